//! The reader's side: one authenticated connection per peer address, requests pipelined on it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::oneshot;

use super::{RemoteConfig, Served};
use crate::wire::frame::{write_frame, FrameReader};
use crate::wire::handshake;
use crate::wire::{Request, Response};
use crate::{Deadline, EndpointId, Op, RegionId, TransportError};

pub(crate) type BoxRead = Box<dyn AsyncRead + Send + Unpin>;
pub(crate) type BoxWrite = Box<dyn AsyncWrite + Send + Unpin>;

/// Opens a byte stream to a peer address (a TCP `host:port`, a Unix socket path).
#[async_trait::async_trait]
pub(crate) trait Dial: Send + Sync + 'static {
    async fn dial(&self, addr: &str) -> std::io::Result<(BoxRead, BoxWrite)>;
}

type Waiter = oneshot::Sender<Result<Response, String>>;

/// What a connection's reader task and its callers share.
#[derive(Default)]
struct Shared {
    /// Requests in flight, by request id.
    pending: Mutex<HashMap<u64, Waiter>>,
    /// Why the connection failed, once it has.
    dead: Mutex<Option<String>>,
}

impl Shared {
    /// Mark the connection failed (first reason wins) and fail every request in flight.
    fn fail(&self, reason: String) {
        let reason = {
            let mut dead = self.dead.lock();
            dead.get_or_insert(reason).clone()
        };
        let waiters: Vec<Waiter> = self.pending.lock().drain().map(|(_, w)| w).collect();
        for waiter in waiters {
            // The caller may have given up already.
            let _ = waiter.send(Err(reason.clone()));
        }
    }

    fn dead(&self) -> Option<String> {
        self.dead.lock().clone()
    }
}

struct Connection {
    shared: Arc<Shared>,
    writer: tokio::sync::Mutex<BoxWrite>,
    next: AtomicU64,
    reader: tokio::task::JoinHandle<()>,
}

impl Connection {
    fn kill(&self, reason: String) {
        self.reader.abort();
        self.shared.fail(reason);
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

type Slot = Arc<tokio::sync::Mutex<Option<Arc<Connection>>>>;

/// A reader's connections to its peers, dialled on first use and again after a failure. It knows
/// its own transport's [`Served`] fabric (secret, knobs, and the regions a request for its own
/// instance reaches without a socket).
pub(crate) struct Peers {
    dialer: Box<dyn Dial>,
    local: Arc<Served>,
    slots: Mutex<HashMap<String, Slot>>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("peers", &self.slots.lock().len())
            .finish()
    }
}

/// Where an error of a call is about.
#[derive(Debug, Clone, Copy)]
pub(crate) struct About {
    pub(crate) owner: EndpointId,
    pub(crate) region: RegionId,
    pub(crate) op: Op,
}

impl About {
    pub(crate) fn deadline_error(self) -> TransportError {
        TransportError::DeadlineExceeded {
            owner: self.owner,
            region: self.region,
            op: self.op,
        }
    }

