//! An inbox region of the local backend: tagged messages held by write id, the current epoch and
//! the write ids delivered in it, all behind one lock, so fencing, delivery, receipt and `advance`
//! are atomic with respect to each other (C7).
//!
//! Waiting: a `recv` that finds no message registers, under the lock, a [`Notify`] for its own tag;
//! a delivery of that tag, and every epoch change, calls `notify_one` on it after releasing the
//! lock. `notify_one` stores a permit when the receiver is not yet waiting, so a delivery between
//! the look and the wait still wakes it (no lost wakeup), and a delivery wakes only the receive it
//! is for, however many other receives the inbox has pending (one per ring step of every
//! collective in flight).

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::identity::Identity;
use super::ids::IdSet;
use crate::deadline::check_deadline;
use crate::error::wide;
use crate::{Deadline, Dtype, EndpointId, Op, RegionHandle, RegionKind, TransportError, WriteTag};

/// Everything a send, a recv or an advance reads and writes.
#[derive(Debug)]
struct State {
    epoch: u64,
    /// Messages of the current epoch that nobody received yet, by write id.
    held: HashMap<u128, Bytes>,
    /// Every write id delivered in the current epoch, received or not, so a retransmit is refused
    /// even after its first copy was received.
    delivered: IdSet,
    /// The receive waiting for each write id of the current epoch.
    waiting: HashMap<u128, Arc<Notify>>,
}

impl State {
    /// Move to `epoch`: drop held messages and ids; returns the messages and the waiters to wake
    /// (outside the lock).
    fn move_to(&mut self, epoch: u64) -> (HashMap<u128, Bytes>, HashMap<u128, Arc<Notify>>) {
        self.epoch = epoch;
        self.delivered.clear();
        (
            std::mem::take(&mut self.held),
            std::mem::take(&mut self.waiting),
        )
    }
}

/// Wake every receive of a previous epoch (each then finds itself aborted).
fn wake_all(waiting: HashMap<u128, Arc<Notify>>) {
    for notify in waiting.into_values() {
        notify.notify_one();
    }
}

/// State of an inbox region, shared by the registry (senders) and the owner's guard (receiver).
#[derive(Debug)]
pub(super) struct Inbox {
    name: Identity,
    pub(super) capacity: usize,
    state: Mutex<State>,
}

impl Inbox {
    /// An empty inbox at `epoch` holding at most `capacity` messages.
    pub(super) fn new(name: Identity, capacity: usize, epoch: u64) -> Self {
        Self {
            name,
            capacity,
            state: Mutex::new(State {
                epoch,
                held: HashMap::new(),
                delivered: IdSet::default(),
                waiting: HashMap::new(),
            }),
        }
    }

    pub(super) fn owner(&self) -> EndpointId {
        self.name.owner
    }

    pub(super) fn handle(&self) -> RegionHandle {
        self.name
            .handle(RegionKind::Inbox, Dtype::F32, 0, self.epoch())
    }

    pub(super) fn epoch(&self) -> u64 {
        self.state.lock().epoch
    }

    /// Hold `data` under `tag`. A newer epoch first moves the inbox to it (dropping held messages
    /// and waking older receives, as `advance`). Checks, in order: epoch (older is stale), write id,
    /// capacity; any of these failures leaves the inbox unchanged (a refused write id stays free).
    pub(super) fn deliver(&self, tag: WriteTag, data: Bytes) -> Result<(), TransportError> {
        let (dropped, woken, outcome) = {
            let mut state = self.state.lock();
            // A sender already in a newer attempt moves the inbox there first (as `advance`): the
            // owner is still in a discarded one, or has not begun the new one yet.
            let (dropped, woken) = if tag.epoch > state.epoch {
                state.move_to(tag.epoch)
            } else {
                (HashMap::new(), HashMap::new())
            };
            let outcome = self.check_and_hold(&mut state, tag, data);
            (dropped, woken, outcome)
        };
        drop(dropped);
        wake_all(woken);
        // The receive this message is for, if it is already waiting.
        if let Some(notify) = outcome? {
            notify.notify_one();
        }
        Ok(())
    }

    /// Under the lock: epoch, write id and capacity checks, then hold the message; the waiting
    /// receive to wake, if any.
    fn check_and_hold(
        &self,
        state: &mut State,
        tag: WriteTag,
        data: Bytes,
    ) -> Result<Option<Arc<Notify>>, TransportError> {
        self.name.fence(&tag, state.epoch, &state.delivered)?;
        if state.held.len() >= self.capacity {
            return Err(TransportError::InboxFull {
                region: self.name.id,
                held: wide(state.held.len()),
                capacity: wide(self.capacity),
            });
        }
        state.delivered.insert(tag.write_id);
        state.held.insert(tag.write_id, data);
        Ok(state.waiting.get(&tag.write_id).cloned())
    }

    /// The message tagged `tag` if it is here (removed), `None` if it may still come, or why it
    /// never will.
    fn try_take(&self, state: &mut State, tag: WriteTag) -> Result<Option<Bytes>, TransportError> {
        if tag.epoch < state.epoch {
            return Err(TransportError::Aborted {
                region: self.name.id,
                epoch: tag.epoch,
                current: state.epoch,
            });
        }
        if tag.epoch > state.epoch {
            return Err(TransportError::StaleEpoch {
                region: self.name.id,
                got: tag.epoch,
                current: state.epoch,
            });
        }
        if let Some(data) = state.held.remove(&tag.write_id) {
            return Ok(Some(data));
        }
        if state.delivered.contains(tag.write_id) {
            // Delivered and already received: it will never be here again.
            return Err(TransportError::DuplicateWrite {
                region: self.name.id,
                epoch: state.epoch,
                write_id: tag.write_id,
            });
        }
        Ok(None)
    }

    pub(super) async fn recv(
        &self,
        tag: WriteTag,
        deadline: Deadline,
    ) -> Result<Bytes, TransportError> {
        check_deadline(deadline, self.name.owner, self.name.id, Op::Recv)?;
        loop {
            let notify = {
                let mut state = self.state.lock();
                let taken = self.try_take(&mut state, tag);
                if !matches!(taken, Ok(None)) {
                    state.waiting.remove(&tag.write_id);
                    if let Some(data) = taken? {
                        return Ok(data);
                    }
                }
                // Registered under the lock: a delivery after this wakes (or leaves a permit for)
                // exactly this receive.
                state
                    .waiting
                    .entry(tag.write_id)
                    .or_insert_with(|| Arc::new(Notify::new()))
                    .clone()
            };
            let woken = tokio::time::timeout_at(
                tokio::time::Instant::from_std(deadline),
                notify.notified(),
            )
            .await;
            if woken.is_err() {
                self.state.lock().waiting.remove(&tag.write_id);
                return Err(TransportError::DeadlineExceeded {
                    owner: self.name.owner,
                    region: self.name.id,
                    op: Op::Recv,
                });
            }
        }
    }

    pub(super) fn advance(&self, epoch: u64) {
        let (dropped, woken) = {
            let mut state = self.state.lock();
            if epoch <= state.epoch {
                return;
            }
            state.move_to(epoch)
        };
        // Freed and woken outside the lock.
        drop(dropped);
        wake_all(woken);
    }
}
