//! Cutting one causal sample across a gang of trainers (context parallelism).
//!
//! A sample of `T` tokens split over a gang of `k` members is cut into `2k` contiguous chunks of
//! near-equal length, and member `m` holds chunks `m` and `2k − 1 − m` ("zig-zag", the
//! load-balanced layout of Megatron's context parallelism and of striped ring attention). Under a
//! causal mask query `i` attends to `i + 1` keys, so a chunk's attention work grows with its
//! position; pairing an early chunk with its mirror image gives every member the same work.
//!
//! Invariants (tested below, as properties):
//! - every token of the sample is held by exactly one member, in two ranges that do not overlap;
//! - with `T` a multiple of `2k` every member's causal work ([`causal_pairs`]) is exactly equal,
//!   and otherwise it differs by at most `2T` query–key pairs (a rounding of one token per chunk);
//! - every member holds `T / k` tokens within 2: the layers outside attention are balanced too;
//! - a cut that cannot be made (no member, fewer than two tokens per member) is an error naming
//!   the numbers, never a panic or an empty chunk.

use std::ops::Range;

use super::SplitError;

/// The two token ranges of each member, in member order: member `m` holds chunks `m` and
/// `2k − 1 − m` of `2k` near-equal chunks of `0..tokens`.
///
/// ```
/// use odc_policy::split::zigzag;
/// // 8 tokens over 2 members: chunks 0..2, 2..4, 4..6, 6..8.
/// assert_eq!(zigzag(8, 2).unwrap(), vec![[0..2, 6..8], [2..4, 4..6]]);
/// ```
pub fn zigzag(tokens: u64, members: u32) -> Result<Vec<[Range<u64>; 2]>, SplitError> {
    if members == 0 {
        return Err(SplitError::NoMembers);
    }
    let chunks = 2 * u64::from(members);
    if tokens < chunks {
        return Err(SplitError::TooShort {
            tokens,
            members,
            chunks,
        });
    }
    let bound = |c: u64| -> u64 {
        // `c · tokens / chunks` without overflow: chunk lengths differ by at most one token.
        (u128::from(c) * u128::from(tokens) / u128::from(chunks)) as u64
    };
    let chunk = |c: u64| bound(c)..bound(c + 1);
    Ok((0..u64::from(members))
        .map(|m| [chunk(m), chunk(chunks - 1 - m)])
        .collect())
}

/// Query–key pairs a causal mask allows for the queries `range` of a sample (query `i` attends
/// to keys `0..=i`): the attention work of those rows.
pub fn causal_pairs(range: &Range<u64>) -> u128 {
    let triangle = |n: u64| u128::from(n) * (u128::from(n) + 1) / 2;
    triangle(range.end).saturating_sub(triangle(range.start))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn bad_cuts_are_errors_naming_the_numbers() {
        assert_eq!(zigzag(100, 0), Err(SplitError::NoMembers));
        let e = zigzag(5, 3).expect_err("5 tokens for 3 members");
        assert_eq!(
            e,
            SplitError::TooShort {
                tokens: 5,
                members: 3,
                chunks: 6
            }
        );
        assert!(e.to_string().contains("5 tokens"), "{e}");
        // The smallest cut that works: one token per chunk.
        assert_eq!(zigzag(6, 3).expect("6 tokens").len(), 3);
    }

    #[test]
    fn one_member_holds_the_whole_sample_in_two_halves() {
        assert_eq!(zigzag(9, 1).unwrap(), vec![[0..4, 4..9]]);
    }

    #[test]
    fn causal_pairs_count_the_triangle() {
        assert_eq!(causal_pairs(&(0..4)), 10);
        assert_eq!(causal_pairs(&(2..4)), 7);
        assert_eq!(causal_pairs(&(3..3)), 0);
    }

    proptest! {
        #[test]
        fn every_token_once_and_the_work_balanced(tokens in 2u64..200_000, members in 1u32..64) {
            prop_assume!(tokens >= 2 * u64::from(members));
            let cut = zigzag(tokens, members).unwrap();
            prop_assert_eq!(cut.len(), members as usize);
            // Every token exactly once: the ranges, sorted, tile 0..tokens without a gap.
            let mut ranges: Vec<Range<u64>> = cut.iter().flat_map(|pair| pair.iter().cloned()).collect();
            prop_assert!(ranges.iter().all(|r| !r.is_empty()));
            ranges.sort_by_key(|r| r.start);
            let mut at = 0;
            for r in &ranges {
                prop_assert_eq!(r.start, at);
                at = r.end;
            }
            prop_assert_eq!(at, tokens);
            // Balanced causal work.
            let work: Vec<u128> = cut.iter().map(|[a, b]| causal_pairs(a) + causal_pairs(b)).collect();
            let (lo, hi) = (*work.iter().min().unwrap(), *work.iter().max().unwrap());
            if tokens % (2 * u64::from(members)) == 0 {
                prop_assert_eq!(lo, hi);
            } else {
                prop_assert!(hi - lo <= 2 * u128::from(tokens), "{work:?}");
            }
            prop_assert_eq!(work.iter().sum::<u128>(), causal_pairs(&(0..tokens)));
            // Token-balanced too (what the layers outside attention do): members' token counts
            // differ by at most 2, so remapping tokens for those layers has nothing to gain.
            let held: Vec<u64> = cut.iter().map(|[a, b]| (a.end - a.start) + (b.end - b.start)).collect();
            let (fewest, most) = (*held.iter().min().unwrap(), *held.iter().max().unwrap());
            prop_assert!(most - fewest <= 2, "{held:?}");
        }
    }
}
