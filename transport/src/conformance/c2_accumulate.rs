//! C2 acknowledged accumulate: an accumulate resolves only once the owner added its values, in fp32.

use tokio::task::JoinHandle;

use super::{assert_describes, join, must_accumulate, register_accumulator, ship, soon, tag, Pair};
use crate::{codec, Dtype, RegionKind};

/// C2: an accumulate resolves once its values are added, in fp32 (a value below bf16 resolution
/// survives), at the given offset: the owner's `take` right after the acknowledgement returns
/// them, zeroes the accumulator and moves the epoch.
pub async fn accumulate_adds_and_acks_c2(pair: Pair) {
    let b = pair.reader.backend();
    let acc = register_accumulator(&pair, 8, 3);
    let handle = ship(&acc.handle());
    assert_describes(b, &handle, RegionKind::Accumulator, 8, 3);
    assert_eq!(handle.dtype, Dtype::F32, "{b}: accumulators are f32");
    assert_eq!(acc.epoch(), 3, "{b}: epoch after registration");

    let tiny = 2f32.powi(-20);
    must_accumulate(&pair, &handle, 2, &[1.0, 2.0, 3.0, 4.0], tag(3, 1)).await;
    must_accumulate(&pair, &handle, 0, &[tiny, tiny, 0.5], tag(3, 2)).await;
    must_accumulate(&pair, &handle, 7, &[-8.0], tag(3, 3)).await;
    let expected = [tiny, tiny, 1.5, 2.0, 3.0, 4.0, 0.0, -8.0];
    assert_eq!(acc.take(4), expected, "{b}: accumulated fp32 values");
    assert_eq!(acc.epoch(), 4, "{b}: epoch after take");
    assert_eq!(
        ship(&acc.handle()).version,
        4,
        "{b}: handle epoch after take"
    );
    assert_eq!(acc.take(5), [0.0; 8], "{b}: take zeroes the accumulator");
}

/// C2: 8 tasks each issue 16 accumulates over a whole 4096-element region at once; the sum is
/// exact (every partial sum is representable), whatever the order they are applied in.
pub async fn concurrent_accumulates_sum_exactly_c2(pair: Pair) {
    const LEN: usize = 4096;
    const WRITERS: u64 = 8;
    const WRITES: u64 = 16;
    let b = pair.reader.backend();
    let acc = register_accumulator(&pair, LEN, 0);
    let handle = ship(&acc.handle());
    let pattern = |i: usize| (i % 7) as f32 + 1.0;

    let writers: Vec<JoinHandle<()>> = (0..WRITERS)
        .map(|writer| {
            let reader = pair.reader.clone();
            let handle = handle.clone();
            tokio::spawn(async move {
                let scale = (writer + 1) as f32 * 0.5;
                let values: Vec<f32> = (0..LEN).map(|i| pattern(i) * scale).collect();
                let data = codec::encode_f32(&values);
                for write in 0..WRITES {
                    let tag = tag(0, (u128::from(writer) << 64) | u128::from(write));
                    let result = reader
                        .accumulate(&handle, 0, data.clone(), tag, soon())
                        .await;
                    assert_eq!(result, Ok(()), "{b}: writer {writer} write {write}");
                }
            })
        })
        .collect();
    for writer in writers {
        join(writer).await;
    }

    // Σ_w (w + 1) / 2 over 8 writers = 18, times 16 writes each.
    let total_scale = WRITES as f32 * 18.0;
    let expected: Vec<f32> = (0..LEN).map(|i| pattern(i) * total_scale).collect();
    assert_eq!(acc.take(1), expected, "{b}: concurrent sum");
}
