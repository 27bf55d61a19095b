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

/// What a reader outside the trainers (RL's sampler) gets from `Job::published_units`: every
/// unit as the trainers read it at the step's version — the masters themselves under fp32 pulls,
/// the masters rounded to bf16 under bf16 pulls — before the first step and after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i1_published_units_are_what_the_trainers_read_at_the_steps_version() {
    crate::within(180, async {
        let data = minibatches(3, 4, 8, 20);
        for (precision, dtype) in [(Precision::F32, Dtype::F32), (Precision::Bf16, Dtype::Bf16)] {
            let mut job = model_job(2, 3, DispatchMode::Dynamic, precision, Arc::default())
                .build()
                .unwrap();
            let mut first = None;
            for step in 0..=data.len() {
                let masters = job.parameters().await.expect("parameters");
                first.get_or_insert_with(|| masters.clone());
                let published = job.published_units().await.expect("published units");
                assert_eq!(published.len(), masters.len(), "{precision:?} step {step}");
                for (unit, (got, master)) in published.iter().zip(&masters).enumerate() {
                    let want = odc::transport::codec::decode(
                        dtype,
                        &odc::transport::codec::encode(dtype, master),
                    )
                    .unwrap();
                    assert_eq!(got, &want, "{precision:?} step {step} unit {unit}");
                }
                if let Some(mb) = data.get(step) {
                    job.step_with(mb.clone()).await.expect("step");
                }
            }
            // The last read is of the trained values, not the initial ones.
            let last = job.published_units().await.unwrap();
            assert_ne!(last[0][..4], first.unwrap()[0][..4], "{precision:?}");
            job.shutdown().await;
        }
    })
    .await
}
