//! C4 bounds: bad requests are typed errors, never panics, and leave regions and destinations
//! unchanged.

use std::ops::Range;

use bytes::Bytes;

use super::{
    accumulate, assert_refused, bits, must_accumulate, must_read_bytes, must_read_f32, one_of_each,
    ramp, read_bytes, read_f32, register_accumulator, register_published, send, sentinel_f32, ship,
    soon, tag, Pair, OWNER, SENTINEL_BYTE,
};
use crate::{codec, Dest, DeviceDest, Dtype, RegionKind, TransportError};

/// C4: unknown regions, out-of-range and reversed ranges, partial elements, publications of the
/// wrong length and wrong region kinds (published, accumulator, inbox) are typed errors; refused
/// reads leave their destination untouched; afterwards every region is unchanged and the refused
/// accumulates consumed no write id.
pub async fn bad_requests_are_typed_errors_c4(pair: Pair) {
    const LEN: usize = 16;
    let b = pair.reader.backend();
    let values = ramp(Dtype::Bf16, LEN, 1.0);
    let initial = codec::encode(Dtype::Bf16, &values);
    let ((params, acc, inbox), [p, a, i]) =
        one_of_each(&pair, Dtype::Bf16, initial.clone(), 3, LEN);
    must_accumulate(&pair, &a, 0, &[1.0; LEN], tag(0, 1)).await;

    // Unknown region.
    let mut unknown = p.clone();
    unknown.id = p.id.max(a.id).max(i.id).wrapping_add(1_000_003);
    let (result, out) = read_bytes(&pair, &unknown, 0..1).await;
    assert_refused(
        b,
        "read of an unknown region",
        result,
        TransportError::UnknownRegion {
            owner: OWNER,
            region: unknown.id,
        },
    );
    assert_eq!(
        out, [SENTINEL_BYTE; 2],
        "{b}: refused read wrote its destination"
    );
    unknown.kind = RegionKind::Accumulator;
    unknown.dtype = Dtype::F32;
    assert_refused(
        b,
        "accumulate into an unknown region",
        accumulate(&pair, &unknown, 0, &[1.0], tag(0, 2)).await,
        TransportError::UnknownRegion {
            owner: OWNER,
            region: unknown.id,
        },
    );
    unknown.kind = RegionKind::Inbox;
    assert_refused(
        b,
        "send into an unknown region",
        send(&pair, &unknown, tag(0, 2), b"x").await,
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
        let mut out = [sentinel_f32(); 3];
        // Sized for the range where that is possible, so the range check is what refuses it.
        let into = if range.len() == 3 {
            Dest::F32(&mut out[..])
        } else {
            Dest::F32(&mut out[..0])
        };
        let result = pair.reader.read(&p, range.clone(), into, soon()).await;
        assert_refused(
            b,
            &format!("read of elements {range:?}"),
            result,
            TransportError::OutOfRange {
                region: p.id,
                start: range.start as u64,
                end: range.end as u64,
                len: LEN as u64,
            },
        );
        assert_eq!(
            bits(&out),
            bits(&[sentinel_f32(); 3]),
            "{b}: refused read of {range:?} wrote its destination"
        );
    }

    // Out-of-range accumulates.
    for (offset, n) in [(LEN - 2, 3), (LEN, 1), (LEN + 5, 0)] {
        assert_refused(
            b,
            &format!("accumulate of {n} elements at {offset}"),
            accumulate(&pair, &a, offset, &vec![1.0; n], tag(0, 7)).await,
            TransportError::OutOfRange {
                region: a.id,
                start: offset as u64,
                end: (offset + n) as u64,
                len: LEN as u64,
            },
        );
    }
    let overflow = accumulate(&pair, &a, usize::MAX, &[1.0; 2], tag(0, 7)).await;
    assert!(
        matches!(overflow, Err(TransportError::OutOfRange { region, start, .. }) if region == a.id && start == usize::MAX as u64),
        "{b}: accumulate at offset usize::MAX: got {overflow:?}"
    );

    // Partial elements.
    for bytes in [1, 3, 6, 10] {
        assert_refused(
            b,
            &format!("accumulate of {bytes} bytes"),
            pair.reader
                .accumulate(&a, 0, Bytes::from(vec![0u8; bytes]), tag(0, 7), soon())
                .await,
            TransportError::BadPayload {
                region: a.id,
                bytes: bytes as u64,
                dtype: Dtype::F32,
            },
        );
    }

    // Wrong kinds.
    for (handle, actual) in [(&a, RegionKind::Accumulator), (&i, RegionKind::Inbox)] {
        let (result, out) = read_f32(&pair, handle, 0..0).await;
        assert!(out.is_empty());
        assert_refused(
            b,
            &format!("read of an {actual:?} region"),
            result,
            TransportError::WrongKind {
                region: handle.id,
                expected: RegionKind::Published,
                actual,
            },
        );
    }
    for (handle, actual) in [(&p, RegionKind::Published), (&i, RegionKind::Inbox)] {
        assert_refused(
            b,
            &format!("accumulate into a {actual:?} region"),
            accumulate(&pair, handle, 0, &[1.0], tag(0, 7)).await,
            TransportError::WrongKind {
                region: handle.id,
                expected: RegionKind::Accumulator,
                actual,
            },
        );
    }
    for (handle, actual) in [(&p, RegionKind::Published), (&a, RegionKind::Accumulator)] {
        assert_refused(
            b,
            &format!("send into a {actual:?} region"),
            send(&pair, handle, tag(0, 7), b"x").await,
            TransportError::WrongKind {
                region: handle.id,
                expected: RegionKind::Inbox,
                actual,
            },
        );
    }

    // Publications of the wrong length.
    assert_refused(
        b,
        "publish of one element too few",
        params.publish(4, codec::encode(Dtype::Bf16, &values[1..])),
        TransportError::LengthMismatch {
            region: p.id,
            elements: LEN as u64 - 1,
            len: LEN as u64,
        },
    );
    assert_refused(
        b,
        "publish of f32 bytes into a bf16 region",
        params.publish(4, codec::encode_f32(&values)),
        TransportError::LengthMismatch {
            region: p.id,
            elements: 2 * LEN as u64,
            len: LEN as u64,
        },
    );
    assert_refused(
        b,
        "publish of a partial element",
        params.publish(4, Bytes::from(vec![0u8; 2 * LEN + 1])),
        TransportError::BadPayload {
            region: p.id,
            bytes: 2 * LEN as u64 + 1,
            dtype: Dtype::Bf16,
        },
    );
    match pair
        .owner
        .register_published(OWNER, Dtype::Bf16, Bytes::from(vec![0u8; 5]), 0)
    {
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

    // Every region is unchanged, and write id 7 (only ever refused) is still free.
    assert_eq!(params.version(), 3, "{b}: version after refused publishes");
    let (version, after) = must_read_bytes(&pair, &p, 0..LEN).await;
    assert_eq!(version, 3, "{b}: version read after refused requests");
    assert_eq!(after, initial, "{b}: contents after refused requests");
    assert_eq!(acc.epoch(), 0, "{b}: epoch after refused requests");
    must_accumulate(&pair, &a, 0, &[1.0; LEN], tag(0, 7)).await;
    assert_eq!(
        acc.take(1),
        [2.0; LEN],
        "{b}: accumulator after refused requests"
    );
    assert_eq!(inbox.epoch(), 0, "{b}: inbox epoch after refused requests");
}

/// C4: a destination that does not hold exactly `range.len()` elements (bytes of the region's
/// dtype for a byte destination, values for an `f32` one) is `BadDestination` naming both sizes,
/// and nothing is written; a destination of the right size then works.
pub async fn bad_destination_is_refused_c4(pair: Pair) {
    const LEN: usize = 16;
    let b = pair.reader.backend();
    for dtype in [Dtype::Bf16, Dtype::F32] {
        let size = dtype.size();
        let values = ramp(dtype, LEN, 0.5);
        let region = register_published(&pair, dtype, codec::encode(dtype, &values), 2);
        let handle = ship(&region.handle());
        let range = 3..11; // 8 elements
        let n = range.len();
        for got in [n * size - 1, n * size + 1, n, 0, n * size * 2] {
            let mut out = vec![SENTINEL_BYTE; got];
            let result = pair
                .reader
                .read(&handle, range.clone(), Dest::Bytes(&mut out), soon())
                .await;
            assert_refused(
                b,
                &format!("{dtype:?} read of {n} elements into {got} bytes"),
                result,
                TransportError::BadDestination {
                    region: handle.id,
                    expected: (n * size) as u64,
                    got: got as u64,
                },
            );
            assert!(
                out.iter().all(|x| *x == SENTINEL_BYTE),
                "{b}: refused read wrote its byte destination"
            );
        }
        for got in [n - 1, n + 1, n * size, 0] {
            let mut out = vec![sentinel_f32(); got];
            let result = pair
                .reader
                .read(&handle, range.clone(), Dest::F32(&mut out), soon())
                .await;
            assert_refused(
                b,
                &format!("{dtype:?} read of {n} elements into {got} f32s"),
                result,
                TransportError::BadDestination {
                    region: handle.id,
                    expected: n as u64,
                    got: got as u64,
                },
            );
            assert!(
                out.iter().all(|x| x.to_bits() == sentinel_f32().to_bits()),
                "{b}: refused read wrote its f32 destination"
            );
        }
        let (version, got) = must_read_f32(&pair, &handle, range.clone()).await;
        assert_eq!(version, 2, "{b}: read after refused reads");
        assert_eq!(
            bits(&got),
            bits(&values[range]),
            "{b}: read after refused reads"
        );
    }
}

/// C4: a host backend refuses a device destination with `Unsupported`. Tolerant of device
/// backends: a backend that supports device destinations must still refuse the null device
/// address given here, with any typed error (then this check is skipped); succeeding fails.
pub async fn device_destination_is_unsupported_c4(pair: Pair) {
    let b = pair.reader.backend();
    let region = register_published(&pair, Dtype::Bf16, codec::encode(Dtype::Bf16, &[1.0; 8]), 1);
    let handle = ship(&region.handle());
    let device = DeviceDest {
        device: 0,
        ptr: 0,
        bytes: 8 * Dtype::Bf16.size() as u64,
    };
    match pair
        .reader
        .read(&handle, 0..8, Dest::Device(device), soon())
        .await
    {
        Err(TransportError::Unsupported { what }) => {
            assert!(!what.is_empty(), "{b}: Unsupported says what");
        }
        Err(other) => eprintln!(
            "{b}: device_destination_is_unsupported_c4 skipped: the backend takes device \
             destinations (it refused the null one with: {other})"
        ),
        Ok(version) => panic!(
            "{b}: a read into device address 0 succeeded (version {version}): a host backend must \
             refuse device destinations with Unsupported"
        ),
    }
}

/// C4: zero-length regions, reads and accumulates within bounds are valid, not errors, and report
/// the version of the region read.
pub async fn empty_regions_and_ranges_are_valid_c4(pair: Pair) {
    let b = pair.reader.backend();
    let empty = register_published(&pair, Dtype::Bf16, Bytes::new(), 2);
    let handle = ship(&empty.handle());
    assert_eq!(handle.len, 0, "{b}: empty published region length");
    let (version, got) = must_read_bytes(&pair, &handle, 0..0).await;
    assert_eq!((version, got.len()), (2, 0), "{b}: empty byte read");
    let (version, got) = must_read_f32(&pair, &handle, 0..0).await;
    assert_eq!((version, got.len()), (2, 0), "{b}: empty f32 read");

    let params = register_published(&pair, Dtype::F32, codec::encode_f32(&[1.0; 4]), 5);
    let handle = ship(&params.handle());
    for at in [0, 2, 4] {
        let (version, _) = must_read_bytes(&pair, &handle, at..at).await;
        assert_eq!(version, 5, "{b}: empty read at {at}");
    }

    let acc = register_accumulator(&pair, 4, 0);
    let handle = ship(&acc.handle());
    for (write_id, at) in [(1, 0), (2, 4)] {
        must_accumulate(&pair, &handle, at, &[], tag(0, write_id)).await;
    }
    must_accumulate(&pair, &handle, 1, &[0.5], tag(0, 3)).await;
    assert_eq!(
        acc.take(1),
        [0.0, 0.5, 0.0, 0.0],
        "{b}: empty accumulates add nothing"
    );
    let none = register_accumulator(&pair, 0, 0);
    must_accumulate(&pair, &ship(&none.handle()), 0, &[], tag(0, 1)).await;
    assert!(none.take(1).is_empty(), "{b}: empty accumulator");
}
