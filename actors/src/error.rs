//! The runtime's one error type. Every variant names what was wrong (unit, trainer, lengths, ...).
//!
//! Errors are plain serializable data (kind + context: the variant and its fields, no trait
//! objects), so they cross the control plane between processes unchanged; an error of the user's
//! compute keeps its rendered message chain ([`Error::user`]).
//!
//! The pure cores of [`crate::policy`] have their own errors, about what they decide; this one
//! also names what only the runtime has: transports, endpoints, actors, checkpoint files. The
//! step machine's decisions nest in it unchanged, [`Error::Step`] around a [`StepError`] (the
//! minibatch is empty, no trainer is left, a step is busy, a value is not finite, ...; its
//! message is the step error's), and a layout's error becomes `Layout` or `UnknownUnit`, so a
//! caller matches one enum whichever core failed. A wait past its deadline and an actor that
//! failed are step errors wherever they happen (`StepError::Deadline`, `StepError::Actor`: the
//! machine's micro-batch and step deadlines, and the runtime's calls); the runtime's own
//! configuration checks are [`Error::Config`], the machine's `StepError::Config`. It is the step
//! machine's error ([`Failure`]): a trainer's failed micro-batch comes back to the caller typed,
//! as [`Error::MicroBatch`] around the trainer's own error.

use odc_checkpoint::FileError;
use odc_policy::layout::LayoutError;
use odc_policy::optimizer::OptimizerError;
use odc_policy::step::{Failure, StepError};
use odc_policy::{NonFiniteAt, UnitId};
use odc_transport::{EndpointId, TransportError};
use serde::{Deserialize, Serialize};

