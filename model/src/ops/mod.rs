//! Differentiable forms of the transformer's fused ops.
//!
//! candle 0.11.1's fused `candle_nn::ops::{softmax_last_dim, rms_norm, layer_norm}`,
//! `candle_nn::rotary_emb::rope*` and `sdpa` have **no backward**: a graph through them silently
//! drops the gradients of everything upstream (the result is not tracked, no error is raised). The
//! ops here compute their values with basic tensor ops (exp, sum, div, sqr, mean, narrow, cat,
//! mul, add). Softmax and log-softmax leave the differentiation to candle; RMSNorm, rotary
//! embedding, SiLU and the linear layer are each one graph node with a hand-written backward, because candle's
//! differentiation of their basic ops keeps every intermediate in the graph and, in the backward,
//! each accumulated gradient's zero tensor and partial sums — several activation-sized tensors per
//! op and token, most of a long sequence's memory after the attention and the MLP are chunked.
//!
//! Guarantees (each has a test named after it):
//! 1. Each op's forward equals candle's fused version within 1e-5 on random fp32 inputs.
//! 2. Each op's backward gives finite, non-zero gradients that match central finite differences.
//! 3. The fused versions indeed drop gradients in this candle version — if that test starts failing,
//!    candle grew backward passes and the fused kernels may be used again.
//! 4. **Mixed precision**: softmax, log-softmax and RMSNorm compute in fp32 whatever their input's
//!    dtype (a bf16 input is cast up first; the cast is differentiable), softmax and log-softmax
//!    return fp32, RMSNorm and rotary embedding return their input's dtype. On fp32 inputs every
//!    cast is the identity (candle's `to_dtype` to the same dtype returns the tensor itself), so
//!    fp32 results are unchanged bit for bit.
//! 5. **Lean backwards equal candle's**: RMSNorm's, rotary embedding's, SiLU's and [`linear`]'s
//!    gradients equal
//!    candle's differentiation of the same values within 1e-5 (fp32); nothing is computed for an
//!    input that does not track gradients, and an untracked input gets the plain values (no op).

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
    D,
};

pub mod fused;
pub(crate) mod precomputed;

use precomputed::{precomputed_forwards, Precomputed};

/// Softmax over the last dimension: `exp(x - max) / sum(exp(x - max))`, in fp32 (and returned in
/// fp32) whatever `x`'s dtype.
///
/// The max is detached: the result does not depend on it mathematically, so no gradient is lost,
/// and none flows through the (tie-breaking) max reduction.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    let max = x.max_keepdim(D::Minus1)?.detach();
    let num = x.broadcast_sub(&max)?.exp()?;
    let den = num.sum_keepdim(D::Minus1)?;
    num.broadcast_div(&den)
}

/// Log-softmax over the last dimension: `x - max - log(sum(exp(x - max)))` (max detached), in
/// fp32 (and returned in fp32) whatever `x`'s dtype.
pub fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let log_den = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&log_den)
}

/// RMSNorm over the last dimension: `x / sqrt(mean(x²) + eps) * weight`, `weight: [d]`; computed
/// in fp32, returned in `x`'s dtype. One graph node ([`LeanRmsNorm`]) whose backward is computed
/// from `x` alone: the graph keeps no intermediate, and the backward's few `x`-sized
/// temporaries are freed as it goes (candle's ops would keep the square, the quotient and the
/// product, and each accumulated gradient's zero tensor and partial sums).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let (xd, wd) = (x.detach(), weight.detach());
    if !(x.track_op() || weight.track_op()) {
        return rms_norm_values(&xd, &wd, eps);
    }
    // A fused kernel's output becomes the node's own, no copy.
    let out = match fused::applies(x) {
        true => Precomputed::owned("rms norm", fused::rms_norm_output(&xd, &wd, eps)?),
        false => Precomputed::new("rms norm", rms_norm_values(&xd, &wd, eps)?),
    };
    x.apply_op2(weight, LeanRmsNorm { eps, out })
}

