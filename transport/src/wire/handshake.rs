//! Challenge–response on the cluster secret, before any other frame. The dialer proves first; the
//! listener proves only to a dialer that did.
//!
//! ```text
//! dialer → listener  Hello     { magic "ODC\x01", protocol u16, nonce_d [32] }
//! listener → dialer  Challenge { nonce_l [32] }                                 (no MAC)
//! dialer → listener  Proof     { HMAC(secret, "odc/dialer"   ‖ nonce_d ‖ nonce_l) }
//! listener → dialer  Welcome   { HMAC(secret, "odc/listener" ‖ nonce_l ‖ nonce_d) }
//!                    or Refused { reason } (no MAC), and the listener closes the connection
//! ```
//!
//! Guarantees:
//! 1. **The listener says nothing keyed before the dialer has proved the secret.** Its only frames
//!    before a valid `Proof` are `Challenge` (a fresh nonce) and `Refused` (text), so a
//!    connection without the secret yields no MAC to brute-force a weak secret offline with. A
//!    dialer still gets the listener's MAC over nonces it chose once it proved the secret, which
//!    is what mutual authentication means.
//! 2. **Both nonces are bound in both MACs, and each direction has its own label**, so neither a
//!    proof nor a welcome can be replayed on another connection or reflected back. The secret
//!    never crosses the wire. MACs are compared in constant time (`hmac`'s `verify_slice`); the
//!    dialer refuses a `Welcome` whose MAC does not match ([`HandshakeError::WrongSecret`]): a
//!    listener without the secret cannot pass for one.
//! 3. **An unauthenticated peer costs little.** Until the handshake completes frames are capped at
//!    [`HANDSHAKE_FRAME_CAP`] bytes (checked before anything is reserved) and the whole exchange,
//!    writes included, runs under one deadline; a peer that sends garbage, sends nothing (slow
//!    loris) or proves nothing is dropped by then. (How many such peers a listener holds at once
//!    is [`super::gate`]'s business.)
//! 4. **Nothing past the handshake is consumed.** Handshake frames are read with
//!    [`FrameReader::next_exact`], which never reads a byte past the frame, so when [`dial`] or
//!    [`accept`] returns `Ok` every later byte is still in the stream: another protocol can take
//!    it over ([`authenticate_dialer`], [`authenticate_listener`]). (Besides, neither side sends
//!    anything the other has not asked for: the dialer sends nothing after its `Proof` until it
//!    has the `Welcome`, the listener nothing after the `Welcome` until the dialer speaks.)
//!
//! 5. **Each connection gets its keys.** Both sides derive one key per direction from the secret
//!    and both nonces ([`SessionKeys`]); the frames after the handshake are sealed with them
//!    ([`super::sealed`]) wherever the connection leaves the host.
//!
//! Not protected here: a peer that relays a handshake between two others gets no keys (it holds no
//! secret), so what it relays afterwards fails the frames' tags; that is [`super::sealed`]'s
//! guarantee, not this file's.
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use std::time::Duration;
//! use odc_transport::wire::handshake::{authenticate_dialer, authenticate_listener};
//! use odc_transport::{deadline_in, ClusterSecret};
//!
//! let secret = ClusterSecret::new("0123456789abcdef0123456789abcdef").unwrap();
//! let (dialer, listener) = tokio::io::duplex(1024);
//! let deadline = deadline_in(Duration::from_secs(5));
//! let (dialed, accepted) = tokio::join!(
//!     authenticate_dialer(dialer, &secret, deadline),
//!     authenticate_listener(listener, &secret, deadline),
//! );
//! // Both streams are authenticated and untouched past the handshake: hand them on.
//! assert!(dialed.is_ok() && accepted.is_ok());
//! # });
//! ```

use std::fmt;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncWrite};

use super::frame::{write_frame, FrameError, FrameReader};
use super::message::Cursor;
use super::sealed::{SessionKeys, Side};
use super::WireError;
use crate::Deadline;

/// Largest frame accepted before the handshake completes.
pub const HANDSHAKE_FRAME_CAP: usize = 256;
/// Start of every `Hello`.
pub const MAGIC: [u8; 4] = *b"ODC\x01";
/// Version of the peer protocol (handshake and messages). 2: the dialer proves first. 3: write
/// tags carry a token (C8), control messages the assignment's token.
pub const PROTOCOL: u16 = 3;
/// The shortest cluster secret accepted, in bytes.
pub const MIN_SECRET_BYTES: usize = 16;

