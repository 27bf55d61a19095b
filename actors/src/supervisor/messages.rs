//! The supervisor's messages: the job's spec, the servers' outcomes it collects, and
//! [`SupervisorMsg`].
//!
//! Follows the control plane's rules ([`crate::messages`]): plain serializable data, no tensor
//! bytes, RPC replies last.

use odc_transport::{Dtype, EndpointId};
use ractor::RpcReplyPort;
use serde::{Deserialize, Serialize};

use crate::batch::SampleMeta;
use crate::error::Result;
use crate::policy::relay::{Combined, RelayPlan};
use crate::policy::stats::StepStats;
use crate::policy::step::StepConfig;
use crate::server::messages::{
    PublishShardsCmd, ShardSnapshot, SnapshotCmd, WriteShardsCmd, WrittenShards,
};
use crate::server::optimizer::OptimizerConfig;
use crate::trainer::messages::TrainerReport;
use crate::trainer::ContextConfig;

/// What a job is: the supervisor's serializable configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SupervisorSpec {
    pub trainers: u32,
    pub servers: u32,
    pub optimizer: OptimizerConfig,
    pub pull_dtype: Dtype,
    pub context: ContextConfig,
    pub step: StepConfig,
    /// Relayed pushes: where every trainer and server sits, by node (`None`: every trainer
    /// pushes straight to the owners).
    pub relay: Option<RelayPlan>,
}

/// Outcome of a barrier or discard call to every server (sent by the supervisor's own task).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ServerOutcome {
    /// What every server's relays combined.
    Flushed(Result<Vec<Combined>>),
    /// Sum over servers of their sums of squares.
    Reduced(Result<f64>),
    Applied(Result<()>),
    Discarded(Result<()>),
}

/// Messages of the supervisor.
pub enum SupervisorMsg {
    /// Train one minibatch; replies after the optimizer step.
    Step(Vec<SampleMeta>, RpcReplyPort<Result<StepStats>>),
    /// A trainer finished a micro-batch.
    Done(TrainerReport),
    /// Where to read the fp32 master parameters (and, when asked, the optimizer state) of every
    /// shard over the data plane.
    Parameters(SnapshotCmd, RpcReplyPort<Result<Vec<ShardSnapshot>>>),
    /// Where the published copies are and their version, for a reader outside the trainers
    /// (RL's sampler); `Error::Step(StepError::Busy)` while a step runs (its version is
    /// about to change).
    Published(RpcReplyPort<Result<crate::datapath::Published>>),
    /// Every server copies its shards and starts writing them into the command's directory (a
    /// sharded checkpoint); replies once every copy is taken.
    WriteShards(WriteShardsCmd, RpcReplyPort<Result<()>>),
    /// Every server's file of the last write, in server order, once all are on disk.
    ShardsWritten(RpcReplyPort<Result<Vec<WrittenShards>>>),
    /// Each named server publishes its host's part of a checkpoint (per-host directories).
    PublishShards(
        Vec<(EndpointId, PublishShardsCmd)>,
        RpcReplyPort<Result<()>>,
    ),
    /// Periodic: time passed (deadlines).
    Tick,
    /// The outcome of server calls the supervisor started.
    Servers(ServerOutcome),
}
