//! Training's packed attention as one kernel of `odc-kernels` where the fused kernels run
//! ([`crate::ops::fused`]): the same signature and result as
//! [`super::blocked_packed_attend`] (queries `[1, H, T, hd]`, keys and values `[1, KV, T, hd]`,
//! each sample attending causally within itself; `[1, H, T, hd]`).
//!
//! - The kernel is token-major (`[T, H, hd]`): the inputs are transposed into it and the output
//!   back, each a copy on the device.
//! - Its graph node keeps q, k, v, the output, each row's log-sum-exp and the samples' offsets
//!   (O(T · head_dim), as the blocked path); the backward is the kernel's (FlashAttention-2's
//!   recomputation, split as FlashAttention-2 splits it: `dq` per query, `dk` and `dv` per key,
//!   no atomic adds, so a step's gradients are the same bits every run).
//! - Head widths up to [`MAX_ATTENTION_HEAD_DIM`]; a wider head takes the blocked path.
//! - Checked on the CPU through the emulated kernels (`tests/fused_kernels_on_cpu.rs`: a
//!   training job equals candle's ops, fp32 and bf16). **Not yet run on a GPU**:
//!   `tests/gpu_training.rs`'s fused-kernel job and the kernel's own device test
//!   (`kernels/tests/device.rs`) check it where one is.

use candle_core::{CustomOp3, Tensor};

use super::super::ops::fused::{self, Varlen, MAX_ATTENTION_HEAD_DIM};
use super::super::ops::precomputed::{precomputed_forwards, Precomputed};
use super::blocked::Partial;
use crate::error::Result;

/// Whether the fused kernel takes `q` (CUDA, fp32 or bf16, enabled, a head it holds).
pub fn applies(q: &Tensor) -> bool {
    fused::applies(q) && q.dim(3).is_ok_and(|hd| hd <= MAX_ATTENTION_HEAD_DIM)
}

/// Whether a block computing on `x: [T, d_model]` attends by the kernel tokens first
/// ([`packed_attend_tokens`]): the kernels run on `x`'s device and dtype, and hold its heads.
pub fn applies_tokens(x: &Tensor, config: &crate::ModelConfig) -> bool {
    fused::applies(x) && config.head_dim() <= MAX_ATTENTION_HEAD_DIM
}

/// The samples at `spans` (each `(start, len)`, in order, tiling `0..T`) attended by the kernel.
pub fn packed_attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &[(usize, usize)],
) -> Result<Tensor> {
    super::blocked::check_packed(q, k, v, spans)?;
    attend(q, k, v, spans, Layout::HeadsFirst)
}

/// [`packed_attend`] tokens first, the kernel's own layout (no transpose either way): queries
/// `[T, H, hd]`, keys and values `[T, KV, hd]`; `[T, H, hd]`.
pub fn packed_attend_tokens(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &[(usize, usize)],
) -> Result<Tensor> {
    let (t, heads, hd) = q.dims3()?;
    let (tk, kv, _) = k.dims3()?;
    let covered: usize = spans.iter().map(|&(_, len)| len).sum();
    if tk != t || v.dims3()? != (t, kv, hd) || kv == 0 || heads % kv != 0 || covered != t {
        return Err(crate::error::Error::Batch(format!(
            "attention shapes: q {:?}, k {:?}, v {:?}, spans of {covered} tokens",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    attend(q, k, v, spans, Layout::TokensFirst)
}

/// Where the graph's q, k, v and output keep heads and tokens (the kernel's are tokens first).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Layout {
    /// `[1, heads, T, hd]`.
    HeadsFirst,
    /// `[T, heads, hd]`.
    TokensFirst,
}

impl Layout {
    /// `x` (this layout) as the kernel reads it, contiguous `[T, heads, hd]`.
    fn tokens(self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Layout::HeadsFirst => x.get(0)?.transpose(0, 1)?.contiguous(),
            Layout::TokensFirst => x.contiguous(),
        }
    }

    /// The kernel's `[T, heads, hd]` in this layout (a view).
    fn of_tokens(self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Layout::HeadsFirst => x.transpose(0, 1)?.unsqueeze(0),
            Layout::TokensFirst => Ok(x.clone()),
        }
    }
}

/// The kernel on `q, k, v` (in `layout`) as their graph node.
fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &[(usize, usize)],
    layout: Layout,
) -> Result<Tensor> {
    let tokens = |x: &Tensor| layout.tokens(&x.detach());
    let (qt, kt, vt) = (tokens(q)?, tokens(k)?, tokens(&v.to_dtype(k.dtype())?)?);
    let hd = qt.dim(2)?;
    let mut cu = vec![0i64];
    for &(_, len) in spans {
        cu.push(cu.last().copied().unwrap_or(0) + len as i64);
    }
    let cu = Tensor::from_vec(cu, spans.len() + 1, q.device())?;
    let scale = 1.0 / (hd as f32).sqrt();
    let (out, lse) = fused::attention(&qt, &kt, &vt, Varlen::packed(&cu), scale)?;
    let op = FusedAttention {
        cu,
        scale,
        layout,
        // A view in the graph's layout: the op's forward copies it once into its own output.
        out: Precomputed::new("fused attention", layout.of_tokens(&out)?),
        out_tokens: out,
        lse,
    };
    Ok(q.apply_op3(k, v, op)?)
}

/// The graph node of [`packed_attend`] and [`packed_attend_tokens`]: its forward hands candle
/// the kernel's output, its backward is the kernel's.
struct FusedAttention {
    /// i64 `[samples + 1]`: the samples' offsets.
    cu: Tensor,
    scale: f32,
    /// The graph's q, k, v and output layout.
    layout: Layout,
    /// The output in `layout`, taken (and copied) by the forward.
    out: Precomputed,
    /// The same output tokens first, `[T, H, hd]`, for the backward.
    out_tokens: Tensor,
    /// fp32 `[T, H]`.
    lse: Tensor,
}

