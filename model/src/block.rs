//! One transformer block (a unit of odc): pre-RMSNorm attention and pre-RMSNorm SwiGLU MLP, each
//! with a residual:
//!
//! ```text
//! h   = x + attn(rms_norm(x, input_layernorm))
//! out = h + down(silu(gate n) * up n),  n = rms_norm(h, post_attention_layernorm)
//! ```
//!
//! Its parameters carry their Hugging Face names ([`block_params`]), in this order:
//! `model.layers.{l}.input_layernorm.weight [d]`, `self_attn.q_proj.weight [H·hd, d]`
//! (`.bias [H·hd]` with `qkv_bias`), `self_attn.k_proj.weight [KV·hd, d]` (+ bias),
//! `self_attn.v_proj.weight [KV·hd, d]` (+ bias), `self_attn.o_proj.weight [d, H·hd]`,
//! `self_attn.q_norm.weight [hd]` and `self_attn.k_norm.weight [hd]` (with `qk_norm`),
//! `post_attention_layernorm.weight [d]`, `mlp.gate_proj.weight [f, d]`, `mlp.up_proj.weight
//! [f, d]`, `mlp.down_proj.weight [d, f]` (linear weights `[out, in]`).
//!
//! **One block for everything**: [`block_forward_with`] is the block; training
//! ([`block_forward`], a packed micro-batch) and cached decoding (`super::generate`) differ only
//! in the attention they pass it.

use candle_core::Tensor;

use super::attention::{fused, packed_attend, project, project_tokens, AttentionWeights};
use super::batch::PackedBatch;
use super::config::{AttentionImpl, LoraTarget, MlpImpl, ModelConfig};
use super::error::{Error, Result};
use super::lora::AdapterWeights;
use super::mlp::{chunk_rows, swiglu};
use super::ops::{add_rms_norm, rms_norm, silu};
use super::params::{ParamInit, ParamSpec};

/// The parameter list of block `layer`, in the order [`BlockWeights::new`] reads it.
pub fn block_params(config: &ModelConfig, layer: usize) -> Vec<ParamSpec> {
    let (d, f, hd) = (config.d_model, config.d_ff, config.head_dim());
    let (q, kv) = (config.n_heads * hd, config.kv_heads() * hd);
    let p = |name: &str, shape: &[usize], init| {
        ParamSpec::new(format!("model.layers.{layer}.{name}"), shape, init)
    };
    let mut specs = vec![p("input_layernorm.weight", &[d], ParamInit::Ones)];
    for (proj, out) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
        specs.push(p(
            &format!("self_attn.{proj}.weight"),
            &[out, d],
            ParamInit::Normal,
        ));
        if config.qkv_bias {
            specs.push(p(
                &format!("self_attn.{proj}.bias"),
                &[out],
                ParamInit::Zeros,
            ));
        }
    }
    specs.push(p("self_attn.o_proj.weight", &[d, q], ParamInit::Normal));
    if config.qk_norm {
        specs.push(p("self_attn.q_norm.weight", &[hd], ParamInit::Ones));
        specs.push(p("self_attn.k_norm.weight", &[hd], ParamInit::Ones));
    }
    specs.extend([
        p("post_attention_layernorm.weight", &[d], ParamInit::Ones),
        p("mlp.gate_proj.weight", &[f, d], ParamInit::Normal),
        p("mlp.up_proj.weight", &[f, d], ParamInit::Normal),
        p("mlp.down_proj.weight", &[d, f], ParamInit::Normal),
    ]);
    specs
}

/// A block's tensors by role, read from its parameters in [`block_params`] order (then, under
/// LoRA, its adapter unit's, in [`super::lora::adapter_params`] order).
#[derive(Debug, Clone, Copy)]
pub struct BlockWeights<'a> {
    pub input_norm: &'a Tensor,
    pub attention: AttentionWeights<'a>,
    pub post_norm: &'a Tensor,
    pub gate: &'a Tensor,
    pub up: &'a Tensor,
    pub down: &'a Tensor,
}

