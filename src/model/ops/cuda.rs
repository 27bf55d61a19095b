//! The fused kernels of `odc-kernels` on candle's CUDA tensors (feature `cuda`): RMSNorm, rotary
//! embedding and SwiGLU, forward and backward, the chunked head's log-softmax and its logit
//! gradient, causal attention over packed samples (the plain kernel) and decoding's attention
//! over the KV cache, each one launch on the tensors' own stream where candle's ops take several kernels
//! and temporaries.
//!
//! **Opt-in, not yet verified on a GPU**: [`enabled`] is false unless `ODC_FUSED_KERNELS=1`;
//! then [`super::rms_norm`], [`super::rope`], the MLP's SwiGLU
//! ([`crate::model::mlp::swiglu`]) and the chunked head ([`crate::model::head`]) on CUDA tensors
//! run these (their values and their backward), else candle's ops as before. The kernels themselves are checked against
//! their CPU references by `kernels/tests/device.rs`; the model with them on by nothing yet.
//!
//! Guarantees:
//! - Sources are compiled by NVRTC once per process (PTX for compute capability 8.0, which the
//!   driver JIT-compiles for newer devices; `--fmad=false`) and loaded once per device (candle's
//!   custom-module cache); a source that does not compile is an error naming it, never a panic.
//! - Inputs are made contiguous; outputs are fresh tensors on the same stream, so candle's
//!   stream order covers every read and free (one stream per device: no event is needed).
//! - Launches are grid-stride over the kernel's `n` (blocks of 256 threads, at most 4,096
//!   blocks), as the kernels' contract asks.

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Error, Result, Storage, Tensor, D};
use odc_kernels::{Source, ATTENTION, FLASH, LOSS, NORM, ROTARY, SWIGLU};

/// Whether the fused kernels replace candle's ops on CUDA tensors (`ODC_FUSED_KERNELS=1`).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("ODC_FUSED_KERNELS").is_ok_and(|v| v == "1"))
}

/// Whether `t` is a CUDA tensor the kernels take (fp32 or bf16) and they are enabled.
pub fn applies(t: &Tensor) -> bool {
    enabled() && t.device().is_cuda() && matches!(t.dtype(), DType::F32 | DType::BF16)
}

/// `source`'s PTX, compiled once per process.
fn ptx(source: &Source) -> Result<&'static str> {
    static NORM_PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    static ROTARY_PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    static SWIGLU_PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    static LOSS_PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    static ATTENTION_PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    static FLASH_PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    let cell = match source.name {
        "attention.cu" => &ATTENTION_PTX,
        "flash.cu" => &FLASH_PTX,
        "norm.cu" => &NORM_PTX,
        "rotary.cu" => &ROTARY_PTX,
        "swiglu.cu" => &SWIGLU_PTX,
        "loss.cu" => &LOSS_PTX,
        other => return Err(Error::Msg(format!("fused kernels: no cache for {other}"))),
    };
    cell.get_or_init(|| {
        let options = CompileOptions {
            options: vec![
                "--gpu-architecture=compute_80".into(),
                "--fmad=false".into(),
            ],
            name: Some(source.name.into()),
            ..CompileOptions::default()
        };
        compile_ptx_with_opts(source.code, options)
            .map(|ptx| ptx.to_src())
            .map_err(|e| format!("NVRTC could not compile {}: {e:?}", source.name))
    })
    .as_deref()
    .map_err(|e| Error::Msg(e.clone()))
}

fn cuda_of(t: &Tensor) -> Result<CudaDevice> {
    Ok(t.device().as_cuda_device()?.clone())
}

/// `t`'s device address (contiguous fp32, bf16 or i64 on CUDA).
fn address(t: &Tensor, device: &CudaDevice) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(storage) = &*storage else {
        return Err(Error::Msg("fused kernels: a tensor not on CUDA".into()));
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| Error::Msg("fused kernels: a tensor that is not contiguous".into()))?;
    let stream = device.cuda_stream();
    Ok(match t.dtype() {
        DType::F32 => {
            storage
                .as_cuda_slice::<f32>()?
                .slice(start..end)
                .device_ptr(&stream)
                .0
        }
        DType::BF16 => {
            storage
                .as_cuda_slice::<half::bf16>()?
                .slice(start..end)
                .device_ptr(&stream)
                .0
        }
        DType::I64 => {
            storage
                .as_cuda_slice::<i64>()?
                .slice(start..end)
                .device_ptr(&stream)
                .0
        }
        other => return Err(Error::Msg(format!("fused kernels: dtype {other:?}"))),
    })
}

