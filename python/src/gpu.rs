//! The GPU path: a trainer's gathers land in device memory of PyTorch's own CUDA
//! context, handed to PyTorch as `kDLCUDA` DLPack views, and a CUDA gradient leaves from the
//! tensor autograd wrote, over odc's `cuda` transport, with no byte through host memory.
//!
//! Everything here is driver API on raw addresses (cudarc, loaded at run time); no Python object
//! is touched but on the Python thread that holds the GIL.
//!
//! Invariants (the contracts of `odc::DeviceMemory` and `odc::DeviceGrad`, and PyTorch's streams):
//! 1. **A buffer handed out is free.** A gather buffer is allocated stream-ordered on odc's own
//!    stream `S` (`cuMemAllocAsync`, the device's pool: no device-wide synchronisation per
//!    micro-batch) and handed to the transport only once an event recorded after the allocation
//!    completed, so whatever `S` did with that memory before is over.
//! 2. **Memory a consumer still reads is held until it is done.** A view exported to PyTorch
//!    records, when PyTorch lets it go (the DLPack deleter), an event on the stream PyTorch named
//!    at export (`__dlpack__(stream=…)`), and `S` waits on it; the buffer is freed on `S` after
//!    that wait (`cuMemFreeAsync`), once neither PyTorch nor the trainer holds it. A later
//!    allocation from the pool is therefore after PyTorch's last kernel on the old buffer.
//! 3. **A gradient is read only once computed.** Its capsule is asked for on `S`
//!    (`grad.__dlpack__(stream=S)`: PyTorch makes `S` wait on its current stream), and an event
//!    recorded on `S` right after is what the push waits for before the transport reads it.
//! 4. **A pushed gradient's memory lives until its push is over.** The consumed capsule is held
//!    (not deleted) in [`Holding`] until the push has dropped its reference; its deleter (which
//!    frees PyTorch's tensor) then runs on the Python thread, at the next call that sweeps.
//! 5. **Bounded waits (I6).** Each event is polled until [`WAIT`]; past it the error names what
//!    was waited for.

use std::any::Any;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{result, sys, CudaContext, CudaStream};
use odc::transport::{DeviceDest, Dtype};
use odc::{DeviceGrad, DeviceMemory, DeviceUnit};
use pyo3::prelude::*;

use crate::dlpack::{self, DLManagedTensor, DLTensor};
use crate::errors;

/// How long one wait for the device may take before it is an error.
pub(crate) const WAIT: Duration = Duration::from_secs(60);

/// The transfers' boxed futures (`odc_actors::datapath::Transfer`).
type Transfer<T> = std::pin::Pin<Box<dyn std::future::Future<Output = odc::Result<T>> + Send>>;

fn failed(what: &str, e: impl std::fmt::Display) -> odc::Error {
    odc::Error::User {
        message: format!("cuda: {what} failed: {e}"),
    }
}

/// One CUDA device as the runtime uses it: PyTorch's primary context and odc's own stream `S`.
pub(crate) struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: u32,
}

// SAFETY: the stream and context are driver handles usable from any thread once the context is
// bound there (every method binds it first).
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Device `ordinal`'s primary context (PyTorch's) and a new stream. Without a driver: the
    /// transport's `no CUDA driver: …` error, checked before any driver call.
    pub(crate) fn open(ordinal: u32) -> odc::Result<Arc<Gpu>> {
        let count = odc::transport::cuda::device_count()?;
        if ordinal >= count {
            return Err(odc::Error::Config(format!(
                "device cuda:{ordinal}: the driver sees {count} CUDA device(s)"
            )));
        }
        let ctx = CudaContext::new(ordinal as usize)
            .map_err(|e| failed("retaining the primary context", e))?;
        let stream = ctx.new_stream().map_err(|e| failed("cuStreamCreate", e))?;
        Ok(Arc::new(Gpu {
            ctx,
            stream,
            ordinal,
        }))
    }

    pub(crate) fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// `S` as DLPack names a stream (its handle).
    pub(crate) fn stream_handle(&self) -> usize {
        self.stream.cu_stream() as usize
    }

    fn bind(&self) -> odc::Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| failed("binding the context", e))
    }

    /// An event recorded on `stream` now.
    fn record(self: &Arc<Self>, stream: sys::CUstream) -> odc::Result<Event> {
        self.bind()?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| failed("cuEventCreate", e))?;
        let event = Event {
            gpu: Arc::clone(self),
            event,
        };
        // SAFETY: a live event and a stream of this context (or a special handle).
        unsafe { result::event::record(event.event, stream) }
            .map_err(|e| failed("cuEventRecord", e))?;
        Ok(event)
    }
}

