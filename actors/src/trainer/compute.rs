//! The trainer-side API a user implements: [`Compute`] runs one micro-batch against a
//! [`TrainerContext`]. The loss convention is in [`crate::batch`].

use std::sync::Arc;

use super::TrainerContext;
use crate::batch::{ComputeOutput, MicroBatch};
use crate::error::Result;

/// User compute for one micro-batch: gather units, compute, push gradients.
///
/// The runtime waits for every gradient push to be acknowledged after `run` returns, and drops
/// prefetched units, so an implementation may leave pushes in flight. Long synchronous work (a
/// layer's forward or backward on the CPU) belongs in [`blocking`]: otherwise the prefetches and
/// pushes the context started do not move until `run` next awaits.
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

/// Runs `work`, synchronous compute, so that the trainer's transfers keep moving meanwhile.
///
/// A prefetch or a push is a task the trainer spawned on its worker thread; tokio keeps such a
/// task in that worker's LIFO slot, which no other worker may steal, so a compute that holds the
/// worker for minutes (a 16K-token layer on the CPU) holds its transfers too: they start when it
/// next awaits, and may then find their deadline passed. On a multi-threaded runtime `blocking`
/// hands the worker's queued tasks to another thread first (`tokio::task::block_in_place`);
/// elsewhere (a current-thread runtime, as under the simulated clock, or no runtime) it just runs
/// `work`.
pub fn blocking<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::blocking;

    /// Waits (at most `patience`) inside a synchronous section for a task spawned just before it.
    fn spawned_runs_during(
        patience: Duration,
        section: impl FnOnce(&dyn Fn() -> bool) -> bool,
    ) -> bool {
        let started = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&started);
        tokio::spawn(async move { flag.store(true, Ordering::SeqCst) });
        let wait = move || {
            let until = Instant::now() + patience;
            while Instant::now() < until {
                if started.load(Ordering::SeqCst) {
                    return true;
                }
                std::hint::spin_loop();
            }
            false
        };
        section(&wait)
    }

    /// What the prefetches of a compute rely on: a task spawned before a synchronous section
    /// runs during it when the section is `blocking`, and (the control) not when it is plain.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_task_spawned_before_blocking_work_runs_during_it() {
        let during_blocking = tokio::spawn(async {
            spawned_runs_during(Duration::from_secs(5), |wait| blocking(wait))
        });
        assert!(
            during_blocking.await.expect("task"),
            "blocking: the task never ran"
        );
        let during_plain =
            tokio::spawn(async { spawned_runs_during(Duration::from_millis(500), |wait| wait()) });
        assert!(
            !during_plain.await.expect("task"),
            "control: a plain synchronous section let the LIFO task run (tokio changed?)"
        );
    }

    #[test]
    fn without_a_multi_threaded_runtime_blocking_just_runs() {
        assert_eq!(blocking(|| 7), 7);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        assert_eq!(runtime.block_on(async { blocking(|| 8) }), 8);
    }
}
