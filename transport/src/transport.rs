use std::ops::Range;

use bytes::Bytes;

use crate::{
    AccumulatorRegion, Dtype, EndpointId, PublishedRegion, ReadChunk, RegionHandle, TransportError,
    WriteTag,
};

/// A data-plane backend. Object safe: the runtime holds an `Arc<dyn Transport>`.
#[async_trait::async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Short backend name, used as a metrics label (`local`, `shm`, `tcp`, ...).
    fn backend(&self) -> &'static str;

    /// Owner side: register a published region holding `initial` (encoded in `dtype`) at `version`.
    fn register_published(
        &self,
        owner: EndpointId,
        dtype: Dtype,
        initial: Bytes,
        version: u64,
    ) -> Result<Box<dyn PublishedRegion>, TransportError>;

    /// Owner side: register a zeroed fp32 accumulator of `len` elements at `epoch`.
    fn register_accumulator(
        &self,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<Box<dyn AccumulatorRegion>, TransportError>;

    /// One-sided read of the elements `range` of a published region (C1).
    async fn read(
        &self,
        handle: &RegionHandle,
        range: Range<usize>,
    ) -> Result<ReadChunk, TransportError>;

    /// Add fp32 little-endian `data` into the accumulator starting at element `offset`; resolves once
    /// applied (C2), refused when fenced (C3).
    async fn accumulate(
        &self,
        handle: &RegionHandle,
        offset: usize,
        data: Bytes,
        tag: WriteTag,
    ) -> Result<(), TransportError>;
}