impl<'a> BlockWeights<'a> {
    /// `params` in [`block_params`] order; [`Error::UnitParams`] when their count is not the
    /// config's.
    pub fn new(config: &ModelConfig, params: &'a [Tensor]) -> Result<Self> {
        let base = 9 + 3 * usize::from(config.qkv_bias) + 2 * usize::from(config.qk_norm);
        let adapters = config.lora.as_ref().map_or(0, |l| 2 * l.targets.len());
        let expected = base + adapters;
        if params.len() != expected {
            return Err(Error::UnitParams {
                what: "tensors",
                expected,
                got: params.len(),
            });
        }
        let mut it = params.iter();
        let mut next = || {
            it.next().ok_or(Error::UnitParams {
                what: "tensors",
                expected,
                got: params.len(),
            })
        };
        let input_norm = next()?;
        let (wq, bq) = (next()?, if config.qkv_bias { Some(next()?) } else { None });
        let (wk, bk) = (next()?, if config.qkv_bias { Some(next()?) } else { None });
        let (wv, bv) = (next()?, if config.qkv_bias { Some(next()?) } else { None });
        let wo = next()?;
        let qk_norm = if config.qk_norm {
            Some([next()?, next()?])
        } else {
            None
        };
        let bias = match (bq, bk, bv) {
            (Some(q), Some(k), Some(v)) => Some([q, k, v]),
            _ => None,
        };
        let (post_norm, gate, up, down) = (next()?, next()?, next()?, next()?);
        let adapters = match &config.lora {
            Some(lora) => Some(AdapterWeights::new(lora, &params[base..])?),
            None => None,
        };
        Ok(BlockWeights {
            input_norm,
            attention: AttentionWeights {
                wq,
                wk,
                wv,
                wo,
                bias,
                qk_norm,
                adapters,
            },
            post_norm,
            gate,
            up,
            down,
        })
    }
}

/// What a block's attention does with its queries `[rows, n_heads, n, hd]` and the new keys and
/// values `[rows, n_kv_heads, n, hd]`: the attended values `[rows, n_heads, n, hd]`.
pub type Attend<'a> = dyn FnMut(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + 'a;

/// The block on `x: [rows · n, d_model]` with rotary angles `cos, sin: [n, hd / 2]`, its
/// attention done by `attend` and its MLP by `mlp`.
pub fn block_forward_with(
    config: &ModelConfig,
    w: &BlockWeights<'_>,
    x: &Tensor,
    rows: usize,
    (cos, sin): (&Tensor, &Tensor),
    attend: &mut Attend<'_>,
    mlp: MlpImpl,
) -> Result<Tensor> {
    let n = rms_norm(x, w.input_norm, config.rms_eps)?;
    let (q, k, v) = project(config, &w.attention, &n, rows, cos, sin)?;
    let attended = w.attention.output(&attend(&q, &k, &v)?)?;
    mlp_residual(config, w, x, &attended, mlp)
}

/// Training: `x: [T, d_model]` -> `[T, d_model]` over a packed micro-batch, with `params` in
/// [`block_params`] order; the attention and the MLP are the batch's ([`PackedBatch::kernels`]:
/// blocked and chunked unless set).
pub fn block_forward(
    config: &ModelConfig,
    params: &[Tensor],
    x: &Tensor,
    batch: &PackedBatch,
) -> Result<Tensor> {
    block_forward_using(config, params, x, batch, batch.implementations.attention)
}

/// [`block_forward`] with the packed attention `attention` (plain or blocked).
pub fn block_forward_using(
    config: &ModelConfig,
    params: &[Tensor],
    x: &Tensor,
    batch: &PackedBatch,
    attention: AttentionImpl,
) -> Result<Tensor> {
    let w = BlockWeights::new(config, params)?;
    if attention != AttentionImpl::Plain
        && batch.pieces.is_empty()
        && fused::applies_tokens(x, config)
    {
        return block_forward_tokens(config, &w, x, batch);
    }
    let rope = (&batch.rope_cos, &batch.rope_sin);
    let attend =
        &mut |q: &Tensor, k: &Tensor, v: &Tensor| packed_attend(attention, config, q, k, v, batch);
    block_forward_with(config, &w, x, 1, rope, attend, batch.implementations.mlp)
}

