//! Blocked causal attention — the FlashAttention-2 algorithm written with candle tensor ops (no
//! hand kernels), so it runs wherever candle does (CPU, CUDA) and keeps memory linear in the
//! sample's length.
//!
//! [`flash_packed_attend`] is [`super::plain::attend_spans`] without the `[H, len, len]`
//! scores: each sample's queries are taken [`Blocks::q`] rows at a time against its keys
//! [`Blocks::k`] at a time, up to the diagonal. Each (query block, key block) tile gives a
//! [`Partial`] — the tile's softmax-normalised output and per-row log-sum-exp — and the partials of
//! a query block are folded with [`merge`] (the online softmax). The backward recomputes each
//! tile's probabilities from the saved log-sum-exp (`p = exp(s − lse)`), so neither pass keeps
//! more than one tile's temporaries alive.
//!
//! **How it meets candle's autograd.** The forward runs outside the graph on detached tensors; a
//! [`CustomOp3`] on (q, k, v) hands its precomputed output to candle (`cpu_fwd`/`cuda_fwd` copy
//! it) so that the graph records one node whose `bwd` is the blocked backward. The graph thus
//! keeps q, k, v, the output and the `[H, T]` log-sum-exp: O(T · head_dim) per layer.
//!
//! Guarantees (each has a test named after it):
//! 1. **Same attention as the plain path**: the output and the gradients of q, k and v equal
//!    [`super::plain::attend`]'s with each sample's causal mask (within 1e-5 in fp32, bf16
//!    rounding in bf16), for any sample lengths, packings, GQA ratios and block sizes — blocks
//!    smaller than, larger than or not dividing a sample included.
//! 2. **Causal within a sample, nothing across samples**: query `i` of a sample sees its keys
//!    `j <= i` only; a sample's output and gradients do not depend on what is packed with it.
//! 3. **Merge rule**: attending to keys `A ∪ B` is [`merge`] of attending to `A` and to `B`
//!    ([`attend_partial`] over any key range at its positions); so is the forward itself, over key
//!    blocks. A row with no visible key in a range has log-sum-exp ≈ [`MASKED`]: weight 0 in any
//!    merge with a range where it has one.
//! 4. **Grouped-query attention** inside the op: query heads `g · G .. (g + 1) · G` use KV head
//!    `g` (`G = H / KV`, as [`super::plain::repeat_kv`]); KV heads are never repeated, and
//!    their gradients sum over their group.
//! 5. **Mixed precision** as the plain path: matmuls in the inputs' dtype (bf16 under
//!    [`crate::ComputePrecision::Bf16`]), masks, softmax statistics and accumulators in fp32, the
//!    output in the values' dtype, each gradient in its input's dtype.
//! 6. **Memory**: besides O(T · head_dim) buffers, a step holds one `[H, Blocks::q, Blocks::k]`
//!    tile's few fp32 temporaries (the mask, scores, probabilities and their gradient).

use candle_core::{CustomOp3, DType, Tensor, D};

use crate::batch::{PackedBatch, MASKED};
use crate::config::{Blocks, ModelConfig};
use crate::error::{Error, Result};
use crate::ops::precomputed::{precomputed_forwards, Precomputed};

/// Attention of some queries to a range of keys: `out` the softmax-weighted values normalised
/// over that range (fp32, `[.., n, head_dim]`) and `lse` each row's log-sum-exp of its scaled
/// scores (fp32, `[.., n]`). [`merge`] combines the partials of disjoint key ranges.
#[derive(Debug, Clone)]
pub struct Partial {
    /// fp32 `[heads, n, head_dim]`, normalised over the partial's keys.
    pub out: Tensor,
    /// fp32 `[heads, n]`: `ln Σ exp(scale · q · k)` over the partial's visible keys.
    pub lse: Tensor,
}

impl Partial {
    /// The partial of no key at all (`out` 0, `lse` [`MASKED`]): the identity of [`merge`] for
    /// rows that have a key elsewhere.
    pub fn empty(
        heads: usize,
        n: usize,
        head_dim: usize,
        device: &candle_core::Device,
    ) -> Result<Self> {
        Ok(Partial {
            out: Tensor::zeros((heads, n, head_dim), DType::F32, device)?,
            lse: Tensor::full(MASKED, (heads, n), device)?,
        })
    }
}

/// The attention of the same queries to the keys of `a` and of `b` together:
/// `lse = logaddexp(lse_a, lse_b)`, `out = out_a · exp(lse_a − lse) + out_b · exp(lse_b − lse)`.
/// Works on any leading shape (`out` has one more dimension than `lse`).
pub fn merge(a: &Partial, b: &Partial) -> Result<Partial> {
    Ok(merge_partials(a, b)?)
}

