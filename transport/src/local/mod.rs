//! The `local` backend: every endpoint lives in one process and shares one [`LocalTransport`].
//!
//! Regions live in a concurrent map shared by the transport (the readers' and writers' side) and
//! the owners' guards; dropping a guard deregisters its region. Region ids come from a counter and
//! are never reused, so a handle to a dropped region stays unknown. A handle names a region by its
//! `owner` and `id`; bounds are checked against the registered length, and a read returns bytes in
//! the registered dtype. Every operation is synchronous inside its `async fn`: no lock is ever held
//! across an `.await`.
//!
//! Guarantees of this backend (the numbering of the crate's contract):
//! - **C1**: a published region is a `(version, Bytes)` pair behind a read-write lock. `publish`
//!   swaps in a whole new pair; `read` takes the read lock only to copy the version and a
//!   reference-counted slice of the bytes. A read therefore returns exactly one publication, the last
//!   one completed before it, with its version, and it copies no element (zero copy): the returned
//!   bytes stay valid after a later publication or after the region is dropped.
//! - **C2**: an accumulate adds into the fp32 values under the region's lock before its future
//!   resolves, so `Ok(())` means applied.
//! - **C3**: the epoch, the set of applied write ids and the values sit behind that same lock. An
//!   accumulate checks epoch and write id and adds in one critical section; `take` swaps the values
//!   for zeros, clears the write ids and moves the epoch in another. An accumulate is therefore
//!   entirely before a take (its values are in the taken vector) or entirely after it (refused as
//!   stale, or, with the new epoch, counted in the next one).
//! - **C4**: unknown ids (or a wrong owner), out-of-range or reversed element ranges, partial
//!   elements, publications of the wrong length and wrong region kinds are [`TransportError`]s.
//!   Every check runs before anything is modified, so a refused request leaves the region exactly as
//!   it was, including the set of applied write ids.
//! - **C5**: any split of a range into chunks (see [`crate::chunk_ranges`]) reads the same bytes as
//!   the whole range, provided no publication happens in between; chunks of one accumulate are
//!   independent writes with their own write ids.

mod accumulator;
mod published;

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use dashmap::DashMap;

use self::accumulator::{Accumulator, AccumulatorGuard};
use self::published::{Published, PublishedGuard};
use crate::{
    AccumulatorRegion, Dtype, EndpointId, PublishedRegion, ReadChunk, RegionHandle, RegionId,
    RegionKind, Transport, TransportError, WriteTag,
};

/// A registered region.
#[derive(Debug, Clone)]
enum Region {
    Published(Arc<Published>),
    Accumulator(Arc<Accumulator>),
}

impl Region {
    fn owner(&self) -> EndpointId {
        match self {
            Region::Published(region) => region.owner(),
            Region::Accumulator(region) => region.owner(),
        }
    }

    fn kind(&self) -> RegionKind {
        match self {
            Region::Published(_) => RegionKind::Published,
            Region::Accumulator(_) => RegionKind::Accumulator,
        }
    }
}

/// The regions of one transport, shared with the owners' guards.
#[derive(Debug, Default)]
struct Registry {
    regions: DashMap<RegionId, Region>,
    next_id: AtomicU64,
}

impl Registry {
    fn next_id(&self) -> RegionId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The region `handle` names. The map's shard lock is released before the caller touches the
    /// region.
    fn lookup(&self, handle: &RegionHandle) -> Result<Region, TransportError> {
        self.regions
            .get(&handle.id)
            .map(|entry| entry.value().clone())
            .filter(|region| region.owner() == handle.owner)
            .ok_or(TransportError::UnknownRegion {
                owner: handle.owner,
                region: handle.id,
            })
    }

    fn remove(&self, id: RegionId) {
        self.regions.remove(&id);
    }
}

/// The one-process, zero-copy backend. Cheap to create; share it as an `Arc<dyn Transport>`.
///
/// ```
/// use odc_transport::{codec, local::LocalTransport, Dtype, Transport};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let transport = LocalTransport::new();
/// let params = transport
///     .register_published(0, Dtype::Bf16, codec::encode(Dtype::Bf16, &[1.0, 2.0, 3.0]), 7)
///     .unwrap();
/// let chunk = transport.read(&params.handle(), 1..3).await.unwrap();
/// assert_eq!(chunk.version, 7);
/// assert_eq!(codec::decode(Dtype::Bf16, &chunk.bytes).unwrap(), vec![2.0, 3.0]);
/// # });
/// ```
#[derive(Debug, Default)]
pub struct LocalTransport {
    registry: Arc<Registry>,
}

impl LocalTransport {
    /// A transport with no regions.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait::async_trait]
impl Transport for LocalTransport {
    fn backend(&self) -> &'static str {
        "local"
    }

