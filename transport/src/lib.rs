//! # odc-transport — the data plane
//!
//! Moves tensor bytes between trainers and shard servers. Nothing here knows about models: an
//! owner registers **regions** (a published parameter copy, a gradient accumulator, an inbox) and
//! hands out [`RegionHandle`]s; peers [`Transport::read`] published regions one-sidedly into memory
//! they own, [`Transport::accumulate`] fp32 gradients into accumulators and [`Transport::send`]
//! tagged messages into inboxes.
//!
//! ## Handles
//! - A [`RegionHandle`] is plain serializable data (serde; no `usize`): owner, region id, kind,
//!   dtype, length in elements, the version (published) or epoch (accumulator, inbox) current when
//!   it was taken, and a backend [`Descriptor`]. A handle that went through serialization is all a
//!   peer needs: owner and reader may be different transport instances (different processes for
//!   process-crossing backends).
//! - A handle a backend cannot use (another process's local region; later: another backend's
//!   descriptor) is [`TransportError::ForeignHandle`], naming the region and why. A handle to a
//!   region that was dropped, or never existed, is [`TransportError::UnknownRegion`]. Region ids
//!   are never reused, so a stale handle never reaches a newer region. Checked by
//!   `conformance/handles.rs`.
//!
//! ## Contract (every backend; checked by the suite in `conformance/`, feature `conformance`)
//! - **C1 one-sided read**: `read(handle, range, into, deadline)` writes the elements `range` of the
//!   region as last published into the caller's destination [`Dest`] (raw little-endian bytes, or
//!   decoded `f32`, bf16 widened exactly) and returns the version they were published with. The
//!   owner's actor is not involved; a read observes one whole publication, never a mix of two.
//!   A republication (`PublishedRegion::republish`) is a publication of the same contents under a
//!   new version, without a copy of them. `conformance/c1_read.rs`.
//! - **C2 acknowledged accumulate**: `accumulate(handle, offset, f32 bytes, tag, deadline)` resolves
//!   only once the owner has added the values into its fp32 accumulator. `conformance/c2_accumulate.rs`.
//! - **C3 fencing**: an accumulate whose `tag.epoch` differs from the accumulator's current epoch is
//!   refused ([`TransportError::StaleEpoch`]); a `tag.write_id` already applied in the current epoch is
//!   refused ([`TransportError::DuplicateWrite`]). Taking the accumulator and moving to the next
//!   epoch happen atomically with respect to accumulates, so a late write from a failed peer can
//!   never land in the next epoch. A take may also return the write ids the ended epoch applied
//!   ([`AccumulatorRegion::take_applied`]: what its sum combined). `conformance/c3_fencing.rs`.
//! - **C4 bounds**: unknown regions, out-of-range element ranges, payloads that are not whole
//!   elements, publications of the wrong length, wrong region kinds and destinations of the wrong
//!   size ([`TransportError::BadDestination`]) are typed errors, never panics, and leave the region
//!   and the destination unchanged. A destination the backend cannot write (device memory for a
//!   host backend) is [`TransportError::Unsupported`]. A request is checked in this order and the
//!   first failure is reported: deadline, handle (foreign, unknown), kind, shape (range, payload),
//!   destination, then admission (C8), then fencing (epoch, write id, capacity).
//!   `conformance/c4_bounds.rs`.
//! - **C5 chunking**: large transfers are split into chunks of a configurable size
//!   ([`chunk_ranges`]) which callers issue concurrently to every owner at once; any split reads and
//!   adds exactly what the whole transfer does. `conformance/c5_chunking.rs`.
//! - **C6 batches and deadlines**: every peer operation carries a [`Deadline`]. One that starts at
//!   or after it is refused with [`TransportError::DeadlineExceeded`] (naming owner, region and
//!   [`Op`]) and changes nothing; a wait that outlives it returns that error. `read_batch` and
//!   `accumulate_batch` return one result per op, in order; one failing op does not affect the
//!   others. `conformance/c6_deadlines.rs`.
//! - **C7 inbox**: `send(inbox, tag, bytes, deadline)` resolves once the message sits in the inbox.
//!   Fenced like C3: a `tag.epoch` older than the inbox's is [`TransportError::StaleEpoch`]; a newer
//!   one first moves the inbox to that epoch, exactly as `advance` does (a sender already in the
//!   next minibatch attempt reaches a neighbour that has not begun it, or is stuck in a discarded
//!   one, whose waits are then aborted); a write
//!   id already delivered in the epoch (even if since received) is
//!   [`TransportError::DuplicateWrite`]; beyond the inbox's capacity of held messages a send is
//!   [`TransportError::InboxFull`]. The owner's [`InboxRegion::recv`] waits for the message with
//!   exactly its tag (any arrival order), removes it and returns it; a recv of an older epoch is
//!   [`TransportError::Aborted`] at once, of a newer one `StaleEpoch`, of a message already received
//!   `DuplicateWrite`. [`InboxRegion::advance`] moves the epoch forward, drops held messages and
//!   aborts waiting receives of older epochs. `conformance/c7_inbox.rs`.
//! - **C8 admission**: the owner of an accumulator may install a [`WriteGuard`]
//!   ([`AccumulatorRegion::admit_only`]); from then on an accumulate whose [`WriteTag`] the guard
//!   does not admit is [`TransportError::RefusedWrite`] (naming owner, region, epoch and write id)
//!   and changes nothing: not the values, not the set of applied write ids, so the genuine write
//!   with the same id is still applied. The owner logs each refusal and counts it in
//!   [`REFUSED_WRITES_METRIC`]. Without a guard every tag is admitted. Inboxes have no guard.
//!   `conformance/c8_admission.rs`.
//!
//! Backends: [`local`] (one process; any local transport of the process can use any local handle).
//! Process-crossing: [`tcp`], `shm` (Linux, one host) and `rdma` (feature `rdma`: one-sided RDMA
//! READ of published regions; accumulates and sends over its TCP control connection).
//! [`throttle::Throttled`] wraps any backend with modelled link bandwidth.

mod chunk;
pub mod codec;
#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(all(feature = "cuda-code", target_os = "linux"))]
pub mod cuda;
mod deadline;
mod dest;
mod error;
mod handle;
pub mod local;
pub mod priced;
#[cfg(feature = "rdma")]
pub mod rdma;
mod region;
mod remote;
mod seqlock;
#[cfg(target_os = "linux")]
pub mod shm;
pub mod tcp;
#[cfg(test)]
mod testing;
pub mod throttle;
mod transport;
pub mod wire;
pub mod wrap;

pub use chunk::chunk_ranges;
pub use deadline::{check_deadline, deadline_in, now, Deadline};
pub use dest::{Dest, DestSpec, DeviceDest};
pub use error::{Op, TransportError};
pub use handle::{
    CudaMemory, Descriptor, Dtype, EndpointId, RdmaMemory, RegionHandle, RegionId, RegionKind,
    WriteGuard, WriteTag,
};
pub use region::{AccumulatorRegion, Applied, InboxRegion, Progress, PublishedRegion};
pub use remote::RemoteConfig;

/// Accumulates refused by their owner's [`WriteGuard`] (C8), counted at the owner.
pub const REFUSED_WRITES_METRIC: &str = "odc_refused_writes_total";
pub use transport::{AccumulateOp, ReadOp, Transport};
pub use wire::ClusterSecret;
