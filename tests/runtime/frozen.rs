//! Frozen units (`UnitSpec::frozen`): pulled, never pushed, reduced or optimised.
//!
//! - After K AdamW steps with weight decay, a frozen unit's parameters are bit-identical to their
//!   initial values, and the trainable units equal the single-process reference that holds the
//!   frozen unit fixed (I3, the equivalence tests' tolerances: fp32 1e-6, bf16 1e-4), in
//!   on-demand and collective mode, 2 trainers × 2 servers; no gradient byte is pushed for it.
//! - Pushing a frozen unit's gradient is `Error::FrozenUnit` naming it, and changes nothing.
//! - The servers keep no optimizer state for it (the train state: 0 steps, no buffers), and a
//!   checkpoint → resume with a frozen unit equals an uninterrupted run; resumed with the unit
//!   trainable, it starts a fresh optimizer state.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use odc::checkpoint::{self, TensorMap};
use odc::layout::UnitOptimizerInit;
use odc::transport::Dtype;
use odc::{Communication, DispatchMode, Error, JobBuilder, Precision};

use crate::model::{self, minibatches, reference_train, reference_train_frozen};
use crate::params::max_abs_diff;
use crate::{adamw, model_job, train, within};

const STEPS: usize = 5;
/// The middle layer: its gradient is still needed below it, and it is not pushed.
const FROZEN: u32 = 1;

fn job(communication: Communication, precision: Precision, hooks: Arc<model::Hooks>) -> JobBuilder {
    model_job(2, 2, DispatchMode::Static, precision, hooks)
        .units(model::units_frozen(&[FROZEN]))
        .communication(communication)
}

