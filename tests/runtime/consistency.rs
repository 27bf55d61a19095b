//! I1 consistency: during step v every read returns exactly version v, also for a trainer that
//! reads late, while every other trainer already waits at the barrier.

use std::sync::Arc;
use std::time::Duration;

use odc::transport::Dtype;
use odc::{DispatchMode, Precision, StepError};

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
            // Parameters of version `step` are the reference after `step` minibatches; version
            // step+1 differs from them by about the learning rate.
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
/// the masters rounded to bf16 under bf16 pulls — before the first step and after each; and a
/// served copy of the initial units (RL's reference), read the same way, never changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i1_published_units_are_what_the_trainers_read_at_the_steps_version() {
    crate::within(180, async {
        let data = minibatches(3, 4, 8, 20);
        let model = crate::model::units();
        let n = model.len() as u32;
        for (precision, dtype) in [(Precision::F32, Dtype::F32), (Precision::Bf16, Dtype::Bf16)] {
            let mut job = model_job(2, 3, DispatchMode::Dynamic, precision, Arc::default());
            for unit in served_copies() {
                job = job.unit(unit);
            }
            let mut job = job.build().unwrap();
            assert_eq!(job.model_units(), model.len());
            let rounded = |values: &[f32]| {
                odc::transport::codec::decode(dtype, &odc::transport::codec::encode(dtype, values))
                    .unwrap()
            };
            let mut first = None;
            for step in 0..=data.len() {
                let masters = job.parameters().await.expect("parameters");
                assert_eq!(
                    masters.len(),
                    model.len(),
                    "served units are not parameters"
                );
                first.get_or_insert_with(|| masters.clone());
                let published = job.published_units(0..n).await.expect("published units");
                for (unit, (got, master)) in published.iter().zip(&masters).enumerate() {
                    assert_eq!(
                        got,
                        &rounded(master),
                        "{precision:?} step {step} unit {unit}"
                    );
                }
                let served = job.published_units(n..2 * n).await.expect("served units");
                for (unit, (got, initial)) in served.iter().zip(first.as_ref().unwrap()).enumerate()
                {
                    assert_eq!(
                        got,
                        &rounded(initial),
                        "{precision:?} step {step} served {unit}"
                    );
                }
                if let Some(mb) = data.get(step) {
                    job.step_with(mb.clone()).await.expect("step");
                }
            }
            // The last read is of the trained values, not the initial ones.
            let last = job.published_units(0..1).await.unwrap();
            assert_ne!(last[0][..4], first.unwrap()[0][..4], "{precision:?}");
            let beyond = job.published_units(0..2 * n + 1).await.unwrap_err();
            assert!(beyond.to_string().contains("unit"), "{beyond}");
            job.shutdown().await;
        }
    })
    .await
}

/// A served, frozen copy of each of the test model's units, named `reference.<name>`.
fn served_copies() -> Vec<odc::UnitSpec> {
    crate::model::units()
        .into_iter()
        .map(|u| {
            odc::UnitSpec {
                name: format!("reference.{}", u.name),
                ..u
            }
            .served()
        })
        .collect()
}

/// Served units stay out of a checkpoint: the job's train state and its checkpoint hold the
/// model's units only, and a job resumed from it (with the served units again) continues with
/// the same parameters and serves the same copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_units_stay_out_of_checkpoints_and_come_back_on_resume() {
    crate::within(180, async {
        let data = minibatches(5, 2, 8, 20);
        let n = crate::model::units().len();
        let with_served =
            |job: odc::JobBuilder| served_copies().into_iter().fold(job, odc::JobBuilder::unit);
        let job = || model_job(2, 3, DispatchMode::Static, Precision::F32, Arc::default());
        let mut trained = with_served(job()).build().unwrap();
        for mb in &data {
            trained.step_with(mb.clone()).await.expect("step");
        }
        let state = trained.train_state().await.expect("train state");
        assert_eq!(state.params.len(), n, "served units are not train state");
        let names: Vec<(String, usize)> = crate::model::units()
            .iter()
            .map(|u| (u.name.clone(), u.len))
            .collect();
        let map = odc::checkpoint::TensorMap::flat(&names).expect("tensor map");
        let dir = std::env::temp_dir().join(format!("odc-served-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let step = trained
            .save_checkpoint(&dir, &map, &serde_json::json!({}))
            .await
            .expect("checkpoint");
        let served = trained
            .published_units(n as u32..2 * n as u32)
            .await
            .unwrap();
        trained.shutdown().await;
        let opened = odc::checkpoint::open(&step, &map).expect("opens with the model's map");
        let mut resumed = with_served(job()).resume_from(opened).build().unwrap();
        assert_eq!(resumed.parameters().await.unwrap(), state.params);
        assert_eq!(
            resumed
                .published_units(n as u32..2 * n as u32)
                .await
                .unwrap(),
            served
        );
        resumed.shutdown().await;
        let _ = std::fs::remove_dir_all(&dir);
    })
    .await
}

/// The published copies are read between steps only: while a step still runs (its caller gave up
/// at the step timeout), a read is refused with `Busy` rather than mixing two versions; once the
/// step ended, the read returns the new version's values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_units_are_refused_while_a_step_runs() {
    crate::within(120, async {
        let data = minibatches(1, 4, 8, 20);
        let hooks = Arc::new(Hooks {
            delay: Some((0, Duration::from_millis(1500))),
            ..Hooks::default()
        });
        let mut job = model_job(2, 2, DispatchMode::Static, Precision::F32, hooks)
            .step_timeout(Duration::from_millis(300))
            .build()
            .unwrap();
        let n = crate::model::units().len() as u32;
        let before = job.published_units(0..n).await.expect("between steps");
        let late = job.step_with(data[0].clone()).await.unwrap_err();
        assert!(late.to_string().contains("deadline"), "{late}");
        let busy = job.published_units(0..n).await.unwrap_err();
        assert!(matches!(busy, odc::Error::Step(StepError::Busy)), "{busy}");
        // Once the step is over (the trainer's delay has passed), the new version reads.
        let after = loop {
            match job.published_units(0..n).await {
                Ok(values) => break values,
                Err(odc::Error::Step(StepError::Busy)) => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(e) => panic!("{e}"),
            }
        };
        assert_ne!(before[0][..4], after[0][..4], "the step's update is read");
        job.shutdown().await;
    })
    .await
}
