//! A block's attention projections: q, k and v from the hidden states (biases, q/k norms, rotary
//! angles, LoRA adapters applied) and the output projection of the attended heads. Training and
//! cached decoding share them.

use candle_core::Tensor;

use crate::config::{LoraTarget, ModelConfig};
use crate::error::{Error, Result};
use crate::lora::AdapterWeights;
use crate::ops::{linear, rms_norm, rope, rope_tokens};

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
    let [q, k, v] = w
        .projections(config, x, (rows, n))?
        .map(|y| Ok::<_, Error>(y.transpose(1, 2)?.contiguous()?));
    Ok((rope(&q?, cos, sin)?, rope(&k?, cos, sin)?, v?))
}

/// [`project`] of one packed row, tokens first (the projections' own layout, no transpose):
/// queries `[T, n_heads, head_dim]`, keys and values `[T, n_kv_heads, head_dim]`.
pub fn project_tokens(
    config: &ModelConfig,
    w: &AttentionWeights<'_>,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (tokens, _) = x.dims2()?;
    let [q, k, v] = w
        .projections(config, x, (1, tokens))?
        .map(|y| Ok::<_, Error>(y.squeeze(0)?));
    Ok((rope_tokens(&q?, cos, sin)?, rope_tokens(&k?, cos, sin)?, v?))
}

impl AttentionWeights<'_> {
    /// q, k and v of `x: [rows · n, d_model]` as `[rows, n, heads, head_dim]` (biases, LoRA
    /// adapters and q/k norms applied; no rotary angles yet).
    fn projections(
        &self,
        config: &ModelConfig,
        x: &Tensor,
        (rows, n): (usize, usize),
    ) -> Result<[Tensor; 3]> {
        let hd = config.head_dim();
        let heads = |m: &Tensor,
                     target: LoraTarget,
                     bias: Option<&Tensor>,
                     count: usize,
                     norm: Option<&Tensor>| {
            let bias = bias.map(|b| b.to_dtype(x.dtype())).transpose()?;
            let y = self.adapt(target, x, linear(x, m, bias.as_ref())?)?;
            let mut y = y.reshape((rows, n, count, hd))?;
            if let Some(weight) = norm {
                y = rms_norm(&y, weight, config.rms_eps)?;
            }
            Ok::<_, Error>(y)
        };
        let (bq, bk, bv) = match self.bias {
            Some([q, k, v]) => (Some(q), Some(k), Some(v)),
            None => (None, None, None),
        };
        let (nq, nk) = match self.qk_norm {
            Some([q, k]) => (Some(q), Some(k)),
            None => (None, None),
        };
        Ok([
            heads(self.wq, LoraTarget::Q, bq, config.n_heads, nq)?,
            heads(self.wk, LoraTarget::K, bk, config.kv_heads(), nk)?,
            heads(self.wv, LoraTarget::V, bv, config.kv_heads(), None)?,
        ])
    }

    /// [`Self::output`] of tokens first: `[T, n_heads, head_dim]` -> `[T, d_model]` (a view, no
    /// copy, before the projection).
    pub fn output_tokens(&self, attended: &Tensor) -> Result<Tensor> {
        let (tokens, heads, hd) = attended.dims3()?;
        let x = attended.reshape((tokens, heads * hd))?;
        self.adapt(LoraTarget::O, &x, linear(&x, self.wo, None)?)
    }

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
