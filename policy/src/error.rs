//! The runtime's one error type. Every variant names what was wrong (unit, trainer, lengths, ...).
//!
//! Errors are plain serializable data (kind + context: the variant and its fields, no trait
//! objects), so they cross the control plane between processes unchanged; an error of the user's
//! compute keeps its rendered message chain ([`Error::user`]).

use odc_transport::{EndpointId, TransportError};
use serde::{Deserialize, Serialize};

use crate::balancer::BalanceError;
use crate::ledger::LedgerError;
use crate::optimizer::OptimizerError;
use crate::UnitId;

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
    #[error("read of unit {unit} from server {owner} returned version {got} during step version {expected} (I1)")]
    VersionMismatch {
        unit: UnitId,
        owner: EndpointId,
        expected: u64,
        got: u64,
    },
    #[error("pull of unit {unit} from server {owner} failed: {source}")]
    Pull {
        unit: UnitId,
        owner: EndpointId,
        source: TransportError,
    },
    #[error("gradient push of unit {unit} to server {owner} failed: {source}")]
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
    #[error("empty minibatch at step {step}")]
    EmptyMinibatch { step: u64 },
    #[error("balancer: {0}")]
    Balance(#[from] BalanceError),
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
    /// The ledger refused a hand-out or a completion: the supervisor's state is inconsistent. The
    /// step fails rather than drop or double-count a micro-batch (I2).
    #[error("step {step}: the ledger refused: {source}")]
    Ledger { step: u64, source: LedgerError },
    /// A gradient, a loss or the global gradient norm was not finite (NaN or ±inf). It never
    /// reached a parameter: the step's gradients were discarded at every owner. Boxed: the
    /// error type stays small.
    #[error("{0}")]
    NonFinite(Box<NonFiniteAt>),
    #[error("actor {actor}: {reason}")]
    Actor { actor: String, reason: String },
    /// A checkpoint file could not be written or read (the path, and why).
    #[error("{path}: {reason}")]
    Checkpoint { path: String, reason: String },
    #[error("internal error: {0}")]
    Internal(String),
}

/// `" on trainer T (micro-batch M)"`, the parts that are known.
fn place(trainer: Option<u32>, micro_batch: Option<u32>) -> String {
    match (trainer, micro_batch) {
        (Some(t), Some(m)) => format!(" on trainer {t} (micro-batch {m})"),
        (Some(t), None) => format!(" on trainer {t}"),
        (None, Some(m)) => format!(" (micro-batch {m})"),
        (None, None) => String::new(),
    }
}

/// Where a non-finite (NaN or ±inf) gradient, loss or global gradient norm was found
/// ([`Error::NonFinite`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
#[error(
    "step {step}: non-finite {what} ({value}){}{}{}",
    place(*.trainer, *.micro_batch),
    samples_of(.samples),
    unit_element(*.unit, *.element)
)]
pub struct NonFiniteAt {
    /// What was not finite: `"gradient"`, `"loss"` or `"global gradient norm"`.
    pub what: String,
    /// The global step (set by the supervisor; a trainer fills in its parameter version).
    pub step: u64,
    /// The trainer that found it (`None`: the barrier, where every trainer's sum meets).
    pub trainer: Option<u32>,
    pub micro_batch: Option<u32>,
    /// Dataset indices ([`SampleMeta::index`](crate::batch::SampleMeta::index)) of the
    /// micro-batch's samples.
    pub samples: Vec<u64>,
    /// The unit of a non-finite gradient.
    pub unit: Option<UnitId>,
    /// Index within the unit of the gradient's first non-finite element.
    pub element: Option<u64>,
    /// The value found, as printed (`NaN`, `inf`, `-inf`).
    pub value: String,
}

/// `" of samples [..]"` when there are any.
fn samples_of(samples: &[u64]) -> String {
    if samples.is_empty() {
        String::new()
    } else {
        format!(" of samples {samples:?}")
    }
}

/// `", unit U element E"`, the parts that are known.
fn unit_element(unit: Option<UnitId>, element: Option<u64>) -> String {
    match (unit, element) {
        (Some(u), Some(e)) => format!(", unit {u} element {e}"),
        (Some(u), None) => format!(", unit {u}"),
        _ => String::new(),
    }
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

/// Short for `Result<T, odc_policy::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
