//! Token-budget packing of samples into micro-batches (first-fit decreasing).
//!
//! Guarantees of [`pack`] on success: every requested sample index appears in exactly one
//! micro-batch, no micro-batch is empty, and the token sum of every micro-batch is at most the
//! budget. The result is deterministic (ties are broken by sample index).

use super::BalanceError;

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
/// use odc_actors::policy::balancer::pack;
/// let tokens = [600, 500, 400, 300];
/// let mbs = pack(&tokens, &[0, 1, 2, 3], 1000).unwrap();
/// assert_eq!(mbs, vec![vec![0, 2], vec![1, 3]]);
/// ```
pub fn pack(
    tokens: &[u64],
    samples: &[usize],
    budget: u64,
) -> Result<Vec<Vec<usize>>, BalanceError> {
    if budget == 0 {
        return Err(BalanceError::ZeroBudget);
    }
    let mut seen = vec![false; tokens.len()];
    for &sample in samples {
        let Some(&len) = tokens.get(sample) else {
            return Err(BalanceError::SampleOutOfRange {
                sample,
                len: tokens.len(),
            });
        };
        if std::mem::replace(&mut seen[sample], true) {
            return Err(BalanceError::DuplicateSample { sample });
        }
        if len == 0 {
            return Err(BalanceError::ZeroLength { sample });
        }
        if len > budget {
            return Err(BalanceError::SampleExceedsBudget {
                sample,
                tokens: len,
                budget,
            });
        }
    }

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
    }
}
