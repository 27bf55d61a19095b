//! The SwiGLU MLP `down(silu(x gateᵀ) ⊙ (x upᵀ))` a chunk of tokens at a time, so that no
//! `[tokens, d_ff]` tensor is kept for the backward (the MLP half of the Mini-Sequence
//! Transformer's chunking; the chunked head, [`super::head`], is the other half).
//!
//! Written with candle's ops, each of the MLP's `[tokens, d_ff]` intermediates — the gate and up
//! projections, the SiLU, their product — stays in the graph until the block's backward returns,
//! and the backward adds about as many again: some eight `d_ff`-wide tensors per token, the
//! widest part of a block's memory (`d_ff` is 4–5.5 × `d_model`). [`swiglu`] is one graph node,
//! a [`CustomOp3`] on `(x, [gate; up], down)`: its forward runs chunk by chunk on detached tensors
//! (handed to candle by [`Precomputed`], as the blocked attention's), and its backward recomputes
//! each chunk's gate and up projections and accumulates the weights' gradients chunk by chunk.
//! The graph keeps `x`, the two weight tensors and the `[tokens, d_model]` result.
//!
//! Guarantees (each has a test named after it):
//! 1. **Same MLP as candle's ops**: the output and the gradients of `x`, `gate`, `up` and `down`
//!    equal [`swiglu_reference`]'s within 1e-5 (relative, fp32) for any chunk size — 1, one that
//!    does not divide the tokens, more than the tokens — and within bf16 rounding in bf16.
//! 2. **Memory**: besides `[tokens, d_model]` tensors and the weights' size, a pass holds one
//!    chunk's few `[rows, d_ff]` temporaries, each at most [`CHUNK_BYTES`] in fp32 (at least one
//!    row).
//! 3. **Frozen weights cost nothing**: a weight that does not track gradients (a frozen base
//!    under LoRA) gets no gradient, and none is computed.
//! 4. **Mixed precision** as [`swiglu_reference`]: matmuls in `x`'s dtype, the SiLU's gradient
//!    in fp32, the weights' gradients accumulated over chunks in fp32 and returned in their dtype.

use candle_core::{CustomOp3, DType, Tensor};

use super::error::{Error, Result};
use super::ops::precomputed::{precomputed_forwards, Precomputed};
use super::ops::{fused, silu};

/// The most bytes one chunk's `[rows, d_ff]` fp32 tensor takes: 32 MiB (1,724 tokens of
/// Qwen2.5-0.5B's 4,864).
pub const CHUNK_BYTES: usize = 32 << 20;

/// Tokens per chunk for an MLP of width `d_ff`: as many as [`CHUNK_BYTES`] of fp32 hold, at least
/// one.
pub fn chunk_rows(d_ff: usize) -> usize {
    (CHUNK_BYTES / (4 * d_ff.max(1))).max(1)
}

/// `silu(x gateᵀ) ⊙ (x upᵀ)` then `· downᵀ`, with candle's ops: `x: [T, d]`, `gate, up: [f, d]`,
/// `down: [d, f]` (the reference of [`swiglu`]).
pub fn swiglu_reference(x: &Tensor, gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let h = (silu(&x.matmul(&gate.t()?)?)? * x.matmul(&up.t()?)?)?;
    Ok(h.matmul(&down.t()?)?)
}

/// [`swiglu_reference`] `chunk` tokens at a time (see the [module docs](self)); differentiable in
/// all four inputs.
pub fn swiglu(
    x: &Tensor,
    gate: &Tensor,
    up: &Tensor,
    down: &Tensor,
    chunk: usize,
) -> Result<Tensor> {
    let (t, d) = x.dims2()?;
    let (f, gd) = gate.dims2()?;
    if gd != d || up.dims2()? != (f, d) || down.dims2()? != (d, f) {
        return Err(Error::Batch(format!(
            "mlp: x {:?}, gate {:?}, up {:?}, down {:?}",
            x.dims(),
            gate.dims(),
            up.dims(),
            down.dims()
        )));
    }
    let chunk = chunk.clamp(1, t.max(1));
    // One matrix for both projections: one matmul per chunk, and a third input for the op.
    let gate_up = Tensor::cat(&[gate, up], 0)?;
    let (xd, gud, dd) = (x.detach(), gate_up.detach(), down.detach());
    let mut outs = Vec::new();
    for start in (0..t).step_by(chunk) {
        let xc = xd.narrow(0, start, chunk.min(t - start))?;
        let (g, u) = project(&xc, &gud, f)?;
        outs.push(activate(&g, &u)?.matmul(&dd.t()?)?);
    }
    let out = if outs.is_empty() {
        xd.zeros_like()?
    } else {
        Tensor::cat(&outs, 0)?
    };
    let op = SwiGlu {
        chunk,
        d_ff: f,
        out: Precomputed::new("chunked mlp", out),
    };
    Ok(x.apply_op3(&gate_up, down, op)?)
}

