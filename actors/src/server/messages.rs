//! The shard server's messages: its spec, the barrier's commands and replies (flush, reduce,
//! apply, discard), relays, snapshots and checkpoint writes, and [`ServerMsg`].
//!
//! Follows the control plane's rules ([`crate::messages`]): plain serializable data, no tensor
//! bytes, RPC replies last.

use std::ops::Range;

use odc_transport::{Dtype, EndpointId, RegionHandle};
use ractor::RpcReplyPort;
use serde::{Deserialize, Serialize};

use crate::directory::ShardRoute;
use crate::error::Result;
use crate::layout::UnitId;
use crate::policy::relay::Combined;
use crate::policy::token::JobKey;
use crate::server::optimizer::OptimizerConfig;

pub use odc_checkpoint::shard_file::WrittenShards;
pub use odc_checkpoint::step_dir::PublishShardsCmd;

/// What a shard server is.
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
    /// The job's token key: the server admits a gradient write only with the token of the
    /// (epoch, micro-batch) it names ([`crate::policy::token`]). Sent to servers only, never to
    /// trainers.
    pub key: JobKey,
}

/// Barrier phase 1: take every accumulator (moving to `next_epoch`), scale it by `scale` and keep
/// it for [`ApplyCmd`]; the reply is the sum of squares of the scaled gradient.
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

/// Barrier phase 2: multiply the kept gradient by `clip`, run the optimizer at `lr_scale` times its
/// base learning rate, publish `version`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ApplyCmd {
    pub clip: f64,
    pub lr_scale: f64,
    pub version: u64,
}

/// Setup of relayed pushes ([`crate::policy::relay`]): the owners' routes of the shards this
/// server relays for its node (trainable ones), and the chunk size of its flushes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpenRelaysCmd {
    pub targets: Vec<ShardRoute>,
    pub chunk_elems: u64,
}

/// One relay: a node-local fp32 accumulator that takes its node's pushes for one owner's shard
/// of one unit (the same elements), and flushes them to the owner at the barrier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RelayRoute {
    /// The relaying server.
    pub relay: EndpointId,
    pub unit: UnitId,
    /// The shard's owner.
    pub owner: EndpointId,
    /// Where the node's trainers push that shard instead of the owner's accumulator.
    pub accumulator: RegionHandle,
}

/// Barrier phase 0 with relayed pushes: take every relay (moving it to `next_epoch`) and add it
/// into its owner's accumulator under `epoch`, within `timeout_ms`; sent to every server, and
/// `Reduce` only once all have acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlushCmd {
    pub epoch: u64,
    pub next_epoch: u64,
    pub timeout_ms: u64,
}

/// Relayed pushes with a static plan, as an attempt starts: the micro-batches this server's
/// node runs in `epoch`. A relay that has every write of them flushes at once, while the step
/// runs (moving to `epoch + 1`, as the barrier's flush would), each write within `timeout_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpectRelaysCmd {
    pub epoch: u64,
    pub micro_batches: u32,
    pub timeout_ms: u64,
}

/// The reply to [`FlushCmd`], once every relay of the server reached its owner (at the barrier
/// or earlier): what each combined, which the supervisor checks against its ledger before any
/// owner reduces. (The bytes sent are the server's metric, `odc_relay_flushed_bytes_total`.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlushAck {
    pub combined: Vec<Combined>,
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
    /// The shard's optimizer state, when asked for ([`SnapshotCmd::optimizer`]).
    pub optimizer: Option<OptimizerSnapshot>,
}

/// fp32 copies of one shard's optimizer buffers, readable over the data plane. The default (0
/// steps, no buffers) is a frozen unit's: it has no optimizer state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OptimizerSnapshot {
    /// Optimizer steps taken.
    pub steps: u64,
    /// Each buffer's name (torch's: `exp_avg`, `exp_avg_sq`, `momentum_buffer`) and region.
    pub buffers: Vec<(String, RegionHandle)>,
}

/// Write this server's shards into the directory `dir` (a sharded checkpoint's staging directory:
/// the lead's where this server's host shares its filesystem, else made on this host, see
/// [`step_dir`](crate::server::step_dir)) as `shard-<endpoint>.safetensors`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteShardsCmd {
    pub dir: String,
}

/// What a snapshot holds besides the master values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SnapshotCmd {
    /// Also the optimizer state (for a checkpoint).
    pub optimizer: bool,
}

impl ShardSnapshot {
    /// Elements of the unit this snapshot holds.
    pub fn range(&self) -> Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// Messages of a shard server.
pub enum ServerMsg {
    /// Routes of this server's non-empty shards, in unit order.
    Routes(RpcReplyPort<Vec<ShardRoute>>),
    /// Register a relay for each target and return their routes (once, at the job's start).
    OpenRelays(OpenRelaysCmd, RpcReplyPort<Result<Vec<RelayRoute>>>),
    /// Flush every relay into its owner (relayed pushes only, before `Reduce`).
    Flush(FlushCmd, RpcReplyPort<Result<FlushAck>>),
    ExpectRelays(ExpectRelaysCmd, RpcReplyPort<Result<()>>),
    Reduce(ReduceCmd, RpcReplyPort<Result<ReduceAck>>),
    Apply(ApplyCmd, RpcReplyPort<Result<()>>),
    Discard(DiscardCmd, RpcReplyPort<Result<()>>),
    /// Publish the fp32 master values of every shard (and, when asked, the optimizer state) for a
    /// read-out over the data plane.
    Snapshot(SnapshotCmd, RpcReplyPort<Result<Vec<ShardSnapshot>>>),
    /// Copy every shard (master values and optimizer state, at the server's version) and reply;
    /// then write the copy to one file in the command's directory, synced
    /// ([`shard_file`](crate::server::shard_file)), while the job goes on. Refused while the
    /// previous write runs.
    WriteShards(WriteShardsCmd, RpcReplyPort<Result<()>>),
    /// The file of the last write, once it is on disk (or why it is not).
    ShardsWritten(RpcReplyPort<Result<WrittenShards>>),
    /// Publish this host's part of a checkpoint.
    PublishShards(PublishShardsCmd, RpcReplyPort<Result<()>>),
}
