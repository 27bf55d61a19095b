//! One shard in the memory of the `cuda` transport's device ([`DeviceShard`]): the host store's
//! protocol ([`ShardStore`]) with the values on the device and the arithmetic in
//! [`OptimizerKernels`].

use std::sync::Arc;

use odc_transport::cuda::{
    CudaTransport, Device, DeviceAccumulator, DeviceBuffer, DevicePublished,
};
use odc_transport::{codec, AccumulatorRegion, Dtype, PublishedRegion, RegionHandle, WriteGuard};

use super::cuda_transport;
use super::kernels::{OptimizerKernels, SgdMomentum};
use crate::error::{Error, Result};
use crate::server::optimizer::{
    plan_step, OptimizerConfig, OptimizerState, StepScalars, SGD_MOMENTUM_BUFFER,
};
use crate::server::shard::{Context, ShardStore};
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
    device: Arc<Device>,
    kernels: OptimizerKernels,
    len: usize,
    master: DeviceBuffer,
    /// The kept gradient (after `Reduce`), or the accumulator's previous buffer.
    grad: DeviceBuffer,
    /// `Reduce` kept a gradient in `grad` for `Apply`.
    kept: bool,
    optimizer: DeviceOptimizer,
    published: DevicePublished,
    accumulator: DeviceAccumulator,
    /// fp32 copy for read-outs (bf16 pulls only), registered on first use.
    snapshot: Option<DevicePublished>,
    /// fp32 copies of the optimizer buffers, registered on first use.
    optimizer_snapshots: Vec<Option<DevicePublished>>,
}

/// Host values as fp32 device memory of `device`.
fn upload(device: &Arc<Device>, values: &[f32]) -> Result<DeviceBuffer> {
    let buffer = device.alloc(values.len() * 4)?;
    device.upload(&buffer, 0, &codec::encode_f32(values))?;
    Ok(buffer)
}

impl DeviceShard {
    /// The shard of `master` with `optimizer`'s state, moved into the device memory of
    /// `transport`, with its published copy (version 0) and its accumulator (at the spec's epoch,
    /// admitting only what `admission` admits) registered there. Compiles the kernels on the
    /// device's first shard (NVRTC; without it: `no NVRTC: …`).
    pub(crate) fn new(
        transport: &CudaTransport,
        spec: &ServerSpec,
        master: &[f32],
        optimizer: &OptimizerState,
        admission: WriteGuard,
    ) -> Result<Self> {
        let device = Arc::clone(transport.device());
        let kernels = OptimizerKernels::new(&device)?;
        let len = master.len();
        let master = upload(&device, master)?;
        let grad = device.alloc(len * 4)?;
        let buffers = optimizer
            .buffers()
            .into_iter()
            .map(|values| upload(&device, values))
            .collect::<Result<Vec<_>>>()?;
        let published =
            transport.register_device_published(spec.endpoint, spec.pull_dtype, &master, 0)?;
        let accumulator = transport.register_device_accumulator(spec.endpoint, len, spec.epoch)?;
        accumulator.admit_only(admission)?;
        Ok(Self {
            device,
            kernels,
            len,
            master,
            grad,
            kept: false,
            optimizer: DeviceOptimizer {
                name: optimizer.name(),
                steps: optimizer.steps(),
                names: optimizer.buffer_names(),
                buffers,
            },
            published,
            accumulator,
            snapshot: None,
            optimizer_snapshots: Vec::new(),
        })
    }

    /// One step of the plan `scalars` with the kept gradient times `clip`.
    fn step(&mut self, scalars: StepScalars, clip: f64) -> Result<()> {
        match scalars {
            StepScalars::AdamW(s) => {
                let [exp_avg, exp_avg_sq] = &self.optimizer.buffers[..] else {
                    return Err(Error::Layout(format!(
                        "the device's AdamW state holds {} buffers, not 2",
                        self.optimizer.buffers.len()
                    )));
                };
                self.kernels
                    .adamw(&s, clip, &self.master, &self.grad, exp_avg, exp_avg_sq)
            }
            StepScalars::Sgd {
                lr,
                momentum,
                weight_decay,
            } => {
                if momentum != 0.0 && self.optimizer.buffers.is_empty() {
                    // torch creates the momentum buffer on the first step with momentum.
                    let buffer = self.device.alloc(self.len * 4)?;
                    self.kernels.sgd(
                        lr,
                        momentum,
                        weight_decay,
                        clip,
                        &self.master,
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
                self.kernels.sgd(
                    lr,
                    momentum,
                    weight_decay,
                    clip,
                    &self.master,
                    &self.grad,
                    buffer,
                )
            }
        }
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
        let transport = cuda_transport(&context.node).ok_or_else(|| {
            Error::Config("a shard in device memory on a node whose transport is not cuda".into())
        })?;
        let region = transport.register_device_published(
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

impl ShardStore for DeviceShard {
    fn published(&self) -> RegionHandle {
        self.published.handle()
    }

    fn accumulator(&self) -> RegionHandle {
        self.accumulator.handle()
    }

    fn reduce(&mut self, scale: f64, next_epoch: u64, sum_sq: &mut f64) -> Result<()> {
        self.kept = false;
        self.accumulator.take_into(next_epoch, &mut self.grad)?;
        *sum_sq += self.kernels.scale_sum_sq(&self.grad, scale)?;
        self.kept = true;
        Ok(())
    }

    fn apply(&mut self, optimizer: &OptimizerConfig, clip: f64, version: u64) -> Result<()> {
        // The kept gradient is used up by this call, whatever happens (as the host store's).
        let kept = std::mem::replace(&mut self.kept, false);
        let o = &self.optimizer;
        let scalars = plan_step(optimizer, o.name, self.len, o.steps, self.len, self.len)?;
        if !kept {
            self.device.zero(&self.grad)?;
        }
        self.step(scalars, clip)?;
        self.optimizer.steps = self.optimizer.steps.saturating_add(1);
        self.published.publish_from(version, &self.master)?;
        Ok(())
    }

    fn discard(&mut self, next_epoch: u64) -> Result<()> {
        self.kept = false;
        self.accumulator.take_into(next_epoch, &mut self.grad)?;
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
            Self::publish_copy(&mut self.snapshot, &self.master, context)?
        };
        if !optimizer {
            return Ok((region, None));
        }
        let o = &self.optimizer;
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
}
