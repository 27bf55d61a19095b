//! C3 fencing: accumulates are fenced by epoch and deduplicated by write id; `take` moves the epoch
//! atomically with respect to accumulates.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::task::JoinHandle;

use super::{accumulate, join, must_accumulate, register_accumulator, ship, soon, tag, Pair};
use crate::{codec, TransportError};

/// C3: an accumulate tagged with any epoch but the current one is refused with `StaleEpoch` and
/// changes nothing, not even the set of applied write ids; after a take, a write of the previous
/// epoch is refused.
pub async fn stale_epoch_refused_c3(pair: Pair) {
    let b = pair.reader.backend();
    let acc = register_accumulator(&pair, 4, 5);
    let handle = ship(&acc.handle());
    for epoch in [4, 6, 0, u64::MAX] {
        let result = accumulate(&pair, &handle, 0, &[1.0; 4], tag(epoch, 9)).await;
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
    must_accumulate(&pair, &handle, 1, &[2.0], tag(5, 9)).await;
    assert_eq!(
        acc.take(6),
        [0.0, 2.0, 0.0, 0.0],
        "{b}: only the fresh write"
    );
    let late = accumulate(&pair, &handle, 0, &[1.0], tag(5, 10)).await;
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
pub async fn duplicate_write_refused_c3(pair: Pair) {
    let b = pair.reader.backend();
    let acc = register_accumulator(&pair, 3, 0);
    let handle = ship(&acc.handle());
    for write_id in [42, u128::MAX] {
        must_accumulate(&pair, &handle, 0, &[1.0; 3], tag(0, write_id)).await;
        let again = accumulate(&pair, &handle, 0, &[5.0; 3], tag(0, write_id)).await;
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
    must_accumulate(&pair, &handle, 0, &[1.0; 3], tag(1, 42)).await;
    assert_eq!(
        acc.take(2),
        [1.0; 3],
        "{b}: write ids are forgotten by take"
    );
}

/// C3: `take_applied` returns what `take` would and the write ids applied in the epoch it
/// ends, ascending: a refused write (a duplicate, another epoch) is not among them, and the next
/// epoch starts with none. An owner in another process may answer `Unsupported` (skipped, said).
pub async fn take_applied_names_the_applied_writes_c3(pair: Pair) {
    let b = pair.reader.backend();
    let acc = register_accumulator(&pair, 2, 3);
    let handle = ship(&acc.handle());
    for write_id in [7, 3, u128::MAX] {
        must_accumulate(&pair, &handle, 0, &[1.0, 2.0], tag(3, write_id)).await;
    }
    let again = accumulate(&pair, &handle, 0, &[9.0; 2], tag(3, 3)).await;
    assert!(again.is_err(), "{b}: a repeated write id is refused");
    let stale = accumulate(&pair, &handle, 0, &[9.0; 2], tag(2, 5)).await;
    assert!(stale.is_err(), "{b}: a write of another epoch is refused");
    let applied = match acc.take_applied(4) {
        Ok(applied) => applied,
        Err(TransportError::Unsupported { what }) => {
            eprintln!("{b}: take_applied skipped: unsupported ({what})");
            return;
        }
        Err(e) => panic!("{b}: take_applied: {e}"),
    };
    assert_eq!(
        applied.values,
        [3.0, 6.0],
        "{b}: the sums, as take returns them"
    );
    assert_eq!(
        applied.write_ids,
        [3, 7, u128::MAX],
        "{b}: the applied write ids, ascending, no refused one"
    );
    assert_eq!(acc.epoch(), 4, "{b}: moved to the next epoch");
    must_accumulate(&pair, &handle, 1, &[1.0], tag(4, 7)).await;
    let next = acc.take_applied(5).expect("a second take_applied");
    assert_eq!(next.values, [0.0, 1.0], "{b}: zeroed by the first");
    assert_eq!(next.write_ids, [7], "{b}: only the new epoch's write");
}

/// C3: `progress`, where the owner offers it, counts the writes applied in the current epoch
/// (not a refused one) and starts again at 0 in the epoch a take moves to.
pub async fn progress_counts_the_applied_writes_c3(pair: Pair) {
    let b = pair.reader.backend();
    let acc = register_accumulator(&pair, 2, 7);
    let handle = ship(&acc.handle());
    let Some(mut progress) = acc.progress() else {
        eprintln!("{b}: progress skipped: the owner does not offer it");
        return;
    };
    assert_eq!(
        *progress.borrow_and_update(),
        crate::Progress {
            epoch: 7,
            applied: 0
        },
        "{b}: a fresh accumulator"
    );
    for write_id in [1, 2, 3] {
        must_accumulate(&pair, &handle, 0, &[1.0], tag(7, write_id)).await;
    }
    let again = accumulate(&pair, &handle, 0, &[1.0], tag(7, 2)).await;
    assert!(again.is_err(), "{b}: a repeated write id is refused");
    assert!(progress.has_changed().unwrap_or(false), "{b}: changed");
    assert_eq!(
        *progress.borrow_and_update(),
        crate::Progress {
            epoch: 7,
            applied: 3
        },
        "{b}: three applied writes, the refused one not counted"
    );
    drop(acc.take(8));
    assert_eq!(
        *progress.borrow_and_update(),
        crate::Progress {
            epoch: 8,
            applied: 0
        },
        "{b}: a take starts the next epoch at 0"
    );
}

/// C3: 4 tasks issue 1024 single-element epoch-0 accumulates while the owner takes the
/// accumulator into epoch 1. Every accumulate acknowledged `Ok` is in the taken values, every
/// other one was refused as stale and left no trace: re-sent in epoch 1 under the same write id,
/// it is accepted, and the next take holds exactly those.
pub async fn take_moves_epoch_atomically_c3(pair: Pair) {
    const WRITERS: usize = 4;
    const WRITES: usize = 256;
    const LEN: usize = WRITERS * WRITES;
    let b = pair.reader.backend();
    let acc = register_accumulator(&pair, LEN, 0);
    let handle = ship(&acc.handle());
    let applied = Arc::new(AtomicUsize::new(0));
    let one = codec::encode_f32(&[1.0]);

    let writers: Vec<JoinHandle<Vec<bool>>> = (0..WRITERS)
        .map(|writer| {
            let reader = pair.reader.clone();
            let handle = handle.clone();
            let applied = Arc::clone(&applied);
            let one = one.clone();
            tokio::spawn(async move {
                let mut acked = Vec::with_capacity(WRITES);
                for write in 0..WRITES {
                    let index = writer * WRITES + write;
                    let result = reader
                        .accumulate(&handle, index, one.clone(), tag(0, index as u128), soon())
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

    let mut refused = Vec::new();
    for (writer, handle) in writers.into_iter().enumerate() {
        for (write, acked) in join(handle).await.into_iter().enumerate() {
            let index = writer * WRITES + write;
            let expected = if acked { 1.0 } else { 0.0 };
            assert_eq!(
                taken[index], expected,
                "{b}: write {index} acknowledged {acked} but the taken value is {}",
                taken[index]
            );
            if !acked {
                refused.push(index);
            }
        }
    }
    // Nothing of epoch 0 landed in epoch 1, and the refused writes consumed no write id.
    for &index in &refused {
        must_accumulate(&pair, &handle, index, &[2.0], tag(1, index as u128)).await;
    }
    let mut expected = vec![0.0; LEN];
    for &index in &refused {
        expected[index] = 2.0;
    }
    assert_eq!(
        acc.take(2),
        expected,
        "{b}: epoch 1 holds exactly the re-sent refused writes"
    );
}
