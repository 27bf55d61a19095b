//! odc's own door to the control plane: every control-plane connection passes the data plane's
//! mutual handshake ([`odc_transport::wire::handshake`]: 32-byte nonces, both bound, a label per
//! direction, the dialer proving first, constant-time compares) before ractor_cluster sees a byte
//! of it; only then is the stream handed to the node server
//! (`NodeServerMessage::ConnectionOpenedExternal`), whose own cookie exchange is a second factor.
//!
//! Guarantees (docs/design.md "Security model"):
//! - before the handshake completes a peer can send at most
//!   [`HANDSHAKE_FRAME_CAP`](odc_transport::wire::handshake::HANDSHAKE_FRAME_CAP) bytes per frame,
//!   has [`HANDSHAKE_TIMEOUT`] to finish, and at most
//!   [`MAX_UNAUTHENTICATED`](odc_transport::wire::gate::MAX_UNAUTHENTICATED) such connections are
//!   open per listener — one more is closed at once and counted in
//!   [`REFUSED_METRIC`](odc_transport::wire::gate::REFUSED_METRIC) (`listener="control"`), the
//!   data plane's [`UnauthenticatedGate`] on this listener too;
//! - a peer that fails costs one log line and changes nothing (it never reaches the node server);
//! - streams that passed are labelled [`VERIFIED`], so the session keeper can tell them from
//!   anything ractor_cluster's own listener accepts (which it closes at once).

use std::time::Duration;

use odc_transport::wire::gate::UnauthenticatedGate;
use odc_transport::wire::handshake::{self, HandshakeError};
use odc_transport::wire::sealed::SessionKeys;
use odc_transport::{ClusterSecret, Deadline};
use ractor::ActorRef;
use ractor_cluster::{BoxRead, BoxWrite, ClusterBidiStream, NodeServerMessage};
use tokio::net::{TcpListener, TcpStream};

/// How long a peer has to complete the handshake (the data plane's longest).
pub const HANDSHAKE_TIMEOUT: Duration = odc_transport::RemoteConfig::MAX_HANDSHAKE_TIMEOUT;
/// Start of the label of every session that came through the handshake.
pub(crate) const VERIFIED: &str = "odc-verified ";

/// A stream whose peer proved the cluster secret; nothing past the handshake was read from it.
/// Its bytes travel sealed under the connection's keys (`odc_transport::wire::sealed`): a
/// control message changed, replayed, reordered or dropped on the path fails the session.
struct Verified {
    stream: TcpStream,
    keys: SessionKeys,
    peer: String,
}

impl ClusterBidiStream for Verified {
    fn split(self: Box<Self>) -> (BoxRead, BoxWrite) {
        let (read, write) = self.stream.into_split();
        let (read, write) = self.keys.seal(read, write);
        (Box::new(read), Box::new(write))
    }

    fn peer_label(&self) -> Option<String> {
        Some(format!("{VERIFIED}{}", self.peer))
    }
}

/// Why dialing the coordinator failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DialError {
    /// No connection (not listening yet, unreachable).
    #[error("cannot connect: {0}")]
    Connect(std::io::Error),
    /// The handshake failed.
    #[error("{0}")]
    Handshake(HandshakeError),
    /// The node server is gone.
    #[error("the node server is gone: {0}")]
    Server(String),
}

/// Connect to the control plane at `addr`, authenticate (this side proves first) and hand the
/// stream to `server` as an outgoing session.
pub(crate) async fn dial(
    server: &ActorRef<NodeServerMessage>,
    addr: &str,
    secret: &ClusterSecret,
    deadline: Deadline,
) -> Result<(), DialError> {
    let stream = tokio::time::timeout_at(deadline.into(), TcpStream::connect(addr))
        .await
        .map_err(|_| {
            DialError::Connect(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "connecting timed out",
            ))
        })?
        .map_err(DialError::Connect)?;
    let _ = stream.set_nodelay(true);
    let (stream, keys) = handshake::authenticate_dialer(stream, secret, deadline)
        .await
        .map_err(DialError::Handshake)?;
    let verified = Verified {
        stream,
        keys,
        peer: addr.to_string(),
    };
    ractor_cluster::client_connect_external(server, Box::new(verified))
        .await
        .map_err(|e| DialError::Server(e.to_string()))
}

/// Accept control-plane connections on `listener` until the task is aborted: each gets the
/// handshake (at most [`MAX_UNAUTHENTICATED`](odc_transport::wire::gate::MAX_UNAUTHENTICATED) at
/// a time), and those that pass go to `server` as incoming sessions.
pub(crate) async fn serve(
    listener: TcpListener,
    server: ActorRef<NodeServerMessage>,
    secret: ClusterSecret,
) {
    let gate = UnauthenticatedGate::new("control");
    let mut handshakes = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => continue,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors or a reset: say so and go on (a moment later).
                tracing::warn!("control plane: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Some(permit) = gate.try_enter() else {
            // Closed at once, counted (and logged now and then) by the gate.
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (server, secret) = (server.clone(), secret.clone());
        handshakes.spawn(async move {
            let deadline = odc_transport::deadline_in(HANDSHAKE_TIMEOUT);
            let verified = handshake::authenticate_listener(stream, &secret, deadline).await;
            drop(permit);
            match verified {
                Ok((stream, keys)) => {
                    let verified = Verified {
                        stream,
                        keys,
                        peer: peer.to_string(),
                    };
                    let opened = NodeServerMessage::ConnectionOpenedExternal {
                        stream: Box::new(verified),
                        is_server: true,
                    };
                    if let Err(e) = server.cast(opened) {
                        tracing::warn!("control plane: the node server is gone: {e}");
                    }
                }
                Err(e) => tracing::warn!("control plane: {peer} was not let in: {e}"),
            }
        });
    }
}
