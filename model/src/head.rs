//! The LM head's loss without the `[T, vocab]` logits: each position's log-probability of its
//! target, computed a chunk of positions at a time.
//!
//! [`target_log_probs`] takes the normed hidden states `h: [T, d]`, the LM head `w: [vocab, d]`
//! and the targets `[T]` and returns `log softmax(h wᵀ)[t, target[t]]`, fp32 `[T]` — what
//! [`super::transformer::head_log_probs`] gathers from its full log-softmax. Its graph node is a
//! [`CustomOp2`] on `(h, w)` whose forward is precomputed chunk by chunk on detached tensors
//! (`cpu_fwd`/`cuda_fwd` copy it, as [`super::attention::blocked`]'s attention) and whose backward recomputes
//! the logits block by block, `dlogits = g ⊙ (onehot(target) − softmax(logits))` from each row's
//! saved log-sum-exp, twice: `dh = dlogits · w` a chunk of positions at a time, then
//! `dw = dlogitsᵀ · h` a chunk of classes at a time, written into its rows in place (so `dw` is
//! one `[vocab, d]` matrix, never a running sum and its next term: the price is a third pass of
//! logits in the backward).
//!
//! Guarantees (each has a test named after it):
//! 1. **Same loss as the full head**: the log-probabilities and the gradients of `h` and `w`
//!    equal the full log-softmax's within 1e-6 (relative, fp32) for any chunk size — 1, one that
//!    does not divide `T`, more than `T` — with the LM head tied to the embedding or not.
//! 2. **Memory**: a chunk's logits are at most [`CHUNK_BYTES`] in fp32 (at least one row or
//!    column); the graph keeps `h`, `w`, the `[T]` result and each row's log-sum-exp, never
//!    `[T, vocab]`; the backward's `dw` is one `[vocab, d]` fp32 matrix.
//! 3. **A gradient sink** ([`WeightGrad`], [`target_log_probs_with`]): `w`'s gradient left there
//!    equals the one candle's store gets (fp32), and `h`'s is unchanged.
//! 4. **Mixed precision** as the full head: the matmuls in `h`'s dtype (bf16 under
//!    [`super::ComputePrecision::Bf16`]), the log-softmax and its gradient in fp32, each input's
//!    gradient in its dtype.
//!
//! Where the fused kernels run ([`super::ops::fused`]) a chunk's log-softmax is one launch of
//! `odc-kernels`' loss kernel and each block's logit gradient one more, where candle's ops take
//! several kernels and temporaries (not yet run on a GPU).

use std::sync::{Arc, Mutex};

use candle_core::{CustomOp2, DType, Tensor, D};

use super::ops::fused;

use super::error::{Error, Result};
use super::ops::precomputed::{precomputed_forwards, Precomputed};

/// The most bytes a chunk's fp32 logits take: 64 MiB (109 positions of a 152K vocabulary).
pub const CHUNK_BYTES: usize = 64 << 20;

/// Positions per chunk for a vocabulary of `vocab`: as many as [`CHUNK_BYTES`] of fp32 logits
/// hold, at least one.
pub fn chunk_rows(vocab: usize) -> usize {
    (CHUNK_BYTES / (4 * vocab.max(1))).max(1)
}

/// Where [`target_log_probs_with`] leaves the LM head's gradient instead of candle's gradient
/// store: fp32 `[vocab, d]`, summed over the backward passes run since the last [`Self::take`].
///
/// candle adds each gradient into a zero tensor it allocates first, so a gradient for `w` in its
/// store would pass through three `[vocab, d]` matrices at once (the gradient, the zeros and their
/// sum) beside `w` itself — 2.2 GB for a 151,936 × 896 head, the largest constant of a trainer's
/// step. Left here, it is one matrix, and `w` needs no `Var` copy.
#[derive(Debug, Clone, Default)]
pub struct WeightGrad(Arc<Mutex<Option<Tensor>>>);

impl WeightGrad {
    /// The gradient so far (none before a backward), emptying the sink.
    pub fn take(&self) -> Option<Tensor> {
        self.0.lock().ok()?.take()
    }

    fn add(&self, dw: Tensor) -> candle_core::Result<()> {
        let mut slot = self
            .0
            .lock()
            .map_err(|_| candle_core::Error::Msg("head: a poisoned gradient sink".into()))?;
        *slot = Some(match slot.take() {
            Some(acc) => (acc + dw)?,
            None => dw,
        });
        Ok(())
    }
}

