//! I2 exactly once: a trainer that fails mid-minibatch has its minibatch discarded at every owner
//! and replayed; the result equals a failure-free run, and writes from the failed attempt (landed,
//! late or duplicated) never count.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use odc::transport::Dtype;
use odc::{
    async_trait, Compute, ComputeOutput, DispatchMode, FailurePolicy, Job, LossWeighting,
    MicroBatch, OptimizerConfig, Precision, SampleMeta, TrainerContext, UnitSpec,
};

use crate::model::{minibatches, reference_train, Hooks};
use crate::params::max_abs_diff;
use crate::{adamw, model_job, within};

/// Train every minibatch (each step must survive the injected failure); per-step stats and the
/// final parameters. Checks that the failure really happened.
async fn run_through_failure(
    mut job: Job,
    data: &[Vec<SampleMeta>],
    hooks: &Hooks,
) -> (Vec<odc::StepStats>, Vec<Vec<f32>>) {
    let stats = within(60, async {
        let mut out = Vec::new();
        for mb in data {
            out.push(
                job.step_with(mb.clone())
                    .await
                    .expect("step survives the failure"),
            );
        }
        out
    })
    .await;
    let params = job.parameters().await.unwrap();
    job.shutdown().await;
    assert!(
        hooks.panicked.load(Ordering::SeqCst),
        "the failure was injected"
    );
    (stats, params)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i2_trainer_panic_is_replayed_and_matches_failure_free_run() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        for dispatch in [DispatchMode::Dynamic, DispatchMode::Static] {
            let data = minibatches(9, 5, 10, 30);
            let hooks = Arc::new(Hooks {
                panic_at: Some((1, 2)),
                ..Hooks::default()
            });
            let job = model_job(4, 3, dispatch, Precision::F32, hooks.clone())
                .build()
                .unwrap();
            let (stats, got) = run_through_failure(job, &data, &hooks).await;
            assert_eq!(
                stats[2].replays, 1,
                "{dispatch:?}: step 2 was replayed once"
            );
            assert!(stats
                .iter()
                .enumerate()
                .all(|(i, s)| i == 2 || s.replays == 0));
            let want = reference_train(&data, adamw(), Dtype::F32, None);
            let diff = max_abs_diff(&got, &want);
            assert!(diff <= 1e-6, "{dispatch:?}: max |Δ| = {diff}");
        }
    })
    .await
}

/// Each sample pushes 1.0 at its own position; with SGD(lr = 1), sample weighting and 8 samples,
/// a sample counted k times moves its parameter by exactly -k/8 (all values exact in binary).
struct OneHot {
    fail: Arc<AtomicBool>,
    trainer: u32,
    wait_ack: bool,
}

#[async_trait]
impl Compute for OneHot {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        mb: &MicroBatch,
    ) -> odc::Result<ComputeOutput> {
        let _ = ctx.gather(0).await?;
        let mut grad = vec![0f32; 8];
        for s in &mb.samples {
            grad[s.index as usize] += 1.0;
        }
        let ticket = ctx.push_grad(0, &grad)?;
        if self.trainer == 0 && self.fail.swap(false, Ordering::SeqCst) {
            // Either the push has landed (then it must be discarded) or it is still in flight (then
            // it lands before the discard or is refused as late).
            if self.wait_ack {
                ticket.wait().await?;
            }
            panic!("injected failure after pushing");
        }
        Ok(ComputeOutput::default())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i2_every_sample_counts_exactly_once_despite_failure() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        let respawn = FailurePolicy::Respawn { max_respawns: 1 };
        for (policy, wait_ack) in [
            (respawn, true),
            (respawn, false),
            (FailurePolicy::Drop, true),
        ] {
            let fail = Arc::new(AtomicBool::new(true));
            let f = fail.clone();
            let mut job = Job::builder()
                .unit(UnitSpec::constant("counts", 8, 0.0))
                .trainers(3)
                .servers(3)
                .optimizer(OptimizerConfig::Sgd {
                    lr: 1.0,
                    momentum: 0.0,
                    weight_decay: 0.0,
                })
                .pull_precision(Precision::F32)
                .loss_weighting(LossWeighting::Samples)
                .token_budget(2)
                .failure_policy(policy)
                .compute(move |trainer| {
                    Box::new(OneHot {
                        fail: f.clone(),
                        trainer,
                        wait_ack,
                    }) as Box<dyn Compute>
                })
                .build()
                .unwrap();
            let samples: Vec<SampleMeta> = (0..8).map(|i| SampleMeta::new(i, 1)).collect();
            let stats = within(30, job.step_with(samples)).await.expect("step");
            assert!(!fail.load(Ordering::SeqCst), "the failure was injected");
            assert_eq!(stats.replays, 1);
            let params = job.parameters().await.unwrap();
            job.shutdown().await;
            assert_eq!(
                params[0],
                vec![-0.125f32; 8],
                "{policy:?} wait_ack={wait_ack}: each sample exactly once"
            );
        }
    })
    .await
}

/// Collective mode: the failed trainer's peers are blocked in ring barriers; discarding the
/// attempt aborts them, the respawned trainer joins the replay, and the result still matches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i2_collective_mode_failure_aborts_peers_and_replays() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        let data = minibatches(21, 4, 12, 30);
        let hooks = Arc::new(Hooks {
            panic_at: Some((2, 1)),
            ..Hooks::default()
        });
        let job = model_job(4, 3, DispatchMode::Static, Precision::F32, hooks.clone())
            .communication(odc::Communication::Collective)
            .build()
            .unwrap();
        let (stats, got) = run_through_failure(job, &data, &hooks).await;
        assert_eq!(stats[1].replays, 1);
        let want = reference_train(&data, adamw(), Dtype::F32, None);
        assert!(max_abs_diff(&got, &want) <= 1e-6);
    })
    .await
}
