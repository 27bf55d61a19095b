//! Speed-weighted static plans: ODC's LB-Mini ([`plan_static`](super::plan_static)) corrected for measured trainer
//! speeds, so a static plan can be re-balanced between minibatches when a trainer straggles.
//!
//! [`plan_static_weighted`] partitions the *samples* over trainers so that the largest
//! **normalised load** `load_t / speed_t` (the estimated time of the slowest trainer) is small,
//! then each trainer packs its own samples under the token budget, exactly as [`plan_static`](super::plan_static)
//! does. The partition is the better (lower max normalised load; the [`plan_static`](super::plan_static) one on
//! ties) of two candidates, each refined by a local search:
//! - LPT on uniform machines: samples by cost descending, each to the trainer that would finish it
//!   first, i.e. with the smallest `(load_t + c) / speed_t` (ties to the lowest index);
//! - the partition of [`plan_static`](super::plan_static) (Karmarkar–Karp or greedy, refined, speed-unaware).
//!
//! The refinement repeatedly moves one sample out of the trainer with the largest normalised load
//! `m`, or swaps one of its samples with a cheaper one of another trainer `j`, taking the step
//! that lowers `max(load_m / speed_m, load_j / speed_j)` the most, while some step lowers it below
//! the current maximum; it is capped at `4·(samples + trainers)` steps and stops if float
//! rounding eats an improvement.
//!
//! Guarantees (tested):
//! - **W1** every plan satisfies the guarantees of every [plan](super::plan): every sample in
//!   exactly one micro-batch (docs/design.md I2 at planning time), micro-batches non-empty, within the
//!   budget and sorted by cost descending; `per_trainer` has one list per speed, names every
//!   micro-batch exactly once, each list costliest first.
//! - **W2** with all speeds equal the plan *is* [`plan_static`](super::plan_static)'s (the problem is the same).
//! - **W3** for any speeds, the max normalised load is at most that of [`plan_static`](super::plan_static)'s
//!   partition under the same speeds: measured speeds never make the plan worse than ignoring
//!   them.
//! - **W4** LPT bound on uniform machines: with `C` the total cost, `c_max` the costliest sample,
//!   `k` trainers and `S` the sum of speeds, the max normalised load is at most
//!   `(C + (k − 1)·c_max) / S`.
//! - **W5** the slowest trainer is the bottleneck by at most one sample: its normalised load
//!   exceeds the largest of the other trainers' by at most `c_max / speed_slowest` (otherwise
//!   moving any of its samples to another trainer would be a refinement step; holds whenever the
//!   refinement ends before its step cap, which the tests never reach).
//!
//! Bad input gives a [`BalanceError`], never a panic: those of [`plan_static`](super::plan_static), plus
//! [`BalanceError::InvalidSpeed`] naming the first trainer whose speed is not finite and
//! positive. Only speed *ratios* matter (speeds are normalised by the fastest first). Cost: the
//! LPT pass is `O(samples · trainers)`, each refinement step `O(samples · samples on m)`.

use super::partition::refine;
use super::plan::{assemble, check_trainers, sample_costs, Packing};
use super::{loads, partition, BalanceError, CostModel, Plan};

/// ODC's LB-Mini for trainers of different speeds: partition the minibatch's samples over
/// `speeds.len()` trainers minimising the largest `load_t / speeds[t]` (see the
/// [module docs](self) for the algorithm and its guarantees), then each trainer packs its own
/// samples into micro-batches under `budget`.
///
/// `speeds` are in any unit (cost units per second, or relative speeds with the fastest at 1.0,
/// as [`SpeedEstimator::relative_speeds`](crate::straggler::SpeedEstimator::relative_speeds)
/// gives); only their ratios matter. With all speeds equal this is exactly [`plan_static`](super::plan_static).
///
/// Errors: [`BalanceError::ZeroTrainers`] for no speeds, [`BalanceError::TooManyTrainers`],
/// [`BalanceError::InvalidSpeed`] for a speed that is not finite and positive, and every error
/// of [`plan_static`](super::plan_static) for a bad minibatch, budget or cost model.
///
/// ```
/// use odc_policy::balancer::{plan_static_weighted, CostModel};
/// // Twelve equal samples; trainer 1 runs at half speed.
/// let tokens = [8_000; 12];
/// let plan = plan_static_weighted(&tokens, &CostModel::linear(), &[1.0, 0.5], 32_000).unwrap();
/// let costs = plan.trainer_costs();
/// // The fast trainer gets twice the work: both finish at the same time.
/// assert!((costs[0] - 2.0 * costs[1]).abs() < 1e-9);
/// assert_eq!(plan.num_samples(), 12);
/// ```
pub fn plan_static_weighted(
    tokens: &[u64],
    cost: &CostModel,
    speeds: &[f64],
    budget: u64,
) -> Result<Plan, BalanceError> {
    let (costs, parts) = weighted_partition(tokens, cost, speeds, budget)?;
    assemble(tokens, &costs, cost, &parts, budget, Packing::Even)
}

