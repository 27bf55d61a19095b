//! C6 batches and deadlines: batches answer per op, in order; an expired deadline refuses an
//! operation without a trace; a wait ends at its deadline.

use std::time::Duration;

use bytes::Bytes;

use super::{
    bits, expired, must_accumulate, must_recv, must_send, one_of_each, register_accumulator,
    register_inbox, register_published, sentinel_f32, ship, soon, tag, Pair, OWNER, SENTINEL_BYTE,
};
use crate::{
    codec, deadline_in, AccumulateOp, Dest, Dtype, Op, ReadOp, RegionHandle, TransportError,
};

fn deadline_exceeded(handle: &RegionHandle, op: Op) -> TransportError {
    TransportError::DeadlineExceeded {
        owner: OWNER,
        region: handle.id,
        op,
    }
}

/// C6: a read batch over three regions (distinct versions and contents) with three bad ops in the
/// middle returns one result per op, in order; the good ops filled their destinations, the bad
/// ones left theirs untouched.
pub async fn read_batch_results_in_order_c6(pair: Pair) {
    let b = pair.reader.backend();
    let a_values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
    let b_values = [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0];
    let c_values = [0.5, 0.25, 0.125, 0.0625];
    let ra = register_published(&pair, Dtype::F32, codec::encode_f32(&a_values), 1);
    let rb = register_published(&pair, Dtype::Bf16, codec::encode(Dtype::Bf16, &b_values), 2);
    let rc = register_published(&pair, Dtype::F32, codec::encode_f32(&c_values), 3);
    let (ha, hb, hc) = (ship(&ra.handle()), ship(&rb.handle()), ship(&rc.handle()));
    let mut unknown = hc.clone();
    unknown.id = ha.id.max(hb.id).max(hc.id).wrapping_add(1_000_003);

    let mut out_a = [sentinel_f32(); 8];
    let mut out_b = [SENTINEL_BYTE; 8];
    let mut out_range = [sentinel_f32(); 9];
    let mut out_dest = [sentinel_f32(); 3];
    let mut out_unknown = [sentinel_f32(); 1];
    let mut out_c = [sentinel_f32(); 2];
    let ops = vec![
        ReadOp {
            handle: &ha,
            range: 0..8,
            into: Dest::F32(&mut out_a),
        },
        ReadOp {
            handle: &hb,
            range: 2..6,
            into: Dest::Bytes(&mut out_b),
        },
        ReadOp {
            handle: &hc,
            range: 0..9,
            into: Dest::F32(&mut out_range),
        },
        ReadOp {
            handle: &ha,
            range: 4..8,
            into: Dest::F32(&mut out_dest),
        },
        ReadOp {
            handle: &unknown,
            range: 0..1,
            into: Dest::F32(&mut out_unknown),
        },
        ReadOp {
            handle: &hc,
            range: 1..3,
            into: Dest::F32(&mut out_c),
        },
    ];
    let results = pair.reader.read_batch(ops, soon()).await;
    let expected = vec![
        Ok(1),
        Ok(2),
        Err(TransportError::OutOfRange {
            region: hc.id,
            start: 0,
            end: 9,
            len: 4,
        }),
        Err(TransportError::BadDestination {
            region: ha.id,
            expected: 4,
            got: 3,
        }),
        Err(TransportError::UnknownRegion {
            owner: OWNER,
            region: unknown.id,
        }),
        Ok(3),
    ];
    assert_eq!(results, expected, "{b}: read batch results, in order");
    assert_eq!(bits(&out_a), bits(&a_values), "{b}: batch op 0 contents");
    assert_eq!(
        out_b[..],
        codec::encode(Dtype::Bf16, &b_values[2..6])[..],
        "{b}: batch op 1 contents"
    );
    assert_eq!(
        bits(&out_c),
        bits(&c_values[1..3]),
        "{b}: batch op 5 contents"
    );
    for (i, untouched) in [&out_range[..], &out_dest[..], &out_unknown[..]]
        .into_iter()
        .enumerate()
    {
        assert!(
            untouched
                .iter()
                .all(|v| v.to_bits() == sentinel_f32().to_bits()),
            "{b}: refused batch op {} wrote its destination",
            i + 2
        );
    }
}

