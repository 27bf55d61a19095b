//! The reader's side: one authenticated connection per peer address, requests pipelined on it.
//!
//! Each connection has a reader task that takes the responses off the stream in order and hands
//! each to the request waiting for it: a whole response (`Done`, `Failed`), or, for a read, its
//! head and the stream itself positioned at its payload ([`Payload`]), so the payload goes from
//! the socket straight into the caller's destination.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::dial::{BoxRead, BoxWrite, Dial};
use super::payload::{Answer, Payload, Shared, Stream};
use super::{RemoteConfig, Served};
use crate::wire::frame::{write_frame, FrameReader};
use crate::wire::{handshake, ReadOkHead, Request, Response, Target, READ_OK_HEAD};
use crate::{Deadline, EndpointId, Op, RegionId, TransportError};

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
    /// A call of `op` on the region `target`.
    pub(crate) fn at(target: &Target, op: Op) -> Self {
        Self {
            owner: target.owner,
            region: target.region,
            op,
        }
    }

    pub(crate) fn deadline_error(self) -> TransportError {
        TransportError::DeadlineExceeded {
            owner: self.owner,
            region: self.region,
            op: self.op,
        }
    }

    pub(crate) fn unreachable(self, addr: &str, reason: impl std::fmt::Display) -> TransportError {
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

    /// Send the request `make(request id)` to `addr` and wait for its answer, by `deadline`. A
    /// read's payload is the caller's to receive (also by its deadline) or drop.
    pub(crate) async fn call(
        &self,
        addr: &str,
        about: About,
        deadline: Deadline,
        make: impl FnOnce(u64) -> Request,
    ) -> Result<Answer, TransportError> {
        let conn = self.connection(addr, about, deadline).await?;
        let req = conn.next.fetch_add(1, Ordering::Relaxed);
        let request = make(req);
        let (tx, rx) = oneshot::channel();
        if let Err(reason) = conn.shared.expect(req, tx) {
            return Err(about.unreachable(addr, reason));
        }
        let forget = || drop(conn.shared.take(req));
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
        let keys = handshake::dial(&mut reader, &mut write, &self.local.secret, deadline)
            .await
            .map_err(|e| e.to_string())?;
        let config = &self.local.config;
        let (read, write): (BoxRead, BoxWrite) = if config.sealed_frames {
            let (read, write) = keys.seal(reader.into_inner(), write);
            (Box::new(read), Box::new(write))
        } else {
            (reader.into_inner(), write)
        };
        let reader = FrameReader::new(read, config.frame_cap);
        let shared = Arc::new(Shared::default());
        let task = tokio::spawn(read_responses(Stream::new(reader), Arc::clone(&shared)));
        Ok(Connection {
            shared,
            writer: tokio::sync::Mutex::new(write),
            next: AtomicU64::new(0),
            reader: task,
        })
    }
}

/// Read payloads up to this size are received whole into the connection's receive buffer (reused
/// from one answer to the next) and handed over as bytes; larger ones are lent (see
/// [`Payload`]). Lending costs a task switch more, which outweighs a copy of a small payload.
const BUFFER_UP_TO: usize = 256 * 1024;

/// A connection's reader task: hand each response to the request waiting for it (a read's with the
/// stream, until its payload is received); on any failure fail every request in flight. A
/// response nobody waits for (its caller gave up at its deadline) is dropped, payload and all.
async fn read_responses(mut stream: Stream, shared: Arc<Shared>) {
    let bad = |e: &dyn std::fmt::Display| {
        tracing::warn!("odc transport: dropped a connection: bad response: {e}");
        format!("the peer sent a bad response: {e}")
    };
    let reason = loop {
        let head = match stream.frames.next_head(READ_OK_HEAD).await {
            Ok((_, head)) => head,
            Err(e) => break e.to_string(),
        };
        let read = match Response::decode_read_head(head.clone()) {
            Ok(read) => read,
            Err(e) => break bad(&e),
        };
        let Some(ReadOkHead {
            req,
            version,
            dtype,
        }) = read
        else {
            // A response without a payload: small, decoded whole.
            let rest = match stream.frames.rest_of_body().await {
                Ok(rest) => rest,
                Err(e) => break e.to_string(),
            };
            let mut body = bytes::BytesMut::with_capacity(head.len() + rest.len());
            body.extend_from_slice(&head);
            body.extend_from_slice(&rest);
            match Response::decode(body.freeze()) {
                Ok(response) => {
                    let waiter = shared.take(response.req());
                    // No waiter: its caller gave up at its deadline; the late answer is dropped.
                    if let Some(waiter) = waiter {
                        let _ = waiter.send(Ok(Answer::Whole(response)));
                    }
                    continue;
                }
                Err(e) => break bad(&e),
            }
        };
        let Some(waiter) = shared.take(req) else {
            continue; // the next frame's read discards the payload
        };
        let left = stream.frames.body_left();
        if left <= BUFFER_UP_TO || stream.frames.body_buffered() == left {
            // A small payload (or one all here already): hand the bytes over, keep the stream.
            let payload = match stream.frames.rest_of_body().await {
                Ok(bytes) => Payload::Buffered(bytes),
                Err(e) => break e.to_string(),
            };
            let _ = waiter.send(Ok(Answer::Read {
                version,
                dtype,
                payload,
            }));
            continue;
        }
        let (payload, returned) = Payload::lend(stream, Arc::clone(&shared));
        // If the caller is gone, the payload is dropped here or in the channel: either way it
        // comes back.
        let _ = waiter.send(Ok(Answer::Read {
            version,
            dtype,
            payload,
        }));
        match returned.await {
            Ok(returned) => {
                stream = returned.stream;
                if let Some(reason) = returned.broken {
                    break reason;
                }
            }
            Err(_) => break "the stream lent to a read was lost".into(),
        }
    };
    shared.fail(reason);
}
