//! Mutual challenge–response on the cluster secret, before any other frame.
//!
//! ```text
//! dialer → listener  Hello     { magic "ODC\x01", protocol u16, nonce_d [32] }
//! listener → dialer  Challenge { nonce_l [32], HMAC(secret, "odc/listener" ‖ nonce_d ‖ nonce_l) }
//! dialer → listener  Proof     { HMAC(secret, "odc/dialer" ‖ nonce_l ‖ nonce_d) }
//! listener → dialer  Welcome   (or Refused { reason } and the connection is closed)
//! ```
//!
//! Each side proves it holds the secret over a nonce the other chose, with a label per direction
//! so a proof cannot be reflected back. The secret never crosses the wire. Until `Welcome`, frames
//! are capped at [`HANDSHAKE_FRAME_CAP`] bytes and the whole exchange runs under a deadline, so a
//! peer that sends garbage, sends nothing (slow loris) or proves nothing costs a few hundred bytes
//! and at most the deadline, and never reaches a region. MACs are compared in constant time
//! (`hmac`'s `verify_slice`).

use std::fmt;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncWrite};

use super::frame::{write_frame, FrameError, FrameReader};
use super::message::Cursor;
use super::WireError;
use crate::Deadline;

/// Largest frame accepted before the handshake completes.
pub const HANDSHAKE_FRAME_CAP: usize = 256;
/// Start of every `Hello`.
pub const MAGIC: [u8; 4] = *b"ODC\x01";
/// Version of the peer protocol (handshake and messages).
pub const PROTOCOL: u16 = 1;

const HELLO: u8 = 0x10;
const CHALLENGE: u8 = 0x11;
const PROOF: u8 = 0x12;
const WELCOME: u8 = 0x13;
const REFUSED: u8 = 0x14;
const NONCE: usize = 32;
const MAC: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// The secret every process of one job shares (`ODC_SECRET`); it authenticates peers. Its `Debug`
/// never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Arc<[u8]>);

impl ClusterSecret {
    /// A secret of these bytes; an empty one is refused (it would authenticate anyone).
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<Self, String> {
        let bytes = bytes.as_ref();
        if bytes.is_empty() {
            return Err("the cluster secret is empty".into());
        }
        Ok(Self(Arc::from(bytes)))
    }

    /// A fresh random secret (for a job whose processes this process starts itself).
    pub fn random() -> Self {
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Self(Arc::from(hex.as_bytes()))
    }