/// [`plan_dynamic`](super::plan_dynamic) for trainers of different speeds: the partition of
/// [`plan_static_weighted`], each trainer's share packed in micro-batches of decreasing size
/// ([`pack_guided`](super::pack_guided)). Same errors as [`plan_static_weighted`]; with all
/// speeds equal this is exactly [`plan_dynamic`](super::plan_dynamic).
///
/// ```
/// use odc_policy::balancer::{plan_dynamic_weighted, CostModel};
/// let tokens = [8_000; 12];
/// let plan = plan_dynamic_weighted(&tokens, &CostModel::linear(), &[1.0, 0.5], 32_000).unwrap();
/// let costs = plan.trainer_costs();
/// assert!((costs[0] - 2.0 * costs[1]).abs() < 1e-9);
/// ```
pub fn plan_dynamic_weighted(
    tokens: &[u64],
    cost: &CostModel,
    speeds: &[f64],
    budget: u64,
) -> Result<Plan, BalanceError> {
    plan_dynamic_weighted_filled(tokens, cost, speeds, budget, 0)
}

/// [`plan_dynamic_weighted`] with the fill floor of
/// [`plan_dynamic_filled`](super::plan_dynamic_filled): micro-batches of at least `min_tokens`
/// tokens while enough samples are left.
pub fn plan_dynamic_weighted_filled(
    tokens: &[u64],
    cost: &CostModel,
    speeds: &[f64],
    budget: u64,
    min_tokens: u64,
) -> Result<Plan, BalanceError> {
    let (costs, parts) = weighted_partition(tokens, cost, speeds, budget)?;
    assemble(
        tokens,
        &costs,
        cost,
        &parts,
        budget,
        Packing::Guided { min_tokens },
    )
}

/// Checks the input; every sample's cost and the speed-weighted partition of the module docs.
fn weighted_partition(
    tokens: &[u64],
    cost: &CostModel,
    speeds: &[f64],
    budget: u64,
) -> Result<(Vec<f64>, Vec<Vec<usize>>), BalanceError> {
    let trainers = speeds.len();
    check_trainers(trainers)?;
    if let Some((trainer, &speed)) = speeds
        .iter()
        .enumerate()
        .find(|(_, s)| !s.is_finite() || **s <= 0.0)
    {
        return Err(BalanceError::InvalidSpeed {
            trainer: trainer as u64,
            speed,
        });
    }
    let costs = sample_costs(tokens, cost, budget)?;
    // plan_static's partition: the answer at equal speeds, a candidate otherwise.
    let mut from_static = partition(&costs, trainers, false);
    if speeds.windows(2).all(|w| w[0] == w[1]) {
        return Ok((costs, from_static));
    }
    let fastest = speeds.iter().copied().fold(0.0, f64::max);
    // Clamped: a ratio that underflows to 0 would make normalised loads infinite.
    let relative: Vec<f64> = speeds
        .iter()
        .map(|s| (s / fastest).max(f64::MIN_POSITIVE))
        .collect();
    let mut best = lpt_uniform(&costs, &relative);
    refine(&costs, Some(&relative), &mut best, true);
    refine(&costs, Some(&relative), &mut from_static, true);
    if max_normalised_load(&costs, &relative, &from_static)
        <= max_normalised_load(&costs, &relative, &best)
    {
        best = from_static;
    }
    Ok((costs, best))
}

/// The largest `load_t / speeds[t]` of a partition (0 for no subsets).
fn max_normalised_load(costs: &[f64], speeds: &[f64], parts: &[Vec<usize>]) -> f64 {
    loads(costs, parts)
        .iter()
        .zip(speeds)
        .map(|(load, speed)| load / speed)
        .fold(0.0, f64::max)
}

