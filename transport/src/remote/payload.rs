//! A connection's answers: what its reader task and the requests waiting on it share (the
//! requests in flight, and why the connection failed), what a request gets back ([`Answer`]), and
//! a read's payload, received straight into the reader's destination.
//!
//! A connection's responses arrive in request order on one stream. Its reader task reads each
//! frame's head; for a read's answer (`ReadOk`) with a large payload, it hands the *stream
//! itself* to the request waiting for that answer, as a [`Payload`], and waits until it comes
//! back. The request copies the payload from the socket into its destination (or, to decode it,
//! into a receive buffer kept with the stream and reused), so a large read is neither buffered
//! in a fresh allocation nor copied twice. A small payload (or one already in the reader's
//! buffer) is received into the connection's receive buffer and handed over as those bytes,
//! without lending the stream.
//!
//! Guarantees:
//! - The stream always comes back: a lent [`Payload`] returns it when dropped, whether read,
//!   partly read (its request missed its deadline), never looked at (its request gave up before
//!   the answer arrived, so the payload was dropped in the channel), or broken. The reader task
//!   then discards whatever is left of the frame and goes on with the next one; a stream that
//!   failed under a payload read fails the connection with that reason.
//! - A payload read never takes more than its frame's body ([`FrameReader::read_body`]), and
//!   [`Payload::read_into`] fills a destination only of exactly the payload's length: a peer's
//!   wrong length is the caller's protocol error before a byte is read, never a write outside the
//!   destination or into the next frame.
//! - While a request holds the stream, the connection's other answers wait for it: a read must
//!   be polled to completion or dropped (every one is bounded by its deadline), as any future.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::dial::BoxRead;
use crate::wire::frame::{FrameError, FrameReader};
use crate::wire::Response;
use crate::{codec, Dtype};

/// What a request gets back.
pub(crate) enum Answer {
    /// A response without a payload to receive (`Done`, `Failed`).
    Whole(Response),
    /// A read's answer: its version and dtype, and its payload, next on the stream.
    Read {
        version: u64,
        dtype: Dtype,
        payload: Payload,
    },
}

type Waiter = oneshot::Sender<Result<Answer, String>>;

/// What a connection's reader task and its callers share.
#[derive(Default)]
pub(crate) struct Shared {
    /// Requests in flight, by request id.
    pending: Mutex<HashMap<u64, Waiter>>,
    /// Why the connection failed, once it has.
    dead: Mutex<Option<String>>,
}

impl Shared {
    /// Wait for the answer to request `req` with `waiter`, unless the connection failed (why).
    pub(crate) fn expect(&self, req: u64, waiter: Waiter) -> Result<(), String> {
        let mut pending = self.pending.lock();
        if let Some(reason) = self.dead() {
            return Err(reason);
        }
        pending.insert(req, waiter);
        Ok(())
    }

    /// The waiter of request `req`, no longer in flight (none: its caller gave up).
    pub(crate) fn take(&self, req: u64) -> Option<Waiter> {
        self.pending.lock().remove(&req)
    }

    /// Mark the connection failed (first reason wins) and fail every request in flight.
    pub(crate) fn fail(&self, reason: String) {
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

    /// Why the connection failed, if it has.
    pub(crate) fn dead(&self) -> Option<String> {
        self.dead.lock().clone()
    }
}

/// A connection's read side: its frames, and the buffer payloads that need decoding are received
/// into (kept, so its pages are not faulted in again for every read).
pub(crate) struct Stream {
    pub(crate) frames: FrameReader<BoxRead>,
    scratch: Vec<u8>,
}

impl Stream {
    pub(crate) fn new(frames: FrameReader<BoxRead>) -> Self {
        Self {
            frames,
            scratch: Vec::new(),
        }
    }
}

/// What a lent [`Payload`] gives back to the reader task.
pub(crate) struct Returned {
    pub(crate) stream: Stream,
    /// Why the stream is unusable, if a payload read failed.
    pub(crate) broken: Option<String>,
}

/// A read's payload: the rest of the current frame's body, for the request it answers.
pub(crate) enum Payload {
    /// Already received (it was all in the reader's buffer).
    Buffered(Bytes),
    /// On the connection's stream, lent until dropped.
    Lent(Lent),
}

/// The stream, positioned at a payload, and where it goes back to.
pub(crate) struct Lent {
    stream: Option<Stream>,
    back: Option<oneshot::Sender<Returned>>,
    broken: Option<String>,
    /// The connection, failed at once if the stream breaks (so the next request dials again
    /// rather than writing to it before the reader task has its stream back).
    connection: Arc<Shared>,
}

impl Payload {
    /// Lend `stream` of `connection`, positioned inside a frame whose remaining body is the
    /// payload; the receiver gets it back when the payload is dropped.
    pub(crate) fn lend(
        stream: Stream,
        connection: Arc<Shared>,
    ) -> (Self, oneshot::Receiver<Returned>) {
        let (back, returned) = oneshot::channel();
        let lent = Lent {
            stream: Some(stream),
            back: Some(back),
            broken: None,
            connection,
        };
        (Payload::Lent(lent), returned)
    }

