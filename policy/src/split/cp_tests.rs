//! The context-parallel baselines' guarantees (module docs of [`super::cp`]).

use proptest::prelude::*;

use super::tests::Toy;
use super::*;
use crate::balancer::{plan_equal_count, CostModel};

/// Every sample placed exactly once (whole in one cell, or one piece on each member of an aligned
/// group in one round), cells within the budget, the step the sum of the rounds' costliest cells.
fn assert_valid(plan: &CpPlan, lengths: &[u64], d: u32, budget: u64) {
    let mut seen = vec![0usize; lengths.len()];
    for round in &plan.rounds {
        assert_eq!(round.len(), d as usize);
        for cell in round {
            assert!(cell.tokens <= budget, "{cell:?} over {budget}");
            for &i in &cell.samples {
                seen[i] += 1;
            }
        }
    }
    for (g, gang) in plan.gangs.iter().enumerate() {
        let k = gang.cost.k;
        assert_eq!(gang.devices.len(), k as usize);
        assert_eq!(gang.devices[0] % k, 0, "aligned: {gang:?}");
        assert!(gang.devices.windows(2).all(|w| w[1] == w[0] + 1));
        assert!(lengths[gang.sample] >= 2 * u64::from(k));
        for (m, &device) in gang.devices.iter().enumerate() {
            let cell = &plan.rounds[gang.round][device as usize];
            assert!(cell.pieces.contains(&(g, m as u32)), "{gang:?}");
        }
        seen[gang.sample] += 1;
    }
    assert!(seen.iter().all(|&n| n == 1), "placed once: {seen:?}");
    let step: f64 = plan
        .rounds
        .iter()
        .map(|r| r.iter().map(|c| c.cost_s).fold(0.0, f64::max))
        .sum();
    assert!((step - plan.step_s).abs() <= 1e-9 * step.max(1.0));
}

fn lengths() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(prop_oneof![4 => 16u64..4_000, 1 => 4_000u64..60_000], 1..48)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn every_variant_places_each_sample_once_within_the_budget(
        lengths in lengths(),
        nodes in 1u32..3,
        c in prop::sample::select(vec![2u32, 4, 8]),
    ) {
        let d = 8 * nodes;
        let costs = Toy::h100(d);
        let budget = 65_536;
        for cp in [ContextParallel::Off, ContextParallel::Static(c), ContextParallel::Dynamic] {
            let plan = plan_cp(&lengths, &costs, cp, budget, 0).unwrap();
            assert_valid(&plan, &lengths, d, budget);
            if let ContextParallel::Static(c) = cp {
                // Every sample that can be cut is, over a group of exactly `c`.
                let cut = lengths.iter().filter(|&&s| s >= 2 * u64::from(c)).count();
                prop_assert_eq!(plan.gangs.len(), cut);
                prop_assert!(plan.gangs.iter().all(|g| g.cost.k == c));
            }
            prop_assert_eq!(&plan, &plan_cp(&lengths, &costs, cp, budget, 0).unwrap());
        }
    }

    #[test]
    fn static_cp_of_one_is_lb_micro(
        lengths in prop::collection::vec(16u64..20_000, 1..40),
        d in 1u32..12,
        transfer in prop::sample::select(vec![0.0, 0.5, 4.0]),
    ) {
        let cost = CostModel::quadratic(1.0, 1.0).with_transfer(transfer);
        let costs = CostModelCosts { cost, devices: d, per_node: d, ring: None };
        let budget = 32_768;
        let plan = plan_cp(&lengths, &costs, ContextParallel::Off, budget, 0).unwrap();
        let lb = plan_equal_count(&lengths, &cost, d as usize, budget).unwrap();
        let rounds = lb.per_trainer[0].len();
        let lb_step: f64 = (0..rounds)
            .map(|r| {
                lb.per_trainer
                    .iter()
                    .map(|l| lb.micro_batches[l[r]].cost)
                    .fold(0.0, f64::max)
            })
            .sum();
        prop_assert!(plan.gangs.is_empty());
        prop_assert_eq!(plan.rounds.len(), rounds);
        prop_assert!((plan.step_s - lb_step).abs() <= 1e-9 * lb_step.max(1.0), "{} vs {}", plan.step_s, lb_step);
    }
}

