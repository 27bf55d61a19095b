//! # odc — on-demand communication for imbalanced LLM post-training
//!
//! Parameters, gradients and optimizer state are sharded over **shard servers**; **trainers** pull
//! the units they need on demand and push gradients point to point; a **supervisor** holds the one
//! synchronisation per minibatch and replays a minibatch when a trainer fails. See
//! `docs/design.md`.
//!
//! Users build a [`Job`] with a [`ModelLayout`](layout), a [`Compute`] (one micro-batch of their
//! model against a [`TrainerContext`]) and a [`DataSource`], then call [`Job::run`].
//!
//! ```no_run
//! use odc::{async_trait, Compute, ComputeOutput, Job, MicroBatch, SampleMeta, TrainerContext,
//! UnitSpec};
//!
//! struct Scale;
//! #[async_trait]
//! impl Compute for Scale {
//! async fn run(&mut self, ctx: &mut TrainerContext, mb: &MicroBatch) -> odc::Result<ComputeOutput>
//! {
//!         let w = ctx.gather(0).await?;
//!         let grad: Vec<f32> = w.iter().map(|w| w * mb.tokens as f32).collect();
//!         ctx.push_grad(0, &grad)?;
//!         Ok(ComputeOutput { loss_sum: 0.0 })
//!     }
//! }
//! # async fn demo() -> odc::Result<()> {
//! let mut job = Job::builder()
//!     .unit(UnitSpec::constant("w", 8, 1.0))
//!     .trainers(2)
//!     .servers(2)
//!     .compute(|_trainer| Box::new(Scale) as Box<dyn Compute>)
//!     .data(|step: u64| Ok(vec![SampleMeta::new(step, 100), SampleMeta::new(step + 1, 200)]))
//!     .build()?;
//! let stats = job.run(3).await?;
//! job.shutdown().await;
//! # Ok(()) }
//! ```

#[cfg(feature = "candle")]
pub mod compute;
pub mod data;
pub mod driven;
mod job;
pub mod launch;
pub mod metrics;
pub mod recipe;
pub mod sim;
pub mod trace;

/// Checkpoints on disk (the `odc-checkpoint` crate, below the runtime): a step directory of
/// safetensors files with a verified manifest, sharded by the servers, opened range by range.
pub use odc_checkpoint as checkpoint;
/// The causal transformers odc trains (the `odc-model` crate; feature `candle`). They meet the
/// runtime in [`compute`] only.
#[cfg(feature = "candle")]
pub use odc_model as model;
/// Post-training text: problems, conversations, tokenizers, chat templates, packed samples and
/// rewards (the `odc-text` crate).
pub use odc_text as text;

pub use async_trait::async_trait;
pub use checkpoint::TrainState;
pub use data::DataSource;
pub use job::{Job, JobBuilder, Precision, DEFAULT_STEP_TIMEOUT};
pub use odc_actors::batch::{ComputeOutput, LossWeighting, MicroBatch, Piece, SampleMeta};
pub use odc_actors::layout::{self, ModelLayout, UnitId, UnitInit, UnitSpec};
pub use odc_actors::policy::balancer::CostModel;
pub use odc_actors::policy::clock::{Clock, SystemClock, Timestamp};
pub use odc_actors::policy::dispatch::{Communication, DispatchMode};
pub use odc_actors::policy::recovery::FailurePolicy;
pub use odc_actors::policy::schedule::LrSchedule;
pub use odc_actors::policy::split::{ContextParallel, Link, RingPrice, SplitPolicy};
pub use odc_actors::policy::stats::{
    MicroBatchRecord, Span, SpanKind, StepStats, TrainerStepStats,
};
pub use odc_actors::policy::step::{NonFinite, StepError};
pub use odc_actors::server::optimizer::{OptimizerConfig, OptimizerState};
pub use odc_actors::trainer::{
    blocking, Compute, ComputeFactory, ContextConfig, DeviceGrad, DeviceMemory, DeviceUnit,
    Direction, MicroBatchStats, PushTicket, TrainerContext, UnitValues,
};
pub use odc_actors::{Error, NonFiniteAt, Result};
pub use odc_transport as transport;

/// Test-only helpers shared by the crate's unit tests.
#[cfg(test)]
pub(crate) mod test_util {
    pub(crate) use odc_policy::testing::temp_path;
}

/// The README's Rust examples compile and run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