/// `log softmax(h wᵀ)[t, targets[t]]` for each position `t`: fp32 `[T]`, from `h: [T, d]`,
/// `w: [vocab, d]` and u32 `targets: [T]`, `chunk` positions at a time (differentiable in `h`
/// and `w`).
pub fn target_log_probs(h: &Tensor, w: &Tensor, targets: &Tensor, chunk: usize) -> Result<Tensor> {
    target_log_probs_with(h, w, targets, chunk, None)
}

/// [`target_log_probs`], and with `weight_grad` the gradient of `w` goes there (fp32) and not to
/// candle's store: the result is then differentiable in `h` only, `w` a constant of the graph.
pub fn target_log_probs_with(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    chunk: usize,
    weight_grad: Option<&WeightGrad>,
) -> Result<Tensor> {
    let (t, d) = h.dims2()?;
    let (vocab, wd) = w.dims2()?;
    if wd != d || targets.dims1()? != t || targets.dtype() != DType::U32 {
        return Err(Error::Batch(format!(
            "head: h {:?}, w {:?}, targets {:?} ({:?})",
            h.dims(),
            w.dims(),
            targets.dims(),
            targets.dtype()
        )));
    }
    let chunk = chunk.clamp(1, t.max(1));
    let (hd, wd) = (h.detach(), w.detach());
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for start in (0..t).step_by(chunk) {
        let n = chunk.min(t - start);
        let logits = chunk_logits(&hd.narrow(0, start, n)?, &wd)?;
        if fused::applies(&logits) {
            let chunk_targets = targets.narrow(0, start, n)?;
            let (out, lse) = fused::target_log_probs(logits, &chunk_targets)?;
            outs.push(out);
            lses.push(lse);
            continue;
        }
        let max = logits.max_keepdim(D::Minus1)?;
        let shifted = logits.broadcast_sub(&max)?;
        let log_den = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
        let target = shifted.gather(&targets.narrow(0, start, n)?.unsqueeze(1)?, 1)?;
        outs.push((target - &log_den)?.squeeze(1)?);
        lses.push((max + log_den)?.squeeze(1)?);
    }
    let op = TargetLogProbs {
        targets: targets.clone(),
        chunk,
        vocab,
        out: Precomputed::new("chunked head", Tensor::cat(&outs, 0)?),
        lse: Tensor::cat(&lses, 0)?,
        weight_grad: weight_grad.cloned(),
    };
    Ok(match weight_grad {
        Some(_) => h.apply_op2(&w.detach(), op)?,
        None => h.apply_op2(w, op)?,
    })
}

/// fp32 logits `[n, vocab]` of a chunk `h: [n, d]` (the matmul in `h`'s dtype).
fn chunk_logits(h: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    h.matmul(&w.t()?)?.to_dtype(DType::F32)
}

/// The graph node of [`target_log_probs`].
struct TargetLogProbs {
    /// u32 `[T]`.
    targets: Tensor,
    chunk: usize,
    vocab: usize,
    /// The precomputed fp32 `[T]` result, taken (and copied) by the forward.
    out: Precomputed,
    /// fp32 `[T]`: each position's log-sum-exp of its logits.
    lse: Tensor,
    /// Where `w`'s gradient goes instead of candle's store.
    weight_grad: Option<WeightGrad>,
}

impl TargetLogProbs {
    /// `(dh, dw)` given the result's gradient `g: [T]` (`dw` in fp32, when wanted).
    fn backward(
        &self,
        h: &Tensor,
        w: &Tensor,
        g: &Tensor,
        want_dw: bool,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let (h, w, g) = (h.detach(), w.detach(), g.detach().to_dtype(DType::F32)?);
        let (t, d) = h.dims2()?;
        // dh = dlogits · w, a chunk of positions at a time (every class).
        let mut dhs = Vec::new();
        for start in (0..t).step_by(self.chunk) {
            let n = self.chunk.min(t - start);
            let dlogits = self.dlogits(&h, &w, &g, (start, n), (0, self.vocab))?;
            dhs.push(dlogits.matmul(&w)?);
        }
        // dw = dlogitsᵀ · h, a chunk of classes at a time (every position), each chunk's rows
        // written in place: one [vocab, d] matrix, where summing per-position chunks would
        // hold three at once (the sum so far, the chunk's and their sum).
        let dw = match want_dw {
            false => None,
            true => {
                let dw = Tensor::zeros((self.vocab, d), DType::F32, h.device())?;
                let cols = (self.chunk * self.vocab / t.max(1)).max(1);
                for first in (0..self.vocab).step_by(cols) {
                    let n = cols.min(self.vocab - first);
                    let dlogits = self.dlogits(&h, &w, &g, (0, t), (first, n))?;
                    let rows = dlogits.t()?.matmul(&h)?.to_dtype(DType::F32)?;
                    dw.slice_set(&rows, 0, first)?;
                }
                Some(dw)
            }
        };
        let dh = match dhs.is_empty() {
            true => h.zeros_like()?,
            false => Tensor::cat(&dhs, 0)?,
        };
        Ok((dh, dw))
    }

