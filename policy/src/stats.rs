//! Per-step statistics returned by the supervisor. Plain data: times are [`Timestamp`]s (comparable
//! across processes of a host), lengths [`Duration`]s.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::clock::Timestamp;
use crate::error::NonFiniteAt;

/// What a span of a trainer's timeline was spent on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SpanKind {
    /// The model's own work (recorded by the compute).
    Compute,
    /// Blocked in `gather` (a pull, or an all-gather with its barriers).
    PullWait,
    /// Waiting for gradient pushes (or reduce-scatters) after the compute returned.
    PushWait,
    /// From the trainer's last micro-batch to the end of the step's barrier.
    BarrierWait,
}

impl SpanKind {
    /// Name used in traces.
    pub fn name(self) -> &'static str {
        match self {
            SpanKind::Compute => "compute",
            SpanKind::PullWait => "pull wait",
            SpanKind::PushWait => "push wait",
            SpanKind::BarrierWait => "barrier wait",
        }
    }
}

/// One span of a trainer's timeline.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Span {
    pub kind: SpanKind,
    pub start: Timestamp,
    pub end: Timestamp,
}

/// One trainer's share of a step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerStepStats {
    /// Time in compute (sum over its micro-batches, pushes acknowledged included).
    pub busy: Duration,
    /// Step wall time minus busy time: waiting for work or for the barrier.
    pub idle: Duration,
    /// From its last micro-batch's end (or the step's start if it had none) to the barrier's end.
    pub barrier_wait: Duration,
    /// Time its compute was blocked in `gather`.
    pub pull_wait: Duration,
    pub micro_batches: u32,
    /// Tokens of its micro-batches.
    pub tokens: u64,
    /// Most gathered units held at once (I5).
    pub peak_gathered: u32,
    pub bytes_pulled: u64,
    pub bytes_pushed: u64,
}

/// When and where one micro-batch ran (for timelines and the I4 check).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MicroBatchRecord {
    pub micro_batch: u32,
    pub trainer: u32,
    pub started: Timestamp,
    pub finished: Timestamp,
    pub tokens: u64,
    pub cost: f64,
    /// The micro-batch's timeline on its trainer.
    pub spans: Vec<Span>,
    /// A gang member's piece of a split sample (sequence splitting).
    #[serde(default)]
    pub pieces: Vec<crate::batch::Piece>,
}

/// What one optimizer step did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    /// Version of the parameters the step trained on (the step index).
    pub step: u64,
    /// Loss averaged by the minibatch's total weight (tokens or samples).
    pub loss: f64,
    pub tokens: u64,
    pub samples: u64,
    pub micro_batches: u32,
    /// Global gradient norm before clipping (NaN or inf for a step skipped for non-finite
    /// gradients; NaN when a trainer found them before the barrier).
    pub grad_norm: f64,
    /// Times the minibatch was replayed after a trainer failure.
    pub replays: u32,
    /// When the step started (plan); it ended at `started + wall`.
    pub started: Timestamp,
    pub wall: Duration,
    /// Indexed by trainer slot.
    pub trainers: Vec<TrainerStepStats>,
    /// Micro-batches of the successful attempt (of a skipped step: those that completed).
    pub micro_batch_log: Vec<MicroBatchRecord>,
    /// `Some(at)`: the step was skipped (`NonFinite::SkipStep`): its gradients were discarded at
    /// every owner and no parameter, optimizer moment or optimizer step count changed; `at` is
    /// where the non-finite value was found, what the step would otherwise have failed with
    /// ([`StepError::NonFinite`](crate::step::StepError::NonFinite)). Boxed: the stats stay small.
    pub skipped: Option<Box<NonFiniteAt>>,
    /// Sequence splitting: the gang size of each sample the step split (in gang order; empty
    /// when nothing was split).
    #[serde(default)]
    pub gangs: Vec<u32>,
    /// Relayed pushes: the relays that flushed before the barrier, as soon as their node's
    /// writes were in (static plans; 0 without relays).
    #[serde(default)]
    pub early_relay_flushes: u32,
}

/// What one micro-batch's data path did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MicroBatchStats {
    /// Time the compute was blocked in `gather`.
    pub pull_wait: Duration,
    /// Time spent waiting for push acknowledgements after the compute returned.
    pub push_wait: Duration,
    pub bytes_pulled: u64,
    pub bytes_pushed: u64,
    /// Most gathered units held at once (gathered and not released, plus prefetches in flight).
    pub peak_gathered: u32,
    /// Units transferred (demand gathers and prefetches).
    pub pulls: u32,
    /// Timeline of the micro-batch: pull waits, push wait, and spans the compute recorded.
    pub spans: Vec<Span>,
}
