//! # odc-actors — the runtime
//!
//! Shard servers, trainers and the supervisor (ractor actors) around the pure policy cores of
//! [`policy`], which import neither ractor nor tokio: [`policy::balancer`] (cost model, packing,
//! partitioning, plans), [`policy::dispatch`] (the work queue), [`policy::ledger`] (exactly-once
//! accounting of micro-batches), [`policy::straggler`] (speed estimates) and [`policy::step`] (the
//! supervisor's decisions as a state machine). [`server::optimizer`] (SGD, AdamW on one shard) is pure
//! too. [`datapath`] holds how gathers and pushes move ([`datapath::OnDemand`],
//! [`datapath::Collective`]); [`messages`] every control-plane message.
//!
//! Invariants (docs/design.md), each stated where it is upheld and tested by name:
//! - **I1 consistency** — [`server`], [`policy::step`], [`trainer`].
//! - **I2 exactly once** — [`policy::ledger`], [`policy::step`], [`server`] (with transport
//!   fencing C3).
//! - **I3 equivalence** — the loss convention of [`batch`] and elementwise [`server::optimizer`] steps.
//! - **I4 no inner barrier** — [`datapath::OnDemand`], [`trainer`], [`policy::step`].
//! - **I5 bounded memory** — [`trainer`] (its context and unit buffers).
//! - **I6 liveness** — [`policy::step`] (micro-batch deadlines), [`supervisor`] (ticks, call
//!   timeouts), [`datapath`] (a deadline on every transfer, the collective epoch floor),
//!   [`server`] (barrier work off the async runtime).

pub mod batch;
pub mod cluster;
pub mod datapath;
pub mod directory;
mod error;
pub mod layout;
pub mod messages;
pub mod metrics;
pub mod node;
pub mod policy;
pub mod server;
pub mod supervisor;
pub mod trainer;

pub use error::{Error, NonFiniteAt, Result};
