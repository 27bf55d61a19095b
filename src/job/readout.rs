//! Reading a job's state out over the data plane: its parameters and its whole train state
//! (every shard's fp32 masters and optimizer state, read as one batch of reads).

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use odc_actors::datapath::published;
use odc_actors::layout::{UnitId, UnitOptimizerInit};
use odc_actors::messages::{ShardSnapshot, SnapshotCmd};
use odc_actors::node::Node;
use odc_actors::policy::step::StepError;
use odc_actors::supervisor::SupervisorMsg;
use odc_actors::{Error, Result};
use odc_transport::{Dest, ReadOp};

use crate::checkpoint::TrainState;

use super::*;

impl Job {
    /// fp32 master parameters of every unit of the model (served units left out:
    /// [`Job::model_units`]), in layout order, read over the data plane: the
    /// servers publish fp32 snapshots of their shards and the job reads them with one batch of
    /// reads (no tensor bytes in control messages); any rank of a multi-process job may ask.
    /// Waits at most the parameters timeout ([`JobBuilder::parameters_timeout`]); past it
    /// `Error::Step(StepError::Deadline)`.
    pub async fn parameters(&mut self) -> Result<Vec<Vec<f32>>> {
        let (node, snapshots, deadline) = self.snapshots(SnapshotCmd::default()).await?;
        let timeout = self.parameters_timeout;
        read_snapshots(node.as_ref(), &snapshots, deadline, self.step, timeout).await
    }

    /// Units `units`' published copies at the current version, decoded to `f32`, in layout
    /// order: the values the trainers compute with (under bf16 pulls the masters rounded to
    /// bf16), read as a trainer's gather reads them — every shard at once, one-sided, each chunk
    /// checked against the version (I1). RL's sampler decodes with these: the policy's units, and
    /// the reference's where the job serves it
    /// ([`UnitSpec::served`](odc_actors::layout::UnitSpec::served)). Any rank may ask, between
    /// steps (`Error::Step(StepError::Busy)` during one); waits at most the parameters timeout.
    pub async fn published_units(&mut self, units: Range<UnitId>) -> Result<Vec<Vec<f32>>> {
        let (node, published, deadline) = self.published().await?;
        let transport = node.transport.as_ref();
        let (values, _) = published::read_host(&published, transport, units, deadline)
            .await
            .map_err(|e| self.past_deadline(e, "published parameters"))?;
        Ok(values)
    }

    /// [`Job::published_units`] into device memory from `memory`, in the published dtype (bf16
    /// stays bf16): one device-to-device read per shard, through no host memory. Needs the `cuda`
    /// transport (a one-process job whose servers are on the GPU, or `odc launch --transport
    /// cuda`; [`Job::reads_device_memory`]); any other fails saying so.
    #[cfg(feature = "cuda-data")]
    pub async fn published_units_into(
        &mut self,
        units: Range<UnitId>,
        memory: &dyn odc_actors::trainer::DeviceMemory,
    ) -> Result<Vec<odc_actors::trainer::UnitValues>> {
        let (node, published, deadline) = self.published().await?;
        let transport = node.transport.as_ref();
        let (values, _) = published::read_device(&published, transport, units, memory, deadline)
            .await
            .map_err(|e| self.past_deadline(e, "published parameters"))?;
        Ok(values)
    }

    /// The units of the model the job trains: every unit before the served ones, whose values
    /// [`Job::parameters`] returns and checkpoints hold.
    pub fn model_units(&self) -> usize {
        match (&self.setup, &self.node) {
            (Some(setup), _) => setup.layout.model_units(),
            (None, Some(node)) => node.layout.model_units(),
            (None, None) => 0,
        }
    }

    /// Whether this process's transport reads the published copies straight into device memory
    /// ([`Job::published_units_into`]): the `cuda` backend.
    #[cfg(feature = "cuda-data")]
    pub async fn reads_device_memory(&mut self) -> Result<bool> {
        self.start().await?;
        Ok(self.node.as_ref().is_some_and(|node| {
            node.transport
                .as_any()
                .is_some_and(|t| t.is::<odc_transport::cuda::CudaTransport>())
        }))
    }

    /// Where the published copies are, from the supervisor, with this process's node and the
    /// read's deadline.
    async fn published(
        &mut self,
    ) -> Result<(
        Arc<Node>,
        odc_actors::datapath::Published,
        odc_transport::Deadline,
    )> {
        let supervisor = self.supervisor().await?;
        let timeout = self.parameters_timeout;
        let deadline = odc_transport::deadline_in(timeout);
        let reply = supervisor
            .call(SupervisorMsg::Published, Some(timeout))
            .await;
        let published = unwrap_call(reply, "published parameters", self.step, timeout)??;
        let node = self
            .node
            .clone()
            .ok_or_else(|| Error::Internal("a started job without a node".into()))?;
        Ok((node, published, deadline))
    }