/// Errors of the odc runtime.
#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
pub enum Error {
    #[error("unknown unit {unit}: the model has {units} units")]
    UnknownUnit { unit: UnitId, units: u64 },
    #[error("gradient for unit {unit} ({name}) has {got} elements, the unit has {expected}")]
    GradLength {
        unit: UnitId,
        name: String,
        expected: u64,
        got: u64,
    },
    /// A gradient pushed for a frozen unit ([`UnitSpec::frozen`](crate::layout::UnitSpec::frozen)):
    /// its servers keep no accumulator and no optimizer state for it. Nothing was sent.
    #[error("unit {unit} ({name}) is frozen: it takes no gradient (push only trainable units)")]
    FrozenUnit { unit: UnitId, name: String },
    #[error("unit {unit} was pushed twice in micro-batch {micro_batch}: sum the gradient locally and push once")]
    DuplicatePush { unit: UnitId, micro_batch: u32 },
    #[error("unit {unit} is not gathered, so it cannot be released")]
    NotGathered { unit: UnitId },
    #[error("read of unit {unit} from shard server {owner} returned version {got} during step version {expected} (I1)")]
    VersionMismatch {
        unit: UnitId,
        owner: EndpointId,
        expected: u64,
        got: u64,
    },
    #[error("pull of unit {unit} from shard server {owner} failed: {source}")]
    Pull {
        unit: UnitId,
        owner: EndpointId,
        source: TransportError,
    },
    #[error("gradient push of unit {unit} to shard server {owner} failed: {source}")]
    Push {
        unit: UnitId,
        owner: EndpointId,
        source: TransportError,
    },
    #[error("collective of unit {unit} with trainer {peer} failed: {source}")]
    Collective {
        unit: UnitId,
        peer: u32,
        source: TransportError,
    },
    /// A gang's exchange (sequence splitting) with trainer `peer` failed.
    #[error("gang exchange with trainer {peer} failed: {source}")]
    Gang { peer: u32, source: TransportError },
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    #[error("invalid model layout: {0}")]
    Layout(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("the job needs at least one {what}, got 0")]
    Zero { what: String },
    /// A decision of the step machine (the minibatch, its plan, its trainers, its values).
    #[error(transparent)]
    Step(#[from] StepError),
    #[error("optimizer: {0}")]
    Optimizer(#[from] OptimizerError),
    #[error("micro-batch {micro_batch} of step {step} failed on trainer {trainer}: {source}")]
    MicroBatch {
        step: u64,
        micro_batch: u32,
        trainer: u32,
        source: Box<Error>,
    },
    #[error("user compute: {message}")]
    User { message: String },
    #[error("a collective was aborted: its minibatch attempt was discarded")]
    CollectiveAborted,
    /// A checkpoint file could not be written or read (the path, and why).
    #[error("{path}: {reason}")]
    Checkpoint { path: String, reason: String },
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// Wrap an error of the user's compute, keeping its message and the messages of its sources.
    pub fn user(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        let e = e.into();
        let mut message = e.to_string();
        let mut source = e.source();
        while let Some(s) = source {
            message.push_str(": ");
            message.push_str(&s.to_string());
            source = s.source();
        }
        Error::User { message }
    }
}

/// Short for `Result<T, odc_actors::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A checkpoint file a server wrote or published (`odc-checkpoint`'s [`FileError`]) as the
/// variant naming its path.
impl From<FileError> for Error {
    fn from(e: FileError) -> Self {
        Error::Checkpoint {
            path: e.path,
            reason: e.reason,
        }
    }
}

/// A layout's error as the variant of the same message.
impl From<LayoutError> for Error {
    fn from(e: LayoutError) -> Self {
        match e {
            LayoutError::Invalid(reason) => Error::Layout(reason),
            LayoutError::UnknownUnit { unit, units } => Error::UnknownUnit { unit, units },
        }
    }
}

/// What the step machine asks of the runtime's error: a trainer's non-finite report is
/// `Error::Step(StepError::NonFinite)`; a failed micro-batch is [`Error::MicroBatch`] around the
/// trainer's error.
impl Failure for Error {
    fn non_finite(&self) -> Option<&NonFiniteAt> {
        match self {
            Error::Step(step) => step.non_finite(),
            _ => None,
        }
    }

    fn in_micro_batch(self, step: u64, micro_batch: u32, trainer: u32) -> Self {
        Error::MicroBatch {
            step,
            micro_batch,
            trainer,
            source: Box::new(self),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use odc_policy::ledger::LedgerError;

    /// The step machine's errors nest unchanged with their messages, the layout's keep theirs as
    /// the runtime's variants (callers and tests compare the text), and a failed micro-batch
    /// wraps the trainer's error.
    #[test]
    fn policy_errors_become_the_variant_of_the_same_message() {
        let step_errors = [
            StepError::Config("token budget must be positive".into()),
            StepError::EmptyMinibatch { step: 1 },
            StepError::NoTrainers { step: 2 },
            StepError::TooManyReplays {
                step: 3,
                replays: 4,
            },
            StepError::Busy,
            StepError::Deadline {
                what: "micro-batch".into(),
                step: 5,
                trainer: Some(6),
                micro_batch: None,
                after_ms: 7,
            },
            StepError::Ledger {
                step: 8,
                source: LedgerError::NotPending {
                    micro_batch: 9,
                    trainer: 1,
                    state: "assigned".into(),
                },
            },
            StepError::NonFinite(Box::new(NonFiniteAt {
                what: "loss".into(),
                step: 10,
                trainer: Some(0),
                micro_batch: Some(1),
                samples: vec![4, 2],
                unit: None,
                element: None,
                value: "NaN".into(),
            })),
            StepError::Actor {
                actor: "shard server 2".into(),
                reason: "panicked".into(),
            },
        ];
        for e in step_errors {
            assert_eq!(Error::from(e.clone()).to_string(), e.to_string(), "{e:?}");
            assert_eq!(Error::from(e.clone()), Error::Step(e.clone()));
            assert_eq!(Error::from(e.clone()).non_finite(), e.non_finite());
        }
        let layout = [
            LayoutError::Invalid("a model needs at least one unit".into()),
            LayoutError::UnknownUnit { unit: 3, units: 1 },
        ];
        for e in layout {
            assert_eq!(Error::from(e.clone()).to_string(), e.to_string(), "{e:?}");
        }
        let pull = Error::Pull {
            unit: 1,
            owner: 2,
            source: TransportError::UnknownRegion {
                owner: 2,
                region: 7,
            },
        };
        assert!(pull.non_finite().is_none());
        match pull.clone().in_micro_batch(3, 4, 5) {
            Error::MicroBatch {
                step: 3,
                micro_batch: 4,
                trainer: 5,
                source,
            } => assert_eq!(*source, pull),
            other => panic!("{other:?}"),
        }
    }
}
