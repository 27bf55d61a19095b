//! A published region of the local backend: the owner swaps in whole publications, readers take
//! reference-counted slices of the current one.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::RwLock;

use super::Registry;
use crate::codec;
use crate::{
    Dtype, EndpointId, PublishedRegion, ReadChunk, RegionHandle, RegionId, RegionKind,
    TransportError,
};

/// One publication: the bytes of every element and the version they carry.
#[derive(Debug)]
struct Publication {
    version: u64,
    bytes: Bytes,
}

/// State of a published region, shared by the registry (readers) and the owner's guard.
#[derive(Debug)]
pub(super) struct Published {
    owner: EndpointId,
    id: RegionId,
    dtype: Dtype,
    len: usize,
    /// Swapped whole under the write lock; readers clone the `Bytes` (a reference count) under the
    /// read lock, so a read sees exactly one publication (C1).
    current: RwLock<Publication>,
}

impl Published {
    /// A region holding `initial`, which must be whole `dtype` elements.
    pub(super) fn new(
        owner: EndpointId,
        id: RegionId,
        dtype: Dtype,
        initial: Bytes,
        version: u64,
    ) -> Result<Self, TransportError> {
        let len = codec::element_count(dtype, initial.len()).map_err(|e| e.for_region(id))?;
        Ok(Self {
            owner,
            id,
            dtype,
            len,
            current: RwLock::new(Publication {
                version,
                bytes: initial,
            }),
        })
    }

    pub(super) fn owner(&self) -> EndpointId {
        self.owner
    }

    pub(super) fn handle(&self) -> RegionHandle {
        RegionHandle {
            owner: self.owner,
            id: self.id,
            kind: RegionKind::Published,
            dtype: self.dtype,
            len: self.len,
        }
    }

    /// The elements `range` of the current publication, without copying.
    pub(super) fn read(&self, range: Range<usize>) -> Result<ReadChunk, TransportError> {
        if range.start > range.end || range.end > self.len {
            return Err(TransportError::OutOfRange {
                region: self.id,
                start: range.start,
                end: range.end,
                len: self.len,
            });
        }
        // Cannot overflow: end <= len and len * size is the length of an existing buffer.
        let size = self.dtype.size();
        let bytes = range.start * size..range.end * size;
        let current = self.current.read();
        Ok(ReadChunk {
            version: current.version,
            bytes: current.bytes.slice(bytes),
        })
    }

    fn publish(&self, version: u64, data: Bytes) -> Result<(), TransportError> {
        let elements =
            codec::element_count(self.dtype, data.len()).map_err(|e| e.for_region(self.id))?;
        if elements != self.len {
            return Err(TransportError::LengthMismatch {
                region: self.id,
                elements,
                len: self.len,
            });
        }
        let previous = std::mem::replace(
            &mut *self.current.write(),
            Publication {
                version,
                bytes: data,
            },
        );
        // Freed (if no reader still holds a slice of it) after the lock is released.
        drop(previous);
        Ok(())
    }

    fn version(&self) -> u64 {
        self.current.read().version
    }
}

/// The owner's guard of a published region; dropping it deregisters the region.
#[derive(Debug)]
pub(super) struct PublishedGuard {
    pub(super) registry: Arc<Registry>,
    pub(super) region: Arc<Published>,
}

impl PublishedRegion for PublishedGuard {
    fn handle(&self) -> RegionHandle {
        self.region.handle()
    }

    fn publish(&self, version: u64, data: Bytes) -> Result<(), TransportError> {
        self.region.publish(version, data)
    }

    fn version(&self) -> u64 {
        self.region.version()
    }
}

impl Drop for PublishedGuard {
    fn drop(&mut self) {
        self.registry.remove(self.region.id);
    }
}
