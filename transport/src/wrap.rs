//! Transports that wrap another and change part of what it does: a link model that prices each
//! transfer ([`crate::priced`]), a test's recorder or gate. A wrapper implements [`Wrap`] — the
//! inner transport and only the operations it changes; every other operation forwards — and
//! [`Wrapped`] makes it a [`Transport`]. Written once here, the forwarding is the same for every
//! wrapper, and a method added to [`Transport`] is added here once.

use std::ops::Range;

use bytes::Bytes;

use crate::{
    AccumulatorRegion, Deadline, Dest, Dtype, EndpointId, InboxRegion, PublishedRegion,
    RegionHandle, Transport, TransportError, WriteTag,
};

/// A wrapper of [`Wrap::inner`]: every method forwards to it unless the wrapper overrides it.
#[async_trait::async_trait]
pub trait Wrap: Send + Sync + 'static {
    /// The wrapped transport.
    fn inner(&self) -> &dyn Transport;

    fn backend(&self) -> &'static str {
        self.inner().backend()
    }

    fn register_published(
        &self,
        owner: EndpointId,
        dtype: Dtype,
        initial: Bytes,
        version: u64,
    ) -> Result<Box<dyn PublishedRegion>, TransportError> {
        self.inner()
            .register_published(owner, dtype, initial, version)
    }

    fn register_accumulator(
        &self,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<Box<dyn AccumulatorRegion>, TransportError> {
        self.inner().register_accumulator(owner, len, epoch)
    }

    fn register_inbox(
        &self,
        owner: EndpointId,
        epoch: u64,
    ) -> Result<Box<dyn InboxRegion>, TransportError> {
        self.inner().register_inbox(owner, epoch)
    }

    async fn read(
        &self,
        handle: &RegionHandle,
        range: Range<usize>,
        into: Dest<'_>,
        deadline: Deadline,
    ) -> Result<u64, TransportError> {
        self.inner().read(handle, range, into, deadline).await
    }

    async fn accumulate(
        &self,
        handle: &RegionHandle,
        offset: usize,
        data: Bytes,
        tag: WriteTag,
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        self.inner()
            .accumulate(handle, offset, data, tag, deadline)
            .await
    }

    async fn send(
        &self,
        inbox: &RegionHandle,
        tag: WriteTag,
        data: Bytes,
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        self.inner().send(inbox, tag, data, deadline).await
    }
}

/// A [`Wrap`] as a [`Transport`] (batches go through the wrapper's `read` and `accumulate`).
#[derive(Debug)]
pub struct Wrapped<W>(pub W);

#[async_trait::async_trait]
impl<W: Wrap> Transport for Wrapped<W> {
    fn backend(&self) -> &'static str {
        self.0.backend()
    }

    fn register_published(
        &self,
        owner: EndpointId,
        dtype: Dtype,
        initial: Bytes,
        version: u64,
    ) -> Result<Box<dyn PublishedRegion>, TransportError> {
        self.0.register_published(owner, dtype, initial, version)
    }

    fn register_accumulator(
        &self,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<Box<dyn AccumulatorRegion>, TransportError> {
        self.0.register_accumulator(owner, len, epoch)
    }

    fn register_inbox(
        &self,
        owner: EndpointId,
        epoch: u64,
    ) -> Result<Box<dyn InboxRegion>, TransportError> {
        self.0.register_inbox(owner, epoch)
    }

    async fn read(
        &self,
        handle: &RegionHandle,
        range: Range<usize>,
        into: Dest<'_>,
        deadline: Deadline,
    ) -> Result<u64, TransportError> {
        self.0.read(handle, range, into, deadline).await
    }

    async fn accumulate(
        &self,
        handle: &RegionHandle,
        offset: usize,
        data: Bytes,
        tag: WriteTag,
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        self.0.accumulate(handle, offset, data, tag, deadline).await
    }

    async fn send(
        &self,
        inbox: &RegionHandle,
        tag: WriteTag,
        data: Bytes,
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        self.0.send(inbox, tag, data, deadline).await
    }
}