    /// Bytes of the payload not received yet.
    pub(crate) fn len(&self) -> usize {
        match self {
            Payload::Buffered(bytes) => bytes.len(),
            Payload::Lent(lent) => lent
                .stream
                .as_ref()
                .map_or(0, |stream| stream.frames.body_left()),
        }
    }

    /// Receive the whole payload into `out`, which must be exactly [`Payload::len`] bytes (else an
    /// error, and nothing is read). An error is the stream failing (the connection is then
    /// failed with it). Cancel safe: what is not received is discarded by the reader task.
    pub(crate) async fn read_into(&mut self, out: &mut [u8]) -> Result<(), String> {
        let left = self.len();
        check_fits(left, out.len())?;
        match self {
            Payload::Buffered(bytes) => {
                out.copy_from_slice(&bytes.split_to(left));
                Ok(())
            }
            Payload::Lent(lent) => {
                let stream = lent.usable()?;
                let result = receive(&mut stream.frames, out).await;
                lent.settle(result, left)
            }
        }
    }

    /// Receive the whole payload, little-endian `dtype` elements, and decode it into `out`, which
    /// must hold exactly as many elements (else an error, and nothing is read). A lent payload
    /// goes through the connection's receive buffer. Cancel safe, as [`Payload::read_into`].
    pub(crate) async fn decode_into(
        &mut self,
        dtype: Dtype,
        out: &mut [f32],
    ) -> Result<(), String> {
        let left = self.len();
        check_fits(left, out.len().saturating_mul(dtype.size()))?;
        match self {
            Payload::Buffered(bytes) => {
                codec::decode_into(dtype, &bytes.split_to(left), out).map_err(|e| e.to_string())
            }
            Payload::Lent(lent) => {
                let Stream { frames, scratch } = lent.usable()?;
                if scratch.len() < left {
                    scratch.resize(left, 0);
                }
                let result = receive(frames, &mut scratch[..left]).await;
                lent.settle(result, left)?;
                let stream = lent.usable()?;
                codec::decode_into(dtype, &stream.scratch[..left], out).map_err(|e| e.to_string())
            }
        }
    }
}

fn check_fits(payload: usize, destination: usize) -> Result<(), String> {
    if payload == destination {
        Ok(())
    } else {
        Err(format!(
            "a payload of {payload} bytes does not fit a destination of {destination} bytes"
        ))
    }
}

impl Lent {
    /// The stream, unless a receive broke it.
    fn usable(&mut self) -> Result<&mut Stream, String> {
        if let Some(reason) = &self.broken {
            return Err(reason.clone());
        }
        self.stream
            .as_mut()
            .ok_or_else(|| "the payload's stream was already given back".into())
    }

    /// Note a failed receive as a broken stream, and fail the connection.
    fn settle(&mut self, result: Result<(), FrameError>, bytes: usize) -> Result<(), String> {
        result.map_err(|e| {
            let reason = format!("receiving a payload of {bytes} bytes: {e}");
            self.connection.fail(reason.clone());
            self.broken = Some(reason.clone());
            reason
        })
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let (Some(stream), Some(back)) = (self.stream.take(), self.back.take()) {
            // The reader task may be gone (the connection was killed); the stream goes with it.
            let _ = back.send(Returned {
                stream,
                broken: self.broken.take(),
            });
        }
    }
}

/// Fill `out` from the current frame's body.
async fn receive(frames: &mut FrameReader<BoxRead>, mut out: &mut [u8]) -> Result<(), FrameError> {
    while !out.is_empty() {
        let taken = frames.read_body(out).await?;
        if taken == 0 {
            // The caller checked that the body holds `out`; a reader never hands out 0 otherwise.
            return Err(FrameError::Io(std::io::Error::other(
                "the frame's body ended before the payload",
            )));
        }
        out = &mut out[taken..];
    }
    Ok(())
}