/// A CUDA event of one [`Gpu`], destroyed when dropped.
struct Event {
    gpu: Arc<Gpu>,
    event: sys::CUevent,
}

// SAFETY: an event handle is usable from any thread with its context bound.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: created by `Gpu::record`, destroyed once.
        let _ = unsafe { result::event::destroy(self.event) };
    }
}

impl Event {
    /// Waits for the event (polled, at most [`WAIT`]).
    async fn reached(&self, what: &str) -> odc::Result<()> {
        odc::transport::cuda::event::reached(&self.gpu.ctx, self.event, what, WAIT)
            .await
            .map_err(|message| odc::Error::User { message })
    }
}

/// Where the trainer's device gathers get their buffers (invariant 1).
pub(crate) struct Memory(pub(crate) Arc<Gpu>);

impl DeviceMemory for Memory {
    fn allocate(&self, elements: usize, dtype: Dtype) -> Transfer<Arc<dyn DeviceUnit>> {
        let gpu = Arc::clone(&self.0);
        Box::pin(async move {
            let block = Block::allocate(&gpu, elements * dtype.size())?;
            let event = gpu.record(gpu.stream.cu_stream())?;
            event.reached("a gather buffer's allocation").await?;
            Ok(Arc::new(block) as Arc<dyn DeviceUnit>)
        })
    }
}

