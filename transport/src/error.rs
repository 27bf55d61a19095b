use crate::region::{Dtype, EndpointId, RegionId, RegionKind};

/// Everything that can go wrong on the data plane. Every variant names the region and the values
/// that were wrong, so a peer's bad request can be reported precisely.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TransportError {
    #[error("unknown region {region} at endpoint {owner}")]
    UnknownRegion { owner: EndpointId, region: RegionId },
    #[error("element range {start}..{end} is out of bounds for region {region} of {len} elements")]
    OutOfRange {
        region: RegionId,
        start: usize,
        end: usize,
        len: usize,
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
        bytes: usize,
        dtype: Dtype,
    },
    #[error("publication of {elements} elements does not match region {region} of {len} elements")]
    LengthMismatch {
        region: RegionId,
        elements: usize,
        len: usize,
    },
    #[error("accumulate into region {region} carries epoch {got}, but the accumulator is at epoch {current}")]
    StaleEpoch {
        region: RegionId,
        got: u64,
        current: u64,
    },
    #[error("write {write_id:#x} was already applied to region {region} in epoch {epoch}")]
    DuplicateWrite {
        region: RegionId,
        epoch: u64,
        write_id: u128,
    },
    #[error("endpoint {owner} is unreachable: {reason}")]
    Unreachable { owner: EndpointId, reason: String },
}
