//! Token-budget packing of samples into micro-batches.
//!
//! - [`pack`]: first-fit decreasing, the fewest micro-batches;
//! - [`pack_even`]: as few micro-batches as [`pack`] makes (or fewer), of near-equal cost (static
//!   plans: no small last micro-batch that cannot hide its transfers);
//! - [`pack_guided`]: micro-batches of decreasing size, each about half of what is left (guided
//!   self-scheduling, for dynamic dispatch: the small ones at the end even out the step).
//!
//! Guarantees of all three on success: every requested sample index appears in exactly one
//! micro-batch, no micro-batch is empty, and the token sum of every micro-batch is at most the
//! budget. The result is deterministic (ties are broken by sample index).

use super::{partition, BalanceError};

/// Checks that `samples` are distinct indices into `tokens`, each of 1 to `budget` tokens.
fn check_samples(tokens: &[u64], samples: &[usize], budget: u64) -> Result<(), BalanceError> {
    if budget == 0 {
        return Err(BalanceError::ZeroBudget);
    }
    let mut seen = vec![false; tokens.len()];
    for &sample in samples {
        let Some(&len) = tokens.get(sample) else {
            return Err(BalanceError::SampleOutOfRange {
                sample: sample as u64,
                len: tokens.len() as u64,
            });
        };
        if std::mem::replace(&mut seen[sample], true) {
            return Err(BalanceError::DuplicateSample {
                sample: sample as u64,
            });
        }
        if len == 0 {
            return Err(BalanceError::ZeroLength {
                sample: sample as u64,
            });
        }
        if len > budget {
            return Err(BalanceError::SampleExceedsBudget {
                sample: sample as u64,
                tokens: len,
                budget,
            });
        }
    }
    Ok(())
}

/// Packs the samples `samples` (indices into `tokens`) into micro-batches whose token sum is at
/// most `budget`, first-fit decreasing: samples are taken longest first (ties by index) and each
/// goes into the first micro-batch that still has room, or opens a new one. Within a micro-batch
/// samples are listed in the order they were placed (longest first).
///
/// An empty `samples` gives no micro-batches. Errors: [`BalanceError::ZeroBudget`],
/// [`BalanceError::SampleOutOfRange`], [`BalanceError::DuplicateSample`],
/// [`BalanceError::ZeroLength`], [`BalanceError::SampleExceedsBudget`].
///
/// ```
/// use odc_policy::balancer::pack;
/// let tokens = [600, 500, 400, 300];
/// let mbs = pack(&tokens, &[0, 1, 2, 3], 1000).unwrap();
/// assert_eq!(mbs, vec![vec![0, 2], vec![1, 3]]);
/// ```
pub fn pack(
    tokens: &[u64],
    samples: &[usize],
    budget: u64,
) -> Result<Vec<Vec<usize>>, BalanceError> {
    check_samples(tokens, samples, budget)?;

    let mut order: Vec<(u64, usize)> = samples.iter().map(|&s| (tokens[s], s)).collect();
    order.sort_unstable_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));

    // (remaining room, samples) per open micro-batch.
    let mut bins: Vec<(u64, Vec<usize>)> = Vec::new();
    for (len, sample) in order {
        match bins.iter_mut().find(|(room, _)| *room >= len) {
            Some((room, members)) => {
                *room -= len;
                members.push(sample);
            }
            None => bins.push((budget - len, vec![sample])),
        }
    }
    Ok(bins.into_iter().map(|(_, members)| members).collect())
}