    /// The secret as text, to hand to a child process (`ODC_SECRET`).
    pub fn expose(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    fn mac(&self, label: &[u8], first: &[u8; NONCE], second: &[u8; NONCE]) -> HmacSha256 {
        // HMAC takes keys of any length.
        let mut mac = match HmacSha256::new_from_slice(&self.0) {
            Ok(mac) => mac,
            Err(_) => unreachable!("HMAC accepts any key length"),
        };
        mac.update(label);
        mac.update(first);
        mac.update(second);
        mac
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClusterSecret(<{} bytes>)", self.0.len())
    }
}

/// Why a handshake failed. The connection is closed after any of them.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("handshake did not complete by its deadline (waiting for {waiting_for})")]
    Timeout { waiting_for: &'static str },
    #[error("handshake: {0}")]
    Frame(#[from] FrameError),
    #[error("handshake: {0}")]
    Wire(#[from] WireError),
    #[error("handshake: peer speaks protocol {theirs}, this process {ours}")]
    Version { ours: u16, theirs: u16 },
    #[error("handshake: not an odc peer (bad magic {0:02x?})")]
    BadMagic([u8; 4]),
    #[error("handshake: the peer did not prove the cluster secret ({0})")]
    WrongSecret(&'static str),
    #[error("handshake refused by the peer: {0}")]
    Refused(String),
    #[error("handshake: expected {expected}, got a {got} frame")]
    Unexpected {
        expected: &'static str,
        got: &'static str,
    },
}

/// One handshake frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeFrame {
    Hello {
        magic: [u8; 4],
        protocol: u16,
        nonce: [u8; NONCE],
    },
    Challenge {
        nonce: [u8; NONCE],
        mac: [u8; MAC],
    },
    Proof {
        mac: [u8; MAC],
    },
    Welcome,
    Refused {
        reason: String,
    },
}

impl HandshakeFrame {
    fn name(&self) -> &'static str {
        match self {
            HandshakeFrame::Hello { .. } => "Hello",
            HandshakeFrame::Challenge { .. } => "Challenge",
            HandshakeFrame::Proof { .. } => "Proof",
            HandshakeFrame::Welcome => "Welcome",
            HandshakeFrame::Refused { .. } => "Refused",
        }
    }

    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(80);
        match self {
            HandshakeFrame::Hello {
                magic,
                protocol,
                nonce,
            } => {
                out.put_u8(HELLO);
                out.put_slice(magic);
                out.put_u16_le(*protocol);
                out.put_slice(nonce);
            }
            HandshakeFrame::Challenge { nonce, mac } => {
                out.put_u8(CHALLENGE);
                out.put_slice(nonce);
                out.put_slice(mac);
            }
            HandshakeFrame::Proof { mac } => {
                out.put_u8(PROOF);
                out.put_slice(mac);
            }
            HandshakeFrame::Welcome => out.put_u8(WELCOME),
            HandshakeFrame::Refused { reason } => {
                out.put_u8(REFUSED);
                // Fits the handshake cap whatever the reason, cut at a character boundary so
                // the peer reads a prefix of it (not a broken last character).
                let mut end = reason.len().min(HANDSHAKE_FRAME_CAP - 1);
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                out.put_slice(&reason.as_bytes()[..end]);
            }
        }
        out.freeze()
    }

    /// Decode one frame body from a peer.
    pub fn decode(body: Bytes) -> Result<Self, WireError> {
        let mut cur = Cursor::new(body);
        let frame = match cur.u8("handshake type")? {
            HELLO => HandshakeFrame::Hello {
                magic: cur.array("magic")?,
                protocol: cur.u16("protocol")?,
                nonce: cur.array("nonce")?,
            },
            CHALLENGE => HandshakeFrame::Challenge {
                nonce: cur.array("nonce")?,
                mac: cur.array("mac")?,
            },
            PROOF => HandshakeFrame::Proof {
                mac: cur.array("mac")?,
            },
            WELCOME => HandshakeFrame::Welcome,
            REFUSED => {
                return Ok(HandshakeFrame::Refused {
                    reason: String::from_utf8_lossy(&cur.rest()).into_owned(),
                })
            }
            code => {
                return Err(WireError::UnknownType {
                    what: "handshake",
                    code,
                })
            }
        };
        cur.finish(frame.name())?;
        Ok(frame)
    }
}

fn nonce() -> [u8; NONCE] {
    let mut nonce = [0u8; NONCE];
    rand::rng().fill_bytes(&mut nonce);
    nonce
}

async fn send<W: AsyncWrite + Unpin>(
    out: &mut W,
    frame: HandshakeFrame,
) -> Result<(), HandshakeError> {
    write_frame(out, &frame.encode(), &[])
        .await
        .map_err(|e| HandshakeError::Frame(FrameError::Io(e)))
}

async fn receive<R: AsyncRead + Unpin>(
    reader: &mut FrameReader<R>,
    deadline: Deadline,
    waiting_for: &'static str,
) -> Result<HandshakeFrame, HandshakeError> {
    let body = tokio::time::timeout_at(deadline.into(), reader.next())
        .await
        .map_err(|_| HandshakeError::Timeout { waiting_for })??;
    Ok(HandshakeFrame::decode(body)?)
}

/// The dialer's side. `reader`'s cap is the handshake cap until this returns `Ok`; the caller
/// then raises it.
pub async fn dial<R, W>(
    reader: &mut FrameReader<R>,
    writer: &mut W,
    secret: &ClusterSecret,
    deadline: Deadline,
) -> Result<(), HandshakeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    reader.set_cap(HANDSHAKE_FRAME_CAP);
    let mine = nonce();
    send(
        writer,
        HandshakeFrame::Hello {
            magic: MAGIC,
            protocol: PROTOCOL,
            nonce: mine,
        },
    )
    .await?;
    let theirs = match receive(reader, deadline, "Challenge").await? {
        HandshakeFrame::Challenge { nonce, mac } => {
            secret
                .mac(b"odc/listener", &mine, &nonce)
                .verify_slice(&mac)
                .map_err(|_| HandshakeError::WrongSecret("its challenge MAC does not match"))?;
            nonce
        }
        HandshakeFrame::Refused { reason } => return Err(HandshakeError::Refused(reason)),
        other => {
            return Err(HandshakeError::Unexpected {
                expected: "Challenge",
                got: other.name(),
            })
        }
    };
    let mac = secret
        .mac(b"odc/dialer", &theirs, &mine)
        .finalize()
        .into_bytes();
    send(writer, HandshakeFrame::Proof { mac: mac.into() }).await?;
    match receive(reader, deadline, "Welcome").await? {
        HandshakeFrame::Welcome => Ok(()),
        HandshakeFrame::Refused { reason } => Err(HandshakeError::Refused(reason)),
        other => Err(HandshakeError::Unexpected {
            expected: "Welcome",
            got: other.name(),
        }),
    }
}

/// The listener's side; on failure it tells the dialer why (when it can) before the caller closes
/// the connection.
pub async fn accept<R, W>(
    reader: &mut FrameReader<R>,
    writer: &mut W,
    secret: &ClusterSecret,
    deadline: Deadline,
) -> Result<(), HandshakeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    reader.set_cap(HANDSHAKE_FRAME_CAP);
    let result = accept_inner(reader, writer, secret, deadline).await;
    if let Err(e) = &result {
        let reason = match e {
            HandshakeError::Version { .. } | HandshakeError::WrongSecret(_) => e.to_string(),
            _ => String::new(),
        };
        if !reason.is_empty() {
            // Best effort: the connection is closed either way.
            let _ = tokio::time::timeout_at(
                deadline.into(),
                send(writer, HandshakeFrame::Refused { reason }),
            )
            .await;
        }
    }
    result
}

