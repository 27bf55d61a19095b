//! How control-plane messages cross a process boundary: every payload and reply is encoded with
//! `postcard` (compact, exact `f64` round trips, so losses and norms are bit-identical on both
//! sides); a call's reply port is bridged to ractor_cluster's binary port by a task bounded by the
//! port's own timeout (I6).
//!
//! Bad bytes from a peer are an error value, never a panic: the message is dropped, and the drop
//! is logged once with the message kind and what was wrong (ractor_cluster logs that it could not
//! deliver it). A reply that cannot be decoded leaves the caller's port unanswered, which the
//! caller sees as a dropped reply (`CallResult::SenderError`), not a hang.

use ractor::concurrency::Duration;
use ractor::message::{BoxedDowncastErr, SerializedMessage};
use ractor::RpcReplyPort;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// `value`'s bytes.
pub fn encode<T: Serialize>(what: &str, value: &T) -> Result<Vec<u8>, BoxedDowncastErr> {
    postcard::to_stdvec(value).map_err(|e| {
        tracing::error!("control plane: cannot encode {what}: {e}");
        BoxedDowncastErr
    })
}

/// The value in `bytes`; every byte must be used.
pub fn decode<T: DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, BoxedDowncastErr> {
    match postcard::take_from_bytes::<T>(bytes) {
        Ok((value, [])) => Ok(value),
        Ok((_, rest)) => {
            tracing::warn!(
                "control plane: dropped {what} from a peer: {} bytes left over after the payload",
                rest.len()
            );
            Err(BoxedDowncastErr)
        }
        Err(e) => {
            tracing::warn!(
                "control plane: dropped {what} from a peer: {e} ({} bytes)",
                bytes.len()
            );
            Err(BoxedDowncastErr)
        }
    }
}

/// A one-way message `variant` with `args`.
pub fn cast<T: Serialize>(variant: &str, args: &T) -> Result<SerializedMessage, BoxedDowncastErr> {
    Ok(SerializedMessage::Cast {
        variant: variant.into(),
        args: encode(variant, args)?,
        metadata: None,
    })
}

/// A call `variant` with `args`, answered on `reply` (the answer bytes are decoded on the way
/// back; the bridge lives at most as long as `reply`'s timeout).
pub fn call<T: Serialize, R: DeserializeOwned + Send + 'static>(
    variant: &'static str,
    args: &T,
    reply: RpcReplyPort<R>,
) -> Result<SerializedMessage, BoxedDowncastErr> {
    let args = encode(variant, args)?;
    let timeout = reply.get_timeout();
    let (tx, rx) = ractor::concurrency::oneshot::<Vec<u8>>();
    ractor::concurrency::spawn(async move {
        let answer = match timeout {
            Some(t) => ractor::concurrency::timeout(t, rx).await.ok(),
            None => Some(rx.await),
        };
        if let Some(Ok(bytes)) = answer {
            if let Ok(value) = decode::<R>(&format!("the reply to {variant}"), &bytes) {
                let _ = reply.send(value);
            }
        }
    });
    Ok(SerializedMessage::Call {
        variant: variant.into(),
        args,
        reply: port(tx, timeout),
        metadata: None,
    })
}

/// A message from a peer: its variant, argument bytes and (for a call) the binary reply port.
pub type Parts = (String, Vec<u8>, Option<RpcReplyPort<Vec<u8>>>);

/// The [`Parts`] of a message from a peer.
pub fn split(message: SerializedMessage) -> Result<Parts, BoxedDowncastErr> {
    match message {
        SerializedMessage::Cast { variant, args, .. } => Ok((variant, args, None)),
        SerializedMessage::Call {
            variant,
            args,
            reply,
            ..
        } => Ok((variant, args, Some(reply))),
        SerializedMessage::CallReply(..) => Err(BoxedDowncastErr),
    }
}

/// A typed reply port whose answer is encoded onto the peer's binary `reply`.
pub fn reply_port<R: Serialize + Send + 'static>(
    variant: &'static str,
    reply: RpcReplyPort<Vec<u8>>,
) -> RpcReplyPort<R> {
    let timeout = reply.get_timeout();
    let (tx, rx) = ractor::concurrency::oneshot::<R>();
    ractor::concurrency::spawn(async move {
        let answer = match timeout {
            Some(t) => ractor::concurrency::timeout(t, rx).await.ok(),
            None => Some(rx.await),
        };
        if let Some(Ok(value)) = answer {
            if let Ok(bytes) = encode(&format!("the reply to {variant}"), &value) {
                let _ = reply.send(bytes);
            }
        }
    });
    port(tx, timeout)
}

/// An unknown variant, or a call sent as a cast (or the reverse): dropped with a log line.
pub fn unknown<T>(message: &str, variant: &str, call: bool) -> Result<T, BoxedDowncastErr> {
    let kind = if call { "call" } else { "cast" };
    tracing::warn!("control plane: dropped an unknown {message} {kind} {variant:?} from a peer");
    Err(BoxedDowncastErr)
}

fn port<T>(
    tx: ractor::concurrency::OneshotSender<T>,
    timeout: Option<Duration>,
) -> RpcReplyPort<T> {
    match timeout {
        Some(t) => RpcReplyPort::from((tx, t)),
        None => RpcReplyPort::from(tx),
    }
}