/// The residual stream and the norm that follows it: `(h, rms_norm(h, weight))` with
/// `h = x + y`. Where the fused kernels run, one launch writes both (the norm of `h` as stored);
/// the graph records `h` as an add of `x` and `y` ([`PrecomputedAdd`]: the gradient goes to both)
/// and the norm as [`rms_norm`]'s node on `h`, so the backward is the two ops' own. Otherwise it
/// is the two ops.
pub fn add_rms_norm(x: &Tensor, y: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    if !fused::applies(x) || x.dims() != y.dims() || x.dtype() != y.dtype() {
        let h = (x + y)?;
        let n = rms_norm(&h, weight, eps)?;
        return Ok((h, n));
    }
    let (sum, out) = fused::add_rms_norm_output(&x.detach(), &y.detach(), &weight.detach(), eps)?;
    let h = match x.track_op() || y.track_op() {
        true => x.apply_op2(
            y,
            PrecomputedAdd {
                out: Precomputed::owned("residual add", sum),
            },
        )?,
        false => sum.tensor(),
    };
    let n = match h.track_op() || weight.track_op() {
        true => h.apply_op2(
            weight,
            LeanRmsNorm {
                eps,
                out: Precomputed::owned("rms norm", out),
            },
        )?,
        false => out.tensor(),
    };
    Ok((h, n))
}

/// [`add_rms_norm`]'s sum: `x + y`, computed beforehand.
struct PrecomputedAdd {
    out: Precomputed,
}

impl CustomOp2 for PrecomputedAdd {
    fn name(&self) -> &'static str {
        "residual-add-precomputed"
    }

    precomputed_forwards!(2);

    fn bwd(
        &self,
        x: &Tensor,
        y: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((
            x.track_op().then(|| grad.clone()),
            y.track_op().then(|| grad.clone()),
        ))
    }
}

/// [`rms_norm`]'s values (candle's ops, no graph of interest).
fn rms_norm_values(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if fused::applies(x) {
        return fused::rms_norm(x, weight, eps);
    }
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let mean_sq = x.sqr()?.mean_keepdim(D::Minus1)?;
    let denom = (mean_sq + eps)?.sqrt()?;
    x.broadcast_div(&denom)?
        .broadcast_mul(&weight.to_dtype(DType::F32)?)?
        .to_dtype(dtype)
}

/// [`rms_norm`]'s op.
struct LeanRmsNorm {
    eps: f64,
    out: Precomputed,
}

impl CustomOp2 for LeanRmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm-lean-backward"
    }

    precomputed_forwards!(2);

    /// With `r = 1 / sqrt(mean(x²) + eps)` and `x̂ = x r`: `dweight = Σ g ⊙ x̂` over every row,
    /// `dx = r (g w − x̂ · mean(g w ⊙ x̂))`, in fp32.
    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if fused::applies(x) {
            let (dx, dw) =
                fused::rms_norm_backward(&x.detach(), &weight.detach(), &grad.detach(), self.eps)?;
            let dx = x.track_op().then_some(dx);
            let dw = match weight.track_op() {
                true => Some(dw.to_dtype(weight.dtype())?),
                false => None,
            };
            return Ok((dx, dw));
        }
        let f32 = |t: &Tensor| t.detach().to_dtype(DType::F32);
        let (x32, w, g) = (f32(x)?, f32(weight)?, f32(grad)?);
        let r = (x32.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?
            .sqrt()?
            .recip()?;
        let xhat = x32.broadcast_mul(&r)?;
        drop(x32);
        let dweight = if weight.track_op() {
            let d = w.dim(0)?;
            let sum = (&g * &xhat)?.reshape(((), d))?.sum(0)?;
            Some(sum.to_dtype(weight.dtype())?)
        } else {
            None
        };
        let dx = if x.track_op() {
            let gw = g.broadcast_mul(&w)?;
            drop(g);
            let dot = (&gw * &xhat)?.mean_keepdim(D::Minus1)?;
            let dx = (gw - xhat.broadcast_mul(&dot)?)?.broadcast_mul(&r)?;
            Some(dx.to_dtype(x.dtype())?)
        } else {
            None
        };
        Ok((dx, dweight))
    }
}

