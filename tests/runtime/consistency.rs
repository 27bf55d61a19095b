//! I1 consistency: during step v every read returns exactly version v, also for a trainer that reads
//! late, while every other trainer already waits at the barrier.

use std::sync::Arc;
use std::time::Duration;

use odc::transport::Dtype;
use odc::{DispatchMode, Precision};

use crate::model::{minibatches, reference_train, Hooks};
use crate::{adamw, model_job, within};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i1_late_reader_sees_the_step_version_not_the_next() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        let data = minibatches(5, 4, 8, 20);
        let hooks = Arc::new(Hooks {
            delay: Some((0, Duration::from_millis(120))),
            ..Hooks::default()
        });
        let mut job = model_job(4, 3, DispatchMode::Dynamic, Precision::F32, hooks.clone())
            .token_budget(20)
            .build()
            .unwrap();
        within(60, async {
            for mb in &data {
                let stats = job.step_with(mb.clone()).await.expect("step");
                // The delayed trainer's micro-batch is the last to finish: its reads happened while
                // the others were idle, just before the barrier.
                let last = stats
                    .micro_batch_log
                    .iter()
                    .max_by_key(|r| r.finished)
                    .unwrap();
                assert_eq!(last.trainer, 0, "the late reader finishes last");
            }
        })
        .await;
        job.shutdown().await;
        let seen = hooks.seen.lock().unwrap().clone();
        assert!(seen.len() >= data.len() * 2);
        for (step, values) in seen {
            // Parameters of version `step` are the reference after `step` minibatches; version step+1
            // differs from them by about the learning rate.
            let want = &reference_train(&data[..step as usize], adamw(), Dtype::F32, None)[0][..4];
            let next =
                &reference_train(&data[..step as usize + 1], adamw(), Dtype::F32, None)[0][..4];
            for ((g, w), n) in values.iter().zip(want).zip(next) {
                assert!(
                    (g - w).abs() <= 1e-6,
                    "step {step}: read {g}, version {step} is {w}"
                );
                assert!(
                    (w - n).abs() > 1e-4,
                    "versions {step} and {} must differ",
                    step + 1
                );
            }
        }
    })
    .await
}
