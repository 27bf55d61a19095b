//! The owner's side of accepting: bind a TCP listener and tell peers its address, and accept
//! connections forever, each served in its own task (all aborted with the loop), at most
//! [`MAX_UNAUTHENTICATED`] of them in the handshake at once (`wire::gate`); a connection that is
//! only the peer protocol is served on its two halves ([`serve_split`]).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{tcp, unix, TcpListener, TcpStream, UnixListener, UnixStream};

use super::service::{serve_connection, Accepted};
use crate::wire::gate::{Permit, UnauthenticatedGate, MAX_UNAUTHENTICATED, REFUSED_METRIC};
use crate::TransportError;

/// Listen on `bind` (`host:port`); also the address peers dial: `advertise_host` (or the bound
/// address's host) with the bound port, an IPv6 literal bracketed.
pub(crate) async fn bind_tcp(
    backend: &str,
    bind: &str,
    advertise_host: Option<&str>,
) -> Result<(TcpListener, String), TransportError> {
    let unsupported = |what: String| TransportError::Unsupported { what };
    let listener = TcpListener::bind(bind)
        .await
        .map_err(|e| unsupported(format!("{backend} backend cannot listen on {bind}: {e}")))?;
    let local = listener.local_addr().map_err(|e| {
        unsupported(format!(
            "{backend} backend: no local address for {bind}: {e}"
        ))
    })?;
    let host = advertise_host.map_or_else(|| local.ip().to_string(), str::to_owned);
    let addr = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{}", local.port())
    } else {
        format!("{host}:{}", local.port())
    };
    Ok((listener, addr))
}

/// A listener whose connections an owner serves.
#[async_trait::async_trait]
pub(crate) trait Listen: Send + 'static {
    type Stream: Send + 'static;
    /// The next connection and a name for it in the log.
    async fn accept(&self) -> std::io::Result<(Self::Stream, String)>;
}

#[async_trait::async_trait]
impl Listen for TcpListener {
    type Stream = TcpStream;
    async fn accept(&self) -> std::io::Result<(TcpStream, String)> {
        let (stream, peer) = TcpListener::accept(self).await?;
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, "odc transport: cannot set TCP_NODELAY: {e}");
        }
        Ok((stream, peer.to_string()))
    }
}

#[async_trait::async_trait]
impl Listen for UnixListener {
    type Stream = UnixStream;
    async fn accept(&self) -> std::io::Result<(UnixStream, String)> {
        static PEERS: AtomicU64 = AtomicU64::new(0);
        let (stream, _) = UnixListener::accept(self).await?;
        Ok((
            stream,
            format!("unix peer {}", PEERS.fetch_add(1, Ordering::Relaxed)),
        ))
    }
}

/// An accepted stream as its read and write halves.
pub(crate) trait Split {
    type Read: AsyncRead + Unpin + Send + 'static;
    type Write: AsyncWrite + Unpin + Send + 'static;
    fn split(self) -> (Self::Read, Self::Write);
}

impl Split for TcpStream {
    type Read = tcp::OwnedReadHalf;
    type Write = tcp::OwnedWriteHalf;
    fn split(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

impl Split for UnixStream {
    type Read = unix::OwnedReadHalf;
    type Write = unix::OwnedWriteHalf;
    fn split(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

/// Serve the peer protocol on an accepted `stream` (the serving of `tcp`, `shm`, `cuda`).
pub(crate) fn serve_split<S: Split>(
    stream: S,
    accepted: Accepted,
) -> impl Future<Output = ()> + Send + 'static {
    let (read, write) = stream.split();
    serve_connection(read, write, accepted)
}

/// Accept connections on `listener` until aborted, serving each with `serve` in its own task;
/// dropping (aborting) the loop aborts every connection task. A connection is served only with a
/// place in the handshake (`wire::gate`: at most 64 at once per listener, `serve` drops the
/// permit once the peer is authenticated or refused); one accepted while they are all taken is
/// closed at once and counted under `backend`. A failed accept (out of descriptors, a reset) is
/// logged and the loop goes on.
pub(crate) async fn accept_loop<L, F, Fut>(listener: L, backend: &'static str, serve: F)
where
    L: Listen,
    F: Fn(L::Stream, String, Permit) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let gate = UnauthenticatedGate::new(backend);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => match gate.try_enter() {
                    Some(permit) => {
                        connections.spawn(serve(stream, peer, permit));
                    }
                    None => {
                        drop(stream);
                        // One line per doubling: a storm of connections is not a storm of lines.
                        let refused = gate.refused();
                        if refused.is_power_of_two() {
                            tracing::warn!(
                                %peer,
                                "odc {backend}: closed a connection at once: \
                                 {MAX_UNAUTHENTICATED} are in the handshake already ({refused} \
                                 closed so far, metric {REFUSED_METRIC})"
                            );
                        }
                    }
                },
                Err(e) => {
                    tracing::warn!("odc {backend}: accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}