/// SiLU, `x * sigmoid(x)`: candle's unary kernel forward, and a backward that holds fewer
/// temporaries than candle's own (whose one statement keeps about seven tensors of the MLP's width
/// alive at once, the widest point of a block's backward; this one keeps three).
pub fn silu(x: &Tensor) -> Result<Tensor> {
    x.apply_op1(LeanSilu)
}

/// [`silu`]'s op.
struct LeanSilu;

impl CustomOp1 for LeanSilu {
    fn name(&self) -> &'static str {
        "silu-lean-backward"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((
            storage.unary_impl::<candle_core::op::Silu>(layout)?,
            layout.shape().clone(),
        ))
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        Ok((
            storage.unary_impl::<candle_core::op::Silu>(layout)?,
            layout.shape().clone(),
        ))
    }

    /// `silu'(x) = s · (1 − y) + y` with `s = sigmoid(x)`, `y = silu(x)` (the result), each step
    /// replacing the previous tensor.
    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (x, y) = (arg.detach(), res.detach());
        let s = candle_nn::ops::sigmoid(&x)?;
        drop(x);
        let mut d = y.affine(-1.0, 1.0)?;
        d = (d * &s)?;
        drop(s);
        d = (d + &y)?;
        Ok(Some((grad * d)?))
    }
}

/// Rotary embedding, non-interleaved ("rotate half", as Llama): `x: [.., T, head_dim]`,
/// `cos, sin: [T, head_dim / 2]` (the angles of each token's own position, see [`rope_cos_sin`]).
/// Computed in fp32, returned in `x`'s dtype. One graph node ([`LeanRope`]) whose backward is the
/// rotation by the opposite angles: the graph keeps no intermediate.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rope_in(x, cos, sin, false)
}

/// [`rope`] of tokens first: `x: [T, heads, head_dim]`, every head of token `t` at its angles.
pub fn rope_tokens(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rope_in(x, cos, sin, true)
}

/// [`rope`] (heads first) or [`rope_tokens`] (`tokens_first`).
fn rope_in(x: &Tensor, cos: &Tensor, sin: &Tensor, tokens_first: bool) -> Result<Tensor> {
    let xd = x.detach();
    if !x.track_op() {
        return rope_values(&xd, cos, sin, tokens_first);
    }
    // A fused kernel's output becomes the node's own, no copy.
    let out = match fused_rope_group(&xd, cos, tokens_first)? {
        Some(group) => {
            let out = fused::rope_output(&xd, cos, sin, group, 1.0)?;
            Precomputed::owned("rotary embedding", out)
        }
        None => Precomputed::new(
            "rotary embedding",
            rope_values(&xd, cos, sin, tokens_first)?,
        ),
    };
    let op = LeanRope {
        cos: cos.detach(),
        sin: sin.detach(),
        tokens_first,
        out,
    };
    x.apply_op1(op)
}

/// The rows sharing a position, where the rotary kernel takes `x` (its angles shared by every
/// row: `[positions, head_dim / 2]`; a padded decoding batch's per-row angles take candle's ops).
fn fused_rope_group(x: &Tensor, cos: &Tensor, tokens_first: bool) -> Result<Option<usize>> {
    if !(fused::applies(x) && cos.rank() == 2) {
        return Ok(None);
    }
    Ok(Some(if tokens_first { x.dim(1)? } else { 1 }))
}