/// A chunk's gate and up projections `[rows, f]` from `x: [rows, d]` and `gate_up: [2f, d]`.
fn project(x: &Tensor, gate_up: &Tensor, f: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let gu = x.matmul(&gate_up.t()?)?;
    Ok((gu.narrow(1, 0, f)?, gu.narrow(1, f, f)?))
}

/// `silu(g) ⊙ u`: one fused kernel where they run ([`crate::ops::fused`]), candle's ops
/// otherwise.
fn activate(g: &Tensor, u: &Tensor) -> candle_core::Result<Tensor> {
    if fused::applies(g) {
        return fused::swiglu(g, u);
    }
    silu(g)? * u
}

/// `acc + next` in fp32 (`next` alone when there is no `acc`).
fn accumulate(acc: Option<Tensor>, next: Tensor) -> candle_core::Result<Tensor> {
    let next = next.to_dtype(DType::F32)?;
    match acc {
        None => Ok(next),
        Some(acc) => acc + next,
    }
}

/// The graph node of [`swiglu`].
struct SwiGlu {
    chunk: usize,
    d_ff: usize,
    /// The precomputed `[T, d]` result, taken (and copied) by the forward.
    out: Precomputed,
}

type Grads = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

impl SwiGlu {
    /// The gradients of `x`, `gate_up` and `down` given the result's gradient `grad: [T, d]`,
    /// each `None` when its input does not track gradients.
    fn backward(
        &self,
        x: &Tensor,
        gate_up: &Tensor,
        down: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Grads> {
        let wants = (x.track_op(), gate_up.track_op(), down.track_op());
        let (x, gate_up, down) = (x.detach(), gate_up.detach(), down.detach());
        let grad = grad.detach().to_dtype(x.dtype())?;
        let (t, f) = (x.dim(0)?, self.d_ff);
        let (mut dxs, mut dgu, mut ddown) = (Vec::new(), None, None);
        for start in (0..t).step_by(self.chunk) {
            let n = self.chunk.min(t - start);
            let (xc, gc) = (x.narrow(0, start, n)?, grad.narrow(0, start, n)?);
            let (g, u) = project(&xc, &gate_up, f)?;
            if fused::applies(&g) {
                // The fused kernels: `h = silu(g) ⊙ u` for `down`, and `(dgate, dup)` in fp32.
                if wants.2 {
                    ddown = Some(accumulate(ddown, gc.t()?.matmul(&fused::swiglu(&g, &u)?)?)?);
                }
                if !(wants.0 || wants.1) {
                    continue;
                }
                let dh = gc.matmul(&down)?.to_dtype(DType::F32)?;
                let (dgate, dup) = fused::swiglu_backward(&g.to_dtype(DType::F32)?, &u, &dh)?;
                let dgu_c = Tensor::cat(&[dgate, dup], 1)?.to_dtype(x.dtype())?;
                if wants.1 {
                    dgu = Some(accumulate(dgu, dgu_c.t()?.matmul(&xc)?)?);
                }
                if wants.0 {
                    dxs.push(dgu_c.matmul(&gate_up)?);
                }
                continue;
            }
            let g32 = g.to_dtype(DType::F32)?;
            drop(g);
            let s = candle_nn::ops::sigmoid(&g32)?;
            let silu = (&g32 * &s)?;
            if wants.2 {
                let h = (silu.to_dtype(x.dtype())? * &u)?;
                ddown = Some(accumulate(ddown, gc.t()?.matmul(&h)?)?);
            }
            if !(wants.0 || wants.1) {
                continue;
            }
            let dh = gc.matmul(&down)?.to_dtype(DType::F32)?;
            let dup = (&dh * silu)?;
            // silu'(g) = s · (1 + g · (1 − s)).
            let dsilu = ((g32 * s.affine(-1.0, 1.0)?)?.affine(1.0, 1.0)? * s)?;
            let dgate = (dh * u.to_dtype(DType::F32)?)?.mul(&dsilu)?;
            drop(dsilu);
            let dgu_c = Tensor::cat(&[dgate, dup], 1)?.to_dtype(x.dtype())?;
            if wants.1 {
                dgu = Some(accumulate(dgu, dgu_c.t()?.matmul(&xc)?)?);
            }
            if wants.0 {
                dxs.push(dgu_c.matmul(&gate_up)?);
            }
        }
        let weight = |acc: Option<Tensor>, w: &Tensor, want: bool| -> candle_core::Result<_> {
            Ok(match (want, acc) {
                (false, _) => None,
                (true, Some(acc)) => Some(acc.to_dtype(w.dtype())?),
                (true, None) => Some(w.zeros_like()?),
            })
        };
        let dx = match (wants.0, dxs.is_empty()) {
            (false, _) => None,
            (true, true) => Some(x.zeros_like()?),
            (true, false) => Some(Tensor::cat(&dxs, 0)?),
        };
        Ok((
            dx,
            weight(dgu, &gate_up, wants.1)?,
            weight(ddown, &down, wants.2)?,
        ))
    }
}

impl CustomOp3 for SwiGlu {
    fn name(&self) -> &'static str {
        "chunked-swiglu"
    }

