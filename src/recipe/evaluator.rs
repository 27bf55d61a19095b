//! Where and how the lead answers held-out problems while the trainers wait: [`Evaluator`], on
//! the trainers' device in their precision (bf16's matrices and cache under bf16), with the
//! weights read from the shard servers' published copies at the job's current version (device
//! to device where the job's transport reaches the evaluator's GPU).
//!
//! Guarantees:
//! - On a GPU one thread answers (its batches are the parallelism); on the CPU one thread per
//!   trainer of this process, each a share of the problems in whole batches of
//!   [`EVAL_BATCH`](crate::model::EVAL_BATCH), so the answers do not depend on the count.
//! - Answers are greedy and end at the tokenizer's stop ids or `max_new_tokens`.
//! - The eval loss ([`Evaluator::loss`]) is over the same weights, packs of at most the job's
//!   token budget, and does not depend on the number of threads either.

use candle_core::Device;

use super::Result;
use crate::compute::{published_weights, Placement};
use crate::model::{
    eval_loss, evaluate_prompted, open_device, ComputePrecision, EvalLoss, Evaluation, ModelConfig,
    Sample, Weights,
};
use crate::text::{Problem, TextFormat};
use crate::Job;

/// Where held-out problems are answered (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct Evaluator {
    pub device: Device,
    pub precision: ComputePrecision,
    /// Threads answering at once.
    pub workers: usize,
}

impl Evaluator {
    /// On the trainers' device (`placement`), with `trainers_here` threads on the CPU.
    pub fn new(placement: &Placement, trainers_here: usize) -> Result<Evaluator> {
        let (device, workers) = match placement.device.is_cuda() {
            true => (open_device(placement.device, placement.local_rank)?, 1),
            false => (Device::Cpu, trainers_here.max(1)),
        };
        Ok(Evaluator {
            device,
            precision: placement.precision,
            workers,
        })
    }

    /// `model`'s weights from the job's unit `first` on (0: the policy; a served copy after it),
    /// at the job's current version, as this evaluator computes with them.
    pub async fn weights(
        &self,
        job: &mut Job,
        model: &ModelConfig,
        first: usize,
    ) -> Result<Weights> {
        Ok(published_weights(job, model, first, &self.device, self.precision).await?)
    }

    /// Exact-match accuracy of greedy answers to `problems`, each prompted in `format`, with the
    /// job's current weights of `model`.
    pub async fn accuracy(
        &self,
        job: &mut Job,
        model: &ModelConfig,
        format: &TextFormat,
        problems: &[Problem],
        max_new_tokens: usize,
    ) -> Result<Evaluation> {
        let weights = self.weights(job, model, 0).await?;
        let prompt = |p: &Problem| format.prompt(&p.question);
        Ok(evaluate_prompted(
            &weights,
            &*format.tokenizer(),
            problems,
            max_new_tokens,
            self.workers,
            &prompt,
        )?)
    }

    /// The eval loss of the job's current weights of `model` on `samples`, in packs of at most
    /// `token_budget` tokens.
    pub async fn loss(
        &self,
        job: &mut Job,
        model: &ModelConfig,
        samples: &[Sample],
        token_budget: usize,
    ) -> Result<EvalLoss> {
        let weights = self.weights(job, model, 0).await?;
        Ok(eval_loss(&weights, samples, token_budget, self.workers)?)
    }
}