/// Device memory allocated and freed stream-ordered on `S` (invariant 2).
pub(crate) struct Block {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

// SAFETY: a device address; the memory is only reached through the driver.
unsafe impl Send for Block {}
unsafe impl Sync for Block {}

impl Block {
    fn allocate(gpu: &Arc<Gpu>, bytes: usize) -> odc::Result<Block> {
        gpu.bind()?;
        // SAFETY: `S` is a live stream of the bound context; the memory is written whole by the
        // gather's copy before anything reads it.
        let ptr = unsafe { result::malloc_async(gpu.stream.cu_stream(), bytes.max(1)) }
            .map_err(|e| failed(&format!("cuMemAllocAsync of {bytes} bytes"), e))?;
        Ok(Block {
            gpu: Arc::clone(gpu),
            ptr,
            bytes,
        })
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.bind() {
            tracing::warn!("odc python: cannot free a gather buffer: {e}");
            return;
        }
        // SAFETY: allocated on `S`, freed once, on `S` after every consumer's recorded wait.
        if let Err(e) = unsafe { result::free_async(self.ptr, self.gpu.stream.cu_stream()) } {
            tracing::warn!("odc python: cuMemFreeAsync failed: {e}");
        }
    }
}

impl DeviceUnit for Block {
    fn dest(&self) -> DeviceDest {
        DeviceDest {
            device: self.gpu.ordinal,
            ptr: self.ptr,
            bytes: self.bytes as u64,
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// What an exported device view keeps alive: the buffer, and the stream its consumer named;
/// dropped (the DLPack deleter), `S` waits for that stream's work so far (invariant 2).
pub(crate) struct DeviceView {
    buffer: Arc<dyn DeviceUnit>,
    gpu: Arc<Gpu>,
    consumer: usize,
}

// SAFETY: the consumer stream is a driver handle, used only through the driver.
unsafe impl Send for DeviceView {}

impl Drop for DeviceView {
    fn drop(&mut self) {
        let fenced = self
            .gpu
            .record(self.consumer as sys::CUstream)
            .and_then(|event| {
                // SAFETY: live stream and event; the wait is enqueued before the event is destroyed
                // (destroying a recorded event is allowed: the wait still sees its completion).
                unsafe {
                    result::stream::wait_event(
                        self.gpu.stream.cu_stream(),
                        event.event,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                }
                .map_err(|e| failed("cuStreamWaitEvent", e))
            });
        if let Err(e) = fenced {
            // Without the fence the memory could be reused under PyTorch's kernels: keep it.
            tracing::warn!("odc python: a device view's release could not be ordered, kept: {e}");
            std::mem::forget(Arc::clone(&self.buffer));
        }
    }
}

/// The stream a DLPack consumer names: `None`, 1 or -1 the legacy default stream, 2 the
/// per-thread one, anything else a stream pointer (0 is refused by the protocol).
pub(crate) fn consumer_stream(stream: Option<isize>) -> PyResult<usize> {
    match stream {
        None | Some(1) | Some(-1) => Ok(1),
        Some(0) => Err(errors::invalid(
            "__dlpack__(stream=0): DLPack refuses 0 for CUDA (1 is the legacy default stream)"
                .into(),
        )),
        Some(s) if s > 0 => Ok(s as usize),
        Some(s) => Err(errors::invalid(format!(
            "__dlpack__(stream={s}): not a CUDA stream"
        ))),
    }
}

/// A view of a gathered device buffer for a consumer on `stream`.
pub(crate) fn view(gpu: &Arc<Gpu>, buffer: Arc<dyn DeviceUnit>, stream: usize) -> DeviceView {
    DeviceView {
        buffer,
        gpu: Arc::clone(gpu),
        consumer: stream,
    }
}

/// A consumed capsule whose deleter has not run yet (invariant 4).
pub(crate) struct Held(*mut DLManagedTensor);

// SAFETY: no Rust thread dereferences it; only [`Holding::sweep`], on the Python thread, calls
// its deleter.
unsafe impl Send for Held {}
unsafe impl Sync for Held {}

/// The capsules of gradients in flight, freed on the Python thread once their pushes are over.
#[derive(Default)]
pub(crate) struct Holding(Mutex<Vec<Arc<Held>>>);

impl Holding {
    fn hold(&self, held: &Arc<Held>) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::clone(held));
    }

    /// Runs the deleters of the capsules no push holds any more (the GIL proves the thread).
    /// Returns how many are still held.
    pub(crate) fn sweep(&self, _py: Python<'_>) -> usize {
        let mut held = self.0.lock().unwrap_or_else(|p| p.into_inner());
        held.retain(|h| {
            if Arc::strong_count(h) > 1 {
                return true;
            }
            // SAFETY: a consumed capsule's managed tensor, deleted once (it leaves the list).
            unsafe {
                if let Some(deleter) = (*h.0).deleter {
                    deleter(h.0);
                }
            }
            false
        });
        held.len()
    }
}

/// A unit's gradient in device memory, pushed from where autograd wrote it.
struct Grad {
    _held: Arc<Held>,
    src: DeviceDest,
    done: Arc<Event>,
}

impl DeviceGrad for Grad {
    fn src(&self) -> DeviceDest {
        self.src
    }

    fn ready(&self) -> Transfer<()> {
        let done = Arc::clone(&self.done);
        Box::pin(async move { done.reached("a gradient's kernels").await })
    }
}

/// The gradient `tensor` (fp32, contiguous, `len` elements, on this device) as a push from
/// device memory (invariants 3 and 4); anything else is an error naming what was wrong.
pub(crate) fn grad(
    gpu: &Arc<Gpu>,
    holding: &Holding,
    tensor: &Bound<'_, PyAny>,
    len: usize,
    what: &str,
) -> PyResult<Arc<dyn DeviceGrad>> {
    let capsule = dlpack::Capsule::take(tensor, Some(gpu.stream_handle()), what)?;
    let checked = check_device_grad(gpu, capsule.tensor(), len, what);
    let managed = capsule.consume_later()?;
    let held = Arc::new(Held(managed));
    holding.hold(&held);
    let ptr = checked?;
    let done = gpu
        .record(gpu.stream.cu_stream())
        .map_err(errors::runtime)?;
    Ok(Arc::new(Grad {
        _held: held,
        src: DeviceDest {
            device: gpu.ordinal,
            ptr,
            bytes: len as u64 * 4,
        },
        done: Arc::new(done),
    }))
}

/// The address of a gradient's fp32 values on `gpu`, checked.
fn check_device_grad(gpu: &Gpu, t: &DLTensor, len: usize, what: &str) -> PyResult<u64> {
    let device = t.device;
    if device.device_type != dlpack::CUDA || device.device_id as i64 != i64::from(gpu.ordinal) {
        return Err(errors::invalid(format!(
            "{what}: the tensor is on DLPack device {:?}, this runtime on CUDA device {}",
            (device.device_type, device.device_id),
            gpu.ordinal
        )));
    }
    dlpack::check_layout(t, Some(len), what)?;
    if !dlpack::is_f32(t.dtype) {
        return Err(errors::invalid(format!(
            "{what}: a CUDA gradient of {} is not taken: odc's device pushes are fp32 (call \
             .float())",
            dlpack::dtype_name(t.dtype)
        )));
    }
    let base = t.data.cast::<u8>().wrapping_add(t.byte_offset as usize);
    Ok(base as *const c_void as u64)
}

/// A gathered unit in device memory, one-dimensional, in the published dtype (fp32, or bf16
/// under `precision="bf16"`), for `torch.from_dlpack`: a view, not a copy, that keeps the memory
/// alive as long as it is used and orders its release after the consumer's stream (invariant 2).
#[pyclass(frozen, name = "DeviceBuffer", module = "odc")]
pub(crate) struct DeviceBuffer {
    gpu: Arc<Gpu>,
    buffer: Arc<dyn DeviceUnit>,
    dtype: Dtype,
}

impl DeviceBuffer {
    pub(crate) fn new(gpu: &Arc<Gpu>, buffer: Arc<dyn DeviceUnit>, dtype: Dtype) -> Self {
        DeviceBuffer {
            gpu: Arc::clone(gpu),
            buffer,
            dtype,
        }
    }

    fn device(&self) -> dlpack::DLDevice {
        dlpack::DLDevice {
            device_type: dlpack::CUDA,
            device_id: self.gpu.ordinal as i32,
        }
    }
}

#[pymethods]
impl DeviceBuffer {
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<isize>,
        max_version: Option<Py<PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let _ = max_version;
        let here = self.device();
        if let Some(asked) = dl_device.filter(|&d| d != (here.device_type, here.device_id)) {
            return Err(pyo3::exceptions::PyBufferError::new_err(format!(
                "odc's buffer is on CUDA device {} (DLPack device {:?}), not {asked:?}",
                self.gpu.ordinal,
                (here.device_type, here.device_id)
            )));
        }
        if copy == Some(true) {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "odc's buffer is exported without a copy (copy=True is not offered)",
            ));
        }
        let consumer = consumer_stream(stream)?;
        let dest = self.buffer.dest();
        let dtype = match self.dtype {
            Dtype::F32 => dlpack::F32,
            Dtype::Bf16 => dlpack::BF16,
        };
        let len = self.__len__();
        let keep = view(&self.gpu, Arc::clone(&self.buffer), consumer);
        dlpack::export(py, dest.ptr as *mut c_void, here, dtype, len, keep)
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        let here = self.device();
        (here.device_type, here.device_id)
    }

    fn __len__(&self) -> usize {
        self.buffer.dest().bytes as usize / self.dtype.size()
    }

    /// The device address of the first element (what a view's `data_ptr()` is).
    #[getter]
    fn address(&self) -> u64 {
        self.buffer.dest().ptr
    }

    /// `"float32"` or `"bfloat16"`.
    #[getter]
    fn dtype(&self) -> &'static str {
        match self.dtype {
            Dtype::F32 => "float32",
            Dtype::Bf16 => "bfloat16",
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "DeviceBuffer({} {} values at {:#x} on cuda:{})",
            self.__len__(),
            self.dtype(),
            self.address(),
            self.gpu.ordinal
        )
    }
}
