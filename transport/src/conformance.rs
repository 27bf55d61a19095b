//! The conformance suite: one generic set of checks of the crate's contract (C1–C5) that every
//! backend runs.
//!
//! Each check is a public `async fn(Arc<dyn Transport>)` whose name ends in the contract clause it
//! checks; it panics (it is a test) with a message that names the backend. [`run_all`] runs them
//! all in sequence; [`conformance_tests!`](crate::conformance_tests) expands to one
//! `#[tokio::test]` per check, each with a timeout, so a backend's failures are reported per check:
//!
//! ```
//! // transport/tests/<backend>_conformance.rs
//! use std::sync::Arc;
//! use odc_transport::{local::LocalTransport, Transport};
//!
//! async fn make_transport() -> Arc<dyn Transport> {
//!     Arc::new(LocalTransport::new())
//! }
//!
//! odc_transport::conformance_tests!(make_transport);
//! # fn main() {}
//! ```
//!
//! The checks register every region with owner [`OWNER`] and need a tokio runtime; concurrency
//! checks spawn tasks (and one blocking task for the publishing owner), so a multi-threaded runtime
//! exercises real parallelism. Values are chosen exactly representable, so results are compared
//! bit for bit whatever the order of concurrent operations.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use futures::future::try_join_all;
use tokio::task::JoinHandle;

use crate::codec;
use crate::{
    chunk_ranges, AccumulatorRegion, Dtype, EndpointId, PublishedRegion, ReadChunk, RegionHandle,
    RegionKind, Transport, TransportError, WriteTag,
};

/// The endpoint that owns every region the suite registers.
pub const OWNER: EndpointId = 0;

/// Run every check against `transport`, in sequence. Panics on the first failure.
pub async fn run_all(transport: Arc<dyn Transport>) {
    // Keep in sync with `conformance_tests!`.
    read_returns_published_contents_c1(Arc::clone(&transport)).await;
    f32_reads_are_bit_exact_c1(Arc::clone(&transport)).await;
    bf16_reads_round_to_nearest_even_c1(Arc::clone(&transport)).await;
    read_sees_whole_publication_c1(Arc::clone(&transport)).await;
    accumulate_adds_and_acks_c2(Arc::clone(&transport)).await;
    concurrent_accumulates_sum_exactly_c2(Arc::clone(&transport)).await;
    stale_epoch_refused_c3(Arc::clone(&transport)).await;
    duplicate_write_refused_c3(Arc::clone(&transport)).await;
    take_moves_epoch_atomically_c3(Arc::clone(&transport)).await;
    bad_requests_are_typed_errors_c4(Arc::clone(&transport)).await;
    empty_regions_and_ranges_are_valid_c4(Arc::clone(&transport)).await;
    dropped_region_is_unknown_c4(Arc::clone(&transport)).await;
    region_ids_are_distinct_c4(Arc::clone(&transport)).await;
    chunked_read_equals_whole_read_c5(Arc::clone(&transport)).await;
    chunked_accumulate_equals_whole_accumulate_c5(transport).await;
}

/// Expands to one `#[tokio::test]` per conformance check, each run on a two-worker multi-threaded
/// runtime under a 30 s timeout against the transport returned by `$make`, a path to an
/// `async fn() -> Arc<dyn Transport>` (called once per check). The calling crate needs `tokio` with
/// the `macros`, `rt-multi-thread` and `time` features.
#[macro_export]
macro_rules! conformance_tests {
    ($make:path) => {
        // Keep in sync with `conformance::run_all`.
        $crate::conformance_tests!(@checks $make;
            read_returns_published_contents_c1,
            f32_reads_are_bit_exact_c1,
            bf16_reads_round_to_nearest_even_c1,
            read_sees_whole_publication_c1,
            accumulate_adds_and_acks_c2,
            concurrent_accumulates_sum_exactly_c2,
            stale_epoch_refused_c3,
            duplicate_write_refused_c3,
            take_moves_epoch_atomically_c3,
            bad_requests_are_typed_errors_c4,
            empty_regions_and_ranges_are_valid_c4,
            dropped_region_is_unknown_c4,
            region_ids_are_distinct_c4,
            chunked_read_equals_whole_read_c5,
            chunked_accumulate_equals_whole_accumulate_c5,
            run_all,
        );
    };
    (@checks $make:path; $($check:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                let transport: ::std::sync::Arc<dyn $crate::Transport> = $make().await;
                let outcome = ::tokio::time::timeout(
                    ::std::time::Duration::from_secs(30),
                    $crate::conformance::$check(transport),
                )
                .await;
                assert!(
                    outcome.is_ok(),
                    concat!("conformance check `", stringify!($check), "` timed out after 30 s")
                );
            }
        )*
    };
}

