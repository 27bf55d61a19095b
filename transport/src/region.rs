use bytes::Bytes;

/// A shard server's identity on the data plane.
pub type EndpointId = u32;
/// A region's identity, unique within its transport.
pub type RegionId = u64;

/// Element type of a region. Accumulators are always [`Dtype::F32`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }
}

/// What a region is for; operations check it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegionKind {
    /// Parameters the owner publishes once per version; peers read them one-sidedly.
    Published,
    /// fp32 gradient accumulator; peers add into it.
    Accumulator,
}

/// Everything a peer needs to address a region. Cheap to clone and to send in a control message.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RegionHandle {
    pub owner: EndpointId,
    pub id: RegionId,
    pub kind: RegionKind,
    pub dtype: Dtype,
    /// Length in elements.
    pub len: usize,
}

/// The result of a one-sided read: the bytes of the requested elements (little-endian, in the
/// region's dtype) and the version they were published with.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadChunk {
    pub version: u64,
    pub bytes: Bytes,
}

/// Identifies one accumulate for fencing (contract C3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WriteTag {
    /// Must equal the accumulator's current epoch.
    pub epoch: u64,
    /// Unique per write within an epoch; a repeat is refused.
    pub write_id: u128,
}

/// Owner side of a published region. Dropping it deregisters the region.
pub trait PublishedRegion: Send + Sync {
    fn handle(&self) -> RegionHandle;
    /// Replace the whole region's contents (encoded in the region's dtype) and its version, atomically
    /// for readers (C1).
    fn publish(&self, version: u64, data: Bytes) -> Result<(), crate::TransportError>;
    /// The version last published.
    fn version(&self) -> u64;
}

/// Owner side of an accumulator region. Dropping it deregisters the region.
pub trait AccumulatorRegion: Send + Sync {
    fn handle(&self) -> RegionHandle;
    /// Atomically return the accumulated values, zero the accumulator, forget applied write ids and
    /// move to `next_epoch` (C3).
    fn take(&self, next_epoch: u64) -> Vec<f32>;
    /// The current epoch.
    fn epoch(&self) -> u64;
    /// Owner side: copy the accumulated values of `range` without taking them (a collective's
    /// staging buffer reads what its peer added). Out-of-range is [`TransportError::OutOfRange`].
    fn read_local(&self, range: std::ops::Range<usize>) -> Result<Vec<f32>, crate::TransportError>;
}