/// [`rope_in`]'s values.
fn rope_values(x: &Tensor, cos: &Tensor, sin: &Tensor, tokens_first: bool) -> Result<Tensor> {
    if let Some(group) = fused_rope_group(x, cos, tokens_first)? {
        return fused::rope(x, cos, sin, group, 1.0);
    }
    let dtype = x.dtype();
    let x = &x.to_dtype(DType::F32)?;
    let (cos, sin) = (&cos.to_dtype(DType::F32)?, &sin.to_dtype(DType::F32)?);
    // Tokens first: each token's angles over its heads.
    let (cos, sin) = match tokens_first {
        true => (&cos.unsqueeze(1)?, &sin.unsqueeze(1)?),
        false => (cos, sin),
    };
    let half = x.dim(D::Minus1)? / 2;
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, half)?,
        x.narrow(D::Minus1, half, half)?,
    );
    // Each half on its own (`x1 cos − x2 sin`, `x2 cos + x1 sin`): half-width temporaries only.
    let first = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let second = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
    Tensor::cat(&[first, second], D::Minus1)?.to_dtype(dtype)
}

/// [`rope`]'s op.
struct LeanRope {
    cos: Tensor,
    sin: Tensor,
    tokens_first: bool,
    out: Precomputed,
}

impl CustomOp1 for LeanRope {
    fn name(&self) -> &'static str {
        "rope-lean-backward"
    }

    precomputed_forwards!(1);

    /// A rotation's transpose is the rotation by the opposite angle: `dx = rope(g, cos, −sin)`.
    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(rope_values(
            &grad.detach(),
            &self.cos,
            &self.sin.neg()?,
            self.tokens_first,
        )?))
    }
}

/// `x wᵀ (+ bias)`: `x: [T, in]`, `w: [out, in]`, `bias: [out]`, in `x`'s dtype (the weights cast
/// to it by the caller). One graph node ([`LeanLinear`]) whose backward computes from detached
/// tensors: candle's matmul backward returns gradients that are themselves graph nodes (they
/// read the tracked weight), so each accumulated input gradient would keep its zero tensor, its
/// partial and the output's gradient alive until the input is differentiated.
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let mut out = x.detach().matmul(&w.detach().t()?)?;
    if let Some(b) = bias {
        out = out.broadcast_add(&b.detach())?;
    }
    let tracked = x.track_op() || w.track_op() || bias.is_some_and(Tensor::track_op);
    if !tracked {
        return Ok(out);
    }
    let op = LeanLinear {
        out: Precomputed::new("linear", out),
    };
    match bias {
        Some(b) => x.apply_op3(w, b, op),
        None => x.apply_op2(w, op),
    }
}

/// [`linear`]'s op (a [`CustomOp2`] without bias, a [`CustomOp3`] with it).
struct LeanLinear {
    out: Precomputed,
}

impl LeanLinear {
    /// `dx = g w`, `dw = gᵀ x`, `dbias = Σ_t g`, each only for an input that tracks gradients.
    fn backward(
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        grad: &Tensor,
    ) -> Result<[Option<Tensor>; 3]> {
        let g = grad.detach();
        let dx = match x.track_op() {
            true => Some(g.matmul(&w.detach())?),
            false => None,
        };
        let dw = match w.track_op() {
            true => Some(g.t()?.matmul(&x.detach())?),
            false => None,
        };
        let dbias = match bias {
            Some(b) if b.track_op() => Some(g.sum(0)?),
            _ => None,
        };
        Ok([dx, dw, dbias])
    }
}

impl CustomOp2 for LeanLinear {
    fn name(&self) -> &'static str {
        "linear-lean-backward"
    }

    precomputed_forwards!(2);

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let [dx, dw, _] = Self::backward(x, w, None, grad)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for LeanLinear {
    fn name(&self) -> &'static str {
        "linear-bias-lean-backward"
    }

    precomputed_forwards!(3);

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dx, dw, dbias] = Self::backward(x, w, Some(bias), grad)?;
        Ok((dx, dw, dbias))
    }
}

