//! The bookkeeping of one step: the trainer slots, the current attempt (plan, queue, ledger) and
//! what the run has measured so far.

use std::time::Duration;

use crate::batch::{MicroBatch, SampleMeta};
use crate::clock::Timestamp;
use crate::dispatch::WorkQueue;
use crate::error::NonFiniteAt;
use crate::ledger::Ledger;
use crate::stats::{MicroBatchRecord, StepStats, TrainerStepStats};

use super::decision::Reason;

/// Where a trainer slot stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Presence {
    Live,
    /// A respawn was commanded and has not started yet.
    Respawning,
    /// Lost for good.
    Gone,
}

/// The micro-batch a trainer is running.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Busy {
    pub(super) epoch: u64,
    pub(super) micro_batch: usize,
    pub(super) since: Timestamp,
    pub(super) cost: f64,
}

#[derive(Debug, Clone)]
pub(super) struct Slot {
    pub(super) presence: Presence,
    pub(super) busy: Option<Busy>,
    pub(super) respawns: u32,
}

/// What follows a discard.
#[derive(Debug, Clone)]
pub(super) enum AfterDiscard<E> {
    /// Re-plan and run the minibatch again.
    Replay,
    /// Fail the step.
    Fail { error: E, reason: Reason },
    /// Skip the step (non-finite gradients, [`NonFinite::SkipStep`]): `why` goes into the stats.
    Skip {
        why: Box<NonFiniteAt>,
        reason: Reason,
        grad_norm: f64,
    },
}

#[derive(Debug, Clone)]
pub(super) enum Phase<E> {
    Computing,
    Discarding(AfterDiscard<E>),
    /// The relays are flushing; `Reduce` with `scale` follows.
    Flushing {
        scale: f64,
    },
    Reducing,
    Applying {
        grad_norm: f64,
        version: u64,
    },
}

/// One planned attempt at a minibatch.
#[derive(Debug, Clone)]
pub(super) struct Attempt {
    /// The accumulator epoch its micro-batches are handed out in.
    pub(super) epoch: u64,
    pub(super) micro_batches: Vec<MicroBatch>,
    pub(super) queue: WorkQueue,
    pub(super) ledger: Ledger,
    pub(super) loss_sum: f64,
    /// Indexed by slot.
    pub(super) trainers: Vec<TrainerStepStats>,
    pub(super) log: Vec<MicroBatchRecord>,
    /// Relays that flushed early, as the barrier's `Flush` reported them.
    pub(super) early_relay_flushes: u32,
    /// `ExpectRelays` went out for this attempt.
    pub(super) relays_expected: bool,
}

/// One minibatch in flight.
#[derive(Debug, Clone)]
pub(super) struct Run<E> {
    pub(super) samples: Vec<SampleMeta>,
    pub(super) total_weight: f64,
    pub(super) attempt: Attempt,
    pub(super) phase: Phase<E>,
    pub(super) replays: u32,
    pub(super) started: Timestamp,
}

impl<E> Run<E> {
    /// What the finished step did: `step` trained, ended at `ended`.
    pub(super) fn stats(self, step: u64, grad_norm: f64, ended: Timestamp) -> StepStats {
        let Run {
            samples,
            total_weight,
            attempt,
            replays,
            started,
            ..
        } = self;
        let wall = ended.saturating_duration_since(started);
        let mut trainers = attempt.trainers;
        for (i, t) in trainers.iter_mut().enumerate() {
            t.idle = wall.saturating_sub(t.busy);
            let last = attempt
                .log
                .iter()
                .filter(|r| r.trainer == i as u32)
                .map(|r| r.finished)
                .max()
                .unwrap_or(started);
            t.barrier_wait = ended.saturating_duration_since(last);
        }
        let loss = if total_weight > 0.0 {
            attempt.loss_sum / total_weight
        } else {
            0.0
        };
        let gangs = attempt
            .micro_batches
            .iter()
            .flat_map(|mb| &mb.pieces)
            .filter(|p| p.member == 0)
            .map(|p| p.members)
            .collect();
        StepStats {
            step,
            loss,
            tokens: samples.iter().map(|s| s.tokens).sum(),
            samples: samples.len() as u64,
            micro_batches: attempt.micro_batches.len() as u32,
            grad_norm,
            replays,
            started,
            wall,
            trainers,
            micro_batch_log: attempt.log,
            skipped: None,
            gangs,
            early_relay_flushes: attempt.early_relay_flushes,
        }
    }
}

/// `d` in whole milliseconds (saturating).
pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
