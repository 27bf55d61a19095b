//! Minibatch plans: samples → micro-batches (token budget) → trainers.
//!
//! Guarantees of every plan returned (tested):
//! - every sample of the minibatch is in exactly one micro-batch (I2 at planning time);
//! - every micro-batch is non-empty and holds at most `budget` tokens;
//! - `micro_batches` is sorted by cost, descending; each micro-batch's `tokens` is the sum over
//!   its samples and its `cost` is [`CostModel::micro_batch`] of theirs: their sum, or the
//!   micro-batch's transfers when those take longer;
//! - `per_trainer` has one list per trainer and names every micro-batch exactly once, each list in
//!   descending cost order (ascending index).
//!
//! Three strategies: [`plan_static`] (ODC's LB-Mini, each trainer's share in micro-batches of
//! even cost: [`pack_even`](super::pack_even)), [`plan_dynamic`] (LB-Mini's partition in
//! micro-batches of decreasing size, for dispatch that lets idle trainers steal the small ones at
//! the end) and [`plan_equal_count`] (LB-Micro, what collectives allow).

use super::{pack_even, pack_guided_filled, partition, BalanceError, CostModel};

/// One micro-batch of a plan: packed samples under the token budget.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedMicroBatch {
    /// Sample indices (into the minibatch), in packing order (longest first).
    pub samples: Vec<usize>,
    /// Token sum of the samples; at most the budget.
    pub tokens: u64,
    /// Estimated cost: the samples' compute, or the micro-batch's transfers when longer
    /// ([`CostModel::micro_batch`]).
    pub cost: f64,
}

/// The plan of one minibatch.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// All micro-batches of the minibatch, sorted by cost descending.
    pub micro_batches: Vec<PlannedMicroBatch>,
    /// For each trainer, indices into `micro_batches` (descending cost order): its own list.
    pub per_trainer: Vec<Vec<usize>>,
}

impl Plan {
    /// Estimated cost of each trainer's list.
    pub fn trainer_costs(&self) -> Vec<f64> {
        self.per_trainer
            .iter()
            .map(|mbs| {
                mbs.iter()
                    .filter_map(|&i| self.micro_batches.get(i))
                    .map(|mb| mb.cost)
                    .sum()
            })
            .collect()
    }

    /// Number of samples over all micro-batches.
    pub fn num_samples(&self) -> usize {
        self.micro_batches.iter().map(|mb| mb.samples.len()).sum()
    }
}

/// The most trainers a plan accepts (2²⁰): far above any cluster, low enough that the per-trainer
/// lists of a plan always fit in memory.
pub const MAX_TRAINERS: usize = 1 << 20;

pub(super) fn check_trainers(trainers: usize) -> Result<(), BalanceError> {
    if trainers == 0 {
        return Err(BalanceError::ZeroTrainers);
    }
    if trainers > MAX_TRAINERS {
        return Err(BalanceError::TooManyTrainers {
            trainers: trainers as u64,
            max: MAX_TRAINERS as u64,
        });
    }
    Ok(())
}

/// Checks the minibatch and returns every sample's cost.
pub(super) fn sample_costs(
    tokens: &[u64],
    cost: &CostModel,
    budget: u64,
) -> Result<Vec<f64>, BalanceError> {
    if tokens.is_empty() {
        return Err(BalanceError::EmptyMinibatch);
    }
    if budget == 0 {
        return Err(BalanceError::ZeroBudget);
    }
    for (sample, &t) in tokens.iter().enumerate() {
        if t == 0 {
            return Err(BalanceError::ZeroLength {
                sample: sample as u64,
            });
        }
        if t > budget {
            return Err(BalanceError::SampleExceedsBudget {
                sample: sample as u64,
                tokens: t,
                budget,
            });
        }
    }
    let costs = cost.sample_costs(tokens)?;
    let total: f64 = costs.iter().sum();
    if !total.is_finite() {
        return Err(BalanceError::CostOverflow { total });
    }
    Ok(costs)
}

fn micro_batch(
    tokens: &[u64],
    costs: &[f64],
    cost: &CostModel,
    samples: Vec<usize>,
) -> PlannedMicroBatch {
    PlannedMicroBatch {
        tokens: samples.iter().map(|&s| tokens[s]).sum(),
        cost: cost.micro_batch(samples.iter().map(|&s| costs[s]).sum()),
        samples,
    }
}