/// The rotary angles of each token: `cos, sin: [T, head_dim / 2]` with angle
/// `positions[t] * inv_freq[i]` (`inv_freq` from
/// [`ModelConfig::rope_inv_freq`](super::ModelConfig::rope_inv_freq)). `positions: [T]` (u32), on
/// the device of the result.
pub fn rope_cos_sin(positions: &Tensor, inv_freq: &[f32]) -> Result<(Tensor, Tensor)> {
    let half = inv_freq.len();
    let inv_freq = Tensor::from_slice(inv_freq, (1, half), positions.device())?;
    let angles = positions
        .to_dtype(DType::F32)?
        .unsqueeze(1)?
        .broadcast_mul(&inv_freq)?;
    Ok((angles.cos()?, angles.sin()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs_diff, random};
    use candle_core::{Device, Var};

    /// Checks the gradient of `sum(f(x) * r)` w.r.t. `x` against central finite differences.
    fn check_grad(f: impl Fn(&Tensor) -> Result<Tensor>, shape: &[usize], seed: u64) {
        let x0 = random(shape, seed);
        let x = Var::from_tensor(&x0).unwrap();
        let out_shape = f(&x0).unwrap().dims().to_vec();
        let r = random(&out_shape, seed + 1);
        let loss = |x: &Tensor| -> f64 {
            let l = (f(x).unwrap() * &r).unwrap().sum_all().unwrap();
            l.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
        };
        let grads = (f(x.as_tensor()).unwrap() * &r)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g: Vec<f32> = grads
            .get(x.as_tensor())
            .expect("no gradient reached the input")
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(g.iter().all(|v| v.is_finite()), "non-finite gradient {g:?}");
        assert!(g.iter().any(|v| *v != 0.0), "all-zero gradient");
        let base: Vec<f32> = x0.flatten_all().unwrap().to_vec1().unwrap();
        let eps = 1e-2f32;
        let (mut diff2, mut norm2) = (0f64, 0f64);
        for k in 0..base.len() {
            let mut plus = base.clone();
            plus[k] += eps;
            let mut minus = base.clone();
            minus[k] -= eps;
            let plus = Tensor::from_vec(plus, shape, &Device::Cpu).unwrap();
            let minus = Tensor::from_vec(minus, shape, &Device::Cpu).unwrap();
            let fd = (loss(&plus) - loss(&minus)) / (2.0 * eps as f64);
            diff2 += (fd - g[k] as f64).powi(2);
            norm2 += fd.powi(2);
        }
        let rel = (diff2 / norm2).sqrt();
        assert!(
            rel < 1e-2,
            "gradient differs from finite differences: relative error {rel}"
        );
    }

    /// Whether a backward of `sum(f(x) * r)` gives `x` any non-zero gradient.
    fn gradient_reaches_input(f: impl Fn(&Tensor) -> Result<Tensor>, shape: &[usize]) -> bool {
        let x = Var::from_tensor(&random(shape, 3)).unwrap();
        let y = f(x.as_tensor()).unwrap();
        let r = random(y.dims(), 4);
        let grads = (y * r).unwrap().sum_all().unwrap().backward().unwrap();
        match grads.get(x.as_tensor()) {
            None => false,
            Some(g) => {
                g.abs()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
                    > 0.0
            }
        }
    }

    fn cos_sin(t: usize, head_dim: usize, offset: u32) -> (Tensor, Tensor) {
        let positions: Vec<u32> = (0..t as u32).map(|p| p * 3 + offset).collect();
        let positions = Tensor::from_vec(positions, t, &Device::Cpu).unwrap();
        let config = crate::ModelConfig {
            d_model: head_dim,
            n_heads: 1,
            ..crate::ModelConfig::tiny()
        };
        rope_cos_sin(&positions, &config.rope_inv_freq()).unwrap()
    }

    #[test]
    fn softmax_matches_fused_forward() {
        let x = (random(&[3, 5, 17], 1) * 4.0).unwrap();
        let fused = candle_nn::ops::softmax_last_dim(&x).unwrap();
        assert!(max_abs_diff(&softmax_last_dim(&x).unwrap(), &fused) < 1e-5);
        let log = log_softmax_last_dim(&x).unwrap().exp().unwrap();
        assert!(max_abs_diff(&log, &fused) < 1e-5);
    }

    #[test]
    fn rms_norm_matches_fused_forward() {
        let x = random(&[4, 6, 32], 2);
        let w = random(&[32], 3);
        let fused = candle_nn::ops::rms_norm(&x, &w, 1e-5).unwrap();
        assert!(max_abs_diff(&rms_norm(&x, &w, 1e-5).unwrap(), &fused) < 1e-5);
    }

    /// Tokens first (`[T, H, hd]`) is heads first transposed, forward and backward.
    #[test]
    fn rope_tokens_is_rope_of_the_transposed_layout() {
        let (h, t, hd) = (3, 7, 8);
        let (cos, sin) = cos_sin(t, hd, 2);
        let x = Var::from_tensor(&random(&[1, h, t, hd], 4)).unwrap();
        let r = random(&[1, h, t, hd], 5);
        let heads_first = rope(x.as_tensor(), &cos, &sin).unwrap();
        let tokens = x.as_tensor().get(0).unwrap().transpose(0, 1).unwrap();
        let tokens_first = rope_tokens(&tokens, &cos, &sin).unwrap();
        let back = tokens_first.transpose(0, 1).unwrap().unsqueeze(0).unwrap();
        assert!(max_abs_diff(&back, &heads_first) < 1e-6);
        let grad = |y: &Tensor| {
            let g = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            g.get(x.as_tensor()).unwrap().clone()
        };
        assert!(max_abs_diff(&grad(&back), &grad(&heads_first)) < 1e-6);
    }

    #[test]
    fn rope_matches_fused_forward() {
        let (t, hd) = (9, 16);
        let x = random(&[1, 3, t, hd], 4);
        let (cos, sin) = cos_sin(t, hd, 5);
        let fused = candle_nn::rotary_emb::rope(&x, &cos, &sin).unwrap();
        assert!(max_abs_diff(&rope(&x, &cos, &sin).unwrap(), &fused) < 1e-5);
        let slow = candle_nn::rotary_emb::rope_slow(&x, &cos, &sin).unwrap();
        assert!(max_abs_diff(&rope(&x, &cos, &sin).unwrap(), &slow) < 1e-5);
    }

    #[test]
    fn softmax_gradient_matches_finite_differences() {
        check_grad(softmax_last_dim, &[2, 5], 10);
        check_grad(log_softmax_last_dim, &[2, 5], 11);
    }

    #[test]
    fn rms_norm_gradient_matches_finite_differences() {
        let w = random(&[6], 12);
        check_grad(|x| rms_norm(x, &w, 1e-5), &[3, 6], 13);
        let x = random(&[3, 6], 14);
        check_grad(|w| rms_norm(&x, w, 1e-5), &[6], 15);
    }

    #[test]
    fn rope_gradient_matches_finite_differences() {
        let (cos, sin) = cos_sin(3, 4, 1);
        check_grad(|x| rope(x, &cos, &sin), &[2, 3, 4], 16);
    }

    #[test]
    fn silu_gradient_matches_finite_differences() {
        check_grad(silu, &[2, 7], 17);
        // And candle's own SiLU, forward and backward.
        let x = candle_core::Var::from_tensor(&(random(&[3, 40], 5) * 4.0).unwrap()).unwrap();
        let w = random(&[3, 40], 6);
        let grad_of = |y: Tensor| {
            (y * &w)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap()
                .get(x.as_tensor())
                .unwrap()
                .clone()
        };
        let (ours, theirs) = (silu(x.as_tensor()).unwrap(), x.as_tensor().silu().unwrap());
        assert!(max_abs_diff(&ours, &theirs) < 1e-6);
        assert!(max_abs_diff(&grad_of(ours), &grad_of(theirs)) < 1e-5);
    }

    #[test]
    fn lean_backwards_equal_candles_own_differentiation() {
        // The gradients of x (and w) of sum(f(x, w) * r), through the lean op and through
        // candle's differentiation of the same values.
        let grads = |lean: bool, which: usize| -> Vec<Tensor> {
            let x = Var::from_tensor(&random(&[2, 3, 5, 8], 20)).unwrap();
            let w = Var::from_tensor(&random(&[8], 21)).unwrap();
            let (cos, sin) = cos_sin(5, 8, 2);
            let (xt, wt) = (x.as_tensor(), w.as_tensor());
            let y = match (which, lean) {
                (0, true) => rms_norm(xt, wt, 1e-5),
                (0, false) => rms_norm_values(xt, wt, 1e-5),
                (1, true) => rope(xt, &cos, &sin),
                (1, false) => rope_values(xt, &cos, &sin, false),
                (2, true) => silu(xt),
                (2, false) => xt.silu(),
                (_, lean) => {
                    let x2 = xt.reshape((30, 8)).unwrap();
                    let m = wt.reshape((2, 4)).unwrap().repeat((4, 2)).unwrap();
                    let b = wt.narrow(0, 0, 8).unwrap();
                    match lean {
                        true => linear(&x2, &m, Some(&b)),
                        false => x2.matmul(&m.t().unwrap()).unwrap().broadcast_add(&b),
                    }
                }
            }
            .unwrap();
            let r = random(y.dims(), 22);
            let g = (y * r).unwrap().sum_all().unwrap().backward().unwrap();
            [xt, wt].iter().filter_map(|t| g.get(t).cloned()).collect()
        };
        for (which, what) in ["rms norm", "rope", "silu", "linear"].iter().enumerate() {
            let (lean, candle) = (grads(true, which), grads(false, which));
            assert_eq!(lean.len(), candle.len(), "{what}");
            for (a, b) in lean.iter().zip(&candle) {
                let diff = max_abs_diff(a, b);
                assert!(diff < 1e-5, "{what}: {diff}");
            }
        }
        // Untracked inputs: the plain values, no op in the way.
        let x = random(&[3, 8], 23);
        let y = rms_norm(&x, &random(&[8], 24), 1e-5).unwrap();
        assert!(!y.track_op());
        // A frozen weight gets nothing, the input still does.
        let xv = Var::from_tensor(&x).unwrap();
        let w = random(&[8], 24);
        let g = rms_norm(xv.as_tensor(), &w, 1e-5)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert!(g.get(&w).is_none() && g.get(xv.as_tensor()).is_some());
    }

    #[test]
    fn fused_candle_ops_drop_gradients() {
        let (cos, sin) = cos_sin(3, 4, 0);
        let w = random(&[4], 5);
        assert!(gradient_reaches_input(softmax_last_dim, &[2, 4]));
        assert!(!gradient_reaches_input(
            candle_nn::ops::softmax_last_dim,
            &[2, 4]
        ));
        assert!(gradient_reaches_input(|x| rms_norm(x, &w, 1e-5), &[2, 4]));
        assert!(!gradient_reaches_input(
            |x| candle_nn::ops::rms_norm(x, &w, 1e-5),
            &[2, 4]
        ));
        assert!(gradient_reaches_input(
            |x| rope(x, &cos, &sin),
            &[1, 2, 3, 4]
        ));
        assert!(!gradient_reaches_input(
            |x| candle_nn::rotary_emb::rope(x, &cos, &sin),
            &[1, 2, 3, 4]
        ));
    }
}
