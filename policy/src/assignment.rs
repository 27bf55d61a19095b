//! The plain data the supervisor's decisions take in and hand out: an [`Assignment`] (one
//! micro-batch for one attempt, with its token) and the [`TrainerReport`] that answers it. The
//! actors carry them in their messages (`odc_actors::messages`, where a report's error is the
//! runtime's, `odc_actors::Error`); the policy owns them.

use serde::{Deserialize, Serialize};

use crate::batch::{ComputeOutput, MicroBatch};
use crate::clock::Timestamp;
use crate::stats::MicroBatchStats;

/// One micro-batch to run within the accumulator epoch `epoch`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    pub micro_batch: MicroBatch,
    pub epoch: u64,
    /// The step of the job this micro-batch trains (what `Job::steps_done` counted when the
    /// step began, the same on every rank): a micro-batch's `step` is the parameters' version,
    /// which stays behind it after a skipped step or a resume.
    #[serde(default)]
    pub step: u64,
    /// The assignment's token ([`crate::token`]): the trainer echoes it in its report
    /// and in every gradient write of the micro-batch; nothing without it counts.
    pub token: u128,
}

/// A micro-batch that completed: the compute's output and what its data path did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MicroBatchDone {
    pub output: ComputeOutput,
    pub stats: MicroBatchStats,
}

/// What a trainer tells the supervisor after a micro-batch; `E` is the runtime's error (what a
/// failed micro-batch reports, see [`step::Failure`](crate::step::Failure)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerReport<E> {
    pub trainer: u32,
    pub epoch: u64,
    pub micro_batch: u32,
    /// The token of the assignment this report answers ([`Assignment::token`]).
    pub token: u128,
    pub started: Timestamp,
    pub finished: Timestamp,
    pub result: Result<MicroBatchDone, E>,
}
