//! The plain attention, the reference of every other: each sample's `[heads, len, len]` scores
//! materialised under its causal mask and differentiated by candle (quadratic memory). Cached
//! decoding attends with [`attend`] too, one new token's scores per step.

use candle_core::{DType, Tensor};

use crate::batch::causal_mask;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::ops::softmax_last_dim;

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

/// Training's attention core, plain: queries `[1, H, T, hd]` and keys and values `[1, KV, T, hd]`
/// of the samples at `spans` (which tile the `T` positions), each sample attending causally
/// within itself only; `[1, H, T, hd]`.
pub fn attend_spans(
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
                &causal_mask(len, q.device())?,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&outs, 2)?)
}