#[test]
fn dynamic_cp_splits_the_long_sample_and_beats_every_static_size() {
    let d = 16;
    let costs = Toy::h100(d);
    let mut lengths = vec![2_000u64; 60];
    lengths.push(120_000);
    let plan = plan_cp(&lengths, &costs, ContextParallel::Dynamic, 65_536, 0).unwrap();
    assert_valid(&plan, &lengths, d, 65_536);
    let long = plan.gangs.iter().find(|g| g.sample == 60).expect("split");
    assert!(long.cost.k >= 4, "{long:?}");
    // Without CP the long sample does not fit the budget.
    assert!(plan_cp(&lengths, &costs, ContextParallel::Off, 65_536, 0).is_err());
    for cp in [2, 4, 8, 16] {
        let fixed = plan_cp(&lengths, &costs, ContextParallel::Static(cp), 65_536, 0);
        let step = fixed.unwrap().step_s;
        assert!(plan.step_s <= step, "cp{cp}: {} vs {step}", plan.step_s);
    }
}

#[test]
fn static_cp_shortens_a_step_that_one_long_sample_sets() {
    let d = 8;
    let costs = Toy::h100(d);
    let lengths = [60_000, 1_000, 1_000, 1_000, 1_000, 1_000, 1_000, 1_000];
    let off = plan_cp(&lengths, &costs, ContextParallel::Off, 65_536, 0).unwrap();
    let cp4 = plan_cp(&lengths, &costs, ContextParallel::Static(4), 65_536, 0).unwrap();
    assert!(
        cp4.step_s < 0.5 * off.step_s,
        "{} vs {}",
        cp4.step_s,
        off.step_s
    );
}

