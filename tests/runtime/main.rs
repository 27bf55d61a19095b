//! Runtime integration tests, one module per invariant of docs/design.md plus bad input, non-finite
//! gradients and frozen units.
//! Every async test runs under a timeout.

mod bad_input;
mod bounded_memory;
mod consistency;
mod equivalence;
mod exactly_once;
mod forged;
mod frozen;
mod liveness;
mod model;
mod no_inner_barrier;
mod non_finite;
/// Comparing two parameter sets.
#[path = "../common/params.rs"]
mod params;
mod ring;
mod sharded_checkpoint;
mod straggler;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use odc::{DispatchMode, Job, JobBuilder, OptimizerConfig, Precision, SampleMeta};

/// Run `f` with a timeout; a hung runtime fails the test instead of hanging CI.
pub async fn within<T>(secs: u64, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("test timed out")
}

/// A job of the test model with the given topology.
pub fn model_job(
    trainers: usize,
    servers: usize,
    dispatch: DispatchMode,
    precision: Precision,
    hooks: Arc<model::Hooks>,
) -> JobBuilder {
    Job::builder()
        .units(model::units())
        .trainers(trainers)
        .servers(servers)
        .dispatch(dispatch)
        .pull_precision(precision)
        .optimizer(adamw())
        .token_budget(64)
        .chunk_elems(7)
        .compute(model::factory(hooks))
}

pub fn adamw() -> OptimizerConfig {
    OptimizerConfig::AdamW {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    }
}

/// Train `job` on `minibatches`, returning the final parameters.
pub async fn train(mut job: Job, minibatches: &[Vec<SampleMeta>]) -> Vec<Vec<f32>> {
    for mb in minibatches {
        job.step_with(mb.clone()).await.expect("step succeeds");
    }
    let params = job.parameters().await.expect("parameters");
    job.shutdown().await;
    params
}
