//! What a trainer is asked to train on and what it returns: plain serializable data shared by the
//! policy (which plans micro-batches), the control plane (which carries them) and the trainer API.
//!
//! Loss convention (so that any split of a minibatch gives the same gradient, I3): a compute returns
//! the **sum** of its samples' losses and pushes the gradient of that sum; with
//! [`LossWeighting::Tokens`] the loss of a sample is the sum of its per-token losses, with
//! [`LossWeighting::Samples`] it is the sample's mean per-token loss. The shard servers divide the
//! accumulated gradient by the minibatch's total weight (tokens or samples) before the optimizer step.

use serde::{Deserialize, Serialize};

/// One sample of a minibatch as the runtime sees it: the user's dataset index and its lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleMeta {
    /// Index into the user's dataset; the compute resolves it.
    pub index: u64,
    /// Sequence length in tokens (drives packing and the cost model).
    pub tokens: u64,
    /// Tokens that carry loss (the weight under [`LossWeighting::Tokens`]).
    pub loss_tokens: u64,
}

impl SampleMeta {
    /// A sample whose every token carries loss.
    pub fn new(index: u64, tokens: u64) -> Self {
        SampleMeta {
            index,
            tokens,
            loss_tokens: tokens,
        }
    }
}

/// What the gradient is averaged over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum LossWeighting {
    /// Token mean over the whole minibatch (verl's `token-mean`).
    #[default]
    Tokens,
    /// Mean over samples of each sample's token mean (verl's `seq-mean-token-mean`).
    Samples,
}

impl LossWeighting {
    /// The weight `sample` contributes to the minibatch's total.
    pub fn weight(self, sample: &SampleMeta) -> f64 {
        match self {
            LossWeighting::Tokens => sample.loss_tokens as f64,
            LossWeighting::Samples => 1.0,
        }
    }
}

/// One member's share of a sample split over a gang of trainers (sequence splitting): every
/// member's micro-batch names the same sample and gang, and its own member index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// The whole sample: each member resolves it and keeps its own chunks
    /// ([`crate::split::zigzag`]).
    pub sample: SampleMeta,
    /// The accumulator epoch of the attempt, and the gang's number in it: together they name
    /// the gang (a replayed attempt's gangs are new ones).
    pub epoch: u64,
    pub gang: u32,
    /// This member, and the gang's size.
    pub member: u32,
    pub members: u32,
    /// The trainer slot of each member, in member order: where its exchange goes.
    pub ranks: Vec<u32>,
}

/// One unit of work handed to a trainer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MicroBatch {
    /// Step (= parameter version) this micro-batch belongs to.
    pub step: u64,
    /// Index of the micro-batch within its minibatch's plan.
    pub id: u32,
    pub samples: Vec<SampleMeta>,
    /// Sum of the samples' tokens.
    pub tokens: u64,
    /// Estimated cost (cost model units).
    pub cost: f64,
    pub weighting: LossWeighting,
    /// This trainer's pieces of split samples, computed after `samples` in this order (gangs
    /// ascending, the same order on every member, so no two gangs wait on each other) with each
    /// gang's other members at the same time; never stolen. One piece on demand; several in a
    /// context-parallel collective round ([`crate::split::plan_cp`]).
    #[serde(default)]
    pub pieces: Vec<Piece>,
}

/// What a micro-batch's compute returns.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct ComputeOutput {
    /// Sum of the samples' losses (see the module docs).
    pub loss_sum: f64,
}
