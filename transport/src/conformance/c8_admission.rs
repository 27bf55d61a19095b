//! C8 admission: an accumulator's owner may install a [`WriteGuard`](crate::WriteGuard); a write
//! its guard does not admit is refused with `RefusedWrite` and leaves no trace, so the genuine
//! write with the same id still lands. Inboxes ignore tokens.

use std::sync::Arc;

use parking_lot::Mutex;

use super::{
    accumulate, assert_refused, must_accumulate, must_recv, must_send, register_accumulator,
    register_inbox, ship, Pair, OWNER,
};
use crate::{TransportError, WriteTag};

/// The token the checks' guard expects for a write: derived from epoch and write id, so a token
/// valid for one write is wrong for every other.
fn expected_token(epoch: u64, write_id: u128) -> u128 {
    (write_id ^ 0x5eed_0000_0000_0000_0000_0000_0000_0000).wrapping_add(u128::from(epoch))
}

fn tagged(epoch: u64, write_id: u128, token: u128) -> WriteTag {
    WriteTag {
        epoch,
        write_id,
        token,
    }
}

/// C8: without a guard every token is admitted. With one, a write with the wrong token is
/// `RefusedWrite` (naming owner, region, epoch and write id) and changes nothing: not the values,
/// not its write id, which the genuine write then uses; admission comes before fencing (a wrong
/// token is refused as such whatever its epoch, and a forger cannot tell an applied write id from
/// a free one). The guard sees each tag exactly as the writer sent it (token included, whatever
/// the wire in between).
pub async fn refused_write_changes_nothing_c8(pair: Pair) {
    let b = pair.reader.backend();
    let acc = register_accumulator(&pair, 4, 2);
    let handle = ship(&acc.handle());
    // Unguarded: any token is applied.
    must_accumulate(&pair, &handle, 0, &[1.0], tagged(2, 1, u128::MAX)).await;
    let seen: Arc<Mutex<Vec<WriteTag>>> = Arc::default();
    let log = Arc::clone(&seen);
    let installed = acc.admit_only(Arc::new(move |tag: &WriteTag| {
        log.lock().push(*tag);
        tag.token == expected_token(tag.epoch, tag.write_id)
    }));
    match installed {
        Ok(()) => {}
        Err(TransportError::Unsupported { what }) => {
            eprintln!("{b}: refused_write_changes_nothing_c8 skipped: {what}");
            return;
        }
        Err(e) => panic!("{b}: installing a write guard failed: {e}"),
    }
    let refused = |epoch: u64, write_id: u128| TransportError::RefusedWrite {
        owner: OWNER,
        region: handle.id,
        epoch,
        write_id,
    };
    let forged = tagged(2, 7, expected_token(2, 7) ^ 1);
    assert_refused(
        b,
        "a write with the wrong token",
        accumulate(&pair, &handle, 1, &[100.0, 100.0], forged).await,
        refused(2, 7),
    );
    let stale = tagged(1, 8, 0);
    assert_refused(
        b,
        "a write with the wrong token and a stale epoch",
        accumulate(&pair, &handle, 0, &[100.0], stale).await,
        refused(1, 8),
    );
    // The genuine write of id 7 is applied: the forgery did not consume its id.
    let genuine = tagged(2, 7, expected_token(2, 7));
    must_accumulate(&pair, &handle, 1, &[2.0, 3.0], genuine).await;
    assert_refused(
        b,
        "a forged copy of an applied write",
        accumulate(&pair, &handle, 1, &[100.0, 100.0], forged).await,
        refused(2, 7),
    );
    assert_refused(
        b,
        "the genuine write again",
        accumulate(&pair, &handle, 1, &[2.0, 3.0], genuine).await,
        TransportError::DuplicateWrite {
            region: handle.id,
            epoch: 2,
            write_id: 7,
        },
    );
    assert_eq!(
        acc.take(3),
        [1.0, 2.0, 3.0, 0.0],
        "{b}: only the unguarded and the genuine writes landed"
    );
    // The guard stays across epochs.
    assert_refused(
        b,
        "a wrong token after take",
        accumulate(
            &pair,
            &handle,
            0,
            &[100.0],
            tagged(3, 7, expected_token(2, 7)),
        )
        .await,
        refused(3, 7),
    );
    must_accumulate(
        &pair,
        &handle,
        3,
        &[4.0],
        tagged(3, 7, expected_token(3, 7)),
    )
    .await;
    assert_eq!(acc.take(4), [0.0, 0.0, 0.0, 4.0], "{b}: epoch 3");
    let seen = seen.lock().clone();
    for tag in [forged, stale, genuine] {
        assert!(
            seen.contains(&tag),
            "{b}: the guard never saw {tag:?} as sent (it saw {seen:?})"
        );
    }
}

/// C8: an inbox has no guard and receives by epoch and write id alone: a message sent with any
/// token is received with a tag of another.
pub async fn inbox_ignores_tokens_c8(pair: Pair) {
    let b = pair.reader.backend();
    let inbox = register_inbox(&pair, 4);
    let handle = ship(&inbox.handle());
    must_send(&pair, &handle, tagged(4, 11, u128::MAX), b"ring").await;
    let got = must_recv(b, inbox.as_ref(), tagged(4, 11, 0)).await;
    assert_eq!(&got[..], b"ring", "{b}: message received by epoch and id");
}
