//! Event: a minibatch arrives ([`StepMachine::start`]): refused, unplannable, or planned and
//! dispatched.

use crate::batch::SampleMeta;
use crate::clock::Timestamp;

use super::decision::{decision, Command, Decision, Reason};
use super::error::{Failure, StepError};
use super::machine::StepMachine;
use super::run::{Phase, Run};

impl<E: Failure> StepMachine<E> {
    /// A new minibatch. `Reject` if a step is running (it goes on) or the machine stopped;
    /// `Finish(Err)` if it cannot be planned; otherwise the first assignments.
    pub fn start(&mut self, samples: Vec<SampleMeta>, now: Timestamp) -> Vec<Decision<E>> {
        if let Some(e) = &self.stopped {
            return vec![decision(Command::Reject(e.clone()), Reason::NotAccepted)];
        }
        if self.run.is_some() {
            let e = StepError::Busy.into();
            return vec![decision(Command::Reject(e), Reason::NotAccepted)];
        }
        if samples.is_empty() {
            let e = StepError::EmptyMinibatch {
                step: self.global_step(),
            };
            return vec![decision(
                Command::Finish(Err(e.into())),
                Reason::Unplannable,
            )];
        }
        let attempt = match self.plan(&samples) {
            Ok(a) => a,
            Err(e) => {
                return vec![decision(
                    Command::Finish(Err(e.into())),
                    Reason::Unplannable,
                )]
            }
        };
        let total_weight = samples
            .iter()
            .map(|s| self.config.weighting.weight(s))
            .sum();
        self.run = Some(Run {
            samples,
            total_weight,
            attempt,
            phase: Phase::Computing,
            replays: 0,
            started: now,
        });
        self.dispatch(now)
    }
}
