//! # odc-actors — the runtime
//!
//! Shard servers, trainers and the supervisor (ractor actors) around the pure policy cores of
//! [`policy`], which import neither ractor nor tokio: [`policy::balancer`] (cost model, packing,
//! partitioning, plans), [`policy::dispatch`] (the work queue), [`policy::ledger`] (exactly-once
//! accounting of micro-batches), [`policy::straggler`] (speed estimates) and [`policy::step`] (the
//! supervisor's decisions as a state machine). [`optimizer`] (SGD, AdamW on one shard) is pure too.
//!
//! Invariants (DESIGN.md), each stated where it is upheld and tested by name:
//! - **I1 consistency** — [`server`], [`policy::step`], [`context`].
//! - **I2 exactly once** — [`policy::ledger`], [`policy::step`], [`server`] (with transport
//!   fencing C3).
//! - **I3 equivalence** — the loss convention of [`compute`] and elementwise [`optimizer`] steps.
//! - **I4 no inner barrier** — [`trainer`], [`policy::step`].
//! - **I5 bounded memory** — [`context`].
//! - **I6 liveness** — [`policy::step`] (micro-batch deadlines), [`supervisor`] (ticks, call
//!   timeouts).

pub mod collective;
pub mod compute;
pub mod context;
pub mod directory;
mod error;
pub mod layout;
pub mod metrics;
pub mod optimizer;
pub mod policy;
pub mod server;
pub mod supervisor;
pub mod trainer;

pub use error::{Error, Result};
