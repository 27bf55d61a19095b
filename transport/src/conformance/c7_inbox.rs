//! C7 inbox: two-sided tagged messages, fenced by epoch, deduplicated by write id, bounded.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::{
    assert_describes, join, must_recv, must_send, register_inbox, send, ship, soon, tag, Pair,
    MIN_INBOX_CAPACITY,
};
use crate::{InboxRegion, RegionKind, TransportError};

/// A message payload that names its sender and index, of a length that varies with them.
fn payload(writer: usize, index: usize) -> Vec<u8> {
    let mut data = format!("writer {writer} message {index}:").into_bytes();
    data.resize(data.len() + (writer * 7 + index) % 13, index as u8);
    data
}

fn inbox_capacity(backend: &str, inbox: &dyn InboxRegion) -> usize {
    let capacity = inbox.capacity();
    assert!(
        capacity >= MIN_INBOX_CAPACITY,
        "{backend}: the inbox checks need an inbox capacity of at least {MIN_INBOX_CAPACITY}, \
         the factory configured {capacity}"
    );
    capacity
}

/// C7: messages sent with different tags (an empty one too) are received by tag, in another order
/// than sent, each with exactly its bytes; a recv that waits before its message is sent is woken
/// by it; the handle describes an inbox at its epoch.
pub async fn send_then_recv_by_tag_c7(pair: Pair) {
    let b = pair.reader.backend();
    let inbox: Arc<dyn InboxRegion> = Arc::from(register_inbox(&pair, 4));
    let handle = ship(&inbox.handle());
    assert_describes(b, &handle, RegionKind::Inbox, 0, 4);
    assert_eq!(inbox.epoch(), 4, "{b}: inbox epoch");

    let ids: [u128; 5] = [9, 3, u128::MAX, 0, 7];
    for (n, id) in ids.iter().enumerate() {
        must_send(&pair, &handle, tag(4, *id), &payload(0, n)).await;
    }
    for n in [3, 4, 0, 2, 1] {
        let got = must_recv(b, inbox.as_ref(), tag(4, ids[n])).await;
        assert_eq!(got[..], payload(0, n), "{b}: message {:#x}", ids[n]);
    }
    must_send(&pair, &handle, tag(4, 11), b"").await;
    assert!(
        must_recv(b, inbox.as_ref(), tag(4, 11)).await.is_empty(),
        "{b}: empty message"
    );

    // A recv waiting before the send.
    let waiter = {
        let inbox = Arc::clone(&inbox);
        tokio::spawn(async move { inbox.recv(tag(4, 100), soon()).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    must_send(&pair, &handle, tag(4, 101), b"not this one").await;
    must_send(&pair, &handle, tag(4, 100), b"wake up").await;
    let got = join(waiter).await;
    assert_eq!(
        got.as_deref(),
        Ok(&b"wake up"[..]),
        "{b}: a waiting recv gets its message"
    );
    assert_eq!(
        &must_recv(b, inbox.as_ref(), tag(4, 101)).await[..],
        b"not this one"
    );
}

/// C7: a send tagged with an older epoch is `StaleEpoch` and leaves no trace (its write id stays
/// free); a recv of a newer epoch is `StaleEpoch` at once; a send of a newer epoch moves the inbox
/// there (held messages dropped, waiting older receives aborted).
pub async fn inbox_stale_epoch_refused_c7(pair: Pair) {
    let b = pair.reader.backend();
    let inbox = register_inbox(&pair, 5);
    let handle = ship(&inbox.handle());
    must_send(&pair, &handle, tag(5, 1), b"held").await;
    for epoch in [4, 0] {
        assert_eq!(
            send(&pair, &handle, tag(epoch, 9), b"stale").await,
            Err(TransportError::StaleEpoch {
                region: handle.id,
                got: epoch,
                current: 5
            }),
            "{b}: send tagged epoch {epoch} into an inbox at epoch 5"
        );
    }
    assert_eq!(
        inbox.recv(tag(6, 9), soon()).await,
        Err(TransportError::StaleEpoch {
            region: handle.id,
            got: 6,
            current: 5
        }),
        "{b}: recv of a newer epoch"
    );
    assert_eq!(inbox.epoch(), 5, "{b}: refused sends left the epoch");
    // A newer sender moves the inbox: the held epoch-5 message is dropped, a waiting epoch-5
    // receive is aborted, and epoch 5 is refused from now on.
    let waiting = inbox.recv(tag(5, 2), soon());
    let moved = async {
        tokio::task::yield_now().await;
        must_send(&pair, &handle, tag(7, 9), b"newer").await;
    };
    let (waited, ()) = tokio::join!(waiting, moved);
    assert_eq!(
        waited,
        Err(TransportError::Aborted {
            region: handle.id,
            epoch: 5,
            current: 7
        }),
        "{b}: a receive of the older epoch is aborted by a newer send"
    );
    assert_eq!(inbox.epoch(), 7, "{b}: a newer send moved the inbox");
    assert_eq!(
        send(&pair, &handle, tag(5, 3), b"late").await,
        Err(TransportError::StaleEpoch {
            region: handle.id,
            got: 5,
            current: 7
        }),
        "{b}: the older epoch is refused once moved"
    );
    assert!(
        matches!(
            inbox.recv(tag(5, 1), soon()).await,
            Err(TransportError::Aborted { .. })
        ),
        "{b}: the held older message is gone"
    );
    assert_eq!(&must_recv(b, inbox.as_ref(), tag(7, 9)).await[..], b"newer");
}

/// C7: a write id already delivered in the epoch is `DuplicateWrite`, before and after its message
/// was received, and the first message is the one received; a second recv of it is
/// `DuplicateWrite` at once; `advance` forgets the ids.
pub async fn inbox_duplicate_refused_even_after_recv_c7(pair: Pair) {
    let b = pair.reader.backend();
    let inbox = register_inbox(&pair, 0);
    let handle = ship(&inbox.handle());
    let duplicate = |epoch| {
        Err(TransportError::DuplicateWrite {
            region: handle.id,
            epoch,
            write_id: 42,
        })
    };
    must_send(&pair, &handle, tag(0, 42), b"first").await;
    assert_eq!(
        send(&pair, &handle, tag(0, 42), b"second").await,
        duplicate(0),
        "{b}: retransmit while held"
    );
    assert_eq!(
        &must_recv(b, inbox.as_ref(), tag(0, 42)).await[..],
        b"first"
    );
    assert_eq!(
        send(&pair, &handle, tag(0, 42), b"third").await,
        duplicate(0),
        "{b}: retransmit after recv"
    );
    // Waits for its deadline (then fails) if the backend forgot the message was received.
    let again = inbox.recv(tag(0, 42), soon()).await;
    assert_eq!(
        again.map(|_| ()),
        duplicate(0),
        "{b}: second recv of one message"
    );
    inbox.advance(1);
    must_send(&pair, &handle, tag(1, 42), b"next epoch").await;
    assert_eq!(
        &must_recv(b, inbox.as_ref(), tag(1, 42)).await[..],
        b"next epoch"
    );
}

/// C7: `advance` wakes every recv of the older epoch with `Aborted`, drops the held messages of the
/// older epoch (a recv of one is `Aborted`), fences sends of it, forgets its write ids, never
/// moves backwards; a recv of a newer epoch is `StaleEpoch`.
pub async fn advance_aborts_waiters_and_drops_messages_c7(pair: Pair) {
    let b = pair.reader.backend();
    let inbox: Arc<dyn InboxRegion> = Arc::from(register_inbox(&pair, 0));
    let handle = ship(&inbox.handle());
    must_send(&pair, &handle, tag(0, 1), b"old").await;
    let waiters: Vec<JoinHandle<_>> = [2, 3]
        .into_iter()
        .map(|id| {
            let inbox = Arc::clone(&inbox);
            tokio::spawn(async move { inbox.recv(tag(0, id), soon()).await })
        })
        .collect();
    // Let the waiters start waiting (they are aborted either way; this exercises the wake-up).
    tokio::time::sleep(Duration::from_millis(20)).await;
    inbox.advance(1);
    let aborted = Err(TransportError::Aborted {
        region: handle.id,
        epoch: 0,
        current: 1,
    });
    for waiter in waiters {
        assert_eq!(
            join(waiter).await,
            aborted,
            "{b}: waiting recv of epoch 0 after advance"
        );
    }
    assert_eq!(inbox.epoch(), 1, "{b}: epoch after advance");
    assert_eq!(
        ship(&inbox.handle()).version,
        1,
        "{b}: handle epoch after advance"
    );
    assert_eq!(
        inbox.recv(tag(0, 1), soon()).await,
        aborted,
        "{b}: recv of a held message of the older epoch"
    );
    assert_eq!(
        send(&pair, &handle, tag(0, 5), b"late").await,
        Err(TransportError::StaleEpoch {
            region: handle.id,
            got: 0,
            current: 1
        }),
        "{b}: send of the older epoch"
    );
    must_send(&pair, &handle, tag(1, 1), b"new").await;
    assert_eq!(
        &must_recv(b, inbox.as_ref(), tag(1, 1)).await[..],
        b"new",
        "{b}: the new epoch's message, not the dropped one"
    );
    inbox.advance(0);
    inbox.advance(1);
    assert_eq!(inbox.epoch(), 1, "{b}: advance never moves backwards");
    assert_eq!(
        inbox.recv(tag(2, 1), soon()).await,
        Err(TransportError::StaleEpoch {
            region: handle.id,
            got: 2,
            current: 1
        }),
        "{b}: recv of a newer epoch"
    );
}

/// C7: an inbox holds at most its capacity of messages: one more is `InboxFull` naming both counts
/// and consumes no write id; a recv frees a place; `advance` drops every held message, freeing all.
pub async fn inbox_capacity_bounds_held_messages_c7(pair: Pair) {
    let b = pair.reader.backend();
    let inbox = register_inbox(&pair, 0);
    let capacity = inbox_capacity(b, inbox.as_ref());
    let handle = ship(&inbox.handle());
    let full = Err(TransportError::InboxFull {
        region: handle.id,
        held: capacity as u64,
        capacity: capacity as u64,
    });
    let last = capacity as u128;
    for id in 0..last {
        must_send(&pair, &handle, tag(0, id), &payload(0, id as usize)).await;
    }
    assert_eq!(
        send(&pair, &handle, tag(0, last), b"one too many").await,
        full,
        "{b}: send into a full inbox"
    );
    assert_eq!(
        &must_recv(b, inbox.as_ref(), tag(0, 0)).await[..],
        payload(0, 0)
    );
    must_send(&pair, &handle, tag(0, last), b"fits now").await;
    assert_eq!(
        send(&pair, &handle, tag(0, last + 1), b"full again").await,
        full,
        "{b}: send into a full inbox after one recv and one send"
    );

    // Advancing drops the held messages: the new epoch has room for a whole capacity again.
    inbox.advance(1);
    for id in 0..last {
        must_send(&pair, &handle, tag(1, id), &payload(1, id as usize)).await;
    }
    for id in (0..last).rev() {
        assert_eq!(
            &must_recv(b, inbox.as_ref(), tag(1, id)).await[..],
            payload(1, id as usize),
            "{b}: message {id} of epoch 1"
        );
    }
}

/// C7: 4 tasks send (through the reader) 64 messages each at once, or fewer to fit the capacity,
/// while 2 owner tasks receive all of them concurrently in two different orders (each takes the
/// messages of two senders); every send is acknowledged and every recv gets exactly its message.
pub async fn concurrent_senders_inbox_c7(pair: Pair) {
    const WRITERS: usize = 4;
    let b = pair.reader.backend();
    let inbox: Arc<dyn InboxRegion> = Arc::from(register_inbox(&pair, 7));
    let per_writer = (inbox_capacity(b, inbox.as_ref()) / WRITERS).min(64);
    let handle = ship(&inbox.handle());
    let id = |writer: usize, index: usize| ((writer as u128) << 64) | index as u128;

    let receivers: Vec<JoinHandle<()>> = (0..2)
        .map(|receiver| {
            let inbox = Arc::clone(&inbox);
            tokio::spawn(async move {
                // Receiver 0: senders 0 and 2 in send order; receiver 1: senders 1 and 3 backwards.
                for index in 0..per_writer {
                    for writer in [receiver, receiver + 2] {
                        let index = if receiver == 0 {
                            index
                        } else {
                            per_writer - 1 - index
                        };
                        let got = inbox.recv(tag(7, id(writer, index)), soon()).await;
                        match got {
                            Ok(data) => assert_eq!(
                                data[..],
                                payload(writer, index),
                                "{b}: message {index} of writer {writer}"
                            ),
                            Err(e) => {
                                panic!("{b}: recv of message {index} of writer {writer}: {e}")
                            }
                        }
                    }
                }
            })
        })
        .collect();
    let senders: Vec<JoinHandle<()>> = (0..WRITERS)
        .map(|writer| {
            let pair = pair.clone();
            let handle = handle.clone();
            tokio::spawn(async move {
                for index in 0..per_writer {
                    must_send(
                        &pair,
                        &handle,
                        tag(7, id(writer, index)),
                        &payload(writer, index),
                    )
                    .await;
                    if index % 8 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
            })
        })
        .collect();
    for task in senders.into_iter().chain(receivers) {
        join(task).await;
    }
}
