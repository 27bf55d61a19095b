//! Splitting large transfers into chunks (contract C5).
//!
//! A gather of a unit or a push of its gradient is split into chunks of a configurable number of
//! elements; callers issue the chunks concurrently to every owner at once, so no single transfer
//! serialises the whole unit. [`chunk_ranges`] is the one place that arithmetic lives.

use std::ops::Range;

/// Split the element range `range` into consecutive chunks of at most `chunk_elems` elements.
///
/// The chunks are contiguous, in order, non-empty, cover `range` exactly and all but the last hold
/// exactly `chunk_elems` elements. An empty (or reversed) `range` yields no chunks. A `chunk_elems`
/// of 0 is clamped to 1, so the split is always well defined.
///
/// ```
/// let chunks: Vec<_> = odc_transport::chunk_ranges(3..13, 4).collect();
/// assert_eq!(chunks, vec![3..7, 7..11, 11..13]);
/// assert_eq!(odc_transport::chunk_ranges(5..5, 4).count(), 0);
/// ```
pub fn chunk_ranges(
    range: Range<usize>,
    chunk_elems: usize,
) -> impl ExactSizeIterator<Item = Range<usize>> + Clone {
    let step = chunk_elems.max(1);
    let end = range.end;
    range
        .step_by(step)
        .map(move |start| start..start.saturating_add(step).min(end))
}

#[cfg(test)]
mod tests {
    use super::chunk_ranges;
    use proptest::prelude::*;

    #[test]
    fn zero_chunk_size_is_clamped_to_one() {
        let chunks: Vec<_> = chunk_ranges(2..5, 0).collect();
        assert_eq!(chunks, vec![2..3, 3..4, 4..5]);
    }

    #[test]
    fn reversed_range_yields_nothing() {
        let (start, end) = (9, 4);
        assert_eq!(chunk_ranges(start..end, 3).count(), 0);
    }

    #[test]
    fn range_ending_at_usize_max_does_not_overflow() {
        let chunks: Vec<_> = chunk_ranges(usize::MAX - 5..usize::MAX, 4).collect();
        assert_eq!(
            chunks,
            vec![usize::MAX - 5..usize::MAX - 1, usize::MAX - 1..usize::MAX]
        );
    }

    #[test]
    fn exact_size_matches_count() {
        let chunks = chunk_ranges(0..1000, 7);
        assert_eq!(chunks.len(), chunks.clone().count());
        assert_eq!(chunks.len(), 143);
    }

    proptest! {
        #[test]
        fn chunks_cover_the_range_exactly_c5(
            start in 0usize..10_000,
            len in 0usize..10_000,
            chunk_elems in 0usize..2_000,
        ) {
            let range = start..start + len;
            let chunks: Vec<_> = chunk_ranges(range.clone(), chunk_elems).collect();
            let step = chunk_elems.max(1);
            let mut next = range.start;
            for (i, chunk) in chunks.iter().enumerate() {
                prop_assert_eq!(chunk.start, next, "chunks are contiguous");
                prop_assert!(chunk.start < chunk.end, "no empty chunk");
                prop_assert!(chunk.len() <= step, "no chunk larger than the chunk size");
                if i + 1 < chunks.len() {
                    prop_assert_eq!(chunk.len(), step, "only the last chunk is short");
                }
                next = chunk.end;
            }
            prop_assert_eq!(next, range.end, "chunks end where the range ends");
            prop_assert_eq!(chunks.len(), len.div_ceil(step));
        }
    }
}