#[test]
fn bad_inputs_are_errors_naming_what_was_wrong() {
    let costs = Toy::h100(8);
    let e = plan_cp(&[100], &costs, ContextParallel::Static(3), 1_000, 0).unwrap_err();
    assert!(
        e.to_string().contains("3 trainers does not divide the 8"),
        "{e}"
    );
    let e = plan_cp(&[10_000], &costs, ContextParallel::Static(2), 1_000, 0).unwrap_err();
    assert!(
        matches!(e, SplitError::PiecesOverBudget { sample: 0, .. }),
        "{e}"
    );
    let e = plan_cp(&[100_000], &costs, ContextParallel::Dynamic, 1_000, 0).unwrap_err();
    assert!(e.to_string().contains("sample 0 has 100000 tokens"), "{e}");
    assert!(plan_cp(&[100], &costs, ContextParallel::Dynamic, 0, 0).is_err());
    let bad = Toy {
        b: f64::NAN,
        ..Toy::h100(8)
    };
    let e = plan_cp(&[100], &bad, ContextParallel::Off, 1_000, 0).unwrap_err();
    assert!(e.to_string().contains("sample_s of sample 0"), "{e}");
    for (text, cp) in [
        ("off", ContextParallel::Off),
        ("4", ContextParallel::Static(4)),
        ("cp8", ContextParallel::Static(8)),
        ("dynamic", ContextParallel::Dynamic),
    ] {
        assert_eq!(text.parse::<ContextParallel>().unwrap(), cp);
    }
    assert!("cp0".parse::<ContextParallel>().is_err());
    assert!("ring".parse::<ContextParallel>().is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// On demand a CP placement runs without lockstep: never longer than its lockstep step, and
    /// the on-demand plan is never longer than the gangs' plan (a placement only below the margin).
    #[test]
    fn on_demand_runs_a_placement_without_lockstep_and_never_loses_to_its_gangs(
        lengths in lengths(),
        nodes in 1u32..3,
    ) {
        let d = 8 * nodes;
        let costs = Toy::h100(d);
        for cp in [ContextParallel::Static(4), ContextParallel::Dynamic] {
            let plan = plan_cp(&lengths, &costs, cp, 65_536, 0).unwrap();
            prop_assert!(unlocked_step_s(&plan) <= plan.step_s * (1.0 + 1e-12));
        }
        let options = SplitOptions::default();
        let gangs = super::plan(&lengths, &costs, options).unwrap();
        let chosen = plan_on_demand(&lengths, &costs, options).unwrap();
        prop_assert!(chosen.step_s() <= gangs.step_s);
        if let OnDemandPlan::Rounds { plan, step_s, .. } = &chosen {
            prop_assert!(*step_s < gangs.step_s * (1.0 - CP_MARGIN));
            prop_assert_eq!(*step_s, unlocked_step_s(plan));
            assert_valid(plan, &lengths, d, 65_536);
        }
        // Only whole samples where a sample must stay whole.
        let kept = SplitOptions { min_tokens: 1, ..options };
        prop_assert!(matches!(plan_on_demand(&lengths, &costs, kept).unwrap(), OnDemandPlan::Gangs(_)));
        // And where the ring exchange has no price (a job without a RingPrice); with one, the
        // runtime's costs weigh the placements too.
        let runtime = |ring| CostModelCosts { cost: CostModel::quadratic(1.0, 1.0), devices: d, per_node: 8, ring };
        prop_assert!(matches!(plan_on_demand(&lengths, &runtime(None), options).unwrap(), OnDemandPlan::Gangs(_)));
        let priced = plan_on_demand(&lengths, &runtime(Some(RingPrice::free())), options).unwrap();
        let gangs = super::plan(&lengths, &runtime(Some(RingPrice::free())), options).unwrap();
        prop_assert!(priced.step_s() <= gangs.step_s);
    }
}

#[test]
fn unlocked_rounds_wait_only_for_the_trainers_their_gangs_tie() {
    // Two trainers, two rounds: round 0 trainer 0 is long alone, round 1 a gang of both. In
    // lockstep round 1 starts after the long cell on both; on demand too (the gang ties them),
    // but a trainer with no gang in round 1 would not wait.
    let costs = CostModelCosts {
        cost: CostModel::linear(),
        devices: 2,
        per_node: 2,
        ring: None,
    };
    let plan = plan_cp(
        &[8_000, 100, 4_000],
        &costs,
        ContextParallel::Dynamic,
        65_536,
        0,
    )
    .unwrap();
    assert!(unlocked_step_s(&plan) <= plan.step_s);
    let mut tied = plan.clone();
    tied.rounds = vec![
        vec![
            CpCell {
                samples: vec![0],
                cost_s: 8.0,
                ..CpCell::default()
            },
            CpCell {
                samples: vec![1],
                cost_s: 1.0,
                ..CpCell::default()
            },
        ],
        vec![
            CpCell {
                pieces: vec![(0, 0)],
                cost_s: 2.0,
                ..CpCell::default()
            },
            CpCell {
                pieces: vec![(0, 1)],
                cost_s: 2.0,
                ..CpCell::default()
            },
        ],
    ];
    tied.gangs = vec![CpGang {
        sample: 2,
        tokens: 4_000,
        cost: plan_cp(&[4_000], &costs, ContextParallel::Static(2), 65_536, 0)
            .unwrap()
            .gangs[0]
            .cost,
        devices: vec![0, 1],
        round: 1,
    }];
    assert_eq!(unlocked_step_s(&tied), 10.0);
    let mut loose = tied.clone();
    loose.gangs.clear();
    loose.rounds[1][0].pieces.clear();
    loose.rounds[1][1] = CpCell {
        samples: vec![2],
        cost_s: 2.0,
        ..CpCell::default()
    };
    loose.rounds[1][0] = CpCell {
        samples: vec![2],
        cost_s: 2.0,
        ..CpCell::default()
    };
    // Trainer 1 runs its two cells back to back: 1 + 2; trainer 0: 8 + 2.
    assert_eq!(unlocked_step_s(&loose), 10.0);
    loose.rounds[0].swap(0, 1);
    assert_eq!(unlocked_step_s(&loose), 10.0);
    loose.rounds[1][1].cost_s = 0.5;
    loose.rounds[0][1].cost_s = 9.0;
    assert_eq!(unlocked_step_s(&loose), 9.5);
}