async fn accept_inner<R, W>(
    reader: &mut FrameReader<R>,
    writer: &mut W,
    secret: &ClusterSecret,
    deadline: Deadline,
) -> Result<(), HandshakeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let theirs = match receive(reader, deadline, "Hello").await? {
        HandshakeFrame::Hello {
            magic,
            protocol,
            nonce,
        } => {
            if magic != MAGIC {
                return Err(HandshakeError::BadMagic(magic));
            }
            if protocol != PROTOCOL {
                return Err(HandshakeError::Version {
                    ours: PROTOCOL,
                    theirs: protocol,
                });
            }
            nonce
        }
        other => {
            return Err(HandshakeError::Unexpected {
                expected: "Hello",
                got: other.name(),
            })
        }
    };
    let mine = nonce();
    let mac = secret
        .mac(b"odc/listener", &theirs, &mine)
        .finalize()
        .into_bytes();
    send(
        writer,
        HandshakeFrame::Challenge {
            nonce: mine,
            mac: mac.into(),
        },
    )
    .await?;
    match receive(reader, deadline, "Proof").await? {
        HandshakeFrame::Proof { mac } => {
            secret
                .mac(b"odc/dialer", &mine, &theirs)
                .verify_slice(&mac)
                .map_err(|_| HandshakeError::WrongSecret("its proof MAC does not match"))?;
        }
        other => {
            return Err(HandshakeError::Unexpected {
                expected: "Proof",
                got: other.name(),
            })
        }
    }
    send(writer, HandshakeFrame::Welcome).await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(future)
    }

    async fn pair(
        dialer_secret: &str,
        listener_secret: &str,
    ) -> (Result<(), HandshakeError>, Result<(), HandshakeError>) {
        let (a, b) = tokio::io::duplex(4096);
        let (ar, mut aw) = tokio::io::split(a);
        let (br, mut bw) = tokio::io::split(b);
        let deadline = crate::deadline_in(Duration::from_secs(5));
        let (ds, ls) = (
            ClusterSecret::new(dialer_secret).expect("secret"),
            ClusterSecret::new(listener_secret).expect("secret"),
        );
        let dialer = async move {
            let mut reader = FrameReader::new(ar, 0);
            dial(&mut reader, &mut aw, &ds, deadline).await
        };
        let listener = async move {
            let mut reader = FrameReader::new(br, 0);
            accept(&mut reader, &mut bw, &ls, deadline).await
        };
        tokio::join!(dialer, listener)
    }

    #[test]
    fn same_secret_is_welcomed() {
        let (dialer, listener) = block_on(pair("s3cret", "s3cret"));
        assert!(dialer.is_ok(), "{dialer:?}");
        assert!(listener.is_ok(), "{listener:?}");
    }

    #[test]
    fn wrong_secret_fails_on_both_sides() {
        let (dialer, listener) = block_on(pair("wrong", "s3cret"));
        assert!(
            matches!(dialer, Err(HandshakeError::WrongSecret(_))),
            "the dialer sees the listener cannot prove its secret: {dialer:?}"
        );
        assert!(
            listener.is_err(),
            "the listener never welcomes the dialer: {listener:?}"
        );
    }

    #[test]
    fn silent_peer_times_out() {
        block_on(async {
            let (_a, b) = tokio::io::duplex(4096);
            let (br, mut bw) = tokio::io::split(b);
            let mut reader = FrameReader::new(br, 0);
            let secret = ClusterSecret::new("x").expect("secret");
            let deadline = crate::deadline_in(Duration::from_millis(50));
            let result = accept(&mut reader, &mut bw, &secret, deadline).await;
            assert!(
                matches!(
                    result,
                    Err(HandshakeError::Timeout {
                        waiting_for: "Hello"
                    })
                ),
                "{result:?}"
            );
        });
    }

    #[test]
    fn garbage_before_the_handshake_is_refused_within_the_cap() {
        block_on(async {
            let (mut a, b) = tokio::io::duplex(4096);
            let (br, mut bw) = tokio::io::split(b);
            tokio::io::AsyncWriteExt::write_all(&mut a, b"GET / HTTP/1.1\r\n\r\n")
                .await
                .expect("write");
            let mut reader = FrameReader::new(br, 0);
            let secret = ClusterSecret::new("x").expect("secret");
            let deadline = crate::deadline_in(Duration::from_secs(5));
            let result = accept(&mut reader, &mut bw, &secret, deadline).await;
            assert!(
                matches!(
                    result,
                    Err(HandshakeError::Frame(FrameError::Wire(
                        WireError::Oversized { .. }
                    )))
                ),
                "{result:?}"
            );
        });
    }

    #[test]
    fn empty_secret_is_refused_and_debug_hides_it() {
        assert!(ClusterSecret::new("").is_err());
        let secret = ClusterSecret::new("hunter2").expect("secret");
        assert!(!format!("{secret:?}").contains("hunter2"));
        assert_ne!(ClusterSecret::random(), ClusterSecret::random());
    }
}
