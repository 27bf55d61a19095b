//! # odc-policy — the runtime's pure cores
//!
//! Every decision the runtime makes about work, and the plain data it decides on, with no actor,
//! no async runtime and no clock behind it. `odc-actors` drives these cores (it re-exports this
//! crate as `odc_actors::policy`, and [`batch`], [`layout`] and [`NonFiniteAt`] at its root).
//!
//! - [`balancer`]: cost model, packing, partitioning, minibatch plans (LB-Mini, LB-Micro, dynamic);
//! - [`dispatch`]: the work queue of one minibatch attempt (own lists, earliest-finish stealing);
//! - [`ledger`]: exactly-once accounting of micro-batches (I2);
//! - [`membership`]: which authenticated session is which rank, and which rank is lost
//!   (closed, or silent past the heartbeat timeout);
//! - [`gather`]: one all-gather at the coordinator (which parts it keeps, when it is complete);
//! - [`straggler`]: per-trainer speed estimates;
//! - [`schedule`]: the learning rate's factor per global step (warm-up, cosine decay);
//! - [`recovery`]: what a trainer failure means (respawn or drop, replay or not, how often);
//! - [`relay`]: which server of a node relays its gradient pushes to an owner on another node;
//! - [`step`]: the supervisor's decisions as a state machine (plan, dispatch, ledger, barrier,
//!   replay, deadlines): events in, commands with reasons out;
//! - [`token`]: the assignment tokens that bind reports and gradient writes to assignments;
//! - [`split`]: cutting one causal sample across a gang (zig-zag chunks, balanced causal work);
//! - [`optimizer`]: SGD and AdamW on one shard, elementwise (the shard servers' update rule);
//! - the data they decide on: [`batch`] (samples, micro-batches, the loss convention),
//!   [`layout`] (units and shards), [`tensor_map`] (a unit's named tensors), [`assignment`] (an
//!   assignment and the report answering it),
//!   [`stats`] (what a micro-batch and a step report), [`clock`] ([`Timestamp`](clock::Timestamp)
//!   and the [`Clock`](clock::Clock) the actors inject);
//! - its errors, one per core that decides: [`step::StepError`], [`layout::LayoutError`],
//!   [`balancer::BalanceError`], [`ledger::LedgerError`], [`optimizer::OptimizerError`], ...,
//!   and [`NonFiniteAt`] ([`error`]). The runtime's one error enum, which also names transports,
//!   endpoints and actors, is `odc_actors::Error`: it converts from each of these, and the step
//!   machine carries it through typed ([`step::Failure`]).
//!
//! Rules every module here follows:
//! - **no actor framework, no async runtime**, by construction: nothing this crate depends on,
//!   directly or through another crate, is ractor, ractor_cluster, tokio, futures or
//!   async-trait, so no file here can name them (the compiler refuses), and `tests/house.rs` walks
//!   the resolved dependency graph to keep it so (it names the chain that brings one in). In
//!   particular the crate does not depend on `odc-transport`. Nothing here spawns, sends or
//!   awaits; the actors translate messages into calls and execute what comes back;
//! - **no clock reads**: time comes in as an argument (`now: Timestamp`, or seconds measured by the
//!   caller), so every decision is a function of its inputs and is unit-tested as such. The one
//!   exception is [`clock::SystemClock`], the implementation the actors inject;
//! - **decisions carry reasons**: every [`step::Decision`] names why it was taken
//!   ([`step::Reason`]), printable for logs and comparable in tests.

pub mod assignment;
pub mod balancer;
pub mod batch;
pub mod clock;
pub mod dispatch;
pub mod error;
pub mod gather;
pub mod layout;
pub mod ledger;
pub mod membership;
pub mod optimizer;
pub mod recovery;
pub mod relay;
pub mod schedule;
pub mod split;
pub mod stats;
pub mod step;
pub mod straggler;
pub mod tensor_map;
#[cfg(feature = "testing")]
pub mod testing;
pub mod token;

pub use error::NonFiniteAt;

/// Index of a unit in its [`ModelLayout`](layout::ModelLayout).
pub type UnitId = u32;
