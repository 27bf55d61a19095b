//! A trainer's host ↔ CUDA device traffic (feature `cuda`): a gathered unit goes up in **one**
//! host-to-device copy, a unit's gradient comes down in **one** device-to-host copy, both through
//! pinned host memory and asynchronous on the trainer's stream.
//!
//! Guarantees:
//! 1. **One copy per unit each way.** [`Staging::upload`] copies the unit's flat fp32 buffer into
//!    pinned memory and enqueues one `cuMemcpyHtoDAsync` into a fresh device buffer, which becomes
//!    a candle tensor without another copy (`CudaStorage::wrap_cuda_slice`). [`Staging::download`]
//!    enqueues one `cuMemcpyDtoHAsync` of a contiguous fp32 tensor (the unit's gradients, already
//!    concatenated on the device) into pinned memory.
//! 2. **Overlap.** Neither waits for the stream: the upload of unit `u + 1` is enqueued behind the
//!    forward kernels of unit `u`, and the download of unit `u`'s gradient behind its backward,
//!    while the host goes on enqueueing unit `u − 1`'s backward. Two pinned slots per direction,
//!    each fenced by an event: a slot is reused only after its previous copy completed.
//! 3. **Bounded waits (I6).** Every wait polls its event until [`WAIT`]; past it the error names
//!    what was waited for (a hung device fails the micro-batch, it does not hang the trainer).
//! 4. Pinned memory is `cuMemHostAlloc` (portable, **not** write-combined, since the host reads
//!    gradients back); it is freed after the stream drained.
//!
//! This is the path of [`DeviceTransfers::Host`](super::DeviceTransfers), and of units whose
//! owners the trainer's transport cannot reach from device memory; the device-resident path
//! (`resident`) needs none of it. Every byte staged here is counted ([`super::host_staging`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::{
    result, sys, CudaEvent, CudaStream, DevicePtr, DevicePtrMut,
};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Device, Storage, Tensor};

use crate::model::error::{Error, Result};

/// The longest a trainer waits for one of its copies (behind the kernels queued before it).
pub const WAIT: Duration = Duration::from_secs(300);

fn failed(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Device(format!("cuda: {what} failed: {e}"))
}

/// Pinned host memory for `len` f32s.
struct Pinned {
    ptr: *mut f32,
    len: usize,
    stream: Arc<CudaStream>,
}

impl Pinned {
    fn new(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| failed("binding the context", e))?;
        // SAFETY: a plain allocation of `len.max(1) * 4` bytes in the bound context.
        let ptr = unsafe {
            result::malloc_host(
                len.max(1) * std::mem::size_of::<f32>(),
                sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(|e| failed("cuMemHostAlloc (pinned staging)", e))?;
        Ok(Pinned {
            ptr: ptr.cast(),
            len,
            stream: stream.clone(),
        })
    }

    fn slice(&self, n: usize) -> &[f32] {
        // SAFETY: `ptr` is a live allocation of `len` f32s, `n` is clamped to it, and the callers
        // hand it out only after the slot's copy completed (its event was waited for).
        unsafe { std::slice::from_raw_parts(self.ptr, n.min(self.len)) }
    }

    fn slice_mut(&mut self, n: usize) -> &mut [f32] {
        // SAFETY: as in `slice`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, n.min(self.len)) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // No copy may still target the memory when it is freed.
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!("odc model: synchronising the stream before freeing staging: {e}");
        }
        // SAFETY: `ptr` came from `malloc_host`, is freed once, and the stream is drained.
        if let Err(e) = unsafe { result::free_host(self.ptr.cast()) } {
            tracing::warn!("odc model: cuMemFreeHost failed: {e}");
        }
    }
}

/// One pinned buffer and the copy that last used it.
struct Slot {
    pinned: Pinned,
    /// Recorded after the slot's last copy; `None` once waited for.
    done: Option<CudaEvent>,
    /// A download's source, kept alive until the copy completed.
    source: Option<Tensor>,
    /// Elements of the last download.
    len: usize,
}

impl Slot {
    fn wait(&mut self, what: &str) -> Result<()> {
        if let Some(event) = self.done.take() {
            wait_for(&event, what)?;
        }
        self.source = None;
        Ok(())
    }
}