/// Sorts micro-batches (tagged with an owner) by cost descending, stable.
fn sort_by_cost<T>(mbs: &mut [(T, PlannedMicroBatch)]) {
    mbs.sort_by(|x, y| y.1.cost.total_cmp(&x.1.cost));
}

/// ODC's LB-Mini: partition the *samples* over `trainers` by cost
/// ([`partition`](fn@partition), counts may differ), then each trainer packs its own samples into
/// as few micro-batches under `budget` as first-fit would, of even cost
/// ([`pack_even`](super::pack_even)). Trainers may get different numbers of micro-batches; one with
/// no samples gets none.
///
/// ```
/// use odc_policy::balancer::{plan_static, CostModel};
/// let tokens = [30_000, 8_000, 8_000, 7_000, 4_000, 3_000];
/// let plan = plan_static(&tokens, &CostModel::linear(), 2, 32_000).unwrap();
/// assert_eq!(plan.per_trainer.len(), 2);
/// assert_eq!(plan.num_samples(), 6);
/// // 30k tokens on one trainer, 30k on the other: one micro-batch vs several.
/// let costs = plan.trainer_costs();
/// assert!((costs[0] - costs[1]).abs() < 1e-9);
/// ```
pub fn plan_static(
    tokens: &[u64],
    cost: &CostModel,
    trainers: usize,
    budget: u64,
) -> Result<Plan, BalanceError> {
    check_trainers(trainers)?;
    let costs = sample_costs(tokens, cost, budget)?;
    let parts = partition(&costs, trainers, false);
    assemble(tokens, &costs, cost, &parts, budget, Packing::Even)
}

/// How a trainer's share of the samples becomes micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Packing {
    /// [`pack_even`]: the fewest micro-batches, of even cost (static dispatch).
    Even,
    /// [`pack_guided_filled`]: decreasing sizes, small ones last (dynamic dispatch), none under
    /// `min_tokens` or under the cost model's transfers while enough is left.
    Guided { min_tokens: u64 },
}

/// A plan from a partition of the samples over trainers: each trainer packs its own samples under
/// `budget`; micro-batches sorted by cost descending (stable), each trainer's list in that order.
pub(super) fn assemble(
    tokens: &[u64],
    costs: &[f64],
    cost: &CostModel,
    parts: &[Vec<usize>],
    budget: u64,
    packing: Packing,
) -> Result<Plan, BalanceError> {
    let mut owned = Vec::new();
    for (trainer, samples) in parts.iter().enumerate() {
        let packed = match packing {
            Packing::Even => pack_even(tokens, costs, samples, budget)?,
            Packing::Guided { min_tokens } => {
                pack_guided_filled(tokens, costs, samples, budget, min_tokens, cost.transfer)?
            }
        };
        for mb in packed {
            owned.push((trainer, micro_batch(tokens, costs, cost, mb)));
        }
    }
    sort_by_cost(&mut owned);
    let mut per_trainer = vec![Vec::new(); parts.len()];
    let mut micro_batches = Vec::with_capacity(owned.len());
    for (position, (trainer, mb)) in owned.into_iter().enumerate() {
        per_trainer[trainer].push(position);
        micro_batches.push(mb);
    }
    Ok(Plan {
        micro_batches,
        per_trainer,
    })
}

/// Split `samples` into at least `parts` micro-batches of near-equal cost (Karmarkar–Karp over
/// sample costs), each within `budget` tokens: when a part exceeds the budget, one more part is
/// tried, up to one sample per part (which always fits, every sample being within the budget).
/// Empty parts are dropped.
fn pack_balanced(
    tokens: &[u64],
    costs: &[f64],
    samples: &[usize],
    parts: usize,
    budget: u64,
) -> Vec<Vec<usize>> {
    let sub: Vec<f64> = samples.iter().map(|&s| costs[s]).collect();
    let mut k = parts.clamp(1, samples.len().max(1));
    loop {
        let groups: Vec<Vec<usize>> = partition(&sub, k, false)
            .into_iter()
            .filter(|g| !g.is_empty())
            .map(|g| g.into_iter().map(|i| samples[i]).collect())
            .collect();
        let fits = groups
            .iter()
            .all(|g| g.iter().map(|&s| tokens[s]).sum::<u64>() <= budget);
        if fits || k >= samples.len() {
            return groups;
        }
        k += 1;
    }
}

/// Micro-batches needed to hold `tokens` under `budget`, at least one.
fn min_parts(tokens: &[u64], budget: u64) -> usize {
    let total: u64 = tokens.iter().sum();
    (total.div_ceil(budget.max(1)) as usize).max(1)
}

