//! Causal self-attention of one block, shared by training over a **packed** micro-batch and by
//! cached decoding ([`mod@super::generate`]): the projections ([`project`]) and the output
//! ([`AttentionWeights::output`]) are the same code; only what the queries attend to differs.
//!
//! Layout: hidden states are `[rows · n, d_model]` (a packed micro-batch is one row of `T`
//! tokens; decoding feeds `rows` sequences of `n` new tokens each); heads are
//! `[rows, heads, n, head_dim]`.
//!
//! Guarantees:
//! 1. Token `i` attends to token `j` iff `segments[i] == segments[j]` and `j <= i` (block-diagonal
//!    causal, via the batch's additive mask): no information crosses samples.
//! 2. Rotary angles come from `positions` (0 at each sample's start), so a sample's output does not
//!    depend on what is packed before it.
//! 3. Every op is differentiable (see [`super::ops`]); the mask is finite, so no row produces NaN
//!    (each row allows at least its diagonal).
//! 4. **Grouped-query attention**: key/value head `g` serves query heads
//!    `g · n_heads / n_kv_heads ..` (consecutive groups, as `transformers`' `repeat_kv`); with as
//!    many KV heads as query heads it is multi-head attention.
//! 5. The Hugging Face layouts' options: q/k/v biases (Qwen2) are added after the projections;
//!    q/k RMSNorm (Qwen3) normalises each head over `head_dim` before the rotary embedding.
//! 6. Memory: training's attention is blocked unless the batch says otherwise
//!    ([`super::flash`], [`PackedBatch::kernels`]): per layer the graph keeps q, k, v, the output
//!    and each row's log-sum-exp (O(T · head_dim)), and a step holds one
//!    `[heads, Blocks::q, Blocks::k]` tile, so memory grows linearly with the longest sample. The
//!    plain path ([`packed_attend`], the reference) materialises each sample's `[heads, len, len]`
//!    scores and its graph keeps them until the backward: about 26 bytes per head per (query,
//!    key) pair under bf16 mixed precision (24 in fp32). Cached decoding
//!    ([`mod@super::generate`]) keeps its own attention: one new token's scores per step.

use candle_core::{DType, Tensor};

use super::batch::PackedBatch;
use super::config::ModelConfig;
use super::error::Result;
use super::lora::{AdapterWeights, LoraTarget};
use super::ops::{linear, rms_norm, rope, softmax_last_dim};

/// One attention layer's parameters (linear weights `[out, in]`).
#[derive(Debug, Clone, Copy)]
pub struct AttentionWeights<'a> {
    /// Query projection `[n_heads · head_dim, d_model]`.
    pub wq: &'a Tensor,
    /// Key projection `[n_kv_heads · head_dim, d_model]`.
    pub wk: &'a Tensor,
    /// Value projection `[n_kv_heads · head_dim, d_model]`.
    pub wv: &'a Tensor,
    /// Output projection `[d_model, n_heads · head_dim]`.
    pub wo: &'a Tensor,
    /// Projection biases (Qwen2): query, key, value.
    pub bias: Option<[&'a Tensor; 3]>,
    /// Per-head RMSNorm weights `[head_dim]` (Qwen3): query, key.
    pub qk_norm: Option<[&'a Tensor; 2]>,
    /// The block's LoRA adapters (on these projections and the MLP's).
    pub adapters: Option<AdapterWeights<'a>>,
}

/// Queries `[rows, n_heads, n, head_dim]` and keys and values `[rows, n_kv_heads, n, head_dim]`
/// of `x: [rows · n, d_model]`, rotary angles `cos, sin: [n, head_dim / 2]` applied.
pub fn project(
    config: &ModelConfig,
    w: &AttentionWeights<'_>,
    x: &Tensor,
    rows: usize,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (tokens, _) = x.dims2()?;
    let n = tokens / rows.max(1);
    let hd = config.head_dim();
    let heads = |m: &Tensor,
                 target: LoraTarget,
                 bias: Option<&Tensor>,
                 count: usize,
                 norm: Option<&Tensor>| {
        let bias = bias.map(|b| b.to_dtype(x.dtype())).transpose()?;
        let y = w.adapt(target, x, linear(x, m, bias.as_ref())?)?;
        let mut y = y.reshape((rows, n, count, hd))?;
        if let Some(weight) = norm {
            y = rms_norm(&y, weight, config.rms_eps)?;
        }
        Ok::<_, super::Error>(y.transpose(1, 2)?.contiguous()?)
    };
    let (bq, bk, bv) = match w.bias {
        Some([q, k, v]) => (Some(q), Some(k), Some(v)),
        None => (None, None, None),
    };
    let (nq, nk) = match w.qk_norm {
        Some([q, k]) => (Some(q), Some(k)),
        None => (None, None),
    };
    let q = rope(
        &heads(w.wq, LoraTarget::Q, bq, config.n_heads, nq)?,
        cos,
        sin,
    )?;
    let k = rope(
        &heads(w.wk, LoraTarget::K, bk, config.kv_heads(), nk)?,
        cos,
        sin,
    )?;
    let v = heads(w.wv, LoraTarget::V, bv, config.kv_heads(), None)?;
    Ok((q, k, v))
}

impl AttentionWeights<'_> {
    /// `[rows, n_heads, n, head_dim]` -> `[rows · n, d_model]`: the heads concatenated and
    /// projected.
    pub fn output(&self, attended: &Tensor) -> Result<Tensor> {
        let (rows, heads, n, hd) = attended.dims4()?;
        let x = attended
            .transpose(1, 2)?
            .contiguous()?
            .reshape((rows * n, heads * hd))?;
        self.adapt(LoraTarget::O, &x, linear(&x, self.wo, None)?)
    }

    /// `y` plus `target`'s LoRA update of `x` (when the block has adapters on it).
    fn adapt(&self, target: LoraTarget, x: &Tensor, y: Tensor) -> Result<Tensor> {
        match &self.adapters {
            Some(adapters) => adapters.add(target, x, y),
            None => Ok(y),
        }
    }
}

