//! The `local` backend: every endpoint lives in one process; regions are plain memory.
//!
//! Every [`LocalTransport::new`] is its own **fabric**: a registry of regions with a fabric id
//! unique in the process, recorded (weakly) in a process-global table and removed from it when the
//! registry is dropped (once the transport and every guard of its regions are gone). A handle
//! carries [`Descriptor::Local`]` { process, fabric }`, so any `LocalTransport` of the process can
//! use a handle alone: its own fabric directly, another one through the global table. A handle of
//! another OS process is [`TransportError::ForeignHandle`]; an unknown fabric, an unknown region id
//! or a different owner is [`TransportError::UnknownRegion`]. Region ids come from a per-fabric
//! counter and fabric ids from a process-wide one; neither is reused, so a handle to a dropped
//! region stays unknown and never aliases a newer one.
//!
//! Every operation is synchronous inside its `async fn` (only an inbox `recv` waits, and it holds
//! no lock while it does). Deadlines are checked when an operation starts.
//!
//! How this backend meets each clause of the crate's contract:
//! - **C1**: a published region is a `(version, Bytes)` pair behind a read-write lock. `publish`
//!   swaps in a whole new pair; `read` takes the read lock only to copy the version and a
//!   reference count of the bytes, then decodes straight from those (immutable) bytes into the
//!   caller's destination in one pass. A read therefore returns exactly one publication, the last
//!   one completed before it, with its version; nothing is copied twice.
//! - **C2**: an accumulate adds into the fp32 values under the region's lock before its future
//!   resolves, so `Ok(())` means applied.
//! - **C3**: the epoch, the set of applied write ids and the values sit behind that same lock. An
//!   accumulate checks epoch and write id and adds in one critical section; `take` swaps the values
//!   for zeros, clears the write ids and moves the epoch in another. An accumulate is therefore
//!   entirely before a take (its values are in the taken vector) or entirely after it (refused as
//!   stale, or, with the new epoch, counted in the next one).
//! - **C4**: unknown ids, out-of-range or reversed element ranges, partial elements, publications
//!   of the wrong length, wrong region kinds and destinations of the wrong size are
//!   [`TransportError`]s; device destinations are [`TransportError::Unsupported`] (host memory
//!   only). Every check runs before anything is modified, so a refused request leaves the region
//!   (and a destination) exactly as it was, including the set of applied write ids.
//! - **C5**: any split of a range into chunks (see [`crate::chunk_ranges`]) reads the same bytes as
//!   the whole range, provided no publication happens in between; chunks of one accumulate are
//!   independent writes with their own write ids.
//! - **C6**: every operation checks its deadline first; the batches are the trait's defaults (each
//!   op runs to completion synchronously, so a batch is as fast as the ops in sequence).
//! - **C7**: an inbox holds messages by write id behind one lock with its epoch and its delivered
//!   ids; a message is the sender's `Bytes`, handed to the receiver without a copy. A `recv`
//!   registers with a `tokio::sync::Notify` before it looks for its message and waits with tokio's
//!   timer until its deadline. Capacity: [`LocalTransport::with_inbox_capacity`].

pub(crate) mod accumulator;
mod guard;
mod identity;
mod ids;
mod inbox;
mod published;
mod registry;

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;

use self::accumulator::{Accumulator, Sums};
pub(crate) use self::guard::AccumulatorGuard;
use self::guard::Guard;
use self::inbox::Inbox;
use self::published::Published;
use self::registry::{Region, Registry};
use crate::deadline::check_deadline;
use crate::{
    AccumulatorRegion, Deadline, Descriptor, Dest, DestSpec, Dtype, EndpointId, InboxRegion, Op,
    PublishedRegion, RegionHandle, RegionId, RegionKind, Transport, TransportError, WriteTag,
};

/// The one-process backend. Cheap to create; share it as an `Arc<dyn Transport>`. Any
/// `LocalTransport` of the process can use a handle issued by any other.
///
/// ```
/// use odc_transport::{codec, deadline_in, local::LocalTransport, Dest, Dtype, Transport};
/// use std::time::Duration;
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let owner = LocalTransport::new();
/// let params = owner
///     .register_published(0, Dtype::Bf16, codec::encode(Dtype::Bf16, &[1.0, 2.0, 3.0]), 7)
///     .unwrap();
/// // A handle is plain data: serialize it, send it, use it from another transport.
/// let handle = params.handle();
/// let reader = LocalTransport::new();
/// let mut values = [0.0f32; 2];
/// let deadline = deadline_in(Duration::from_secs(1));
/// let version = reader.read(&handle, 1..3, Dest::F32(&mut values), deadline).await.unwrap();
/// assert_eq!((version, values), (7, [2.0, 3.0]));
/// # });
/// ```
#[derive(Debug)]
pub struct LocalTransport {
    registry: Arc<Registry>,
    inbox_capacity: usize,
}