/// C6: an accumulate batch over two accumulators (different epochs) with a stale, a duplicate and
/// an out-of-range op among good ones returns one result per op, in order; exactly the good ops
/// were applied.
pub async fn accumulate_batch_results_in_order_c6(pair: Pair) {
    let b = pair.reader.backend();
    let x = register_accumulator(&pair, 4, 0);
    let y = register_accumulator(&pair, 4, 1);
    let (hx, hy) = (ship(&x.handle()), ship(&y.handle()));
    must_accumulate(&pair, &hx, 0, &[100.0; 4], tag(0, 5)).await;
    let op = |handle: &RegionHandle, offset: usize, values: &[f32], epoch: u64, write_id: u128| {
        AccumulateOp {
            handle: handle.clone(),
            offset,
            data: codec::encode_f32(values),
            tag: tag(epoch, write_id),
        }
    };
    let ops = vec![
        op(&hx, 0, &[1.0, 2.0, 3.0, 4.0], 0, 1),
        op(&hy, 1, &[10.0, 20.0], 1, 1),
        op(&hx, 0, &[1000.0; 4], 1, 2),
        op(&hx, 0, &[1000.0; 4], 0, 5),
        op(&hy, 3, &[1000.0; 2], 1, 2),
        op(&hx, 2, &[0.5], 0, 3),
    ];
    let results = pair.reader.accumulate_batch(ops, soon()).await;
    let expected = vec![
        Ok(()),
        Ok(()),
        Err(TransportError::StaleEpoch {
            region: hx.id,
            got: 1,
            current: 0,
        }),
        Err(TransportError::DuplicateWrite {
            region: hx.id,
            epoch: 0,
            write_id: 5,
        }),
        Err(TransportError::OutOfRange {
            region: hy.id,
            start: 3,
            end: 5,
            len: 4,
        }),
        Ok(()),
    ];
    assert_eq!(results, expected, "{b}: accumulate batch results, in order");
    assert_eq!(x.take(1), [101.0, 102.0, 103.5, 104.0], "{b}: batch into x");
    assert_eq!(y.take(2), [0.0, 10.0, 20.0, 0.0], "{b}: batch into y");
}