fn merge_partials(a: &Partial, b: &Partial) -> candle_core::Result<Partial> {
    let max = a.lse.maximum(&b.lse)?;
    let wa = (&a.lse - &max)?.exp()?;
    let wb = (&b.lse - &max)?.exp()?;
    let sum = (&wa + &wb)?;
    let lse = (max + sum.log()?)?;
    let wa = (wa / &sum)?.unsqueeze(D::Minus1)?;
    let wb = (wb / &sum)?.unsqueeze(D::Minus1)?;
    let out = (a.out.broadcast_mul(&wa)? + b.out.broadcast_mul(&wb)?)?;
    Ok(Partial { out, lse })
}

/// The partial of queries `q: [H, n, head_dim]` at positions `q_pos..q_pos + n` of a sample
/// against keys and values `k, v: [KV, m, head_dim]` at positions `k_pos..k_pos + m` of the same
/// sample, causally (query at `i` sees key at `j` iff `j <= i`): what a caller holding only part
/// of a sample's keys contributes; [`merge`] the partials of all ranges for the attention.
/// `H` is a multiple of `KV` (grouped-query); queries run [`Blocks::q`] rows at a time, keys
/// [`Blocks::k`] at a time.
pub fn attend_partial(
    q: &Tensor,
    q_pos: usize,
    k: &Tensor,
    v: &Tensor,
    k_pos: usize,
    blocks: Blocks,
) -> Result<Partial> {
    let (heads, n, hd) = q.dims3()?;
    let (kv, m, _) = k.dims3()?;
    if kv == 0 || heads % kv != 0 || v.dims3()? != (kv, m, hd) || k.dim(2)? != hd {
        return Err(Error::Batch(format!(
            "attention shapes: q {:?}, k {:?}, v {:?} (query heads a multiple of KV heads)",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    if n == 0 {
        return Partial::empty(heads, 0, hd, q.device());
    }
    let scale = 1.0 / (hd as f64).sqrt();
    let (bq, bk) = (blocks.q.clamp(1, n), blocks.k.clamp(1, m.max(1)));
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for qs in (0..n).step_by(bq) {
        let rows = bq.min(n - qs);
        let qg = group(&q.narrow(1, qs, rows)?, kv)?;
        let part = match span_partial(&qg, q_pos + qs, rows, k, v, k_pos, bk, scale)? {
            Some(p) => ungroup(&p, heads)?,
            None => Partial::empty(heads, rows, hd, q.device())?,
        };
        outs.push(part.out);
        lses.push(part.lse);
    }
    Ok(Partial {
        out: Tensor::cat(&outs, 1)?,
        lse: Tensor::cat(&lses, 1)?,
    })
}

/// `[H, n, hd]` -> `[KV, G · n, hd]` (contiguous): query head `g · G + i` is row block `i` of
/// group `g`.
fn group(x: &Tensor, kv: usize) -> candle_core::Result<Tensor> {
    let (heads, n, hd) = x.dims3()?;
    x.contiguous()?.reshape((kv, heads / kv * n, hd))
}

/// A grouped partial (`[KV, G · n, ..]`) in head layout (`[H, n, ..]`).
fn ungroup(p: &Partial, heads: usize) -> candle_core::Result<Partial> {
    let (kv, gn, hd) = p.out.dims3()?;
    let n = gn * kv / heads;
    Ok(Partial {
        out: p.out.reshape((heads, n, hd))?,
        lse: p.lse.reshape((heads, n))?,
    })
}

/// The additive causal mask `[n, m]` (fp32) of queries at `q_pos..` against keys at `k_pos..`:
/// 0 where the key is not after the query, [`MASKED`] where it is.
fn causal_tile(
    q_pos: usize,
    n: usize,
    k_pos: usize,
    m: usize,
    device: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    let position = |p: usize| {
        u32::try_from(p).map_err(|_| candle_core::Error::Msg(format!("position {p} past u32")))
    };
    let query = Tensor::arange(position(q_pos)?, position(q_pos + n)?, device)?.reshape((n, 1))?;
    let key = Tensor::arange(position(k_pos)?, position(k_pos + m)?, device)?.reshape((1, m))?;
    key.broadcast_gt(&query)?.to_dtype(DType::F32)? * f64::from(MASKED)
}

/// Scaled scores (fp32 `[KV, G · n, m]`) of grouped queries `qg: [KV, G · n, hd]` at positions
/// `q_pos..q_pos + n` against keys `k: [KV, m, hd]` at `k_pos..`; masked only when the tile
/// crosses the diagonal. The matmul runs in the inputs' dtype.
fn scores(
    qg: &Tensor,
    q_pos: usize,
    n: usize,
    k: &Tensor,
    k_pos: usize,
    scale: f64,
) -> candle_core::Result<Tensor> {
    let s = (qg.matmul(&k.t()?)?.to_dtype(DType::F32)? * scale)?;
    let m = k.dim(1)?;
    if k_pos + m <= q_pos + 1 {
        return Ok(s);
    }
    let (kv, gn, _) = s.dims3()?;
    let mask = causal_tile(q_pos, n, k_pos, m, qg.device())?;
    s.reshape((kv, gn / n, n, m))?
        .broadcast_add(&mask)?
        .reshape((kv, gn, m))
}

/// The partial of grouped queries against one key tile (grouped shapes: `out [KV, G · n, hd]`,
/// `lse [KV, G · n]`).
fn tile_partial(
    qg: &Tensor,
    q_pos: usize,
    n: usize,
    k: &Tensor,
    v: &Tensor,
    k_pos: usize,
    scale: f64,
) -> candle_core::Result<Partial> {
    let s = scores(qg, q_pos, n, k, k_pos, scale)?;
    let max = s.max_keepdim(D::Minus1)?;
    let p = s.broadcast_sub(&max)?.exp()?;
    let l = p.sum_keepdim(D::Minus1)?;
    let out = p
        .to_dtype(v.dtype())?
        .matmul(v)?
        .to_dtype(DType::F32)?
        .broadcast_div(&l)?;
    let lse = (max + l.log()?)?.squeeze(D::Minus1)?;
    Ok(Partial { out, lse })
}

/// Grouped queries (`n` rows per head at `q_pos..`) against keys at `k_pos..`, `bk` keys per
/// tile, the tiles' partials merged; keys after the last query are skipped. `None` when every
/// key is after every query.
#[allow(clippy::too_many_arguments)]
fn span_partial(
    qg: &Tensor,
    q_pos: usize,
    n: usize,
    k: &Tensor,
    v: &Tensor,
    k_pos: usize,
    bk: usize,
    scale: f64,
) -> candle_core::Result<Option<Partial>> {
    let end = (k_pos + k.dim(1)?).min(q_pos + n);
    let mut acc: Option<Partial> = None;
    let mut ks = k_pos;
    while ks < end {
        let m = bk.min(end - ks);
        let (kt, vt) = (k.narrow(1, ks - k_pos, m)?, v.narrow(1, ks - k_pos, m)?);
        let tile = tile_partial(qg, q_pos, n, &kt, &vt, ks, scale)?;
        acc = Some(match acc {
            None => tile,
            Some(a) => merge_partials(&a, &tile)?,
        });
        ks += m;
    }
    Ok(acc)
}

/// The gradients of [`attend_partial`]'s queries `q: [H, n, hd]` at `q_pos..` against keys and
/// values `k, v: [KV, m, hd]` at `k_pos..`, given the output's gradient `d_o: [H, n, hd]`, each
/// row's log-sum-exp over **all** the keys it attends to (`lse`, fp32 `[H, n]`, the merged
/// partials') and `dd = rowsum(dO ⊙ O)` (fp32 `[H, n]`, of the merged output): fp32
/// `(dq [H, n, hd], dk [KV, m, hd], dv [KV, m, hd])`, this key range's share. Summing the shares
/// of every key range gives the attention's gradients (FlashAttention-2: per tile
/// `p = exp(s − lse)`, `dV += pᵀ dO`, `dS = p ⊙ (dO Vᵀ − D)`, `dQ += dS K · scale`,
/// `dK += dSᵀ Q · scale`).
#[allow(clippy::too_many_arguments)]
pub fn attend_partial_backward(
    q: &Tensor,
    q_pos: usize,
    k: &Tensor,
    v: &Tensor,
    k_pos: usize,
    d_o: &Tensor,
    lse: &Tensor,
    dd: &Tensor,
    blocks: Blocks,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (heads, n, hd) = q.dims3()?;
    let (kv, m, _) = k.dims3()?;
    if kv == 0
        || heads % kv != 0
        || v.dims3()? != (kv, m, hd)
        || k.dim(2)? != hd
        || d_o.dims3()? != (heads, n, hd)
        || lse.dims2()? != (heads, n)
        || dd.dims2()? != (heads, n)
    {
        return Err(Error::Batch(format!(
            "attention backward shapes: q {:?}, k {:?}, v {:?}, dO {:?}, lse {:?}, D {:?}",
            q.dims(),
            k.dims(),
            v.dims(),
            d_o.dims(),
            lse.dims(),
            dd.dims()
        )));
    }
    Ok(partial_backward(
        q, q_pos, k, v, k_pos, d_o, lse, dd, blocks,
    )?)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn partial_backward(
    q: &Tensor,
    q_pos: usize,
    k: &Tensor,
    v: &Tensor,
    k_pos: usize,
    d_o: &Tensor,
    lse: &Tensor,
    dd: &Tensor,
    blocks: Blocks,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let (heads, n, hd) = q.dims3()?;
    let (kv, m, _) = k.dims3()?;
    let scale = 1.0 / (hd as f64).sqrt();
    let device = q.device();
    let (bq, bk) = (blocks.q.clamp(1, n.max(1)), blocks.k.clamp(1, m.max(1)));
    let key_blocks = m.div_ceil(bk);
    let d_o = d_o.to_dtype(v.dtype())?;
    // dq is written in place a query block at a time (pieces and their concatenation would hold
    // it twice).
    let dq_all = Tensor::zeros((heads, n, hd), DType::F32, device)?;
    let mut dk_acc: Vec<Option<Tensor>> = vec![None; key_blocks];
    let mut dv_acc: Vec<Option<Tensor>> = vec![None; key_blocks];
    for qs in (0..n).step_by(bq) {
        let rows = bq.min(n - qs);
        let (qg, dog) = (
            group(&q.narrow(1, qs, rows)?, kv)?,
            group(&d_o.narrow(1, qs, rows)?, kv)?,
        );
        let stat = |x: &Tensor| {
            x.narrow(1, qs, rows)?
                .contiguous()?
                .reshape((kv, heads / kv * rows, 1))
        };
        let (lse, dd) = (stat(lse)?, stat(dd)?);
        // Keys after this block's last query are masked for all of it.
        let visible_end = q_pos + qs + rows;
        let mut dq: Option<Tensor> = None;
        for j in 0..key_blocks {
            let ks = j * bk;
            let full = bk.min(m - ks);
            if k_pos + ks >= visible_end {
                break;
            }
            let mm = full.min(visible_end - (k_pos + ks));
            let (kt, vt) = (k.narrow(1, ks, mm)?, v.narrow(1, ks, mm)?);
            let p = scores(&qg, q_pos + qs, rows, &kt, k_pos + ks, scale)?
                .broadcast_sub(&lse)?
                .exp()?;
            let dv = p.to_dtype(v.dtype())?.t()?.matmul(&dog)?;
            let dp = dog.matmul(&vt.t()?)?.to_dtype(DType::F32)?;
            let ds = (&p * dp.broadcast_sub(&dd)?)?.to_dtype(q.dtype())?;
            let dq_t = ds.matmul(&kt)?.to_dtype(DType::F32)?;
            let dk = ds.t()?.matmul(&qg)?;
            dq = Some(match dq {
                None => dq_t,
                Some(acc) => (acc + dq_t)?,
            });
            let pad = |x: Tensor| x.to_dtype(DType::F32)?.pad_with_zeros(1, 0, full - mm);
            for (acc, d) in [(&mut dk_acc[j], dk), (&mut dv_acc[j], dv)] {
                let d = pad(d)?;
                *acc = Some(match acc.take() {
                    None => d,
                    Some(a) => (a + d)?,
                });
            }
        }
        if let Some(dq) = dq {
            dq_all.slice_set(&(dq * scale)?.reshape((heads, rows, hd))?, 1, qs)?;
        }
    }
    let finish = |acc: Vec<Option<Tensor>>| -> candle_core::Result<Tensor> {
        if acc.is_empty() {
            return Tensor::zeros((kv, 0, hd), DType::F32, device);
        }
        let parts = acc
            .into_iter()
            .enumerate()
            .map(|(j, a)| match a {
                Some(a) => Ok(a),
                None => Tensor::zeros((kv, bk.min(m - j * bk), hd), DType::F32, device),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Tensor::cat(&parts, 1)
    };
    Ok((dq_all, (finish(dk_acc)? * scale)?, finish(dv_acc)?))
}

/// Training's attention core, blocked: the same signature and result as
/// [`super::plain::attend_spans`] (queries `[1, H, T, hd]`, keys and values
/// `[1, KV, T, hd]`, each sample attending causally within itself; `[1, H, T, hd]`), in memory
/// linear in `T`, with [`Blocks::default`].
pub fn flash_packed_attend(
    config: &ModelConfig,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: &PackedBatch,
) -> Result<Tensor> {
    let (_, heads, _, _) = q.dims4()?;
    let (_, kv, _, _) = k.dims4()?;
    if heads != config.n_heads || kv != config.kv_heads() {
        return Err(Error::Batch(format!(
            "attention of {heads} query and {kv} KV heads under a config of {} and {}",
            config.n_heads,
            config.kv_heads()
        )));
    }
    blocked_packed_attend(q, k, v, &batch.spans, Blocks::default())
}

/// [`flash_packed_attend`] over explicit `spans` (each sample's `(start, len)`, in order, tiling
/// `0..T`) and tile sizes.
pub fn blocked_packed_attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &[(usize, usize)],
    blocks: Blocks,
) -> Result<Tensor> {
    check_packed(q, k, v, spans)?;
    let (_, heads, t, hd) = q.dims4()?;
    let (qd, kd, vd) = (q.detach().get(0)?, k.detach().get(0)?, v.detach().get(0)?);
    let mut outs = Vec::with_capacity(spans.len());
    let mut lses = Vec::with_capacity(spans.len());
    for &(start, len) in spans {
        let p = attend_partial(
            &qd.narrow(1, start, len)?,
            0,
            &kd.narrow(1, start, len)?,
            &vd.narrow(1, start, len)?,
            0,
            blocks,
        )?;
        outs.push(p.out.to_dtype(v.dtype())?);
        lses.push(p.lse);
    }
    let out = Tensor::cat(&outs, 1)?.reshape((1, heads, t, hd))?;
    let op = BlockedAttention {
        spans: spans.to_vec(),
        blocks,
        out: Precomputed::new("blocked attention", out),
        lse: Tensor::cat(&lses, 1)?,
    };
    Ok(q.apply_op3(k, v, op)?)
}

/// Packed attention's inputs: `q [1, H, T, hd]`, `k, v [1, KV, T, hd]` and `spans` (each
/// `(start, len)`, in order, non-empty) tiling `0..T`.
pub(super) fn check_packed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &[(usize, usize)],
) -> Result<()> {
    let (rows, _, t, hd) = q.dims4()?;
    let (_, kv, _, _) = k.dims4()?;
    if rows != 1 || k.dims4()? != (1, kv, t, hd) || v.dims4()? != (1, kv, t, hd) {
        return Err(Error::Batch(format!(
            "packed attention takes q [1, H, T, hd] and k, v [1, KV, T, hd]: got q {:?}, k {:?}, \
             v {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let mut at = 0;
    for &(start, len) in spans {
        if start != at || len == 0 {
            return Err(Error::Batch(format!(
                "spans {spans:?} do not tile the pack's {t} tokens"
            )));
        }
        at += len;
    }
    if at != t {
        return Err(Error::Batch(format!(
            "spans {spans:?} do not tile the pack's {t} tokens"
        )));
    }
    Ok(())
}

/// The graph node of [`blocked_packed_attend`]: its forward hands candle the precomputed output,
/// its backward is FlashAttention-2's.
struct BlockedAttention {
    spans: Vec<(usize, usize)>,
    blocks: Blocks,
    /// The precomputed output `[1, H, T, hd]`, taken (and copied) by the forward.
    out: Precomputed,
    /// fp32 `[H, T]`: each row's log-sum-exp.
    lse: Tensor,
}

impl BlockedAttention {
    /// `(dq, dk, dv)` of `q [1, H, T, hd]`, `k, v [1, KV, T, hd]`, given the output `o` and its
    /// gradient `d_o`: each sample's span is [`attend_partial_backward`] of its queries against
    /// its own keys (`D = rowsum(dO ⊙ O)`).
    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (q, k, v) = (q.detach().get(0)?, k.detach().get(0)?, v.detach().get(0)?);
        let (o, d_o) = (o.detach().get(0)?, d_o.detach().get(0)?);
        let (heads, t, hd) = q.dims3()?;
        // D: [H, T] fp32.
        let dd = (d_o.to_dtype(DType::F32)? * o.to_dtype(DType::F32)?)?.sum(D::Minus1)?;
        // dq is written in place a sample at a time.
        let dq_all = Tensor::zeros((heads, t, hd), DType::F32, q.device())?;
        let (mut dks, mut dvs) = (vec![], vec![]);
        for &(start, len) in &self.spans {
            let span = |x: &Tensor| x.narrow(1, start, len);
            let (dq, dk, dv) = partial_backward(
                &span(&q)?,
                0,
                &span(&k)?,
                &span(&v)?,
                0,
                &span(&d_o)?,
                &span(&self.lse)?,
                &span(&dd)?,
                self.blocks,
            )?;
            dq_all.slice_set(&dq, 1, start)?;
            dks.push(dk);
            dvs.push(dv);
        }
        let whole = |parts: Vec<Tensor>, dtype: DType| -> candle_core::Result<Tensor> {
            Tensor::cat(&parts, 1)?.to_dtype(dtype)?.unsqueeze(0)
        };
        Ok((
            dq_all.to_dtype(q.dtype())?.unsqueeze(0)?,
            whole(dks, k.dtype())?,
            whole(dvs, v.dtype())?,
        ))
    }
}

impl CustomOp3 for BlockedAttention {
    fn name(&self) -> &'static str {
        "blocked-causal-attention"
    }

    precomputed_forwards!(3);

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv) = self.backward(q, k, v, out, grad_out)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Sample;
    use crate::config::AttentionImpl;
    use crate::test_util::{err, random};
    use candle_core::{Device, Var};
    use proptest::prelude::*;

    /// A config whose packs hold samples of up to 128 tokens, with `heads` query heads over `kv`
    /// KV heads of width `hd`.
    fn config(heads: usize, kv: usize, hd: usize) -> ModelConfig {
        ModelConfig {
            vocab_size: 16,
            d_model: heads * hd,
            n_heads: heads,
            n_kv_heads: Some(kv),
            head_dim: Some(hd),
            max_seq_len: 128,
            ..ModelConfig::tiny()
        }
    }

    fn pack(c: &ModelConfig, lens: &[usize]) -> PackedBatch {
        let samples: Vec<Sample> = lens.iter().map(|&n| Sample::all_loss(vec![1; n])).collect();
        PackedBatch::pack(c, &samples, &Device::Cpu).unwrap()
    }

    /// Output and gradients of q, k, v (of `sum(out · r)`) of `attention` on `q, k, v` (fp32
    /// `Var`s, cast to `dtype` inside the graph, so the gradients come back in fp32).
    fn run(
        attention: AttentionImpl,
        c: &ModelConfig,
        batch: &PackedBatch,
        qkv: &[Tensor; 3],
        r: &Tensor,
        dtype: DType,
    ) -> [Tensor; 4] {
        let vars: Vec<Var> = qkv.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let cast: Vec<Tensor> = vars
            .iter()
            .map(|v| v.as_tensor().to_dtype(dtype).unwrap())
            .collect();
        let out =
            crate::attention::packed_attend(attention, c, &cast[0], &cast[1], &cast[2], batch)
                .unwrap();
        assert_eq!(out.dtype(), dtype);
        let grads = (out.to_dtype(DType::F32).unwrap() * r)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g = |i: usize| grads.get(vars[i].as_tensor()).unwrap().clone();
        [out, g(0), g(1), g(2)]
    }

    /// Random q `[1, H, T, hd]`, k, v `[1, KV, T, hd]` and an output cotangent `r`.
    fn inputs(c: &ModelConfig, t: usize, seed: u64) -> ([Tensor; 3], Tensor) {
        let (h, kv, hd) = (c.n_heads, c.kv_heads(), c.head_dim());
        let qkv = [
            random(&[1, h, t, hd], seed),
            random(&[1, kv, t, hd], seed + 1),
            random(&[1, kv, t, hd], seed + 2),
        ];
        (qkv, random(&[1, h, t, hd], seed + 3))
    }

    /// The largest of the errors of the output and the three gradients, blocked against plain.
    fn blocked_vs_plain(
        lens: &[usize],
        (heads, kv, hd): (usize, usize, usize),
        blocks: Blocks,
        dtype: DType,
        seed: u64,
    ) -> [f32; 4] {
        let c = config(heads, kv, hd);
        let batch = pack(&c, lens);
        let (qkv, r) = inputs(&c, lens.iter().sum(), seed);
        let plain = run(AttentionImpl::Plain, &c, &batch, &qkv, &r, dtype);
        let blocked = run(AttentionImpl::Blocked(blocks), &c, &batch, &qkv, &r, dtype);
        [0, 1, 2, 3].map(|i| err(&blocked[i], &plain[i]))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn blocked_equals_plain_attention_forward_and_backward(
            lens in prop::collection::vec(1usize..70, 1..4),
            (kv, groups) in (1usize..3, prop::sample::select(vec![1usize, 2, 4])),
            hd in prop::sample::select(vec![4usize, 8, 12]),
            bq in 1usize..80,
            bk in 1usize..80,
            seed in 0u64..1000,
        ) {
            let errs = blocked_vs_plain(
                &lens,
                (kv * groups, kv, hd),
                Blocks { q: bq, k: bk },
                DType::F32,
                seed,
            );
            prop_assert!(
                errs.iter().all(|e| *e < 1e-5),
                "out, dq, dk, dv errors {errs:?}"
            );
        }
    }

    #[test]
    fn blocked_equals_plain_attention_with_blocks_that_divide_or_exceed_the_sample() {
        for blocks in [
            (1, 1),
            (4, 4),
            (8, 16),
            (16, 8),
            (64, 64),
            (500, 500),
            (3, 1000),
        ] {
            let blocks = Blocks {
                q: blocks.0,
                k: blocks.1,
            };
            let errs = blocked_vs_plain(&[64, 16, 1, 33], (4, 2, 8), blocks, DType::F32, 7);
            assert!(errs.iter().all(|e| *e < 1e-5), "{blocks:?}: {errs:?}");
        }
        // The default tiles, on samples longer than them (the training path's function).
        let c = ModelConfig {
            max_seq_len: 1024,
            ..config(4, 2, 8)
        };
        let batch = pack(&c, &[700, 300]);
        let (qkv, _) = inputs(&c, 1000, 9);
        let plain = crate::attention::packed_attend(
            AttentionImpl::Plain,
            &c,
            &qkv[0],
            &qkv[1],
            &qkv[2],
            &batch,
        )
        .unwrap();
        let blocked = flash_packed_attend(&c, &qkv[0], &qkv[1], &qkv[2], &batch).unwrap();
        assert!(err(&blocked, &plain) < 1e-5);
    }

    #[test]
    fn blocked_equals_plain_attention_within_bf16_rounding() {
        for (blocks, groups) in [((16, 32), 2), ((7, 5), 1), ((64, 64), 4)] {
            let blocks = Blocks {
                q: blocks.0,
                k: blocks.1,
            };
            let errs = blocked_vs_plain(&[50, 17, 64], (2 * groups, 2, 16), blocks, DType::BF16, 3);
            assert!(errs.iter().all(|e| *e < 2e-2), "{blocks:?}: {errs:?}");
        }
    }

    /// `[1, H, T, hd]` -> the `[H, len, hd]` of the sample at `start`.
    fn sample(x: &Tensor, start: usize, len: usize) -> Tensor {
        x.get(0).unwrap().narrow(1, start, len).unwrap()
    }

    #[test]
    fn merging_the_partials_of_two_key_ranges_equals_attending_to_all() {
        let c = config(4, 2, 8);
        let len = 45;
        let (qkv, _) = inputs(&c, len, 11);
        let [q, k, v] = qkv.clone().map(|x| sample(&x, 0, len));
        let blocks = Blocks { q: 8, k: 6 };
        let all = attend_partial(&q, 0, &k, &v, 0, blocks).unwrap();
        // The whole sample against the plain attention.
        let batch = pack(&c, &[len]);
        let plain = crate::attention::packed_attend(
            AttentionImpl::Plain,
            &c,
            &qkv[0],
            &qkv[1],
            &qkv[2],
            &batch,
        )
        .unwrap();
        assert!(err(&all.out, &plain.get(0).unwrap()) < 1e-5);
        for cut in [1, 10, 20, 44] {
            let part = |from: usize, to: usize| {
                attend_partial(
                    &q,
                    0,
                    &k.narrow(1, from, to - from).unwrap(),
                    &v.narrow(1, from, to - from).unwrap(),
                    from,
                    blocks,
                )
                .unwrap()
            };
            let merged = merge(&part(0, cut), &part(cut, len)).unwrap();
            assert!(err(&merged.out, &all.out) < 1e-5, "cut {cut}");
            assert!(err(&merged.lse, &all.lse) < 1e-5, "cut {cut}");
            // Order does not matter.
            let swapped = merge(&part(cut, len), &part(0, cut)).unwrap();
            assert!(err(&swapped.out, &all.out) < 1e-5, "cut {cut}");
        }
        // A query block in the middle of the sample against key ranges, one of them entirely
        // after it (its partial is empty: the identity).
        let (qs, n) = (20, 9);
        let qb = q.narrow(1, qs, n).unwrap();
        let range = |from: usize, to: usize| {
            attend_partial(
                &qb,
                qs,
                &k.narrow(1, from, to - from).unwrap(),
                &v.narrow(1, from, to - from).unwrap(),
                from,
                blocks,
            )
            .unwrap()
        };
        let merged = merge(
            &merge(&range(0, 13), &range(13, 35)).unwrap(),
            &range(35, len),
        )
        .unwrap();
        assert!(err(&merged.out, &all.out.narrow(1, qs, n).unwrap()) < 1e-5);
        assert!(err(&merged.lse, &all.lse.narrow(1, qs, n).unwrap()) < 1e-5);
    }

    #[test]
    fn blocked_attention_is_causal_and_nothing_crosses_samples() {
        let c = config(4, 2, 8);
        let blocks = AttentionImpl::Blocked(Blocks { q: 8, k: 16 });
        let (lens, len_a) = ([21, 30], 30);
        let batch = pack(&c, &lens);
        let (qkv, r) = inputs(&c, 51, 21);
        // Sample A (the second) alone.
        let alone_batch = pack(&c, &[len_a]);
        let alone_qkv = qkv.clone().map(|x| x.narrow(2, 21, len_a).unwrap());
        let alone = run(
            blocks,
            &c,
            &alone_batch,
            &alone_qkv,
            &r.narrow(2, 21, len_a).unwrap(),
            DType::F32,
        );
        // Packed after B, and the loss on A's outputs only.
        let only_a = Tensor::cat(
            &[
                &r.narrow(2, 0, 21).unwrap().zeros_like().unwrap(),
                &r.narrow(2, 21, len_a).unwrap(),
            ],
            2,
        )
        .unwrap();
        let packed = run(blocks, &c, &batch, &qkv, &only_a, DType::F32);
        for i in 0..4 {
            assert!(
                err(&packed[i].narrow(2, 21, len_a).unwrap(), &alone[i]) < 1e-5,
                "{i}"
            );
        }
        // B's inputs get no gradient from A's outputs.
        for g in &packed[1..] {
            let b: Vec<f32> = g
                .narrow(2, 0, 21)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!(b.iter().all(|x| *x == 0.0));
        }
        // Causal: changing A's last key and value changes only A's last output row.
        let changed: [Tensor; 3] = qkv.clone().map(|x| {
            let last = (x.narrow(2, 50, 1).unwrap() + 1.0).unwrap();
            Tensor::cat(&[&x.narrow(2, 0, 50).unwrap(), &last], 2).unwrap()
        });
        let before =
            crate::attention::packed_attend(blocks, &c, &qkv[0], &qkv[1], &qkv[2], &batch).unwrap();
        let after =
            crate::attention::packed_attend(blocks, &c, &qkv[0], &changed[1], &changed[2], &batch)
                .unwrap();
        assert!(
            err(
                &before.narrow(2, 0, 50).unwrap(),
                &after.narrow(2, 0, 50).unwrap()
            ) == 0.0
        );
        assert!(
            err(
                &before.narrow(2, 50, 1).unwrap(),
                &after.narrow(2, 50, 1).unwrap()
            ) > 1e-3
        );
    }

    #[test]
    fn grouped_kv_heads_gradients_sum_over_their_group() {
        // GQA equals multi-head attention with each KV head repeated for its group; the
        // repeated heads' gradients summed are the KV head's.
        let (gqa, mha) = (config(4, 1, 8), config(4, 4, 8));
        let lens = [13, 29];
        let (qkv, r) = inputs(&gqa, 42, 31);
        let blocks = AttentionImpl::Blocked(Blocks { q: 5, k: 7 });
        let grouped = run(blocks, &gqa, &pack(&gqa, &lens), &qkv, &r, DType::F32);
        let repeat = |x: &Tensor| crate::attention::repeat_kv(x, 4).unwrap();
        let wide = [qkv[0].clone(), repeat(&qkv[1]), repeat(&qkv[2])];
        let multi = run(blocks, &mha, &pack(&mha, &lens), &wide, &r, DType::F32);
        assert!(err(&grouped[0], &multi[0]) < 1e-5);
        assert!(err(&grouped[1], &multi[1]) < 1e-5);
        for i in [2, 3] {
            let summed = multi[i].sum_keepdim(1).unwrap();
            assert!(err(&grouped[i], &summed) < 1e-5, "{i}");
        }
    }

    /// Blocked against plain, forward and backward, one sample of 1024 and of 2048 tokens, 14
    /// query heads over 2 KV heads of width 64 (Qwen2.5-0.5B's attention), A and B interleaved;
    /// prints the time ratio. `cargo test --release --lib model::attention::blocked -- --ignored --nocapture`.
    #[test]
    #[ignore = "a timing, not a check: run it by hand in a release build"]
    fn blocked_and_plain_attention_timing() {
        use std::time::{Duration, Instant};
        let c = config(14, 2, 64);
        for len in [1024, 2048] {
            let batch = pack(
                &ModelConfig {
                    max_seq_len: len,
                    ..c.clone()
                },
                &[len],
            );
            let (qkv, r) = inputs(&c, len, 5);
            let time = |attention| {
                let start = Instant::now();
                run(attention, &c, &batch, &qkv, &r, DType::F32);
                start.elapsed()
            };
            let (mut plain, mut blocked) = (Duration::ZERO, Duration::ZERO);
            for round in 0..4 {
                let (p, b) = (time(AttentionImpl::Plain), time(AttentionImpl::default()));
                if round > 0 {
                    (plain, blocked) = (plain + p, blocked + b);
                }
            }
            eprintln!(
                "{len} tokens: plain {:.1} ms, blocked {:.1} ms, blocked/plain {:.2}",
                plain.as_secs_f64() * 1e3 / 3.0,
                blocked.as_secs_f64() * 1e3 / 3.0,
                blocked.as_secs_f64() / plain.as_secs_f64()
            );
        }
    }
}
