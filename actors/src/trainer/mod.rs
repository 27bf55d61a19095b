//! The trainer: runs user compute on one micro-batch at a time and reports to the supervisor.
//!
//! - A micro-batch is reported done only after every gradient push was acknowledged by its
//!   receivers (docs/design.md "One minibatch", step 4).
//! - Nothing non-finite leaves a trainer: a gradient with a NaN or ±inf is refused by `push_grad`
//!   (checked in the pass that encodes it) and a compute returning a non-finite loss fails its
//!   micro-batch; both report `Error::Step(StepError::NonFinite)` naming the trainer,
//!   micro-batch and samples (and the unit), and the supervisor fails or skips the step.
//! - No gradient leaves a trainer for a frozen unit: `push_grad` refuses it with
//!   [`Error::FrozenUnit`](crate::Error::FrozenUnit) and sends nothing (no bytes pushed, no
//!   collective issued).
//! - A panic in user compute fails the actor; spawned linked, the failure reaches the supervisor as
//!   a supervision event (I2 replay).
//! - In on-demand mode trainers never talk to each other (**I4**): the only thing a trainer waits
//!   on is its own transfers.
//! - Messages are plain serializable data ([`Assignment`], [`TrainerReport`]); the actor starts
//!   from a serializable [`TrainerSpec`] plus its process's [`Node`](crate::node::Node).

mod actor;
mod compute;
mod context;
pub mod messages;

pub use crate::memory::{DeviceGrad, DeviceMemory, DeviceUnit, UnitValues};
pub use actor::{Trainer, TrainerArgs};
pub use compute::{blocking, Compute, ComputeFactory, SharedComputeFactory};
pub use context::{ContextConfig, Direction, MicroBatchStats, PushTicket, TrainerContext};
pub use messages::{Assignment, MicroBatchDone, TrainerMsg, TrainerReport, TrainerSpec};
