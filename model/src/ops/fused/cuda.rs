//! The fused kernels' CUDA backend: PTX compiled by NVRTC, launched on candle's stream.
//!
//! Guarantees:
//! - Sources are compiled by NVRTC once per process (PTX for compute capability 8.0, which the
//!   driver JIT-compiles for newer devices; `--fmad=false`) and loaded once per device (candle's
//!   custom-module cache); a source that does not compile is an error naming it, never a panic.
//! - Outputs are fresh tensors on the device's one stream, where every launch goes too, so
//!   candle's stream order covers every read and free (no event is needed).

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::{CudaDevice, CudaStorage, DType, Error, Result, Storage, Tensor};
use odc_kernels::Source;

use super::buf::{Arg, Buf};

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
    // odc-kernels' one NVRTC compile (`--fmad=false`), for compute capability 8.0: the driver
    // JIT-compiles it for newer devices.
    cell.get_or_init(|| odc_kernels::nvrtc::ptx(source, (8, 0)).map_err(|e| e.0))
        .as_deref()
        .map_err(|e| Error::Msg(e.clone()))
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
    storage_address(storage, start..end, device)
}

/// The device address of elements `range` of `storage` (fp32, bf16 or i64).
fn storage_address(
    storage: &CudaStorage,
    range: std::ops::Range<usize>,
    device: &CudaDevice,
) -> Result<u64> {
    let (start, end) = (range.start, range.end);
    let stream = device.cuda_stream();
    Ok(match storage.dtype() {
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

/// A fresh allocation of `shape` elements of `dtype` on `device` (its values written by a kernel).
pub(super) fn empty(device: &CudaDevice, dtype: DType, shape: &[usize]) -> Result<CudaStorage> {
    let n: usize = shape.iter().product();
    // SAFETY: every element is written by the kernel the caller launches next on this stream,
    // before anything reads it.
    Ok(match dtype {
        DType::F32 => {
            CudaStorage::wrap_cuda_slice(unsafe { device.alloc::<f32>(n) }?, device.clone())
        }
        DType::BF16 => {
            CudaStorage::wrap_cuda_slice(unsafe { device.alloc::<half::bf16>(n) }?, device.clone())
        }
        other => return Err(Error::Msg(format!("fused kernels: dtype {other:?}"))),
    })
}

/// Launch `function` of `source` over `n` work items with `args`, on `device`'s stream.
pub(super) fn launch(
    device: &CudaDevice,
    source: &Source,
    function: &str,
    n: usize,
    args: &[Arg<'_>],
) -> Result<()> {
    let func = device.get_or_load_custom_func(function, source.name, ptx(source)?)?;
    let mut builder = func.builder();
    let mut words = Vec::with_capacity(args.len());
    for arg in args {
        words.push(match *arg {
            Arg::Buffer(Buf::Cuda(t)) => Word::U(address(t, device)?),
            Arg::Buffer(Buf::CudaOut(storage, shape)) => {
                Word::U(storage_address(storage, 0..shape.iter().product(), device)?)
            }
            #[allow(unreachable_patterns)]
            Arg::Buffer(_) => {
                return Err(Error::Msg("fused kernels: a host buffer on CUDA".into()))
            }
            Arg::U64(v) => Word::U(v),
            Arg::I32(v) => Word::I(v),
            Arg::F32(v) => Word::F(v),
            Arg::F64(v) => Word::D(v),
        });
    }
    for word in &words {
        match word {
            Word::U(v) => builder.arg(v),
            Word::I(v) => builder.arg(v),
            Word::F(v) => builder.arg(v),
            Word::D(v) => builder.arg(v),
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

/// A launch parameter's value, held while the builder borrows it.
enum Word {
    U(u64),
    I(i32),
    F(f32),
    D(f64),
}