/// Longest processing time first on uniform machines: samples by cost descending (ties by
/// index), each to the trainer with the earliest finish time `(load + c) / speed` (ties to the
/// lowest index).
fn lpt_uniform(costs: &[f64], speeds: &[f64]) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&x, &y| costs[y].total_cmp(&costs[x]).then(x.cmp(&y)));
    let mut parts = vec![Vec::new(); speeds.len()];
    let mut loads = vec![0.0; speeds.len()];
    for sample in order {
        let c = costs[sample];
        let finish = |t: usize| (loads[t] + c) / speeds[t];
        let Some(t) =
            (0..speeds.len()).min_by(|&x, &y| finish(x).total_cmp(&finish(y)).then(x.cmp(&y)))
        else {
            break;
        };
        parts[t].push(sample);
        loads[t] += c;
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balancer::{plan_dynamic, plan_static, MAX_TRAINERS};
    use proptest::prelude::*;

    /// W1: the guarantees of every plan, plus one `per_trainer` list per speed.
    fn assert_plan_valid(
        plan: &Plan,
        tokens: &[u64],
        cost: &CostModel,
        trainers: usize,
        budget: u64,
    ) {
        let mut seen: Vec<usize> = plan
            .micro_batches
            .iter()
            .flat_map(|mb| mb.samples.iter().copied())
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..tokens.len()).collect::<Vec<_>>(), "exactly once");
        for mb in &plan.micro_batches {
            assert!(!mb.samples.is_empty());
            assert_eq!(
                mb.tokens,
                mb.samples.iter().map(|&s| tokens[s]).sum::<u64>()
            );
            assert!(mb.tokens <= budget, "budget respected");
            let c: f64 = mb.samples.iter().map(|&s| cost.cost(tokens[s])).sum();
            assert!((mb.cost - c).abs() <= 1e-9 * c.max(1.0));
        }
        for pair in plan.micro_batches.windows(2) {
            assert!(pair[0].cost >= pair[1].cost, "sorted by cost descending");
        }
        let per_trainer = &plan.per_trainer;
        assert_eq!(per_trainer.len(), trainers);
        let mut all: Vec<usize> = per_trainer.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..plan.micro_batches.len()).collect::<Vec<_>>());
        for list in per_trainer {
            assert!(list.windows(2).all(|w| w[0] < w[1]), "costliest first");
        }
    }

    fn normalised(plan: &Plan, speeds: &[f64]) -> Vec<f64> {
        let costs = plan.trainer_costs();
        costs.iter().zip(speeds).map(|(c, s)| c / s).collect()
    }

    fn max_of(xs: &[f64]) -> f64 {
        xs.iter().copied().fold(0.0, f64::max)
    }

    #[test]
    fn weighted_rejects_bad_speeds_naming_the_trainer() {
        let m = CostModel::linear();
        assert_eq!(
            plan_static_weighted(&[10], &m, &[], 100),
            Err(BalanceError::ZeroTrainers)
        );
        for bad in [0.0, -1.0, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(
                plan_static_weighted(&[10], &m, &[1.0, 0.5, bad], 100),
                Err(BalanceError::InvalidSpeed {
                    trainer: 2,
                    speed: bad
                })
            );
        }
        assert!(matches!(
            plan_static_weighted(&[10], &m, &[f64::NAN, 1.0], 100),
            Err(BalanceError::InvalidSpeed { trainer: 0, speed }) if speed.is_nan()
        ));
        let too_many = vec![1.0; MAX_TRAINERS + 1];
        assert_eq!(
            plan_static_weighted(&[10], &m, &too_many, 100),
            Err(BalanceError::TooManyTrainers {
                trainers: (MAX_TRAINERS + 1) as u64,
                max: MAX_TRAINERS as u64
            })
        );
    }

    #[test]
    fn weighted_passes_minibatch_errors_through() {
        let m = CostModel::odc_7b();
        let speeds = [1.0, 0.5];
        assert_eq!(
            plan_static_weighted(&[], &m, &speeds, 100),
            Err(BalanceError::EmptyMinibatch)
        );
        assert_eq!(
            plan_static_weighted(&[10], &m, &speeds, 0),
            Err(BalanceError::ZeroBudget)
        );
        assert_eq!(
            plan_static_weighted(&[10, 0], &m, &speeds, 100),
            Err(BalanceError::ZeroLength { sample: 1 })
        );
        assert_eq!(
            plan_static_weighted(&[10, 101], &m, &speeds, 100),
            Err(BalanceError::SampleExceedsBudget {
                sample: 1,
                tokens: 101,
                budget: 100
            })
        );
        assert!(matches!(
            plan_static_weighted(&[5], &CostModel::quadratic(-1.0, 0.0), &speeds, 10),
            Err(BalanceError::InvalidCostModel { field, .. }) if field == "a"
        ));
    }

    #[test]
    fn weighted_equal_speeds_is_plan_static() {
        let tokens = [40_000, 9_000, 12_000, 30_000, 5_000, 22_000, 17_000, 3_000];
        let m = CostModel::odc_7b();
        for speed in [1.0, 0.25, 3.0] {
            let weighted = plan_static_weighted(&tokens, &m, &[speed; 3], 65_536).unwrap();
            assert_eq!(weighted, plan_static(&tokens, &m, 3, 65_536).unwrap());
            let dynamic = plan_dynamic_weighted(&tokens, &m, &[speed; 3], 65_536).unwrap();
            assert_eq!(dynamic, plan_dynamic(&tokens, &m, 3, 65_536).unwrap());
        }
    }

    #[test]
    fn weighted_dynamic_has_the_weighted_partition_in_decreasing_sizes() {
        let tokens: Vec<u64> = (0..24).map(|i| 1_000 + (i * 2_777) % 20_000).collect();
        let m = CostModel::odc_7b();
        let speeds = [1.0, 0.25, 1.0];
        let fixed = plan_static_weighted(&tokens, &m, &speeds, 65_536).unwrap();
        let dynamic = plan_dynamic_weighted(&tokens, &m, &speeds, 65_536).unwrap();
        assert_plan_valid(&dynamic, &tokens, &m, 3, 65_536);
        for (d, s) in dynamic.trainer_costs().iter().zip(fixed.trainer_costs()) {
            assert!((d - s).abs() <= 1e-9 * s.max(1.0));
        }
        assert!(dynamic.micro_batches.len() >= fixed.micro_batches.len());
        assert!(
            plan_dynamic_weighted(&tokens, &m, &[1.0, 0.0], 65_536).is_err(),
            "speeds are checked"
        );
    }

    #[test]
    fn weighted_half_speed_trainer_gets_half_the_work() {
        let tokens = [8_000; 12];
        let m = CostModel::linear();
        let plan = plan_static_weighted(&tokens, &m, &[1.0, 0.5], 32_000).unwrap();
        assert_plan_valid(&plan, &tokens, &m, 2, 32_000);
        let counts: Vec<usize> = plan
            .per_trainer
            .iter()
            .map(|mbs| {
                mbs.iter()
                    .map(|&i| plan.micro_batches[i].samples.len())
                    .sum()
            })
            .collect();
        assert_eq!(counts, vec![8, 4]);
        // Speed-unaware LB-Mini splits 6/6 and the slow trainer needs 1.5 as long.
        let unaware = plan_static(&tokens, &m, 2, 32_000).unwrap();
        let speeds = [1.0, 0.5];
        assert!((max_of(&normalised(&plan, &speeds)) - 2.0).abs() < 1e-9);
        assert!((max_of(&normalised(&unaware, &speeds)) - 3.0).abs() < 1e-9);
    }

    #[test]
    fn weighted_one_straggler_among_eight() {
        // One of eight trainers at half speed: the perfect-balance bound is total / 7.5.
        let tokens: Vec<u64> = (0..64).map(|i| 2_000 + (i * 7_919) % 30_000).collect();
        let m = CostModel::odc_7b();
        let mut speeds = [1.0; 8];
        speeds[3] = 0.5;
        let plan = plan_static_weighted(&tokens, &m, &speeds, 65_536).unwrap();
        assert_plan_valid(&plan, &tokens, &m, 8, 65_536);
        let total: f64 = tokens.iter().map(|&t| m.cost(t)).sum();
        let bound = total / speeds.iter().sum::<f64>();
        let worst = max_of(&normalised(&plan, &speeds));
        let unaware = max_of(&normalised(
            &plan_static(&tokens, &m, 8, 65_536).unwrap(),
            &speeds,
        ));
        assert!(worst <= 1.02 * bound, "{worst} vs bound {bound}");
        assert!(
            unaware > 1.5 * bound,
            "speed-unaware plan: {unaware} vs bound {bound}"
        );
    }

    #[test]
    fn weighted_more_trainers_than_samples() {
        let tokens = [100, 200];
        let m = CostModel::linear();
        let plan = plan_static_weighted(&tokens, &m, &[0.5, 1.0, 0.25, 1.0, 0.75], 1_000).unwrap();
        assert_plan_valid(&plan, &tokens, &m, 5, 1_000);
        let per_trainer = plan.per_trainer;
        // The two samples go to the two fastest trainers.
        assert!(per_trainer[1].len() == 1 && per_trainer[3].len() == 1);
        assert_eq!(per_trainer.iter().filter(|l| l.is_empty()).count(), 3);
    }

    proptest! {
        /// W1 and W3 for arbitrary speeds.
        #[test]
        fn weighted_plans_are_valid_and_no_worse_than_plan_static(
            tokens in prop::collection::vec(1u64..32_000, 1..60),
            speeds in prop::collection::vec(0.05f64..4.0, 1..9),
            budget in 32_000u64..70_000,
            quadratic in any::<bool>(),
        ) {
            let m = if quadratic { CostModel::odc_7b() } else { CostModel::linear() };
            let plan = plan_static_weighted(&tokens, &m, &speeds, budget).unwrap();
            assert_plan_valid(&plan, &tokens, &m, speeds.len(), budget);
            let unaware = plan_static(&tokens, &m, speeds.len(), budget).unwrap();
            let (mine, theirs) = (
                max_of(&normalised(&plan, &speeds)),
                max_of(&normalised(&unaware, &speeds)),
            );
            prop_assert!(mine <= theirs * (1.0 + 1e-9), "{} > {}", mine, theirs);
        }

        /// W2 in terms of load: equal speeds never give a larger max load than plan_static.
        #[test]
        fn weighted_equal_speeds_no_worse_than_plan_static(
            tokens in prop::collection::vec(1u64..64_000, 1..80),
            trainers in 1usize..9,
            speed in 0.01f64..100.0,
        ) {
            let m = CostModel::odc_7b();
            let speeds = vec![speed; trainers];
            let plan = plan_static_weighted(&tokens, &m, &speeds, 65_536).unwrap();
            assert_plan_valid(&plan, &tokens, &m, trainers, 65_536);
            let unaware = plan_static(&tokens, &m, trainers, 65_536).unwrap();
            let mine = max_of(&plan.trainer_costs());
            let theirs = max_of(&unaware.trainer_costs());
            prop_assert!(mine <= theirs * (1.0 + 1e-12));
        }

        /// W4 and W5 with one trainer at half speed and the others between half and full speed.
        #[test]
        fn weighted_slow_trainer_within_lpt_bound(
            tokens in prop::collection::vec(1u64..64_000, 1..80),
            others in prop::collection::vec(0.5f64..=1.0, 0..7),
            quadratic in any::<bool>(),
        ) {
            let m = if quadratic { CostModel::odc_7b() } else { CostModel::linear() };
            let speeds: Vec<f64> = [1.0, 0.5].into_iter().chain(others).collect();
            let plan = plan_static_weighted(&tokens, &m, &speeds, 65_536).unwrap();
            assert_plan_valid(&plan, &tokens, &m, speeds.len(), 65_536);
            let norm = normalised(&plan, &speeds);
            let costs: Vec<f64> = tokens.iter().map(|&t| m.cost(t)).collect();
            let c_max = max_of(&costs);
            let total: f64 = costs.iter().sum();
            let k = speeds.len() as f64;
            let lpt_bound = (total + (k - 1.0) * c_max) / speeds.iter().sum::<f64>();
            prop_assert!(
                max_of(&norm) <= lpt_bound * (1.0 + 1e-9),
                "W4: {:?} vs {}", norm, lpt_bound
            );
            let others_max = norm
                .iter()
                .enumerate()
                .filter(|&(t, _)| t != 1)
                .map(|(_, &n)| n)
                .fold(0.0, f64::max);
            prop_assert!(
                norm[1] <= (others_max + c_max / 0.5) * (1.0 + 1e-9),
                "W5: slow trainer at {} vs others {} + {}", norm[1], others_max, c_max / 0.5
            );
        }
    }
}
