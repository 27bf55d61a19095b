//! Dynamic dispatch: stealing from slow trainers, filled micro-batches.

use super::super::decision::Reason;
use super::*;

#[test]
fn dynamic_dispatch_steals_from_a_slow_trainer_and_not_between_equals() {
    let dynamic = StepConfig {
        dispatch: DispatchMode::Dynamic,
        token_budget: 65_536,
        ..config()
    };
    let cost = |stats: &StepStats, t: u32| -> f64 {
        stats
            .micro_batch_log
            .iter()
            .filter(|r| r.trainer == t)
            .map(|r| r.cost)
            .sum()
    };
    let mut equal = World::new(dynamic, &[1.0; 4]);
    let stats = equal
        .step(samples(32, 1_000))
        .expect("finishes")
        .expect("ok");
    assert!(!equal
        .log
        .iter()
        .any(|d| matches!(d.reason, Reason::Stolen { .. })));
    let per: Vec<f64> = (0..4).map(|t| cost(&stats, t)).collect();
    assert!(per.iter().all(|&c| (c - per[0]).abs() < 1e-9), "{per:?}");

    let mut slow = World::new(dynamic, &[0.25, 1.0, 1.0, 1.0]);
    let stats = slow
        .step(samples(32, 1_000))
        .expect("finishes")
        .expect("ok");
    let stolen_from_0 = slow
        .log
        .iter()
        .any(|d| matches!(d.reason, Reason::Stolen { from: 0, .. }));
    assert!(stolen_from_0);
    let others = (1..4).map(|t| cost(&stats, t)).sum::<f64>() / 3.0;
    assert!(
        cost(&stats, 0) < 0.6 * others,
        "{} vs {others}",
        cost(&stats, 0)
    );
}

#[test]
fn dynamic_dispatch_fills_micro_batches_to_the_floor_and_still_steals() {
    // 8 samples of 100 tokens per trainer: guided packing halves down to single samples
    // (4, 2, 1, 1); a floor of half the 1,000-token budget keeps 5 together, then the rest.
    let guided = StepConfig {
        dispatch: DispatchMode::Dynamic,
        token_budget: 1_000,
        ..config()
    };
    let filled = StepConfig {
        min_fill: 0.5,
        ..guided
    };
    let run = |c: StepConfig, speeds: &[f64]| {
        let mut w = World::new(c, speeds);
        let stats = w.step(samples(16, 100)).expect("finishes").expect("ok");
        let stolen = w
            .log
            .iter()
            .any(|d| matches!(d.reason, Reason::Stolen { .. }));
        (stats, stolen)
    };
    let (plain, _) = run(guided, &[1.0, 1.0]);
    let (full, _) = run(filled, &[1.0, 1.0]);
    assert_eq!(plain.micro_batches, 8);
    assert_eq!(full.micro_batches, 4);
    assert_eq!(full.samples, 16);
    assert!(full
        .micro_batch_log
        .iter()
        .all(|r| r.tokens >= 500 || r.tokens == 300));
    // A slow trainer still loses its last micro-batch to the other.
    let (_, stolen) = run(filled, &[0.2, 1.0]);
    assert!(stolen);
}