/// The plan for dynamic dispatch: LB-Mini's partition of the samples over `trainers` (the one
/// [`plan_static`] makes), each trainer's share packed into micro-batches of **decreasing size**
/// ([`pack_guided`](super::pack_guided): each about half of what is left, the last ones single samples). At run time
/// a trainer runs its own list costliest first and, once it is empty, may steal the smallest
/// micro-batch of the trainer expected to finish last
/// ([`WorkQueue::steal`](crate::dispatch::WorkQueue::steal)). Per trainer the work is
/// exactly [`plan_static`]'s, so when costs are as modelled nothing needs to move.
///
/// ```
/// use odc_policy::balancer::{plan_dynamic, plan_static, CostModel};
/// let tokens = [4_000; 16];
/// let m = CostModel::odc_7b();
/// let dynamic = plan_dynamic(&tokens, &m, 2, 65_536).unwrap();
/// let fixed = plan_static(&tokens, &m, 2, 65_536).unwrap();
/// for (d, s) in dynamic.trainer_costs().iter().zip(fixed.trainer_costs()) {
///     assert!((d - s).abs() < 1e-9, "the same work per trainer");
/// }
/// // Eight samples per trainer: 4 + 2 + 1 + 1 instead of one micro-batch of 8.
/// assert_eq!(dynamic.per_trainer[0].len(), 4);
/// assert_eq!(fixed.per_trainer[0].len(), 1);
/// ```
pub fn plan_dynamic(
    tokens: &[u64],
    cost: &CostModel,
    trainers: usize,
    budget: u64,
) -> Result<Plan, BalanceError> {
    plan_dynamic_filled(tokens, cost, trainers, budget, 0)
}

/// [`plan_dynamic`] whose micro-batches hold at least `min_tokens` tokens while enough samples are
/// left ([`pack_guided_filled`](super::pack_guided_filled)): fewer and larger micro-batches, so
/// fewer passes over the model and fewer gathers of it, at the cost of coarser stealing. The work
/// per trainer is still [`plan_static`]'s.
///
/// ```
/// use odc_policy::balancer::{plan_dynamic, plan_dynamic_filled, CostModel};
/// let tokens = [4_000; 16];
/// let m = CostModel::odc_7b();
/// let filled = plan_dynamic_filled(&tokens, &m, 2, 65_536, 32_768).unwrap();
/// let guided = plan_dynamic(&tokens, &m, 2, 65_536).unwrap();
/// for (f, g) in filled.trainer_costs().iter().zip(guided.trainer_costs()) {
///     assert!((f - g).abs() < 1e-9, "the same work per trainer");
/// }
/// // Eight samples per trainer: 8 x 4,000 tokens fill the floor in one micro-batch.
/// assert_eq!(filled.per_trainer[0].len(), 1);
/// assert_eq!(guided.per_trainer[0].len(), 4);
/// ```
pub fn plan_dynamic_filled(
    tokens: &[u64],
    cost: &CostModel,
    trainers: usize,
    budget: u64,
    min_tokens: u64,
) -> Result<Plan, BalanceError> {
    check_trainers(trainers)?;
    let costs = sample_costs(tokens, cost, budget)?;
    let parts = partition(&costs, trainers, false);
    assemble(
        tokens,
        &costs,
        cost,
        &parts,
        budget,
        Packing::Guided { min_tokens },
    )
}