/// A fresh tensor of `shape` and `dtype` on `device` (its values written by a kernel).
fn empty(device: &CudaDevice, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    // SAFETY: every element is written by the kernel the caller launches next on this stream,
    // before anything reads it.
    let storage = match dtype {
        DType::F32 => {
            CudaStorage::wrap_cuda_slice(unsafe { device.alloc::<f32>(n) }?, device.clone())
        }
        DType::BF16 => {
            CudaStorage::wrap_cuda_slice(unsafe { device.alloc::<half::bf16>(n) }?, device.clone())
        }
        other => return Err(Error::Msg(format!("fused kernels: dtype {other:?}"))),
    };
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        shape,
        BackpropOp::none(),
        false,
    ))
}

/// One value a kernel takes: an address or `unsigned long long` (`U`), or a `float` (`F`).
#[derive(Clone, Copy)]
enum Arg {
    U(u64),
    F(f32),
}

/// Launch `function` of `source` over `n` work items with `args`, on `device`'s stream.
fn launch(
    device: &CudaDevice,
    source: &Source,
    function: &str,
    n: usize,
    args: &[Arg],
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let func = device.get_or_load_custom_func(function, source.name, ptx(source)?)?;
    let mut builder = func.builder();
    for arg in args {
        match arg {
            Arg::U(v) => builder.arg(v),
            Arg::F(v) => builder.arg(v),
        };
    }
    let blocks = n.div_ceil(256).clamp(1, 4096) as u32;
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `function`'s parameters are `args` in order (the caller's kernel signature), every
    // address is memory of this device holding the elements the kernel indexes for `n`.
    unsafe { builder.launch(config) }
        .map(|_| ())
        .map_err(|e| Error::Msg(format!("fused kernels: launching {function}: {e}")))
}

fn suffix(t: &Tensor) -> &'static str {
    match t.dtype() {
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

/// RMSNorm over the last dimension: `x r w` in `x`'s dtype (`w` any float dtype, used as fp32).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let device = cuda_of(x)?;
    let x = x.contiguous()?;
    let w = w.to_dtype(DType::F32)?.contiguous()?;
    let cols = x.dim(D::Minus1)?;
    let rows = x.elem_count() / cols.max(1);
    let out = empty(&device, x.dtype(), x.dims())?;
    let args = [
        Arg::U(address(&out, &device)?),
        Arg::U(address(&x, &device)?),
        Arg::U(address(&w, &device)?),
        Arg::U(rows as u64),
        Arg::U(cols as u64),
        Arg::F(eps as f32),
        Arg::U((rows * 32) as u64),
    ];
    let function = format!("odc_rms_norm_fwd_{}", suffix(&x));
    launch(&device, &NORM, &function, rows * 32, &args)?;
    Ok(out)
}

/// RMSNorm's gradients for the output gradient `g`: `dx` in `x`'s dtype and `dw` in fp32.
pub fn rms_norm_backward(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let device = cuda_of(x)?;
    let x = x.contiguous()?;
    let g = g.to_dtype(x.dtype())?.contiguous()?;
    let w = w.to_dtype(DType::F32)?.contiguous()?;
    let cols = x.dim(D::Minus1)?;
    let rows = x.elem_count() / cols.max(1);
    let dx = empty(&device, x.dtype(), x.dims())?;
    let part = empty(&device, DType::F32, &[rows, cols])?;
    let dw = empty(&device, DType::F32, &[cols])?;
    let args = [
        Arg::U(address(&dx, &device)?),
        Arg::U(address(&part, &device)?),
        Arg::U(address(&x, &device)?),
        Arg::U(address(&w, &device)?),
        Arg::U(address(&g, &device)?),
        Arg::U(rows as u64),
        Arg::U(cols as u64),
        Arg::F(eps as f32),
        Arg::U((rows * 32) as u64),
    ];
    let function = format!("odc_rms_norm_bwd_{}", suffix(&x));
    launch(&device, &NORM, &function, rows * 32, &args)?;
    let args = [
        Arg::U(address(&dw, &device)?),
        Arg::U(address(&part, &device)?),
        Arg::U(rows as u64),
        Arg::U(cols as u64),
    ];
    launch(&device, &NORM, "odc_column_sum_f32", cols, &args)?;
    Ok((dx, dw))
}

