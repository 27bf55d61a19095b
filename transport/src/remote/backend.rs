//! The served-backend core: one [`Transport`] for every process-crossing backend. The owner side
//! (listener, accept, handshake, peers, registration, fencing, deduplication, admission, the
//! accumulate bookkeeping) is [`Served`] behind its listener; the reader side (dial, locate, the
//! three operations) is [`Remote`]'s `Transport` impl, written once here. A backend supplies only
//! what is its own ([`Backend`]): its descriptor, how a handle of its kind is located, where a
//! published region's bytes live and how a reader copies them without the owner (a mapped
//! segment, an RDMA READ, a CUDA IPC copy), or nothing of that kind (`tcp` serves every read).
//! Its constructor binds its listener and hands it, with its dialer ([`super::dial`]), to
//! [`Remote::start`], which sets up the fabric, the peers and the accept loop the same way for
//! every backend.
//!
//! Every operation checks its deadline first, then locates the handle (a foreign handle is
//! [`TransportError::ForeignHandle`] naming why); a published region with memory of its own is
//! read one-sidedly by the backend, anything else goes to its owner over the connection
//! ([`ops`]); an accumulate or a send aimed at a published region's memory is refused by kind
//! after the backend's checks of the handle.

use std::future::Future;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;

use super::listen::{accept_loop, Listen};
use super::service::Accepted;
use super::{ops, Dial, Peers, RemoteConfig, Renamed, Served};
use crate::deadline::check_deadline;
use crate::wire::{ClusterSecret, Target};
use crate::{
    AccumulatorRegion, Deadline, Descriptor, Dest, Dtype, EndpointId, InboxRegion, Op,
    PublishedRegion, RegionHandle, RegionKind, Transport, TransportError, WriteTag,
};

/// Where a handle points: the owner's control address, the region, and the memory a reader
/// copies without the owner (a published region of a backend that has such memory).
pub(crate) struct Located<'h, M> {
    /// The owner's control connection (`host:port`, a socket path).
    pub(crate) addr: &'h str,
    pub(crate) target: Target,
    pub(crate) memory: Option<M>,
}

/// What a process-crossing backend brings to the core (see the [module docs](self)). Its two
/// operations are plain futures (not boxed): a one-sided read of a few KiB is a few hundred
/// nanoseconds, of which an allocation per call would be a fifth.
pub(crate) trait Backend: Send + Sync + Sized + 'static {
    /// How a handle names a published region's own memory.
    type Memory: Send + Sync;

    /// The backend's name (`Transport::backend`).
    const NAME: &'static str;

    /// The descriptor of this transport's accumulators and inboxes.
    fn descriptor(&self, served: &Served) -> Descriptor;

    /// Where `handle` lives, or why this backend cannot use it.
    fn locate<'h>(
        &self,
        served: &Served,
        handle: &'h RegionHandle,
    ) -> Result<Located<'h, Self::Memory>, TransportError>;

    /// The owner side of a published region: by default kept in the core's fabric, every read of
    /// it served by the owner over the connection (`tcp`).
    fn register_published(
        &self,
        served: &Served,
        owner: EndpointId,
        dtype: Dtype,
        initial: Bytes,
        version: u64,
    ) -> Result<Box<dyn PublishedRegion>, TransportError> {
        let inner = served
            .fabric
            .register_published(owner, dtype, initial, version)?;
        Ok(Box::new(Renamed {
            descriptor: self.descriptor(served),
            inner,
        }))
    }

    /// The owner side of an accumulator: by default kept by the core's [`Served`].
    fn register_accumulator(
        &self,
        served: &Served,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<Box<dyn AccumulatorRegion>, TransportError> {
        served.register_accumulator(self.descriptor(served), owner, len, epoch)
    }

    /// A one-sided read of the published region at `memory`.
    #[allow(clippy::too_many_arguments)]
    fn read_memory(
        &self,
        served: &Served,
        handle: &RegionHandle,
        located: &Located<'_, Self::Memory>,
        memory: &Self::Memory,
        range: Range<usize>,
        into: Dest<'_>,
        deadline: Deadline,
    ) -> impl Future<Output = Result<u64, TransportError>> + Send;

    /// An accumulate or a send (`op`, for a region of kind `expected`) aimed at the published
    /// region at `memory`: the error, after the backend's checks of the handle.
    #[allow(clippy::too_many_arguments)]
    fn wrong_kind(
        &self,
        served: &Served,
        handle: &RegionHandle,
        located: &Located<'_, Self::Memory>,
        memory: &Self::Memory,
        op: Op,
        expected: RegionKind,
        deadline: Deadline,
    ) -> impl Future<Output = TransportError> + Send;
}

/// A process-crossing transport: the core around backend `B`. Dropping it stops listening and
/// closes every connection it serves.
pub struct Remote<B> {
    pub(crate) served: Arc<Served>,
    pub(crate) peers: Peers,
    listener: tokio::task::JoinHandle<()>,
    pub(crate) backend: B,
}

