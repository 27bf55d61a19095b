//! The owner's guards of a fabric's regions. [`Guard::register`] gives a new region the fabric's
//! next id and its descriptor, inserts it into the fabric's table and returns its guard; the guard is
//! the owner's side of the region ([`PublishedRegion`], [`AccumulatorRegion`], [`InboxRegion`])
//! and keeps the fabric alive. Dropping the guard deregisters the region: later handles to it name
//! an unknown region. A send racing with an inbox guard's drop may be acknowledged and then
//! dropped with the inbox.

use std::sync::Arc;

use bytes::Bytes;

use super::accumulator::{Accumulator, Sums};
use super::identity::Identity;
use super::inbox::Inbox;
use super::published::Published;
use super::registry::{Region, Registry};
use crate::{
    AccumulatorRegion, Deadline, EndpointId, InboxRegion, PublishedRegion, RegionHandle, RegionId,
    TransportError, WriteGuard, WriteTag,
};

/// The owner's guard of a region `R` of a fabric; dropping it deregisters the region.
#[derive(Debug)]
pub(crate) struct Guard<R> {
    registry: Arc<Registry>,
    id: RegionId,
    pub(super) region: Arc<R>,
}

/// The owner's guard of an accumulator region.
pub(crate) type AccumulatorGuard = Guard<Accumulator>;

impl<R> Guard<R> {
    /// Register the region of `owner` that `make` makes with `registry`'s next id and its
    /// descriptor, as `region` wraps it in the fabric's table.
    pub(super) fn register(
        registry: &Arc<Registry>,
        owner: EndpointId,
        make: impl FnOnce(Identity) -> Result<R, TransportError>,
        region: fn(Arc<R>) -> Region,
    ) -> Result<Self, TransportError> {
        let id = registry.next_id();
        let descriptor = registry.descriptor();
        let made = Arc::new(make(Identity {
            owner,
            id,
            descriptor,
        })?);
        registry.insert(id, region(Arc::clone(&made)));
        Ok(Self {
            registry: Arc::clone(registry),
            id,
            region: made,
        })
    }
}

impl<R> Drop for Guard<R> {
    fn drop(&mut self) {
        self.registry.remove(self.id);
    }
}

impl PublishedRegion for Guard<Published> {
    fn handle(&self) -> RegionHandle {
        self.region.handle()
    }

    fn publish(&self, version: u64, data: Bytes) -> Result<(), TransportError> {
        self.region.publish(version, data)
    }

    fn republish(&self, version: u64) -> Result<(), TransportError> {
        self.region.republish(version);
        Ok(())
    }

    fn version(&self) -> u64 {
        self.region.version()
    }
}

impl Guard<Accumulator> {
    /// [`AccumulatorRegion::take`] with the caller removing the values: `take` gets the
    /// region's [`Sums`] under the accumulate lock, after the move to `next_epoch`, and must leave
    /// them zeroed (the `cuda` backend's take into a device buffer).
    #[cfg_attr(not(feature = "cuda-code"), allow(dead_code))]
    pub(crate) fn take_with<T>(&self, next_epoch: u64, take: impl FnOnce(&mut dyn Sums) -> T) -> T {
        self.region.take_with(next_epoch, take)
    }
}

impl AccumulatorRegion for Guard<Accumulator> {
    fn handle(&self) -> RegionHandle {
        self.region.handle()
    }

    fn take(&self, next_epoch: u64) -> Vec<f32> {
        self.region.take(next_epoch)
    }

    fn take_applied(&self, next_epoch: u64) -> Result<crate::Applied, TransportError> {
        Ok(self.region.take_applied(next_epoch))
    }

    fn progress(&self) -> Option<tokio::sync::watch::Receiver<crate::Progress>> {
        Some(self.region.progress())
    }

    fn epoch(&self) -> u64 {
        self.region.epoch()
    }

    fn admit_only(&self, guard: WriteGuard) -> Result<(), TransportError> {
        self.region.admit_only(guard);
        Ok(())
    }
}

#[async_trait::async_trait]
impl InboxRegion for Guard<Inbox> {
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
