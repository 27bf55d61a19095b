//! Event: a trainer's report of a micro-batch ([`StepMachine::on_report`]), admitted only when
//! it answers an assignment of this machine.

use crate::assignment::TrainerReport;
use crate::clock::Timestamp;
use crate::error::NonFiniteAt;
use crate::stats::MicroBatchRecord;

use super::decision::{decision, Command, Decision, Reason, ReportRefusal};
use super::error::Failure;
use super::machine::StepMachine;
use super::run::Phase;

impl<E: Failure> StepMachine<E> {
    /// A trainer's report of a micro-batch, success or error. A report that is not admitted
    /// (module docs, "Reports are bound to assignments") is answered with one `Ignore` and
    /// changes nothing.
    pub fn on_report(&mut self, report: TrainerReport<E>, now: Timestamp) -> Vec<Decision<E>> {
        if let Err(why) = self.admit(&report) {
            let reason = Reason::ReportRefused {
                trainer: report.trainer,
                micro_batch: report.micro_batch,
                epoch: report.epoch,
                why,
            };
            return vec![decision(Command::Ignore, reason)];
        }
        // Admitted: the slot was running exactly this micro-batch; it is idle now.
        let slot = report.trainer as usize;
        if let Some(s) = self.slots.get_mut(slot) {
            s.busy = None;
        }
        let current = self.stopped.is_none()
            && report.epoch == self.epoch
            && self
                .run
                .as_ref()
                .is_some_and(|r| matches!(r.phase, Phase::Computing));
        if !current {
            // A report of a discarded attempt (its gradients were discarded or refused at the
            // owners), or of no step: ignored, the trainer is idle.
            return self.dispatch(now);
        }
        let step = self.global_step();
        let mb = report.micro_batch as usize;
        let (output, io) = match report.result {
            Ok(done) => (done.output, done.stats),
            Err(e) => {
                if let Some(at) = e.non_finite() {
                    // Named by the report (the trainer and micro-batch the ledger knows) and
                    // the global step.
                    let at = NonFiniteAt {
                        step,
                        trainer: Some(report.trainer),
                        micro_batch: Some(report.micro_batch),
                        ..at.clone()
                    };
                    let reason = Reason::NonFiniteMicroBatch {
                        slot: slot as u32,
                        micro_batch: report.micro_batch,
                        policy: self.config.non_finite,
                    };
                    return self.non_finite(at, reason, f64::NAN).into_iter().collect();
                }
                let reason = Reason::MicroBatchFailed {
                    slot: slot as u32,
                    micro_batch: mb as u32,
                };
                let error = e.in_micro_batch(step, report.micro_batch, report.trainer);
                return self.fail(error, reason).into_iter().collect();
            }
        };
        let Some(run) = self.run.as_mut() else {
            return Vec::new();
        };
        let a = &mut run.attempt;
        if let Err(refusal) = a.ledger.complete(mb, slot) {
            return self.refused(refusal);
        }
        let (tokens, cost, pieces) = a.micro_batches.get(mb).map_or((0, 0.0, Vec::new()), |m| {
            (m.tokens, m.cost, m.pieces.clone())
        });
        a.loss_sum += output.loss_sum;
        let busy = report.finished.saturating_duration_since(report.started);
        self.speeds.observe(slot, cost, busy.as_secs_f64());
        if let Some(t) = a.trainers.get_mut(slot) {
            t.busy += busy;
            t.pull_wait += io.pull_wait;
            t.micro_batches += 1;
            t.tokens += tokens;
            t.peak_gathered = t.peak_gathered.max(io.peak_gathered);
            t.bytes_pulled += io.bytes_pulled;
            t.bytes_pushed += io.bytes_pushed;
        }
        a.log.push(MicroBatchRecord {
            micro_batch: report.micro_batch,
            trainer: report.trainer,
            started: report.started,
            finished: report.finished,
            tokens,
            cost,
            spans: io.spans,
            pieces,
        });
        if !a.ledger.is_complete() {
            return self.dispatch(now);
        }
        let micro_batches = a.ledger.len() as u32;
        let epoch = a.epoch;
        // The barrier: I1, every micro-batch of step v is in; nobody has step-v work.
        let scale = if run.total_weight > 0.0 {
            1.0 / run.total_weight
        } else {
            0.0
        };
        self.epoch += 1;
        if self.relay.is_some() {
            run.phase = Phase::Flushing { scale };
            return vec![decision(
                Command::Flush {
                    epoch,
                    next_epoch: self.epoch,
                },
                Reason::LedgerComplete { micro_batches },
            )];
        }
        run.phase = Phase::Reducing;
        vec![decision(
            Command::Reduce {
                scale,
                next_epoch: self.epoch,
            },
            Reason::LedgerComplete { micro_batches },
        )]
    }

    /// Whether `report` answers an assignment of this machine: its token is the one of its
    /// (epoch, micro-batch) and its trainer is running that micro-batch of that epoch.
    pub(super) fn admit(&self, report: &TrainerReport<E>) -> Result<(), ReportRefusal> {
        let Some(s) = self.slots.get(report.trainer as usize) else {
            return Err(ReportRefusal::UnknownTrainer);
        };
        if !self
            .key
            .admits(report.epoch, report.micro_batch, report.token)
        {
            return Err(ReportRefusal::WrongToken);
        }
        let mb = report.micro_batch as usize;
        if s.busy
            .is_some_and(|b| b.epoch == report.epoch && b.micro_batch == mb)
        {
            return Ok(());
        }
        let counted = self.run.as_ref().is_some_and(|r| {
            r.attempt.epoch == report.epoch
                && r.attempt.ledger.done_by(mb) == Some(report.trainer as usize)
        });
        if counted {
            Err(ReportRefusal::Duplicate)
        } else {
            Err(ReportRefusal::NotRunning)
        }
    }
}