/// LB-Micro, the best plan collectives allow: every trainer runs the same number `m` of
/// micro-batches, in lockstep. The samples are split into `trainers × m` cost-balanced micro-batches
/// under `budget` (Karmarkar–Karp over sample costs), with `m` the smallest count for which every
/// part fits the budget (the max count agreed across trainers, as verl does); they are sorted by cost
/// and dealt in rounds, so the micro-batches that run together have similar costs: trainer `t` runs
/// parts `t, trainers + t, 2·trainers + t, …`. When there are fewer samples than parts, the missing
/// ones are **empty** micro-batches (no samples, zero tokens and cost): a collective still needs the
/// trainer to take part. Counts are always equal.
pub fn plan_equal_count(
    tokens: &[u64],
    cost: &CostModel,
    trainers: usize,
    budget: u64,
) -> Result<Plan, BalanceError> {
    check_trainers(trainers)?;
    let costs = sample_costs(tokens, cost, budget)?;
    let all: Vec<usize> = (0..tokens.len()).collect();
    let mut rounds = min_parts(tokens, budget).div_ceil(trainers);
    let groups = loop {
        let parts = rounds * trainers;
        let sub: Vec<f64> = costs.clone();
        let groups = partition(&sub, parts.min(tokens.len()), false);
        let fits = groups
            .iter()
            .all(|g| g.iter().map(|&s| tokens[s]).sum::<u64>() <= budget);
        if fits || parts >= tokens.len() {
            // One sample per part at worst, which always fits.
            break if fits {
                groups
            } else {
                pack_balanced(tokens, &costs, &all, tokens.len(), budget)
            };
        }
        rounds += 1;
    };
    let rounds = groups.len().div_ceil(trainers).max(rounds);
    let mut mbs: Vec<PlannedMicroBatch> = groups
        .into_iter()
        .filter(|g| !g.is_empty())
        .map(|g| micro_batch(tokens, &costs, cost, g))
        .collect();
    mbs.sort_by(|x, y| y.cost.total_cmp(&x.cost));
    mbs.resize(
        rounds * trainers,
        // An empty micro-batch still joins every collective.
        micro_batch(tokens, &costs, cost, Vec::new()),
    );
    let per_trainer = (0..trainers)
        .map(|t| (0..rounds).map(|r| r * trainers + t).collect())
        .collect();
    Ok(Plan {
        micro_batches: mbs,
        per_trainer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balancer::{greedy_partition, max_load};
    use proptest::prelude::*;

    /// Checks every guarantee listed in the module docs.
    fn assert_plan_valid(plan: &Plan, tokens: &[u64], cost: &CostModel, budget: u64) {
        let mut seen: Vec<usize> = plan
            .micro_batches
            .iter()
            .flat_map(|mb| mb.samples.iter().copied())
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..tokens.len()).collect::<Vec<_>>(), "exactly once");
        for mb in &plan.micro_batches {
            if mb.samples.is_empty() {
                // Only LB-Micro pads with empty micro-batches, which cost their transfers.
                assert!(mb.tokens == 0 && mb.cost == cost.transfer);
                continue;
            }
            let sum: u64 = mb.samples.iter().map(|&s| tokens[s]).sum();
            assert_eq!(mb.tokens, sum);
            assert!(mb.tokens <= budget, "budget respected");
            let c: f64 = mb.samples.iter().map(|&s| cost.cost(tokens[s])).sum();
            let c = c.max(cost.transfer);
            assert!((mb.cost - c).abs() <= 1e-9 * c.max(1.0));
        }
        for pair in plan.micro_batches.windows(2) {
            assert!(pair[0].cost >= pair[1].cost, "sorted by cost descending");
        }
        let mut all: Vec<usize> = plan.per_trainer.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..plan.micro_batches.len()).collect::<Vec<_>>());
        for list in &plan.per_trainer {
            assert!(
                list.windows(2).all(|w| w[0] < w[1]),
                "descending cost order"
            );
        }
    }

    /// Each trainer's samples, sorted.
    fn samples_of(plan: &Plan) -> Vec<Vec<usize>> {
        plan.per_trainer
            .iter()
            .map(|list| {
                let mut samples: Vec<usize> = list
                    .iter()
                    .flat_map(|&i| plan.micro_batches[i].samples.iter().copied())
                    .collect();
                samples.sort_unstable();
                samples
            })
            .collect()
    }

    fn count_spread(per_trainer: &[Vec<usize>]) -> usize {
        let max = per_trainer.iter().map(Vec::len).max().unwrap_or(0);
        let min = per_trainer.iter().map(Vec::len).min().unwrap_or(0);
        max - min
    }

    #[test]
    fn plans_error_for_bad_input() {
        let m = CostModel::default();
        let static_plan = |t: &[u64], k, b| plan_static(t, &m, k, b);
        let equal_plan = |t: &[u64], k, b| plan_equal_count(t, &m, k, b);
        for plan in [
            &static_plan as &dyn Fn(&[u64], usize, u64) -> _,
            &equal_plan,
        ] {
            assert_eq!(plan(&[10], 0, 100), Err(BalanceError::ZeroTrainers));
            assert_eq!(
                plan(&[10], usize::MAX, 100),
                Err(BalanceError::TooManyTrainers {
                    trainers: (usize::MAX) as u64,
                    max: MAX_TRAINERS as u64
                })
            );
            assert!(plan(&[10], MAX_TRAINERS, 100).is_ok());
            assert_eq!(plan(&[], 2, 100), Err(BalanceError::EmptyMinibatch));
            assert_eq!(plan(&[10], 2, 0), Err(BalanceError::ZeroBudget));
            assert_eq!(
                plan(&[10, 0], 2, 100),
                Err(BalanceError::ZeroLength { sample: 1 })
            );
            assert_eq!(
                plan(&[10, 101], 2, 100),
                Err(BalanceError::SampleExceedsBudget {
                    sample: 1,
                    tokens: 101,
                    budget: 100
                })
            );
        }
        assert_eq!(
            plan_dynamic(&[], &m, 2, 100),
            Err(BalanceError::EmptyMinibatch)
        );
        assert_eq!(plan_dynamic(&[5], &m, 2, 0), Err(BalanceError::ZeroBudget));
        assert_eq!(
            plan_dynamic(&[0], &m, 2, 10),
            Err(BalanceError::ZeroLength { sample: 0 })
        );
        let bad = CostModel::quadratic(-1.0, 0.0);
        assert!(matches!(
            plan_dynamic(&[5], &bad, 2, 10),
            Err(BalanceError::InvalidCostModel { field, .. }) if field == "a"
        ));
        let huge = CostModel::quadratic(0.0, f64::MAX);
        assert!(matches!(
            plan_static(&[32_000, 32_000, 64_000], &huge, 2, 64_000),
            Err(BalanceError::NonFiniteCost { sample: 2, .. })
                | Err(BalanceError::CostOverflow { .. })
        ));
        let big = CostModel::quadratic(0.0, f64::MAX / 2.0);
        assert!(matches!(
            plan_dynamic(&[32_000, 32_000, 32_000], &big, 2, 64_000),
            Err(BalanceError::CostOverflow { .. })
        ));
    }

    #[test]
    fn plan_static_is_lb_mini_counts_may_differ() {
        // One long sample balances against many short ones: counts differ across trainers.
        let tokens = [60_000, 10_000, 10_000, 10_000, 10_000, 10_000, 10_000];
        let m = CostModel::linear();
        let plan = plan_static(&tokens, &m, 2, 65_536).unwrap();
        assert_plan_valid(&plan, &tokens, &m, 65_536);
        let mut counts: Vec<usize> = plan.per_trainer.iter().map(Vec::len).collect();
        counts.sort_unstable();
        assert_eq!(counts, vec![1, 1]);
        let costs = plan.trainer_costs();
        assert!((costs[0] - costs[1]).abs() < 1e-9);

        // Budget forces the short samples into several micro-batches.
        let plan = plan_static(&tokens, &m, 2, 60_000).unwrap();
        assert_plan_valid(&plan, &tokens, &m, 60_000);
        let mut counts: Vec<usize> = plan.per_trainer.iter().map(Vec::len).collect();
        counts.sort_unstable();
        assert_eq!(counts, vec![1, 1]);
        let plan = plan_static(&tokens, &m, 2, 30_000);
        assert!(matches!(
            plan,
            Err(BalanceError::SampleExceedsBudget { sample: 0, .. })
        ));
    }

    #[test]
    fn plan_static_more_trainers_than_samples() {
        let tokens = [100, 200];
        let m = CostModel::default();
        let plan = plan_static(&tokens, &m, 5, 1000).unwrap();
        assert_plan_valid(&plan, &tokens, &m, 1000);
        let per_trainer = plan.per_trainer;
        assert_eq!(per_trainer.len(), 5);
        assert_eq!(per_trainer.iter().filter(|l| l.is_empty()).count(), 3);
    }

    #[test]
    fn plan_dynamic_is_lb_mini_in_decreasing_sizes() {
        let tokens = [1_000, 30_000, 2_000, 20_000, 15_000, 3_000, 2_500, 1_500];
        let m = CostModel::odc_7b();
        for trainers in 1..=4 {
            let plan = plan_dynamic(&tokens, &m, trainers, 32_000).unwrap();
            assert_plan_valid(&plan, &tokens, &m, 32_000);
            let fixed = plan_static(&tokens, &m, trainers, 32_000).unwrap();
            assert_eq!(samples_of(&plan), samples_of(&fixed), "same partition");
            for list in &plan.per_trainer {
                // Each list ends with its cheapest micro-batch, a single sample.
                if let Some(&last) = list.last() {
                    assert_eq!(plan.micro_batches[last].samples.len(), 1);
                }
            }
        }
        let one = plan_dynamic(&tokens, &m, 1, 32_000).unwrap();
        assert!(
            one.micro_batches.len()
                > plan_static(&tokens, &m, 1, 32_000)
                    .unwrap()
                    .micro_batches
                    .len()
        );
    }

    #[test]
    fn a_priced_transfer_keeps_dynamic_micro_batches_large_enough_to_hide_it() {
        // One trainer, 16 samples of 2,000 tokens (linear: 1/16 each); guided packing halves
        // what is left down to single samples, each of which pays a whole transfer.
        let tokens = [2_000u64; 16];
        let m = CostModel::linear();
        let guided = plan_dynamic(&tokens, &m, 1, 65_536).unwrap();
        assert_eq!(guided.micro_batches.len(), 5, "8, 4, 2, 1, 1 samples");
        let priced = m.with_transfer(0.2);
        let plan = plan_dynamic(&tokens, &priced, 1, 65_536).unwrap();
        let sizes: Vec<usize> = plan
            .micro_batches
            .iter()
            .map(|mb| mb.samples.len())
            .collect();
        assert_eq!(
            sizes,
            [8, 4, 4],
            "no micro-batch under 0.2 while enough is left"
        );
        let total: f64 = plan.trainer_costs().iter().sum();
        let priced_guided: f64 = guided
            .micro_batches
            .iter()
            .map(|mb| priced.micro_batch(mb.cost))
            .sum();
        assert!(total < priced_guided, "{total} vs {priced_guided}");
        // Static plans price each micro-batch at least at its transfers too.
        let fixed = plan_static(&[1_000, 1_000], &priced, 2, 65_536).unwrap();
        assert_eq!(fixed.trainer_costs(), [0.2, 0.2]);
    }

    #[test]
    fn plan_equal_count_counts_are_equal_and_rounds_are_balanced() {
        let tokens: Vec<u64> = (1..=23).map(|i| i * 1_000).collect();
        let m = CostModel::odc_1_5b();
        for trainers in 1..=9 {
            let plan = plan_equal_count(&tokens, &m, trainers, 24_000).unwrap();
            assert_plan_valid(&plan, &tokens, &m, 24_000);
            let per_trainer = &plan.per_trainer;
            assert_eq!(per_trainer.len(), trainers);
            assert_eq!(count_spread(per_trainer), 0);
        }
        // A collective-friendly plan of many short samples: one round, every trainer busy.
        let short = vec![4_000u64; 32];
        let plan = plan_equal_count(&short, &m, 8, 65_536).unwrap();
        assert_eq!(plan.micro_batches.len(), 8);
        let costs: Vec<f64> = plan.micro_batches.iter().map(|mb| mb.cost).collect();
        assert!(
            costs.iter().all(|&c| (c - costs[0]).abs() < 1e-9),
            "{costs:?}"
        );
    }

    proptest! {
        #[test]
        fn plans_place_every_sample_once_within_budget(
            tokens in prop::collection::vec(1u64..32_000, 1..80),
            trainers in 1usize..9,
            budget in 32_000u64..70_000,
            quadratic in any::<bool>(),
            transfer in prop_oneof![Just(0.0), 0.0f64..4.0],
        ) {
            let m = if quadratic { CostModel::odc_7b() } else { CostModel::linear() };
            let m = m.with_transfer(transfer);
            let s = plan_static(&tokens, &m, trainers, budget).unwrap();
            assert_plan_valid(&s, &tokens, &m, budget);
            prop_assert_eq!(s.per_trainer.len(), trainers);
            let d = plan_dynamic(&tokens, &m, trainers, budget).unwrap();
            assert_plan_valid(&d, &tokens, &m, budget);
            prop_assert_eq!(samples_of(&d), samples_of(&s));
            let e = plan_equal_count(&tokens, &m, trainers, budget).unwrap();
            assert_plan_valid(&e, &tokens, &m, budget);
            prop_assert_eq!(count_spread(&e.per_trainer), 0);
            prop_assert_eq!(s.num_samples(), tokens.len());
        }

        #[test]
        fn plan_static_balances_samples_no_worse_than_greedy(
            tokens in prop::collection::vec(1u64..64_000, 1..80),
            trainers in 1usize..9,
        ) {
            let m = CostModel::odc_7b();
            let plan = plan_static(&tokens, &m, trainers, 65_536).unwrap();
            let costs: Vec<f64> = tokens.iter().map(|&t| m.cost(t)).collect();
            let worst = plan
                .trainer_costs()
                .into_iter()
                .fold(0.0, f64::max);
            let greedy = max_load(&costs, &greedy_partition(&costs, trainers));
            prop_assert!(worst <= greedy * (1.0 + 1e-12));
        }
    }
}
