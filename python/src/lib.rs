//! # odc-python — the `odc` package for Python
//!
//! odc's Rust runtime from Python, one piece at a time, as a thin `#[pymodule]` over the Rust
//! crates (the pattern of Hugging Face's `tokenizers` and `safetensors`): the logic stays in
//! Rust, this crate maps types one to one, and the Python package beside it (`odc/`) adds what is
//! idiomatic there (`__repr__`, type stubs, docstrings).
//!
//! What it holds: `odc.balance`, the minibatch planner the runtime runs ([`plan`]: static and
//! dynamic dispatch, LB-Micro's equal counts, long samples split over gangs of ranks, a cost
//! model given or fitted to a measured table), with no training attached; and `odc.Runtime`
//! (`runtime.rs`), this rank's part of a job driven from a Python loop (`odc::driven`), its
//! tensors crossing by DLPack (`dlpack.rs`) with no libtorch linked, in host memory or, on the
//! GPU path (`device.rs`, `gpu.rs`), in device memory of PyTorch's CUDA context.
//!
//! Guarantees:
//! - **No panic crosses into Python**: every failure is an exception of one hierarchy, `odc.Error`
//!   and its subclasses (defined in `odc/errors.py`), raised in one place (`errors.rs`) from the
//!   Rust error, its message naming what was wrong.
//! - **The GIL is released** for the planning itself; no Rust thread holds a Python object.
//! - **No Python to build Rust**: without the feature `python` (maturin turns it on) the crate
//!   has no code, so the workspace's default build needs no interpreter. [`plan`] is plain Rust
//!   and unit-tested as such.

pub mod plan;

#[cfg(feature = "python")]
mod balance;
#[cfg(feature = "python")]
mod checkpoint;
#[cfg(feature = "python")]
mod device;
#[cfg(feature = "python")]
mod dlpack;
#[cfg(feature = "python")]
mod errors;
#[cfg(feature = "python")]
mod gpu;
#[cfg(feature = "python")]
mod runtime;

#[cfg(feature = "python")]
use pyo3::prelude::*;

/// The extension module `odc._odc` (the package `odc` re-exports it).
#[cfg(feature = "python")]
#[pymodule]
fn _odc(m: &Bound<'_, PyModule>) -> PyResult<()> {
    balance::register(m)?;
    runtime::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