/// C6: every operation (read, accumulate, send, recv, both batches) started after its deadline is
/// `DeadlineExceeded` naming owner, region and operation, and leaves no trace: destinations keep
/// their sentinel, nothing is added, no write id is consumed, no message is held or taken.
pub async fn expired_deadline_changes_nothing_c6(pair: Pair) {
    let b = pair.reader.backend();
    let ((_published, acc, inbox), [p, a, i]) =
        one_of_each(&pair, Dtype::F32, codec::encode_f32(&[1.0, 2.0]), 4, 2);

    let mut out = [sentinel_f32(); 2];
    let result = pair
        .reader
        .read(&p, 0..2, Dest::F32(&mut out), expired())
        .await;
    assert_eq!(
        result,
        Err(deadline_exceeded(&p, Op::Read)),
        "{b}: expired read"
    );
    assert!(
        out.iter().all(|v| v.to_bits() == sentinel_f32().to_bits()),
        "{b}: expired read wrote its destination"
    );

    let result = pair
        .reader
        .accumulate(&a, 0, codec::encode_f32(&[1.0, 1.0]), tag(0, 1), expired())
        .await;
    assert_eq!(
        result,
        Err(deadline_exceeded(&a, Op::Accumulate)),
        "{b}: expired accumulate"
    );

    let result = pair
        .reader
        .send(&i, tag(0, 1), Bytes::from_static(b"expired"), expired())
        .await;
    assert_eq!(
        result,
        Err(deadline_exceeded(&i, Op::Send)),
        "{b}: expired send"
    );

    let mut out_batch = [sentinel_f32(); 1];
    let mut out_batch2 = [SENTINEL_BYTE; 4];
    let ops = vec![
        ReadOp {
            handle: &p,
            range: 1..2,
            into: Dest::F32(&mut out_batch),
        },
        ReadOp {
            handle: &p,
            range: 0..1,
            into: Dest::Bytes(&mut out_batch2),
        },
    ];
    let results = pair.reader.read_batch(ops, expired()).await;
    assert_eq!(
        results,
        vec![
            Err(deadline_exceeded(&p, Op::Read)),
            Err(deadline_exceeded(&p, Op::Read))
        ],
        "{b}: expired read batch"
    );
    assert_eq!(
        out_batch[0].to_bits(),
        sentinel_f32().to_bits(),
        "{b}: expired batch read wrote"
    );
    assert_eq!(
        out_batch2, [SENTINEL_BYTE; 4],
        "{b}: expired batch read wrote"
    );

    let ops = vec![
        AccumulateOp {
            handle: a.clone(),
            offset: 0,
            data: codec::encode_f32(&[5.0]),
            tag: tag(0, 2),
        },
        AccumulateOp {
            handle: a.clone(),
            offset: 1,
            data: codec::encode_f32(&[5.0]),
            tag: tag(0, 3),
        },
    ];
    let results = pair.reader.accumulate_batch(ops, expired()).await;
    assert_eq!(
        results,
        vec![
            Err(deadline_exceeded(&a, Op::Accumulate)),
            Err(deadline_exceeded(&a, Op::Accumulate))
        ],
        "{b}: expired accumulate batch"
    );

    // No trace: write ids 1..=3 and message id 1 are free, nothing was added or held.
    for write_id in 1..=3 {
        must_accumulate(&pair, &a, 0, &[0.25], tag(0, write_id)).await;
    }
    assert_eq!(
        acc.take(1),
        [0.75, 0.0],
        "{b}: only the later writes were applied"
    );
    must_send(&pair, &i, tag(0, 1), b"fresh").await;
    // An expired recv does not take the message that is there.
    let result = inbox.recv(tag(0, 1), expired()).await;
    assert_eq!(
        result,
        Err(deadline_exceeded(&i, Op::Recv)),
        "{b}: expired recv"
    );
    let got = must_recv(b, inbox.as_ref(), tag(0, 1)).await;
    assert_eq!(
        &got[..],
        b"fresh",
        "{b}: the message sent in time, not the expired one"
    );
}

/// C6: a recv whose message never comes ends at its deadline with `DeadlineExceeded` (asserted on
/// the error, never on elapsed time), also while another message is held; the inbox works
/// normally afterwards.
pub async fn recv_without_message_times_out_c6(pair: Pair) {
    let b = pair.reader.backend();
    let inbox = register_inbox(&pair, 2);
    let handle = ship(&inbox.handle());
    let short = || deadline_in(Duration::from_millis(50));
    let result = inbox.recv(tag(2, 1), short()).await;
    assert_eq!(
        result,
        Err(deadline_exceeded(&handle, Op::Recv)),
        "{b}: recv of a message that never comes"
    );
    must_send(&pair, &handle, tag(2, 2), b"other").await;
    let result = inbox.recv(tag(2, 1), short()).await;
    assert_eq!(
        result,
        Err(deadline_exceeded(&handle, Op::Recv)),
        "{b}: recv of a message that never comes, while another one is held"
    );
    must_send(&pair, &handle, tag(2, 1), b"late").await;
    assert_eq!(&must_recv(b, inbox.as_ref(), tag(2, 1)).await[..], b"late");
    assert_eq!(&must_recv(b, inbox.as_ref(), tag(2, 2)).await[..], b"other");
}
