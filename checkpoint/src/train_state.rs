//! [`TrainState`]: what a job needs to continue exactly, in memory.

use odc_policy::layout::UnitOptimizerInit;

/// A job's state after `step` optimizer steps: per unit its fp32 master values and optimizer state
/// ([`Job::train_state`](crate::Job::train_state) reads it, [`JobBuilder::resume`](crate::JobBuilder::resume)
/// starts from it, [`save`](super::save) and [`load`](super::load) put it on disk).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainState {
    /// Global steps taken (applied, or skipped for non-finite gradients): the next step is
    /// `step`.
    pub step: u64,
    /// Per unit, its flat master values.
    pub params: Vec<Vec<f32>>,
    /// Per unit, its optimizer step count and named buffers (each as long as the unit); a frozen
    /// unit's is 0 steps and no buffers ([`UnitOptimizerInit::default`]).
    pub optimizer: Vec<UnitOptimizerInit>,
}
