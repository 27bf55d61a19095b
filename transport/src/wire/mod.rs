//! The peer protocol of the process-crossing backends (`tcp`, and `shm`'s acknowledged path): how
//! a reader asks an owner for a read, an accumulate or an inbox send over a byte stream, and how
//! both sides prove they hold the cluster secret before anything else.
//!
//! Layers, each a file:
//! - [`frame`]: length-prefixed frames (a 4-byte big-endian length, then the body) with a size
//!   cap checked before anything is allocated. Before authentication the cap is
//!   [`handshake::HANDSHAKE_FRAME_CAP`]; after, the connection's configured cap.
//! - [`handshake`]: a mutual challenge–response on the cluster secret (HMAC-SHA256 over both
//!   nonces, a different label per direction), under a deadline, before any other frame. The
//!   dialer proves first; the listener proves only to a dialer that did.
//! - [`sealed`]: after the handshake, on every connection that leaves the host, the stream in
//!   AES-256-GCM records under per-connection, per-direction HKDF-SHA256 keys with counter nonces:
//!   an altered, replayed, reordered or dropped record is refused before a byte of it is read.
//! - [`gate`]: at most [`gate::MAX_UNAUTHENTICATED`] connections per listener in the handshake at
//!   once; more are closed at once and counted.
//! - [`message`]: the requests and responses, a hand-written little-endian layout whose decoder
//!   checks every length against the bytes present. Payloads (read results, gradients, inbox
//!   messages) are slices of the received frame (`Bytes`), never copied by the decoder.
//!
//! Every decoder takes bytes from a peer: it never panics and never allocates more than the frame
//! it was given; a bad frame is a [`WireError`] naming what was wrong, and the connection that sent
//! it is dropped with that reason logged. The fuzz targets in `fuzz/` and the proptest in
//! `tests/wire_decoders.rs` hold the decoders to this.

pub mod frame;
pub mod gate;
pub mod handshake;
pub mod message;
pub mod sealed;

pub use frame::{read_frame, write_frame, FrameReader};
pub use handshake::{ClusterSecret, HandshakeError, SecretError};
pub use message::{
    IpcSource, ReadOkHead, Request, Response, Target, IPC_HANDLE_BYTES, READ_OK_HEAD,
};

/// A frame from a peer that does not decode. Every variant says what was wrong; none carries the
/// peer's bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The body ended before `what` was complete.
    #[error("frame truncated: {what} needs {need} bytes, {have} left")]
    Truncated {
        what: &'static str,
        need: usize,
        have: usize,
    },
    /// A message type byte this protocol version does not know.
    #[error("unknown {what} type {code:#04x}")]
    UnknownType { what: &'static str, code: u8 },
    /// A length prefix above the cap.
    #[error("frame of {len} bytes exceeds the cap of {cap} bytes")]
    Oversized { len: u64, cap: u64 },
    /// Bytes left after a message that has no trailing payload.
    #[error("{extra} unexpected bytes after a {what}")]
    Trailing { what: &'static str, extra: usize },
    /// A field whose value is not allowed (an unknown dtype, a reversed range, ...).
    #[error("bad {field}: {reason}")]
    BadField { field: &'static str, reason: String },
}