/// Packs `samples` into micro-batches of **near-equal cost**, no more of them than [`pack`]
/// makes: the fewest parts that can hold the tokens, `⌈Σ tokens / budget⌉`, partitioned by cost
/// (Karmarkar–Karp, [`partition`](fn@super::partition)); while some part exceeds the budget, one
/// more part; if that reaches [`pack`]'s count without fitting, [`pack`]'s micro-batches. Within a
/// micro-batch samples are listed longest first (ties by index).
///
/// Why: every micro-batch pulls and pushes the whole model once, overlapped with its compute.
/// First-fit fills the first micro-batches to the budget and leaves a small last one whose compute
/// cannot hide those transfers (on a modelled H100 cluster at 64 devices, RL-like lengths: 0.86
/// of the achievable step with first-fit, 0.99 with this). Total compute is the same either way.
/// Errors: those of [`pack`], plus [`BalanceError::SampleOutOfRange`] for a sample without a cost.
///
/// ```
/// use odc_policy::balancer::{pack, pack_even};
/// let tokens = [9_000, 5_000, 3_000, 1_000];
/// let costs = [9.0, 5.0, 3.0, 1.0];
/// let all = [0, 1, 2, 3];
/// assert_eq!(pack(&tokens, &all, 16_000).unwrap(), vec![vec![0, 1, 3], vec![2]]);
/// assert_eq!(pack_even(&tokens, &costs, &all, 16_000).unwrap(), vec![vec![0], vec![1, 2, 3]]);
/// ```
pub fn pack_even(
    tokens: &[u64],
    costs: &[f64],
    samples: &[usize],
    budget: u64,
) -> Result<Vec<Vec<usize>>, BalanceError> {
    let first_fit = pack(tokens, samples, budget)?;
    if let Some(&sample) = samples.iter().find(|&&s| s >= costs.len()) {
        return Err(BalanceError::SampleOutOfRange {
            sample: sample as u64,
            len: costs.len() as u64,
        });
    }
    let total: u64 = samples.iter().map(|&s| tokens[s]).sum();
    let fewest = (total.div_ceil(budget) as usize).max(1);
    let sub: Vec<f64> = samples.iter().map(|&s| costs[s]).collect();
    for k in fewest..=first_fit.len() {
        let mut groups: Vec<Vec<usize>> = partition(&sub, k, false)
            .into_iter()
            .filter(|g| !g.is_empty())
            .map(|g| g.into_iter().map(|i| samples[i]).collect())
            .collect();
        if groups
            .iter()
            .all(|g| g.iter().map(|&s| tokens[s]).sum::<u64>() <= budget)
        {
            for g in &mut groups {
                g.sort_by(|&x, &y| tokens[y].cmp(&tokens[x]).then(x.cmp(&y)));
            }
            groups.sort_by_key(|g| {
                g.first()
                    .copied()
                    .map(|s| (std::cmp::Reverse(tokens[s]), s))
            });
            return Ok(groups);
        }
    }
    Ok(first_fit)
}

/// Relative slack under which a micro-batch still counts as within its cost target.
const TARGET_SLACK: f64 = 1e-9;

/// Packs `samples` (indices into `tokens`, with `costs` per sample) into micro-batches of
/// **decreasing size** for one trainer's list in dynamic dispatch (guided self-scheduling):
/// each next micro-batch targets half of the cost still unpacked. Samples are visited costliest
/// first (ties: more tokens first, then lower index); the first one visited always opens the
/// micro-batch (so each holds at least one sample), each further one joins if it keeps the
/// micro-batch within both the token `budget` and the cost target, else it waits for a later one.
///
/// Hence: every micro-batch of two or more samples costs at most half of what was left when it
/// was made; the last one is a single sample and the cheapest micro-batch of all; there are about
/// `log2(samples) + 1` micro-batches when the budget does not bind. They are returned in the
/// order made (not necessarily sorted by cost). Errors: those of [`pack`], plus
/// [`BalanceError::SampleOutOfRange`] for a sample without a cost.
///
/// ```
/// use odc_policy::balancer::pack_guided;
/// let tokens = [100; 8];
/// let costs = [1.0; 8];
/// let mbs = pack_guided(&tokens, &costs, &[0, 1, 2, 3, 4, 5, 6, 7], 1_000).unwrap();
/// let sizes: Vec<usize> = mbs.iter().map(Vec::len).collect();
/// assert_eq!(sizes, vec![4, 2, 1, 1]);
/// ```
pub fn pack_guided(
    tokens: &[u64],
    costs: &[f64],
    samples: &[usize],
    budget: u64,
) -> Result<Vec<Vec<usize>>, BalanceError> {
    pack_guided_filled(tokens, costs, samples, budget, 0, 0.0)
}