fn initial() -> Vec<Vec<f32>> {
    reference_train(&[], adamw(), Dtype::F32, None)
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// The trainable units (every unit but the frozen one) of `params`.
fn trainable(params: &[Vec<f32>]) -> Vec<Vec<f32>> {
    params
        .iter()
        .enumerate()
        .filter(|(u, _)| *u as u32 != FROZEN)
        .map(|(_, p)| p.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_unit_stays_bit_identical_and_the_rest_equals_the_reference() {
    within(180, async {
        let data = minibatches(23, STEPS, 12, 40);
        let initial = initial();
        let trainable_elements: u64 = trainable(&initial).iter().map(|p| p.len() as u64).sum();
        for communication in [Communication::OnDemand, Communication::Collective] {
            for (precision, dtype, tol) in [
                (Precision::F32, Dtype::F32, 1e-6),
                (Precision::Bf16, Dtype::Bf16, 1e-4),
            ] {
                let label = format!("{communication:?} {precision:?}");
                let mut job = job(communication, precision, Arc::default())
                    .build()
                    .expect("valid job");
                let mut pushed = 0u64;
                let mut micro_batches = 0u64;
                for mb in &data {
                    let stats = job.step_with(mb.clone()).await.expect("step succeeds");
                    pushed += stats.trainers.iter().map(|t| t.bytes_pushed).sum::<u64>();
                    micro_batches += u64::from(stats.micro_batches);
                }
                let got = job.parameters().await.expect("parameters");
                let state = job.train_state().await.expect("train state");
                job.shutdown().await;

                assert_eq!(
                    bits(&got[FROZEN as usize]),
                    bits(&initial[FROZEN as usize]),
                    "{label}: the frozen unit is bit-identical to its initial values"
                );
                let want = reference_train_frozen(&data, adamw(), dtype, None, &[FROZEN]);
                let diff = max_abs_diff(&trainable(&got), &trainable(&want));
                assert!(diff <= tol, "{label}: max |Δ| = {diff} > {tol}");
                eprintln!("{label}: trainable units max |Δ| = {diff:e}");
                // Not vacuous: the trainable units moved, and training the frozen unit too
                // would have given other values.
                assert!(max_abs_diff(&trainable(&got), &trainable(&initial)) > 20.0 * tol);
                let unfrozen = reference_train(&data, adamw(), dtype, None);
                assert!(max_abs_diff(&want, &unfrozen) > 20.0 * tol);
                // No optimizer state for it; every other unit stepped K times.
                assert_eq!(
                    state.optimizer[FROZEN as usize],
                    UnitOptimizerInit::default()
                );
                for (u, opt) in state.optimizer.iter().enumerate() {
                    if u as u32 != FROZEN {
                        assert_eq!((opt.steps, opt.buffers.len()), (STEPS as u64, 2));
                    }
                }
                if communication == Communication::OnDemand {
                    // One fp32 gradient of every trainable unit per micro-batch, nothing more.
                    assert_eq!(pushed, micro_batches * 4 * trainable_elements, "{label}");
                }
            }
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushing_a_frozen_unit_is_an_error_naming_it_and_changes_nothing() {
    within(180, async {
        let data = minibatches(29, 2, 8, 30);
        for communication in [Communication::OnDemand, Communication::Collective] {
            let hooks = Arc::new(model::Hooks::default());
            hooks.push_frozen.store(true, Ordering::SeqCst);
            let mut job = job(communication, Precision::F32, hooks.clone())
                .build()
                .expect("valid job");
            let err = job
                .step_with(data[0].clone())
                .await
                .expect_err("pushing a frozen unit fails the step");
            match &err {
                Error::MicroBatch { source, .. } => match source.as_ref() {
                    Error::FrozenUnit { unit, name } => {
                        assert_eq!((*unit, name.as_str()), (FROZEN, "layer1"))
                    }
                    other => panic!("{communication:?}: unexpected {other}"),
                },
                other => panic!("{communication:?}: unexpected {other}"),
            }
            assert!(err.to_string().contains("layer1"), "{err}");
            // Nothing of the failed step was applied; the job keeps running.
            hooks.push_frozen.store(false, Ordering::SeqCst);
            job.step_with(data[1].clone())
                .await
                .expect("a good step after the bad one");
            let got = job.parameters().await.expect("parameters");
            job.shutdown().await;
            let want = reference_train_frozen(&data[1..], adamw(), Dtype::F32, None, &[FROZEN]);
            assert_eq!(
                bits(&got[FROZEN as usize]),
                bits(&initial()[FROZEN as usize])
            );
            let diff = max_abs_diff(&got, &want);
            assert!(diff <= 1e-6, "{communication:?}: max |Δ| = {diff}");
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_resume_with_a_frozen_unit_equals_an_uninterrupted_run() {
    within(180, async {
        let data = minibatches(31, 4, 10, 30);
        let (first, second) = data.split_at(2);
        let build = || {
            job(Communication::OnDemand, Precision::F32, Arc::default())
                .build()
                .expect("valid job")
        };
        let uninterrupted = train(build(), &data).await;

        let mut before = build();
        for mb in first {
            before.step_with(mb.clone()).await.expect("step succeeds");
        }
        let state = before.train_state().await.expect("train state");
        before.shutdown().await;
        assert_eq!(
            state.optimizer[FROZEN as usize],
            UnitOptimizerInit::default()
        );
        // Through the files: the frozen unit has no optimizer tensors.
        let names: Vec<(String, usize)> = model::units()
            .iter()
            .map(|u| (u.name.clone(), u.len))
            .collect();
        let map = TensorMap::flat(&names).expect("tensor map");
        let dir = std::env::temp_dir().join(format!("odc-frozen-resume-{}", std::process::id()));
        let step = checkpoint::save(&dir, &map, &state, &serde_json::Value::Null).expect("save");
        let (loaded, _) = checkpoint::load(&step, &map).expect("load");
        std::fs::remove_dir_all(&dir).expect("clean up");
        assert_eq!(loaded, state, "the checkpoint round-trips exactly");

        // The unit frozen in the checkpoint may train in the next run: a fresh optimizer state.
        let mut unfrozen = model_job(2, 2, DispatchMode::Static, Precision::F32, Arc::default())
            .resume(loaded.clone())
            .build()
            .expect("valid unfrozen job");
        unfrozen
            .step_with(second[0].clone())
            .await
            .expect("the unfrozen unit trains");
        let unfrozen_state = unfrozen.train_state().await.expect("train state");
        unfrozen.shutdown().await;
        assert_eq!(unfrozen_state.optimizer[FROZEN as usize].steps, 1);
        assert_ne!(
            bits(&unfrozen_state.params[FROZEN as usize]),
            bits(&initial()[FROZEN as usize])
        );

        let resumed = job(Communication::OnDemand, Precision::F32, Arc::default())
            .resume(loaded)
            .build()
            .expect("valid resumed job");
        let got = train(resumed, second).await;
        assert_eq!(
            bits(&got[FROZEN as usize]),
            bits(&initial()[FROZEN as usize])
        );
        let diff = max_abs_diff(&got, &uninterrupted);
        assert!(diff <= 1e-6, "resumed vs uninterrupted: max |Δ| = {diff}");
        let want = reference_train_frozen(&data, adamw(), Dtype::F32, None, &[FROZEN]);
        assert!(max_abs_diff(&got, &want) <= 1e-6);
    })
    .await
}