// ---------------------------------------------------------------------------------------------
// C1 one-sided read
// ---------------------------------------------------------------------------------------------

/// C1: a read returns the elements last published with their version; handles describe the
/// registration; a publication replaces the contents and the version.
pub async fn read_returns_published_contents_c1(transport: Arc<dyn Transport>) {
    let b = transport.backend();
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let first = ramp(dtype, 37, 0.5);
        let initial = codec::encode(dtype, &first);
        let region = register_published(&transport, dtype, initial.clone(), 7);
        let handle = region.handle();
        assert_eq!(handle.owner, OWNER, "{b}: handle owner");
        assert_eq!(handle.kind, RegionKind::Published, "{b}: handle kind");
        assert_eq!(handle.dtype, dtype, "{b}: handle dtype");
        assert_eq!(handle.len, 37, "{b}: handle length in elements");
        assert_eq!(region.version(), 7, "{b}: version after registration");

        let whole = must_read(&transport, &handle, 0..37).await;
        assert_eq!(whole.version, 7, "{b}: {dtype:?} read version");
        assert_eq!(
            whole.bytes, initial,
            "{b}: {dtype:?} read of the whole region"
        );
        let part = must_read(&transport, &handle, 3..11).await;
        assert_eq!(part.version, 7, "{b}: {dtype:?} partial read version");
        assert_eq!(
            part.bytes,
            initial.slice(3 * dtype.size()..11 * dtype.size()),
            "{b}: {dtype:?} read of elements 3..11"
        );

        let second = ramp(dtype, 37, -0.25);
        let published = codec::encode(dtype, &second);
        must_publish(b, region.as_ref(), 8, published.clone());
        assert_eq!(region.version(), 8, "{b}: version after publish");
        let after = must_read(&transport, &handle, 0..37).await;
        assert_eq!(
            after.version, 8,
            "{b}: {dtype:?} version read after publish"
        );
        assert_eq!(
            after.bytes, published,
            "{b}: {dtype:?} contents read after publish"
        );
        assert_eq!(
            codec::decode(dtype, &after.bytes).ok(),
            Some(second),
            "{b}: {dtype:?} decoded contents"
        );
    }
}

/// C1: an f32 region returns its bytes unchanged, special values included (signed zero,
/// subnormals, infinities, NaN payloads).
pub async fn f32_reads_are_bit_exact_c1(transport: Arc<dyn Transport>) {
    let b = transport.backend();
    let values = [
        0.0,
        -0.0,
        f32::MIN_POSITIVE / 4.0,
        -f32::MIN_POSITIVE,
        f32::MAX,
        f32::MIN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(0x7fc0_1234),
        f32::from_bits(0xffa0_0001),
        0.1,
        -1.0e-30,
    ];
    let bytes = codec::encode_f32(&values);
    let region = register_published(&transport, Dtype::F32, bytes.clone(), 1);
    let chunk = must_read(&transport, &region.handle(), 0..values.len()).await;
    assert_eq!(chunk.bytes, bytes, "{b}: f32 bytes read back bit for bit");
}

/// C1: a bf16 region returns exactly the bytes its owner published, and a reader decodes the
/// owner's fp32 values rounded to nearest, ties to even ([`codec::round_trip`]).
pub async fn bf16_reads_round_to_nearest_even_c1(transport: Arc<dyn Transport>) {
    let b = transport.backend();
    let ulp = 2f32.powi(-7); // bf16 spacing in [1, 2)
    let tie = ulp / 2.0;
    let cases: [(f32, f32); 7] = [
        (1.0 + tie, 1.0),
        (1.0 + 3.0 * tie, 1.0 + 2.0 * ulp),
        (1.0 + tie + 2f32.powi(-20), 1.0 + ulp),
        (-(1.0 + tie), -1.0),
        (1.0e-3, 131.0 / 128.0 * 2f32.powi(-10)),
        (3.0, 3.0),
        (-0.0, -0.0),
    ];
    let inputs: Vec<f32> = cases.iter().map(|(x, _)| *x).collect();
    let bytes = codec::encode(Dtype::Bf16, &inputs);
    let region = register_published(&transport, Dtype::Bf16, bytes.clone(), 1);
    let chunk = must_read(&transport, &region.handle(), 0..cases.len()).await;
    assert_eq!(chunk.bytes, bytes, "{b}: bf16 bytes read back bit for bit");
    let decoded = codec::decode(Dtype::Bf16, &chunk.bytes).unwrap_or_default();
    assert_eq!(decoded.len(), cases.len(), "{b}: bf16 element count");
    for ((x, expected), got) in cases.iter().zip(&decoded) {
        assert_eq!(
            got.to_bits(),
            expected.to_bits(),
            "{b}: bf16 read of {x:e} is {got:e}, expected {expected:e}"
        );
        assert_eq!(
            got.to_bits(),
            codec::round_trip(Dtype::Bf16, *x).to_bits(),
            "{b}: bf16 read of {x:e} matches round_trip"
        );
    }
}

