//! Where one shard's values live and how the barrier runs on them: [`ShardStore`], implemented in
//! host memory by [`HostShard`] (the default, every backend) and in CUDA device memory by
//! `device::DeviceShard` (feature `cuda`, the `cuda` backend). The actor drives either through the
//! same calls, so the barrier protocol is one: `Reduce` takes the accumulator into the kept gradient
//! scaled by `scale` and adds the squares of the scaled values to the server's sum; `Apply`
//! multiplies the kept gradient by `clip` (when it is not 1), runs the optimizer's step
//! ([`optimizer::plan_step`](super::optimizer::plan_step) and its elementwise math) and publishes
//! the new version; `Discard` drops the accumulator's values and the kept gradient; `Snapshot`
//! hands out fp32 regions of the master weights (and the optimizer's buffers) to read.
//!
//! A frozen unit's shard ([`UnitSpec::frozen`](crate::layout::UnitSpec::frozen)) has only its
//! master weights and published copy: no accumulator, no optimizer state, no kept gradient.
//! `Reduce` and `Discard` leave it alone (it adds 0 to the sum of squares), and `Apply` publishes
//! the same bytes again as the new version (I1: every read during step `v` returns version `v`),
//! without a step and without encoding them again. Its snapshot's optimizer state is 0 steps and
//! no buffers.

use std::sync::Arc;

use odc_transport::{codec, AccumulatorRegion, Dtype, PublishedRegion, RegionHandle, WriteGuard};

use super::optimizer::{OptimizerConfig, OptimizerState};
use super::{OptimizerSnapshot, ServerSpec};
use crate::error::{Error, Result};
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
    /// The accumulator trainers push into (`None`: a frozen unit's shard).
    fn accumulator(&self) -> Option<RegionHandle>;
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
    /// Host copies of the fp32 master weights and of the optimizer's step count and buffers
    /// (none for a frozen shard): what a sharded checkpoint writes.
    fn values(&self, context: &Context) -> Result<StoreValues>;
    /// The values at this version for a checkpoint's writer ([`Captured`]); by default
    /// [`Self::values`], copied now.
    fn capture(&self, context: &Context) -> Result<Captured> {
        Ok(Captured::Now(self.values(context)?))
    }
}

/// A store's values copied to host memory ([`ShardStore::values`]).
pub(super) struct StoreValues {
    pub(super) params: Vec<f32>,
    pub(super) steps: u64,
    pub(super) buffers: Vec<(String, Vec<f32>)>,
}

/// A store's values taken at one version for a checkpoint ([`ShardStore::capture`]): in host
/// memory already, or copied where they live (device to device, which the step does not wait
/// long for) and brought to host memory by [`Captured::into_values`] on the writer's thread.
pub(super) enum Captured {
    Now(StoreValues),
    /// Made by the device store only (feature `cuda`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Later(Box<dyn FnOnce() -> Result<StoreValues> + Send>),
}

impl Captured {
    /// The values in host memory.
    pub(super) fn into_values(self) -> Result<StoreValues> {
        match self {
            Captured::Now(values) => Ok(values),
            Captured::Later(download) => download(),
        }
    }
}

/// A shard in host memory: `Vec<f32>`s, the host optimizer loops, host-encoded publications.
pub(super) struct HostShard {
    pull_dtype: Dtype,
    /// The fp32 master values; `None` for a served shard, whose published bytes are all it keeps
    /// (nothing reads a served unit's masters: [`crate::layout::UnitSpec::served`]).
    master: Option<Vec<f32>>,
    published: Box<dyn PublishedRegion>,
    /// What a trainable shard has besides; `None` for a frozen one, whose published copy is
    /// published again at every version as it is (no copy of its bytes is kept).
    training: Option<HostTraining>,
    /// fp32 copy for read-outs, registered on first use (bf16 pulls only; fp32 pulls read the
    /// published copy, which is the same bytes).
    snapshot: Option<Box<dyn PublishedRegion>>,
    /// fp32 copies of the optimizer buffers for checkpoints, registered on first use.
    optimizer_snapshots: Vec<Option<Box<dyn PublishedRegion>>>,
}

/// A trainable shard's optimizer state, accumulator and kept gradient.
struct HostTraining {
    optimizer: OptimizerState,
    accumulator: Box<dyn AccumulatorRegion>,
    /// The scaled gradient `Reduce` kept for `Apply`.
    grad: Option<Vec<f32>>,
}

