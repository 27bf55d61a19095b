//! The CUDA driver as this backend uses it: a device (its primary context, one stream, pinned
//! staging, a device scratch buffer, the NVRTC kernels), device buffers from `cuMemAlloc`, kernel
//! launches on the device's stream, and bounded waits.
//!
//! Guarantees:
//! - Nothing here calls into cudarc before [`check_driver`] found `libcuda` (cudarc panics on a
//!   missing library): [`Device::open`] checks first and is the only way to a [`Device`].
//! - Every wait for the device is bounded: [`Lane::finish`] polls an event until a deadline. Work
//!   still in flight when a wait gave up is drained (bounded again) before the lane is used next,
//!   so its pinned staging is never written by the device while the host reuses it.
//! - Device memory that a caller names by address ([`DeviceDest`]) is checked to be device memory
//!   of this device, inside one allocation, before anything is copied into it.
//! - Work is serialised on the device's one stream (its lane, behind a lock): a kernel an owner
//!   launches ([`Device::launch`]) runs after everything enqueued before it (accumulates, copies)
//!   and before anything enqueued after, and each owner-side call waits for its own work.

use std::ffi::c_void;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cudarc::driver::{result, sys, CudaContext, CudaStream};
use parking_lot::Mutex;

use odc_kernels::launch::{Arg, Launcher};
use odc_kernels::nvrtc::{Module, Param};
use odc_kernels::Source;

use super::kernels::{kernel_error, Accumulate, Elementwise};
use super::library::{check_driver, failed};
use crate::{Deadline, DeviceDest, TransportError};

/// Bytes of a lane's pinned staging buffer (and device scratch buffer): host transfers move in
/// pieces of this size.
pub const STAGING_BYTES: usize = 16 << 20;

/// How long an owner-side operation (publish, accumulate, take), which has no caller deadline,
/// may wait for the device.
pub(crate) const OWNER_WAIT: Duration = Duration::from_secs(60);

/// How many CUDA devices the driver sees ([`check_driver`] first: without a driver, the "no CUDA
/// driver" error).
pub fn device_count() -> Result<u32, TransportError> {
    check_driver()?;
    let count = result::device::get_count().map_err(|e| failed("cuDeviceGetCount", e))?;
    Ok(u32::try_from(count).unwrap_or(0))
}