/// [`block_forward_using`] where the fused kernels take the attention: q, k and v stay tokens
/// first, as the projections make them and the kernels read them, and so does the attention's
/// output into the output projection (no transpose, no copy either way).
fn block_forward_tokens(
    config: &ModelConfig,
    w: &BlockWeights<'_>,
    x: &Tensor,
    batch: &PackedBatch,
) -> Result<Tensor> {
    let n = rms_norm(x, w.input_norm, config.rms_eps)?;
    let (q, k, v) = project_tokens(config, &w.attention, &n, &batch.rope_cos, &batch.rope_sin)?;
    let attended = fused::packed_attend_tokens(&q, &k, &v, &batch.spans)?;
    let attended = w.attention.output_tokens(&attended)?;
    mlp_residual(config, w, x, &attended, batch.implementations.mlp)
}

/// `h + down(silu(gate n) * up n)` with `h = x + attended` and `n = rms_norm(h,
/// post_attention_layernorm)` (the add and the norm one fused launch where the kernels run:
/// [`add_rms_norm`]): the block's second half, chunked ([`swiglu`]) unless `mlp` says otherwise
/// or LoRA adapts one of the MLP's matrices (then with candle's ops, the adapters added to each
/// projection).
fn mlp_residual(
    config: &ModelConfig,
    w: &BlockWeights<'_>,
    x: &Tensor,
    attended: &Tensor,
    mlp: MlpImpl,
) -> Result<Tensor> {
    let (h, n) = add_rms_norm(x, attended, w.post_norm, config.rms_eps)?;
    let h = &h;
    let adapted = w.attention.adapters.is_some_and(|a| {
        [LoraTarget::Gate, LoraTarget::Up, LoraTarget::Down]
            .iter()
            .any(|t| a.adapts(*t))
    });
    if mlp == MlpImpl::Chunked && !adapted {
        let out = swiglu(&n, w.gate, w.up, w.down, chunk_rows(config.d_ff))?;
        return Ok((h + out)?);
    }
    let linear = |m: &Tensor, target: LoraTarget, x: &Tensor| -> Result<Tensor> {
        let y = x.matmul(&m.t()?)?;
        match &w.attention.adapters {
            Some(adapters) => adapters.add(target, x, y),
            None => Ok(y),
        }
    };
    let gate = silu(&linear(w.gate, LoraTarget::Gate, &n)?)?;
    let up = linear(w.up, LoraTarget::Up, &n)?;
    Ok((h + linear(w.down, LoraTarget::Down, &(gate * up)?)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Sample;
    use crate::params::{init_values, unit_tensors};
    use crate::test_util::random;
    use candle_core::Device;

    fn config() -> ModelConfig {
        ModelConfig {
            vocab_size: 16,
            d_model: 16,
            n_heads: 2,
            d_ff: 24,
            max_seq_len: 16,
            init_std: 0.2,
            ..ModelConfig::tiny()
        }
    }

    fn batch(c: &ModelConfig) -> PackedBatch {
        let samples = [
            Sample::all_loss(vec![1, 2, 3]),
            Sample::all_loss(vec![4, 5]),
        ];
        PackedBatch::pack(c, &samples, &Device::Cpu).unwrap()
    }

    #[test]
    fn block_param_names_and_shapes() {
        let specs = block_params(&config(), 3);
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names[1], "model.layers.3.self_attn.q_proj.weight");
        assert_eq!(names[7], "model.layers.3.mlp.up_proj.weight");
        assert_eq!(specs[8].shape, vec![16, 24]);
        assert_eq!(
            specs.iter().map(ParamSpec::numel).sum::<usize>(),
            2 * 16 + 4 * 256 + 3 * 16 * 24
        );
        // Qwen3-like: GQA, explicit head_dim, q/k norms; Qwen2-like: biases.
        let qwen3 = ModelConfig {
            n_kv_heads: Some(1),
            head_dim: Some(12),
            qk_norm: true,
            ..config()
        };
        let specs = block_params(&qwen3, 0);
        let shape = |name: &str| {
            specs
                .iter()
                .find(|s| s.name == format!("model.layers.0.{name}"))
                .map(|s| s.shape.clone())
        };
        assert_eq!(shape("self_attn.q_proj.weight"), Some(vec![24, 16]));
        assert_eq!(shape("self_attn.k_proj.weight"), Some(vec![12, 16]));
        assert_eq!(shape("self_attn.o_proj.weight"), Some(vec![16, 24]));
        assert_eq!(shape("self_attn.k_norm.weight"), Some(vec![12]));
        assert_eq!(shape("self_attn.q_proj.bias"), None);
        let qwen2 = ModelConfig {
            qkv_bias: true,
            ..qwen3
        };
        let specs = block_params(&qwen2, 0);
        assert_eq!(specs.len(), 14);
        assert!(specs
            .iter()
            .any(|s| s.name == "model.layers.0.self_attn.v_proj.bias"));
    }

    #[test]
    fn block_is_identity_when_output_projections_are_zero() {
        let c = config();
        let specs = block_params(&c, 0);
        let mut params = unit_tensors(
            &init_values(&specs, c.init_std, 1).unwrap(),
            &specs,
            &Device::Cpu,
        )
        .unwrap();
        params[4] = params[4].zeros_like().unwrap(); // o_proj
        params[8] = params[8].zeros_like().unwrap(); // down_proj
        let x = random(&[5, 16], 9);
        let out = block_forward(&c, &params, &x, &batch(&c)).unwrap();
        let diff = (out - &x)
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(diff, 0.0);
    }

    #[test]
    fn block_rejects_a_wrong_parameter_count() {
        let c = config();
        let err = block_forward(&c, &[], &random(&[5, 16], 9), &batch(&c)).unwrap_err();
        assert!(
            matches!(
                err,
                Error::UnitParams {
                    expected: 9,
                    got: 0,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn block_with_blocked_attention_equals_block_with_plain_attention() {
        use crate::config::Blocks;
        use candle_core::Var;
        let c = ModelConfig {
            n_heads: 4,
            n_kv_heads: Some(2),
            ..config()
        };
        let specs = block_params(&c, 0);
        let values = init_values(&specs, c.init_std, 1).unwrap();
        let b = batch(&c);
        let run = |attention: AttentionImpl| {
            let params: Vec<Var> = unit_tensors(&values, &specs, &Device::Cpu)
                .unwrap()
                .iter()
                .map(|t| Var::from_tensor(t).unwrap())
                .collect();
            let x = Var::from_tensor(&random(&[5, 16], 9)).unwrap();
            let tensors: Vec<Tensor> = params.iter().map(|p| p.as_tensor().clone()).collect();
            let out = block_forward_using(&c, &tensors, x.as_tensor(), &b, attention).unwrap();
            let grads = (&out * random(&[5, 16], 10))
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let mut all = vec![out, grads.get(x.as_tensor()).unwrap().clone()];
            all.extend(
                params
                    .iter()
                    .map(|p| grads.get(p.as_tensor()).unwrap().clone()),
            );
            all
        };
        let plain = run(AttentionImpl::Plain);
        let blocked = run(AttentionImpl::Blocked(Blocks { q: 2, k: 1 }));
        for (i, (a, b)) in blocked.iter().zip(&plain).enumerate() {
            let diff = crate::test_util::max_abs_diff(a, b);
            assert!(diff < 1e-5, "tensor {i}: {diff}");
        }
    }
}