    precomputed_forwards!(3);

    fn bwd(
        &self,
        x: &Tensor,
        gate_up: &Tensor,
        down: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Grads> {
        self.backward(x, gate_up, down, grad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{random, rel};
    use candle_core::{Device, Var};

    const T: usize = 13;
    const D: usize = 8;
    const F: usize = 20;

    /// The MLP's output and the gradients of x, gate, up and down (`None` for a frozen weight)
    /// under a random upstream gradient, by `chunk` (`None`: the reference), in `dtype`.
    fn mlp(chunk: Option<usize>, dtype: DType, frozen: bool) -> Vec<Option<Tensor>> {
        let x = Var::from_tensor(&random(&[T, D], 1)).unwrap();
        let weights: Vec<Tensor> = [(&[F, D][..], 2), (&[F, D], 3), (&[D, F], 4)]
            .into_iter()
            .map(|(shape, seed)| random(shape, seed))
            .collect();
        let vars: Vec<Var> = weights
            .iter()
            .map(|w| Var::from_tensor(w).unwrap())
            .collect();
        let w: Vec<Tensor> = if frozen {
            weights.iter().map(|w| w.to_dtype(dtype).unwrap()).collect()
        } else {
            vars.iter()
                .map(|v| v.as_tensor().to_dtype(dtype).unwrap())
                .collect()
        };
        let xc = x.as_tensor().to_dtype(dtype).unwrap();
        let out = match chunk {
            Some(chunk) => swiglu(&xc, &w[0], &w[1], &w[2], chunk).unwrap(),
            None => swiglu_reference(&xc, &w[0], &w[1], &w[2]).unwrap(),
        };
        let upstream = random(&[T, D], 5).to_dtype(dtype).unwrap();
        let grads = (&out * upstream)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let mut all = vec![Some(out), grads.get(x.as_tensor()).cloned()];
        all.extend(vars.iter().map(|v| grads.get(v.as_tensor()).cloned()));
        all
    }

    #[test]
    fn chunked_mlp_equals_candles_ops_output_and_gradients() {
        let reference = mlp(None, DType::F32, false);
        for chunk in [1, 4, 5, T, T + 7, chunk_rows(F)] {
            let chunked = mlp(Some(chunk), DType::F32, false);
            for (i, what) in ["out", "dx", "dgate", "dup", "ddown"].iter().enumerate() {
                let (a, b) = (chunked[i].as_ref().unwrap(), reference[i].as_ref().unwrap());
                let e = rel(a, b);
                assert!(e < 1e-5, "chunk {chunk}: {what} differs by {e}");
            }
        }
    }

    #[test]
    fn chunked_mlp_equals_candles_ops_within_bf16_rounding() {
        let reference = mlp(None, DType::BF16, false);
        let chunked = mlp(Some(4), DType::BF16, false);
        for (i, what) in ["out", "dx", "dgate", "dup", "ddown"].iter().enumerate() {
            let (a, b) = (chunked[i].as_ref().unwrap(), reference[i].as_ref().unwrap());
            let e = rel(a, b);
            assert!(e < 2e-2, "{what} differs by {e}");
        }
        // The Vars' gradients come back in their fp32.
        assert_eq!(chunked[4].as_ref().unwrap().dtype(), DType::F32);
    }

    #[test]
    fn frozen_weights_get_no_gradient_and_the_input_still_does() {
        let reference = mlp(None, DType::F32, true);
        let chunked = mlp(Some(4), DType::F32, true);
        assert!(chunked[2..].iter().all(Option::is_none));
        let e = rel(chunked[1].as_ref().unwrap(), reference[1].as_ref().unwrap());
        assert!(e < 1e-5, "dx differs by {e}");
    }

    #[test]
    fn a_chunks_temporaries_stay_under_the_memory_bound() {
        for d_ff in [1, 24, 4_864, 8_960, CHUNK_BYTES] {
            let rows = chunk_rows(d_ff);
            assert!(rows >= 1);
            assert!(
                rows == 1 || rows * d_ff * 4 <= CHUNK_BYTES,
                "{d_ff}: {rows}"
            );
        }
        assert_eq!(chunk_rows(4_864), 1_724);
    }

    #[test]
    fn an_empty_batch_and_wrong_shapes() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((0, D), DType::F32, &dev).unwrap();
        let (g, d) = (random(&[F, D], 1), random(&[D, F], 2));
        assert_eq!(swiglu(&x, &g, &g, &d, 4).unwrap().dims(), &[0, D]);
        let err = swiglu(&random(&[3, D], 3), &g, &g, &g, 4).unwrap_err();
        assert!(err.to_string().contains("mlp"), "{err}");
    }
}
