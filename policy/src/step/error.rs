//! What the step machine decides fails a step ([`StepError`]), and what it needs of the runtime's
//! error to carry it through ([`Failure`]).
//!
//! The machine is generic over the runtime's error `E` (`odc_actors::Error` in the runtime): a
//! trainer's report and a server call's outcome come in as `Result<_, E>` and go out unchanged
//! (typed: a transport's failure of a micro-batch stays that failure, wrapped with the step,
//! micro-batch and trainer), and every failure the machine itself decides is a [`StepError`],
//! turned into `E` with `From`. Invariants:
//! 1. a [`StepError`] renders exactly as the runtime error's variant of the same name (the
//!    runtime's `From<StepError>` maps each variant to that flat variant, fields unchanged);
//! 2. a report is recognised as non-finite only through [`Failure::non_finite`], and such a
//!    report never ends a step as a micro-batch failure (it is discarded, then failed or skipped
//!    per [`NonFinite`](super::NonFinite));
//! 3. any other failed report ends the step as [`Failure::in_micro_batch`] of its error.

use std::fmt::Debug;

use serde::{Deserialize, Serialize};

use crate::balancer::BalanceError;
use crate::error::{place, NonFiniteAt};
use crate::ledger::LedgerError;

/// A failure the step machine decides: the step cannot start, cannot be planned, ran past a
/// deadline, lost what it needs, or found non-finite values. Each message is the runtime
/// error's for the variant of the same name.
#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
pub enum StepError {
    /// A [`StepConfig`](super::StepConfig) field out of range, or a plan the configuration cannot
    /// run (collective mode without every trainer, a sample sequence splitting cannot cut).
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("empty minibatch at step {step}")]
    EmptyMinibatch { step: u64 },
    /// The balancer could not plan the minibatch (a sample over the budget, a bad cost model).
    #[error("balancer: {0}")]
    Balance(#[from] BalanceError),
    #[error("no trainer left alive (step {step})")]
    NoTrainers { step: u64 },
    #[error("step {step} was replayed {replays} times and failed again; giving up")]
    TooManyReplays { step: u64, replays: u32 },
    #[error("a step is already running")]
    Busy,
    /// A wait ran past its deadline (docs/design.md I6): a hung compute, a lost peer, a stuck step.
    #[error("step {step}: {what}{} ran past its deadline, gave up after {after_ms} ms", place(*.trainer, *.micro_batch))]
    Deadline {
        /// What was waited for: `"micro-batch"`, `"step"`, `"parameters"`.
        what: String,
        step: u64,
        trainer: Option<u32>,
        micro_batch: Option<u32>,
        /// How long it had run when given up on.
        after_ms: u64,
    },
    /// The ledger refused a hand-out or a completion: the machine's state is inconsistent. The
    /// step fails rather than drop or double-count a micro-batch (I2).
    #[error("step {step}: the ledger refused: {source}")]
    Ledger { step: u64, source: LedgerError },
    /// A gradient, a loss or the global gradient norm was not finite (NaN or ±inf). It never
    /// reached a parameter: the step's gradients were discarded at every owner. Boxed: the
    /// error type stays small.
    #[error("{0}")]
    NonFinite(Box<NonFiniteAt>),
    /// An actor the step needs is gone (a shard server, and with it its shard).
    #[error("actor {actor}: {reason}")]
    Actor { actor: String, reason: String },
}

/// What the step machine needs of the runtime's error `E`: to be made from a [`StepError`]
/// (every failure the machine decides itself), cloned (a stopped machine answers every later
/// request with its error), and two questions about a trainer's failed report. A report whose
/// error is [`non_finite`](Failure::non_finite) is discarded and the step failed or skipped per
/// [`NonFinite`](super::NonFinite), never failed as a micro-batch; any other failed report ends
/// the step with [`in_micro_batch`](Failure::in_micro_batch) of its error, unchanged inside.
///
/// ```
/// use odc_policy::step::{Failure, StepError};
/// use odc_policy::NonFiniteAt;
///
/// #[derive(Debug, Clone)]
/// enum RuntimeError {
///     Step(StepError),
///     MicroBatch { micro_batch: u32, source: Box<RuntimeError> },
/// }
/// impl From<StepError> for RuntimeError {
///     fn from(e: StepError) -> Self {
///         RuntimeError::Step(e)
///     }
/// }
/// impl Failure for RuntimeError {
///     fn non_finite(&self) -> Option<&NonFiniteAt> {
///         match self {
///             RuntimeError::Step(StepError::NonFinite(at)) => Some(at),
///             _ => None,
///         }
///     }
///     fn in_micro_batch(self, _step: u64, micro_batch: u32, _trainer: u32) -> Self {
///         RuntimeError::MicroBatch { micro_batch, source: Box::new(self) }
///     }
/// }
/// ```
pub trait Failure: Clone + Debug + From<StepError> {
    /// Where this failure found a non-finite value, if that is what it is (a trainer's gradient
    /// or loss check).
    fn non_finite(&self) -> Option<&NonFiniteAt>;

    /// This failure of `micro_batch` of `step`, which `trainer` ran: what the step ends with.
    fn in_micro_batch(self, step: u64, micro_batch: u32, trainer: u32) -> Self;
}

/// The machine's own errors as its error type, for a machine with no runtime around it (the
/// examples): a [`StepError`] has no variant naming a micro-batch, so a failed micro-batch ends
/// the step with the report's error itself; the runtime's error wraps it instead
/// (`odc_actors::Error::MicroBatch`).
impl Failure for StepError {
    fn non_finite(&self) -> Option<&NonFiniteAt> {
        match self {
            StepError::NonFinite(at) => Some(at),
            _ => None,
        }
    }

    fn in_micro_batch(self, _step: u64, _micro_batch: u32, _trainer: u32) -> Self {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_errors_name_their_context() {
        let deadline = StepError::Deadline {
            what: "micro-batch".into(),
            step: 3,
            trainer: Some(1),
            micro_batch: Some(4),
            after_ms: 250,
        };
        assert_eq!(
            deadline.to_string(),
            "step 3: micro-batch on trainer 1 (micro-batch 4) ran past its deadline, gave up after 250 ms"
        );
        let replays = StepError::TooManyReplays {
            step: 2,
            replays: 3,
        };
        assert_eq!(
            replays.to_string(),
            "step 2 was replayed 3 times and failed again; giving up"
        );
    }
}