    /// `e`, or `Error::Step(StepError::Deadline)` naming `what` when it is the transport's
    /// deadline.
    fn past_deadline(&self, e: Error, what: &str) -> Error {
        match e {
            Error::Pull {
                source: odc_transport::TransportError::DeadlineExceeded { .. },
                ..
            } => Error::Step(StepError::Deadline {
                what: what.into(),
                step: self.step,
                trainer: None,
                micro_batch: None,
                after_ms: u64::try_from(self.parameters_timeout.as_millis()).unwrap_or(u64::MAX),
            }),
            e => e,
        }
    }

    /// Everything a checkpoint holds, read like [`Job::parameters`]: the global step, the fp32
    /// master values and the optimizer state of every unit of the model (a frozen unit's: 0
    /// steps, no buffers; served units left out). A job built with [`JobBuilder::resume`] from it
    /// continues exactly where this one is.
    pub async fn train_state(&mut self) -> Result<TrainState> {
        let (node, snapshots, deadline) = self.snapshots(SnapshotCmd { optimizer: true }).await?;
        let timeout = self.parameters_timeout;
        let params =
            read_snapshots(node.as_ref(), &snapshots, deadline, self.step, timeout).await?;
        let optimizer =
            read_optimizer_snapshots(node.as_ref(), &snapshots, deadline, self.step, timeout)
                .await?;
        Ok(TrainState {
            step: self.step,
            params,
            optimizer,
        })
    }

    /// Ask the supervisor for every shard's snapshot handles.
    async fn snapshots(
        &mut self,
        cmd: SnapshotCmd,
    ) -> Result<(Arc<Node>, Vec<ShardSnapshot>, odc_transport::Deadline)> {
        let supervisor = self.supervisor().await?;
        let timeout = self.parameters_timeout;
        let deadline = odc_transport::deadline_in(timeout);
        let reply = supervisor
            .call(|reply| SupervisorMsg::Parameters(cmd, reply), Some(timeout))
            .await;
        let snapshots = unwrap_call(reply, "parameters", self.step, timeout)??;
        let node = self
            .node
            .clone()
            .ok_or_else(|| Error::Internal("a started job without a node".into()))?;
        Ok((node, snapshots, deadline))
    }
}

/// One piece of a unit to read: the unit, the elements of it the region holds, and the region.
struct Tile<'a> {
    unit: UnitId,
    range: std::ops::Range<usize>,
    region: &'a odc_transport::RegionHandle,
}

/// Reads `pieces`, which must tile every unit of `lens` they touch, in one batch of reads over the
/// data plane; units no piece touches stay empty. `what` names the values in errors.
async fn read_tiled(
    node: &Node,
    lens: &[usize],
    mut pieces: Vec<Tile<'_>>,
    what: &str,
    deadline: odc_transport::Deadline,
    step: u64,
    timeout: Duration,
) -> Result<Vec<Vec<f32>>> {
    let touched: std::collections::HashSet<UnitId> = pieces.iter().map(|p| p.unit).collect();
    let mut units: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(u, &len)| {
            if touched.contains(&(u as UnitId)) {
                vec![0.0; len]
            } else {
                Vec::new()
            }
        })
        .collect();
    // Disjoint destinations: each piece's range of its unit, found by splitting the unit in range
    // order.
    pieces.sort_by_key(|p| (p.unit, p.range.start));
    let mut ops = Vec::with_capacity(pieces.len());
    let mut rest: Vec<&mut [f32]> = units.iter_mut().map(Vec::as_mut_slice).collect();
    let mut at: Vec<usize> = vec![0; rest.len()];
    for piece in &pieces {
        let unit = piece.unit as usize;
        let range = piece.range.clone();
        let Some(slice) = rest.get_mut(unit) else {
            return Err(Error::UnknownUnit {
                unit: piece.unit,
                units: lens.len() as u64,
            });
        };
        if range.start != at[unit] || range.end > range.start + slice.len() {
            return Err(Error::Internal(format!(
                "{what} snapshots of unit {unit} do not tile it (shard {range:?} after {})",
                at[unit]
            )));
        }
        let (head, tail) = std::mem::take(slice).split_at_mut(range.len());
        *slice = tail;
        at[unit] = range.end;
        ops.push(ReadOp {
            handle: piece.region,
            range: 0..range.len(),
            into: Dest::F32(head),
        });
    }
    let results = node.transport.read_batch(ops, deadline).await;
    for (piece, result) in pieces.iter().zip(results) {
        match result {
            Ok(_) => {}
            Err(odc_transport::TransportError::DeadlineExceeded { .. }) => {
                return Err(Error::Step(StepError::Deadline {
                    what: what.into(),
                    step,
                    trainer: None,
                    micro_batch: None,
                    after_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                }))
            }
            Err(source) => {
                return Err(Error::Pull {
                    unit: piece.unit,
                    owner: piece.region.owner,
                    source,
                })
            }
        }
    }
    drop(rest);
    // Pieces tile each unit from 0 without gaps (checked above), so `at` is what they cover.
    for (unit, (values, covered)) in units.iter().zip(&at).enumerate() {
        if *covered != values.len() {
            return Err(Error::Internal(format!(
                "{what} snapshots cover {covered} of the {} elements of unit {unit}",
                values.len()
            )));
        }
    }
    Ok(units)
}