    fn unreachable(self, addr: &str, reason: impl std::fmt::Display) -> TransportError {
        TransportError::Unreachable {
            owner: self.owner,
            reason: format!("{addr}: {reason}"),
        }
    }
}

impl Peers {
    pub(crate) fn new(dialer: Box<dyn Dial>, local: Arc<Served>) -> Self {
        Self {
            dialer,
            local,
            slots: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn config(&self) -> &RemoteConfig {
        &self.local.config
    }

    /// The regions of this reader's own transport.
    pub(crate) fn local(&self) -> &Served {
        &self.local
    }

    /// Send the request `make(request id)` to `addr` and wait for its answer, by `deadline`.
    pub(crate) async fn call(
        &self,
        addr: &str,
        about: About,
        deadline: Deadline,
        make: impl FnOnce(u64) -> Request,
    ) -> Result<Response, TransportError> {
        let conn = self.connection(addr, about, deadline).await?;
        let req = conn.next.fetch_add(1, Ordering::Relaxed);
        let request = make(req);
        let (tx, rx) = oneshot::channel();
        {
            let mut pending = conn.shared.pending.lock();
            if let Some(reason) = conn.shared.dead() {
                return Err(about.unreachable(addr, reason));
            }
            pending.insert(req, tx);
        }
        let forget = || {
            conn.shared.pending.lock().remove(&req);
        };
        let (head, payload) = request.encode();
        let Ok(mut writer) = tokio::time::timeout_at(deadline.into(), conn.writer.lock()).await
        else {
            forget();
            return Err(about.deadline_error());
        };
        match tokio::time::timeout_at(deadline.into(), write_frame(&mut *writer, &head, &payload))
            .await
        {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                conn.kill(format!("write failed: {e}"));
                return Err(about.unreachable(addr, format!("write failed: {e}")));
            }
            Err(_) => {
                // A frame cut off midway leaves the stream unusable.
                conn.kill("a request write was cut off by its deadline".into());
                return Err(about.deadline_error());
            }
        }
        drop(writer);
        match tokio::time::timeout_at(deadline.into(), rx).await {
            Ok(Ok(Ok(response))) => Ok(response),
            Ok(Ok(Err(reason))) => Err(about.unreachable(addr, reason)),
            Ok(Err(_)) => Err(about.unreachable(
                addr,
                conn.shared
                    .dead()
                    .unwrap_or_else(|| "the connection closed".into()),
            )),
            Err(_) => {
                forget();
                Err(about.deadline_error())
            }
        }
    }

    /// The live connection to `addr`, dialled (and authenticated) if there is none.
    async fn connection(
        &self,
        addr: &str,
        about: About,
        deadline: Deadline,
    ) -> Result<Arc<Connection>, TransportError> {
        let slot = self
            .slots
            .lock()
            .entry(addr.to_owned())
            .or_default()
            .clone();
        let Ok(mut slot) = tokio::time::timeout_at(deadline.into(), slot.lock()).await else {
            return Err(about.deadline_error());
        };
        if let Some(conn) = slot.as_ref() {
            if conn.shared.dead().is_none() {
                return Ok(Arc::clone(conn));
            }
        }
        *slot = None;
        let conn = match tokio::time::timeout_at(deadline.into(), self.open(addr, deadline)).await {
            Ok(Ok(conn)) => Arc::new(conn),
            Ok(Err(reason)) => return Err(about.unreachable(addr, reason)),
            Err(_) => return Err(about.deadline_error()),
        };
        *slot = Some(Arc::clone(&conn));
        Ok(conn)
    }

    async fn open(&self, addr: &str, deadline: Deadline) -> Result<Connection, String> {
        let (read, mut write) = self
            .dialer
            .dial(addr)
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        let mut reader = FrameReader::new(read, handshake::HANDSHAKE_FRAME_CAP);
        handshake::dial(&mut reader, &mut write, &self.local.secret, deadline)
            .await
            .map_err(|e| e.to_string())?;
        reader.set_cap(self.local.config.frame_cap);
        let shared = Arc::new(Shared::default());
        let task = tokio::spawn(read_responses(reader, Arc::clone(&shared)));
        Ok(Connection {
            shared,
            writer: tokio::sync::Mutex::new(write),
            next: AtomicU64::new(0),
            reader: task,
        })
    }
}

/// A connection's reader task: hand each response to the request waiting for it; on any failure
/// fail every request in flight.
async fn read_responses(mut reader: FrameReader<BoxRead>, shared: Arc<Shared>) {
    let reason = loop {
        let body = match reader.next().await {
            Ok(body) => body,
            Err(e) => break e.to_string(),
        };
        match Response::decode(body) {
            Ok(response) => {
                let waiter = shared.pending.lock().remove(&response.req());
                // No waiter: its caller gave up at its deadline; the late answer is dropped.
                if let Some(waiter) = waiter {
                    let _ = waiter.send(Ok(response));
                }
            }
            Err(e) => {
                tracing::warn!("odc transport: dropped a connection: bad response: {e}");
                break format!("the peer sent a bad response: {e}");
            }
        }
    };
    shared.fail(reason);
}
