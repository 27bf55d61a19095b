//! The trainer: runs user compute on one micro-batch at a time and reports to the supervisor.
//!
//! - A micro-batch is reported done only after every gradient push was acknowledged by its
//!   receivers (DESIGN step 4).
//! - A panic in user compute fails the actor; spawned linked, the failure reaches the supervisor as
//!   a supervision event (I2 replay).
//! - In on-demand mode trainers never talk to each other (**I4**): the only thing a trainer waits
//!   on is its own transfers.
//! - Messages are plain serializable data ([`Assignment`], [`TrainerReport`]); the actor starts from
//!   a serializable [`TrainerSpec`] plus its process's [`Node`](crate::node::Node).

mod actor;
pub mod buffers;
mod compute;
mod context;

use serde::{Deserialize, Serialize};

pub use actor::{Trainer, TrainerArgs};
pub use compute::{Compute, ComputeFactory, SharedComputeFactory};
pub use context::{ContextConfig, Direction, MicroBatchStats, PushTicket, TrainerContext};

use crate::batch::{ComputeOutput, MicroBatch};
use crate::directory::Directory;
use crate::error::Result;
use crate::policy::clock::Timestamp;
use crate::policy::dispatch::Communication;

/// What a trainer is: serializable, so a per-node spawner can start one from a message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerSpec {
    /// The trainer's slot (its rank in collective mode).
    pub rank: u32,
    pub communication: Communication,
    pub context: ContextConfig,
    /// Where every shard lives.
    pub directory: Directory,
}

/// One micro-batch to run within the accumulator epoch `epoch`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    pub micro_batch: MicroBatch,
    pub epoch: u64,
}

/// Messages of a trainer.
pub enum TrainerMsg {
    Run(Assignment),
}

/// A micro-batch that completed: the compute's output and what its data path did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MicroBatchDone {
    pub output: ComputeOutput,
    pub stats: MicroBatchStats,
}

/// What a trainer tells the supervisor after a micro-batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerReport {
    pub trainer: u32,
    pub epoch: u64,
    pub micro_batch: u32,
    pub started: Timestamp,
    pub finished: Timestamp,
    pub result: Result<MicroBatchDone>,
}