    /// `dlogits = g ⊙ (onehot(target) − softmax(logits))` of positions `start .. start + n` and
    /// classes `first .. first + m` (`(start, n)`, `(first, m)`), in `h`'s dtype; the softmax
    /// from the saved log-sum-exp.
    fn dlogits(
        &self,
        h: &Tensor,
        w: &Tensor,
        g: &Tensor,
        (start, n): (usize, usize),
        (first, m): (usize, usize),
    ) -> candle_core::Result<Tensor> {
        let hc = h.narrow(0, start, n)?;
        let logits = chunk_logits(&hc, &w.narrow(0, first, m)?)?;
        if fused::applies(&logits) && matches!(h.dtype(), DType::F32 | DType::BF16) {
            return fused::softmax_grad(
                &logits,
                &self.lse.narrow(0, start, n)?,
                &self.targets.narrow(0, start, n)?,
                &g.narrow(0, start, n)?,
                first,
                h.dtype(),
            );
        }
        let lse = self.lse.narrow(0, start, n)?.unsqueeze(1)?;
        let softmax = logits.broadcast_sub(&lse)?.exp()?;
        let classes = Tensor::arange(first as u32, (first + m) as u32, h.device())?.unsqueeze(0)?;
        let onehot = self
            .targets
            .narrow(0, start, n)?
            .unsqueeze(1)?
            .broadcast_eq(&classes)?
            .to_dtype(DType::F32)?;
        (onehot - softmax)?
            .broadcast_mul(&g.narrow(0, start, n)?.unsqueeze(1)?)?
            .to_dtype(h.dtype())
    }
}

