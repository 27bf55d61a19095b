//! Work on one model split over a few threads while the trainers wait (evaluation, GRPO's
//! sampling): each thread takes a contiguous share of the items, and the results come back in
//! the items' order, so they do not depend on the number of threads.

/// `f` of every item, on `workers` threads (at least one), in the items' order; the first error
/// in that order. A panic in `f` resumes on the caller.
pub fn map_in_shares<T, R, E>(
    items: &[T],
    workers: usize,
    f: impl Fn(&T) -> Result<R, E> + Sync,
) -> Result<Vec<R>, E>
where
    T: Sync,
    R: Send,
    E: Send,
{
    let share = items.len().div_ceil(workers.max(1)).max(1);
    let f = &f;
    let shares: Vec<Result<Vec<R>, E>> = std::thread::scope(|scope| {
        let handles: Vec<_> = items
            .chunks(share)
            .map(|chunk| scope.spawn(move || chunk.iter().map(f).collect()))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    let mut out = Vec::with_capacity(items.len());
    for share in shares {
        out.extend(share?);
    }
    Ok(out)
}

/// `f` of every batch of `batch` consecutive items (at least one; the last batch may be
/// shorter), on `workers` threads, the results in the items' order: `f` returns one result per
/// item of its batch. The batches are cut from the whole list before it is shared out, so what
/// each call of `f` sees does not depend on the number of workers (a batched decoder's float
/// rounding depends on its batch).
pub fn map_batches_in_shares<T, R, E>(
    items: &[T],
    workers: usize,
    batch: usize,
    f: impl Fn(&[T]) -> Result<Vec<R>, E> + Sync,
) -> Result<Vec<R>, E>
where
    T: Sync,
    R: Send,
    E: Send,
{
    let batches: Vec<&[T]> = items.chunks(batch.max(1)).collect();
    Ok(map_in_shares(&batches, workers, |b| f(b))?
        .into_iter()
        .flatten()
        .collect())
}

/// [`share_range`] in whole batches of `batch` items: part `part` of `parts` of `0..len`, cut at
/// multiples of `batch` (the batches shared out as evenly as they go), so a rank that decodes its
/// share in batches of `batch` forms the same batches as one process decoding all of it.
pub fn batch_share_range(
    len: usize,
    batch: usize,
    part: usize,
    parts: usize,
) -> std::ops::Range<usize> {
    let batch = batch.max(1);
    let batches = share_range(len.div_ceil(batch), part, parts);
    (batches.start * batch).min(len)..(batches.end * batch).min(len)
}

/// Part `part` of `parts` contiguous, balanced parts of `0..len` (sizes differ by at most one;
/// the parts in order cover `0..len` once): a rank's share of the prompts or problems every rank
/// of an SPMD program lists alike.
pub fn share_range(len: usize, part: usize, parts: usize) -> std::ops::Range<usize> {
    let parts = parts.max(1);
    let part = part.min(parts);
    len * part / parts..len * (part + 1).min(parts) / parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_item_once_in_order_and_differ_by_at_most_one() {
        for len in [0, 1, 5, 32, 33] {
            for parts in [1, 2, 3, 7] {
                let ranges: Vec<_> = (0..parts).map(|p| share_range(len, p, parts)).collect();
                let covered: Vec<usize> = ranges.iter().cloned().flatten().collect();
                assert_eq!(covered, (0..len).collect::<Vec<_>>(), "{len} in {parts}");
                let sizes: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
                let (min, max) = (sizes.iter().min(), sizes.iter().max());
                assert!(max.unwrap() - min.unwrap() <= 1, "{sizes:?}");
            }
        }
        assert!(
            share_range(4, 9, 2).is_empty(),
            "a part past the last is empty"
        );
    }

    #[test]
    fn results_keep_the_items_order_for_any_worker_count() {
        let items: Vec<u32> = (0..10).collect();
        for workers in [0, 1, 3, 10, 32] {
            let out = map_in_shares(&items, workers, |&x| Ok::<_, ()>(x * 2)).unwrap();
            assert_eq!(out, (0..10).map(|x| x * 2).collect::<Vec<_>>());
        }
        assert!(map_in_shares(&[] as &[u32], 2, |&x| Ok::<_, ()>(x))
            .unwrap()
            .is_empty());
    }

    #[test]
    fn the_first_error_in_item_order_is_returned() {
        let items: Vec<u32> = (0..10).collect();
        let out = map_in_shares(&items, 3, |&x| if x >= 4 { Err(x) } else { Ok(x) });
        assert_eq!(out, Err(4));
    }

    #[test]
    fn batches_are_the_same_for_any_worker_count_and_any_rank_split() {
        let items: Vec<u32> = (0..23).collect();
        // Each result records its batch's first item: the batch it was decoded in.
        let batched = |items: &[u32], workers| {
            map_batches_in_shares(items, workers, 4, |b| Ok::<_, ()>(vec![b[0]; b.len()])).unwrap()
        };
        let one = batched(&items, 1);
        assert_eq!(&one[..9], &[0, 0, 0, 0, 4, 4, 4, 4, 8]);
        for workers in [0, 2, 3, 9] {
            assert_eq!(batched(&items, workers), one, "{workers} workers");
        }
        for parts in [1, 2, 3, 4, 8] {
            let mut joined = Vec::new();
            for part in 0..parts {
                let r = batch_share_range(items.len(), 4, part, parts);
                assert!(r.start % 4 == 0 || r.is_empty(), "{r:?}");
                joined.extend(batched(&items[r], 2));
            }
            assert_eq!(joined, one, "{parts} parts");
        }
    }
}