/// Pinned (page-locked) host memory from `cuMemHostAlloc` (portable, not write-combined: the
/// host reads it back).
pub(crate) struct Pinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; every access goes through
// `&self`/`&mut self` (and device copies into it are waited for under the lane's lock).
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(len: usize) -> Result<Self, TransportError> {
        // SAFETY: a plain allocation of `len` (> 0) bytes; the context is bound by the caller.
        let ptr = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| failed("cuMemHostAlloc (pinned staging)", e))?;
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    fn as_slice(&self, len: usize) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `self.len` bytes, `len` is clamped to it, and no
        // device copy into it is in flight when the lane hands it out (the lane waits first).
        unsafe { std::slice::from_raw_parts(self.ptr, len.min(self.len)) }
    }

    fn as_mut_slice(&mut self, len: usize) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len.min(self.len)) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_host` and is freed once; the lane drained its stream
        // before it drops (no copy still targets it).
        if let Err(e) = unsafe { result::free_host(self.ptr.cast::<c_void>()) } {
            tracing::warn!("odc cuda: cuMemFreeHost failed: {e}");
        }
    }
}

/// One stream of a device and what moves through it: pinned staging for host transfers, a device
/// scratch buffer for payloads the kernels add, and the event that bounds waits. Behind the
/// device's lock: work on one device is serialised on its stream.
pub(crate) struct Lane {
    pub(crate) stream: Arc<CudaStream>,
    event: sys::CUevent,
    pinned: Pinned,
    scratch: Option<sys::CUdeviceptr>,
    /// Work was enqueued whose completion nobody saw (a wait gave up at its deadline).
    pending: bool,
}

// SAFETY: the raw event and scratch pointer are only used under the device's lock with the
// context bound; CUDA handles may be used from any thread.
unsafe impl Send for Lane {}

impl Lane {
    /// Wait until everything enqueued so far is done, polling until `deadline`. On a deadline
    /// the work stays pending, and the next [`Device::lane`] drains it first.
    pub(crate) fn finish(&mut self, deadline: Deadline) -> Result<(), Waited> {
        // SAFETY: the event and stream belong to this lane's context, which the caller bound.
        unsafe { result::event::record(self.event, self.stream.cu_stream()) }
            .map_err(|e| Waited::Failed(failed("cuEventRecord", e)))?;
        self.pending = true;
        let mut spins = 0u32;
        loop {
            // SAFETY: as above; querying a recorded event.
            match unsafe { sys::cuEventQuery(self.event) } {
                sys::CUresult::CUDA_SUCCESS => {
                    self.pending = false;
                    return Ok(());
                }
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => {
                    return Err(Waited::Failed(failed(
                        "waiting for the stream",
                        result::DriverError(other),
                    )))
                }
            }
            spins += 1;
            if spins < 256 {
                std::hint::spin_loop();
            } else {
                if crate::now() >= deadline {
                    return Err(Waited::Deadline);
                }
                std::thread::yield_now();
            }
        }
    }

    /// [`Lane::finish`] for owner-side work: [`OWNER_WAIT`] at most, a timeout is an error.
    pub(crate) fn finish_owner(&mut self, what: &str) -> Result<(), TransportError> {
        self.finish(crate::deadline_in(OWNER_WAIT))
            .map_err(|w| w.into_error(what))
    }

    /// The device scratch buffer ([`STAGING_BYTES`]), allocated on first use.
    pub(crate) fn scratch(&mut self) -> Result<sys::CUdeviceptr, TransportError> {
        if let Some(ptr) = self.scratch {
            return Ok(ptr);
        }
        // SAFETY: a plain device allocation in the bound context.
        let ptr = unsafe { result::malloc_sync(STAGING_BYTES) }
            .map_err(|e| failed("cuMemAlloc (scratch)", e))?;
        self.scratch = Some(ptr);
        Ok(ptr)
    }

    /// Copy host `data` to device address `dst` through the pinned staging, piece by piece,
    /// waiting for each piece (the staging is reused). `dst` must have room for `data`.
    pub(crate) fn upload(
        &mut self,
        dst: sys::CUdeviceptr,
        data: &[u8],
        deadline: Deadline,
    ) -> Result<(), Waited> {
        for (i, piece) in data.chunks(STAGING_BYTES).enumerate() {
            self.pinned.as_mut_slice(piece.len()).copy_from_slice(piece);
            let at = dst + (i * STAGING_BYTES) as u64;
            // SAFETY: the source is `piece.len()` bytes of pinned memory that nothing else
            // touches until the wait below returns; the caller guarantees `dst` has room.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    at,
                    self.pinned.ptr.cast::<c_void>(),
                    piece.len(),
                    self.stream.cu_stream(),
                )
            }
            .result()
            .map_err(|e| Waited::Failed(failed("cuMemcpyHtoDAsync", e)))?;
            self.finish(deadline)?;
        }
        Ok(())
    }

    /// Copy `bytes` bytes at device address `src` to the host through the pinned staging, piece by
    /// piece; `sink(piece, offset)` receives each piece once it arrived.
    pub(crate) fn download(
        &mut self,
        src: sys::CUdeviceptr,
        bytes: usize,
        deadline: Deadline,
        sink: &mut Sink<'_>,
    ) -> Result<(), Waited> {
        let mut at = 0;
        while at < bytes {
            let n = (bytes - at).min(STAGING_BYTES);
            // SAFETY: the destination is `n` bytes of pinned memory not read until the wait
            // below returns; the caller guarantees `src..src + bytes` is readable device memory.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    self.pinned.ptr.cast::<c_void>(),
                    src + at as u64,
                    n,
                    self.stream.cu_stream(),
                )
            }
            .result()
            .map_err(|e| Waited::Failed(failed("cuMemcpyDtoHAsync", e)))?;
            self.finish(deadline)?;
            sink(self.pinned.as_slice(n), at).map_err(Waited::Failed)?;
            at += n;
        }
        Ok(())
    }

    /// Enqueue a device-to-device copy of `bytes` bytes (not waited for).
    pub(crate) fn copy(
        &mut self,
        dst: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<(), TransportError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller guarantees both ranges are device memory reachable from this
        // context with `bytes` bytes each; the copy is ordered on this lane's stream.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| failed("cuMemcpyDtoDAsync", e))
    }

    /// Enqueue zeroing `bytes` bytes at `dst` (not waited for).
    pub(crate) fn zero(
        &mut self,
        dst: sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<(), TransportError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller guarantees `dst..dst + bytes` is device memory of this context.
        unsafe { result::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }
            .map_err(|e| failed("cuMemsetD8Async", e))
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // Nothing may still copy into the pinned staging or the scratch buffer when they go.
        // SAFETY: the stream is this lane's; synchronising it has no other effect.
        let _ = unsafe { result::stream::synchronize(self.stream.cu_stream()) };
        if let Some(ptr) = self.scratch.take() {
            // SAFETY: allocated by `scratch` with cuMemAlloc, freed once, stream drained.
            let _ = unsafe { result::free_sync(ptr) };
        }
        // SAFETY: created by `Device::open`, destroyed once.
        let _ = unsafe { result::event::destroy(self.event) };
    }
}

/// Receives the pieces of a download: `(piece, byte offset in the whole)`.
pub(crate) type Sink<'a> = dyn FnMut(&[u8], usize) -> Result<(), TransportError> + 'a;

/// Why a bounded wait ended without the work done.
#[derive(Debug)]
pub(crate) enum Waited {
    /// The deadline passed first (the work is still in flight).
    Deadline,
    /// A driver call failed.
    Failed(TransportError),
}

impl Waited {
    /// As an error of an owner-side operation `what` (a deadline there is a hung device).
    pub(crate) fn into_error(self, what: &str) -> TransportError {
        match self {
            Waited::Deadline => TransportError::Unsupported {
                what: format!(
                    "cuda: {what}: the device did not finish within {} s",
                    OWNER_WAIT.as_secs()
                ),
            },
            Waited::Failed(e) => e,
        }
    }
}

/// One CUDA device as this process uses it: its primary context, one [`Lane`] (stream, pinned
/// staging, scratch) and, compiled on first use, the NVRTC kernels. Cheap to share (`Arc`);
/// every method binds the context to the calling thread first.
pub struct Device {
    ctx: Arc<CudaContext>,
    ordinal: u32,
    lane: Mutex<Lane>,
    kernels: OnceLock<Result<Accumulate, TransportError>>,
    /// Owners' kernel modules, by name, compiled on first use.
    modules: Mutex<Vec<(String, Arc<Module>)>>,
    /// Primary contexts of other devices this one reads from (peer access enabled).
    peers: Mutex<Vec<Arc<CudaContext>>>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // The lane's stream, event and buffers are released with this context current.
        let _ = self.ctx.bind_to_thread();
    }
}

impl Device {
    /// Open CUDA device `ordinal`: retain its primary context, create a stream, pinned staging of
    /// [`STAGING_BYTES`]. Without a driver this is [`TransportError::Unsupported`] starting `no
    /// CUDA driver:` (checked before any driver call); an ordinal the driver does not have is
    /// `Unsupported` naming it.
    pub fn open(ordinal: u32) -> Result<Arc<Self>, TransportError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(TransportError::Unsupported {
                what: format!("cuda: no CUDA device {ordinal}: the driver sees {count} device(s)"),
            });
        }
        let index = usize::try_from(ordinal).unwrap_or(usize::MAX);
        let ctx =
            CudaContext::new(index).map_err(|e| failed("retaining the primary context", e))?;
        let stream = ctx.new_stream().map_err(|e| failed("cuStreamCreate", e))?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| failed("cuEventCreate", e))?;
        let pinned = Pinned::new(STAGING_BYTES)?;
        Ok(Arc::new(Self {
            ctx,
            ordinal,
            lane: Mutex::new(Lane {
                stream,
                event,
                pinned,
                scratch: None,
                pending: false,
            }),
            kernels: OnceLock::new(),
            modules: Mutex::new(Vec::new()),
            peers: Mutex::new(Vec::new()),
        }))
    }

    /// The device's ordinal in this process.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The device's name (`NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|e| format!("<{e}>"))
    }

    /// Bind this device's context to the calling thread.
    pub(crate) fn bind(&self) -> Result<(), TransportError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| failed("cuCtxSetCurrent", e))
    }

    /// The lane, with the context bound and earlier work that outlived its wait drained (at most
    /// [`OWNER_WAIT`]).
    pub(crate) fn lane(&self) -> Result<parking_lot::MutexGuard<'_, Lane>, TransportError> {
        self.bind()?;
        let mut lane = self.lane.lock();
        if lane.pending {
            // SAFETY: the event was recorded by the wait that gave up; polling it until done.
            let deadline = crate::deadline_in(OWNER_WAIT);
            loop {
                match unsafe { sys::cuEventQuery(lane.event) } {
                    sys::CUresult::CUDA_SUCCESS => break,
                    sys::CUresult::CUDA_ERROR_NOT_READY if crate::now() < deadline => {
                        std::thread::sleep(Duration::from_micros(50))
                    }
                    other => {
                        return Err(TransportError::Unsupported {
                            what: format!(
                                "cuda: earlier work on device {} did not drain: {}",
                                self.ordinal,
                                result::DriverError(other)
                            ),
                        })
                    }
                }
            }
            lane.pending = false;
        }
        Ok(lane)
    }

    /// The kernels, compiled with NVRTC on first use (tens to hundreds of milliseconds).
    pub(crate) fn kernels(&self) -> Result<&Accumulate, TransportError> {
        self.kernels
            .get_or_init(|| {
                self.bind()?;
                Accumulate::compile(&self.ctx)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The kernels of `source`, compiled with NVRTC for this device on the first call with its
    /// name and cached (later calls with the same name return the same module, whatever their
    /// source). Without NVRTC: `Unsupported`, `no NVRTC: …`; a source that does not compile:
    /// `Unsupported` with NVRTC's log.
    pub fn module(&self, source: &Source) -> Result<Arc<Module>, TransportError> {
        let mut modules = self.modules.lock();
        if let Some((_, module)) = modules.iter().find(|(n, _)| n == source.name) {
            return Ok(Arc::clone(module));
        }
        self.bind()?;
        let module = Arc::new(Module::compile(&self.ctx, source).map_err(kernel_error)?);
        modules.push((source.name.to_owned(), Arc::clone(&module)));
        Ok(module)
    }

    /// Run kernel `function` of `module` over `n` elements with `args` on this device's stream
    /// (after everything enqueued before it) and wait for it (at most 60 s: longer is an error).
    /// A buffer argument of another device is refused before anything runs.
    ///
    /// # Safety
    /// `function`'s parameters are exactly `args`, in order and of their types, and the kernel
    /// touches only memory of the buffers given, within their lengths (for the `n` the caller
    /// passes); `module` came from [`Device::module`] of this device.
    pub unsafe fn launch(
        &self,
        module: &Module,
        function: &str,
        n: usize,
        args: &[Arg<'_, DeviceBuffer>],
    ) -> Result<(), TransportError> {
        let mut params = Vec::with_capacity(args.len());
        for arg in args {
            params.push(match *arg {
                Arg::Buffer(buffer) if !buffer.is_on(self) => {
                    return Err(TransportError::Unsupported {
                        what: format!(
                            "cuda: kernel {function}: {buffer:?} is not memory of this device \
                             (device {})",
                            self.ordinal
                        ),
                    })
                }
                Arg::Buffer(buffer) => Param::U64(buffer.ptr),
                Arg::U64(v) => Param::U64(v),
                Arg::I32(v) => Param::I32(v),
                Arg::F32(v) => Param::F32(v),
                Arg::F64(v) => Param::F64(v),
            });
        }
        let mut lane = self.lane()?;
        // SAFETY: the caller's guarantee (each buffer passed by its address); the lane's stream
        // belongs to this device's context, which `lane()` bound.
        unsafe { module.enqueue(&lane.stream, function, n, &params) }.map_err(kernel_error)?;
        lane.finish_owner(&format!("kernel {function}"))
    }

    /// Set every byte of `buffer` to zero and wait.
    pub fn zero(&self, buffer: &DeviceBuffer) -> Result<(), TransportError> {
        if !buffer.is_on(self) {
            return Err(TransportError::Unsupported {
                what: format!("cuda: {buffer:?} is not memory of device {}", self.ordinal),
            });
        }
        let mut lane = self.lane()?;
        lane.zero(buffer.ptr, buffer.bytes)?;
        lane.finish_owner("zeroing device memory")
    }

    /// Make memory on device `peer` (this process's ordinal) readable from this device's
    /// context: peer access, enabled once. The same device needs nothing.
    pub(crate) fn reach_peer(&self, peer: u32) -> Result<(), TransportError> {
        if peer == self.ordinal {
            return Ok(());
        }
        let mut peers = self.peers.lock();
        if peers.iter().any(|c| c.ordinal() == peer as usize) {
            return Ok(());
        }
        let index = usize::try_from(peer).unwrap_or(usize::MAX);
        let peer_ctx =
            CudaContext::new(index).map_err(|e| failed("retaining a peer's primary context", e))?;
        // `CudaContext::new` bound the peer's context: bind ours again.
        self.bind()?;
        let mut can = 0;
        // SAFETY: plain queries and a context call with valid device and context handles.
        unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), peer_ctx.cu_device())
                .result()
                .map_err(|e| failed("cuDeviceCanAccessPeer", e))?;
            if can == 0 {
                return Err(TransportError::Unsupported {
                    what: format!(
                        "cuda: device {} cannot access device {peer} (no peer access between \
                         them: no NVLink or PCIe peer path)",
                        self.ordinal
                    ),
                });
            }
            match sys::cuCtxEnablePeerAccess(peer_ctx.cu_ctx(), 0) {
                sys::CUresult::CUDA_SUCCESS
                | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                other => return Err(failed("cuCtxEnablePeerAccess", result::DriverError(other))),
            }
        }
        peers.push(peer_ctx);
        Ok(())
    }

    /// Check that `dest` is `bytes` bytes of device memory on this device inside one allocation
    /// (a caller-named destination of a read). Anything else is [`TransportError::Unsupported`]
    /// naming it; nothing is written.
    pub(crate) fn check_dest(&self, dest: &DeviceDest) -> Result<(), TransportError> {
        let refuse = |why: String| TransportError::Unsupported {
            what: format!(
                "cuda: device destination of {} bytes at {:#x} on device {}: {why}",
                dest.bytes, dest.ptr, dest.device
            ),
        };
        if dest.device != self.ordinal {
            return Err(refuse(format!(
                "this transport reads into device {} only",
                self.ordinal
            )));
        }
        if dest.bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        let mut kind: u32 = 0;
        // SAFETY: a query about an address; invalid addresses are an error, not a fault.
        let queried = unsafe {
            sys::cuPointerGetAttribute(
                (&mut kind as *mut u32).cast::<c_void>(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                dest.ptr,
            )
        };
        if queried != sys::CUresult::CUDA_SUCCESS
            || kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
        {
            return Err(refuse("not device memory of this process".into()));
        }
        let (base, size) = allocation_of(dest.ptr).map_err(|e| refuse(e.to_string()))?;
        let end = dest.ptr.checked_add(dest.bytes);
        if end.is_none_or(|end| end > base + size as u64) {
            return Err(refuse(format!(
                "it runs past the end of its allocation ({size} bytes at {base:#x})"
            )));
        }
        let mut ordinal: i32 = -1;
        // SAFETY: as above.
        let queried = unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast::<c_void>(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                dest.ptr,
            )
        };
        if queried != sys::CUresult::CUDA_SUCCESS || ordinal != self.ordinal as i32 {
            return Err(refuse(format!("the memory is on device {ordinal}")));
        }
        Ok(())
    }

    /// Allocate `bytes` bytes of zeroed device memory with `cuMemAlloc` (IPC-exportable, unlike
    /// cudarc's stream-ordered pool).
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuffer, TransportError> {
        let mut lane = self.lane()?;
        // At least one byte: cuMemAlloc refuses 0, and an empty region still exports a handle.
        // SAFETY: a plain allocation in the bound context.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(|e| failed(&format!("cuMemAlloc of {bytes} bytes"), e))?;
        let zeroed = lane
            .zero(ptr, bytes)
            .and_then(|()| lane.finish_owner("zeroing a new allocation"));
        if let Err(e) = zeroed {
            // SAFETY: just allocated, freed once; a failed or timed-out memset is the only work
            // that touched it (a stream that failed is unusable anyway).
            let _ = unsafe { result::free_sync(ptr) };
            return Err(e);
        }
        drop(lane);
        Ok(DeviceBuffer {
            device: Arc::clone(self),
            ptr,
            bytes,
        })
    }

    /// Copy host `data` into `dst` at byte `at` through the pinned staging.
    pub fn upload(&self, dst: &DeviceBuffer, at: usize, data: &[u8]) -> Result<(), TransportError> {
        dst.check_range(at, data.len())?;
        self.lane()?
            .upload(dst.ptr + at as u64, data, crate::deadline_in(OWNER_WAIT))
            .map_err(|w| w.into_error("upload"))
    }

    /// Copy `src` whole into host memory through the pinned staging.
    pub fn download(&self, src: &DeviceBuffer) -> Result<Vec<u8>, TransportError> {
        let mut out = vec![0u8; src.bytes];
        self.lane()?
            .download(
                src.ptr,
                src.bytes,
                crate::deadline_in(OWNER_WAIT),
                &mut |piece, at| {
                    out[at..at + piece.len()].copy_from_slice(piece);
                    Ok(())
                },
            )
            .map_err(|w| w.into_error("download"))?;
        Ok(out)
    }

    /// The first `len` fp32 values of `src` (little-endian on the device) in host memory, through
    /// the pinned staging and decoded piece by piece into the result: one host copy of the values
    /// (a checkpoint of device shards), not a byte copy and then a decoded one.
    pub fn download_f32(&self, src: &DeviceBuffer, len: usize) -> Result<Vec<f32>, TransportError> {
        let bytes = len.saturating_mul(4);
        src.check_range(0, bytes)?;
        let mut out = vec![0f32; len];
        self.lane()?
            .download(
                src.ptr,
                bytes,
                crate::deadline_in(OWNER_WAIT),
                &mut |piece, at| {
                    // Pieces are STAGING_BYTES apart (a multiple of 4) and `bytes` is too.
                    for (v, b) in out[at / 4..].iter_mut().zip(piece.chunks_exact(4)) {
                        *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                    Ok(())
                },
            )
            .map_err(|w| w.into_error("download"))?;
        Ok(out)
    }

    /// Copy `src` whole into `dst` (`cuMemcpyDtoDAsync` on this device's stream) and wait.
    pub fn copy(&self, dst: &DeviceBuffer, src: &DeviceBuffer) -> Result<(), TransportError> {
        sizes_fit(dst.bytes, src.bytes, 1)?;
        let mut lane = self.lane()?;
        lane.copy(dst.ptr, src.ptr, src.bytes)?;
        lane.finish_owner("device copy")
    }

    /// Add the fp32 values of `src` into the fp32 values of `acc` (the accumulate kernel) and
    /// wait. Both hold the same number of bytes, a multiple of 4.
    pub fn add_f32(&self, acc: &DeviceBuffer, src: &DeviceBuffer) -> Result<(), TransportError> {
        self.add(
            Elementwise::AddF32,
            acc,
            src,
            src.bytes,
            "accumulate kernel (f32)",
        )
    }

    /// Add the bf16 values of `src` into the fp32 values of `acc` (the bf16 accumulate kernel)
    /// and wait. `acc` holds twice the bytes of `src`.
    pub fn add_bf16(&self, acc: &DeviceBuffer, src: &DeviceBuffer) -> Result<(), TransportError> {
        let widened = src.bytes.saturating_mul(2);
        self.add(
            Elementwise::AddBf16,
            acc,
            src,
            widened,
            "accumulate kernel (bf16)",
        )
    }

    /// Run the accumulate `kernel` of `src` (`widened`: its bytes as fp32) into `acc` and wait.
    fn add(
        &self,
        kernel: Elementwise,
        acc: &DeviceBuffer,
        src: &DeviceBuffer,
        widened: usize,
        what: &str,
    ) -> Result<(), TransportError> {
        sizes_fit(acc.bytes, widened, 4)?;
        let kernels = self.kernels()?;
        let mut lane = self.lane()?;
        kernels.enqueue(&lane.stream, kernel, acc.ptr, src.ptr, acc.bytes / 4)?;
        lane.finish_owner(what)
    }

    /// Copy `src` whole into the pinned staging, piece by piece, waiting for each (the bytes are
    /// not looked at): the raw device → pinned host rate, for the benchmark.
    pub fn stage_out(&self, src: &DeviceBuffer) -> Result<(), TransportError> {
        self.lane()?
            .download(
                src.ptr,
                src.bytes,
                crate::deadline_in(OWNER_WAIT),
                &mut |_, _| Ok(()),
            )
            .map_err(|w| w.into_error("staging out"))
    }

    /// Fill `dst` whole from the pinned staging (whatever it holds), piece by piece, waiting for
    /// each: the raw pinned host → device rate, for the benchmark.
    pub fn stage_in(&self, dst: &DeviceBuffer) -> Result<(), TransportError> {
        let mut lane = self.lane()?;
        let deadline = crate::deadline_in(OWNER_WAIT);
        let mut at = 0;
        while at < dst.bytes {
            let n = (dst.bytes - at).min(STAGING_BYTES);
            // SAFETY: `n` bytes of pinned staging into `n` bytes of `dst`'s allocation; waited
            // for before the staging is used again.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dst.ptr + at as u64,
                    lane.pinned.ptr.cast::<c_void>(),
                    n,
                    lane.stream.cu_stream(),
                )
            }
            .result()
            .map_err(|e| failed("cuMemcpyHtoDAsync", e))?;
            lane.finish(deadline)
                .map_err(|w| w.into_error("staging in"))?;
            at += n;
        }
        Ok(())
    }
}

