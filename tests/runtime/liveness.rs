//! I6 liveness: every wait has a deadline. A hung compute becomes a typed error naming the step,
//! trainer and micro-batch, never a hang; the hung trainer is replaced and the next step works. A
//! step the caller stops waiting for is a typed error too.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use odc::{
    async_trait, Compute, ComputeOutput, Error, Job, MicroBatch, OptimizerConfig, SampleMeta,
    StepError, TrainerContext, UnitSpec,
};

use crate::within;

/// Hangs forever on the first micro-batch any trainer runs (recording which), then behaves.
struct HangOnce {
    trainer: u32,
    hang: Arc<AtomicBool>,
    /// (trainer, micro-batch) that hung.
    hung: Arc<(AtomicUsize, AtomicUsize)>,
}

#[async_trait]
impl Compute for HangOnce {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        mb: &MicroBatch,
    ) -> odc::Result<ComputeOutput> {
        let w = ctx.gather(0).await?;
        if self.hang.swap(false, Ordering::SeqCst) {
            self.hung.0.store(self.trainer as usize, Ordering::SeqCst);
            self.hung.1.store(mb.id as usize, Ordering::SeqCst);
            std::future::pending::<()>().await;
        }
        ctx.push_grad(0, &vec![1.0; w.len()])?;
        Ok(ComputeOutput::default())
    }
}

fn hanging_job(
    micro_batch_timeout: Duration,
    step_timeout: Duration,
) -> (Job, Arc<(AtomicUsize, AtomicUsize)>) {
    let hang = Arc::new(AtomicBool::new(true));
    let hung = Arc::new((AtomicUsize::new(usize::MAX), AtomicUsize::new(usize::MAX)));
    let h = (hang.clone(), hung.clone());
    let job = Job::builder()
        .unit(UnitSpec::constant("w", 16, 0.0))
        .trainers(2)
        .servers(2)
        .optimizer(OptimizerConfig::sgd(0.1))
        .token_budget(10)
        .micro_batch_timeout(micro_batch_timeout)
        .step_timeout(step_timeout)
        .compute(move |trainer| {
            Box::new(HangOnce {
                trainer,
                hang: h.0.clone(),
                hung: h.1.clone(),
            }) as Box<dyn Compute>
        })
        .build()
        .expect("valid job");
    (job, hung)
}

fn minibatch() -> Vec<SampleMeta> {
    (0..6).map(|i| SampleMeta::new(i, 10)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i6_hung_compute_is_a_deadline_error_naming_trainer_and_micro_batch() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        let (mut job, hung) = hanging_job(Duration::from_millis(500), Duration::from_secs(60));
        let err = within(30, job.step_with(minibatch()))
            .await
            .expect_err("the hung micro-batch fails the step");
        let (trainer, micro_batch) = (hung.0.load(Ordering::SeqCst), hung.1.load(Ordering::SeqCst));
        match &err {
            Error::Step(StepError::Deadline {
                what,
                step: 0,
                trainer: Some(t),
                micro_batch: Some(m),
                after_ms,
            }) if what == "micro-batch"
                && *t as usize == trainer
                && *m as usize == micro_batch
                && *after_ms >= 500 => {}
            other => panic!("expected a micro-batch deadline on trainer {trainer}, micro-batch {micro_batch}: {other}"),
        }
        eprintln!("{err}");
        // The hung trainer was killed and respawned: the next step works, on every trainer.
        let stats = within(30, job.step_with(minibatch()))
            .await
            .expect("the next step works");
        assert_eq!(stats.step, 0, "the failed step applied nothing");
        assert_eq!(stats.replays, 0);
        let params = within(30, job.parameters()).await.expect("parameters");
        // SGD(0.1) on a gradient of 1 per micro-batch summed over 6, divided by 60 tokens: one
        // step.
        let want = -0.1 * 6.0 / 60.0;
        assert!(
            params[0].iter().all(|&p| (p - want).abs() < 1e-6),
            "{params:?}"
        );
        job.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i6_a_step_past_its_timeout_is_a_deadline_error() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        let (mut job, _) = hanging_job(Duration::from_secs(3600), Duration::from_millis(300));
        let err = within(30, job.step_with(minibatch()))
            .await
            .expect_err("the caller stops waiting");
        assert!(
            matches!(
                &err,
                Error::Step(StepError::Deadline {
                    what,
                    step: 0,
                    trainer: None,
                    micro_batch: None,
                    after_ms: 300
                }) if what == "step"
            ),
            "{err}"
        );
        within(30, job.shutdown()).await;
    })
    .await
}
