//! [`JobRecipe`]: the job of a transformer as both recipes build it — the model's units and a
//! trainer's compute per trainer ([`transformer_job_of`]), AdamW ([`adamw`]), the global
//! gradient norm clipped, micro-batches under a token budget, fp32 pulls, the fleet on its
//! ranks, the newest checkpoints kept, and a checkpoint to resume from. The entry adds what is
//! its own (a learning-rate schedule, its data, units it serves) to the builder it returns.

use std::sync::Arc;

use super::{Fleet, Result};
use crate::checkpoint::Opened;
use crate::compute::{transformer_job_of, Objective, Placement, SampleStore};
use crate::launch::World;
use crate::model::ModelConfig;
use crate::{JobBuilder, OptimizerConfig, Precision, UnitSpec};

/// AdamW as the recipes train with it: β = (0.9, 0.95), ε = 1e-8 (the values of Llama's and
/// Qwen's fine-tuning recipes).
pub fn adamw(lr: f32, weight_decay: f32) -> OptimizerConfig {
    OptimizerConfig::AdamW {
        lr,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay,
    }
}

/// What a recipe's job is made of (see the [module docs](self)).
pub struct JobRecipe<'a> {
    pub model: &'a ModelConfig,
    /// The model's units as they start (a checkpoint's, a model directory's, or seeded).
    pub units: Vec<UnitSpec>,
    /// The samples the trainers' compute reads by index.
    pub store: Arc<dyn SampleStore>,
    pub objective: Objective,
    pub placement: Placement,
    pub optimizer: OptimizerConfig,
    /// The global gradient norm's bound.
    pub clip_grad_norm: f64,
    /// Most tokens in one packed micro-batch.
    pub token_budget: u64,
    /// Checkpoints kept (0: all).
    pub keep_last: usize,
    pub fleet: &'a Fleet,
}

impl JobRecipe<'_> {
    /// The job's builder on `world`, resuming `resume` if given.
    pub fn builder(self, world: &World, resume: Option<Opened>) -> Result<JobBuilder> {
        let builder = transformer_job_of(
            self.model,
            self.units,
            self.store,
            self.objective,
            self.placement,
        )?
        .optimizer(self.optimizer)
        .clip_grad_norm(self.clip_grad_norm)
        .token_budget(self.token_budget)
        .pull_precision(Precision::F32)
        .keep_last_checkpoints(self.keep_last);
        let builder = self.fleet.apply(builder, world)?;
        Ok(match resume {
            Some(opened) => builder.resume_from(opened),
            None => builder,
        })
    }
}