impl HostShard {
    /// Register the shard's regions with `node`'s transport: the published copy of `master` at
    /// version 0 and, for a trainable shard (`optimizer` given), a zeroed accumulator at the
    /// spec's epoch that admits only what `admission` admits. A frozen shard (`optimizer`
    /// `None`) registers no accumulator; a `served` one (frozen) keeps only its published bytes.
    pub(super) fn new(
        node: &Node,
        spec: &ServerSpec,
        master: Vec<f32>,
        optimizer: Option<OptimizerState>,
        admission: WriteGuard,
        served: bool,
    ) -> Result<Self> {
        let bytes = codec::encode(spec.pull_dtype, &master);
        let published =
            node.transport
                .register_published(spec.endpoint, spec.pull_dtype, bytes, 0)?;
        let training = match optimizer {
            None => None,
            Some(optimizer) => {
                let accumulator =
                    node.transport
                        .register_accumulator(spec.endpoint, master.len(), spec.epoch)?;
                accumulator.admit_only(admission)?;
                let training = HostTraining {
                    optimizer,
                    accumulator,
                    grad: None,
                };
                Some(training)
            }
        };
        let master = (!served || training.is_some()).then_some(master);
        Ok(Self {
            pull_dtype: spec.pull_dtype,
            master,
            published,
            training,
            snapshot: None,
            optimizer_snapshots: Vec::new(),
        })
    }
}

/// A shard's master values; an error for a served unit's shard, which keeps none.
fn masters(master: &mut Option<Vec<f32>>) -> Result<&mut Vec<f32>> {
    master.as_mut().ok_or_else(no_masters)
}

fn no_masters() -> Error {
    Error::Internal("a served shard keeps no master values to read out".into())
}

impl ShardStore for HostShard {
    fn published(&self) -> RegionHandle {
        self.published.handle()
    }

    fn accumulator(&self) -> Option<RegionHandle> {
        self.training.as_ref().map(|t| t.accumulator.handle())
    }

    fn reduce(&mut self, scale: f64, next_epoch: u64, sum_sq: &mut f64) -> Result<()> {
        let Some(training) = &mut self.training else {
            return Ok(());
        };
        let mut grad = training.accumulator.take(next_epoch);
        for g in &mut grad {
            *g = (*g as f64 * scale) as f32;
            *sum_sq += (*g as f64) * (*g as f64);
        }
        training.grad = Some(grad);
        Ok(())
    }

    fn apply(&mut self, optimizer: &OptimizerConfig, clip: f64, version: u64) -> Result<()> {
        let Some(training) = &mut self.training else {
            // Frozen: the same bytes, now as `version`.
            self.published.republish(version)?;
            return Ok(());
        };
        let master = masters(&mut self.master)?;
        let mut grad = training
            .grad
            .take()
            .unwrap_or_else(|| vec![0.0; master.len()]);
        if clip != 1.0 {
            for g in &mut grad {
                *g = (*g as f64 * clip) as f32;
            }
        }
        training.optimizer.step(optimizer, master, &grad)?;
        self.published
            .publish(version, codec::encode(self.pull_dtype, master))?;
        Ok(())
    }

    fn discard(&mut self, next_epoch: u64) -> Result<()> {
        if let Some(training) = &mut self.training {
            training.accumulator.take(next_epoch);
            training.grad = None;
        }
        Ok(())
    }

    fn snapshot(
        &mut self,
        context: &Context,
        optimizer: bool,
    ) -> Result<(RegionHandle, Option<OptimizerSnapshot>)> {
        let master = masters(&mut self.master)?;
        let region = if context.spec.pull_dtype == Dtype::F32 {
            self.published.handle()
        } else {
            publish_copy(&mut self.snapshot, master, context)?
        };
        if !optimizer {
            return Ok((region, None));
        }
        let Some(training) = &self.training else {
            return Ok((region, Some(OptimizerSnapshot::default())));
        };
        let names = training.optimizer.buffer_names();
        let buffers = training.optimizer.buffers();
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
            steps: training.optimizer.steps(),
            buffers: handles,
        };
        Ok((region, Some(snapshot)))
    }

    fn values(&self, _context: &Context) -> Result<StoreValues> {
        let params = self.master.clone().ok_or_else(no_masters)?;
        let (steps, buffers) = match &self.training {
            None => (0, Vec::new()),
            Some(t) => (
                t.optimizer.steps(),
                t.optimizer
                    .buffer_names()
                    .iter()
                    .zip(t.optimizer.buffers())
                    .map(|(name, values)| (name.to_string(), values.to_vec()))
                    .collect(),
            ),
        };
        Ok(StoreValues {
            params,
            steps,
            buffers,
        })
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
