//! Where a fused kernel runs, and its memory: [`Backend`] is the CUDA device of the tensors
//! (feature `cuda`, [`super::cuda`]) or this CPU through `odc_kernels::emulate` (feature
//! `emulate`, [`super::emulated`]); the ops in [`super`] are written once against it.
//!
//! Guarantees:
//! - An op reads its tensors through [`Backend::input`] (contiguous, the tensor's own dtype) and
//!   writes fresh [`Backend::output`]s that become tensors with [`Backend::tensor`] after the
//!   launches; an output may be read by a later launch of the same op (a partial sum).
//! - Launches are grid-stride over the kernel's `n`: on CUDA blocks of 256 threads (at most
//!   4,096 blocks, as the kernels' contract asks), emulated one block of 256 threads whose loops
//!   cover the grid.
//! - With neither feature there is no backend: [`Backend::of`] is an error and nothing calls it
//!   ([`super::applies`] is false).

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Error, Result, Shape, Storage, Tensor};
use odc_kernels::Source;

use super::buf::{Arg, Buf};

/// The backend of one op's launches.
pub(super) enum Backend {
    #[cfg(feature = "cuda")]
    Cuda(candle_core::CudaDevice),
    #[cfg(feature = "emulate")]
    Emulated(odc_kernels::emulate::Emulator),
}

static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// The fused kernels launched by this process so far, on either backend.
pub(super) fn launches() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

/// Whether the fused kernels run on `device`'s tensors: CUDA with `ODC_FUSED_KERNELS=1`, the CPU
/// while [`super::emulate_on_cpu`] holds an emulator.
pub(super) fn runs_on(device: &Device) -> bool {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => super::enabled(),
        #[cfg(feature = "emulate")]
        Device::Cpu => super::emulated::emulating(),
        _ => false,
    }
}

// With neither feature no backend exists, and the methods' bodies are empty matches.
#[cfg_attr(
    not(any(feature = "cuda", feature = "emulate")),
    allow(unused_variables)
)]
impl Backend {
    /// The backend for `t`'s device.
    pub(super) fn of(t: &Tensor) -> Result<Backend> {
        match t.device() {
            #[cfg(feature = "cuda")]
            Device::Cuda(device) => Ok(Backend::Cuda(device.clone())),
            #[cfg(feature = "emulate")]
            Device::Cpu => super::emulated::emulator()
                .map(Backend::Emulated)
                .ok_or_else(|| {
                    Error::Msg(
                        "fused kernels: a CPU tensor and no emulation (emulate_on_cpu)".into(),
                    )
                }),
            other => Err(Error::Msg(format!(
                "fused kernels: no backend for {other:?} in this build"
            ))),
        }
    }

    /// `t` as a kernel reads it (contiguous; fp32, bf16 or i64).
    pub(super) fn input(&self, t: &Tensor) -> Result<Buf> {
        match *self {
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => Ok(Buf::Cuda(t.contiguous()?)),
            #[cfg(feature = "emulate")]
            Backend::Emulated(_) => Ok(Buf::Host(super::buf::HostTensor::of(t)?)),
        }
    }

    /// A fresh buffer of `shape` elements of `dtype` for a kernel to write.
    pub(super) fn output(&self, dtype: DType, shape: &[usize]) -> Result<Buf> {
        match *self {
            #[cfg(feature = "cuda")]
            Backend::Cuda(ref device) => Ok(Buf::CudaOut(
                super::cuda::empty(device, dtype, shape)?,
                shape.to_vec(),
            )),
            #[cfg(feature = "emulate")]
            Backend::Emulated(_) => Ok(Buf::Host(super::buf::HostTensor::poisoned(dtype, shape)?)),
        }
    }

    /// Launch `function` of `source` over `n` work items with `args`.
    pub(super) fn launch(
        &self,
        source: &Source,
        function: &str,
        n: usize,
        args: &[Arg<'_>],
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        match *self {
            #[cfg(feature = "cuda")]
            Backend::Cuda(ref device) => super::cuda::launch(device, source, function, n, args),
            #[cfg(feature = "emulate")]
            Backend::Emulated(ref emulator) => {
                super::emulated::launch(emulator, source, function, n, args)
            }
        }
    }

    /// `buf` as a tensor on this backend's device.
    pub(super) fn tensor(&self, buf: Buf) -> Result<Tensor> {
        let (storage, shape) = self.owned(buf)?;
        Ok(Tensor::from_storage(
            storage,
            shape,
            BackpropOp::none(),
            false,
        ))
    }

    /// `buf` as an [`super::Output`] (no copy on CUDA).
    pub(super) fn output_of(&self, buf: Buf) -> Result<super::Output> {
        let (storage, shape) = self.owned(buf)?;
        Ok(super::Output { storage, shape })
    }

    /// `buf`'s memory as an owned storage of its shape (an output's: no copy on CUDA).
    pub(super) fn owned(&self, buf: Buf) -> Result<(Storage, Shape)> {
        match buf {
            #[cfg(feature = "cuda")]
            Buf::Cuda(_) => Err(Error::Msg(
                "fused kernels: an input taken as an output".into(),
            )),
            #[cfg(feature = "cuda")]
            Buf::CudaOut(storage, shape) => Ok((Storage::Cuda(storage), Shape::from(shape))),
            #[cfg(feature = "emulate")]
            Buf::Host(host) => host.owned(),
        }
    }
}
