//! A trainer's CUDA device memory as its data path's buffers (feature `cuda`): a gather lands in
//! a device buffer that is already a candle tensor ([`Memory`], [`Unit`]), and a unit's
//! gradient leaves from the tensor the backward wrote ([`Grad`]). Together with shard servers on
//! the same GPU (`JobBuilder::servers_on_device`) no parameter or gradient byte crosses host
//! memory.
//!
//! Guarantees (the contracts of [`odc_actors::memory::device`]):
//! 1. **A gather buffer is free when handed out.** It is allocated on the trainer's stream
//!    (candle's, stream-ordered), and handed to the transport only once an event recorded right
//!    after the allocation completed: whatever the stream did with that memory before (a freed
//!    tensor's last kernels) is over, so the transport's copy on its own stream cannot race it.
//!    The copy completes before the gather returns, so the kernels the compute enqueues next on
//!    its stream read the whole unit.
//! 2. **A gradient is read only once computed.** [`Grad::new`] records an event on the trainer's
//!    stream after the kernels that wrote the gradient; the push waits for it before the owner's
//!    kernel reads the memory, and the tensor (its memory) lives as long as the push does.
//! 3. **No copy in between.** The gather buffer becomes the unit's tensor as it is (published
//!    dtype: bf16 stays bf16 until the compute casts it on the device); the gradient is pushed
//!    from the backward's own tensor.
//! 4. **Bounded waits (I6).** Each wait polls its event until [`WAIT`]; past it the error names
//!    what was waited for.

use std::any::Any;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaEvent, CudaStream, DevicePtr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Device, Storage, Tensor};
use odc_actors::datapath::Transfer;
use odc_actors::trainer::{DeviceGrad, DeviceMemory, DeviceUnit, UnitValues};
use odc_transport::{DeviceDest, Dtype};

use super::staging::WAIT;

fn failed(what: &str, e: impl std::fmt::Display) -> odc_actors::Error {
    odc_actors::Error::User {
        message: format!("cuda: {what} failed: {e}"),
    }
}

/// The trainer's device, as where its gathers land (see the [module docs](self)).
pub struct Memory {
    device: CudaDevice,
    stream: Arc<CudaStream>,
    ordinal: u32,
}

impl Memory {
    /// The memory of `device` (a CUDA device), on its stream.
    pub fn new(device: &Device) -> crate::model::error::Result<Self> {
        let cuda = device
            .as_cuda_device()
            .map_err(|e| crate::model::error::Error::Device(e.to_string()))?
            .clone();
        let ordinal = crate::model::device::location_ordinal(device) as u32;
        Ok(Memory {
            stream: cuda.cuda_stream(),
            device: cuda,
            ordinal,
        })
    }

    /// A tensor of `elements` of `dtype` on the stream, its address, and the event after its
    /// allocation.
    fn make(&self, elements: usize, dtype: Dtype) -> odc_actors::Result<(Unit, CudaEvent)> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| failed("binding the context", e))?;
        let (storage, ptr) = match dtype {
            Dtype::F32 => {
                // SAFETY: the buffer is written whole by the gather's copy before any kernel
                // reads it (the gather returns only once the copy completed).
                let slice = unsafe { self.stream.alloc::<f32>(elements) }
                    .map_err(|e| failed("allocating a gather buffer", e))?;
                let ptr = slice.device_ptr(&self.stream).0;
                (
                    CudaStorage::wrap_cuda_slice(slice, self.device.clone()),
                    ptr,
                )
            }
            Dtype::Bf16 => {
                // SAFETY: as above.
                let slice = unsafe { self.stream.alloc::<half::bf16>(elements) }
                    .map_err(|e| failed("allocating a gather buffer", e))?;
                let ptr = slice.device_ptr(&self.stream).0;
                (
                    CudaStorage::wrap_cuda_slice(slice, self.device.clone()),
                    ptr,
                )
            }
        };
        let tensor =
            Tensor::from_storage(Storage::Cuda(storage), elements, BackpropOp::none(), false);
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| failed("cuEventRecord", e))?;
        let dest = DeviceDest {
            device: self.ordinal,
            ptr,
            bytes: (elements * dtype.size()) as u64,
        };
        let context = self.stream.context().clone();
        Ok((
            Unit {
                tensor,
                dest,
                context,
            },
            event,
        ))
    }

    /// A flat tensor of `elements` of `dtype` on the stream, free for a transport to write
    /// (guarantee 1), and its memory.
    pub async fn tensor(
        &self,
        elements: usize,
        dtype: Dtype,
    ) -> odc_actors::Result<(Tensor, DeviceDest)> {
        let (unit, event) = self.make(elements, dtype)?;
        reached(&unit.context, &event, "a buffer's allocation").await?;
        Ok((unit.tensor.clone(), unit.dest))
    }
}

