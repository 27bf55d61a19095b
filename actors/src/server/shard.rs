//! Where one shard's values live and how the barrier runs on them: [`ShardStore`], implemented in
//! host memory by [`HostShard`] (the default, every backend) and in CUDA device memory by
//! `device::DeviceShard` (feature `cuda`, the `cuda` backend). The actor drives either through the
//! same calls, so the barrier protocol is one: `Reduce` takes the accumulator into the kept gradient
//! scaled by `scale` and adds the squares of the scaled values to the server's sum; `Apply`
//! multiplies the kept gradient by `clip` (when it is not 1), runs the optimizer's step
//! ([`optimizer::plan_step`](super::optimizer::plan_step) and its elementwise math) and publishes
//! the new version; `Discard` drops the accumulator's values and the kept gradient; `Snapshot`
//! hands out fp32 regions of the master weights (and the optimizer's buffers) to read.

use std::sync::Arc;

use odc_transport::{codec, AccumulatorRegion, Dtype, PublishedRegion, RegionHandle, WriteGuard};

use super::optimizer::{OptimizerConfig, OptimizerState};
use super::{OptimizerSnapshot, ServerSpec};
use crate::error::Result;
use crate::node::Node;

/// What blocking work may read of the server besides its shards.
pub(super) struct Context {
    pub(super) node: Arc<Node>,
    pub(super) spec: ServerSpec,
    /// The version of the published parameters.
    pub(super) version: u64,
}

/// One shard's master weights, optimizer state, accumulator, published copy and read-out copies.
/// Every call runs on a blocking thread (the actor's `off_runtime`).
pub(super) trait ShardStore: Send {
    /// The published copy trainers read.
    fn published(&self) -> RegionHandle;
    /// The accumulator trainers push into.
    fn accumulator(&self) -> RegionHandle;
    /// Take the accumulator (moving it to `next_epoch`), scale each value by `scale` (in f64,
    /// rounded to f32), keep it for [`ShardStore::apply`], and add the squares of the scaled
    /// values to `sum_sq`.
    fn reduce(&mut self, scale: f64, next_epoch: u64, sum_sq: &mut f64) -> Result<()>;
    /// One optimizer step with the kept gradient (zeros if none) times `clip` (when not 1), then
    /// publish the master weights as `version`.
    fn apply(&mut self, optimizer: &OptimizerConfig, clip: f64, version: u64) -> Result<()>;
    /// Drop the accumulator's values (moving it to `next_epoch`) and the kept gradient.
    fn discard(&mut self, next_epoch: u64) -> Result<()>;
    /// fp32 regions of the master weights and, when `optimizer`, of the optimizer's buffers, at
    /// the server's version.
    fn snapshot(
        &mut self,
        context: &Context,
        optimizer: bool,
    ) -> Result<(RegionHandle, Option<OptimizerSnapshot>)>;
}

/// A shard in host memory: `Vec<f32>`s, the host optimizer loops, host-encoded publications.
pub(super) struct HostShard {
    pull_dtype: Dtype,
    master: Vec<f32>,
    optimizer: OptimizerState,
    published: Box<dyn PublishedRegion>,
    accumulator: Box<dyn AccumulatorRegion>,
    /// fp32 copy for read-outs, registered on first use (bf16 pulls only; fp32 pulls read the
    /// published copy, which is the same bytes).
    snapshot: Option<Box<dyn PublishedRegion>>,
    /// fp32 copies of the optimizer buffers for checkpoints, registered on first use.
    optimizer_snapshots: Vec<Option<Box<dyn PublishedRegion>>>,
    /// The scaled gradient `Reduce` kept for `Apply`.
    grad: Option<Vec<f32>>,
}

impl HostShard {
    /// Register the shard's regions with `node`'s transport: the published copy of `master` at
    /// version 0 and a zeroed accumulator at the spec's epoch that admits only what `admission`
    /// admits.
    pub(super) fn new(
        node: &Node,
        spec: &ServerSpec,
        master: Vec<f32>,
        optimizer: OptimizerState,
        admission: WriteGuard,
    ) -> Result<Self> {
        let published = node.transport.register_published(
            spec.endpoint,
            spec.pull_dtype,
            codec::encode(spec.pull_dtype, &master),
            0,
        )?;
        let accumulator =
            node.transport
                .register_accumulator(spec.endpoint, master.len(), spec.epoch)?;
        accumulator.admit_only(admission)?;
        Ok(Self {
            pull_dtype: spec.pull_dtype,
            master,
            optimizer,
            published,
            accumulator,
            snapshot: None,
            optimizer_snapshots: Vec::new(),
            grad: None,
        })
    }
}

impl ShardStore for HostShard {
    fn published(&self) -> RegionHandle {
        self.published.handle()
    }

    fn accumulator(&self) -> RegionHandle {
        self.accumulator.handle()
    }

    fn reduce(&mut self, scale: f64, next_epoch: u64, sum_sq: &mut f64) -> Result<()> {
        let mut grad = self.accumulator.take(next_epoch);
        for g in &mut grad {
            *g = (*g as f64 * scale) as f32;
            *sum_sq += (*g as f64) * (*g as f64);
        }
        self.grad = Some(grad);
        Ok(())
    }

    fn apply(&mut self, optimizer: &OptimizerConfig, clip: f64, version: u64) -> Result<()> {
        let mut grad = self
            .grad
            .take()
            .unwrap_or_else(|| vec![0.0; self.master.len()]);
        if clip != 1.0 {
            for g in &mut grad {
                *g = (*g as f64 * clip) as f32;
            }
        }
        self.optimizer.step(optimizer, &mut self.master, &grad)?;
        self.published
            .publish(version, codec::encode(self.pull_dtype, &self.master))?;
        Ok(())
    }

    fn discard(&mut self, next_epoch: u64) -> Result<()> {
        self.accumulator.take(next_epoch);
        self.grad = None;
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
            publish_copy(&mut self.snapshot, &self.master, context)?
        };
        if !optimizer {
            return Ok((region, None));
        }
        let names = self.optimizer.buffer_names();
        let buffers = self.optimizer.buffers();
        self.optimizer_snapshots.resize_with(buffers.len(), || None);
        let mut handles = Vec::with_capacity(buffers.len());
        for ((name, values), slot) in names
            .iter()
            .zip(buffers)
            .zip(self.optimizer_snapshots.iter_mut())
        {
            handles.push((name.to_string(), publish_copy(slot, values, context)?));
        }
        let snapshot = OptimizerSnapshot {
            steps: self.optimizer.steps(),
            buffers: handles,
        };
        Ok((region, Some(snapshot)))
    }
}

/// Publish `values` as fp32 at the server's version in the region kept in `slot` (registered on
/// first use) and return its handle.
fn publish_copy(
    slot: &mut Option<Box<dyn PublishedRegion>>,
    values: &[f32],
    context: &Context,
) -> Result<RegionHandle> {
    let bytes = codec::encode(Dtype::F32, values);
    if let Some(region) = slot {
        region.publish(context.version, bytes)?;
        return Ok(region.handle());
    }
    let region = context.node.transport.register_published(
        context.spec.endpoint,
        Dtype::F32,
        bytes,
        context.version,
    )?;
    let handle = region.handle();
    *slot = Some(region);
    Ok(handle)
}
