//! The fused kernels of `odc-kernels` in the model: RMSNorm, rotary embedding and SwiGLU,
//! forward and backward, the chunked head's log-softmax and its logit gradient, causal attention
//! over packed samples (FlashAttention-2's tiles in bf16, the plain kernel otherwise) and
//! decoding's attention over the KV cache, each one launch where candle's ops take several
//! kernels and temporaries.
//!
//! Where they run ([`applies`]): on CUDA tensors with `ODC_FUSED_KERNELS=1` (feature `cuda`,
//! [`cuda`]), and on CPU tensors while [`emulate_on_cpu`] holds an emulator (feature `emulate`,
//! [`emulated`]: the same CUDA C run on the CPU, what `tests/fused_kernels_on_cpu.rs` checks the
//! model's fused path with). Then [`super::rms_norm`], the residual add with the norm after it
//! ([`super::add_rms_norm`], forward), [`super::rope`], the MLP's SwiGLU
//! ([`crate::mlp::swiglu`]), the chunked head ([`crate::head`]), the packed
//! attention ([`crate::attention`]) and decoding ([`crate::generate`]) compute their
//! values and their backward with these; otherwise candle's ops as before.
//!
//! **Opt-in on CUDA, not yet verified on a GPU**: the kernels are checked against their CPU
//! references by `kernels/tests/` (on the CPU in CI, `device.rs` on a GPU); the model with them
//! on the CPU by `tests/fused_kernels_on_cpu.rs`, on a GPU by `tests/gpu_training.rs`.
//!
//! Guarantees:
//! - Each op is written once against [`launch::Backend`]: the same arguments, layouts and
//!   launches on both backends.
//! - Inputs are made contiguous; outputs are fresh tensors (see [`launch`]).

use std::sync::OnceLock;

use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Result, Shape, Storage, Tensor, D};
use odc_kernels::{LOSS, NORM, ROTARY, SWIGLU};

mod attention;
mod buf;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "emulate")]
mod emulated;
mod launch;

pub use attention::{
    attention, attention_backward, attention_backward_from, decode_attention, Varlen,
    MAX_ATTENTION_HEAD_DIM,
};
use buf::Arg;
#[cfg(feature = "emulate")]
pub use emulated::emulate_on_cpu;
use launch::Backend;

/// Whether the fused kernels replace candle's ops on CUDA tensors (`ODC_FUSED_KERNELS=1`).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("ODC_FUSED_KERNELS").is_ok_and(|v| v == "1"))
}

/// Whether the kernels run on `device`'s tensors (see the module docs).
pub fn runs_on(device: &Device) -> bool {
    launch::runs_on(device)
}

/// The fused kernels launched by this process so far (each op is one to three launches): what a
/// test reads to know the kernels ran, and a measure of a step's launches.
pub fn launches() -> u64 {
    launch::launches()
}

/// Whether `t` is a tensor the kernels take: fp32 or bf16, on a device they run on.
pub fn applies(t: &Tensor) -> bool {
    matches!(t.dtype(), DType::F32 | DType::BF16) && runs_on(t.device())
}

/// A kernel's name's dtype: `bf16`, else `f32`.
fn suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

/// A kernel's output before it is a tensor: a graph node takes it as its own output without a
/// copy (`ops::precomputed::Precomputed::owned`), or it becomes a tensor ([`Output::tensor`]).
pub struct Output {
    storage: Storage,
    shape: Shape,
}

impl Output {
    pub fn tensor(self) -> Tensor {
        Tensor::from_storage(self.storage, self.shape, BackpropOp::none(), false)
    }

    pub(crate) fn into_parts(self) -> (Storage, Shape) {
        (self.storage, self.shape)
    }
}

/// RMSNorm over the last dimension: `x r w` in `x`'s dtype (`w` any float dtype, used as fp32).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(rms_norm_output(x, w, eps)?.tensor())
}

/// [`rms_norm`] as an [`Output`].
pub fn rms_norm_output(x: &Tensor, w: &Tensor, eps: f64) -> Result<Output> {
    let k = Backend::of(x)?;
    let cols = x.dim(D::Minus1)?;
    let rows = x.elem_count() / cols.max(1);
    let out = k.output(x.dtype(), x.dims())?;
    let (xb, wb) = (k.input(x)?, k.input(&w.to_dtype(DType::F32)?)?);
    let args = [
        Arg::Buffer(&out),
        Arg::Buffer(&xb),
        Arg::Buffer(&wb),
        Arg::U64(rows as u64),
        Arg::U64(cols as u64),
        Arg::F32(eps as f32),
        Arg::U64((rows * 32) as u64),
    ];
    let function = format!("odc_rms_norm_fwd_{}", suffix(x.dtype()));
    k.launch(&NORM, &function, rows * 32, &args)?;
    k.output_of(out)
}

