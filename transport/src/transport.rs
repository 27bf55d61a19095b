use std::ops::Range;

use bytes::Bytes;

use crate::deadline::Deadline;
use crate::dest::Dest;
use crate::error::TransportError;
use crate::handle::{Dtype, EndpointId, RegionHandle, WriteTag};
use crate::region::{AccumulatorRegion, InboxRegion, PublishedRegion};

/// One read of a [`Transport::read_batch`].
#[derive(Debug)]
pub struct ReadOp<'a> {
    pub handle: &'a RegionHandle,
    pub range: Range<usize>,
    pub into: Dest<'a>,
}

/// One accumulate of a [`Transport::accumulate_batch`].
#[derive(Debug, Clone)]
pub struct AccumulateOp {
    pub handle: RegionHandle,
    pub offset: usize,
    pub data: Bytes,
    pub tag: WriteTag,
}

/// A data-plane backend. Object safe: the runtime holds an `Arc<dyn Transport>`.
///
/// Owner side: `register_*` return guards that keep a region registered while they live. Peer
/// side: `read`, `accumulate`, `send` address a region by its [`RegionHandle`] alone, which may
/// come from another transport instance (or, for process-crossing backends, another process).
/// Every peer operation takes a [`Deadline`].
#[async_trait::async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Short backend name, used as a metrics label (`local`, `shm`, `tcp`, ...).
    fn backend(&self) -> &'static str;

    /// The backend itself, for owner-side APIs only it has (a downcast): the `cuda` backend's
    /// regions whose values stay in device memory
    /// (`cuda::CudaTransport::register_device_accumulator`, `register_device_published`). `None`
    /// by default: host backends have none, and wrappers hide what they wrap.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

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

    /// Owner side: register an empty inbox at `epoch` (C7).
    fn register_inbox(
        &self,
        owner: EndpointId,
        epoch: u64,
    ) -> Result<Box<dyn InboxRegion>, TransportError>;

    /// One-sided read of the elements `range` of a published region into `into` (C1); returns the
    /// version read.
    async fn read(
        &self,
        handle: &RegionHandle,
        range: Range<usize>,
        into: Dest<'_>,
        deadline: Deadline,
    ) -> Result<u64, TransportError>;

    /// Add fp32 little-endian `data` into the accumulator starting at element `offset`; resolves once
    /// applied (C2), refused when fenced (C3).
    async fn accumulate(
        &self,
        handle: &RegionHandle,
        offset: usize,
        data: Bytes,
        tag: WriteTag,
        deadline: Deadline,
    ) -> Result<(), TransportError>;

    /// Put the message `data` tagged `tag` into the inbox `inbox`; resolves once it sits there
    /// (acknowledged), refused when fenced or full (C7).
    async fn send(
        &self,
        inbox: &RegionHandle,
        tag: WriteTag,
        data: Bytes,
        deadline: Deadline,
    ) -> Result<(), TransportError>;

    /// Issue every read at once; one result per op, in order (C6). One failing op does not
    /// affect the others.
    async fn read_batch(
        &self,
        ops: Vec<ReadOp<'_>>,
        deadline: Deadline,
    ) -> Vec<Result<u64, TransportError>> {
        let reads = ops
            .into_iter()
            .map(|op| self.read(op.handle, op.range, op.into, deadline));
        futures::future::join_all(reads).await
    }

    /// Issue every accumulate at once; one result per op, in order (C6). One failing op does not
    /// affect the others.
    async fn accumulate_batch(
        &self,
        ops: Vec<AccumulateOp>,
        deadline: Deadline,
    ) -> Vec<Result<(), TransportError>> {
        let writes = ops.into_iter().map(|op| async move {
            self.accumulate(&op.handle, op.offset, op.data, op.tag, deadline)
                .await
        });
        futures::future::join_all(writes).await
    }
}
