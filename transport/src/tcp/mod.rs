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

use tokio::net::TcpStream;

use crate::remote::{
    bind_tcp, other_backend, serve_split, Backend, Located, Remote, RemoteConfig, Served, TcpDial,
};
use crate::wire::{ClusterSecret, Target};
use crate::{Deadline, Descriptor, Dest, Op, RegionHandle, RegionKind, TransportError};

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

/// The TCP backend: the served core ([`Remote`]) with every read served by the owner over its
/// connection. Create it inside a tokio runtime ([`TcpTransport::bind`]); dropping it stops
/// listening and closes every connection it serves.
pub type TcpTransport = Remote<Tcp>;

/// What is the TCP backend's own: the address peers dial.
#[derive(Debug)]
pub struct Tcp {
    addr: String,
}

impl Remote<Tcp> {
    /// Listen at `config.bind` and serve this transport's regions there.
    pub async fn bind(config: TcpConfig) -> Result<Self, TransportError> {
        let (listener, addr) =
            bind_tcp(Tcp::NAME, &config.bind, config.advertise_host.as_deref()).await?;
        Ok(Remote::start(
            listener,
            TcpDial,
            config.remote,
            config.secret,
            Tcp { addr },
            serve_split::<TcpStream>,
        ))
    }

    /// The address peers dial (`host:port`).
    pub fn addr(&self) -> &str {
        &self.backend.addr
    }
}

impl Backend for Tcp {
    /// Nothing: the owner serves every read.
    type Memory = std::convert::Infallible;

    const NAME: &'static str = "tcp";

    fn descriptor(&self, served: &Served) -> Descriptor {
        Descriptor::Tcp {
            addr: self.addr.clone(),
            instance: served.instance,
        }
    }

    fn locate<'h>(
        &self,
        _: &Served,
        handle: &'h RegionHandle,
    ) -> Result<Located<'h, Self::Memory>, TransportError> {
        match &handle.descriptor {
            Descriptor::Tcp { addr, instance } => Ok(Located {
                addr,
                target: Target {
                    owner: handle.owner,
                    instance: *instance,
                    region: handle.id,
                },
                memory: None,
            }),
            _ => Err(other_backend(handle, "tcp", "regions served over tcp")),
        }
    }

    async fn read_memory(
        &self,
        _: &Served,
        _: &RegionHandle,
        _: &Located<'_, Self::Memory>,
        memory: &Self::Memory,
        _: Range<usize>,
        _: Dest<'_>,
        _: Deadline,
    ) -> Result<u64, TransportError> {
        match *memory {}
    }

    async fn wrong_kind(
        &self,
        _: &Served,
        _: &RegionHandle,
        _: &Located<'_, Self::Memory>,
        memory: &Self::Memory,
        _: Op,
        _: RegionKind,
        _: Deadline,
    ) -> TransportError {
        match *memory {}
    }
}
