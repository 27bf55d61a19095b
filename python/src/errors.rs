//! The package's exceptions, raised from the Rust errors in one place. The classes are defined in
//! Python (`odc/errors.py`: `odc.Error` and its subclasses, a bad argument also a `ValueError`),
//! so that one hierarchy holds whether an error starts in Rust or in the package's Python; each
//! carries the Rust error's message, which names what was wrong.

use odc_policy::balancer::BalanceError;
use pyo3::prelude::*;

use crate::plan::PlanError;

/// The Python classes, imported from `odc.errors` when first raised.
mod class {
    pyo3::import_exception!(odc.errors, BalanceError);
    pyo3::import_exception!(odc.errors, InvalidArgument);
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