impl<B> Remote<B> {
    /// The core around `backend`, inside a tokio runtime: a fresh fabric ([`Served`]) under its
    /// knobs `remote` and `secret`; connections accepted on `listener` by the accept loop
    /// ([`accept_loop`], its log and metric named `B::NAME`), each handed to `serve` in its own
    /// task with what it is served with ([`Accepted`], its handshake due from its acceptance);
    /// and other owners reached through `dial`. Dropping the transport aborts the loop and every
    /// connection it serves.
    pub(crate) fn start<L, F, Fut>(
        listener: L,
        dial: impl Dial,
        remote: RemoteConfig,
        secret: ClusterSecret,
        backend: B,
        serve: F,
    ) -> Self
    where
        B: Backend,
        L: Listen + Sync,
        F: Fn(L::Stream, Accepted) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let served = Served::new(remote, secret);
        let peers = Peers::new(Box::new(dial), Arc::clone(&served));
        let serving = Arc::clone(&served);
        let listener = tokio::spawn(accept_loop(
            listener,
            B::NAME,
            move |stream, peer, permit| {
                let accepted = Accepted {
                    deadline: serving.handshake_deadline(),
                    served: Arc::clone(&serving),
                    peer,
                    permit,
                };
                serve(stream, accepted)
            },
        ));
        Self {
            served,
            peers,
            listener,
            backend,
        }
    }
}

impl<B> Drop for Remote<B> {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

impl<B: std::fmt::Debug> std::fmt::Debug for Remote<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("backend", &self.backend)
            .field("instance", &self.served.instance)
            .finish()
    }
}

#[async_trait::async_trait]
impl<B: Backend> Transport for Remote<B> {
    fn backend(&self) -> &'static str {
        B::NAME
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn register_published(
        &self,
        owner: EndpointId,
        dtype: Dtype,
        initial: Bytes,
        version: u64,
    ) -> Result<Box<dyn PublishedRegion>, TransportError> {
        self.backend
            .register_published(&self.served, owner, dtype, initial, version)
    }

    fn register_accumulator(
        &self,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<Box<dyn AccumulatorRegion>, TransportError> {
        self.backend
            .register_accumulator(&self.served, owner, len, epoch)
    }

    fn register_inbox(
        &self,
        owner: EndpointId,
        epoch: u64,
    ) -> Result<Box<dyn InboxRegion>, TransportError> {
        self.served
            .register_inbox(self.backend.descriptor(&self.served), owner, epoch)
    }

    async fn read(
        &self,
        handle: &RegionHandle,
        range: Range<usize>,
        into: Dest<'_>,
        deadline: Deadline,
    ) -> Result<u64, TransportError> {
        check_deadline(deadline, handle.owner, handle.id, Op::Read)?;
        let located = self.backend.locate(&self.served, handle)?;
        match &located.memory {
            Some(memory) => {
                self.backend
                    .read_memory(
                        &self.served,
                        handle,
                        &located,
                        memory,
                        range,
                        into,
                        deadline,
                    )
                    .await
            }
            // Not a published region with memory of its own: the owner serves it (or says what
            // it is: unknown, another kind).
            None => {
                ops::read(
                    &self.peers,
                    located.addr,
                    located.target,
                    handle,
                    range,
                    into,
                    deadline,
                )
                .await
            }
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
        let located = self.backend.locate(&self.served, handle)?;
        if let Some(memory) = &located.memory {
            return Err(self
                .backend
                .wrong_kind(
                    &self.served,
                    handle,
                    &located,
                    memory,
                    Op::Accumulate,
                    RegionKind::Accumulator,
                    deadline,
                )
                .await);
        }
        ops::accumulate(
            &self.peers,
            located.addr,
            located.target,
            offset,
            data,
            tag,
            deadline,
        )
        .await
    }

    async fn send(
        &self,
        inbox: &RegionHandle,
        tag: WriteTag,
        data: Bytes,
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        check_deadline(deadline, inbox.owner, inbox.id, Op::Send)?;
        let located = self.backend.locate(&self.served, inbox)?;
        if let Some(memory) = &located.memory {
            return Err(self
                .backend
                .wrong_kind(
                    &self.served,
                    inbox,
                    &located,
                    memory,
                    Op::Send,
                    RegionKind::Inbox,
                    deadline,
                )
                .await);
        }
        ops::send(
            &self.peers,
            located.addr,
            located.target,
            tag,
            data,
            deadline,
        )
        .await
    }
}

/// Why a handle of another backend cannot be used by `backend`.
pub(crate) fn foreign(handle: &RegionHandle, reason: String) -> TransportError {
    TransportError::ForeignHandle {
        owner: handle.owner,
        region: handle.id,
        reason,
    }
}

/// The usual [`foreign`] reason: a handle of another backend.
pub(crate) fn other_backend(handle: &RegionHandle, backend: &str, reaches: &str) -> TransportError {
    foreign(
        handle,
        format!(
            "it is a {} handle; the {backend} backend reaches {reaches}",
            handle.descriptor.backend()
        ),
    )
}