/// Polls `event` until it completed or [`WAIT`] passed.
fn wait_for(event: &CudaEvent, what: &str) -> Result<()> {
    let deadline = Instant::now() + WAIT;
    let mut spins = 0u32;
    loop {
        // SAFETY: querying a live event of this context (no other effect).
        match unsafe { sys::cuEventQuery(event.cu_event()) } {
            sys::CUresult::CUDA_SUCCESS => return Ok(()),
            sys::CUresult::CUDA_ERROR_NOT_READY => {}
            other => return Err(failed(what, result::DriverError(other))),
        }
        spins += 1;
        if spins < 1024 {
            std::hint::spin_loop();
        } else if Instant::now() >= deadline {
            return Err(Error::Device(format!(
                "cuda: {what} did not complete within {} s (the device is hung or overloaded)",
                WAIT.as_secs()
            )));
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// A trainer's pinned slots on one CUDA device (see the [module docs](self)).
pub struct Staging {
    device: CudaDevice,
    stream: Arc<CudaStream>,
    up: [Slot; 2],
    down: [Slot; 2],
    next_up: usize,
    next_down: usize,
}

// SAFETY: the raw pinned pointers are owned by this value and only touched through `&mut self`
// after the copy that used them was waited for; CUDA handles may be used from any thread.
unsafe impl Send for Staging {}
// SAFETY: every method takes `&mut self`; a shared `&Staging` reaches no pointer (a trainer's
// compute prototype, which has none yet, is shared by the factory that clones it).
unsafe impl Sync for Staging {}

/// A download in flight: [`Staging::finish`] waits for it.
#[derive(Debug)]
#[must_use]
pub struct Download(usize);

impl Staging {
    /// Slots of `max_elems` f32s each on `device` (a CUDA device).
    pub fn new(device: &Device, max_elems: usize) -> Result<Self> {
        let device = device
            .as_cuda_device()
            .map_err(|e| Error::Device(e.to_string()))?
            .clone();
        let stream = device.cuda_stream();
        let slot = || -> Result<Slot> {
            Ok(Slot {
                pinned: Pinned::new(&stream, max_elems)?,
                done: None,
                source: None,
                len: 0,
            })
        };
        Ok(Staging {
            up: [slot()?, slot()?],
            down: [slot()?, slot()?],
            device,
            stream,
            next_up: 0,
            next_down: 0,
        })
    }

    /// `values` as a flat fp32 tensor on the device: one pinned copy on the host, one
    /// asynchronous host-to-device copy (not waited for).
    pub fn upload(&mut self, values: &[f32]) -> Result<Tensor> {
        let n = values.len();
        let slot = &mut self.up[self.next_up];
        self.next_up ^= 1;
        if n > slot.pinned.len {
            return Err(Error::Device(format!(
                "cuda staging: a unit of {n} elements, the slots hold {}",
                slot.pinned.len
            )));
        }
        slot.wait("an earlier upload")?;
        slot.pinned.slice_mut(n).copy_from_slice(values);
        // SAFETY: the buffer is fully written by the copy enqueued right below, before any
        // kernel on this stream reads it.
        let mut dst = unsafe { self.stream.alloc::<f32>(n) }
            .map_err(|e| failed("allocating a unit's device buffer", e))?;
        {
            let (ptr, _record) = dst.device_ptr_mut(&self.stream);
            // SAFETY: `n` f32s of pinned memory that nothing writes until the event recorded
            // below completed; `ptr` is a device buffer of `n` f32s on this stream.
            unsafe {
                result::memcpy_htod_async(ptr, slot.pinned.slice(n), self.stream.cu_stream())
            }
            .map_err(|e| failed("cuMemcpyHtoDAsync (unit upload)", e))?;
        }
        slot.done = Some(
            self.stream
                .record_event(None)
                .map_err(|e| failed("cuEventRecord", e))?,
        );
        super::host_staging::staged("up", (n * 4) as u64);
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(dst, self.device.clone()));
        Ok(Tensor::from_storage(storage, n, BackpropOp::none(), false))
    }

    /// Enqueues the copy of `flat` (a contiguous fp32 tensor on this device) to pinned memory;
    /// [`Staging::finish`] waits for it. At most two downloads are in flight: a third waits for
    /// the oldest.
    pub fn download(&mut self, flat: Tensor) -> Result<Download> {
        let index = self.next_down;
        self.next_down ^= 1;
        let slot = &mut self.down[index];
        slot.wait("an earlier gradient download")?;
        let n = flat.elem_count();
        if n > slot.pinned.len {
            return Err(Error::Device(format!(
                "cuda staging: a gradient of {n} elements, the slots hold {}",
                slot.pinned.len
            )));
        }
        {
            let (storage, layout) = flat.storage_and_layout();
            let Some((start, end)) = layout.contiguous_offsets() else {
                return Err(Error::Device(
                    "cuda staging: a gradient download needs a contiguous tensor".into(),
                ));
            };
            let Storage::Cuda(cuda) = &*storage else {
                return Err(Error::Device(
                    "cuda staging: the gradient is not in CUDA memory".into(),
                ));
            };
            let slice = cuda
                .as_cuda_slice::<f32>()
                .map_err(|e| Error::Device(format!("cuda staging: the gradient: {e}")))?
                .slice(start..end);
            let (ptr, _record) = slice.device_ptr(&self.stream);
            // SAFETY: `n` f32s of pinned memory not read until this slot's event completed; the
            // source stays alive (kept in the slot) until then.
            unsafe {
                result::memcpy_dtoh_async(slot.pinned.slice_mut(n), ptr, self.stream.cu_stream())
            }
            .map_err(|e| failed("cuMemcpyDtoHAsync (gradient download)", e))?;
        }
        slot.done = Some(
            self.stream
                .record_event(None)
                .map_err(|e| failed("cuEventRecord", e))?,
        );
        slot.source = Some(flat);
        slot.len = n;
        super::host_staging::staged("down", (n * 4) as u64);
        Ok(Download(index))
    }

    /// Waits for `download` and returns its values (valid until the slot's next download).
    pub fn finish(&mut self, download: Download) -> Result<&[f32]> {
        let slot = &mut self.down[download.0];
        slot.wait("a gradient download")?;
        Ok(slot.pinned.slice(slot.len))
    }
}
