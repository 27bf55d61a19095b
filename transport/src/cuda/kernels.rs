//! The backend's device kernels: `kernels.cu` (next to this file), compiled at run time with
//! NVRTC for the device's compute capability and loaded into its context.
//!
//! - `odc_add_f32(acc, src, n)`: `acc[i] += src[i]`, fp32 into fp32 — the accumulate of the
//!   transport contract (C2), bit for bit what the host accumulate computes.
//! - `odc_add_bf16(acc, src, n)`: `acc[i] += widen(src[i])`, bf16 into fp32 (widening is exact) —
//!   for gradients pushed in bf16 (the benchmark's `acc-bf16` row; the contract's payloads are
//!   fp32 today).
//!
//! Both are grid-stride loops (256 threads a block, at most 16 blocks per multiprocessor), so one
//! launch covers any `n`.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

use super::driver::{check_nvrtc, failed};
use crate::TransportError;

/// The kernels' source.
pub(crate) const SOURCE: &str = include_str!("kernels.cu");

/// Threads per block.
const BLOCK: u32 = 256;
/// Blocks per multiprocessor at most (a grid-stride loop needs no more to fill the device).
const BLOCKS_PER_SM: u32 = 16;

/// The compiled kernels of one context.
pub(crate) struct Kernels {
    add_f32: CudaFunction,
    add_bf16: CudaFunction,
    /// Most blocks a launch uses.
    max_blocks: u32,
}

/// NVRTC's complaint, with its log.
fn compile_failed(error: CompileError) -> TransportError {
    let detail = match &error {
        CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}: {}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    };
    TransportError::Unsupported {
        what: format!("cuda: NVRTC could not compile kernels.cu: {detail}"),
    }
}

/// [`SOURCE`] compiled with NVRTC to PTX for compute capability `(major, minor)`. Needs NVRTC
/// only (no driver, no device).
pub(crate) fn ptx((major, minor): (i32, i32)) -> Result<Ptx, TransportError> {
    check_nvrtc()?;
    let options = CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
        name: Some("kernels.cu".into()),
        ..CompileOptions::default()
    };
    compile_ptx_with_opts(SOURCE, options).map_err(compile_failed)
}

impl Kernels {
    /// Compile [`SOURCE`] for `ctx`'s device (which must be bound) and load it.
    pub(crate) fn compile(ctx: &Arc<CudaContext>) -> Result<Self, TransportError> {
        let capability = ctx
            .compute_capability()
            .map_err(|e| failed("reading the compute capability", e))?;
        let module = ctx
            .load_module(ptx(capability)?)
            .map_err(|e| failed("loading the kernels (cuModuleLoadData)", e))?;
        let function = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| failed(&format!("finding kernel {name}"), e))
        };
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| failed("reading the multiprocessor count", e))?;
        Ok(Self {
            add_f32: function("odc_add_f32")?,
            add_bf16: function("odc_add_bf16")?,
            max_blocks: u32::try_from(sms).unwrap_or(1).max(1) * BLOCKS_PER_SM,
        })
    }

    fn config(&self, n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(BLOCK as usize).min(self.max_blocks as usize);
        LaunchConfig {
            grid_dim: (u32::try_from(blocks).unwrap_or(1).max(1), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Enqueue `acc[i] += src[i]` for `n` fp32 elements on `stream` (not waited for). The caller
    /// guarantees `acc` and `src` are device memory of the stream's context holding `n` fp32
    /// elements each.
    pub(crate) fn add_f32(
        &self,
        stream: &CudaStream,
        acc: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        n: usize,
    ) -> Result<(), TransportError> {
        self.launch(&self.add_f32, stream, acc, src, n, "odc_add_f32")
    }

    /// Enqueue `acc[i] += widen(src[i])` for `n` elements (fp32 `acc`, bf16 `src`) on `stream`
    /// (not waited for); the caller guarantees the sizes as for [`Kernels::add_f32`].
    pub(crate) fn add_bf16(
        &self,
        stream: &CudaStream,
        acc: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        n: usize,
    ) -> Result<(), TransportError> {
        self.launch(&self.add_bf16, stream, acc, src, n, "odc_add_bf16")
    }

    fn launch(
        &self,
        function: &CudaFunction,
        stream: &CudaStream,
        acc: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        n: usize,
        name: &str,
    ) -> Result<(), TransportError> {
        if n == 0 {
            return Ok(());
        }
        let count = n as u64;
        let mut launch = stream.launch_builder(function);
        launch.arg(&acc).arg(&src).arg(&count);
        // SAFETY: the kernel takes (float*, const T*, unsigned long long), which the three 8-byte
        // arguments are; the caller guarantees both pointers address `n` elements of device
        // memory of this context, and the kernel touches no index at or past `n`.
        unsafe { launch.launch(self.config(n)) }
            .map(|_| ())
            .map_err(|e| failed(&format!("launching {name}"), e))
    }
}
