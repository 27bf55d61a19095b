//! One transformer block (a unit of odc): pre-RMSNorm attention and pre-RMSNorm SwiGLU MLP, each
//! with a residual:
//!
//! ```text
//! h   = x + attn(rms_norm(x, attn_norm))
//! out = h + w2(silu(w1 n) * w3 n),  n = rms_norm(h, mlp_norm)
//! ```
//!
//! Its parameters, in this order ([`block_params`]): `layers.{l}.attn_norm.weight [d]`,
//! `layers.{l}.attn.{wq,wk,wv,wo} [d, d]`, `layers.{l}.mlp_norm.weight [d]`, `layers.{l}.mlp.w1
//! [d_ff, d]`, `layers.{l}.mlp.w2 [d, d_ff]`, `layers.{l}.mlp.w3 [d_ff, d]` (linear weights
//! `[out, in]`).

use candle_core::Tensor;

use super::attention::{causal_self_attention, AttentionWeights};
use super::batch::PackedBatch;
use super::config::ModelConfig;
use super::error::{Error, Result};
use super::ops::{rms_norm, silu};
use super::params::{ParamInit, ParamSpec};

/// The parameter list of block `layer`, in the order [`block_forward`] expects.
pub fn block_params(config: &ModelConfig, layer: usize) -> Vec<ParamSpec> {
    let (d, f) = (config.d_model, config.d_ff);
    let p = |name: &str, shape: &[usize], init| {
        ParamSpec::new(format!("layers.{layer}.{name}"), shape, init)
    };
    vec![
        p("attn_norm.weight", &[d], ParamInit::Ones),
        p("attn.wq", &[d, d], ParamInit::Normal),
        p("attn.wk", &[d, d], ParamInit::Normal),
        p("attn.wv", &[d, d], ParamInit::Normal),
        p("attn.wo", &[d, d], ParamInit::Normal),
        p("mlp_norm.weight", &[d], ParamInit::Ones),
        p("mlp.w1", &[f, d], ParamInit::Normal),
        p("mlp.w2", &[d, f], ParamInit::Normal),
        p("mlp.w3", &[f, d], ParamInit::Normal),
    ]
}

/// `x: [T, d_model]` -> `[T, d_model]` with `params` in [`block_params`] order.
pub fn block_forward(
    config: &ModelConfig,
    params: &[Tensor],
    x: &Tensor,
    batch: &PackedBatch,
) -> Result<Tensor> {
    let [attn_norm, wq, wk, wv, wo, mlp_norm, w1, w2, w3] = params else {
        return Err(Error::UnitParams {
            what: "tensors",
            expected: 9,
            got: params.len(),
        });
    };
    let attn = AttentionWeights { wq, wk, wv, wo };
    let n = rms_norm(x, attn_norm, config.rms_eps)?;
    let h = (x + causal_self_attention(&n, attn, config.n_heads, batch)?)?;
    mlp_residual(config, &h, [mlp_norm, w1, w2, w3])
}

/// `h + w2(silu(w1 n) * w3 n)`, `n = rms_norm(h, mlp_norm)`: the block's second half (also used by
/// the cached decoder of [`super::generate`]).
pub(crate) fn mlp_residual(
    config: &ModelConfig,
    h: &Tensor,
    [mlp_norm, w1, w2, w3]: [&Tensor; 4],
) -> Result<Tensor> {
    let n = rms_norm(h, mlp_norm, config.rms_eps)?;
    let gate = silu(&n.matmul(&w1.t()?)?)?;
    let up = n.matmul(&w3.t()?)?;
    Ok((h + (gate * up)?.matmul(&w2.t()?)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::batch::Sample;
    use crate::model::ops::tests::random;
    use crate::model::params::{init_values, unit_tensors};
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
        assert_eq!(names[1], "layers.3.attn.wq");
        assert_eq!(names[6], "layers.3.mlp.w1");
        assert_eq!(specs[7].shape, vec![16, 24]);
        assert_eq!(
            specs.iter().map(ParamSpec::numel).sum::<usize>(),
            2 * 16 + 4 * 256 + 3 * 16 * 24
        );
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
        params[4] = params[4].zeros_like().unwrap(); // wo
        params[7] = params[7].zeros_like().unwrap(); // w2
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
}
