//! The `tcp` backend: processes on any hosts, over TCP (tokio).
//!
//! An owner's regions live in a [`LocalTransport`] fabric; the transport listens on a socket and
//! serves every accepted connection in its own task (a reader task, not an actor's mailbox):
//! handshake on the cluster secret first ([`crate::wire::handshake`]), then requests answered in
//! order ([`crate::remote`]). Handles carry [`Descriptor::Tcp`]` { addr, instance }`: the advertised
//! address and a random instance number, so a handle to an earlier instance at the same address
//! names an unknown region, never a newer one's.
//!
//! A reader keeps one authenticated connection per owner address and pipelines its requests on
//! it; reads larger than [`RemoteConfig::read_part_bytes`] go as parts in flight at once, and a
//! batch issues all its operations to all owners at once (C5, C6). A read's payload goes from the
//! socket straight into its part of the caller's destination (`Dest::Bytes`; an `f32` destination
//! decodes it from a receive buffer the connection reuses), never through a buffer allocated per
//! answer. A handle of this very instance is served in-process, without a socket.
//!
//! How each clause holds across processes:
//! - **C1**: the owner answers every part from one publication (a slice of its immutable bytes)
//!   and says which version; a read whose parts saw different versions is read again.
//! - **C2, C3, C7**: the owner applies an accumulate (holds a message) before it answers `Done`;
//!   fencing is the fabric's, under its locks.
//! - **C4**: the caller checks the deadline and the descriptor; the owner checks everything else in
//!   the contract's order (the request names the whole range and the destination's shape) and
//!   answers with the typed error.
//! - **C6 and I6**: every wait is bounded by the operation's deadline; a connection that fails
//!   fails its requests in flight with [`TransportError::Unreachable`] naming the owner.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use tokio::net::TcpStream;

use crate::remote::{
    accept_loop, bind_tcp, ops, serve_connection, BoxRead, BoxWrite, Dial, Peers, RemoteConfig,
    Renamed, Served,
};
use crate::transport::check_deadline;
use crate::wire::{ClusterSecret, Target};
use crate::{
    AccumulatorRegion, Deadline, Descriptor, Dest, Dtype, EndpointId, InboxRegion, Op,
    PublishedRegion, RegionHandle, Transport, TransportError, WriteTag,
};

/// How a [`TcpTransport`] listens and what it tells peers.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Where to listen (`host:port`; port 0 picks a free one).
    pub bind: String,
    /// The host peers should dial, if not the bound address's (e.g. the node's name when binding
    /// `0.0.0.0`). The port is always the bound one.
    pub advertise_host: Option<String>,
    /// Shared by every process of the job.
    pub secret: ClusterSecret,
    pub remote: RemoteConfig,
}

impl TcpConfig {
    /// Listen on a free loopback port.
    pub fn loopback(secret: ClusterSecret) -> Self {
        Self {
            bind: "127.0.0.1:0".into(),
            advertise_host: None,
            secret,
            remote: RemoteConfig::default(),
        }
    }
}

struct TcpDial;

#[async_trait::async_trait]
impl Dial for TcpDial {
    async fn dial(&self, addr: &str) -> std::io::Result<(BoxRead, BoxWrite)> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (read, write) = stream.into_split();
        Ok((Box::new(read), Box::new(write)))
    }
}

/// The TCP backend. Create it inside a tokio runtime ([`TcpTransport::bind`]); dropping it stops
/// listening and closes every connection it serves.
pub struct TcpTransport {
    served: Arc<Served>,
    addr: String,
    peers: Peers,
    listener: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("addr", &self.addr)
            .field("instance", &self.served.instance)
            .finish()
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

impl TcpTransport {
    /// Listen at `config.bind` and serve this transport's regions there.
    pub async fn bind(config: TcpConfig) -> Result<Self, TransportError> {
        let (listener, addr) =
            bind_tcp("tcp", &config.bind, config.advertise_host.as_deref()).await?;
        let served = Served::new(config.remote, config.secret);
        let peers = Peers::new(Box::new(TcpDial), Arc::clone(&served));
        let serving = Arc::clone(&served);
        let listener = tokio::spawn(accept_loop(
            listener,
            "tcp",
            move |stream: TcpStream, peer, permit| {
                let (read, write) = stream.into_split();
                let deadline = serving.handshake_deadline();
                serve_connection(read, write, Arc::clone(&serving), peer, permit, deadline)
            },
        ));
        Ok(Self {
            served,
            addr,
            peers,
            listener,
        })
    }

    /// The address peers dial (`host:port`).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn descriptor(&self) -> Descriptor {
        Descriptor::Tcp {
            addr: self.addr.clone(),
            instance: self.served.instance,
        }
    }

    /// Where `handle` is served, or why this backend cannot use it.
    fn locate<'h>(&self, handle: &'h RegionHandle) -> Result<(&'h str, Target), TransportError> {
        match &handle.descriptor {
            Descriptor::Tcp { addr, instance } => Ok((
                addr,
                Target {
                    owner: handle.owner,
                    instance: *instance,
                    region: handle.id,
                },
            )),
            other => Err(TransportError::ForeignHandle {
                owner: handle.owner,
                region: handle.id,
                reason: format!(
                    "it is a {} handle; the tcp backend reaches regions served over tcp",
                    other.backend()
                ),
            }),
        }
    }
}

#[async_trait::async_trait]
impl Transport for TcpTransport {
    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn register_published(
        &self,
        owner: EndpointId,
        dtype: Dtype,
        initial: Bytes,
        version: u64,
    ) -> Result<Box<dyn PublishedRegion>, TransportError> {
        let inner = self
            .served
            .fabric
            .register_published(owner, dtype, initial, version)?;
        Ok(Box::new(Renamed {
            descriptor: self.descriptor(),
            inner,
        }))
    }

    fn register_accumulator(
        &self,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<Box<dyn AccumulatorRegion>, TransportError> {
        self.served
            .register_accumulator(self.descriptor(), owner, len, epoch)
    }

    fn register_inbox(
        &self,
        owner: EndpointId,
        epoch: u64,
    ) -> Result<Box<dyn InboxRegion>, TransportError> {
        self.served.register_inbox(self.descriptor(), owner, epoch)
    }

    async fn read(
        &self,
        handle: &RegionHandle,
        range: Range<usize>,
        into: Dest<'_>,
        deadline: Deadline,
    ) -> Result<u64, TransportError> {
        check_deadline(deadline, handle.owner, handle.id, Op::Read)?;
        let (addr, target) = self.locate(handle)?;
        ops::read(&self.peers, addr, target, handle, range, into, deadline).await
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
        let (addr, target) = self.locate(handle)?;
        ops::accumulate(&self.peers, addr, target, offset, data, tag, deadline).await
    }

    async fn send(
        &self,
        inbox: &RegionHandle,
        tag: WriteTag,
        data: Bytes,
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        check_deadline(deadline, inbox.owner, inbox.id, Op::Send)?;
        let (addr, target) = self.locate(inbox)?;
        ops::send(&self.peers, addr, target, tag, data, deadline).await
    }
}
