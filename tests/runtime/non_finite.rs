//! A non-finite gradient never reaches a parameter (docs/design.md "Faults"). A trainer refuses a
//! gradient with a NaN before sending it and fails a micro-batch whose loss is NaN; the barrier
//! finds a sum that overflowed to inf although every trainer's gradient was finite. Then, per
//! `JobBuilder::on_non_finite`:
//! - `Error`: the step fails with `Error::Step(StepError::NonFinite)` naming trainer, micro-batch,
//!   samples and unit; parameters, optimizer moments and the optimizer's step count equal a run
//!   that never took the step's data, and the job goes on;
//! - `SkipStep`: the step is skipped (stats say so), the job goes on, and the final parameters
//!   equal a run without the step's data (AdamW with a constant rate: the optimizer's step count
//!   shows).

use std::sync::Arc;

use odc::transport::Dtype;
use odc::{
    Communication, DispatchMode, Error, Job, NonFinite, NonFiniteAt, Precision, SampleMeta,
    StepError,
};

use crate::model::{minibatches, reference_train, Hooks, Poison};
use crate::params::max_abs_diff;
use crate::{adamw, model_job, within};

/// Minibatches trained; the one at index `BAD` is poisoned.
const STEPS: usize = 6;
const BAD: usize = 3;

fn data() -> Vec<Vec<SampleMeta>> {
    minibatches(31, STEPS, 8, 20)
}

/// Hooks poisoning every sample of minibatch `BAD` (dataset indices are consecutive).
fn hooks(poison: Poison, data: &[Vec<SampleMeta>]) -> Arc<Hooks> {
    let indices: Vec<u64> = data[BAD].iter().map(|s| s.index).collect();
    let lo = indices.iter().copied().min().unwrap_or(0);
    let hi = indices.iter().copied().max().unwrap_or(0);
    assert_eq!((hi - lo + 1) as usize, indices.len(), "consecutive indices");
    Arc::new(Hooks {
        poison: Some((poison, lo..hi + 1)),
        ..Hooks::default()
    })
}

fn job(communication: Communication, policy: NonFinite, hooks: Arc<Hooks>) -> Job {
    let trainers = match communication {
        Communication::OnDemand => 3,
        Communication::Collective => 2,
    };
    model_job(trainers, 2, DispatchMode::Dynamic, Precision::F32, hooks)
        .communication(communication)
        .on_non_finite(policy)
        .build()
        .expect("valid job")
}

/// The single-process loop's parameters after the minibatches of `data` at `steps`.
fn reference(data: &[Vec<SampleMeta>], steps: &[usize]) -> Vec<Vec<f32>> {
    let kept: Vec<Vec<SampleMeta>> = steps.iter().map(|&i| data[i].clone()).collect();
    reference_train(&kept, adamw(), Dtype::F32, None)
}

/// `error` names what `poison` did where the hooks recorded it, at global step `BAD`.
fn check_named(error: &Error, poison: Poison, hooks: &Hooks) {
    let poisoned = hooks.poisoned.lock().unwrap().clone();
    let Error::Step(StepError::NonFinite(at)) = error else {
        panic!("not a non-finite error: {error:?}");
    };
    let NonFiniteAt {
        what,
        step,
        trainer,
        micro_batch,
        samples,
        unit,
        element,
        value,
    } = at.as_ref();
    assert_eq!(*step, BAD as u64, "{error}");
    if poison == Poison::GradMax {
        // Every trainer's gradient was finite: only the barrier saw the sum.
        assert!(poisoned.len() >= 2, "{poisoned:?}");
        assert_eq!(what, "global gradient norm");
        assert_eq!((trainer, micro_batch, unit), (&None, &None, &None));
        assert_eq!(value, "inf");
        return;
    }
    assert_eq!(poisoned.len(), 1, "poisoned once: {poisoned:?}");
    let (t, mb, s) = &poisoned[0];
    assert_eq!(
        (trainer, micro_batch, samples),
        (&Some(*t), &Some(*mb), s),
        "{error}"
    );
    assert_eq!(value, "NaN");
    match poison {
        Poison::GradNan {
            unit: u,
            element: e,
        } => {
            assert_eq!(what, "gradient");
            assert_eq!((unit, element), (&Some(u), &Some(e as u64)));
        }
        _ => {
            assert_eq!(what, "loss");
            assert_eq!((unit, element), (&None, &None));
        }
    }
    let shown = error.to_string();
    for part in [format!("trainer {t}"), format!("micro-batch {mb}")] {
        assert!(shown.contains(&part), "{shown} names {part}");
    }
}

