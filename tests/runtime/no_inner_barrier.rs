//! I4 no inner barrier: with one trainer slowed down, the others keep finishing micro-batches
//! while it works; nothing waits for it before the barrier. Observed from the micro-batch log's
//! timestamps (ordering only, no wall-clock thresholds).

use std::sync::Arc;
use std::time::Duration;

use odc::{DispatchMode, MicroBatchRecord, Precision};

use crate::model::{minibatches, Hooks};
use crate::{model_job, within};

async fn log_with_slow_trainer(dispatch: DispatchMode) -> Vec<MicroBatchRecord> {
    let hooks = Arc::new(Hooks {
        delay: Some((0, Duration::from_millis(150))),
        ..Hooks::default()
    });
    let mut job = model_job(4, 2, dispatch, Precision::Bf16, hooks)
        .token_budget(16)
        .build()
        .unwrap();
    let data = minibatches(13, 1, 40, 16);
    let stats = within(60, job.step_with(data[0].clone())).await.unwrap();
    job.shutdown().await;
    assert!(
        stats.micro_batches >= 8,
        "enough micro-batches to observe overlap"
    );
    stats.micro_batch_log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i4_dynamic_others_finish_while_slow_trainer_works() {
    let log = log_with_slow_trainer(DispatchMode::Dynamic).await;
    let slow: Vec<_> = log.iter().filter(|r| r.trainer == 0).collect();
    let first = slow
        .iter()
        .min_by_key(|r| r.started)
        .expect("slow trainer ran");
    // Others completed micro-batches strictly inside the slow trainer's first micro-batch.
    let inside = log
        .iter()
        .filter(|r| r.trainer != 0 && r.started >= first.started && r.finished <= first.finished)
        .count();
    let others = log.len() - slow.len();
    assert!(
        inside >= 3,
        "only {inside} of {others} micro-batches overlapped the slow one"
    );
    // Dynamic dispatch moved work away from the slow trainer.
    assert!(
        slow.len() < others,
        "slow trainer ran {} of {}",
        slow.len(),
        log.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i4_static_others_do_not_wait_for_slow_trainer() {
    let log = log_with_slow_trainer(DispatchMode::Static).await;
    let slow_end = log
        .iter()
        .filter(|r| r.trainer == 0)
        .map(|r| r.finished)
        .max()
        .unwrap();
    for t in 1..4 {
        let own: Vec<_> = log.iter().filter(|r| r.trainer == t).collect();
        assert!(!own.is_empty(), "trainer {t} had work");
        let end = own.iter().map(|r| r.finished).max().unwrap();
        assert!(
            end < slow_end,
            "trainer {t} finished its list before the slow trainer"
        );
        // Its micro-batches ran back to back: each started no earlier than the previous finished,
        // and none waited for trainer 0's progress (they all ended before trainer 0 ended).
        let mut sorted = own.clone();
        sorted.sort_by_key(|r| r.started);
        for w in sorted.windows(2) {
            assert!(w[1].started >= w[0].finished);
        }
    }
}