/// The device memory of `t`: contiguous, f32 or bf16, on a CUDA device. What the memory holds
/// is only complete once the kernels enqueued on its stream so far have run.
pub fn device_range(t: &Tensor) -> crate::model::error::Result<DeviceDest> {
    let err = |what: String| crate::model::error::Error::Device(format!("cuda: {what}"));
    let ordinal = crate::model::device::location_ordinal(t.device()) as u32;
    let cuda = t
        .device()
        .as_cuda_device()
        .map_err(|e| err(e.to_string()))?;
    let stream = cuda.cuda_stream();
    let (storage, layout) = t.storage_and_layout();
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(err("a tensor that is not contiguous".into()));
    };
    let Storage::Cuda(storage) = &*storage else {
        return Err(err("a tensor that is not in CUDA memory".into()));
    };
    let slice_err = |e: candle_core::Error| err(format!("a tensor's memory: {e}"));
    let (ptr, size) = match t.dtype() {
        candle_core::DType::F32 => {
            let slice = storage.as_cuda_slice::<f32>().map_err(slice_err)?;
            let ptr = slice.slice(start..end).device_ptr(&stream).0;
            (ptr, 4)
        }
        candle_core::DType::BF16 => {
            let slice = storage.as_cuda_slice::<half::bf16>().map_err(slice_err)?;
            let ptr = slice.slice(start..end).device_ptr(&stream).0;
            (ptr, 2)
        }
        other => return Err(err(format!("a tensor of {other:?}, not f32 or bf16"))),
    };
    Ok(DeviceDest {
        device: ordinal,
        ptr,
        bytes: ((end - start) * size) as u64,
    })
}

impl DeviceMemory for Memory {
    fn allocate(&self, elements: usize, dtype: Dtype) -> Transfer<Arc<dyn DeviceUnit>> {
        let made = self.make(elements, dtype);
        let context = self.stream.context().clone();
        Box::pin(async move {
            let (unit, event) = made?;
            reached(&context, &event, "a gather buffer's allocation").await?;
            Ok(Arc::new(unit) as Arc<dyn DeviceUnit>)
        })
    }
}

/// A gathered unit in device memory: a flat tensor of the published dtype.
pub struct Unit {
    tensor: Tensor,
    dest: DeviceDest,
    context: Arc<CudaContext>,
}

impl Drop for Unit {
    /// The tensor's memory goes back to the stream's pool from whatever thread drops the unit
    /// (a cancelled prefetch's): bind the context there first.
    fn drop(&mut self) {
        if let Err(e) = self.context.bind_to_thread() {
            tracing::warn!("odc model: binding the context to free a gather buffer: {e}");
        }
    }
}

impl Unit {
    /// The unit's values (flat, the published dtype).
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }
}

/// The flat tensor (published dtype) of a unit gathered into device memory by [`Memory`];
/// [`crate::model::Error::Device`] for host values or another kind of device buffer.
pub fn flat_tensor(values: &UnitValues) -> crate::model::error::Result<&Tensor> {
    match values {
        UnitValues::Device { buffer, .. } => buffer
            .as_any()
            .downcast_ref::<Unit>()
            .map(Unit::tensor)
            .ok_or_else(|| {
                crate::model::error::Error::Device("a device unit of another kind".into())
            }),
        UnitValues::Host(_) => Err(crate::model::error::Error::Device(
            "a unit in host memory where device memory was expected".into(),
        )),
    }
}

impl DeviceUnit for Unit {
    fn dest(&self) -> DeviceDest {
        self.dest
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A unit's gradient on the device, pushed from where the backward wrote it.
pub struct Grad {
    /// Keeps the memory alive until the push is over.
    _tensor: Tensor,
    src: DeviceDest,
    done: Arc<CudaEvent>,
    context: Arc<CudaContext>,
}

impl Grad {
    /// `flat` (a contiguous fp32 tensor on a CUDA device), with an event recorded on its stream
    /// after the kernels enqueued so far (those that wrote it).
    pub fn new(flat: Tensor) -> crate::model::error::Result<Self> {
        let err = |what: String| crate::model::error::Error::Device(format!("cuda push: {what}"));
        if flat.dtype() != candle_core::DType::F32 {
            return Err(err(format!("a gradient of {:?}", flat.dtype())));
        }
        let src = device_range(&flat)?;
        let stream = flat
            .device()
            .as_cuda_device()
            .map_err(|e| err(e.to_string()))?
            .cuda_stream();
        let done = stream
            .record_event(None)
            .map_err(|e| err(format!("cuEventRecord: {e}")))?;
        Ok(Grad {
            src,
            _tensor: flat,
            done: Arc::new(done),
            context: stream.context().clone(),
        })
    }
}

impl Drop for Grad {
    /// As [`Unit`]'s: the push task's thread frees the gradient's memory.
    fn drop(&mut self) {
        if let Err(e) = self.context.bind_to_thread() {
            tracing::warn!("odc model: binding the context to free a pushed gradient: {e}");
        }
    }
}

impl DeviceGrad for Grad {
    fn src(&self) -> DeviceDest {
        self.src
    }

    fn ready(&self) -> Transfer<()> {
        let (done, context) = (self.done.clone(), self.context.clone());
        Box::pin(async move { reached(&context, &done, "a gradient's kernels").await })
    }
}

/// Waits for `event` (polled, at most [`WAIT`]: odc-transport's one device wait).
async fn reached(context: &CudaContext, event: &CudaEvent, what: &str) -> odc_actors::Result<()> {
    odc_transport::cuda::event::reached(context, event.cu_event(), what, WAIT)
        .await
        .map_err(|message| odc_actors::Error::User { message })
}
