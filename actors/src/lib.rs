//! # odc-actors — the runtime
//!
//! Shard servers, trainers and the supervisor (ractor actors) around pure policy cores that import
//! neither ractor nor tokio: [`balancer`] (cost model, packing, partitioning, plans), [`optimizer`]
//! (SGD, AdamW on one shard), [`ledger`] (exactly-once accounting of micro-batches) and [`dispatch`]
//! (the work queue).
//!
//! Invariants (DESIGN.md), each stated where it is upheld and tested by name:
//! - **I1 consistency** — [`server`], [`supervisor`], [`context`].
//! - **I2 exactly once** — [`ledger`], [`server`], [`supervisor`] (with transport fencing C3).
//! - **I3 equivalence** — the loss convention of [`compute`] and elementwise [`optimizer`] steps.
//! - **I4 no inner barrier** — [`trainer`], [`supervisor`].
//! - **I5 bounded memory** — [`context`].

pub mod balancer;
pub mod collective;
pub mod compute;
pub mod context;
pub mod directory;
pub mod dispatch;
mod error;
pub mod layout;
pub mod ledger;
pub mod metrics;
pub mod optimizer;
pub mod server;
pub mod stats;
pub mod straggler;
pub mod supervisor;
pub mod trainer;

pub use error::{Error, Result};