    fn register_published(
        &self,
        owner: EndpointId,
        dtype: Dtype,
        initial: Bytes,
        version: u64,
    ) -> Result<Box<dyn PublishedRegion>, TransportError> {
        let id = self.registry.next_id();
        let region = Arc::new(Published::new(owner, id, dtype, initial, version)?);
        self.registry
            .regions
            .insert(id, Region::Published(Arc::clone(&region)));
        Ok(Box::new(PublishedGuard {
            registry: Arc::clone(&self.registry),
            region,
        }))
    }

    fn register_accumulator(
        &self,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<Box<dyn AccumulatorRegion>, TransportError> {
        let id = self.registry.next_id();
        let region = Arc::new(Accumulator::new(owner, id, len, epoch));
        self.registry
            .regions
            .insert(id, Region::Accumulator(Arc::clone(&region)));
        Ok(Box::new(AccumulatorGuard {
            registry: Arc::clone(&self.registry),
            region,
        }))
    }

    async fn read(
        &self,
        handle: &RegionHandle,
        range: Range<usize>,
    ) -> Result<ReadChunk, TransportError> {
        match self.registry.lookup(handle)? {
            Region::Published(region) => region.read(range),
            other => Err(TransportError::WrongKind {
                region: handle.id,
                expected: RegionKind::Published,
                actual: other.kind(),
            }),
        }
    }

    async fn accumulate(
        &self,
        handle: &RegionHandle,
        offset: usize,
        data: Bytes,
        tag: WriteTag,
    ) -> Result<(), TransportError> {
        match self.registry.lookup(handle)? {
            Region::Accumulator(region) => region.accumulate(offset, &data, tag),
            other => Err(TransportError::WrongKind {
                region: handle.id,
                expected: RegionKind::Accumulator,
                actual: other.kind(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec;

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("tokio runtime")
            .block_on(future)
    }

    #[test]
    fn read_is_a_slice_of_the_published_buffer() {
        block_on(async {
            let transport = LocalTransport::new();
            let data = codec::encode(Dtype::Bf16, &[0.0, 1.0, 2.0, 3.0, 4.0]);
            let base = data.as_ptr();
            let region = transport
                .register_published(0, Dtype::Bf16, data, 1)
                .expect("register");
            let chunk = transport.read(&region.handle(), 2..4).await.expect("read");
            assert_eq!(
                chunk.bytes.as_ptr(),
                base.wrapping_add(2 * Dtype::Bf16.size())
            );
            assert_eq!(codec::decode(Dtype::Bf16, &chunk.bytes), Ok(vec![2.0, 3.0]));
        });
    }

    #[test]
    fn read_outlives_publication_and_region() {
        block_on(async {
            let transport = LocalTransport::new();
            let region = transport
                .register_published(0, Dtype::F32, codec::encode_f32(&[1.0; 4]), 1)
                .expect("register");
            let handle = region.handle();
            let chunk = transport.read(&handle, 0..4).await.expect("read");
            region
                .publish(2, codec::encode_f32(&[2.0; 4]))
                .expect("publish");
            drop(region);
            assert_eq!(codec::decode_f32(&chunk.bytes), Ok(vec![1.0; 4]));
            assert_eq!(chunk.version, 1);
            assert_eq!(
                transport.read(&handle, 0..4).await,
                Err(TransportError::UnknownRegion {
                    owner: 0,
                    region: handle.id
                })
            );
        });
    }

    #[test]
    fn handle_with_another_owner_is_unknown() {
        block_on(async {
            let transport = LocalTransport::new();
            let region = transport
                .register_published(3, Dtype::F32, codec::encode_f32(&[1.0]), 1)
                .expect("register");
            let mut handle = region.handle();
            handle.owner = 4;
            assert_eq!(
                transport.read(&handle, 0..1).await,
                Err(TransportError::UnknownRegion {
                    owner: 4,
                    region: handle.id
                })
            );
        });
    }

    #[test]
    fn accumulate_past_usize_max_is_out_of_range() {
        block_on(async {
            let transport = LocalTransport::new();
            let acc = transport.register_accumulator(0, 4, 0).expect("register");
            let tag = WriteTag {
                epoch: 0,
                write_id: 1,
            };
            let result = transport
                .accumulate(&acc.handle(), usize::MAX, codec::encode_f32(&[1.0]), tag)
                .await;
            assert_eq!(
                result,
                Err(TransportError::OutOfRange {
                    region: acc.handle().id,
                    start: usize::MAX,
                    end: usize::MAX,
                    len: 4
                })
            );
            assert_eq!(acc.take(1), vec![0.0; 4]);
        });
    }

    #[test]
    fn region_ids_are_not_reused() {
        let transport = LocalTransport::new();
        let first = transport.register_accumulator(0, 1, 0).expect("register");
        let first_id = first.handle().id;
        drop(first);
        let second = transport.register_accumulator(0, 1, 0).expect("register");
        assert_ne!(second.handle().id, first_id);
    }
}
