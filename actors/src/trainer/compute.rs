//! The trainer-side API a user implements: [`Compute`] runs one micro-batch against a
//! [`TrainerContext`]. The loss convention is in [`crate::batch`].

use std::sync::Arc;

use super::TrainerContext;
use crate::batch::{ComputeOutput, MicroBatch};
use crate::error::Result;

/// User compute for one micro-batch: gather units, compute, push gradients.
///
/// The runtime waits for every gradient push to be acknowledged after `run` returns, and drops
/// prefetched units, so an implementation may leave pushes in flight.
#[async_trait::async_trait]
pub trait Compute: Send + 'static {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        micro_batch: &MicroBatch,
    ) -> Result<ComputeOutput>;
}

/// Makes one [`Compute`] per trainer (called again when a failed trainer is respawned).
pub trait ComputeFactory: Send + Sync + 'static {
    fn create(&self, trainer: u32) -> Box<dyn Compute>;
}

impl<F> ComputeFactory for F
where
    F: Fn(u32) -> Box<dyn Compute> + Send + Sync + 'static,
{
    fn create(&self, trainer: u32) -> Box<dyn Compute> {
        self(trainer)
    }
}

/// Shared handle to a compute factory.
pub type SharedComputeFactory = Arc<dyn ComputeFactory>;