/// [`pack_guided`] with a **fill floor**: a micro-batch holding fewer than `min_tokens` tokens, or
/// costing less than `min_cost` (a micro-batch's transfers, [`CostModel::transfer`](super::CostModel)),
/// also takes the next sample visited that fits the `budget`, past its cost target. Each
/// micro-batch runs the whole model once (and on odc gathers every unit once), so tiny ones cost
/// more than their samples; the floor keeps them at least `min_tokens` large while enough is
/// left, still in decreasing size. `min_tokens = 0` and `min_cost = 0` is [`pack_guided`]. Hence:
/// every micro-batch of two or more samples costs at most half of what was left when it was made
/// **or** held fewer than `min_tokens` tokens, or cost less than `min_cost`, before its last
/// sample joined.
///
/// ```
/// use odc_policy::balancer::{pack_guided, pack_guided_filled};
/// let tokens = [100; 8];
/// let costs = [1.0; 8];
/// let all = [0, 1, 2, 3, 4, 5, 6, 7];
/// let sizes = |mbs: Vec<Vec<usize>>| mbs.iter().map(Vec::len).collect::<Vec<_>>();
/// assert_eq!(sizes(pack_guided_filled(&tokens, &costs, &all, 1_000, 300, 0.0).unwrap()), [4, 3, 1]);
/// assert_eq!(sizes(pack_guided_filled(&tokens, &costs, &all, 1_000, 0, 3.0).unwrap()), [4, 3, 1]);
/// assert_eq!(
///     pack_guided_filled(&tokens, &costs, &all, 1_000, 0, 0.0),
///     pack_guided(&tokens, &costs, &all, 1_000)
/// );
/// ```
pub fn pack_guided_filled(
    tokens: &[u64],
    costs: &[f64],
    samples: &[usize],
    budget: u64,
    min_tokens: u64,
    min_cost: f64,
) -> Result<Vec<Vec<usize>>, BalanceError> {
    check_samples(tokens, samples, budget)?;
    if let Some(&sample) = samples.iter().find(|&&s| s >= costs.len()) {
        return Err(BalanceError::SampleOutOfRange {
            sample: sample as u64,
            len: costs.len() as u64,
        });
    }
    let mut left: Vec<usize> = samples.to_vec();
    left.sort_by(|&x, &y| {
        costs[y]
            .total_cmp(&costs[x])
            .then(tokens[y].cmp(&tokens[x]))
            .then(x.cmp(&y))
    });
    let mut remaining: f64 = left.iter().map(|&s| costs[s]).sum();
    let mut out = Vec::new();
    while !left.is_empty() {
        let target = remaining / 2.0;
        let (mut cost, mut used) = (0.0, 0u64);
        let mut members = Vec::new();
        left.retain(|&s| {
            let fits = used.saturating_add(tokens[s]) <= budget
                && (used < min_tokens
                    || cost < min_cost
                    || cost + costs[s] <= target + TARGET_SLACK * target.abs().max(1.0));
            if members.is_empty() || fits {
                members.push(s);
                cost += costs[s];
                used += tokens[s];
                false
            } else {
                true
            }
        });
        remaining = left.iter().map(|&s| costs[s]).sum();
        out.push(members);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pack_first_fit_decreasing_known_instance() {
        let tokens = [600, 500, 400, 300, 200, 1000];
        let mbs = pack(&tokens, &[0, 1, 2, 3, 4, 5], 1000).unwrap();
        assert_eq!(mbs, vec![vec![5], vec![0, 2], vec![1, 3, 4]]);
    }

    #[test]
    fn pack_only_the_requested_subset() {
        let tokens = [10, 20, 30, 40];
        let mbs = pack(&tokens, &[3, 1], 50).unwrap();
        assert_eq!(mbs, vec![vec![3], vec![1]]);
        assert_eq!(pack(&tokens, &[], 50), Ok(vec![]));
    }

    #[test]
    fn pack_errors_for_bad_input() {
        let tokens = [10, 0, 70];
        assert_eq!(pack(&tokens, &[0], 0), Err(BalanceError::ZeroBudget));
        assert_eq!(
            pack(&tokens, &[0, 3], 50),
            Err(BalanceError::SampleOutOfRange { sample: 3, len: 3 })
        );
        assert_eq!(
            pack(&tokens, &[0, 0], 50),
            Err(BalanceError::DuplicateSample { sample: 0 })
        );
        assert_eq!(
            pack(&tokens, &[1], 50),
            Err(BalanceError::ZeroLength { sample: 1 })
        );
        assert_eq!(
            pack(&tokens, &[0, 2], 50),
            Err(BalanceError::SampleExceedsBudget {
                sample: 2,
                tokens: 70,
                budget: 50
            })
        );
    }

    #[test]
    fn pack_handles_extreme_lengths_without_overflow() {
        let tokens = [u64::MAX, u64::MAX - 1, 1];
        let mbs = pack(&tokens, &[0, 1, 2], u64::MAX).unwrap();
        assert_eq!(mbs, vec![vec![0], vec![1, 2]]);
    }

    #[test]
    fn pack_even_leaves_no_small_last_micro_batch() {
        // First fit: 15,000 + 3,000 tokens; even: 9,000 + 9,000 (costs linear in tokens).
        let tokens = [9_000, 5_000, 3_000, 1_000];
        let costs = tokens.map(|t| t as f64 / 1_000.0);
        let all = [0, 1, 2, 3];
        let cost = |mbs: &[Vec<usize>]| -> Vec<f64> {
            mbs.iter()
                .map(|mb| mb.iter().map(|&s| costs[s]).sum())
                .collect()
        };
        assert_eq!(cost(&pack(&tokens, &all, 16_000).unwrap()), [15.0, 3.0]);
        assert_eq!(
            cost(&pack_even(&tokens, &costs, &all, 16_000).unwrap()),
            [9.0, 9.0]
        );
        // Where no even cut fits the budget, first fit's micro-batches.
        let tight = [8_000, 8_000, 4_000, 4_000];
        let c = tight.map(|t| t as f64);
        let mbs = pack_even(&tight, &c, &all, 12_000).unwrap();
        assert_eq!(mbs.len(), 2);
        assert!(mbs
            .iter()
            .all(|mb| mb.iter().map(|&s| tight[s]).sum::<u64>() <= 12_000));
        assert_eq!(
            pack_even(&tight, &c[..2], &all, 12_000).unwrap_err(),
            BalanceError::SampleOutOfRange { sample: 2, len: 2 }
        );
    }

    #[test]
    fn pack_guided_halves_what_is_left() {
        let tokens = [100u64; 16];
        let costs = [1.0; 16];
        let all: Vec<usize> = (0..16).collect();
        let mbs = pack_guided(&tokens, &costs, &all, 10_000).unwrap();
        let sizes: Vec<usize> = mbs.iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![8, 4, 2, 1, 1]);
        // The token budget caps a micro-batch; sizes still shrink.
        let mbs = pack_guided(&tokens, &costs, &all, 300).unwrap();
        let sizes: Vec<usize> = mbs.iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![3, 3, 3, 3, 2, 1, 1]);
        // A sample costlier than half of everything opens its own micro-batch.
        let costs = [10.0, 1.0, 1.0, 1.0, 1.0];
        let mbs = pack_guided(&[5, 1, 1, 1, 1], &costs, &[0, 1, 2, 3, 4], 100).unwrap();
        assert_eq!(mbs, vec![vec![0], vec![1, 2], vec![3], vec![4]]);
        assert_eq!(pack_guided(&tokens, &[1.0; 16], &[], 10), Ok(vec![]));
        assert_eq!(
            pack_guided(&tokens, &[1.0; 2], &[3], 1_000),
            Err(BalanceError::SampleOutOfRange { sample: 3, len: 2 })
        );
        assert_eq!(
            pack_guided(&tokens, &costs, &[0, 0], 1_000),
            Err(BalanceError::DuplicateSample { sample: 0 })
        );
    }

    proptest! {
        #[test]
        fn pack_places_every_sample_once_within_budget(
            tokens in prop::collection::vec(1u64..5_000, 0..120),
            budget in 5_000u64..20_000,
        ) {
            let samples: Vec<usize> = (0..tokens.len()).collect();
            let mbs = pack(&tokens, &samples, budget).unwrap();
            let mut placed: Vec<usize> = mbs.iter().flatten().copied().collect();
            placed.sort_unstable();
            prop_assert_eq!(placed, samples);
            for mb in &mbs {
                prop_assert!(!mb.is_empty());
                prop_assert!(mb.iter().map(|&s| tokens[s]).sum::<u64>() <= budget);
            }
            // First fit leaves at most one micro-batch at most half full: a later one's samples
            // would all have fitted into the earlier one.
            let half_full = mbs
                .iter()
                .filter(|mb| 2 * mb.iter().map(|&s| tokens[s]).sum::<u64>() <= budget)
                .count();
            prop_assert!(half_full <= 1);
        }
        #[test]
        fn pack_guided_decreasing_sizes_every_sample_once_within_budget(
            tokens in prop::collection::vec(1u64..5_000, 0..120),
            budget in 5_000u64..20_000,
        ) {
            let costs: Vec<f64> = tokens.iter().map(|&t| (t as f64).powf(1.5)).collect();
            let samples: Vec<usize> = (0..tokens.len()).collect();
            let mbs = pack_guided(&tokens, &costs, &samples, budget).unwrap();
            let mut placed: Vec<usize> = mbs.iter().flatten().copied().collect();
            placed.sort_unstable();
            prop_assert_eq!(placed, samples);
            let mut left: f64 = costs.iter().sum();
            for mb in &mbs {
                prop_assert!(!mb.is_empty());
                prop_assert!(mb.iter().map(|&s| tokens[s]).sum::<u64>() <= budget);
                let cost: f64 = mb.iter().map(|&s| costs[s]).sum();
                if mb.len() > 1 {
                    prop_assert!(cost <= left / 2.0 + 1e-6 * left.max(1.0), "{} of {}", cost, left);
                }
                left -= cost;
            }
            // Ends with one sample, the cheapest micro-batch of all: each earlier one holds a
            // sample at least as costly (the costliest left when it was made).
            if let Some(last) = mbs.last() {
                prop_assert_eq!(last.len(), 1);
                for mb in &mbs {
                    prop_assert!(mb.iter().map(|&s| costs[s]).sum::<f64>() >= costs[last[0]]);
                }
            }
        }

        #[test]
        fn pack_guided_filled_keeps_micro_batches_full_enough_every_sample_once(
            tokens in prop::collection::vec(1u64..5_000, 0..120),
            budget in 5_000u64..20_000,
            fill in 0.0f64..=1.0,
            cost_floor in 0.0f64..=0.5,
        ) {
            let min_tokens = (fill * budget as f64) as u64;
            let costs: Vec<f64> = tokens.iter().map(|&t| (t as f64).powf(1.5)).collect();
            let min_cost = cost_floor * costs.iter().sum::<f64>();
            let samples: Vec<usize> = (0..tokens.len()).collect();
            let mbs =
                pack_guided_filled(&tokens, &costs, &samples, budget, min_tokens, min_cost).unwrap();
            let mut placed: Vec<usize> = mbs.iter().flatten().copied().collect();
            placed.sort_unstable();
            prop_assert_eq!(placed, samples);
            let mut left: f64 = costs.iter().sum();
            let mut left_tokens: u64 = tokens.iter().sum();
            for (k, mb) in mbs.iter().enumerate() {
                let size: u64 = mb.iter().map(|&s| tokens[s]).sum();
                prop_assert!(!mb.is_empty() && size <= budget);
                let cost: f64 = mb.iter().map(|&s| costs[s]).sum();
                let last = *mb.last().unwrap();
                let before_last = size - tokens[last];
                if mb.len() > 1 {
                    prop_assert!(
                        cost <= left / 2.0 + 1e-6 * left.max(1.0)
                            || before_last < min_tokens
                            || cost - costs[last] < min_cost,
                        "{} of {}", cost, left
                    );
                }
                // Under either floor only when nothing else that was left would have fitted.
                if (size < min_tokens || cost < min_cost) && k + 1 < mbs.len() {
                    let rest = mbs[k + 1..].iter().flatten();
                    let smallest = rest.map(|&s| tokens[s]).min().unwrap();
                    prop_assert!(size + smallest > budget, "{} under a floor", size);
                }
                left -= cost;
                left_tokens -= size;
            }
            prop_assert_eq!(left_tokens, 0);
            // The floors never make more micro-batches than guided packing without them.
            let plain = pack_guided(&tokens, &costs, &(0..tokens.len()).collect::<Vec<_>>(), budget)
                .unwrap();
            prop_assert!(mbs.len() <= plain.len(), "{} > {}", mbs.len(), plain.len());
        }

        #[test]
        fn pack_even_places_every_sample_once_in_no_more_micro_batches_than_first_fit(
            tokens in prop::collection::vec(1u64..5_000, 0..120),
            budget in 5_000u64..20_000,
        ) {
            let costs: Vec<f64> = tokens.iter().map(|&t| (t as f64).powf(1.5)).collect();
            let samples: Vec<usize> = (0..tokens.len()).collect();
            let mbs = pack_even(&tokens, &costs, &samples, budget).unwrap();
            let mut placed: Vec<usize> = mbs.iter().flatten().copied().collect();
            placed.sort_unstable();
            prop_assert_eq!(placed, samples.clone());
            for mb in &mbs {
                prop_assert!(!mb.is_empty());
                prop_assert!(mb.iter().map(|&s| tokens[s]).sum::<u64>() <= budget);
                prop_assert!(mb.windows(2).all(|w| tokens[w[0]] >= tokens[w[1]]), "longest first");
            }
            let first_fit = pack(&tokens, &samples, budget).unwrap();
            prop_assert!(mbs.len() <= first_fit.len(), "{} > {}", mbs.len(), first_fit.len());
            prop_assert!(mbs.len() as u64 >= tokens.iter().sum::<u64>().div_ceil(budget));
        }
    }
}
