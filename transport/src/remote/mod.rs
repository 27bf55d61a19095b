//! What the process-crossing backends share above their byte streams: the owner's service (serve
//! a connection's requests against a local fabric) and the reader's connections (dial, handshake,
//! pipelined requests with deadlines). `tcp` runs them over TCP sockets; `shm` over a Unix socket
//! for its acknowledged operations (accumulate, send) while its reads are one-sided; `rdma` keeps
//! its control path here too.
//!
//! Guarantees (contract C2, C3, C6, C7 and I6 across processes):
//! - A peer is served only after the handshake ([`crate::wire::handshake`]); a peer without the
//!   secret never reaches a region. At most 64 connections per listener are in the handshake at
//!   once ([`crate::wire::gate`]), each for at most `handshake_timeout` (≤ 10 s).
//! - An owner serves each connection in its own task, in request order, straight from its fabric
//!   ([`crate::local::LocalTransport`]): a read answers with a slice of the publication (no copy
//!   on the owner), an accumulate is acknowledged only once applied, a send once held.
//! - A frame that does not decode, is over the cap or breaks the protocol closes that connection
//!   with the reason logged (`tracing`); other connections and the owner are unaffected.
//! - A reader's every request carries its deadline: a request that started after it is refused
//!   before anything is sent, and a wait that outlives it is `DeadlineExceeded`. A connection
//!   that fails (the peer vanished, a write was cut off by a deadline) fails every request in
//!   flight on it with [`TransportError::Unreachable`] naming the owner and the reason, and the
//!   next request dials again.
//! - A reader receives a read's payload straight into the caller's destination (`payload`): the
//!   connection's responses are taken in order, and the request a payload answers reads it off
//!   the stream itself. A payload is received only if its length is exactly its part's (else a
//!   protocol violation naming the owner, and the payload is discarded), never past its frame;
//!   a request that gives up mid-payload leaves the rest to be discarded, and the connection goes
//!   on. Frame lengths are checked against the cap before anything is reserved.

mod backend;
mod client;
mod dial;
mod listen;
pub(crate) mod ops;
mod payload;
mod service;

use std::time::Duration;

pub use self::backend::Remote;
pub(crate) use self::backend::{foreign, other_backend, Backend, Located};
pub(crate) use self::client::Peers;
pub(crate) use self::dial::{Dial, TcpDial, UnixDial};
pub(crate) use self::listen::{bind_tcp, serve_split};
#[cfg(feature = "rdma")]
pub(crate) use self::service::{serve_connection, Accepted};
#[cfg_attr(not(feature = "cuda-code"), allow(unused_imports))]
pub(crate) use self::service::{DeviceSources, Served};

/// Knobs of a process-crossing backend's connections.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// Largest frame accepted from an authenticated peer (bytes). A read larger than
    /// `read_part_bytes` travels in parts, so this bounds one part (plus a small head) and the
    /// largest accumulate or message payload.
    pub frame_cap: usize,
    /// Bytes per part of a large read; parts are in flight at once (pipelined).
    pub read_part_bytes: usize,
    /// How long a peer has to complete the handshake (a slow or silent peer is dropped); at most
    /// [`RemoteConfig::MAX_HANDSHAKE_TIMEOUT`] (a longer one is cut to it), so a connection that
    /// never authenticates holds one of its listener's 64 places (`wire::gate`) no longer.
    pub handshake_timeout: Duration,
    /// Messages an inbox holds at most.
    pub inbox_capacity: usize,
    /// Seal every frame after the handshake ([`crate::wire::sealed`]: AES-256-GCM records under
    /// the connection's own keys). On by default; the one-host backends (`shm`, `cuda`) turn it
    /// off for their Unix sockets, and a job may turn it off with `ODC_INSECURE_FRAMES=1`
    /// (logged, and counted in `odc_insecure_frames`). Both ends of a connection must agree: a
    /// sealed end refuses plain frames as forged.
    pub sealed_frames: bool,
}

impl RemoteConfig {
    /// 64 MiB + 4 KiB of head room.
    pub const DEFAULT_FRAME_CAP: usize = (64 << 20) + 4096;
    /// The longest handshake timeout (also the default).
    pub const MAX_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            frame_cap: Self::DEFAULT_FRAME_CAP,
            read_part_bytes: 4 << 20,
            handshake_timeout: Self::MAX_HANDSHAKE_TIMEOUT,
            inbox_capacity: crate::local::LocalTransport::DEFAULT_INBOX_CAPACITY,
            sealed_frames: true,
        }
    }
}

/// A request whose payload exceeds what the peer accepts.
pub(crate) fn too_large(what: &str, bytes: usize, cap: usize) -> crate::TransportError {
    crate::TransportError::Unsupported {
        what: format!(
            "{what} of {bytes} bytes exceeds the frame cap of {cap} bytes; split it into chunks \
             (chunk_elems) or raise frame_cap on every process"
        ),
    }
}

/// An owner's guard whose handles carry another backend's descriptor: the process-crossing
/// backends keep their regions in a [`LocalTransport`](crate::local::LocalTransport) fabric and
/// hand out handles that say how to reach it from elsewhere.
pub(crate) struct Renamed<G: ?Sized> {
    pub(crate) descriptor: crate::Descriptor,
    pub(crate) inner: Box<G>,
}

impl<G: ?Sized> Renamed<G> {
    fn rename(&self, mut handle: crate::RegionHandle) -> crate::RegionHandle {
        handle.descriptor = self.descriptor.clone();
        handle
    }
}

impl crate::PublishedRegion for Renamed<dyn crate::PublishedRegion> {
    fn handle(&self) -> crate::RegionHandle {
        self.rename(self.inner.handle())
    }
    fn publish(&self, version: u64, data: bytes::Bytes) -> Result<(), crate::TransportError> {
        self.inner.publish(version, data)
    }
    fn republish(&self, version: u64) -> Result<(), crate::TransportError> {
        self.inner.republish(version)
    }
    fn version(&self) -> u64 {
        self.inner.version()
    }
}

impl crate::AccumulatorRegion for Renamed<dyn crate::AccumulatorRegion> {
    fn handle(&self) -> crate::RegionHandle {
        self.rename(self.inner.handle())
    }
    fn take(&self, next_epoch: u64) -> Vec<f32> {
        self.inner.take(next_epoch)
    }
    fn take_applied(&self, next_epoch: u64) -> Result<crate::Applied, crate::TransportError> {
        self.inner.take_applied(next_epoch)
    }
    fn progress(&self) -> Option<tokio::sync::watch::Receiver<crate::Progress>> {
        self.inner.progress()
    }
    fn epoch(&self) -> u64 {
        self.inner.epoch()
    }
    fn admit_only(&self, guard: crate::WriteGuard) -> Result<(), crate::TransportError> {
        self.inner.admit_only(guard)
    }
}

#[async_trait::async_trait]
impl crate::InboxRegion for Renamed<dyn crate::InboxRegion> {
    fn handle(&self) -> crate::RegionHandle {
        self.rename(self.inner.handle())
    }
    fn epoch(&self) -> u64 {
        self.inner.epoch()
    }
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }
    fn advance(&self, epoch: u64) {
        self.inner.advance(epoch)
    }
    async fn recv(
        &self,
        tag: crate::WriteTag,
        deadline: crate::Deadline,
    ) -> Result<bytes::Bytes, crate::TransportError> {
        self.inner.recv(tag, deadline).await
    }
}
