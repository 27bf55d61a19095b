//! An inbox region of the local backend: tagged messages held by write id, the current epoch and
//! the write ids delivered in it, all behind one lock, so fencing, delivery, receipt and `advance`
//! are atomic with respect to each other (C7).
//!
//! Waiting: a `recv` registers with the inbox's [`Notify`] (`Notified::enable`) *before* it looks
//! for its message, and every delivery and every `advance` calls `notify_waiters` after releasing
//! the lock, so a message that arrives between the look and the wait still wakes it (no lost
//! wakeup). Every delivery wakes every pending `recv` of the inbox, which then looks again for its
//! own tag: cheap for the few receives an inbox has pending at once in neighbour-to-neighbour
//! signalling, and the price of never missing one.

use std::collections::{HashMap, HashSet};
use std::pin::pin;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::registry::Registry;
use crate::error::wide;
use crate::transport::check_deadline;
use crate::{
    Deadline, Descriptor, Dtype, EndpointId, InboxRegion, Op, RegionHandle, RegionId, RegionKind,
    TransportError, WriteTag,
};

/// Everything a send, a recv or an advance reads and writes.
#[derive(Debug)]
struct State {
    epoch: u64,
    /// Messages of the current epoch that nobody received yet, by write id.
    held: HashMap<u128, Bytes>,
    /// Every write id delivered in the current epoch, received or not, so a retransmit is refused
    /// even after its first copy was received.
    delivered: HashSet<u128>,
}

/// State of an inbox region, shared by the registry (senders) and the owner's guard (receiver).
#[derive(Debug)]
pub(super) struct Inbox {
    owner: EndpointId,
    id: RegionId,
    descriptor: Descriptor,
    capacity: usize,
    state: Mutex<State>,
    /// Signalled after every delivery and every advance.
    changed: Notify,
}

impl Inbox {
    /// An empty inbox at `epoch` holding at most `capacity` messages.
    pub(super) fn new(
        owner: EndpointId,
        id: RegionId,
        descriptor: Descriptor,
        capacity: usize,
        epoch: u64,
    ) -> Self {
        Self {
            owner,
            id,
            descriptor,
            capacity,
            state: Mutex::new(State {
                epoch,
                held: HashMap::new(),
                delivered: HashSet::new(),
            }),
            changed: Notify::new(),
        }
    }

    pub(super) fn owner(&self) -> EndpointId {
        self.owner
    }

    fn handle(&self) -> RegionHandle {
        RegionHandle {
            owner: self.owner,
            id: self.id,
            kind: RegionKind::Inbox,
            dtype: Dtype::F32,
            len: 0,
            version: self.epoch(),
            descriptor: self.descriptor.clone(),
        }
    }

    fn epoch(&self) -> u64 {
        self.state.lock().epoch
    }

    /// Hold `data` under `tag`. A newer epoch first moves the inbox to it (dropping held messages
    /// and waking older receives, as `advance`). Checks, in order: epoch (older is stale), write id,
    /// capacity; any of these failures leaves the inbox unchanged (a refused write id stays free).
    pub(super) fn deliver(&self, tag: WriteTag, data: Bytes) -> Result<(), TransportError> {
        let dropped = {
            let mut state = self.state.lock();
            // A sender already in a newer attempt moves the inbox there first (as `advance`): the
            // owner is still in a discarded one, or has not begun the new one yet.
            let dropped = if tag.epoch > state.epoch {
                state.epoch = tag.epoch;
                state.delivered.clear();
                std::mem::take(&mut state.held)
            } else {
                HashMap::new()
            };
            if tag.epoch != state.epoch {
                return Err(TransportError::StaleEpoch {
                    region: self.id,
                    got: tag.epoch,
                    current: state.epoch,
                });
            }
            if state.delivered.contains(&tag.write_id) {
                return Err(TransportError::DuplicateWrite {
                    region: self.id,
                    epoch: state.epoch,
                    write_id: tag.write_id,
                });
            }
            if state.held.len() >= self.capacity {
                return Err(TransportError::InboxFull {
                    region: self.id,
                    held: wide(state.held.len()),
                    capacity: wide(self.capacity),
                });
            }
            state.delivered.insert(tag.write_id);
            state.held.insert(tag.write_id, data);
            dropped
        };
        drop(dropped);
        self.changed.notify_waiters();
        Ok(())
    }

    /// The message tagged `tag` if it is here (removed), `None` if it may still come, or why it
    /// never will.
    fn try_take(&self, tag: WriteTag) -> Result<Option<Bytes>, TransportError> {
        let mut state = self.state.lock();
        if tag.epoch < state.epoch {
            return Err(TransportError::Aborted {
                region: self.id,
                epoch: tag.epoch,
                current: state.epoch,
            });
        }
        if tag.epoch > state.epoch {
            return Err(TransportError::StaleEpoch {
                region: self.id,
                got: tag.epoch,
                current: state.epoch,
            });
        }
        if let Some(data) = state.held.remove(&tag.write_id) {
            return Ok(Some(data));
        }
        if state.delivered.contains(&tag.write_id) {
            // Delivered and already received: it will never be here again.
            return Err(TransportError::DuplicateWrite {
                region: self.id,
                epoch: state.epoch,
                write_id: tag.write_id,
            });
        }
        Ok(None)
    }

    async fn recv(&self, tag: WriteTag, deadline: Deadline) -> Result<Bytes, TransportError> {
        check_deadline(deadline, self.owner, self.id, Op::Recv)?;
        loop {
            let mut changed = pin!(self.changed.notified());
            // Register before looking, so a delivery in between still wakes this wait.
            changed.as_mut().enable();
            if let Some(data) = self.try_take(tag)? {
                return Ok(data);
            }
            let woken =
                tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), changed).await;
            if woken.is_err() {
                return Err(TransportError::DeadlineExceeded {
                    owner: self.owner,
                    region: self.id,
                    op: Op::Recv,
                });
            }
        }
    }

    fn advance(&self, epoch: u64) {
        let dropped = {
            let mut state = self.state.lock();
            if epoch <= state.epoch {
                return;
            }
            state.epoch = epoch;
            state.delivered.clear();
            std::mem::take(&mut state.held)
        };
        // Freed outside the lock.
        drop(dropped);
        self.changed.notify_waiters();
    }
}

/// The owner's guard of an inbox region; dropping it deregisters the region. A send racing with
/// the drop may be acknowledged and then dropped with the inbox.
#[derive(Debug)]
pub(super) struct InboxGuard {
    pub(super) registry: Arc<Registry>,
    pub(super) region: Arc<Inbox>,
}

#[async_trait::async_trait]
impl InboxRegion for InboxGuard {
    fn handle(&self) -> RegionHandle {
        self.region.handle()
    }

    fn epoch(&self) -> u64 {
        self.region.epoch()
    }

    fn capacity(&self) -> usize {
        self.region.capacity
    }

    fn advance(&self, epoch: u64) {
        self.region.advance(epoch);
    }

    async fn recv(&self, tag: WriteTag, deadline: Deadline) -> Result<Bytes, TransportError> {
        self.region.recv(tag, deadline).await
    }
}

impl Drop for InboxGuard {
    fn drop(&mut self) {
        self.registry.remove(self.region.id);
    }
}