impl CustomOp3 for FusedAttention {
    fn name(&self) -> &'static str {
        "fused-causal-attention"
    }

    precomputed_forwards!(3);

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad_out: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dtype = q.dtype();
        let tokens = |x: &Tensor| self.layout.tokens(&x.detach().to_dtype(dtype)?);
        let (dq, dk, dv) = fused::attention_backward(
            &tokens(q)?,
            &tokens(k)?,
            &tokens(v)?,
            &self.out_tokens,
            &tokens(grad_out)?,
            &self.lse,
            Varlen::packed(&self.cu),
            self.scale,
        )?;
        let back = |x: &Tensor, like: &Tensor| self.layout.of_tokens(&x.to_dtype(like.dtype())?);
        Ok((
            Some(back(&dq, q)?),
            Some(back(&dk, k)?),
            Some(back(&dv, v)?),
        ))
    }
}

/// Ring attention's pair of queries `q: [H, n, hd]` at positions `q_pos..` and `m` keys at
/// `k_pos..` of one sample, as the kernel takes it: one sample's offsets `[0, n]`, `[0, m]` and
/// whether it is causal — the same range (causal) or an earlier one, wholly seen (not causal).
/// `None` for other overlaps, or where the kernels do not run: the blocked path takes those.
struct Pair {
    cu_q: Tensor,
    cu_k: Tensor,
    causal: bool,
    scale: f32,
}

impl Pair {
    fn of(q: &Tensor, q_pos: usize, k: &Tensor, k_pos: usize) -> Result<Option<Pair>> {
        let ((_, n, hd), m) = (q.dims3()?, k.dim(1)?);
        let causal = match (q_pos == k_pos && n == m, k_pos + m <= q_pos) {
            (true, _) => true,
            (false, true) => false,
            _ => return Ok(None),
        };
        if !(fused::applies(q) && hd <= MAX_ATTENTION_HEAD_DIM) {
            return Ok(None);
        }
        let offsets = |len: usize| Tensor::from_vec(vec![0i64, len as i64], 2, q.device());
        Ok(Some(Pair {
            cu_q: offsets(n)?,
            cu_k: offsets(m)?,
            causal,
            scale: 1.0 / (hd as f32).sqrt(),
        }))
    }

    fn varlen(&self) -> Varlen<'_> {
        Varlen {
            cu_q: &self.cu_q,
            cu_k: &self.cu_k,
            causal: self.causal,
        }
    }
}

/// Ring attention's partial ([`super::blocked::attend_partial`]'s arguments and result: queries
/// `q: [H, n, hd]` at `q_pos..` against `k, v: [KV, m, hd]` at `k_pos..`; fp32 output and
/// log-sum-exp) by the kernel, where it takes the pair ([`Pair`]); `None` otherwise.
pub fn partial(
    q: &Tensor,
    q_pos: usize,
    k: &Tensor,
    v: &Tensor,
    k_pos: usize,
) -> Result<Option<Partial>> {
    let Some(pair) = Pair::of(q, q_pos, k, k_pos)? else {
        return Ok(None);
    };
    let dtype = q.dtype();
    let (qt, kt, vt) = (
        tokens(q)?,
        tokens(&k.to_dtype(dtype)?)?,
        tokens(&v.to_dtype(dtype)?)?,
    );
    let (out, lse) = fused::attention(&qt, &kt, &vt, pair.varlen(), pair.scale)?;
    Ok(Some(Partial {
        out: heads_first(&out)?.to_dtype(candle_core::DType::F32)?,
        lse: lse.t()?.contiguous()?,
    }))
}

/// [`super::blocked::attend_partial_backward`] by the kernel where [`partial`] takes the pair:
/// fp32 `(dq [H, n, hd], dk [KV, m, hd], dv [KV, m, hd])`, this pair's share given the merged
/// rows' `lse` and `dd` (fp32 `[H, n]`); `None` otherwise.
#[allow(clippy::too_many_arguments)]
pub fn partial_backward(
    q: &Tensor,
    q_pos: usize,
    k: &Tensor,
    v: &Tensor,
    k_pos: usize,
    d_o: &Tensor,
    lse: &Tensor,
    dd: &Tensor,
) -> Result<Option<(Tensor, Tensor, Tensor)>> {
    let Some(pair) = Pair::of(q, q_pos, k, k_pos)? else {
        return Ok(None);
    };
    let dtype = q.dtype();
    let (dq, dk, dv) = fused::attention_backward_from(
        &tokens(q)?,
        &tokens(&k.to_dtype(dtype)?)?,
        &tokens(&v.to_dtype(dtype)?)?,
        &tokens(&d_o.to_dtype(dtype)?)?,
        &lse.t()?.contiguous()?,
        &dd.t()?.contiguous()?,
        pair.varlen(),
        pair.scale,
    )?;
    let f32 = candle_core::DType::F32;
    Ok(Some((
        heads_first(&dq)?.to_dtype(f32)?,
        heads_first(&dk)?,
        heads_first(&dv)?,
    )))
}

/// `[H, n, hd]` → contiguous `[n, H, hd]`.
fn tokens(x: &Tensor) -> candle_core::Result<Tensor> {
    x.transpose(0, 1)?.contiguous()
}

/// `[n, H, hd]` → contiguous `[H, n, hd]`.
fn heads_first(x: &Tensor) -> candle_core::Result<Tensor> {
    x.transpose(0, 1)?.contiguous()
}