/// The residual add and the RMSNorm after it in one launch: `(a + b, rms_norm(a + b, w))`, both
/// in `a`'s dtype (`b` cast to it), the norm taken of the sum as stored (rounded to the dtype),
/// as the two ops compute it.
pub fn add_rms_norm_output(
    a: &Tensor,
    b: &Tensor,
    w: &Tensor,
    eps: f64,
) -> Result<(Output, Output)> {
    let k = Backend::of(a)?;
    let cols = a.dim(D::Minus1)?;
    let rows = a.elem_count() / cols.max(1);
    let (sum, out) = (
        k.output(a.dtype(), a.dims())?,
        k.output(a.dtype(), a.dims())?,
    );
    let (ab, bb, wb) = (
        k.input(a)?,
        k.input(&b.to_dtype(a.dtype())?)?,
        k.input(&w.to_dtype(DType::F32)?)?,
    );
    let args = [
        Arg::Buffer(&sum),
        Arg::Buffer(&out),
        Arg::Buffer(&ab),
        Arg::Buffer(&bb),
        Arg::Buffer(&wb),
        Arg::U64(rows as u64),
        Arg::U64(cols as u64),
        Arg::F32(eps as f32),
        Arg::U64((rows * 32) as u64),
    ];
    let function = format!("odc_add_rms_norm_fwd_{}", suffix(a.dtype()));
    k.launch(&NORM, &function, rows * 32, &args)?;
    Ok((k.output_of(sum)?, k.output_of(out)?))
}

/// RMSNorm's gradients for the output gradient `g`: `dx` in `x`'s dtype and `dw` in fp32.
pub fn rms_norm_backward(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let k = Backend::of(x)?;
    let cols = x.dim(D::Minus1)?;
    let rows = x.elem_count() / cols.max(1);
    let (xb, wb, gb) = (
        k.input(x)?,
        k.input(&w.to_dtype(DType::F32)?)?,
        k.input(&g.to_dtype(x.dtype())?)?,
    );
    let dx = k.output(x.dtype(), x.dims())?;
    let part = k.output(DType::F32, &[rows, cols])?;
    let dw = k.output(DType::F32, &[cols])?;
    let args = [
        Arg::Buffer(&dx),
        Arg::Buffer(&part),
        Arg::Buffer(&xb),
        Arg::Buffer(&wb),
        Arg::Buffer(&gb),
        Arg::U64(rows as u64),
        Arg::U64(cols as u64),
        Arg::F32(eps as f32),
        Arg::U64((rows * 32) as u64),
    ];
    let function = format!("odc_rms_norm_bwd_{}", suffix(x.dtype()));
    k.launch(&NORM, &function, rows * 32, &args)?;
    let args = [
        Arg::Buffer(&dw),
        Arg::Buffer(&part),
        Arg::U64(rows as u64),
        Arg::U64(cols as u64),
    ];
    k.launch(&NORM, "odc_column_sum_f32", cols, &args)?;
    Ok((k.tensor(dx)?, k.tensor(dw)?))
}

/// Rotary embedding of `x` with `[T, head_dim / 2]` tables, by `sign` times the angles (−1: the
/// backward), in `x`'s dtype: heads first (`x: [.., T, head_dim]`, `group` 1) or tokens first
/// (`x: [T, group, head_dim]`, `group` the heads).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, group: usize, sign: f32) -> Result<Tensor> {
    Ok(rope_output(x, cos, sin, group, sign)?.tensor())
}

/// [`rope`] as an [`Output`].
pub fn rope_output(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    group: usize,
    sign: f32,
) -> Result<Output> {
    let k = Backend::of(x)?;
    let dim = x.dim(D::Minus1)?;
    let positions = cos.dim(0)?;
    let pairs = x.elem_count() / 2;
    let (xb, cb, sb) = (
        k.input(x)?,
        k.input(&cos.to_dtype(DType::F32)?)?,
        k.input(&sin.to_dtype(DType::F32)?)?,
    );
    let out = k.output(x.dtype(), x.dims())?;
    let args = [
        Arg::Buffer(&out),
        Arg::Buffer(&xb),
        Arg::Buffer(&cb),
        Arg::Buffer(&sb),
        Arg::U64(positions as u64),
        Arg::U64(group.max(1) as u64),
        Arg::U64(dim as u64),
        Arg::F32(sign),
        Arg::U64(pairs as u64),
    ];
    let function = format!("odc_rope_{}", suffix(x.dtype()));
    k.launch(&ROTARY, &function, pairs, &args)?;
    k.output_of(out)
}

