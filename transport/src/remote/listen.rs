//! The owner's side of accepting: bind a TCP listener and tell peers its address, and accept
//! connections forever, each served in its own task (all aborted with the loop).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

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

/// Accept connections on `listener` until aborted, serving each with `serve` in its own task;
/// dropping (aborting) the loop aborts every connection task. A failed accept (out of
/// descriptors, a reset) is logged and the loop goes on.
pub(crate) async fn accept_loop<L, F, Fut>(listener: L, serve: F)
where
    L: Listen,
    F: Fn(L::Stream, String) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    connections.spawn(serve(stream, peer));
                }
                Err(e) => {
                    tracing::warn!("odc transport: accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}
