//! The supervisor: plans each minibatch, dispatches micro-batches, keeps the ledger, runs the
//! barrier and the optimizer step, replays a minibatch when a trainer fails and enforces the
//! deadlines. Every decision is made by the pure [`StepMachine`](crate::policy::step::StepMachine);
//! the actor ([`Supervisor`]) only translates messages into its events and executes its commands.

mod actor;
pub mod messages;
pub mod placement;
mod spec;

pub use actor::{Supervisor, SupervisorArgs, SupervisorState};
pub use messages::{ServerOutcome, SupervisorMsg, SupervisorSpec};
pub use placement::RankPlacement;
