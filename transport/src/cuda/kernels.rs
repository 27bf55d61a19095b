//! The backend's own kernels: odc-kernels' [`ACCUMULATE`] source (every `.cu` of odc lives in
//! odc-kernels), compiled by NVRTC for the device's compute capability through
//! [`odc_kernels::nvrtc`], loaded into its context and launched on its stream.
//!
//! - `odc_add_f32(acc, src, n)`: `acc[i] += src[i]`, fp32 into fp32 — the accumulate of the
//!   transport contract (C2), bit for bit what the host accumulate computes.
//! - `odc_add_bf16(acc, src, n)`: `acc[i] += widen(src[i])`, bf16 into fp32 (widening is exact) —
//!   for gradients pushed in bf16 (the benchmark's `acc-bf16` row; the contract's payloads are
//!   fp32 today).
//! - `odc_encode_bf16(dst, src, n)`: fp32 → bf16, bit for bit the host codec's rounding — a
//!   published bf16 copy written from fp32 values in device memory
//!   ([`DevicePublished::publish_from`](super::DevicePublished::publish_from)).

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream};
use odc_kernels::nvrtc::{KernelError, Module, Param};
use odc_kernels::ACCUMULATE;

use crate::TransportError;

/// A kernel's failure (NVRTC, loading, launching) as the backend's error, its text unchanged
/// (`no NVRTC: …` without NVRTC).
pub(crate) fn kernel_error(e: KernelError) -> TransportError {
    TransportError::Unsupported { what: e.0 }
}

/// The backend's kernels, each elementwise over `n` elements: `(T* dst, const U* src, unsigned
/// long long n)`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Elementwise {
    /// `acc[i] += src[i]`, fp32 into fp32.
    AddF32,
    /// `acc[i] += widen(src[i])`, bf16 into fp32.
    AddBf16,
    /// `dst[i] = bf16(src[i])`, fp32 into bf16.
    EncodeBf16,
}

impl Elementwise {
    /// The kernel's function in [`ACCUMULATE`].
    const fn function(self) -> &'static str {
        match self {
            Elementwise::AddF32 => "odc_add_f32",
            Elementwise::AddBf16 => "odc_add_bf16",
            Elementwise::EncodeBf16 => "odc_encode_bf16",
        }
    }
}

/// The backend's kernels (odc-kernels' [`ACCUMULATE`] source), compiled for one context.
pub(crate) struct Accumulate {
    module: Module,
}

impl Accumulate {
    /// Compile [`ACCUMULATE`] for `ctx`'s device (which must be bound) and load it.
    pub(crate) fn compile(ctx: &Arc<CudaContext>) -> Result<Self, TransportError> {
        Module::compile(ctx, &ACCUMULATE)
            .map(|module| Self { module })
            .map_err(kernel_error)
    }

    /// Enqueue `kernel` over `n` elements on `stream` (not waited for). The caller guarantees
    /// that `dst` and `src` are device memory of the stream's context holding `n` elements each
    /// of the kernel's types.
    pub(crate) fn enqueue(
        &self,
        stream: &CudaStream,
        kernel: Elementwise,
        dst: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        n: usize,
    ) -> Result<(), TransportError> {
        let params = [Param::U64(dst), Param::U64(src), Param::U64(n as u64)];
        // SAFETY: every backend kernel takes (T* dst, const U* src, unsigned long long n); the
        // caller guarantees `n` elements at both addresses.
        unsafe { self.module.enqueue(stream, kernel.function(), n, &params) }.map_err(kernel_error)
    }
}