const HELLO: u8 = 0x10;
const CHALLENGE: u8 = 0x11;
const PROOF: u8 = 0x12;
const WELCOME: u8 = 0x13;
const REFUSED: u8 = 0x14;
const NONCE: usize = 32;
const MAC: usize = 32;
/// The label of the dialer's proof and of the listener's welcome.
const DIALER: &[u8] = b"odc/dialer";
const LISTENER: &[u8] = b"odc/listener";

type HmacSha256 = Hmac<Sha256>;

/// The secret every process of one job shares (`ODC_SECRET`); it authenticates peers. Its `Debug`
/// never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Arc<[u8]>);

/// A cluster secret too short to use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the cluster secret is {len} bytes; at least {MIN_SECRET_BYTES} are needed (make one with \
     `openssl rand -hex 32`)"
)]
pub struct SecretError {
    /// Its length in bytes.
    pub len: usize,
}

impl ClusterSecret {
    /// A secret of these bytes, at least [`MIN_SECRET_BYTES`] of them: a shorter one is refused
    /// (an empty one would authenticate anyone, a short one is guessed offline). `openssl rand
    /// -hex 32` makes a good one.
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<Self, SecretError> {
        let bytes = bytes.as_ref();
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(SecretError { len: bytes.len() });
        }
        Ok(Self(Arc::from(bytes)))
    }

    /// A fresh random secret (for a job whose processes this process starts itself): 32 random
    /// bytes as 64 hex digits.
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

    /// The secret's bytes (the key derivation's input, [`super::sealed`]).
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// HMAC(secret, label ‖ first ‖ second).
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
    /// The peer's MAC does not match: it does not hold this process's secret (a listener's
    /// `Welcome`, or a dialer's `Proof`).
    #[error("handshake: the peer did not prove the cluster secret ({0})")]
    WrongSecret(&'static str),
    /// The listener refused this dialer (it sends `Refused` only for a proof that does not match
    /// or a protocol it does not speak); the reason is the listener's.
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
    },
    Proof {
        mac: [u8; MAC],
    },
    Welcome {
        mac: [u8; MAC],
    },
    Refused {
        reason: String,
    },
}