/// Rotary embedding of `x: [.., T, head_dim]` with `[T, head_dim / 2]` tables, by `sign` times
/// the angles (−1: the backward), in `x`'s dtype.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, sign: f32) -> Result<Tensor> {
    let device = cuda_of(x)?;
    let x = x.contiguous()?;
    let (cos, sin) = (
        cos.to_dtype(DType::F32)?.contiguous()?,
        sin.to_dtype(DType::F32)?.contiguous()?,
    );
    let dim = x.dim(D::Minus1)?;
    let positions = x.dim(D::Minus2)?;
    let pairs = x.elem_count() / 2;
    let out = empty(&device, x.dtype(), x.dims())?;
    let args = [
        Arg::U(address(&out, &device)?),
        Arg::U(address(&x, &device)?),
        Arg::U(address(&cos, &device)?),
        Arg::U(address(&sin, &device)?),
        Arg::U(positions as u64),
        Arg::U(dim as u64),
        Arg::F(sign),
        Arg::U(pairs as u64),
    ];
    let function = format!("odc_rope_{}", suffix(&x));
    launch(&device, &ROTARY, &function, pairs, &args)?;
    Ok(out)
}

/// SwiGLU, `silu(a) b`, in `a`'s dtype (`b` cast to it).
pub fn swiglu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let device = cuda_of(a)?;
    let a = a.contiguous()?;
    let b = b.to_dtype(a.dtype())?.contiguous()?;
    let n = a.elem_count();
    let out = empty(&device, a.dtype(), a.dims())?;
    let args = [
        Arg::U(address(&out, &device)?),
        Arg::U(address(&a, &device)?),
        Arg::U(address(&b, &device)?),
        Arg::U(n as u64),
    ];
    let function = format!("odc_swiglu_fwd_{}", suffix(&a));
    launch(&device, &SWIGLU, &function, n, &args)?;
    Ok(out)
}

/// SwiGLU's gradients `(da, db)` for the output gradient `g`, in `a`'s dtype (`b` and `g` cast to
/// it).
pub fn swiglu_backward(a: &Tensor, b: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    let device = cuda_of(a)?;
    let a = a.contiguous()?;
    let b = b.to_dtype(a.dtype())?.contiguous()?;
    let g = g.to_dtype(a.dtype())?.contiguous()?;
    let n = a.elem_count();
    let da = empty(&device, a.dtype(), a.dims())?;
    let db = empty(&device, a.dtype(), a.dims())?;
    let args = [
        Arg::U(address(&da, &device)?),
        Arg::U(address(&db, &device)?),
        Arg::U(address(&a, &device)?),
        Arg::U(address(&b, &device)?),
        Arg::U(address(&g, &device)?),
        Arg::U(n as u64),
    ];
    let function = format!("odc_swiglu_bwd_{}", suffix(&a));
    launch(&device, &SWIGLU, &function, n, &args)?;
    Ok((da, db))
}

/// Each row's log-probability of its target and its log-sum-exp, fp32 `[n]` each, from fp32
/// `logits: [n, vocab]` and u32 `targets: [n]`: one launch of the loss kernel with every row's
/// weight −1 (its loss is then `x_target − lse`). The kernel writes its gradient over `logits`,
/// which this takes by value: the caller's chunk, read by nothing else.
pub fn target_log_probs(logits: Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let device = cuda_of(&logits)?;
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let (rows, vocab) = logits.dims2()?;
    let targets = targets.to_dtype(DType::I64)?.contiguous()?;
    let weights = Tensor::full(-1f32, rows, logits.device())?;
    let (out, lse) = (
        empty(&device, DType::F32, &[rows])?,
        empty(&device, DType::F32, &[rows])?,
    );
    let at = address(&logits, &device)?;
    let args = [
        Arg::U(address(&out, &device)?),
        Arg::U(address(&lse, &device)?),
        Arg::U(at),
        Arg::U(at),
        Arg::U(address(&targets, &device)?),
        Arg::U(address(&weights, &device)?),
        Arg::U(rows as u64),
        Arg::U(vocab as u64),
        Arg::U((rows * 32) as u64),
    ];
    launch(&device, &LOSS, "odc_cross_entropy_f32", rows * 32, &args)?;
    Ok((out, lse))
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
    let device = cuda_of(logits)?;
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let (rows, cols) = logits.dims2()?;
    let lse = lse.to_dtype(DType::F32)?.contiguous()?;
    let targets = targets.to_dtype(DType::I64)?.contiguous()?;
    // The kernel's weight times (softmax − onehot): the weight is −g.
    let weights = g.to_dtype(DType::F32)?.neg()?.contiguous()?;
    let out = empty(&device, dtype, &[rows, cols])?;
    let n = rows * cols;
    let args = [
        Arg::U(address(&out, &device)?),
        Arg::U(address(&logits, &device)?),
        Arg::U(address(&lse, &device)?),
        Arg::U(address(&targets, &device)?),
        Arg::U(address(&weights, &device)?),
        Arg::U(cols as u64),
        Arg::U(first as u64),
        Arg::U(n as u64),
    ];
    let function = format!("odc_softmax_grad_{}", suffix(&out));
    launch(&device, &LOSS, &function, n, &args)?;
    Ok(out)
}