impl Default for LocalTransport {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalTransport {
    /// How many messages an inbox holds at most unless configured otherwise.
    pub const DEFAULT_INBOX_CAPACITY: usize = 65_536;

    /// A new fabric with no regions; inboxes hold [`Self::DEFAULT_INBOX_CAPACITY`] messages.
    pub fn new() -> Self {
        Self::with_inbox_capacity(Self::DEFAULT_INBOX_CAPACITY)
    }

    /// A new fabric whose inboxes hold at most `capacity` messages each (0 refuses every
    /// message).
    pub fn with_inbox_capacity(capacity: usize) -> Self {
        Self {
            registry: Registry::new(),
            inbox_capacity: capacity,
        }
    }

    /// The region `handle` names, in this fabric or, through the process-global table, another.
    fn resolve(&self, handle: &RegionHandle) -> Result<Region, TransportError> {
        match handle.descriptor {
            Descriptor::Local { process, fabric } => {
                if process != self.registry.process() {
                    return Err(TransportError::ForeignHandle {
                        owner: handle.owner,
                        region: handle.id,
                        reason: format!(
                            "it was issued by the local backend of process {process}, this is \
                             process {}; local handles do not cross processes",
                            self.registry.process()
                        ),
                    });
                }
                if fabric == self.registry.fabric() {
                    return self.registry.lookup(handle);
                }
                Registry::find(fabric)
                    .ok_or(TransportError::UnknownRegion {
                        owner: handle.owner,
                        region: handle.id,
                    })?
                    .lookup(handle)
            }
            Descriptor::Tcp { .. }
            | Descriptor::Shm { .. }
            | Descriptor::Rdma { .. }
            | Descriptor::Cuda { .. } => Err(TransportError::ForeignHandle {
                owner: handle.owner,
                region: handle.id,
                reason: format!(
                    "it is a {} handle; the local backend reaches only local regions",
                    handle.descriptor.backend()
                ),
            }),
        }
    }
}

fn wrong_kind(region: RegionId, expected: RegionKind, actual: &Region) -> TransportError {
    TransportError::WrongKind {
        region,
        expected,
        actual: actual.kind(),
    }
}

/// An element index from a peer's request, as a `usize` (saturating: an index past `usize::MAX` is
/// out of range of every region anyway).
fn index(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// The owner's side of the process-crossing backends: requests that arrived over a connection
/// address a region of this fabric by owner and id, and are checked in the contract's order (the
/// deadline and the handle's descriptor were the caller's checks).
impl LocalTransport {
    /// `handle` re-addressed to this fabric (for a backend that keeps its regions here and
    /// serves its own handles without a socket).
    pub(crate) fn local_handle(&self, handle: &RegionHandle) -> RegionHandle {
        RegionHandle {
            descriptor: self.registry.descriptor(),
            ..handle.clone()
        }
    }

    /// A region id of this fabric's sequence, for a region kept elsewhere (an `shm` segment), so
    /// ids stay distinct across all of a transport's regions.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn next_region_id(&self) -> RegionId {
        self.registry.next_id()
    }

    /// Register an accumulator of `len` elements at `epoch` whose values live in `values` (zeroed,
    /// `len` long): the checks, fencing and deduplication are this fabric's, the memory and the
    /// addition are the caller's (the `cuda` backend's device memory).
    pub(crate) fn register_accumulator_in(
        &self,
        owner: EndpointId,
        len: usize,
        epoch: u64,
        values: Box<dyn Sums>,
    ) -> Result<AccumulatorGuard, TransportError> {
        Guard::register(
            &self.registry,
            owner,
            |name| Ok(Accumulator::new(name, len, epoch, values)),
            Region::Accumulator,
        )
    }

    /// A peer's read: the elements `part` of the read of `range` into a destination shaped `dest`,
    /// as a slice of the publication (no copy), with its version and dtype.
    pub(crate) fn serve_read(
        &self,
        owner: EndpointId,
        id: RegionId,
        range: (u64, u64),
        part: (u64, u64),
        dest: DestSpec,
    ) -> Result<(u64, Dtype, Bytes), TransportError> {
        match self.registry.get(owner, id)? {
            Region::Published(region) => {
                let (version, bytes) = region.serve(
                    index(range.0)..index(range.1),
                    index(part.0)..index(part.1),
                    dest,
                )?;
                Ok((version, region.dtype(), bytes))
            }
            other => Err(wrong_kind(id, RegionKind::Published, &other)),
        }
    }

    /// A peer's accumulate.
    pub(crate) fn serve_accumulate(
        &self,
        owner: EndpointId,
        id: RegionId,
        offset: u64,
        data: &[u8],
        tag: WriteTag,
    ) -> Result<(), TransportError> {
        match self.registry.get(owner, id)? {
            Region::Accumulator(region) => region.accumulate(index(offset), data, tag),
            other => Err(wrong_kind(id, RegionKind::Accumulator, &other)),
        }
    }

    /// An accumulate from device memory of this process (see [`accumulator::Sums::add_device`]).
    pub(crate) fn serve_accumulate_device(
        &self,
        owner: EndpointId,
        id: RegionId,
        offset: usize,
        src: u64,
        elements: usize,
        tag: WriteTag,
    ) -> Result<(), TransportError> {
        match self.registry.get(owner, id)? {
            Region::Accumulator(region) => region.accumulate_device(offset, src, elements, tag),
            other => Err(wrong_kind(id, RegionKind::Accumulator, &other)),
        }
    }

    /// A peer's inbox send.
    pub(crate) fn serve_send(
        &self,
        owner: EndpointId,
        id: RegionId,
        tag: WriteTag,
        data: Bytes,
    ) -> Result<(), TransportError> {
        match self.registry.get(owner, id)? {
            Region::Inbox(region) => region.deliver(tag, data),
            other => Err(wrong_kind(id, RegionKind::Inbox, &other)),
        }
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
        let guard = Guard::register(
            &self.registry,
            owner,
            |name| Published::new(name, dtype, initial, version),
            Region::Published,
        )?;
        Ok(Box::new(guard))
    }

    fn register_accumulator(
        &self,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<Box<dyn AccumulatorRegion>, TransportError> {
        self.register_accumulator_in(owner, len, epoch, Box::new(vec![0.0f32; len]))
            .map(|guard| Box::new(guard) as Box<dyn AccumulatorRegion>)
    }

    fn register_inbox(
        &self,
        owner: EndpointId,
        epoch: u64,
    ) -> Result<Box<dyn InboxRegion>, TransportError> {
        let capacity = self.inbox_capacity;
        let guard = Guard::register(
            &self.registry,
            owner,
            |name| Ok(Inbox::new(name, capacity, epoch)),
            Region::Inbox,
        )?;
        Ok(Box::new(guard))
    }

    async fn read(
        &self,
        handle: &RegionHandle,
        range: Range<usize>,
        into: Dest<'_>,
        deadline: Deadline,
    ) -> Result<u64, TransportError> {
        check_deadline(deadline, handle.owner, handle.id, Op::Read)?;
        match self.resolve(handle)? {
            Region::Published(region) => region.read_into(range, into),
            other => Err(wrong_kind(handle.id, RegionKind::Published, &other)),
        }
    }

    async fn accumulate(
        &self,
        handle: &RegionHandle,
        offset: usize,
        data: Bytes,
        tag: WriteTag,
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        check_deadline(deadline, handle.owner, handle.id, Op::Accumulate)?;
        match self.resolve(handle)? {
            Region::Accumulator(region) => region.accumulate(offset, &data, tag),
            other => Err(wrong_kind(handle.id, RegionKind::Accumulator, &other)),
        }
    }

    async fn send(
        &self,
        inbox: &RegionHandle,
        tag: WriteTag,
        data: Bytes,
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        check_deadline(deadline, inbox.owner, inbox.id, Op::Send)?;
        match self.resolve(inbox)? {
            Region::Inbox(region) => region.deliver(tag, data),
            other => Err(wrong_kind(inbox.id, RegionKind::Inbox, &other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::testing::block_on;
    use crate::{codec, deadline_in};

    fn soon() -> Deadline {
        deadline_in(Duration::from_secs(10))
    }

    #[test]
    fn read_is_served_from_the_own_fabric_and_from_another() {
        block_on(async {
            let owner = LocalTransport::new();
            let other = LocalTransport::new();
            let region = owner
                .register_published(0, Dtype::F32, codec::encode_f32(&[1.0, 2.0, 3.0]), 4)
                .expect("register");
            let handle = region.handle();
            for transport in [&owner, &other] {
                let mut out = [0.0f32; 2];
                let version = transport
                    .read(&handle, 1..3, Dest::F32(&mut out), soon())
                    .await
                    .expect("read");
                assert_eq!((version, out), (4, [2.0, 3.0]));
            }
        });
    }

    #[test]
    fn dropped_fabric_is_unknown_even_to_its_peers() {
        block_on(async {
            let reader = LocalTransport::new();
            let owner = LocalTransport::new();
            let region = owner
                .register_published(0, Dtype::F32, codec::encode_f32(&[1.0]), 1)
                .expect("register");
            let handle = region.handle();
            let Descriptor::Local { fabric, .. } = handle.descriptor else {
                panic!("a local handle");
            };
            // The guard keeps the fabric alive after its transport is gone.
            drop(owner);
            let mut out = [0.0f32; 1];
            let read = reader
                .read(&handle, 0..1, Dest::F32(&mut out), soon())
                .await;
            assert_eq!(read, Ok(1));
            drop(region);
            assert!(Registry::find(fabric).is_none(), "fabric left the table");
            let read = reader
                .read(&handle, 0..1, Dest::F32(&mut out), soon())
                .await;
            assert_eq!(
                read,
                Err(TransportError::UnknownRegion {
                    owner: 0,
                    region: handle.id
                })
            );
        });
    }

    #[test]
    fn fabric_ids_are_not_reused() {
        let first = LocalTransport::new().registry.fabric();
        let second = LocalTransport::new().registry.fabric();
        assert_ne!(first, second);
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
            let mut out = [0u8; 4];
            assert_eq!(
                transport
                    .read(&handle, 0..1, Dest::Bytes(&mut out), soon())
                    .await,
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
                token: 0,
            };
            let result = transport
                .accumulate(
                    &acc.handle(),
                    usize::MAX,
                    codec::encode_f32(&[1.0]),
                    tag,
                    soon(),
                )
                .await;
            assert_eq!(
                result,
                Err(TransportError::OutOfRange {
                    region: acc.handle().id,
                    start: u64::MAX,
                    end: u64::MAX,
                    len: 4
                })
            );
            assert_eq!(acc.take(1), vec![0.0; 4]);
        });
    }

    #[test]
    fn received_message_is_the_sent_buffer() {
        block_on(async {
            let owner = LocalTransport::new();
            let sender = LocalTransport::new();
            let inbox = owner.register_inbox(2, 0).expect("register");
            let data = Bytes::from(vec![7u8; 64]);
            let base = data.as_ptr();
            let tag = WriteTag {
                epoch: 0,
                write_id: 9,
                token: 0,
            };
            sender
                .send(&inbox.handle(), tag, data, soon())
                .await
                .expect("send");
            let got = inbox.recv(tag, soon()).await.expect("recv");
            assert_eq!(got.as_ptr(), base, "zero copy");
        });
    }

    #[test]
    fn inbox_capacity_is_configurable() {
        block_on(async {
            let owner = LocalTransport::with_inbox_capacity(1);
            let inbox = owner.register_inbox(0, 0).expect("register");
            assert_eq!(inbox.capacity(), 1);
            let tag = |write_id| WriteTag {
                epoch: 0,
                write_id,
                token: 0,
            };
            let handle = inbox.handle();
            assert_eq!(
                owner.send(&handle, tag(1), Bytes::new(), soon()).await,
                Ok(())
            );
            assert_eq!(
                owner.send(&handle, tag(2), Bytes::new(), soon()).await,
                Err(TransportError::InboxFull {
                    region: handle.id,
                    held: 1,
                    capacity: 1
                })
            );
            assert_eq!(
                LocalTransport::new()
                    .register_inbox(0, 0)
                    .expect("register")
                    .capacity(),
                LocalTransport::DEFAULT_INBOX_CAPACITY
            );
        });
    }
}
