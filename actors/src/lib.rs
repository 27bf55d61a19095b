//! # odc-actors — the runtime
//!
//! Shard servers, trainers and the supervisor (ractor actors) around the pure policy cores of
//! [`policy`] (the `odc-policy` crate, which nothing async reaches: neither ractor, tokio,
//! futures nor async-trait is in its dependency graph, not even through odc-transport, which it
//! does not depend on): [`policy::balancer`] (cost model, packing,
//! partitioning, plans), [`policy::dispatch`] (the work queue), [`policy::ledger`] (exactly-once
//! accounting of micro-batches), [`policy::straggler`] (speed estimates) and [`policy::step`] (the
//! supervisor's decisions as a state machine). [`policy::optimizer`] (SGD, AdamW on one shard) is
//! pure too. [`datapath`] holds how gathers and pushes move ([`datapath::OnDemand`],
//! [`datapath::Collective`]); [`messages`] the control plane's rules and every actor's messages.
//!
//! [`Error`] is the runtime's one error enum, here because it names what only the runtime has
//! (transports, endpoints, actors, checkpoint files): plain serializable data that crosses
//! processes. The policy's cores fail with their own errors ([`policy::step::StepError`],
//! [`layout::LayoutError`], ...), which convert into its variants of the same name and message;
//! the step machine runs as `StepMachine<Error>`, so a trainer's error reaches the caller typed.
//!
//! Invariants (docs/design.md), each stated where it is upheld and tested by name:
//! - **I1 consistency** — [`server`], [`policy::step`], [`trainer`].
//! - **I2 exactly once** — [`policy::ledger`], [`policy::step`], [`server`] (with transport
//!   fencing C3).
//! - **I3 equivalence** — the loss convention of [`batch`] and elementwise [`policy::optimizer`]
//!   steps.
//! - **I4 no inner barrier** — [`datapath::OnDemand`], [`trainer`], [`policy::step`].
//! - **I5 bounded memory** — [`trainer`] (its context and unit buffers).
//! - **I6 liveness** — [`policy::step`] (micro-batch deadlines), [`supervisor`] (ticks, call
//!   timeouts), [`datapath`] (a deadline on every transfer, the collective epoch floor),
//!   [`server`] (barrier work off the async runtime).
//!
//! **Layers.** `error`, [`directory`], [`faults`] and [`metrics`] import nothing else of the
//! crate; [`memory`] (what a trainer's transfers read and write) sits below [`datapath`], which
//! sits below the actors. Above them the actors name one another, and that is the crate's one
//! import circle, on purpose: the supervisor spawns servers and trainers ([`supervisor`] →
//! [`server`], [`trainer`]) and they answer it (a trainer reports to the supervisor's mailbox), a
//! node ([`node`]) hosts the process's actors and data paths, and [`cluster`] carries their
//! messages between processes. Each actor's messages live beside it (`server::messages`,
//! `trainer::messages`, `supervisor::messages`, `cluster::messages`; [`messages`] re-exports them
//! and states their rules). An actor is the pair of its messages and its mailbox's owner, so the
//! folders follow the actors; each folder has no circle of its own.

pub mod cluster;
pub mod datapath;
pub mod directory;
mod error;
pub mod faults;
pub mod memory;
pub mod messages;
pub mod metrics;
pub mod node;
pub mod server;
pub mod supervisor;
pub mod trainer;

/// The pure cores, their own crate so that the compiler keeps ractor, tokio and the rest of the
/// async stack out of them.
pub use odc_policy as policy;
pub use odc_policy::NonFiniteAt;
pub use odc_policy::{batch, layout};

pub use error::{Error, Result};
