//! One shard in the memory of the `cuda` transport's device ([`DeviceShard`]): the host store's
//! protocol ([`ShardStore`]) with the values on the device and the arithmetic in
//! [`OptimizerKernels`]. A frozen unit's shard keeps only its master weights and published copy
//! (no accumulator, gradient buffer, optimizer buffers or kernels); `Apply` publishes the same
//! bytes again as the new version (`PublishedRegion::republish`: no copy).

use std::sync::Arc;

use odc_transport::cuda::{
    CudaTransport, Device, DeviceAccumulator, DeviceBuffer, DeviceLauncher, DevicePublished,
};
use odc_transport::{codec, AccumulatorRegion, Dtype, PublishedRegion, RegionHandle, WriteGuard};

use super::cuda_transport;
use crate::error::{Error, Result};
use crate::server::optimizer::{
    plan_step, OptimizerConfig, OptimizerState, StepScalars, SGD_MOMENTUM_BUFFER,
};
use crate::server::optimizer_kernels::{OptimizerKernels, SgdMomentum};
use crate::server::shard::{Captured, Context, ShardStore, StoreValues};
use crate::server::{OptimizerSnapshot, ServerSpec};

/// The optimizer's state in device memory: the step count and the per-element buffers, named as
/// [`OptimizerState::buffer_names`] names them.
struct DeviceOptimizer {
    /// [`OptimizerState::name`].
    name: &'static str,
    steps: u64,
    names: &'static [&'static str],
    buffers: Vec<DeviceBuffer>,
}

/// One shard in device memory.
pub(crate) struct DeviceShard {
    len: usize,
    /// The fp32 master weights; `None` for a served unit's shard, whose published copy is all
    /// it keeps (nothing reads a served unit's masters: [`crate::layout::UnitSpec::served`]).
    master: Option<DeviceBuffer>,
    published: DevicePublished,
    /// What a trainable shard has besides; `None` for a frozen unit's shard.
    training: Option<DeviceTraining>,
    /// fp32 copy for read-outs (bf16 pulls only), registered on first use.
    snapshot: Option<DevicePublished>,
    /// fp32 copies of the optimizer buffers, registered on first use.
    optimizer_snapshots: Vec<Option<DevicePublished>>,
}

/// A trainable shard's kernels, optimizer state, accumulator and kept gradient.
struct DeviceTraining {
    device: Arc<Device>,
    kernels: OptimizerKernels<DeviceLauncher>,
    /// The kept gradient (after `Reduce`), or the accumulator's previous buffer.
    grad: DeviceBuffer,
    /// `Reduce` kept a gradient in `grad` for `Apply`.
    kept: bool,
    optimizer: DeviceOptimizer,
    accumulator: DeviceAccumulator,
}

/// Host values as fp32 device memory of `device`.
fn upload(device: &Arc<Device>, values: &[f32]) -> Result<DeviceBuffer> {
    let buffer = device.alloc(values.len() * 4)?;
    device.upload(&buffer, 0, &codec::encode_f32(values))?;
    Ok(buffer)
}

impl DeviceShard {
    /// The shard of `master` moved into the device memory of `transport`, with its published
    /// copy (version 0) registered there and, for a trainable shard (`optimizer` given), that
    /// optimizer state and an accumulator (at the spec's epoch, admitting only what `admission`
    /// admits). A frozen shard (`optimizer` `None`) allocates neither, nor a gradient buffer; a
    /// `served` one (frozen) frees its masters once published. Compiles the kernels on the
    /// device's first trainable shard (NVRTC; without it: `no NVRTC: …`).
    pub(crate) fn new(
        transport: &CudaTransport,
        spec: &ServerSpec,
        master: &[f32],
        optimizer: Option<&OptimizerState>,
        admission: WriteGuard,
        served: bool,
    ) -> Result<Self> {
        let device = Arc::clone(transport.device());
        let len = master.len();
        let master = upload(&device, master)?;
        let published =
            transport.register_device_published(spec.endpoint, spec.pull_dtype, &master, 0)?;
        let training = match optimizer {
            None => None,
            Some(optimizer) => {
                let kernels = OptimizerKernels::new(DeviceLauncher(Arc::clone(&device)))?;
                let grad = device.alloc(len * 4)?;
                let buffers = optimizer
                    .buffers()
                    .into_iter()
                    .map(|values| upload(&device, values))
                    .collect::<Result<Vec<_>>>()?;
                let accumulator =
                    transport.register_device_accumulator(spec.endpoint, len, spec.epoch)?;
                accumulator.admit_only(admission)?;
                Some(DeviceTraining {
                    device,
                    kernels,
                    grad,
                    kept: false,
                    optimizer: DeviceOptimizer {
                        name: optimizer.name(),
                        steps: optimizer.steps(),
                        names: optimizer.buffer_names(),
                        buffers,
                    },
                    accumulator,
                })
            }
        };
        let master = (!served || training.is_some()).then_some(master);
        Ok(Self {
            len,
            master,
            published,
            training,
            snapshot: None,
            optimizer_snapshots: Vec::new(),
        })
    }

