//! Events: time passes (deadlines) and a shard server is lost.

use crate::clock::Timestamp;

use super::decision::{decision, Command, Decision, Reason};
use super::error::{Failure, StepError};
use super::machine::StepMachine;
use super::run::{millis, Phase, Presence};

impl<E: Failure> StepMachine<E> {
    /// Time passed: enforce the micro-batch deadline (I6). A micro-batch of the running attempt
    /// past `micro_batch_timeout` fails the step (`Discard`, then `Finish(Err(Deadline))`); every
    /// trainer past it (also one still running a discarded attempt) is killed and respawned per
    /// policy, so the next step has it back.
    pub fn on_tick(&mut self, now: Timestamp) -> Vec<Decision<E>> {
        let mut out = Vec::new();
        if self.stopped.is_some() {
            return out;
        }
        let timeout = self.config.micro_batch_timeout;
        for slot in 0..self.slots.len() {
            let s = &self.slots[slot];
            let Some(busy) = s.busy.filter(|_| s.presence == Presence::Live) else {
                continue;
            };
            let ran = now.saturating_duration_since(busy.since);
            if ran <= timeout {
                continue;
            }
            let reason = Reason::MicroBatchDeadline {
                slot: slot as u32,
                micro_batch: busy.micro_batch as u32,
                after: ran,
            };
            let current = busy.epoch == self.epoch
                && self
                    .run
                    .as_ref()
                    .is_some_and(|r| matches!(r.phase, Phase::Computing));
            if current {
                let error = StepError::Deadline {
                    what: "micro-batch".into(),
                    step: self.global_step(),
                    trainer: Some(slot as u32),
                    micro_batch: Some(busy.micro_batch as u32),
                    after_ms: millis(ran),
                };
                out.extend(self.fail(error.into(), reason.clone()));
            }
            out.push(decision(
                Command::Kill { slot: slot as u32 },
                reason.clone(),
            ));
            out.extend(self.lost(slot, reason));
        }
        out
    }

    /// A shard server is gone: its shard is lost; the step fails and the supervisor stops.
    pub fn on_server_lost(
        &mut self,
        endpoint: u32,
        reason: String,
        now: Timestamp,
    ) -> Vec<Decision<E>> {
        let _ = now;
        if self.stopped.is_some() {
            return Vec::new();
        }
        let error: E = StepError::Actor {
            actor: format!("shard server {endpoint}"),
            reason: reason.clone(),
        }
        .into();
        let why = Reason::ServerLost { endpoint, reason };
        let mut out = Vec::new();
        if self.run.is_some() {
            out.push(self.finish(Err(error.clone()), why.clone()));
        }
        self.stopped = Some(error.clone());
        out.push(decision(Command::Stop(error), why));
        out
    }
}
