//! I4 no inner barrier: in on-demand mode no trainer waits on another before the barrier.
//!
//! Observed without clocks or sleeps: trainer 0 holds its first micro-batch at a gate that opens
//! only once the other trainers have completed micro-batches of the same step. In on-demand mode
//! the gate opens — nobody waits on trainer 0. The negative control runs the same check in
//! collective mode, where every all-gather needs trainer 0: the others cannot complete anything,
//! so the gate can only give up at its timeout. The check therefore can fail, and does when the
//! paradigm has an inner barrier.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use odc::{
    async_trait, Communication, Compute, ComputeOutput, DispatchMode, MicroBatch, Precision,
    TrainerContext,
};
use tokio::sync::Notify;

use crate::model::{minibatches, Hooks, MlpCompute};
use crate::{model_job, within};

/// Micro-batches the other trainers must complete while trainer 0 is held.
const NEEDED: usize = 3;

#[derive(Default)]
struct Gate {
    /// Micro-batches other trainers completed while trainer 0 was held.
    others_done: AtomicUsize,
    progress: Notify,
    held: AtomicBool,
    /// Set when the gate gave up instead of seeing the others progress.
    timed_out: AtomicBool,
    /// Micro-batches the others had completed when the gate gave up.
    done_at_timeout: AtomicUsize,
}

struct Gated {
    model: MlpCompute,
    gate: Arc<Gate>,
    timeout: Duration,
}

#[async_trait]
impl Compute for Gated {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        mb: &MicroBatch,
    ) -> odc::Result<ComputeOutput> {
        if self.model.trainer == 0 && !self.gate.held.swap(true, Ordering::SeqCst) {
            let progressed = async {
                loop {
                    let notified = self.gate.progress.notified();
                    if self.gate.others_done.load(Ordering::SeqCst) >= NEEDED {
                        return;
                    }
                    notified.await;
                }
            };
            if tokio::time::timeout(self.timeout, progressed)
                .await
                .is_err()
            {
                self.gate.timed_out.store(true, Ordering::SeqCst);
                let done = self.gate.others_done.load(Ordering::SeqCst);
                self.gate.done_at_timeout.store(done, Ordering::SeqCst);
            }
        }
        let out = self.model.run(ctx, mb).await?;
        if self.model.trainer != 0 {
            self.gate.others_done.fetch_add(1, Ordering::SeqCst);
            self.gate.progress.notify_waiters();
        }
        Ok(out)
    }
}

/// Run one step with trainer 0 held at the gate; the gate afterwards.
async fn held_step(
    communication: Communication,
    dispatch: DispatchMode,
    timeout: Duration,
) -> Arc<Gate> {
    let gate = Arc::new(Gate::default());
    let hooks = Arc::new(Hooks::default());
    let g = gate.clone();
    let mut job = model_job(4, 2, dispatch, Precision::F32, hooks.clone())
        .communication(communication)
        .token_budget(16)
        .compute(move |trainer| {
            Box::new(Gated {
                model: MlpCompute {
                    trainer,
                    hooks: hooks.clone(),
                },
                gate: g.clone(),
                timeout,
            }) as Box<dyn Compute>
        })
        .build()
        .expect("valid job");
    let data = minibatches(13, 1, 40, 16);
    let stats = within(120, job.step_with(data[0].clone()))
        .await
        .expect("the step completes");
    assert!(
        stats.micro_batches >= 8,
        "enough micro-batches that the others have work while trainer 0 is held"
    );
    job.shutdown().await;
    gate
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i4_on_demand_others_progress_while_one_trainer_is_held() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        for dispatch in [DispatchMode::Static, DispatchMode::Dynamic] {
            // The timeout only bounds a broken run; a correct one never reaches it.
            let gate = held_step(Communication::OnDemand, dispatch, Duration::from_secs(60)).await;
            assert!(
                !gate.timed_out.load(Ordering::SeqCst),
                "{dispatch:?}: the others stopped while trainer 0 was held (an inner barrier)"
            );
            assert!(gate.others_done.load(Ordering::SeqCst) >= NEEDED);
        }
    })
    .await
}

/// Negative control: the same check fails under collective mode, whose every all-gather waits
/// for the held trainer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i4_negative_control_collective_mode_stalls_behind_the_held_trainer() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        let gate = held_step(
            Communication::Collective,
            DispatchMode::Static,
            Duration::from_millis(500),
        )
        .await;
        assert!(
            gate.timed_out.load(Ordering::SeqCst),
            "collective mode let the others progress without trainer 0"
        );
        assert_eq!(
            gate.done_at_timeout.load(Ordering::SeqCst),
            0,
            "no other trainer completed anything while trainer 0 was held"
        );
    })
    .await
}