impl CustomOp2 for TargetLogProbs {
    fn name(&self) -> &'static str {
        "chunked-target-log-probs"
    }

    precomputed_forwards!(2);

    fn bwd(
        &self,
        h: &Tensor,
        w: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let want_dw = self.weight_grad.is_some() || w.track_op();
        let (dh, dw) = self.backward(h, w, grad, want_dw)?;
        match (&self.weight_grad, dw) {
            (Some(sink), Some(dw)) => {
                sink.add(dw)?;
                Ok((Some(dh), None))
            }
            (_, dw) => Ok((Some(dh), dw.map(|d| d.to_dtype(w.dtype())).transpose()?)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{log_softmax_last_dim, rms_norm};
    use crate::test_util::{random, rel};
    use candle_core::{Device, Var};

    const T: usize = 11;
    const VOCAB: usize = 37;
    const D: usize = 16;

    /// The head's loss and its gradients of `x`, the norm weight and `w`, with the targets'
    /// log-probabilities from `chunk` (`None`: the full log-softmax); `tied`: `w` is also the
    /// embedding, looked up in the same graph, so its gradient has both parts. Matrices cast to
    /// `dtype` inside the graph.
    fn head(chunk: Option<usize>, tied: bool, dtype: DType) -> [Tensor; 4] {
        let x = Var::from_tensor(&random(&[T, D], 1)).unwrap();
        let norm = Var::from_tensor(&random(&[D], 2).affine(0.25, 1.0).unwrap()).unwrap();
        let w = Var::from_tensor(&random(&[VOCAB, D], 3)).unwrap();
        let targets: Vec<u32> = (0..T as u32).map(|i| (i * 7 + 3) % VOCAB as u32).collect();
        let targets = Tensor::new(targets, &Device::Cpu).unwrap();
        let weights = random(&[T], 4).abs().unwrap();
        let h = rms_norm(&x.as_tensor().to_dtype(dtype).unwrap(), &norm, 1e-5).unwrap();
        let wc = w.as_tensor().to_dtype(dtype).unwrap();
        let lp = match chunk {
            Some(chunk) => target_log_probs(&h, &wc, &targets, chunk).unwrap(),
            None => log_softmax_last_dim(&h.matmul(&wc.t().unwrap()).unwrap())
                .unwrap()
                .gather(&targets.unsqueeze(1).unwrap(), 1)
                .unwrap()
                .squeeze(1)
                .unwrap(),
        };
        assert_eq!((lp.dims(), lp.dtype()), (&[T][..], DType::F32));
        let mut loss = (lp * weights).unwrap().sum_all().unwrap().neg().unwrap();
        if tied {
            let tokens = Tensor::new(&[3u32, 0, 36, 3], &Device::Cpu).unwrap();
            let looked_up = wc.index_select(&tokens, 0).unwrap().to_dtype(DType::F32);
            let r = random(&[4, D], 5);
            loss = (loss + (looked_up.unwrap() * r).unwrap().sum_all().unwrap()).unwrap();
        }
        let grads = loss.backward().unwrap();
        let g = |v: &Var| grads.get(v.as_tensor()).unwrap().clone();
        [loss, g(&x), g(&norm), g(&w)]
    }

    #[test]
    fn chunked_head_equals_the_full_log_softmax_loss_and_gradients() {
        for tied in [false, true] {
            let full = head(None, tied, DType::F32);
            for chunk in [1, 3, 4, T, T + 5, chunk_rows(VOCAB)] {
                let chunked = head(Some(chunk), tied, DType::F32);
                for (i, what) in ["loss", "dx", "dnorm", "dw"].iter().enumerate() {
                    let e = rel(&chunked[i], &full[i]);
                    assert!(
                        e < 1e-6,
                        "tied {tied}, chunk {chunk}: {what} differs by {e}"
                    );
                }
            }
        }
    }

    #[test]
    fn chunked_head_equals_the_full_head_within_bf16_rounding() {
        for tied in [false, true] {
            let full = head(None, tied, DType::BF16);
            let chunked = head(Some(4), tied, DType::BF16);
            for (i, what) in ["loss", "dx", "dnorm", "dw"].iter().enumerate() {
                let e = rel(&chunked[i], &full[i]);
                assert!(e < 1e-2, "tied {tied}: {what} differs by {e}");
                // Gradients come back in the Vars' fp32.
                assert_eq!(chunked[i].dtype(), DType::F32);
            }
        }
    }

    #[test]
    fn a_gradient_sink_gets_what_candles_store_gets() {
        let x = Var::from_tensor(&random(&[T, D], 1)).unwrap();
        let w = Var::from_tensor(&random(&[VOCAB, D], 3)).unwrap();
        let targets: Vec<u32> = (0..T as u32).map(|i| (i * 5 + 1) % VOCAB as u32).collect();
        let targets = Tensor::new(targets, &Device::Cpu).unwrap();
        let weights = random(&[T], 4).abs().unwrap();
        let run = |sink: Option<&WeightGrad>| {
            let (xt, wt) = (x.as_tensor(), w.as_tensor());
            let lp = target_log_probs_with(xt, wt, &targets, 4, sink).unwrap();
            let g = (lp * &weights)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            (g.get(xt).cloned(), g.get(wt).cloned())
        };
        let (dx, dw) = run(None);
        let sink = WeightGrad::default();
        let (dx_sink, dw_store) = run(Some(&sink));
        assert!(dw_store.is_none(), "the store got w's gradient");
        assert!(rel(&dx_sink.unwrap(), &dx.unwrap()) < 1e-7);
        assert!(rel(&sink.take().unwrap(), &dw.unwrap()) < 1e-7);
        assert!(sink.take().is_none());
    }

    #[test]
    fn a_chunks_logits_stay_under_the_memory_bound() {
        for vocab in [1, 16, 32_000, 151_936, CHUNK_BYTES] {
            let rows = chunk_rows(vocab);
            assert!(rows >= 1);
            assert!(
                rows == 1 || rows * vocab * 4 <= CHUNK_BYTES,
                "{vocab}: {rows}"
            );
        }
        assert_eq!(chunk_rows(151_936), 110);
    }
}
