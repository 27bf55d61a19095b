//! # odc-transport — the data plane
//!
//! Moves tensor bytes between trainers and shard servers. Nothing here knows about models: a server
//! registers **regions** (a published parameter copy, a gradient accumulator) and hands out
//! [`RegionHandle`]s; trainers [`Transport::read`] published regions one-sidedly and
//! [`Transport::accumulate`] fp32 gradients into accumulators.
//!
//! ## Contract (every backend; checked by [`conformance`])
//! - **C1 one-sided read**: `read(handle, range)` returns the elements `range` of the region as last
//!   published, together with the version they were published with. The owner's actor is not
//!   involved; a read observes one whole publication, never a mix of two.
//! - **C2 acknowledged accumulate**: `accumulate(handle, offset, f32 bytes, tag)` resolves only once the
//!   owner has added the values into its fp32 accumulator.
//! - **C3 fencing**: an accumulate whose `tag.epoch` differs from the accumulator's current epoch is
//!   refused ([`TransportError::StaleEpoch`]); a `tag.write_id` already applied in the current epoch is
//!   refused ([`TransportError::DuplicateWrite`]). Taking or discarding the accumulator and moving to the
//!   next epoch happen atomically with respect to accumulates, so a late write from a failed peer can
//!   never land in the next epoch.
//! - **C4 bounds**: unknown regions, out-of-range element ranges, payloads that are not whole fp32
//!   elements and wrong region kinds are typed errors, never panics, and leave the region unchanged.
//! - **C5 chunking**: large transfers are split into chunks of a configurable size
//!   ([`chunk_ranges`]) which callers issue concurrently to every owner at once.
//!
//! Backends: [`local`] (one process, zero copy: a read is a reference-counted slice of the published
//! buffer). [`throttle::Throttled`] wraps any backend with modelled link bandwidth.

mod chunk;
pub mod codec;
pub mod conformance;
mod error;
pub mod local;
mod region;
pub mod throttle;
mod transport;

pub use chunk::chunk_ranges;
pub use error::TransportError;
pub use region::{
    AccumulatorRegion, Dtype, EndpointId, PublishedRegion, ReadChunk, RegionHandle, RegionId,
    RegionKind, WriteTag,
};
pub use transport::Transport;
