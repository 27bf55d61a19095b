//! The package's exceptions, raised from the Rust errors in one place. The classes are defined in
//! Python (`odc/errors.py`: `odc.Error` and its subclasses, a bad argument also a `ValueError`,
//! an unknown unit also a `KeyError`), so that one hierarchy holds whether an error starts in
//! Rust or in the package's Python; each carries the Rust error's message, which names what was
//! wrong.

use odc_policy::balancer::BalanceError;
use pyo3::prelude::*;

use crate::plan::PlanError;

/// The Python classes, imported from `odc.errors` when first raised.
mod class {
    pyo3::import_exception!(odc.errors, BalanceError);
    pyo3::import_exception!(odc.errors, InvalidArgument);
    pyo3::import_exception!(odc.errors, UnknownUnit);
    pyo3::import_exception!(odc.errors, Closed);
    pyo3::import_exception!(odc.errors, StepError);
    pyo3::import_exception!(odc.errors, CheckpointError);
}

/// A balancer's refusal as `odc.BalanceError`.
pub(crate) fn balance(e: BalanceError) -> PyErr {
    class::BalanceError::new_err(e.to_string())
}

/// A plan's refusal: a bad argument as `odc.InvalidArgument`, the rest as `odc.BalanceError`.
pub(crate) fn plan(e: PlanError) -> PyErr {
    match e {
        PlanError::SplitWithEqual => invalid(e.to_string()),
        e => class::BalanceError::new_err(e.to_string()),
    }
}

/// A bad argument as `odc.InvalidArgument` (also a `ValueError`).
pub(crate) fn invalid(reason: String) -> PyErr {
    class::InvalidArgument::new_err(reason)
}

/// A unit the job does not have, as `odc.UnknownUnit` (also a `KeyError`).
pub(crate) fn unknown_unit(reason: String) -> PyErr {
    class::UnknownUnit::new_err(reason)
}

/// A call on a closed runtime or a finished micro-batch, as `odc.Closed`.
pub(crate) fn closed(reason: String) -> PyErr {
    class::Closed::new_err(reason)
}

/// A failed step (a rank lost, a deadline passed, a non-finite gradient), as `odc.StepError`.
pub(crate) fn step(reason: String) -> PyErr {
    class::StepError::new_err(reason)
}

/// A checkpoint not written, found or opened, as `odc.CheckpointError`.
pub(crate) fn checkpoint(reason: String) -> PyErr {
    class::CheckpointError::new_err(reason)
}

/// The runtime's error: what the caller gave wrong as `odc.InvalidArgument` (or
/// `odc.UnknownUnit`), the rest as `odc.StepError`.
pub(crate) fn runtime(e: impl Into<odc::Error>) -> PyErr {
    use odc::Error as E;
    let e = e.into();
    match &e {
        E::UnknownUnit { .. } => unknown_unit(e.to_string()),
        E::GradLength { .. }
        | E::FrozenUnit { .. }
        | E::DuplicatePush { .. }
        | E::NotGathered { .. }
        | E::Config(_)
        | E::Layout(_) => invalid(e.to_string()),
        E::Checkpoint { .. } => checkpoint(e.to_string()),
        _ => step(e.to_string()),
    }
}