/// `job`'s parameters equal the single-process loop's after the minibatches of `data` at `steps`,
/// within 1e-6 (the case: `poison` over `communication`).
async fn check_parameters(
    job: &mut Job,
    data: &[Vec<SampleMeta>],
    steps: &[usize],
    poison: Poison,
    communication: Communication,
) {
    let got = job.parameters().await.expect("parameters");
    let diff = max_abs_diff(&got, &reference(data, steps));
    assert!(
        diff <= 1e-6,
        "{poison:?} {communication:?}: max |Δ| = {diff}"
    );
}

/// Every unit's optimizer has taken `steps` steps.
async fn check_optimizer_steps(job: &mut Job, steps: u64) {
    let state = job.train_state().await.expect("train state");
    let counts: Vec<u64> = state.optimizer.iter().map(|o| o.steps).collect();
    assert_eq!(counts, vec![steps; 3]);
}

const CASES: [(Poison, Communication); 4] = [
    (
        Poison::GradNan {
            unit: 1,
            element: 5,
        },
        Communication::OnDemand,
    ),
    (Poison::LossNan, Communication::OnDemand),
    (Poison::GradMax, Communication::OnDemand),
    (
        Poison::GradNan {
            unit: 0,
            element: 0,
        },
        Communication::Collective,
    ),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_finite_error_fails_the_step_naming_it_and_changes_nothing() {
    within(180, async {
        let data = data();
        for (poison, communication) in CASES {
            let hooks = hooks(poison, &data);
            let mut job = job(communication, NonFinite::Error, hooks.clone());
            for mb in &data[..BAD] {
                job.step_with(mb.clone()).await.expect("a clean step");
            }
            let error = job
                .step_with(data[BAD].clone())
                .await
                .expect_err("the poisoned step fails");
            check_named(&error, poison, &hooks);
            // Every parameter finite and equal to a run that never took the step's data.
            check_parameters(&mut job, &data, &[0, 1, 2], poison, communication).await;
            check_optimizer_steps(&mut job, BAD as u64).await;
            assert_eq!(job.steps_done(), BAD as u64, "a failed step is not a step");
            // The job goes on: moments and step count were untouched, so the next step lands
            // where the clean run does.
            let stats = job
                .step_with(data[BAD + 1].clone())
                .await
                .expect("the next step works");
            assert_eq!((stats.step, stats.skipped), (BAD as u64, None));
            check_parameters(&mut job, &data, &[0, 1, 2, 4], poison, communication).await;
            job.shutdown().await;
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_finite_skip_step_discards_the_step_and_goes_on() {
    within(180, async {
        let data = data();
        for (poison, communication) in CASES {
            let hooks = hooks(poison, &data);
            let mut job = job(communication, NonFinite::SkipStep, hooks.clone());
            let mut stats = Vec::new();
            for mb in &data {
                stats.push(job.step_with(mb.clone()).await.expect("no step fails"));
            }
            for (i, s) in stats.iter().enumerate() {
                assert_eq!(
                    s.step, i as u64,
                    "a skipped step counts as a step of the job"
                );
                assert_eq!(s.skipped.is_some(), i == BAD, "step {i}: {:?}", s.skipped);
            }
            let why = stats[BAD].skipped.clone().expect("skipped");
            check_named(&Error::Step(StepError::NonFinite(why)), poison, &hooks);
            if poison == Poison::GradMax {
                assert_eq!(stats[BAD].grad_norm, f64::INFINITY);
            }
            check_parameters(&mut job, &data, &[0, 1, 2, 4, 5], poison, communication).await;
            check_optimizer_steps(&mut job, (STEPS - 1) as u64).await;
            assert_eq!(job.steps_done(), STEPS as u64);
            job.shutdown().await;
        }
    })
    .await
}