/// The head widths the attention kernel takes (a warp holds a row in 4 registers per lane).
pub const MAX_ATTENTION_HEAD_DIM: usize = 128;

/// Whether FlashAttention-2's tensor-core kernels (`flash.cu`) take `q: [T, H, hd]`: bf16 at the
/// head widths their tiles take.
fn flash_applies(q: &Tensor) -> bool {
    q.dtype() == DType::BF16 && matches!(q.dim(2), Ok(64 | 96 | 128))
}

/// Threads of a `flash.cu` launch over `tokens` rows (or keys) of `heads` heads: a block of
/// `launch`'s 256 threads (8 warps of 16 rows) per 128 rows and head.
fn flash_threads(tokens: usize, heads: usize) -> usize {
    tokens.div_ceil(128) * heads * 256
}

/// Causal attention over packed samples with grouped-query heads: token-major `q: [T, H, hd]`,
/// `k, v: [T, KV, hd]` in one dtype, `cu_seqlens` i64 `[samples + 1]` (0, each sample's end);
/// `(out [T, H, hd]` in `q`'s dtype, `lse [T, H]` fp32), scores scaled by `scale`. In bf16 with
/// head widths 64, 96 or 128 FlashAttention-2's tiled forward on tensor cores (`flash.cu`), else
/// the plain kernel; the backward takes either's output.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    let device = cuda_of(q)?;
    let (tokens, heads, dim) = q.dims3()?;
    let kv_heads = k.dim(1)?;
    let (q, k, v) = (
        q.contiguous()?,
        k.to_dtype(q.dtype())?.contiguous()?,
        v.to_dtype(q.dtype())?.contiguous()?,
    );
    let cu = cu_seqlens.contiguous()?;
    let samples = cu.elem_count().saturating_sub(1);
    let out = empty(&device, q.dtype(), &[tokens, heads, dim])?;
    let lse = empty(&device, DType::F32, &[tokens, heads])?;
    let flash = flash_applies(&q);
    let n = match flash {
        true => flash_threads(tokens, heads),
        false => tokens * heads * 32,
    };
    let args = [
        Arg::U(address(&out, &device)?),
        Arg::U(address(&lse, &device)?),
        Arg::U(address(&q, &device)?),
        Arg::U(address(&k, &device)?),
        Arg::U(address(&v, &device)?),
        Arg::U(address(&cu, &device)?),
        Arg::U(samples as u64),
        Arg::U(heads as u64),
        Arg::U(kv_heads as u64),
        Arg::U(dim as u64),
        Arg::F(scale),
        Arg::U(n as u64),
    ];
    match flash {
        true => launch(&device, &FLASH, "odc_flash_attention_fwd_bf16", n, &args)?,
        false => {
            let function = format!("odc_attention_fwd_{}", suffix(&q));
            launch(&device, &ATTENTION, &function, n, &args)?;
        }
    }
    Ok((out, lse))
}