    /// Publish `values` as fp32 at the server's version in the device region kept in `slot`
    /// (registered on first use) and return its handle.
    fn publish_copy(
        slot: &mut Option<DevicePublished>,
        values: &DeviceBuffer,
        context: &Context,
    ) -> Result<RegionHandle> {
        if let Some(region) = slot {
            region.publish_from(context.version, values)?;
            return Ok(region.handle());
        }
        let region = transport_of(context)?.register_device_published(
            context.spec.endpoint,
            Dtype::F32,
            values,
            context.version,
        )?;
        let handle = region.handle();
        *slot = Some(region);
        Ok(handle)
    }
}

/// Something of each of a shard's buffers: the master weights, and the optimizer's step count
/// with each named buffer (none for a frozen shard).
struct PerBuffer<T> {
    master: T,
    steps: u64,
    buffers: Vec<(String, T)>,
}

impl DeviceShard {
    /// `f` of each of its buffers.
    fn each_buffer<T>(&self, f: impl Fn(&DeviceBuffer) -> Result<T>) -> Result<PerBuffer<T>> {
        let master = f(masters(&self.master)?)?;
        let Some(t) = &self.training else {
            return Ok(PerBuffer {
                master,
                steps: 0,
                buffers: Vec::new(),
            });
        };
        let o = &t.optimizer;
        let buffers = o
            .names
            .iter()
            .zip(&o.buffers)
            .map(|(name, b)| Ok((name.to_string(), f(b)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(PerBuffer {
            master,
            steps: o.steps,
            buffers,
        })
    }
}

/// A shard's master weights; an error for a served unit's shard, which keeps none.
fn masters(master: &Option<DeviceBuffer>) -> Result<&DeviceBuffer> {
    master
        .as_ref()
        .ok_or_else(|| Error::Internal("a served shard keeps no master values to read out".into()))
}

/// The node's `cuda` transport, whose device a device shard lives on.
fn transport_of(context: &Context) -> Result<&CudaTransport> {
    cuda_transport(&context.node).ok_or_else(|| {
        Error::Config("a shard in device memory on a node whose transport is not cuda".into())
    })
}

impl DeviceTraining {
    /// One step of the plan `scalars` on `master` (`len` elements) with the kept gradient times
    /// `clip`.
    fn step(
        &mut self,
        scalars: StepScalars,
        clip: f64,
        master: &DeviceBuffer,
        len: usize,
    ) -> Result<()> {
        match scalars {
            StepScalars::AdamW(s) => {
                let [exp_avg, exp_avg_sq] = &self.optimizer.buffers[..] else {
                    return Err(Error::Layout(format!(
                        "the device's AdamW state holds {} buffers, not 2",
                        self.optimizer.buffers.len()
                    )));
                };
                self.kernels
                    .adamw(&s, clip, master, &self.grad, exp_avg, exp_avg_sq)
            }
            StepScalars::Sgd {
                lr,
                momentum,
                weight_decay,
            } => {
                if momentum != 0.0 && self.optimizer.buffers.is_empty() {
                    // torch creates the momentum buffer on the first step with momentum.
                    let buffer = self.device.alloc(len * 4)?;
                    self.kernels.sgd(
                        lr,
                        momentum,
                        weight_decay,
                        clip,
                        master,
                        &self.grad,
                        SgdMomentum::First(&buffer),
                    )?;
                    self.optimizer.buffers.push(buffer);
                    self.optimizer.names = &[SGD_MOMENTUM_BUFFER];
                    return Ok(());
                }
                let buffer = match self.optimizer.buffers.first() {
                    Some(buffer) if momentum != 0.0 => SgdMomentum::Next(buffer),
                    _ => SgdMomentum::Off,
                };
                self.kernels
                    .sgd(lr, momentum, weight_decay, clip, master, &self.grad, buffer)
            }
        }
    }
}

impl ShardStore for DeviceShard {
    fn published(&self) -> RegionHandle {
        self.published.handle()
    }

    fn accumulator(&self) -> Option<RegionHandle> {
        self.training.as_ref().map(|t| t.accumulator.handle())
    }

    fn reduce(&mut self, scale: f64, next_epoch: u64, sum_sq: &mut f64) -> Result<()> {
        let Some(t) = &mut self.training else {
            return Ok(());
        };
        t.kept = false;
        t.accumulator.take_into(next_epoch, &mut t.grad)?;
        *sum_sq += t.kernels.scale_sum_sq(&t.grad, scale)?;
        t.kept = true;
        Ok(())
    }

    fn apply(&mut self, optimizer: &OptimizerConfig, clip: f64, version: u64) -> Result<()> {
        let Some(t) = &mut self.training else {
            // Frozen: the same values, published again as `version` (no copy).
            self.published.republish(version)?;
            return Ok(());
        };
        // The kept gradient is used up by this call, whatever happens (as the host store's).
        let kept = std::mem::replace(&mut t.kept, false);
        let o = &t.optimizer;
        let scalars = plan_step(optimizer, o.name, self.len, o.steps, self.len, self.len)?;
        if !kept {
            t.device.zero(&t.grad)?;
        }
        let master = masters(&self.master)?;
        t.step(scalars, clip, master, self.len)?;
        t.optimizer.steps = t.optimizer.steps.saturating_add(1);
        self.published.publish_from(version, master)?;
        Ok(())
    }

    fn discard(&mut self, next_epoch: u64) -> Result<()> {
        if let Some(t) = &mut self.training {
            t.kept = false;
            t.accumulator.take_into(next_epoch, &mut t.grad)?;
        }
        Ok(())
    }

    fn snapshot(
        &mut self,
        context: &Context,
        optimizer: bool,
    ) -> Result<(RegionHandle, Option<OptimizerSnapshot>)> {
        let region = if context.spec.pull_dtype == Dtype::F32 {
            self.published.handle()
        } else {
            Self::publish_copy(&mut self.snapshot, masters(&self.master)?, context)?
        };
        if !optimizer {
            return Ok((region, None));
        }
        let Some(t) = &self.training else {
            return Ok((region, Some(OptimizerSnapshot::default())));
        };
        let o = &t.optimizer;
        self.optimizer_snapshots
            .resize_with(o.buffers.len(), || None);
        let mut handles = Vec::with_capacity(o.buffers.len());
        for ((name, values), slot) in o
            .names
            .iter()
            .zip(&o.buffers)
            .zip(self.optimizer_snapshots.iter_mut())
        {
            handles.push((name.to_string(), Self::publish_copy(slot, values, context)?));
        }
        let snapshot = OptimizerSnapshot {
            steps: o.steps,
            buffers: handles,
        };
        Ok((region, Some(snapshot)))
    }

    /// Device copies of the master weights and optimizer buffers (device to device: the step
    /// waits for milliseconds, not for a download), brought to host memory on the writer's
    /// thread, each device copy freed once downloaded: one copy of the shard in all. Where the
    /// device has no room for the copies, the values are downloaded now ([`Self::values`]).
    fn capture(&self, context: &Context) -> Result<Captured> {
        let device = Arc::clone(transport_of(context)?.device());
        let copy = |buffer: &DeviceBuffer| -> Result<DeviceBuffer> {
            let copied = device.alloc(buffer.len())?;
            device.copy(&copied, buffer)?;
            Ok(copied)
        };
        let PerBuffer {
            master,
            steps,
            buffers,
        } = match self.each_buffer(copy) {
            Ok(copies) => copies,
            Err(e) => {
                tracing::warn!("checkpoint: no device copy ({e}): downloading the shard now");
                return Ok(Captured::Now(self.values(context)?));
            }
        };
        let len = self.len;
        Ok(Captured::Later(Box::new(move || {
            let params = device.download_f32(&master, len)?;
            drop(master);
            let mut host = Vec::with_capacity(buffers.len());
            for (name, buffer) in buffers {
                host.push((name, device.download_f32(&buffer, len)?));
            }
            Ok(StoreValues {
                params,
                steps,
                buffers: host,
            })
        })))
    }

    fn values(&self, context: &Context) -> Result<StoreValues> {
        let device = transport_of(context)?.device();
        let host = self.each_buffer(|buffer| Ok(device.download_f32(buffer, self.len)?))?;
        Ok(StoreValues {
            params: host.master,
            steps: host.steps,
            buffers: host.buffers,
        })
    }
}
