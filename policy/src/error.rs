//! What the policy's errors share: where a non-finite value was found ([`NonFiniteAt`], a
//! decision's data: the step machine fails or skips a step with it) and how an error names its
//! place in a step ([`place`]).
//!
//! The policy's errors are its own, one per core that decides something: [`StepError`]
//! (the step machine), [`LayoutError`](crate::layout::LayoutError),
//! [`BalanceError`](crate::balancer::BalanceError), [`LedgerError`](crate::ledger::LedgerError),
//! [`OptimizerError`](crate::optimizer::OptimizerError), ... The runtime's one error enum, the
//! one that also names transports, endpoints and actors, is `odc_actors::Error`: it converts from
//! each of these into its own flat variants, and the step machine carries it through unchanged
//! ([`step::Failure`](crate::step::Failure)). Like it, the policy's errors are plain
//! serializable data (no trait objects), so they cross the control plane between processes.
//!
//! [`StepError`]: crate::step::StepError

use serde::{Deserialize, Serialize};

use crate::UnitId;

/// `" on trainer T (micro-batch M)"`, the parts that are known (how a step's errors name where
/// in the step they happened).
pub fn place(trainer: Option<u32>, micro_batch: Option<u32>) -> String {
    match (trainer, micro_batch) {
        (Some(t), Some(m)) => format!(" on trainer {t} (micro-batch {m})"),
        (Some(t), None) => format!(" on trainer {t}"),
        (None, Some(m)) => format!(" (micro-batch {m})"),
        (None, None) => String::new(),
    }
}

/// Where a non-finite (NaN or ±inf) gradient, loss or global gradient norm was found
/// ([`StepError::NonFinite`](crate::step::StepError::NonFinite), and the runtime error's
/// variant of the same name).
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
