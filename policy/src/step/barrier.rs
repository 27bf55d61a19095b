//! Events of the barrier: the servers flushed, reduced, applied or discarded; and the relays'
//! expectations of a static plan.

use crate::clock::Timestamp;
use crate::dispatch::{Communication, DispatchMode};
use crate::error::NonFiniteAt;
use crate::relay::Combined;
use crate::stats::StepStats;

use super::decision::{decision, Command, Decision, Reason};
use super::error::Failure;
use super::machine::StepMachine;
use super::run::{AfterDiscard, Phase};

impl<E: Failure> StepMachine<E> {
    /// Every server flushed its relays (`Ok`: what each relay combined) or one failed. Counts
    /// that agree with the ledger lead to `Reduce`; a disagreement discards the attempt and
    /// replays it (module docs); a failed flush fails the step, as a failed reduce does.
    pub fn on_flushed(
        &mut self,
        result: Result<Vec<Combined>, E>,
        now: Timestamp,
    ) -> Vec<Decision<E>> {
        let _ = now;
        let Some(run) = self.run.as_mut() else {
            return Vec::new();
        };
        let Phase::Flushing { scale } = run.phase else {
            return Vec::new();
        };
        let combined = match result {
            Ok(combined) => combined,
            Err(e) => return vec![self.finish(Err(e), Reason::ServerCallFailed { call: "flush" })],
        };
        let ledger = &run.attempt.ledger;
        let every_micro_batch_pushes = self.config.communication == Communication::OnDemand;
        let checked = self.relay.as_ref().map_or(Ok(()), |plan| {
            plan.check_combined(
                ledger.len() as u32,
                |mb| ledger.done_by(mb as usize).map(|t| t as u32),
                &combined,
                every_micro_batch_pushes,
            )
        });
        match checked {
            Ok(()) => {
                run.phase = Phase::Reducing;
                run.attempt.early_relay_flushes =
                    combined.iter().filter(|c| c.early).count() as u32;
                vec![decision(
                    Command::Reduce {
                        scale,
                        next_epoch: self.epoch,
                    },
                    Reason::RelaysFlushed {
                        relays: combined.len() as u32,
                    },
                )]
            }
            Err(mismatch) => {
                let why = Reason::RelayMismatch { mismatch };
                self.discard(AfterDiscard::Replay, why)
                    .into_iter()
                    .collect()
            }
        }
    }

    /// Every server reduced (`Ok`: the sum over servers of their sums of squares) or one failed.
    pub fn on_reduced(&mut self, result: Result<f64, E>, now: Timestamp) -> Vec<Decision<E>> {
        let _ = now;
        let lr_scale = self.config.schedule.factor(self.global_step());
        let Some(run) = self.run.as_mut() else {
            return Vec::new();
        };
        if !matches!(run.phase, Phase::Reducing) {
            return Vec::new();
        }
        let sum_sq = match result {
            Ok(v) => v,
            Err(e) => return vec![self.finish(Err(e), Reason::ServerCallFailed { call: "reduce" })],
        };
        if !sum_sq.is_finite() {
            // Checked before anything compares it: `max(0.0)` would turn NaN into 0 (clip
            // factor 1), and an infinite norm gives a clip factor of 0 and NaN through inf × 0.
            let value = sum_sq.to_string();
            let at = NonFiniteAt {
                what: "global gradient norm".into(),
                step: self.global_step(),
                trainer: None,
                micro_batch: None,
                samples: Vec::new(),
                unit: None,
                element: None,
                value: value.clone(),
            };
            let reason = Reason::NonFiniteGradNorm {
                value,
                policy: self.config.non_finite,
            };
            return self
                .non_finite(at, reason, sum_sq.sqrt())
                .into_iter()
                .collect();
        }
        // Finite, and a sum of squares: never negative but for a misbehaving server.
        let grad_norm = sum_sq.max(0.0).sqrt();
        let clip = match self.config.clip_norm {
            Some(max) if grad_norm > max => max / (grad_norm + 1e-6),
            _ => 1.0,
        };
        let version = self.version + 1;
        run.phase = Phase::Applying { grad_norm, version };
        vec![decision(
            Command::Apply {
                clip,
                lr_scale,
                version,
            },
            Reason::GradientsReduced { grad_norm, clip },
        )]
    }

