//! Non-finite gradients and losses: the attempt is discarded, then the step fails or is skipped.

use super::super::config::NonFinite;
use super::super::decision::Reason;
use super::*;
use crate::schedule::LrSchedule;

/// Start a step of `w` on `samples`, run it to its barrier and answer the reduce with
/// `sum_sq`: the decisions that answer gave.
fn reduce_with(w: &mut World, samples: Vec<SampleMeta>, sum_sq: f64) -> Vec<Decision> {
    w.log.clear();
    let ds = w.m.start(samples, w.now);
    w.apply(ds);
    while !w.log.iter().any(|d| d.command.name() == "reduce") {
        assert!(w.event(), "the step reaches its barrier");
    }
    assert!(matches!(w.pending.pop_front(), Some(Pending::Reduced)));
    let ds = w.m.on_reduced(Ok(sum_sq), w.now);
    w.apply(ds.clone());
    ds
}

/// After a failed or skipped step at global step `global` (version 0): the next step reads
/// version 0, applies the schedule's factor of `global` and is named `global`.
fn next_step_trains_at(w: &mut World, global: u64) {
    let stats = w.step(samples(4, 100)).expect("finishes").expect("ok");
    assert_eq!(stats.step, global);
    assert_eq!(stats.skipped, None);
    let scale = w.log.iter().find_map(|d| match d.command {
        Command::Apply { lr_scale, .. } => Some(lr_scale),
        _ => None,
    });
    assert_eq!(scale, Some(w.m.config().schedule.factor(global)));
    assert!(assigned(&w.log)
        .iter()
        .all(|(_, a)| a.micro_batch.step == 0));
    assert_eq!(w.m.version(), 1);
}

fn warmup() -> LrSchedule {
    LrSchedule::WarmupCosine {
        warmup_steps: 4,
        total_steps: 8,
        min_ratio: 0.0,
    }
}

/// A NaN or infinite sum of squares at the barrier (NaN used to become clip factor 1 through
/// `max(0.0)`, inf a clip factor of 0 and NaN through inf × 0): never an `Apply`; the attempt
/// is discarded at every owner, then the step fails (`Error`) or is skipped (`SkipStep`,
/// counting as a step of the job but not as an optimizer step).
#[test]
fn a_non_finite_global_norm_discards_the_step_then_fails_or_skips_it() {
    for policy in [NonFinite::Error, NonFinite::SkipStep] {
        for (sum_sq, shown) in [(f64::NAN, "NaN"), (f64::INFINITY, "inf")] {
            let cfg = StepConfig {
                non_finite: policy,
                schedule: warmup(),
                ..config()
            };
            let mut w = World::new(cfg, &[1.0, 1.0]);
            let ds = reduce_with(&mut w, samples(4, 100), sum_sq);
            let reason = Reason::NonFiniteGradNorm {
                value: shown.into(),
                policy,
            };
            assert_eq!(names(&ds), ["discard"], "{policy:?} {shown}");
            assert_eq!(ds[0].reason, reason);
            assert!(matches!(ds[0].command, Command::Discard { next_epoch: 2 }));
            let result = w.finish().expect("finishes");
            assert!(!w.log.iter().any(|d| d.command.name() == "apply"));
            assert_eq!(w.log.last().map(|d| &d.reason), Some(&reason));
            assert_eq!(w.m.version(), 0, "nothing published");
            let named = |at: &NonFiniteAt| {
                at.what == "global gradient norm"
                    && at.value == shown
                    && (at.step, at.trainer, at.micro_batch, at.unit) == (0, None, None, None)
            };
            match (policy, result) {
                (NonFinite::Error, Err(e)) => {
                    assert!(e.non_finite().is_some_and(named), "{e:?}");
                    assert_eq!(w.m.global_step(), 0, "a failed step is not a step");
                    next_step_trains_at(&mut w, 0);
                }
                (NonFinite::SkipStep, Ok(stats)) => {
                    assert!(stats.skipped.as_deref().is_some_and(named), "{stats:?}");
                    assert_eq!((stats.step, stats.micro_batches), (0, 4));
                    assert!(sum_sq.is_nan() == stats.grad_norm.is_nan());
                    assert!(sum_sq.is_infinite() == stats.grad_norm.is_infinite());
                    assert_eq!(w.m.global_step(), 1, "a skipped step is a step of the job");
                    next_step_trains_at(&mut w, 1);
                }
                (p, r) => panic!("{p:?}: {r:?}"),
            }
        }
    }
}

/// A trainer's report of a non-finite gradient (or loss): the attempt is discarded at every
/// owner (what other trainers pushed of it too), then the step fails or is skipped with the
/// error named by the report's trainer and micro-batch and the global step.
#[test]
fn a_non_finite_micro_batch_discards_the_step_then_fails_or_skips_it() {
    for policy in [NonFinite::Error, NonFinite::SkipStep] {
        let cfg = StepConfig {
            non_finite: policy,
            schedule: warmup(),
            ..config()
        };
        let mut w = World::new(cfg, &[1.0, 1.0]);
        let ds = w.m.start(samples(4, 100), w.now);
        w.apply(ds);
        let Some((a, since, end)) = w.running[1].take() else {
            panic!("trainer 1 runs a micro-batch");
        };
        let indices: Vec<u64> = a.micro_batch.samples.iter().map(|s| s.index).collect();
        let mut report = ok_report(1, &a, since, end);
        report.result = Err(TestError::non_finite_at(NonFiniteAt {
            what: "gradient".into(),
            step: 0,
            // The report's own trainer and micro-batch are what count.
            trainer: Some(7),
            micro_batch: None,
            samples: indices.clone(),
            unit: Some(2),
            element: Some(5),
            value: "NaN".into(),
        }));
        w.now = end;
        let ds = w.m.on_report(report, end);
        let reason = Reason::NonFiniteMicroBatch {
            slot: 1,
            micro_batch: a.micro_batch.id,
            policy,
        };
        assert_eq!(names(&ds), ["discard"], "{policy:?}");
        assert_eq!(ds[0].reason, reason);
        w.apply(ds);
        let result = w.finish().expect("finishes");
        assert!(!w.log.iter().any(|d| d.command.name() == "apply"));
        assert_eq!(w.log.last().map(|d| &d.reason), Some(&reason));
        let want = NonFiniteAt {
            what: "gradient".into(),
            step: 0,
            trainer: Some(1),
            micro_batch: Some(a.micro_batch.id),
            samples: indices,
            unit: Some(2),
            element: Some(5),
            value: "NaN".into(),
        };
        match (policy, result) {
            (NonFinite::Error, Err(e)) => {
                assert_eq!(e, TestError::non_finite_at(want));
                next_step_trains_at(&mut w, 0);
            }
            (NonFinite::SkipStep, Ok(stats)) => {
                assert_eq!(stats.skipped, Some(Box::new(want)));
                assert!(stats.grad_norm.is_nan(), "no norm: no barrier");
                next_step_trains_at(&mut w, 1);
            }
            (p, r) => panic!("{p:?}: {r:?}"),
        }
    }
}