/// C1: while the owner publishes versions 1..=64 of a 128 KiB bf16 region (every element equal to
/// the version), concurrent readers of the whole region and of parts of it only ever see uniform
/// contents that match the version returned, and each reader sees versions in order.
pub async fn read_sees_whole_publication_c1(transport: Arc<dyn Transport>) {
    const LEN: usize = 1 << 16;
    const LAST: u64 = 64;
    const READERS: usize = 4;
    let b = transport.backend();
    let region = register_published(
        &transport,
        Dtype::Bf16,
        codec::encode(Dtype::Bf16, &[0.0; LEN]),
        0,
    );
    let handle = region.handle();

    let readers: Vec<JoinHandle<usize>> = (0..READERS)
        .map(|reader| {
            let transport = Arc::clone(&transport);
            let handle = handle.clone();
            // Reader 0 reads the whole region; the others read a different part each.
            let range = if reader == 0 {
                0..LEN
            } else {
                (reader - 1) * LEN / 3 + 1..reader * LEN / 3
            };
            tokio::spawn(async move {
                let mut last_version = 0;
                let mut reads = 0;
                loop {
                    let chunk = must_read(&transport, &handle, range.clone()).await;
                    reads += 1;
                    assert!(
                        chunk.version >= last_version,
                        "{b}: reader {reader} saw version {} after version {last_version}",
                        chunk.version
                    );
                    last_version = chunk.version;
                    let values = codec::decode(Dtype::Bf16, &chunk.bytes).unwrap_or_default();
                    assert_eq!(values.len(), range.len(), "{b}: reader {reader} length");
                    let expected = chunk.version as f32;
                    if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| **v != expected) {
                        panic!(
                            "{b}: reader {reader} read version {} but element {} is {v} \
                             (a torn read mixing two publications)",
                            chunk.version,
                            range.start + i
                        );
                    }
                    if chunk.version == LAST {
                        return reads;
                    }
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();

    let writer = tokio::task::spawn_blocking(move || {
        for version in 1..=LAST {
            let data = codec::encode(Dtype::Bf16, &vec![version as f32; LEN]);
            if let Err(e) = region.publish(version, data) {
                panic!("{b}: publish of version {version} failed: {e}");
            }
            std::thread::yield_now();
        }
        region
    });
    // Keep the region registered until every reader has seen the last version.
    let region = join(writer).await;
    for reader in readers {
        let reads = join(reader).await;
        assert!(reads >= 1, "{b}: every reader completes a read");
    }
    assert_eq!(region.version(), LAST, "{b}: final version");
}

// ---------------------------------------------------------------------------------------------
// C2 acknowledged accumulate
// ---------------------------------------------------------------------------------------------

/// C2: an accumulate resolves once its values are added, in fp32 (a value below bf16 resolution
/// survives), at the given offset; `take` returns them, zeroes the accumulator and moves the epoch.
pub async fn accumulate_adds_and_acks_c2(transport: Arc<dyn Transport>) {
    let b = transport.backend();
    let acc = register_accumulator(&transport, 8, 3);
    let handle = acc.handle();
    assert_eq!(handle.owner, OWNER, "{b}: handle owner");
    assert_eq!(handle.kind, RegionKind::Accumulator, "{b}: handle kind");
    assert_eq!(handle.dtype, Dtype::F32, "{b}: accumulators are f32");
    assert_eq!(handle.len, 8, "{b}: handle length");
    assert_eq!(acc.epoch(), 3, "{b}: epoch after registration");

    let tiny = 2f32.powi(-20);
    must_accumulate(&transport, &handle, 2, &[1.0, 2.0, 3.0, 4.0], tag(3, 1)).await;
    must_accumulate(&transport, &handle, 0, &[tiny, tiny, 0.5], tag(3, 2)).await;
    must_accumulate(&transport, &handle, 7, &[-8.0], tag(3, 3)).await;
    let expected = [tiny, tiny, 1.5, 2.0, 3.0, 4.0, 0.0, -8.0];
    assert_eq!(
        acc.read_local(1..4).expect("in range"),
        expected[1..4],
        "{b}: owner reads what was added without taking it"
    );
    assert!(
        matches!(
            acc.read_local(6..9),
            Err(TransportError::OutOfRange {
                start: 6,
                end: 9,
                len: 8,
                ..
            })
        ),
        "{b}: owner read out of range is a typed error"
    );
    assert_eq!(acc.take(4), expected, "{b}: accumulated fp32 values");
    assert_eq!(acc.epoch(), 4, "{b}: epoch after take");
    assert_eq!(acc.take(5), [0.0; 8], "{b}: take zeroes the accumulator");
}

/// C2: 8 tasks each issue 16 accumulates over a whole 4096-element region at once; the sum is
/// exact (every partial sum is representable), whatever the order they are applied in.
pub async fn concurrent_accumulates_sum_exactly_c2(transport: Arc<dyn Transport>) {
    const LEN: usize = 4096;
    const WRITERS: u64 = 8;
    const WRITES: u64 = 16;
    let b = transport.backend();
    let acc = register_accumulator(&transport, LEN, 0);
    let handle = acc.handle();
    let pattern = |i: usize| (i % 7) as f32 + 1.0;

    let writers: Vec<JoinHandle<()>> = (0..WRITERS)
        .map(|writer| {
            let transport = Arc::clone(&transport);
            let handle = handle.clone();
            tokio::spawn(async move {
                let scale = (writer + 1) as f32 * 0.5;
                let values: Vec<f32> = (0..LEN).map(|i| pattern(i) * scale).collect();
                let data = codec::encode_f32(&values);
                for write in 0..WRITES {
                    let tag = tag(0, (u128::from(writer) << 64) | u128::from(write));
                    let result = transport.accumulate(&handle, 0, data.clone(), tag).await;
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

// ---------------------------------------------------------------------------------------------
// C3 fencing
// ---------------------------------------------------------------------------------------------

/// C3: an accumulate tagged with any epoch but the current one is refused with `StaleEpoch` and
/// changes nothing, not even the set of applied write ids.
pub async fn stale_epoch_refused_c3(transport: Arc<dyn Transport>) {
    let b = transport.backend();
    let acc = register_accumulator(&transport, 4, 5);
    let handle = acc.handle();
    for epoch in [4, 6, 0, u64::MAX] {
        let result = accumulate(&transport, &handle, 0, &[1.0; 4], tag(epoch, 9)).await;
        assert_eq!(
            result,
            Err(TransportError::StaleEpoch {
                region: handle.id,
                got: epoch,
                current: 5
            }),
            "{b}: accumulate tagged epoch {epoch} into epoch 5"
        );
    }
    // The refused writes did not consume write id 9.
    must_accumulate(&transport, &handle, 1, &[2.0], tag(5, 9)).await;
    assert_eq!(
        acc.take(6),
        [0.0, 2.0, 0.0, 0.0],
        "{b}: only the fresh write"
    );
    let late = accumulate(&transport, &handle, 0, &[1.0], tag(5, 10)).await;
    assert_eq!(
        late,
        Err(TransportError::StaleEpoch {
            region: handle.id,
            got: 5,
            current: 6
        }),
        "{b}: a write of the previous epoch after take"
    );
    assert_eq!(acc.epoch(), 6, "{b}: epoch");
    assert_eq!(acc.take(7), [0.0; 4], "{b}: late write did not land");
}

/// C3: a write id already applied in the current epoch is refused with `DuplicateWrite` and
/// changes nothing; `take` forgets the ids, so the next epoch may reuse them.
pub async fn duplicate_write_refused_c3(transport: Arc<dyn Transport>) {
    let b = transport.backend();
    let acc = register_accumulator(&transport, 3, 0);
    let handle = acc.handle();
    for write_id in [42, u128::MAX] {
        must_accumulate(&transport, &handle, 0, &[1.0; 3], tag(0, write_id)).await;
        let again = accumulate(&transport, &handle, 0, &[5.0; 3], tag(0, write_id)).await;
        assert_eq!(
            again,
            Err(TransportError::DuplicateWrite {
                region: handle.id,
                epoch: 0,
                write_id
            }),
            "{b}: repeated write id {write_id:#x}"
        );
    }
    assert_eq!(acc.take(1), [2.0; 3], "{b}: each write applied once");
    must_accumulate(&transport, &handle, 0, &[1.0; 3], tag(1, 42)).await;
    assert_eq!(
        acc.take(2),
        [1.0; 3],
        "{b}: write ids are forgotten by take"
    );
}

/// C3: 4 tasks issue 1024 single-element epoch-0 accumulates while the owner takes the
/// accumulator into epoch 1. Every accumulate acknowledged `Ok` is in the taken values, every
/// other one was refused as stale, and none landed in epoch 1.
pub async fn take_moves_epoch_atomically_c3(transport: Arc<dyn Transport>) {
    const WRITERS: usize = 4;
    const WRITES: usize = 256;
    const LEN: usize = WRITERS * WRITES;
    let b = transport.backend();
    let acc = register_accumulator(&transport, LEN, 0);
    let handle = acc.handle();
    let applied = Arc::new(AtomicUsize::new(0));
    let one = codec::encode_f32(&[1.0]);

    let writers: Vec<JoinHandle<Vec<bool>>> = (0..WRITERS)
        .map(|writer| {
            let transport = Arc::clone(&transport);
            let handle = handle.clone();
            let applied = Arc::clone(&applied);
            let one = one.clone();
            tokio::spawn(async move {
                let mut acked = Vec::with_capacity(WRITES);
                for write in 0..WRITES {
                    let index = writer * WRITES + write;
                    let result = transport
                        .accumulate(&handle, index, one.clone(), tag(0, index as u128))
                        .await;
                    match result {
                        Ok(()) => {
                            applied.fetch_add(1, Ordering::SeqCst);
                            acked.push(true);
                        }
                        Err(TransportError::StaleEpoch {
                            got: 0, current: 1, ..
                        }) => acked.push(false),
                        Err(e) => panic!("{b}: write {index} failed unexpectedly: {e}"),
                    }
                    tokio::task::yield_now().await;
                }
                acked
            })
        })
        .collect();

    // Take in the middle of the writes (or after them, if they are faster than this task).
    while applied.load(Ordering::SeqCst) < LEN / 4 && !writers.iter().all(|w| w.is_finished()) {
        tokio::task::yield_now().await;
    }
    let taken = acc.take(1);
    assert_eq!(acc.epoch(), 1, "{b}: epoch after take");
    assert_eq!(taken.len(), LEN, "{b}: taken length");

    let mut acked_count = 0;
    for (writer, handle) in writers.into_iter().enumerate() {
        for (write, acked) in join(handle).await.into_iter().enumerate() {
            let index = writer * WRITES + write;
            let expected = if acked { 1.0 } else { 0.0 };
            assert_eq!(
                taken[index], expected,
                "{b}: write {index} acknowledged {acked} but the taken value is {}",
                taken[index]
            );
            acked_count += usize::from(acked);
        }
    }
    assert!(
        acked_count >= LEN / 4,
        "{b}: writes before the take were applied"
    );
    assert_eq!(
        acc.take(2),
        vec![0.0; LEN],
        "{b}: no epoch-0 write landed in epoch 1"
    );
}

// ---------------------------------------------------------------------------------------------
// C4 bounds
// ---------------------------------------------------------------------------------------------

/// C4: unknown regions, out-of-range and reversed ranges, partial elements, publications of the
/// wrong length and wrong region kinds are typed errors; afterwards both regions are unchanged
/// and the refused accumulates consumed no write id.
pub async fn bad_requests_are_typed_errors_c4(transport: Arc<dyn Transport>) {
    const LEN: usize = 16;
    let b = transport.backend();
    let values = ramp(Dtype::Bf16, LEN, 1.0);
    let initial = codec::encode(Dtype::Bf16, &values);
    let params = register_published(&transport, Dtype::Bf16, initial.clone(), 3);
    let acc = register_accumulator(&transport, LEN, 0);
    let (p, a) = (params.handle(), acc.handle());
    must_accumulate(&transport, &a, 0, &[1.0; LEN], tag(0, 1)).await;

    // Unknown region.
    let mut unknown = p.clone();
    unknown.id = p.id.max(a.id).wrapping_add(1_000_003);
    assert_refused(
        b,
        "read of an unknown region",
        transport.read(&unknown, 0..1).await,
        TransportError::UnknownRegion {
            owner: OWNER,
            region: unknown.id,
        },
    );
    unknown.kind = RegionKind::Accumulator;
    unknown.dtype = Dtype::F32;
    assert_refused(
        b,
        "accumulate into an unknown region",
        accumulate(&transport, &unknown, 0, &[1.0], tag(0, 2)).await,
        TransportError::UnknownRegion {
            owner: OWNER,
            region: unknown.id,
        },
    );

    // Out-of-range and reversed reads.
    let (five, three) = (5, 3);
    let bad_reads: [Range<usize>; 4] = [
        LEN - 2..LEN + 1,
        LEN + 1..LEN + 1,
        five..three,
        0..usize::MAX,
    ];
    for range in bad_reads {
        assert_refused(
            b,
            &format!("read of elements {range:?}"),
            transport.read(&p, range.clone()).await,
            TransportError::OutOfRange {
                region: p.id,
                start: range.start,
                end: range.end,
                len: LEN,
            },
        );
    }

    // Out-of-range accumulates.
    for (offset, n) in [(LEN - 2, 3), (LEN, 1), (LEN + 5, 0)] {
        assert_refused(
            b,
            &format!("accumulate of {n} elements at {offset}"),
            accumulate(&transport, &a, offset, &vec![1.0; n], tag(0, 7)).await,
            TransportError::OutOfRange {
                region: a.id,
                start: offset,
                end: offset + n,
                len: LEN,
            },
        );
    }
    let overflow = accumulate(&transport, &a, usize::MAX, &[1.0; 2], tag(0, 7)).await;
    assert!(
        matches!(overflow, Err(TransportError::OutOfRange { region, start: usize::MAX, .. }) if region == a.id),
        "{b}: accumulate at offset usize::MAX: got {overflow:?}"
    );

    // Partial elements.
    for bytes in [1, 3, 6, 10] {
        assert_refused(
            b,
            &format!("accumulate of {bytes} bytes"),
            transport
                .accumulate(&a, 0, Bytes::from(vec![0u8; bytes]), tag(0, 7))
                .await,
            TransportError::BadPayload {
                region: a.id,
                bytes,
                dtype: Dtype::F32,
            },
        );
    }

    // Wrong kinds.
    assert_refused(
        b,
        "read of an accumulator",
        transport.read(&a, 0..1).await,
        TransportError::WrongKind {
            region: a.id,
            expected: RegionKind::Published,
            actual: RegionKind::Accumulator,
        },
    );
    assert_refused(
        b,
        "accumulate into a published region",
        accumulate(&transport, &p, 0, &[1.0], tag(0, 7)).await,
        TransportError::WrongKind {
            region: p.id,
            expected: RegionKind::Accumulator,
            actual: RegionKind::Published,
        },
    );

    // Publications of the wrong length.
    assert_refused(
        b,
        "publish of one element too few",
        params.publish(4, codec::encode(Dtype::Bf16, &values[1..])),
        TransportError::LengthMismatch {
            region: p.id,
            elements: LEN - 1,
            len: LEN,
        },
    );
    assert_refused(
        b,
        "publish of f32 bytes into a bf16 region",
        params.publish(4, codec::encode_f32(&values)),
        TransportError::LengthMismatch {
            region: p.id,
            elements: 2 * LEN,
            len: LEN,
        },
    );
    assert_refused(
        b,
        "publish of a partial element",
        params.publish(4, Bytes::from(vec![0u8; 2 * LEN + 1])),
        TransportError::BadPayload {
            region: p.id,
            bytes: 2 * LEN + 1,
            dtype: Dtype::Bf16,
        },
    );
    match transport.register_published(OWNER, Dtype::Bf16, Bytes::from(vec![0u8; 5]), 0) {
        Ok(_) => panic!("{b}: registering 5 bytes as bf16 succeeded"),
        Err(e) => assert!(
            matches!(
                e,
                TransportError::BadPayload {
                    bytes: 5,
                    dtype: Dtype::Bf16,
                    ..
                }
            ),
            "{b}: registering 5 bytes as bf16: got {e:?}"
        ),
    }

    // Both regions are unchanged, and write id 7 (only ever refused) is still free.
    assert_eq!(params.version(), 3, "{b}: version after refused publishes");
    let after = must_read(&transport, &p, 0..LEN).await;
    assert_eq!(after.version, 3, "{b}: version read after refused requests");
    assert_eq!(after.bytes, initial, "{b}: contents after refused requests");
    assert_eq!(acc.epoch(), 0, "{b}: epoch after refused requests");
    must_accumulate(&transport, &a, 0, &[1.0; LEN], tag(0, 7)).await;
    assert_eq!(
        acc.take(1),
        [2.0; LEN],
        "{b}: accumulator after refused requests"
    );
}

/// C4: zero-length regions, reads and accumulates within bounds are valid, not errors.
pub async fn empty_regions_and_ranges_are_valid_c4(transport: Arc<dyn Transport>) {
    let b = transport.backend();
    let empty = register_published(&transport, Dtype::Bf16, Bytes::new(), 2);
    assert_eq!(empty.handle().len, 0, "{b}: empty published region length");
    let chunk = must_read(&transport, &empty.handle(), 0..0).await;
    assert_eq!(
        (chunk.version, chunk.bytes.len()),
        (2, 0),
        "{b}: empty read"
    );

    let params = register_published(&transport, Dtype::F32, codec::encode_f32(&[1.0; 4]), 5);
    for at in [0, 2, 4] {
        let chunk = must_read(&transport, &params.handle(), at..at).await;
        assert_eq!(
            (chunk.version, chunk.bytes.len()),
            (5, 0),
            "{b}: empty read at {at}"
        );
    }

    let acc = register_accumulator(&transport, 4, 0);
    for (write_id, at) in [(1, 0), (2, 4)] {
        must_accumulate(&transport, &acc.handle(), at, &[], tag(0, write_id)).await;
    }
    assert_eq!(acc.take(1), [0.0; 4], "{b}: empty accumulates add nothing");
    let none = register_accumulator(&transport, 0, 0);
    must_accumulate(&transport, &none.handle(), 0, &[], tag(0, 1)).await;
    assert!(none.take(1).is_empty(), "{b}: empty accumulator");
}

/// C4: once the owner drops a region's guard, reads and accumulates name an unknown region.
pub async fn dropped_region_is_unknown_c4(transport: Arc<dyn Transport>) {
    let b = transport.backend();
    let params = register_published(&transport, Dtype::F32, codec::encode_f32(&[1.0; 4]), 1);
    let acc = register_accumulator(&transport, 4, 0);
    let (p, a) = (params.handle(), acc.handle());
    must_read(&transport, &p, 0..4).await;
    must_accumulate(&transport, &a, 0, &[1.0; 4], tag(0, 1)).await;
    drop(params);
    drop(acc);
    assert_refused(
        b,
        "read after the region was dropped",
        transport.read(&p, 0..4).await,
        TransportError::UnknownRegion {
            owner: OWNER,
            region: p.id,
        },
    );
    assert_refused(
        b,
        "accumulate after the region was dropped",
        accumulate(&transport, &a, 0, &[1.0; 4], tag(0, 2)).await,
        TransportError::UnknownRegion {
            owner: OWNER,
            region: a.id,
        },
    );
}

/// C4: every registration gets its own region id, so handles never alias.
pub async fn region_ids_are_distinct_c4(transport: Arc<dyn Transport>) {
    let b = transport.backend();
    let params: Vec<_> = (0..4)
        .map(|i| register_published(&transport, Dtype::F32, codec::encode_f32(&[i as f32]), 0))
        .collect();
    let accs: Vec<_> = (0..4)
        .map(|_| register_accumulator(&transport, 1, 0))
        .collect();
    let mut ids: Vec<_> = params
        .iter()
        .map(|r| r.handle().id)
        .chain(accs.iter().map(|r| r.handle().id))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 8, "{b}: 8 registrations, distinct ids");
    for (i, region) in params.iter().enumerate() {
        let chunk = must_read(&transport, &region.handle(), 0..1).await;
        assert_eq!(
            codec::decode_f32(&chunk.bytes).ok(),
            Some(vec![i as f32]),
            "{b}: region {i} reads its own contents"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// C5 chunking
// ---------------------------------------------------------------------------------------------

/// C5: reading a region in chunks of any size, issued concurrently, yields exactly the bytes and
/// the version of one whole read, for the whole region and for a sub-range.
pub async fn chunked_read_equals_whole_read_c5(transport: Arc<dyn Transport>) {
    const LEN: usize = 10_007;
    let b = transport.backend();
    let values: Vec<f32> = (0..LEN).map(|i| i as f32 * 0.37 - 1000.0).collect();
    let region = register_published(
        &transport,
        Dtype::Bf16,
        codec::encode(Dtype::Bf16, &values),
        11,
    );
    let handle = region.handle();
    let whole = must_read(&transport, &handle, 0..LEN).await;
    let size = Dtype::Bf16.size();
    for range in [0..LEN, 123..9_876] {
        for chunk_elems in [333, 1_000, 4_096, LEN, LEN + 5] {
            let reads =
                chunk_ranges(range.clone(), chunk_elems).map(|r| transport.read(&handle, r));
            let chunks = match try_join_all(reads).await {
                Ok(chunks) => chunks,
                Err(e) => panic!("{b}: chunked read of {range:?} by {chunk_elems}: {e}"),
            };
            assert!(
                chunks.iter().all(|c| c.version == whole.version),
                "{b}: every chunk has the version of the whole read"
            );
            let joined: Vec<u8> = chunks
                .iter()
                .flat_map(|c| c.bytes.iter().copied())
                .collect();
            assert_eq!(
                joined,
                whole.bytes[range.start * size..range.end * size],
                "{b}: {range:?} read in chunks of {chunk_elems} equals the whole read"
            );
        }
    }
}

/// C5: an accumulate split into chunks, each its own write issued concurrently, adds exactly what
/// the whole accumulate adds.
pub async fn chunked_accumulate_equals_whole_accumulate_c5(transport: Arc<dyn Transport>) {
    const LEN: usize = 10_007;
    const CHUNK: usize = 1_000;
    let b = transport.backend();
    let values: Vec<f32> = (0..LEN).map(|i| (i % 101) as f32 * 0.5 - 20.0).collect();
    let whole = register_accumulator(&transport, LEN, 0);
    let chunked = register_accumulator(&transport, LEN, 0);
    must_accumulate(&transport, &whole.handle(), 0, &values, tag(0, 1)).await;
    let handle = chunked.handle();
    let writes = chunk_ranges(0..LEN, CHUNK).enumerate().map(|(i, r)| {
        let data = codec::encode_f32(&values[r.clone()]);
        transport.accumulate(&handle, r.start, data, tag(0, i as u128))
    });
    if let Err(e) = try_join_all(writes).await {
        panic!("{b}: chunked accumulate: {e}");
    }
    let expected = whole.take(1);
    assert_eq!(expected, values, "{b}: whole accumulate");
    assert_eq!(
        chunked.take(1),
        expected,
        "{b}: chunked accumulate equals whole"
    );
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// `len` distinct values `i * step + 1`, exactly representable in `dtype`.
fn ramp(dtype: Dtype, len: usize, step: f32) -> Vec<f32> {
    (0..len)
        .map(|i| codec::round_trip(dtype, i as f32 * step + 1.0))
        .collect()
}

fn tag(epoch: u64, write_id: u128) -> WriteTag {
    WriteTag { epoch, write_id }
}

fn register_published(
    transport: &Arc<dyn Transport>,
    dtype: Dtype,
    initial: Bytes,
    version: u64,
) -> Box<dyn PublishedRegion> {
    let bytes = initial.len();
    match transport.register_published(OWNER, dtype, initial, version) {
        Ok(region) => region,
        Err(e) => panic!(
            "{}: registering {bytes} bytes of {dtype:?} failed: {e}",
            transport.backend()
        ),
    }
}

fn register_accumulator(
    transport: &Arc<dyn Transport>,
    len: usize,
    epoch: u64,
) -> Box<dyn AccumulatorRegion> {
    match transport.register_accumulator(OWNER, len, epoch) {
        Ok(region) => region,
        Err(e) => panic!(
            "{}: registering an accumulator of {len} elements failed: {e}",
            transport.backend()
        ),
    }
}

fn must_publish(backend: &str, region: &dyn PublishedRegion, version: u64, data: Bytes) {
    if let Err(e) = region.publish(version, data) {
        panic!("{backend}: publish of version {version} failed: {e}");
    }
}

async fn must_read(
    transport: &Arc<dyn Transport>,
    handle: &RegionHandle,
    range: Range<usize>,
) -> ReadChunk {
    match transport.read(handle, range.clone()).await {
        Ok(chunk) => {
            let expected = range.len() * handle.dtype.size();
            assert_eq!(
                chunk.bytes.len(),
                expected,
                "{}: read of {range:?} returned {} bytes",
                transport.backend(),
                chunk.bytes.len()
            );
            chunk
        }
        Err(e) => panic!(
            "{}: read of {range:?} from region {} failed: {e}",
            transport.backend(),
            handle.id
        ),
    }
}

async fn accumulate(
    transport: &Arc<dyn Transport>,
    handle: &RegionHandle,
    offset: usize,
    values: &[f32],
    tag: WriteTag,
) -> Result<(), TransportError> {
    transport
        .accumulate(handle, offset, codec::encode_f32(values), tag)
        .await
}

async fn must_accumulate(
    transport: &Arc<dyn Transport>,
    handle: &RegionHandle,
    offset: usize,
    values: &[f32],
    tag: WriteTag,
) {
    if let Err(e) = accumulate(transport, handle, offset, values, tag).await {
        panic!(
            "{}: accumulate of {} elements at {offset} into region {} failed: {e}",
            transport.backend(),
            values.len(),
            handle.id
        );
    }
}

fn assert_refused<T>(
    backend: &str,
    what: &str,
    got: Result<T, TransportError>,
    expected: TransportError,
) {
    match got {
        Ok(_) => panic!("{backend}: {what}: expected {expected:?}, but it succeeded"),
        Err(e) => assert_eq!(e, expected, "{backend}: {what}"),
    }
}

/// Await a spawned task, re-raising its panic (with its message) if it panicked.
async fn join<T>(task: JoinHandle<T>) -> T {
    match task.await {
        Ok(value) => value,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => panic!("conformance task did not complete: {e}"),
        },
    }
}
