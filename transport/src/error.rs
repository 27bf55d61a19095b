use serde::{Deserialize, Serialize};

use crate::handle::{Dtype, EndpointId, RegionId, RegionKind};

/// The data-plane operation an error is about (carried by [`TransportError::DeadlineExceeded`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Op {
    /// [`Transport::read`](crate::Transport::read) (one-sided, C1).
    Read,
    /// [`Transport::accumulate`](crate::Transport::accumulate) (C2).
    Accumulate,
    /// [`Transport::send`](crate::Transport::send) into an inbox (C7).
    Send,
    /// [`InboxRegion::recv`](crate::InboxRegion::recv) (C7).
    Recv,
}

/// Everything that can go wrong on the data plane. Every variant names the region (and, where it
/// is known, the owner) and the values that were wrong, so a peer's bad request can be reported
/// precisely. Serializable, with no `usize`: errors cross processes as data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum TransportError {
    #[error("unknown region {region} at endpoint {owner}")]
    UnknownRegion { owner: EndpointId, region: RegionId },
    #[error("handle to region {region} at endpoint {owner} cannot be used here: {reason}")]
    ForeignHandle {
        owner: EndpointId,
        region: RegionId,
        reason: String,
    },
    #[error("element range {start}..{end} is out of bounds for region {region} of {len} elements")]
    OutOfRange {
        region: RegionId,
        start: u64,
        end: u64,
        len: u64,
    },
    #[error(
        "region {region} is a {actual:?} region but the operation needs a {expected:?} region"
    )]
    WrongKind {
        region: RegionId,
        expected: RegionKind,
        actual: RegionKind,
    },
    #[error(
        "payload of {bytes} bytes for region {region} is not a whole number of {dtype:?} elements"
    )]
    BadPayload {
        region: RegionId,
        bytes: u64,
        dtype: Dtype,
    },
    #[error("publication of {elements} elements does not match region {region} of {len} elements")]
    LengthMismatch {
        region: RegionId,
        elements: u64,
        len: u64,
    },
    /// The destination of a read of `region` holds `got` units but the read needs `expected`:
    /// bytes for [`Dest::Bytes`](crate::Dest::Bytes), `f32`s for [`Dest::F32`](crate::Dest::F32).
    #[error(
        "destination for a read of region {region} holds {got} units (bytes or f32s) but the read needs {expected}"
    )]
    BadDestination {
        region: RegionId,
        expected: u64,
        got: u64,
    },
    /// The backend cannot do `what` (e.g. a host backend asked to write device memory).
    #[error("unsupported by this backend: {what}")]
    Unsupported { what: String },
    /// A write (accumulate or send) or a recv carries an epoch other than the region's current
    /// one (for a recv: a newer one; an older one is [`TransportError::Aborted`]).
    #[error(
        "operation on region {region} carries epoch {got}, but the region is at epoch {current}"
    )]
    StaleEpoch {
        region: RegionId,
        got: u64,
        current: u64,
    },
    /// The write id was already applied (accumulator) or delivered (inbox) in this epoch; for an
    /// inbox also a second `recv` of a message that was already received.
    #[error("write {write_id:#x} was already applied to (or delivered to) region {region} in epoch {epoch}")]
    DuplicateWrite {
        region: RegionId,
        epoch: u64,
        write_id: u128,
    },
    /// The owner's [`WriteGuard`](crate::WriteGuard) did not admit the write (C8): its token is
    /// not the one the owner expects for it. Nothing was applied; the write id stays free.
    #[error(
        "endpoint {owner} refused write {write_id:#x} of epoch {epoch} to region {region}: its token is not admitted"
    )]
    RefusedWrite {
        owner: EndpointId,
        region: RegionId,
        epoch: u64,
        write_id: u128,
    },
    /// The operation started after its deadline, or waited past it.
    #[error("{op:?} on region {region} at endpoint {owner} missed its deadline")]
    DeadlineExceeded {
        owner: EndpointId,
        region: RegionId,
        op: Op,
    },
    /// A recv of `epoch` on an inbox that is (or moved) at the newer epoch `current`.
    #[error(
        "recv of epoch {epoch} on inbox {region} was aborted: the inbox is at epoch {current}"
    )]
    Aborted {
        region: RegionId,
        epoch: u64,
        current: u64,
    },
    /// The inbox already holds `capacity` messages that nobody received.
    #[error("inbox {region} is full: it holds {held} messages, its capacity is {capacity}")]
    InboxFull {
        region: RegionId,
        held: u64,
        capacity: u64,
    },
    #[error("endpoint {owner} is unreachable: {reason}")]
    Unreachable { owner: EndpointId, reason: String },
}

/// A count or index as carried by a serialized error. Lossless on every platform Rust supports
/// (`usize` is at most 64 bits); saturates otherwise.
pub(crate) fn wide(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}