impl HandshakeFrame {
    /// This protocol's Hello with the dialer's nonce `nonce`.
    fn hello(nonce: [u8; NONCE]) -> Self {
        HandshakeFrame::Hello {
            magic: MAGIC,
            protocol: PROTOCOL,
            nonce,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            HandshakeFrame::Hello { .. } => "Hello",
            HandshakeFrame::Challenge { .. } => "Challenge",
            HandshakeFrame::Proof { .. } => "Proof",
            HandshakeFrame::Welcome { .. } => "Welcome",
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
            HandshakeFrame::Challenge { nonce } => {
                out.put_u8(CHALLENGE);
                out.put_slice(nonce);
            }
            HandshakeFrame::Proof { mac } => {
                out.put_u8(PROOF);
                out.put_slice(mac);
            }
            HandshakeFrame::Welcome { mac } => {
                out.put_u8(WELCOME);
                out.put_slice(mac);
            }
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
            },
            PROOF => HandshakeFrame::Proof {
                mac: cur.array("mac")?,
            },
            WELCOME => HandshakeFrame::Welcome {
                mac: cur.array("mac")?,
            },
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

/// Send one frame by `deadline` (a peer that does not read cannot hold a handshake past it).
async fn send<W: AsyncWrite + Unpin>(
    out: &mut W,
    frame: HandshakeFrame,
    deadline: Deadline,
) -> Result<(), HandshakeError> {
    let waiting_for = match frame {
        HandshakeFrame::Hello { .. } => "the Hello to be sent",
        HandshakeFrame::Challenge { .. } => "the Challenge to be sent",
        HandshakeFrame::Proof { .. } => "the Proof to be sent",
        HandshakeFrame::Welcome { .. } => "the Welcome to be sent",
        HandshakeFrame::Refused { .. } => "the refusal to be sent",
    };
    tokio::time::timeout_at(deadline.into(), write_frame(out, &frame.encode(), &[]))
        .await
        .map_err(|_| HandshakeError::Timeout { waiting_for })?
        .map_err(|e| HandshakeError::Frame(FrameError::Io(e)))
}

/// A frame other than the `expected` one.
fn unexpected(expected: &'static str, got: &HandshakeFrame) -> HandshakeError {
    HandshakeError::Unexpected {
        expected,
        got: got.name(),
    }
}

/// Receive one frame by `deadline`, reading no byte past it.
async fn receive<R: AsyncRead + Unpin>(
    reader: &mut FrameReader<R>,
    deadline: Deadline,
    waiting_for: &'static str,
) -> Result<HandshakeFrame, HandshakeError> {
    let body = tokio::time::timeout_at(deadline.into(), reader.next_exact())
        .await
        .map_err(|_| HandshakeError::Timeout { waiting_for })??;
    Ok(HandshakeFrame::decode(body)?)
}

/// The dialer's side: prove the secret over both nonces, then check the listener's proof. Sets
/// `reader`'s cap to the handshake cap; after `Ok` the caller raises it (or hands the stream on:
/// nothing past the `Welcome` has been read). Every wait ends by `deadline`. The connection's
/// keys for its sealed frames ([`super::sealed`]) come back.
pub async fn dial<R, W>(
    reader: &mut FrameReader<R>,
    writer: &mut W,
    secret: &ClusterSecret,
    deadline: Deadline,
) -> Result<SessionKeys, HandshakeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    reader.set_cap(HANDSHAKE_FRAME_CAP);
    let mine = nonce();
    let hello = HandshakeFrame::hello(mine);
    send(writer, hello, deadline).await?;
    let theirs = match receive(reader, deadline, "Challenge").await? {
        HandshakeFrame::Challenge { nonce } => nonce,
        HandshakeFrame::Refused { reason } => return Err(HandshakeError::Refused(reason)),
        other => return Err(unexpected("Challenge", &other)),
    };
    let proof = secret.mac(DIALER, &mine, &theirs).finalize().into_bytes();
    send(
        writer,
        HandshakeFrame::Proof { mac: proof.into() },
        deadline,
    )
    .await?;
    match receive(reader, deadline, "Welcome").await? {
        HandshakeFrame::Welcome { mac } => secret
            .mac(LISTENER, &theirs, &mine)
            .verify_slice(&mac)
            .map_err(|_| HandshakeError::WrongSecret("its welcome MAC does not match"))
            .map(|()| SessionKeys::derive(secret, &mine, &theirs, Side::Dialer)),
        HandshakeFrame::Refused { reason } => Err(HandshakeError::Refused(reason)),
        other => Err(unexpected("Welcome", &other)),
    }
}

/// The listener's side: challenge, check the dialer's proof, and only then prove the secret in
/// the `Welcome`. On a proof that does not match or a protocol it does not speak it tells the
/// dialer why (`Refused`, no MAC) before the caller closes the connection. Sets `reader`'s cap to
/// the handshake cap; after `Ok` nothing past the `Proof` has been read. Every wait ends by
/// `deadline`. The connection's keys for its sealed frames ([`super::sealed`]) come back.
pub async fn accept<R, W>(
    reader: &mut FrameReader<R>,
    writer: &mut W,
    secret: &ClusterSecret,
    deadline: Deadline,
) -> Result<SessionKeys, HandshakeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    reader.set_cap(HANDSHAKE_FRAME_CAP);
    let result = accept_inner(reader, writer, secret, deadline).await;
    if let Err(e @ (HandshakeError::Version { .. } | HandshakeError::WrongSecret(_))) = &result {
        // Best effort: the connection is closed either way.
        let refused = HandshakeFrame::Refused {
            reason: e.to_string(),
        };
        let _ = send(writer, refused, deadline).await;
    }
    result
}

async fn accept_inner<R, W>(
    reader: &mut FrameReader<R>,
    writer: &mut W,
    secret: &ClusterSecret,
    deadline: Deadline,
) -> Result<SessionKeys, HandshakeError>
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
        other => return Err(unexpected("Hello", &other)),
    };
    let mine = nonce();
    send(writer, HandshakeFrame::Challenge { nonce: mine }, deadline).await?;
    match receive(reader, deadline, "Proof").await? {
        HandshakeFrame::Proof { mac } => {
            secret
                .mac(DIALER, &theirs, &mine)
                .verify_slice(&mac)
                .map_err(|_| HandshakeError::WrongSecret("its proof MAC does not match"))?;
        }
        other => return Err(unexpected("Proof", &other)),
    }
    let welcome = secret.mac(LISTENER, &mine, &theirs).finalize().into_bytes();
    send(
        writer,
        HandshakeFrame::Welcome {
            mac: welcome.into(),
        },
        deadline,
    )
    .await?;
    Ok(SessionKeys::derive(secret, &theirs, &mine, Side::Listener))
}