/// `[rows, kv_heads, n, hd]` -> `[rows, kv_heads · groups, n, hd]`, each KV head repeated for its
/// `groups` consecutive query heads (the identity when `groups == 1`).
pub fn repeat_kv(x: &Tensor, groups: usize) -> Result<Tensor> {
    if groups == 1 {
        return Ok(x.clone());
    }
    let (rows, kv, n, hd) = x.dims4()?;
    Ok(x.unsqueeze(2)?
        .broadcast_as((rows, kv, groups, n, hd))?
        .contiguous()?
        .reshape((rows, kv * groups, n, hd))?)
}

/// `softmax(scale · q kᵀ + mask) v` with `q: [rows, H, n, hd]`, `k, v: [rows, H, m, hd]` and an
/// additive `mask` broadcast to `[rows, H, n, m]`; scores in the activations' dtype (a bf16
/// matmul under mixed precision), the mask and the softmax in fp32, the probabilities back in
/// the values' dtype.
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let scale = 1.0 / (q.dim(3)? as f64).sqrt();
    let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?
        .to_dtype(DType::F32)?
        .broadcast_add(mask)?;
    Ok(softmax_last_dim(&scores)?.to_dtype(v.dtype())?.matmul(v)?)
}

/// Training's attention core: queries `[1, H, T, hd]` and keys and values `[1, KV, T, hd]` of
/// a packed micro-batch, each sample attending causally within itself only; `[1, H, T, hd]`.
pub fn packed_attend(
    config: &ModelConfig,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: &PackedBatch,
) -> Result<Tensor> {
    attend_spans(config, q, k, v, &batch.spans)
}