/// The lengths of the model's units (served units are not the job's parameters).
fn model_lens(node: &Node) -> Vec<usize> {
    let units = &node.layout.units()[..node.layout.model_units()];
    units.iter().map(|u| u.len).collect()
}

/// The master values of every unit from the servers' snapshots.
async fn read_snapshots(
    node: &Node,
    snapshots: &[ShardSnapshot],
    deadline: odc_transport::Deadline,
    step: u64,
    timeout: Duration,
) -> Result<Vec<Vec<f32>>> {
    let lens = model_lens(node);
    let pieces = snapshots
        .iter()
        .map(|s| Tile {
            unit: s.unit,
            range: s.range(),
            region: &s.region,
        })
        .collect();
    let units = read_tiled(node, &lens, pieces, "parameters", deadline, step, timeout).await?;
    if let Some(unit) = units.iter().position(Vec::is_empty) {
        return Err(Error::Internal(format!(
            "no parameter snapshot of unit {unit}"
        )));
    }
    Ok(units)
}

/// The optimizer state of every unit from the servers' snapshots: per unit its step count and
/// buffers, which every shard of the unit must agree on.
async fn read_optimizer_snapshots(
    node: &Node,
    snapshots: &[ShardSnapshot],
    deadline: odc_transport::Deadline,
    step: u64,
    timeout: Duration,
) -> Result<Vec<UnitOptimizerInit>> {
    let lens = model_lens(node);
    // Per unit: steps and buffer names, equal across its shards.
    let mut meta: Vec<Option<(u64, Vec<String>)>> = vec![None; lens.len()];
    for s in snapshots {
        let opt = s.optimizer.as_ref().ok_or_else(|| {
            Error::Internal(format!(
                "unit {}: a snapshot without optimizer state",
                s.unit
            ))
        })?;
        let names: Vec<String> = opt.buffers.iter().map(|(n, _)| n.clone()).collect();
        let slot = meta.get_mut(s.unit as usize).ok_or(Error::UnknownUnit {
            unit: s.unit,
            units: lens.len() as u64,
        })?;
        match slot {
            None => *slot = Some((opt.steps, names)),
            Some((steps, seen)) if *steps == opt.steps && *seen == names => {}
            Some((steps, seen)) => {
                return Err(Error::Internal(format!(
                    "unit {}: its shards disagree on the optimizer state ({steps} steps, \
                     {seen:?} vs {} steps, {names:?})",
                    s.unit, opt.steps
                )))
            }
        }
    }
    let mut out: Vec<UnitOptimizerInit> = Vec::with_capacity(lens.len());
    for (unit, m) in meta.iter().enumerate() {
        let (steps, _) = m
            .as_ref()
            .ok_or_else(|| Error::Internal(format!("no optimizer snapshot of unit {unit}")))?;
        out.push(UnitOptimizerInit {
            steps: *steps,
            buffers: Vec::new(),
        });
    }
    let mut names: Vec<&String> = meta.iter().flatten().flat_map(|(_, n)| n).collect();
    names.sort();
    names.dedup();
    for name in names {
        let pieces = snapshots
            .iter()
            .filter_map(|s| {
                let (_, region) = s
                    .optimizer
                    .as_ref()?
                    .buffers
                    .iter()
                    .find(|(n, _)| n == name)?;
                Some(Tile {
                    unit: s.unit,
                    range: s.range(),
                    region,
                })
            })
            .collect();
        let what = format!("optimizer `{name}`");
        let values = read_tiled(node, &lens, pieces, &what, deadline, step, timeout).await?;
        for (unit, values) in values.into_iter().enumerate() {
            if !values.is_empty() {
                out[unit].buffers.push((name.clone(), values.into()));
            }
        }
    }
    Ok(out)
}
