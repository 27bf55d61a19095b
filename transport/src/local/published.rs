//! A published region of the local backend: the owner swaps in whole publications, readers decode
//! straight from the current one into their destination.

use std::ops::Range;

use bytes::Bytes;
use parking_lot::RwLock;

use super::identity::Identity;
use crate::codec;
use crate::error::wide;
use crate::{Dest, DestSpec, Dtype, EndpointId, RegionHandle, RegionKind, TransportError};

/// One publication: the bytes of every element and the version they carry.
#[derive(Debug)]
struct Publication {
    version: u64,
    bytes: Bytes,
}

/// State of a published region, shared by the registry (readers) and the owner's guard.
#[derive(Debug)]
pub(super) struct Published {
    name: Identity,
    dtype: Dtype,
    len: usize,
    /// Swapped whole under the write lock; readers clone the `Bytes` (a reference count) under the
    /// read lock, so a read sees exactly one publication (C1).
    current: RwLock<Publication>,
}

impl Published {
    /// A region holding `initial`, which must be whole `dtype` elements.
    pub(super) fn new(
        name: Identity,
        dtype: Dtype,
        initial: Bytes,
        version: u64,
    ) -> Result<Self, TransportError> {
        let len = codec::element_count(dtype, initial.len()).map_err(|e| e.for_region(name.id))?;
        Ok(Self {
            name,
            dtype,
            len,
            current: RwLock::new(Publication {
                version,
                bytes: initial,
            }),
        })
    }

    pub(super) fn owner(&self) -> EndpointId {
        self.name.owner
    }

    pub(super) fn handle(&self) -> RegionHandle {
        self.name.handle(
            RegionKind::Published,
            self.dtype,
            wide(self.len),
            self.version(),
        )
    }

    /// Write the elements `range` of the current publication into `into`, decoding straight from
    /// the published buffer (one pass, no intermediate copy); return its version. Every refusal
    /// happens before anything is written.
    pub(super) fn read_into(
        &self,
        range: Range<usize>,
        into: Dest<'_>,
    ) -> Result<u64, TransportError> {
        self.check_range(&range)?;
        // Cannot overflow: end <= len and len * size is the length of an existing buffer.
        let size = self.dtype.size();
        let bytes = range.start * size..range.end * size;
        // Take the publication (a reference count) and release the lock before decoding, so a
        // large read never holds up the owner's next publication. The bytes are immutable: the
        // read sees exactly this publication (C1).
        let (version, publication) = {
            let current = self.current.read();
            (current.version, current.bytes.clone())
        };
        let src = publication.get(bytes).ok_or(TransportError::OutOfRange {
            region: self.name.id,
            start: wide(range.start),
            end: wide(range.end),
            len: wide(self.len),
        })?;
        into.fill_from_host(self.name.id, self.dtype, src)?;
        Ok(version)
    }

    fn check_range(&self, range: &Range<usize>) -> Result<(), TransportError> {
        if range.start > range.end || range.end > self.len {
            return Err(TransportError::OutOfRange {
                region: self.name.id,
                start: wide(range.start),
                end: wide(range.end),
                len: wide(self.len),
            });
        }
        Ok(())
    }

    pub(super) fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// For a peer in another process: check the whole read (`range` into a destination shaped
    /// `dest`) in the contract's order, then return the elements `part` of it from the current
    /// publication, with its version, as a slice of the published buffer (no copy).
    pub(super) fn serve(
        &self,
        range: Range<usize>,
        part: Range<usize>,
        dest: DestSpec,
    ) -> Result<(u64, Bytes), TransportError> {
        self.check_range(&range)?;
        dest.check_host(self.name.id, self.dtype, range.len())?;
        if part.start > part.end || part.start < range.start || part.end > range.end {
            return Err(TransportError::OutOfRange {
                region: self.name.id,
                start: wide(part.start),
                end: wide(part.end),
                len: wide(self.len),
            });
        }
        let size = self.dtype.size();
        let current = self.current.read();
        Ok((
            current.version,
            current.bytes.slice(part.start * size..part.end * size),
        ))
    }

    pub(super) fn publish(&self, version: u64, data: Bytes) -> Result<(), TransportError> {
        codec::check_exact(self.dtype, &data, self.len).map_err(|e| e.for_region(self.name.id))?;
        let previous = std::mem::replace(
            &mut *self.current.write(),
            Publication {
                version,
                bytes: data,
            },
        );
        // Freed (if no reader still holds it) after the lock is released.
        drop(previous);
        Ok(())
    }

    pub(super) fn republish(&self, version: u64) {
        self.current.write().version = version;
    }

    pub(super) fn version(&self) -> u64 {
        self.current.read().version
    }
}