    /// Every server applied and published, or one failed.
    pub fn on_applied(&mut self, result: Result<(), E>, now: Timestamp) -> Vec<Decision<E>> {
        let Some(run) = self.run.as_ref() else {
            return Vec::new();
        };
        let Phase::Applying { grad_norm, version } = run.phase else {
            return Vec::new();
        };
        if let Err(e) = result {
            return vec![self.finish(Err(e), Reason::ServerCallFailed { call: "apply" })];
        }
        let step = self.global_step();
        self.version = version;
        let Some(run) = self.run.take() else {
            return Vec::new();
        };
        let stats = run.stats(step, grad_norm, now);
        vec![decision(
            Command::Finish(Ok(stats)),
            Reason::Applied { version },
        )]
    }

    /// Every server discarded the attempt, or one failed.
    pub fn on_discarded(&mut self, result: Result<(), E>, now: Timestamp) -> Vec<Decision<E>> {
        let Some(run) = self.run.as_mut() else {
            return Vec::new();
        };
        let Phase::Discarding(then) = std::mem::replace(&mut run.phase, Phase::Computing) else {
            return Vec::new();
        };
        match (result, then) {
            (Err(e), _) => vec![self.finish(Err(e), Reason::ServerCallFailed { call: "discard" })],
            (Ok(()), AfterDiscard::Fail { error, reason }) => vec![self.finish(Err(error), reason)],
            (Ok(()), AfterDiscard::Replay) => self.replay(now),
            (
                Ok(()),
                AfterDiscard::Skip {
                    why,
                    reason,
                    grad_norm,
                },
            ) => {
                let step = self.global_step();
                self.skipped += 1;
                let Some(run) = self.run.take() else {
                    return Vec::new();
                };
                let stats = StepStats {
                    skipped: Some(why),
                    ..run.stats(step, grad_norm, now)
                };
                vec![decision(Command::Finish(Ok(stats)), reason)]
            }
        }
    }

    /// With relays on demand, once each node's micro-batches of the running attempt are final
    /// (a static plan: at once, nothing is stolen; a dynamic one: when nothing is left to hand
    /// out or steal), tell the servers how many each node runs ([`Command::ExpectRelays`]),
    /// once per attempt: its relays may then flush as soon as their writes are in.
    pub(super) fn expect_relays(&mut self) -> Option<Decision<E>> {
        let plan = self.relay.as_ref()?;
        if self.config.communication != Communication::OnDemand {
            return None;
        }
        let run = self.run.as_mut()?;
        let a = &mut run.attempt;
        if a.relays_expected || !matches!(run.phase, Phase::Computing) {
            return None;
        }
        if self.config.dispatch == DispatchMode::Dynamic && a.queue.remaining() > 0 {
            return None;
        }
        a.relays_expected = true;
        let nodes = plan
            .trainer_nodes
            .iter()
            .copied()
            .max()
            .map_or(0, |n| n + 1);
        let mut per_node = vec![0u32; nodes as usize];
        let node_of = |slot: usize| plan.trainer_nodes.get(slot).map(|&n| n as usize);
        for slot in 0..plan.trainer_nodes.len() {
            if let Some(node) = node_of(slot) {
                per_node[node] += a.queue.own(slot).count() as u32;
            }
        }
        for mb in 0..a.ledger.len() {
            if let Some(node) = a.ledger.trainer_of(mb).and_then(node_of) {
                per_node[node] += 1;
            }
        }
        let epoch = a.epoch;
        Some(decision(
            Command::ExpectRelays { epoch, per_node },
            Reason::NodeCountsFinal { epoch },
        ))
    }
}