/// [`packed_attend`] of the samples at `spans` (which tile `q`'s `T` positions).
pub(super) fn attend_spans(
    config: &ModelConfig,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &[(usize, usize)],
) -> Result<Tensor> {
    let groups = config.n_heads / config.kv_heads();
    let (k, v) = (repeat_kv(k, groups)?, repeat_kv(v, groups)?);
    let outs = spans
        .iter()
        .map(|&(start, len)| {
            attend(
                &q.narrow(2, start, len)?,
                &k.narrow(2, start, len)?,
                &v.narrow(2, start, len)?,
                &super::batch::causal_mask(len, q.device())?,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&outs, 2)?)
}

/// Training's attention layer over the packed micro-batch `x: [T, d_model]`: [`project`], the
/// batch's packed attention ([`PackedBatch::kernels`]: blocked unless set),
/// [`AttentionWeights::output`]; `[T, d_model]`.
pub fn causal_self_attention(
    config: &ModelConfig,
    x: &Tensor,
    w: &AttentionWeights<'_>,
    batch: &PackedBatch,
) -> Result<Tensor> {
    let (q, k, v) = project(config, w, x, 1, &batch.rope_cos, &batch.rope_sin)?;
    w.output(
        &batch
            .kernels
            .attention
            .packed_attend(config, &q, &k, &v, batch)?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::batch::Sample;
    use crate::model::ops::tests::{max_abs_diff, random};
    use crate::model::ModelConfig;
    use candle_core::Device;

    /// 4 query heads of 4 over 2 KV heads, width 16.
    fn config() -> ModelConfig {
        ModelConfig {
            vocab_size: 16,
            d_model: 16,
            n_heads: 4,
            n_kv_heads: Some(2),
            max_seq_len: 16,
            ..ModelConfig::tiny()
        }
    }

    /// wq, wk, wv, wo for `c`.
    fn weights(c: &ModelConfig) -> Vec<Tensor> {
        let (d, q, kv) = (
            c.d_model,
            c.n_heads * c.head_dim(),
            c.kv_heads() * c.head_dim(),
        );
        [[q, d], [kv, d], [kv, d], [d, q]]
            .iter()
            .enumerate()
            .map(|(i, shape)| (random(shape, 100 + i as u64) * 0.3).unwrap())
            .collect()
    }

    fn aw(w: &[Tensor]) -> AttentionWeights<'_> {
        AttentionWeights {
            wq: &w[0],
            wk: &w[1],
            wv: &w[2],
            wo: &w[3],
            bias: None,
            qk_norm: None,
            adapters: None,
        }
    }

    fn pack(c: &ModelConfig, lens: &[usize]) -> PackedBatch {
        let samples: Vec<Sample> = lens
            .iter()
            .map(|&n| Sample::all_loss((0..n as u32).collect()))
            .collect();
        PackedBatch::pack(c, &samples, &Device::Cpu).unwrap()
    }

    #[test]
    fn attention_does_not_cross_samples_and_positions_reset() {
        let c = config();
        let w = weights(&c);
        // Sample A (5 tokens) alone, and packed after sample B (3 tokens).
        let xa = random(&[5, 16], 1);
        let xb = random(&[3, 16], 2);
        let alone = causal_self_attention(&c, &xa, &aw(&w), &pack(&c, &[5])).unwrap();
        let packed_x = Tensor::cat(&[&xb, &xa], 0).unwrap();
        let packed = causal_self_attention(&c, &packed_x, &aw(&w), &pack(&c, &[3, 5])).unwrap();
        assert!(max_abs_diff(&alone, &packed.narrow(0, 3, 5).unwrap()) < 1e-5);
        // A different sample B changes nothing for A.
        let other_x = Tensor::cat(&[&random(&[3, 16], 3), &xa], 0).unwrap();
        let other = causal_self_attention(&c, &other_x, &aw(&w), &pack(&c, &[3, 5])).unwrap();
        assert!(
            max_abs_diff(
                &packed.narrow(0, 3, 5).unwrap(),
                &other.narrow(0, 3, 5).unwrap()
            ) < 1e-5
        );
    }

    #[test]
    fn grouped_query_attention_is_multi_head_with_repeated_kv_heads() {
        let gqa = config();
        let w = weights(&gqa);
        // The same layer as multi-head attention: KV head g's rows repeated for query heads
        // 2g and 2g + 1.
        let mha = ModelConfig {
            n_kv_heads: None,
            ..gqa.clone()
        };
        let hd = gqa.head_dim();
        let repeat = |m: &Tensor| {
            let heads: Vec<Tensor> = (0..gqa.kv_heads())
                .flat_map(|g| {
                    let rows = m.narrow(0, g * hd, hd).unwrap();
                    [rows.clone(), rows]
                })
                .collect();
            Tensor::cat(&heads, 0).unwrap()
        };
        let wide = [w[0].clone(), repeat(&w[1]), repeat(&w[2]), w[3].clone()];
        let x = random(&[7, 16], 4);
        let b = pack(&gqa, &[3, 4]);
        let grouped = causal_self_attention(&gqa, &x, &aw(&w), &b).unwrap();
        let multi = causal_self_attention(&mha, &x, &aw(&wide), &b).unwrap();
        assert!(max_abs_diff(&grouped, &multi) < 1e-5);
    }

    #[test]
    fn attention_is_finite_on_large_inputs_and_later_tokens_do_not_matter() {
        let c = config();
        let w = weights(&c);
        let x = (random(&[7, 16], 4) * 50.0).unwrap();
        let b = pack(&c, &[1, 4, 2]);
        let out = causal_self_attention(&c, &x, &aw(&w), &b).unwrap();
        assert!(out
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|v| v.is_finite()));
        // Changing the last token of the middle sample leaves its earlier tokens alone.
        let mut rows: Vec<Vec<f32>> = x.to_vec2().unwrap();
        rows[4] = vec![3.0; 16];
        let changed = Tensor::new(rows, &Device::Cpu).unwrap();
        let out2 = causal_self_attention(&c, &changed, &aw(&w), &b).unwrap();
        assert!(
            max_abs_diff(
                &out.narrow(0, 0, 4).unwrap(),
                &out2.narrow(0, 0, 4).unwrap()
            ) < 1e-5
        );
        assert!(
            max_abs_diff(
                &out.narrow(0, 5, 2).unwrap(),
                &out2.narrow(0, 5, 2).unwrap()
            ) < 1e-5
        );
        assert!(
            max_abs_diff(
                &out.narrow(0, 4, 1).unwrap(),
                &out2.narrow(0, 4, 1).unwrap()
            ) > 1e-3
        );
    }
}