/// SwiGLU, `silu(a) b`, in `a`'s dtype (`b` cast to it).
pub fn swiglu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let k = Backend::of(a)?;
    let n = a.elem_count();
    let (ab, bb) = (k.input(a)?, k.input(&b.to_dtype(a.dtype())?)?);
    let out = k.output(a.dtype(), a.dims())?;
    let args = [
        Arg::Buffer(&out),
        Arg::Buffer(&ab),
        Arg::Buffer(&bb),
        Arg::U64(n as u64),
    ];
    let function = format!("odc_swiglu_fwd_{}", suffix(a.dtype()));
    k.launch(&SWIGLU, &function, n, &args)?;
    k.tensor(out)
}

/// SwiGLU's gradients `(da, db)` for the output gradient `g`, in `a`'s dtype (`b` and `g` cast to
/// it).
pub fn swiglu_backward(a: &Tensor, b: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    let k = Backend::of(a)?;
    let n = a.elem_count();
    let (ab, bb, gb) = (
        k.input(a)?,
        k.input(&b.to_dtype(a.dtype())?)?,
        k.input(&g.to_dtype(a.dtype())?)?,
    );
    let da = k.output(a.dtype(), a.dims())?;
    let db = k.output(a.dtype(), a.dims())?;
    let args = [
        Arg::Buffer(&da),
        Arg::Buffer(&db),
        Arg::Buffer(&ab),
        Arg::Buffer(&bb),
        Arg::Buffer(&gb),
        Arg::U64(n as u64),
    ];
    let function = format!("odc_swiglu_bwd_{}", suffix(a.dtype()));
    k.launch(&SWIGLU, &function, n, &args)?;
    Ok((k.tensor(da)?, k.tensor(db)?))
}

/// Each row's log-probability of its target and its log-sum-exp, fp32 `[n]` each, from fp32
/// `logits: [n, vocab]` and u32 `targets: [n]`: one launch of the loss kernel with every row's
/// weight −1 (its loss is then `x_target − lse`). The kernel writes its gradient over `logits`,
/// which this takes by value: the caller's chunk, read by nothing else.
pub fn target_log_probs(logits: Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let k = Backend::of(&logits)?;
    let (rows, vocab) = logits.dims2()?;
    let (targets, weights) = (
        k.input(&targets.to_dtype(DType::I64)?)?,
        k.input(&Tensor::full(-1f32, rows, logits.device())?)?,
    );
    let logits = k.input(&logits.to_dtype(DType::F32)?)?;
    let (out, lse) = (
        k.output(DType::F32, &[rows])?,
        k.output(DType::F32, &[rows])?,
    );
    let args = [
        Arg::Buffer(&out),
        Arg::Buffer(&lse),
        Arg::Buffer(&logits),
        Arg::Buffer(&logits),
        Arg::Buffer(&targets),
        Arg::Buffer(&weights),
        Arg::U64(rows as u64),
        Arg::U64(vocab as u64),
        Arg::U64((rows * 32) as u64),
    ];
    k.launch(&LOSS, "odc_cross_entropy_f32", rows * 32, &args)?;
    Ok((k.tensor(out)?, k.tensor(lse)?))
}

/// The chunked head's logit gradient `g ⊙ (onehot(target) − softmax)` of the classes
/// `first .. first + cols` of fp32 `logits: [n, cols]`, from each row's saved `lse: [n]`, u32
/// `targets: [n]` and the result's gradient `g: [n]`, in `dtype` (fp32 or bf16).
pub fn softmax_grad(
    logits: &Tensor,
    lse: &Tensor,
    targets: &Tensor,
    g: &Tensor,
    first: usize,
    dtype: DType,
) -> Result<Tensor> {
    let k = Backend::of(logits)?;
    let (rows, cols) = logits.dims2()?;
    let (lb, eb, tb) = (
        k.input(&logits.to_dtype(DType::F32)?)?,
        k.input(&lse.to_dtype(DType::F32)?)?,
        k.input(&targets.to_dtype(DType::I64)?)?,
    );
    // The kernel's weight times (softmax − onehot): the weight is −g.
    let wb = k.input(&g.to_dtype(DType::F32)?.neg()?)?;
    let out = k.output(dtype, &[rows, cols])?;
    let n = rows * cols;
    let args = [
        Arg::Buffer(&out),
        Arg::Buffer(&lb),
        Arg::Buffer(&eb),
        Arg::Buffer(&tb),
        Arg::Buffer(&wb),
        Arg::U64(cols as u64),
        Arg::U64(first as u64),
        Arg::U64(n as u64),
    ];
    let function = format!("odc_softmax_grad_{}", suffix(dtype));
    k.launch(&LOSS, &function, n, &args)?;
    k.tensor(out)
}