/// Authenticate a freshly dialed `stream` (a `tokio::net::TcpStream`, a Unix stream, ...) as the
/// dialer, and give it back for another protocol to take over, with its keys: no byte past the
/// handshake has been read from it. On an error the stream is dropped (closed).
pub async fn authenticate_dialer<S>(
    stream: S,
    secret: &ClusterSecret,
    deadline: Deadline,
) -> Result<(S, SessionKeys), HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    authenticate(stream, secret, deadline, true).await
}

/// Authenticate a freshly accepted `stream` as the listener (a dialer without the secret gets no
/// MAC), and give it back for another protocol to take over, with its keys: no byte past the
/// handshake has been read from it. On an error the stream is dropped (closed); the error says
/// why (log it).
pub async fn authenticate_listener<S>(
    stream: S,
    secret: &ClusterSecret,
    deadline: Deadline,
) -> Result<(S, SessionKeys), HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    authenticate(stream, secret, deadline, false).await
}

async fn authenticate<S>(
    mut stream: S,
    secret: &ClusterSecret,
    deadline: Deadline,
    dialer: bool,
) -> Result<(S, SessionKeys), HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (read, mut write) = tokio::io::split(&mut stream);
    let mut reader = FrameReader::new(read, HANDSHAKE_FRAME_CAP);
    let keys = if dialer {
        dial(&mut reader, &mut write, secret, deadline).await?
    } else {
        accept(&mut reader, &mut write, secret, deadline).await?
    };
    debug_assert_eq!(reader.buffered(), 0, "the handshake reads nothing past it");
    drop((reader, write));
    Ok((stream, keys))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use super::*;
    use crate::testing::block_on;

    const SECRET: &str = "the-right-secret-of-this-job";
    const WRONG: &str = "not-the-secret-of-this-job";

    fn secret(text: &str) -> ClusterSecret {
        ClusterSecret::new(text).expect("secret")
    }

    fn soon() -> Deadline {
        crate::deadline_in(Duration::from_secs(5))
    }

    async fn pair(
        dialer_secret: &str,
        listener_secret: &str,
    ) -> (Result<(), HandshakeError>, Result<(), HandshakeError>) {
        let (a, b) = tokio::io::duplex(4096);
        let (ds, ls) = (secret(dialer_secret), secret(listener_secret));
        let (dialed, accepted) = tokio::join!(
            authenticate_dialer(a, &ds, soon()),
            authenticate_listener(b, &ls, soon())
        );
        (dialed.map(drop), accepted.map(drop))
    }

    /// One whole frame, prefix and body, as raw bytes.
    fn raw(frame: &HandshakeFrame) -> Vec<u8> {
        let body = frame.encode();
        let mut bytes = (body.len() as u32).to_be_bytes().to_vec();
        bytes.extend_from_slice(&body);
        bytes
    }

    /// Read one frame's raw bytes off `stream`: its body.
    async fn raw_frame(stream: &mut DuplexStream) -> Vec<u8> {
        let mut prefix = [0u8; 4];
        stream.read_exact(&mut prefix).await.expect("a prefix");
        let len = u32::from_be_bytes(prefix) as usize;
        assert!(len <= HANDSHAKE_FRAME_CAP, "{len}");
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body).await.expect("a body");
        body
    }

    #[test]
    fn same_secret_is_welcomed() {
        let (dialer, listener) = block_on(pair(SECRET, SECRET));
        assert!(dialer.is_ok(), "{dialer:?}");
        assert!(listener.is_ok(), "{listener:?}");
    }

    #[test]
    fn wrong_secret_fails_on_both_sides() {
        let (dialer, listener) = block_on(pair(WRONG, SECRET));
        match dialer {
            Err(HandshakeError::Refused(reason)) => assert!(
                reason.contains("did not prove the cluster secret"),
                "the dialer is told its proof failed: {reason}"
            ),
            other => panic!("expected the dialer refused, got {other:?}"),
        }
        assert!(
            matches!(listener, Err(HandshakeError::WrongSecret(_))),
            "the listener never welcomes the dialer: {listener:?}"
        );
    }

    /// Guarantee 1: a dialer without the secret gets a nonce and a refusal, nothing keyed.
    #[test]
    fn a_dialer_with_the_wrong_secret_never_receives_a_mac() {
        block_on(async {
            let (mut dialer, listener) = tokio::io::duplex(4096);
            let listening = tokio::spawn(async move {
                authenticate_listener(listener, &secret(SECRET), soon())
                    .await
                    .map(drop)
            });
            let mine = [5u8; NONCE];
            let hello = HandshakeFrame::hello(mine);
            dialer.write_all(&raw(&hello)).await.expect("write");
            let challenge = raw_frame(&mut dialer).await;
            assert_eq!(challenge.len(), 1 + NONCE, "a Challenge is a nonce, no MAC");
            assert_eq!(challenge[0], CHALLENGE);
            let theirs: [u8; NONCE] = challenge[1..].try_into().expect("a nonce");
            let forged = secret(WRONG)
                .mac(DIALER, &mine, &theirs)
                .finalize()
                .into_bytes();
            dialer
                .write_all(&raw(&HandshakeFrame::Proof { mac: forged.into() }))
                .await
                .expect("write");
            let mut rest = Vec::new();
            dialer
                .read_to_end(&mut rest)
                .await
                .expect("read to the close");
            let outcome = listening.await.expect("listener task");
            assert!(
                matches!(outcome, Err(HandshakeError::WrongSecret(_))),
                "{outcome:?}"
            );
            // All the dialer got after the challenge: one Refused frame, text only.
            let refused = HandshakeFrame::decode(Bytes::copy_from_slice(&rest[4..]));
            assert!(
                matches!(&refused, Ok(HandshakeFrame::Refused { reason }) if reason.contains("proof MAC does not match")),
                "{refused:?}"
            );
            assert_eq!(
                u32::from_be_bytes(rest[..4].try_into().expect("prefix")) as usize,
                rest.len() - 4
            );
            let mut received = challenge;
            received.extend_from_slice(&rest);
            let right = secret(SECRET);
            for mac in [
                right.mac(LISTENER, &theirs, &mine).finalize().into_bytes(),
                right.mac(LISTENER, &mine, &theirs).finalize().into_bytes(),
                right.mac(DIALER, &mine, &theirs).finalize().into_bytes(),
            ] {
                assert!(
                    !received.windows(MAC).any(|w| w == mac.as_slice()),
                    "no MAC under the secret reaches a dialer without it"
                );
            }
        });
    }

    /// Guarantee 2: a listener without the secret cannot welcome a dialer, even by echoing the
    /// dialer's own proof back.
    #[test]
    fn a_listener_with_the_wrong_secret_is_detected_by_the_dialer() {
        for reflect in [false, true] {
            block_on(async {
                let (dialer, mut impostor) = tokio::io::duplex(4096);
                let dialing = tokio::spawn(async move {
                    authenticate_dialer(dialer, &secret(SECRET), soon())
                        .await
                        .map(drop)
                });
                let hello = HandshakeFrame::decode(raw_frame(&mut impostor).await.into());
                let Ok(HandshakeFrame::Hello { nonce: theirs, .. }) = hello else {
                    panic!("expected a Hello, got {hello:?}");
                };
                let mine = [9u8; NONCE];
                impostor
                    .write_all(&raw(&HandshakeFrame::Challenge { nonce: mine }))
                    .await
                    .expect("write");
                let proof = HandshakeFrame::decode(raw_frame(&mut impostor).await.into());
                let Ok(HandshakeFrame::Proof { mac: proof }) = proof else {
                    panic!("expected a Proof, got {proof:?}");
                };
                let mac = if reflect {
                    proof
                } else {
                    secret(WRONG)
                        .mac(LISTENER, &mine, &theirs)
                        .finalize()
                        .into_bytes()
                        .into()
                };
                impostor
                    .write_all(&raw(&HandshakeFrame::Welcome { mac }))
                    .await
                    .expect("write");
                let outcome = dialing.await.expect("dialer task");
                assert!(
                    matches!(
                        outcome,
                        Err(HandshakeError::WrongSecret(
                            "its welcome MAC does not match"
                        ))
                    ),
                    "reflect {reflect}: {outcome:?}"
                );
            });
        }
    }

    /// Guarantee 4: bytes the peer sent right behind its last handshake frame stay in the stream
    /// for whoever takes it over, on both sides.
    #[test]
    fn nothing_past_the_handshake_is_read() {
        block_on(async {
            // A listener that sends its Welcome and the next protocol's first bytes in one write.
            let (dialer, mut listener) = tokio::io::duplex(4096);
            let dialing =
                tokio::spawn(
                    async move { authenticate_dialer(dialer, &secret(SECRET), soon()).await },
                );
            let Ok(HandshakeFrame::Hello { nonce: theirs, .. }) =
                HandshakeFrame::decode(raw_frame(&mut listener).await.into())
            else {
                panic!("expected a Hello");
            };
            let mine = [1u8; NONCE];
            listener
                .write_all(&raw(&HandshakeFrame::Challenge { nonce: mine }))
                .await
                .expect("write");
            raw_frame(&mut listener).await;
            let welcome = secret(SECRET)
                .mac(LISTENER, &mine, &theirs)
                .finalize()
                .into_bytes();
            let mut bytes = raw(&HandshakeFrame::Welcome {
                mac: welcome.into(),
            });
            bytes.extend_from_slice(b"next protocol");
            listener.write_all(&bytes).await.expect("write");
            let (mut stream, _keys) = dialing.await.expect("dialer task").expect("welcomed");
            let mut after = [0u8; 13];
            stream
                .read_exact(&mut after)
                .await
                .expect("the bytes after the Welcome");
            assert_eq!(&after, b"next protocol");

            // A dialer that sends its Proof and the next protocol's first bytes in one write.
            let (mut dialer, listener) = tokio::io::duplex(4096);
            let accepting = tokio::spawn(async move {
                authenticate_listener(listener, &secret(SECRET), soon()).await
            });
            let mine = [2u8; NONCE];
            let hello = HandshakeFrame::hello(mine);
            dialer.write_all(&raw(&hello)).await.expect("write");
            let theirs: [u8; NONCE] = raw_frame(&mut dialer).await[1..]
                .try_into()
                .expect("a nonce");
            let proof = secret(SECRET)
                .mac(DIALER, &mine, &theirs)
                .finalize()
                .into_bytes();
            let mut bytes = raw(&HandshakeFrame::Proof { mac: proof.into() });
            bytes.extend_from_slice(b"first request");
            dialer.write_all(&bytes).await.expect("write");
            let (mut stream, _keys) = accepting.await.expect("listener task").expect("accepted");
            let mut after = [0u8; 13];
            stream
                .read_exact(&mut after)
                .await
                .expect("the bytes after the Proof");
            assert_eq!(&after, b"first request");
        });
    }

    #[test]
    fn silent_peer_times_out_on_either_side() {
        block_on(async {
            let (_silent, listener) = tokio::io::duplex(4096);
            let deadline = crate::deadline_in(Duration::from_millis(50));
            let result = authenticate_listener(listener, &secret(SECRET), deadline).await;
            assert!(
                matches!(
                    result,
                    Err(HandshakeError::Timeout {
                        waiting_for: "Hello"
                    })
                ),
                "{result:?}"
            );
            let (dialer, _silent) = tokio::io::duplex(4096);
            let deadline = crate::deadline_in(Duration::from_millis(50));
            let result = authenticate_dialer(dialer, &secret(SECRET), deadline).await;
            assert!(
                matches!(
                    result,
                    Err(HandshakeError::Timeout {
                        waiting_for: "Challenge"
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
            a.write_all(b"GET / HTTP/1.1\r\n\r\n").await.expect("write");
            let result = authenticate_listener(b, &secret(SECRET), soon()).await;
            assert!(
                matches!(
                    result,
                    Err(HandshakeError::Frame(FrameError::Wire(
                        WireError::Oversized { cap: 256, .. }
                    )))
                ),
                "{result:?}"
            );
        });
    }

    #[test]
    fn short_secrets_are_refused_and_debug_hides_the_secret() {
        for short in ["", "x", "fifteen-bytes!!"] {
            let error = ClusterSecret::new(short).expect_err("too short");
            assert_eq!(error.len, short.len());
            let text = error.to_string();
            assert!(
                text.contains("at least 16") && text.contains("openssl rand -hex 32"),
                "{text}"
            );
        }
        let secret = ClusterSecret::new("sixteen-bytes-ok").expect("16 bytes are enough");
        assert!(!format!("{secret:?}").contains("sixteen"));
        assert_ne!(ClusterSecret::random(), ClusterSecret::random());
        assert!(ClusterSecret::new(ClusterSecret::random().expose()).is_ok());
    }
}