/// [`attention`]'s gradients from its output `out`, `lse` and the output's gradient `dout`
/// (token-major as there): `dq` in `q`'s dtype, `dk` and `dv` fp32. Three launches (each row's
/// `dout · out`, then `dq` per query and `dk`, `dv` per key: `flash.cu`'s tiles where
/// [`attention`] takes them, `attention.cu`'s warps otherwise), no atomic adds: the same inputs
/// give the same bits.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    dout: &Tensor,
    lse: &Tensor,
    cu_seqlens: &Tensor,
    scale: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    let device = cuda_of(q)?;
    let (tokens, heads, dim) = q.dims3()?;
    let kv_heads = k.dim(1)?;
    let dtype = q.dtype();
    let (q, k, v, out, dout) = (
        q.contiguous()?,
        k.to_dtype(dtype)?.contiguous()?,
        v.to_dtype(dtype)?.contiguous()?,
        out.to_dtype(dtype)?.contiguous()?,
        dout.to_dtype(dtype)?.contiguous()?,
    );
    let (lse, cu) = (lse.contiguous()?, cu_seqlens.contiguous()?);
    let samples = cu.elem_count().saturating_sub(1);
    let delta = empty(&device, DType::F32, &[tokens, heads])?;
    let rows = tokens * heads * 32;
    let prep = [
        Arg::U(address(&delta, &device)?),
        Arg::U(address(&out, &device)?),
        Arg::U(address(&dout, &device)?),
        Arg::U(dim as u64),
        Arg::U(rows as u64),
    ];
    launch(
        &device,
        &ATTENTION,
        &format!("odc_attention_bwd_prep_{}", suffix(&q)),
        rows,
        &prep,
    )?;
    // The arguments both passes share after their outputs.
    let shared = [
        Arg::U(address(&q, &device)?),
        Arg::U(address(&k, &device)?),
        Arg::U(address(&v, &device)?),
        Arg::U(address(&dout, &device)?),
        Arg::U(address(&lse, &device)?),
        Arg::U(address(&delta, &device)?),
        Arg::U(address(&cu, &device)?),
        Arg::U(samples as u64),
        Arg::U(heads as u64),
        Arg::U(kv_heads as u64),
        Arg::U(dim as u64),
        Arg::F(scale),
    ];
    // The dq and dk/dv passes: FlashAttention-2's tiles where they apply, else the plain ones.
    let (source, prefix, queries, keys) = match flash_applies(&q) {
        true => (
            &FLASH,
            "odc_flash_attention_bwd",
            flash_threads(tokens, heads),
            flash_threads(tokens, kv_heads),
        ),
        false => (
            &ATTENTION,
            "odc_attention_bwd",
            rows,
            tokens * kv_heads * 32,
        ),
    };
    let dq = empty(&device, dtype, &[tokens, heads, dim])?;
    let mut args = vec![Arg::U(address(&dq, &device)?)];
    args.extend_from_slice(&shared);
    args.push(Arg::U(queries as u64));
    let function = format!("{prefix}_dq_{}", suffix(&q));
    launch(&device, source, &function, queries, &args)?;
    let dk = empty(&device, DType::F32, &[tokens, kv_heads, dim])?;
    let dv = empty(&device, DType::F32, &[tokens, kv_heads, dim])?;
    let mut args = vec![
        Arg::U(address(&dk, &device)?),
        Arg::U(address(&dv, &device)?),
    ];
    args.extend_from_slice(&shared);
    args.push(Arg::U(keys as u64));
    let function = format!("{prefix}_dkdv_{}", suffix(&q));
    launch(&device, source, &function, keys, &args)?;
    Ok((dq, dk, dv))
}

/// Decoding's attention: each row's one new query `q: [rows, H, 1, hd]` against columns
/// `pads[r] .. len` of the cache's buffers `k, v: [rows, KV, capacity, hd]` (read in place, no
/// copy of the filled prefix), i64 `pads: [rows]`; `[rows, H, 1, hd]` in `q`'s dtype.
pub fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pads: &Tensor,
    len: usize,
) -> Result<Tensor> {
    let device = cuda_of(q)?;
    let (rows, heads, one, dim) = q.dims4()?;
    let (_, kv_heads, capacity, _) = k.dims4()?;
    if one != 1 || len > capacity || v.dims() != k.dims() || k.dtype() != q.dtype() {
        return Err(Error::Msg(format!(
            "fused decoding attention: q {:?}, k {:?}, v {:?}, {len} columns",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let q = q.contiguous()?;
    let out = empty(&device, q.dtype(), &[rows, heads, 1, dim])?;
    let n = rows * heads * 32;
    let args = [
        Arg::U(address(&out, &device)?),
        Arg::U(address(&q, &device)?),
        Arg::U(address(k, &device)?),
        Arg::U(address(v, &device)?),
        Arg::U(address(pads, &device)?),
        Arg::U(heads as u64),
        Arg::U(kv_heads as u64),
        Arg::U(capacity as u64),
        Arg::U(len as u64),
        Arg::U(dim as u64),
        Arg::F(1.0 / (dim as f32).sqrt()),
        Arg::U(n as u64),
    ];
    let function = format!("odc_decode_attention_{}", suffix(&q));
    launch(&device, &ATTENTION, &function, n, &args)?;
    Ok(out)
}
