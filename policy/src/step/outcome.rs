//! The moves every event shares: fail, fail or skip on a non-finite value, discard, refuse,
//! finish, replay.

use crate::clock::Timestamp;
use crate::error::NonFiniteAt;
use crate::ledger::LedgerError;
use crate::recovery::may_replay;
use crate::stats::StepStats;

use super::config::NonFinite;
use super::decision::{decision, Command, Decision, Reason};
use super::error::{Failure, StepError};
use super::machine::StepMachine;
use super::run::{AfterDiscard, Phase};

impl<E: Failure> StepMachine<E> {
    /// Fail the step: discard the attempt, then `Finish(Err(error))`.
    pub(super) fn fail(&mut self, error: E, reason: Reason) -> Option<Decision<E>> {
        let then = AfterDiscard::Fail {
            error,
            reason: reason.clone(),
        };
        self.discard(then, reason)
    }

    /// Non-finite gradients (`at` says where, `grad_norm` is the barrier's or NaN): discard
    /// the attempt, then fail or skip the step per [`StepConfig::non_finite`].
    pub(super) fn non_finite(
        &mut self,
        at: NonFiniteAt,
        reason: Reason,
        grad_norm: f64,
    ) -> Option<Decision<E>> {
        let at = Box::new(at);
        let then = match self.config.non_finite {
            NonFinite::Error => AfterDiscard::Fail {
                error: StepError::NonFinite(at).into(),
                reason: reason.clone(),
            },
            NonFinite::SkipStep => AfterDiscard::Skip {
                why: at,
                reason: reason.clone(),
                grad_norm,
            },
        };
        self.discard(then, reason)
    }

    /// Discard the attempt: new epoch, phase `Discarding(then)`. `None` without a run or while
    /// already discarding (the first outcome decides).
    pub(super) fn discard(&mut self, then: AfterDiscard<E>, reason: Reason) -> Option<Decision<E>> {
        let run = self.run.as_mut()?;
        if matches!(run.phase, Phase::Discarding(_)) {
            return None;
        }
        run.phase = Phase::Discarding(then);
        self.epoch += 1;
        Some(decision(
            Command::Discard {
                next_epoch: self.epoch,
            },
            reason,
        ))
    }

    /// The ledger refused: the machine's state is inconsistent (reports reach the ledger only once
    /// admitted, so no peer causes this). Fail the step (nothing is dropped).
    pub(super) fn refused(&mut self, refusal: LedgerError) -> Vec<Decision<E>> {
        let reason = Reason::LedgerRefused {
            refusal: refusal.clone(),
        };
        let error = StepError::Ledger {
            step: self.global_step(),
            source: refusal,
        };
        self.fail(error.into(), reason).into_iter().collect()
    }

    /// End the step with `result`.
    pub(super) fn finish(&mut self, result: Result<StepStats, E>, reason: Reason) -> Decision<E> {
        self.run = None;
        decision(Command::Finish(result), reason)
    }

    /// After a discard for a lost trainer: re-plan and hand everything out again.
    pub(super) fn replay(&mut self, now: Timestamp) -> Vec<Decision<E>> {
        let Some(mut run) = self.run.take() else {
            return Vec::new();
        };
        if !may_replay(run.replays, self.config.max_replays) {
            let replays = run.replays;
            let e = StepError::TooManyReplays {
                step: self.global_step(),
                replays,
            };
            return vec![self.finish(Err(e.into()), Reason::TooManyReplays { replays })];
        }
        run.replays += 1;
        run.attempt = match self.plan(&run.samples) {
            Ok(a) => a,
            Err(e) => return vec![self.finish(Err(e.into()), Reason::Unplannable)],
        };
        run.phase = Phase::Computing;
        self.run = Some(run);
        self.dispatch(now)
    }
}