/// `a == b`, a multiple of `unit`.
fn sizes_fit(a: usize, b: usize, unit: usize) -> Result<(), TransportError> {
    if a == b && a % unit == 0 {
        Ok(())
    } else {
        Err(TransportError::Unsupported {
            what: format!(
                "cuda: buffers of {a} and {b} (equivalent) bytes do not match, or are not whole \
                 {unit}-byte elements"
            ),
        })
    }
}

/// The allocation holding device address `ptr`: its base and size (`cuMemGetAddressRange`).
pub(crate) fn allocation_of(
    ptr: sys::CUdeviceptr,
) -> Result<(sys::CUdeviceptr, usize), TransportError> {
    let (mut base, mut size) = (0, 0usize);
    // SAFETY: a query about an address; an invalid one is an error, not a fault.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .map_err(|e| failed("cuMemGetAddressRange", e))?;
    Ok((base, size))
}

/// Device memory from `cuMemAlloc` on one [`Device`], freed when dropped.
pub struct DeviceBuffer {
    device: Arc<Device>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuffer({} bytes at {:#x} on device {})",
            self.bytes, self.ptr, self.device.ordinal
        )
    }
}

impl DeviceBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The device address.
    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Whether this buffer was allocated by `device` (the same [`Device`], so work on it is
    /// ordered on that device's stream).
    pub(crate) fn is_on(&self, device: &Device) -> bool {
        std::ptr::eq(Arc::as_ptr(&self.device), device)
    }

    /// The whole buffer as a read destination ([`crate::Dest::Device`]).
    pub fn dest(&self) -> DeviceDest {
        DeviceDest {
            device: self.device.ordinal,
            ptr: self.ptr,
            bytes: self.bytes as u64,
        }
    }

    fn check_range(&self, at: usize, len: usize) -> Result<(), TransportError> {
        if at.checked_add(len).is_some_and(|end| end <= self.bytes) {
            Ok(())
        } else {
            Err(TransportError::Unsupported {
                what: format!(
                    "cuda: {len} bytes at {at} do not fit a buffer of {} bytes",
                    self.bytes
                ),
            })
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Work that may still use the memory is drained first (the lane's stream), then freed.
        match self.device.lane() {
            Ok(mut lane) => {
                let _ = lane.finish_owner("freeing device memory");
                // SAFETY: allocated with cuMemAlloc, freed once, no work on it in flight.
                if let Err(e) = unsafe { result::free_sync(self.ptr) } {
                    tracing::warn!("odc cuda: cuMemFree failed: {e}");
                }
            }
            Err(e) => tracing::warn!("odc cuda: cannot free device memory: {e}"),
        }
    }
}

/// A device as odc-kernels' [`Launcher`]: modules compiled by NVRTC and cached
/// ([`Device::module`]), device buffers, launches on the device's stream, waited for
/// ([`Device::launch`]).
#[derive(Debug, Clone)]
pub struct DeviceLauncher(pub Arc<Device>);

impl Launcher for DeviceLauncher {
    type Buffer = DeviceBuffer;
    type Module = Arc<Module>;
    type Error = TransportError;

    fn module(&self, source: &Source) -> Result<Arc<Module>, TransportError> {
        self.0.module(source)
    }

    fn upload(&self, bytes: &[u8]) -> Result<DeviceBuffer, TransportError> {
        let buffer = self.0.alloc(bytes.len())?;
        self.0.upload(&buffer, 0, bytes)?;
        Ok(buffer)
    }

    fn download(&self, buffer: &DeviceBuffer) -> Result<Vec<u8>, TransportError> {
        self.0.download(buffer)
    }

    fn bytes(&self, buffer: &DeviceBuffer) -> usize {
        buffer.len()
    }

    fn blocks(&self, module: &Arc<Module>, n: usize) -> u32 {
        module.blocks(n)
    }

    unsafe fn launch(
        &self,
        module: &Arc<Module>,
        function: &str,
        n: usize,
        args: &[Arg<'_, DeviceBuffer>],
    ) -> Result<(), TransportError> {
        // SAFETY: the caller's contract (`Launcher::launch`).
        unsafe { self.0.launch(module, function, n, args) }
    }
}
