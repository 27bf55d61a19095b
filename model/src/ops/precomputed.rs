//! The forward half of a custom op whose result is computed beforehand with tensor ops on
//! detached inputs (the blocked attention, the chunked head): the op holds that result and hands
//! candle an owned copy of it once, on the CPU or a CUDA device — or, for a fused kernel's output
//! ([`Precomputed::owned`]), the kernel's storage itself, no copy; its backward is the op's own.
//! So a memory-lean algorithm written in candle ops runs on both devices without kernels, and the
//! graph records one node with its custom backward instead of every intermediate.

use std::sync::Mutex;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, Layout, Shape, Storage, Tensor};

/// A result taken once by the op's forward (see the [module docs](self)).
pub(crate) struct Precomputed {
    /// The op's name, for errors.
    what: &'static str,
    out: Mutex<Option<Held>>,
}

/// What a [`Precomputed`] holds: a tensor (copied into the op's output), or a kernel's own
/// output storage (the op's output as it is).
enum Held {
    Tensor(Tensor),
    Owned(Storage, Shape),
}

impl Precomputed {
    pub(crate) fn new(what: &'static str, out: Tensor) -> Self {
        Precomputed {
            what,
            out: Mutex::new(Some(Held::Tensor(out))),
        }
    }

    /// A fused kernel's output, handed to candle as the op's output without a copy.
    pub(crate) fn owned(what: &'static str, out: super::fused::Output) -> Self {
        let (storage, shape) = out.into_parts();
        Precomputed {
            what,
            out: Mutex::new(Some(Held::Owned(storage, shape))),
        }
    }

    /// The result, once: a second forward of the same op is an error.
    fn take(&self) -> candle_core::Result<Held> {
        let what = self.what;
        self.out
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{what}: a poisoned lock")))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{what}: forward run twice")))
    }

    /// The result as a CPU op's output.
    pub(crate) fn cpu(&self) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = match self.take()? {
            Held::Owned(Storage::Cpu(s), shape) => return Ok((s, shape)),
            Held::Owned(..) => candle_core::bail!("{}: the result is not on the CPU", self.what),
            Held::Tensor(t) => t,
        };
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((fresh(s, layout)?, layout.shape().clone())),
            _ => candle_core::bail!("{}: the result is not on the CPU", self.what),
        }
    }

    /// The result as a CUDA op's output.
    pub(crate) fn cuda(&self) -> candle_core::Result<(CudaStorage, Shape)> {
        let out = match self.take()? {
            Held::Owned(Storage::Cuda(s), shape) => return Ok((s, shape)),
            Held::Owned(..) => {
                candle_core::bail!("{}: the result is not on the CUDA device", self.what)
            }
            Held::Tensor(t) => t,
        };
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((fresh(s, layout)?, layout.shape().clone())),
            _ => candle_core::bail!("{}: the result is not on the CUDA device", self.what),
        }
    }
}

/// A fresh, contiguous copy of the storage `layout` reads (candle wants an owned storage): one
/// copy into uninitialised memory (on CUDA one device-to-device copy, not a memset and a copy).
fn fresh<S>(storage: &S, layout: &Layout) -> candle_core::Result<S>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    // SAFETY: `copy_strided_src` writes every element of the new storage (`layout`'s shape, from
    // offset 0, contiguous) before anything reads it: the copy is enqueued first on the device's
    // stream, and on the CPU it runs before this returns.
    let mut copy = unsafe {
        storage
            .device()
            .alloc_uninit(layout.shape(), storage.dtype())?
    };
    storage.copy_strided_src(&mut copy, 0, layout)?;
    Ok(copy)
}

/// The `cpu_fwd` and `cuda_fwd` of a custom op of 1, 2 or 3 inputs whose result is its
/// `out: Precomputed` field (the inputs are not read: the result was computed from them).
macro_rules! precomputed_forwards {
    (1) => {
        precomputed_forwards!(@ _s1 _l1);
    };
    (2) => {
        precomputed_forwards!(@ _s1 _l1, _s2 _l2);
    };
    (3) => {
        precomputed_forwards!(@ _s1 _l1, _s2 _l2, _s3 _l3);
    };
    (@ $($storage:ident $layout:ident),+) => {
        fn cpu_fwd(
            &self,
            $($storage: &candle_core::CpuStorage, $layout: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            self.out.cpu()
        }

        fn cuda_fwd(
            &self,
            $($storage: &candle_core::CudaStorage, $layout: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
            self.out.cuda()
        }
    };
}
pub(crate) use precomputed_forwards;
