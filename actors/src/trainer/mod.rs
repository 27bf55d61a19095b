//! The trainer: runs user compute on one micro-batch at a time and reports to the supervisor.
//!
//! - A micro-batch is reported done only after every gradient push was acknowledged by its
//!   receivers (DESIGN step 4).
//! - A panic in user compute fails the actor; spawned linked, the failure reaches the supervisor as
//!   a supervision event (I2 replay).
//! - In on-demand mode trainers never talk to each other (**I4**): the only thing a trainer waits
//!   on is its own transfers.
//! - Messages are plain serializable data ([`Assignment`], [`TrainerReport`]); the actor starts from
//!   a serializable [`TrainerSpec`] plus its process's [`Node`](crate::node::Node).

mod actor;
pub mod buffers;
mod compute;
mod context;

pub use crate::messages::{Assignment, MicroBatchDone, TrainerMsg, TrainerReport, TrainerSpec};
pub use actor::{Trainer, TrainerArgs};
pub use compute::{Compute, ComputeFactory, SharedComputeFactory};
pub use context::{ContextConfig, Direction, MicroBatchStats, PushTicket, TrainerContext};
