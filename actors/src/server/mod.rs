//! The shard server: owns, per unit, one shard of fp32 master weights, its optimizer state, an fp32
//! gradient accumulator region and a published copy (bf16 or fp32) region that trainers read.
//!
//! Invariants:
//! - **I1 consistency**: the published copy changes only in [`ServerMsg::Apply`], which the
//!   supervisor sends after the barrier, and each publication is atomic for readers (transport C1).
//! - **I2 exactly once**: [`ServerMsg::Reduce`] and [`ServerMsg::Discard`] take the accumulator and
//!   move it to the next epoch atomically (transport C3): writes of a discarded attempt, late or
//!   duplicated, are refused and never reach a step.
//! - **I6 liveness**: the reduce, optimizer and discard loops run on blocking threads, never on a
//!   tokio worker, so a large shard cannot stall the runtime's other tasks (transfers, timers).
//!
//! The actor is not on the data path: reads and accumulates go through the transport, and so does
//! the parameter read-out ([`ServerMsg::Snapshot`] hands out fp32 regions to read). Every message
//! payload is plain serializable data, fixed-width integers only (ready for ractor_cluster); the
//! actor starts from a serializable [`ServerSpec`] plus its process's [`Node`](crate::node::Node).

mod actor;
pub mod optimizer;

use std::ops::Range;

use odc_transport::{Dtype, EndpointId, RegionHandle};
use ractor::RpcReplyPort;
use serde::{Deserialize, Serialize};

pub use actor::{ServerArgs, ShardServer};

use crate::directory::ShardRoute;
use crate::error::Result;
use crate::layout::UnitId;
use optimizer::OptimizerConfig;

/// What a shard server is: serializable, so a per-node spawner can start one from a message.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ServerSpec {
    /// This server's endpoint, `0..servers`; it holds shard `endpoint` of every unit.
    pub endpoint: EndpointId,
    pub servers: u32,
    pub optimizer: OptimizerConfig,
    /// Dtype of the published copy trainers pull.
    pub pull_dtype: Dtype,
    /// Epoch the accumulators start at.
    pub epoch: u64,
}

/// Barrier phase 1: take every accumulator (moving to `next_epoch`), scale it by `scale` and keep it
/// for [`ApplyCmd`]; the reply is the sum of squares of the scaled gradient.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReduceCmd {
    pub scale: f64,
    pub next_epoch: u64,
}

/// The reply to [`ReduceCmd`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReduceAck {
    pub sum_sq: f64,
}

/// Barrier phase 2: multiply the kept gradient by `clip`, run the optimizer, publish `version`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ApplyCmd {
    pub clip: f64,
    pub version: u64,
}

/// Drop everything accumulated in this attempt and move to `next_epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DiscardCmd {
    pub next_epoch: u64,
}

/// An fp32 copy of one shard's master values at `version`, readable over the data plane.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardSnapshot {
    pub unit: UnitId,
    /// First element of the shard within its unit.
    pub start: u64,
    pub end: u64,
    pub version: u64,
    pub region: RegionHandle,
}

impl ShardSnapshot {
    /// Elements of the unit this snapshot holds.
    pub fn range(&self) -> Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// Messages of a shard server: control only, no tensor bytes, none growing with the model beyond
/// one route per unit.
pub enum ServerMsg {
    /// Routes of this server's non-empty shards, in unit order.
    Routes(RpcReplyPort<Vec<ShardRoute>>),
    Reduce(ReduceCmd, RpcReplyPort<Result<ReduceAck>>),
    Apply(ApplyCmd, RpcReplyPort<Result<()>>),
    Discard(DiscardCmd, RpcReplyPort<Result<()>>),
    /// Publish the fp32 master values of every shard for a read-out over the data plane.
    Snapshot(RpcReplyPort<Result<Vec<ShardSnapshot>>>),
}
