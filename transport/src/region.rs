//! The owner's side of a region: [`PublishedRegion`], [`AccumulatorRegion`] and [`InboxRegion`],
//! which a backend's `register_*` hands out; their handles are [`crate::RegionHandle`]s.

use bytes::Bytes;

use crate::deadline::Deadline;
use crate::error::TransportError;
use crate::handle::{RegionHandle, WriteGuard, WriteTag};

/// Owner side of a published region. Dropping it deregisters the region.
pub trait PublishedRegion: Send + Sync {
    fn handle(&self) -> RegionHandle;
    /// Replace the whole region's contents (encoded in the region's dtype) and its version, atomically
    /// for readers (C1).
    fn publish(&self, version: u64, data: Bytes) -> Result<(), TransportError>;
    /// Publish the current contents again as `version`, without copying them: readers see the
    /// same bytes with the new version, atomically (C1). What a frozen unit's shard does at every
    /// step, so that it needs no copy of its bytes to publish them again.
    fn republish(&self, version: u64) -> Result<(), TransportError>;
    /// The version last published.
    fn version(&self) -> u64;
}

/// What [`AccumulatorRegion::take_applied`] returns: the sums and the write ids they combined.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Applied {
    /// The accumulated values (the region is zeroed).
    pub values: Vec<f32>,
    /// Every write id applied in the epoch the take ended, ascending.
    pub write_ids: Vec<u128>,
}

/// An accumulator's epoch and the writes it applied in it ([`AccumulatorRegion::progress`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Progress {
    pub epoch: u64,
    pub applied: usize,
}

/// Owner side of an accumulator region. Dropping it deregisters the region.
pub trait AccumulatorRegion: Send + Sync {
    fn handle(&self) -> RegionHandle;
    /// Atomically return the accumulated values, zero the accumulator, forget applied write ids and
    /// move to `next_epoch` (C3).
    fn take(&self, next_epoch: u64) -> Vec<f32>;
    /// [`take`](Self::take), also returning the write ids applied in the epoch it ends,
    /// ascending: what the sum combined (a relay's flush names its micro-batches by them). A
    /// backend whose owner cannot say answers [`TransportError::Unsupported`] and takes nothing.
    fn take_applied(&self, next_epoch: u64) -> Result<Applied, TransportError>;
    /// The accumulator's progress as it happens: its epoch and how many writes it applied in it,
    /// sent after every applied write and every take. `None`: a backend whose owner cannot say
    /// (a relay then flushes only when told to).
    fn progress(&self) -> Option<tokio::sync::watch::Receiver<Progress>> {
        None
    }
    /// The current epoch.
    fn epoch(&self) -> u64;
    /// From now on apply only writes whose tag `guard` admits (C8); any other accumulate is
    /// refused with [`TransportError::RefusedWrite`] and changes nothing (its write id stays
    /// free). Replaces an earlier guard. A backend whose owner lives where a closure cannot go
    /// answers [`TransportError::Unsupported`].
    fn admit_only(&self, guard: WriteGuard) -> Result<(), TransportError>;
}

/// Owner side of an inbox region: peers [`send`](crate::Transport::send) tagged messages, the owner
/// receives each by its tag (C7). Dropping it deregisters the region.
#[async_trait::async_trait]
pub trait InboxRegion: Send + Sync {
    /// Kind [`RegionKind::Inbox`], length 0, version = the current epoch.
    fn handle(&self) -> RegionHandle;
    /// The current epoch.
    fn epoch(&self) -> u64;
    /// How many messages the inbox holds at most; a send beyond it is
    /// [`TransportError::InboxFull`].
    fn capacity(&self) -> usize;
    /// Move to `epoch` (never backwards: an older or equal epoch changes nothing): drop every held
    /// message of an older epoch, forget its delivered write ids and wake every `recv` of an older
    /// epoch with [`TransportError::Aborted`].
    fn advance(&self, epoch: u64);
    /// Wait for the message sent with exactly `tag`, remove it and return its bytes. A `tag` of an
    /// older epoch is [`TransportError::Aborted`], of a newer one [`TransportError::StaleEpoch`],
    /// and a message already received is [`TransportError::DuplicateWrite`], all at once; no
    /// message by `deadline` is [`TransportError::DeadlineExceeded`].
    async fn recv(&self, tag: WriteTag, deadline: Deadline) -> Result<Bytes, TransportError>;
}
