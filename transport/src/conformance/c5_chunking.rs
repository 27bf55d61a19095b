//! C5 chunking: any split of a transfer into chunks, issued concurrently, moves exactly what the
//! whole transfer moves.

use futures::future::{join_all, try_join_all};

use super::{
    bits, must_accumulate, must_read_bytes, must_read_f32, register_accumulator,
    register_published, sentinel_f32, ship, soon, tag, Pair, SENTINEL_BYTE,
};
use crate::{chunk_ranges, codec, Dest, Dtype, ReadOp};

/// C5: reading a region in chunks of any size, issued concurrently into disjoint parts of one
/// caller-owned destination (as a batch into `f32`, and as separate reads into bytes), yields
/// exactly the contents and the version of one whole read, for the whole region and a sub-range.
pub async fn chunked_read_equals_whole_read_c5(pair: Pair) {
    const LEN: usize = 10_007;
    let b = pair.reader.backend();
    let values: Vec<f32> = (0..LEN).map(|i| i as f32 * 0.37 - 1000.0).collect();
    let region = register_published(&pair, Dtype::Bf16, codec::encode(Dtype::Bf16, &values), 11);
    let handle = ship(&region.handle());
    let (version, whole_bytes) = must_read_bytes(&pair, &handle, 0..LEN).await;
    let (_, whole) = must_read_f32(&pair, &handle, 0..LEN).await;
    assert_eq!(version, 11, "{b}: whole read version");
    let size = Dtype::Bf16.size();
    for range in [0..LEN, 123..9_876] {
        for chunk_elems in [333, 1_000, 4_096, LEN, LEN + 5] {
            // As one batch of reads into disjoint parts of one f32 destination.
            let mut joined = vec![sentinel_f32(); range.len()];
            let ops: Vec<ReadOp<'_>> = chunk_ranges(range.clone(), chunk_elems)
                .zip(joined.chunks_mut(chunk_elems))
                .map(|(r, into)| ReadOp {
                    handle: &handle,
                    range: r,
                    into: Dest::F32(into),
                })
                .collect();
            let results = pair.reader.read_batch(ops, soon()).await;
            for (i, result) in results.into_iter().enumerate() {
                assert_eq!(
                    result,
                    Ok(version),
                    "{b}: batch chunk {i} of {range:?} by {chunk_elems}"
                );
            }
            assert_eq!(
                bits(&joined),
                bits(&whole[range.clone()]),
                "{b}: {range:?} read in a batch of chunks of {chunk_elems} equals the whole read"
            );

            // As separate concurrent reads into disjoint parts of one byte destination.
            let mut joined = vec![SENTINEL_BYTE; range.len() * size];
            let reads = chunk_ranges(range.clone(), chunk_elems)
                .zip(joined.chunks_mut(chunk_elems * size))
                .map(|(r, into)| pair.reader.read(&handle, r, Dest::Bytes(into), soon()));
            let versions = match try_join_all(reads).await {
                Ok(versions) => versions,
                Err(e) => panic!("{b}: chunked read of {range:?} by {chunk_elems}: {e}"),
            };
            assert!(
                versions.iter().all(|v| *v == version),
                "{b}: every chunk has the version of the whole read"
            );
            assert_eq!(
                joined,
                whole_bytes[range.start * size..range.end * size],
                "{b}: {range:?} read in chunks of {chunk_elems} equals the whole read"
            );
        }
    }
}

/// C5: an accumulate split into chunks, each its own write issued concurrently, adds exactly what
/// the whole accumulate adds.
pub async fn chunked_accumulate_equals_whole_accumulate_c5(pair: Pair) {
    const LEN: usize = 10_007;
    const CHUNK: usize = 1_000;
    let b = pair.reader.backend();
    let values: Vec<f32> = (0..LEN).map(|i| (i % 101) as f32 * 0.5 - 20.0).collect();
    let whole = register_accumulator(&pair, LEN, 0);
    let chunked = register_accumulator(&pair, LEN, 0);
    must_accumulate(&pair, &ship(&whole.handle()), 0, &values, tag(0, 1)).await;
    let handle = ship(&chunked.handle());
    let writes = chunk_ranges(0..LEN, CHUNK).enumerate().map(|(i, r)| {
        let data = codec::encode_f32(&values[r.clone()]);
        pair.reader
            .accumulate(&handle, r.start, data, tag(0, i as u128), soon())
    });
    for (i, result) in join_all(writes).await.into_iter().enumerate() {
        assert_eq!(result, Ok(()), "{b}: chunk {i} of the chunked accumulate");
    }
    let expected = whole.take(1);
    assert_eq!(expected, values, "{b}: whole accumulate");
    assert_eq!(
        chunked.take(1),
        expected,
        "{b}: chunked accumulate equals whole"
    );
}
