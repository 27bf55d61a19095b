//! The node host's messages: spawning servers and trainers on request of the supervisor, the
//! collective inboxes, a step's outcome, the all-gathers, and [`HostMsg`].
//!
//! Follows the control plane's rules ([`crate::messages`]): plain serializable data, no tensor
//! bytes, RPC replies last.

use odc_transport::RegionHandle;
use ractor::RpcReplyPort;
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::policy::stats::StepStats;
use crate::server::messages::ServerSpec;
use crate::trainer::messages::TrainerSpec;

/// Start a shard server on this node as `group` (its `ractor::pg` group, unique per spawn).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerSpawn {
    pub spec: ServerSpec,
    pub group: String,
    /// The coordinator's [`ModelLayout::digest`](crate::layout::ModelLayout::digest): every
    /// process must build the same model.
    pub layout: u64,
}

/// Start a trainer on this node as `group`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerSpawn {
    pub spec: TrainerSpec,
    pub group: String,
    pub layout: u64,
}

/// A trainer started: its collective inbox (collective mode), for every other node's group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerStarted {
    pub inbox: Option<RegionHandle>,
}

/// Where the collective inbox of trainer `rank` is now (it started or was respawned).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InboxUpdate {
    pub rank: u32,
    pub inbox: RegionHandle,
}

/// How a step ended, told by the coordinator to every other process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepOutcome {
    pub step: u64,
    pub result: Result<StepStats>,
}

/// One rank's part of an all-gather (`Job::all_gather`): bytes the application encoded (a small
/// object such as a rank's sampled responses, never tensors: those move over the data plane),
/// sent by rank `rank` to the coordinator for gather `round` (the job's count of earlier ones).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Contribution {
    pub round: u64,
    pub rank: u32,
    pub bytes: Vec<u8>,
}

/// The coordinator's answer to gather `round`: every rank's bytes in rank order, or why the
/// gather failed (a rank was lost, the parts exceed a control frame).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gathered {
    pub round: u64,
    pub parts: std::result::Result<Vec<Vec<u8>>, String>,
}

/// Messages of a node host: the per-process actor that starts servers and trainers on request
/// of the supervisor (which may be in another process) and relays the job's progress to the
/// process's [`Job`](crate::cluster).
pub enum HostMsg {
    SpawnServer(ServerSpawn, RpcReplyPort<Result<()>>),
    SpawnTrainer(TrainerSpawn, RpcReplyPort<Result<TrainerStarted>>),
    /// Register a trainer's collective inbox in this node's group.
    Inbox(InboxUpdate, RpcReplyPort<Result<()>>),
    /// Kill the actor of this `group` (a hung trainer).
    Kill(String),
    /// Abort every collective of an epoch below this one (a discarded attempt).
    Abort(u64),
    /// A step ended (coordinator to every other process).
    Step(StepOutcome),
    /// A step failed (coordinator to every other process, acknowledged: the coordinator is
    /// about to stop and must know the others heard why before it exits).
    StepFailed(StepOutcome, RpcReplyPort<()>),
    /// Rank `n` is done with the job and waits for [`HostMsg::Shutdown`] (to the coordinator).
    Leaving(u32),
    /// The job is over: stop this node's actors (`Some(reason)` when it failed).
    Shutdown(Option<String>),
    /// The coordinator's heartbeat (answered at once; a rank that stops answering is lost).
    Heartbeat(RpcReplyPort<()>),
    /// A rank's part of an all-gather (to the coordinator).
    Contribute(Contribution),
    /// Every rank's parts of an all-gather (coordinator to every other process).
    Gathered(Gathered),
}
