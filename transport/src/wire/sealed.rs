//! Authenticated frames: after the handshake every byte of a connection that leaves the host
//! travels in sealed records (AES-256-GCM, `ring`), so that a byte changed on the path, or a record
//! replayed, reordered or dropped, is refused before any of it is read.
//!
//! ```text
//! record = length u32 (big-endian, ≤ RECORD)  ciphertext [length]  tag [16]
//! key    = HKDF-SHA256(ikm = the job's secret, salt = nonce_dialer ‖ nonce_listener,
//!                      info = "odc/frames/v1 " ‖ direction)        one per connection and direction
//! nonce  = 0u32 ‖ record number u64 (big-endian, from 0 in each direction)
//! aad    = the record's length field
//! ```
//!
//! Above it the frames ([`super::frame`]) are unchanged: [`SealedRead`] and [`SealedWrite`] wrap a
//! stream's two halves and are streams themselves.
//!
//! Guarantees:
//! 1. **Nothing unverified is read.** A record's bytes are handed to the reader only after its tag
//!    verified under the number the reader expects next. A changed byte (length, ciphertext or
//!    tag), a replayed, reordered or missing record fails with [`SealError::Forged`] naming the
//!    record, and the reader stays failed: every later read returns the same error, so the
//!    connection is dead (its owner closes it) and nothing after the forgery is read either.
//! 2. **A key seals on one connection in one direction only.** Both handshake nonces are fresh
//!    per connection and both are in the salt; each direction has its own label. So a record of
//!    one connection or direction fails on any other, and a record number never repeats under a
//!    key (the writer refuses to wrap its counter).
//! 3. **A peer's length costs at most [`RECORD`].** The length is checked before anything is
//!    reserved; a longer one is [`SealError::Oversized`].
//! 4. **A cut is an error inside a record, an end between records.** The stream ending inside a
//!    record is `UnexpectedEof`; between records it is the end of the stream, as a closed
//!    connection always is (an attacker can cut a connection, as a failure can; odc recovers from a
//!    lost connection).
//! 5. **Written bytes go out on flush.** [`SealedWrite`] gathers writes into a record of at most
//!    [`RECORD`] bytes and seals it when it is full or on `flush` (every frame writer of odc
//!    flushes each frame).
//!
//! Not protected: confidentiality is a side effect (the bytes are encrypted), not a goal stated
//! here; traffic analysis (record lengths and timing).

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::hkdf::{Salt, HKDF_SHA256};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::handshake::ClusterSecret;

/// Largest plaintext of one record: 256 KiB.
pub const RECORD: usize = 256 << 10;
/// Bytes of a record's tag.
pub const TAG: usize = 16;
/// Bytes of a record's length field.
const LENGTH: usize = 4;
/// The label of the keys' derivation, then the direction.
const LABEL: &[u8] = b"odc/frames/v1 ";
const DIALER_TO_LISTENER: &[u8] = b"dialer to listener";
const LISTENER_TO_DIALER: &[u8] = b"listener to dialer";

/// Why a sealed stream failed (carried in an `io::Error` of kind `InvalidData`, or `Other` for
/// the counter).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// A record whose tag does not verify: altered, replayed, reordered or one before it missing.
    #[error(
        "a forged frame: record {record}'s authentication tag does not verify (altered, \
         replayed, reordered, or a record before it missing on the path)"
    )]
    Forged { record: u64 },
    /// A record length above [`RECORD`].
    #[error("a sealed record of {len} bytes exceeds the limit of {RECORD} bytes")]
    Oversized { len: u64 },
    /// The writer's record counter would wrap (2^64 records under one key).
    #[error("the connection sealed 2^64 records; it must be opened again")]
    Exhausted,
}

impl SealError {
    /// The `SealError` inside `e`, if it is one of a sealed stream.
    pub fn of(e: &io::Error) -> Option<&SealError> {
        e.get_ref()
            .and_then(|inner| inner.downcast_ref::<SealError>())
    }

    fn io(self) -> io::Error {
        let kind = match self {
            SealError::Exhausted => io::ErrorKind::Other,
            _ => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, self)
    }
}

/// Which side of the handshake this process was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Dialer,
    Listener,
}

/// The two keys of one connection, from its handshake: one seals what this side sends, the other
/// opens what it receives.
pub struct SessionKeys {
    send: LessSafeKey,
    recv: LessSafeKey,
}

impl std::fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKeys(..)")
    }
}

impl SessionKeys {
    /// The keys of a connection whose handshake exchanged these nonces, for `side` (see the
    /// module docs).
    pub fn derive(
        secret: &ClusterSecret,
        dialer_nonce: &[u8],
        listener_nonce: &[u8],
        side: Side,
    ) -> Self {
        let mut salt = Vec::with_capacity(dialer_nonce.len() + listener_nonce.len());
        salt.extend_from_slice(dialer_nonce);
        salt.extend_from_slice(listener_nonce);
        let prk = Salt::new(HKDF_SHA256, &salt).extract(secret.bytes());
        let key = |direction: &[u8]| {
            let info = [LABEL, direction];
            let okm = match prk.expand(&info, &AES_256_GCM) {
                Ok(okm) => okm,
                Err(_) => unreachable!("32 bytes is within HKDF-SHA256's output limit"),
            };
            LessSafeKey::new(UnboundKey::from(okm))
        };
        let (d2l, l2d) = (key(DIALER_TO_LISTENER), key(LISTENER_TO_DIALER));
        match side {
            Side::Dialer => SessionKeys {
                send: d2l,
                recv: l2d,
            },
            Side::Listener => SessionKeys {
                send: l2d,
                recv: d2l,
            },
        }
    }

    /// Wrap a connection's halves: what is read is opened, what is written sealed.
    pub fn seal<R, W>(self, read: R, write: W) -> (SealedRead<R>, SealedWrite<W>) {
        (
            SealedRead::new(read, self.recv),
            SealedWrite::new(write, self.send),
        )
    }
}

/// The AEAD nonce of record `n`.
fn nonce(n: u64) -> Nonce {
    let mut bytes = [0u8; NONCE_LEN];
    bytes[NONCE_LEN - 8..].copy_from_slice(&n.to_be_bytes());
    Nonce::assume_unique_for_key(bytes)
}

/// The reading half of a sealed connection (see the module docs).
pub struct SealedRead<R> {
    inner: R,
    key: LessSafeKey,
    /// The number of the next record.
    next: u64,
    length: [u8; LENGTH],
    length_filled: usize,
    /// The record being received (ciphertext and tag), then its plaintext.
    record: Vec<u8>,
    /// Bytes of the record received; its full size once the length is known.
    filled: usize,
    want: Option<usize>,
    /// The verified plaintext not handed out yet: `record[taken..plain]`.
    taken: usize,
    plain: usize,
    failed: Option<SealError>,
}

impl<R> SealedRead<R> {
    fn new(inner: R, key: LessSafeKey) -> Self {
        SealedRead {
            inner,
            key,
            next: 0,
            length: [0; LENGTH],
            length_filled: 0,
            record: Vec::new(),
            filled: 0,
            want: None,
            taken: 0,
            plain: 0,
            failed: None,
        }
    }

    /// Records verified so far.
    pub fn records(&self) -> u64 {
        self.next
    }

    fn fail(&mut self, e: SealError) -> io::Error {
        self.failed = Some(e.clone());
        e.io()
    }

    /// Open the record received: its plaintext becomes readable, or the stream fails.
    fn open(&mut self) -> io::Result<()> {
        let len = u32::from_be_bytes(self.length) as usize;
        let opened = self.key.open_in_place(
            nonce(self.next),
            Aad::from(self.length),
            &mut self.record[..len + TAG],
        );
        if opened.is_err() {
            return Err(self.fail(SealError::Forged { record: self.next }));
        }
        self.next += 1;
        self.taken = 0;
        self.plain = len;
        self.length_filled = 0;
        self.filled = 0;
        self.want = None;
        Ok(())
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for SealedRead<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if let Some(e) = &this.failed {
                return Poll::Ready(Err(e.clone().io()));
            }
            if this.taken < this.plain {
                let n = out.remaining().min(this.plain - this.taken);
                out.put_slice(&this.record[this.taken..this.taken + n]);
                this.taken += n;
                return Poll::Ready(Ok(()));
            }
            if out.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            let want = match this.want {
                Some(want) => want,
                None => {
                    while this.length_filled < LENGTH {
                        let mut buf = ReadBuf::new(&mut this.length[this.length_filled..]);
                        ready!(Pin::new(&mut this.inner).poll_read(cx, &mut buf))?;
                        match buf.filled().len() {
                            0 if this.length_filled == 0 => return Poll::Ready(Ok(())),
                            0 => return Poll::Ready(Err(cut("a record's length"))),
                            n => this.length_filled += n,
                        }
                    }
                    let len = u32::from_be_bytes(this.length) as usize;
                    if len > RECORD {
                        let e = this.fail(SealError::Oversized { len: len as u64 });
                        return Poll::Ready(Err(e));
                    }
                    if this.record.len() < len + TAG {
                        this.record.resize(len + TAG, 0);
                    }
                    this.want = Some(len + TAG);
                    len + TAG
                }
            };
            while this.filled < want {
                let mut buf = ReadBuf::new(&mut this.record[this.filled..want]);
                ready!(Pin::new(&mut this.inner).poll_read(cx, &mut buf))?;
                match buf.filled().len() {
                    0 => return Poll::Ready(Err(cut("a record"))),
                    n => this.filled += n,
                }
            }
            this.open()?;
        }
    }
}

/// The stream ended inside `what`.
fn cut(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("the connection ended inside {what}"),
    )
}

/// The writing half of a sealed connection (see the module docs).
pub struct SealedWrite<W> {
    inner: W,
    key: LessSafeKey,
    next: u64,
    /// The record being gathered: a length field's room, then plaintext.
    gathering: Vec<u8>,
    /// A sealed record being written, and how much of it is out.
    sending: Vec<u8>,
    sent: usize,
}

impl<W> SealedWrite<W> {
    fn new(inner: W, key: LessSafeKey) -> Self {
        let mut gathering = Vec::with_capacity(LENGTH + RECORD + TAG);
        gathering.extend_from_slice(&[0; LENGTH]);
        SealedWrite {
            inner,
            key,
            next: 0,
            gathering,
            sending: Vec::with_capacity(LENGTH + RECORD + TAG),
            sent: 0,
        }
    }

    /// Records sealed so far.
    pub fn records(&self) -> u64 {
        self.next
    }

    fn gathered(&self) -> usize {
        self.gathering.len() - LENGTH
    }

    /// Seal the gathered plaintext into the record to send (the last one is out).
    fn seal(&mut self) -> io::Result<()> {
        if self.next == u64::MAX {
            return Err(SealError::Exhausted.io());
        }
        let len = self.gathered() as u32;
        let length = len.to_be_bytes();
        self.gathering[..LENGTH].copy_from_slice(&length);
        let tag = self
            .key
            .seal_in_place_separate_tag(
                nonce(self.next),
                Aad::from(length),
                &mut self.gathering[LENGTH..],
            )
            .map_err(|_| io::Error::other("sealing a record failed"))?;
        self.gathering.extend_from_slice(tag.as_ref());
        self.next += 1;
        std::mem::swap(&mut self.gathering, &mut self.sending);
        self.sent = 0;
        self.gathering.clear();
        self.gathering.extend_from_slice(&[0; LENGTH]);
        Ok(())
    }
}

impl<W: AsyncWrite + Unpin> SealedWrite<W> {
    /// Write out the sealed record, if any.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.sending.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.sending[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        Poll::Ready(Ok(()))
    }

    /// Seal what was gathered and write it out.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_send(cx))?;
        if self.gathered() > 0 {
            self.seal()?;
            ready!(self.poll_send(cx))?;
        }
        Poll::Ready(Ok(()))
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for SealedWrite<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.gathered() == RECORD {
            ready!(this.poll_drain(cx))?;
        }
        let n = buf.len().min(RECORD - this.gathered());
        this.gathering.extend_from_slice(&buf[..n]);
        // A full record starts out at once where the last one is out; what does not go now goes
        // on the next write or flush. The bytes are taken either way (never Pending after).
        if this.gathered() == RECORD {
            if let Poll::Ready(sent) = this.poll_send(cx) {
                sent?;
                this.seal()?;
                if let Poll::Ready(sent) = this.poll_send(cx) {
                    sent?;
                }
            }
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::testing::block_on;

    fn secret() -> ClusterSecret {
        ClusterSecret::new("sealed-frames-test-secret").expect("secret")
    }

    /// The two sides' keys of one connection.
    fn pair(dialer_nonce: u8, listener_nonce: u8) -> (SessionKeys, SessionKeys) {
        let (d, l) = ([dialer_nonce; 32], [listener_nonce; 32]);
        (
            SessionKeys::derive(&secret(), &d, &l, Side::Dialer),
            SessionKeys::derive(&secret(), &d, &l, Side::Listener),
        )
    }

    /// `writes` sealed by the dialer, one record each (each flushed), as the wire bytes.
    fn sealed(writes: &[&[u8]]) -> Vec<u8> {
        block_on(async {
            let (dialer, _) = pair(1, 2);
            let (_, mut write) = dialer.seal(tokio::io::empty(), Vec::new());
            for w in writes {
                write.write_all(w).await.expect("write");
                write.flush().await.expect("flush");
            }
            assert_eq!(write.records(), writes.len() as u64);
            write.inner
        })
    }

    /// The wire bytes split into records.
    fn records(mut wire: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while !wire.is_empty() {
            let len = u32::from_be_bytes(wire[..4].try_into().expect("4 bytes")) as usize;
            out.push(wire[..LENGTH + len + TAG].to_vec());
            wire = &wire[LENGTH + len + TAG..];
        }
        out
    }

    /// What the listener reads off `wire`: the bytes it was handed, then the error it stopped on.
    fn open(wire: Vec<u8>) -> (Vec<u8>, Option<io::Error>) {
        block_on(async {
            let (_, listener) = pair(1, 2);
            let (mut read, _) = listener.seal(&wire[..], tokio::io::sink());
            let mut got = Vec::new();
            let mut buf = [0u8; 7];
            loop {
                match read.read(&mut buf).await {
                    Ok(0) => return (got, None),
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) => {
                        // Failed for good: the next read fails the same way.
                        let again = read.read(&mut buf).await.expect_err("still failed");
                        assert_eq!(again.to_string(), e.to_string());
                        return (got, Some(e));
                    }
                }
            }
        })
    }

    fn forged(e: &Option<io::Error>) -> Option<u64> {
        match e.as_ref().and_then(SealError::of) {
            Some(SealError::Forged { record }) => Some(*record),
            _ => None,
        }
    }

    #[test]
    fn what_is_written_is_read_across_records_of_any_size() {
        block_on(async {
            let (dialer, listener) = pair(3, 4);
            let (a, b) = tokio::io::duplex(64 << 10);
            let (a_read, a_write) = tokio::io::split(a);
            let (b_read, b_write) = tokio::io::split(b);
            let (_, mut write) = dialer.seal(a_read, a_write);
            let (mut read, _) = listener.seal(b_read, b_write);
            let data: Vec<u8> = (0..(3 * RECORD + 12_345))
                .map(|i| (i * 7 % 251) as u8)
                .collect();
            let sent = data.clone();
            let writer = tokio::spawn(async move {
                for piece in sent.chunks(100_000) {
                    write.write_all(piece).await.expect("write");
                }
                write.shutdown().await.expect("shutdown");
                write.records()
            });
            let mut got = Vec::new();
            read.read_to_end(&mut got).await.expect("read");
            assert_eq!(got, data);
            assert_eq!(read.records(), writer.await.expect("writer"));
        });
    }

    /// On-path changes: each is refused at the record it touches; nothing of it or after it is
    /// read, what came before is.
    #[test]
    fn an_altered_replayed_reordered_or_dropped_record_is_refused() {
        let wire = records(&sealed(&[b"first", b"second", b"third"]));
        let join = |rs: &[&Vec<u8>]| rs.iter().flat_map(|r| r.iter().copied()).collect();
        let (got, end) = open(join(&[&wire[0], &wire[1], &wire[2]]));
        assert_eq!(
            (got.as_slice(), end.is_none()),
            (&b"firstsecondthird"[..], true)
        );
        for at in [0, 3, 4, 8, wire[1].len() - 1] {
            let mut bad = wire[1].clone();
            bad[at] ^= 0x10;
            let (got, end) = open(join(&[&wire[0], &bad, &wire[2]]));
            assert_eq!(got, b"first", "a bit flipped at {at}");
            let end = end.expect("refused");
            match SealError::of(&end) {
                Some(SealError::Forged { record: 1 }) => {}
                // A length bit flipped may also ask for more than a record holds, or for more
                // bytes than the stream has left; never for data.
                Some(SealError::Oversized { .. }) if at < LENGTH => {}
                None if at < LENGTH && end.kind() == io::ErrorKind::UnexpectedEof => {}
                _ => panic!("a bit flipped at {at}: {end:?}"),
            }
        }
        let cases: [(&str, Vec<&Vec<u8>>); 3] = [
            ("replayed", vec![&wire[0], &wire[0], &wire[2]]),
            ("reordered", vec![&wire[0], &wire[2], &wire[1]]),
            ("dropped", vec![&wire[0], &wire[2]]),
        ];
        for (what, rs) in cases {
            let (got, end) = open(join(&rs));
            assert_eq!(got, b"first", "{what}");
            assert_eq!(forged(&end), Some(1), "{what}: {end:?}");
            assert_eq!(end.expect("an error").kind(), io::ErrorKind::InvalidData);
        }
    }

    #[test]
    fn a_record_opens_only_on_its_connection_and_direction() {
        let wire = sealed(&[b"hello"]);
        block_on(async {
            let reads = |keys: SessionKeys| {
                let wire = wire.clone();
                async move {
                    let (mut read, _) = keys.seal(&wire[..], tokio::io::sink());
                    let mut got = Vec::new();
                    read.read_to_end(&mut got).await.map(|_| got)
                }
            };
            let (dialer, listener) = pair(1, 2);
            assert_eq!(reads(listener).await.expect("opens"), b"hello");
            assert!(reads(dialer).await.is_err(), "its own direction");
            assert!(reads(pair(1, 9).1).await.is_err(), "another connection");
            let other = ClusterSecret::new("another-job-secret-entirely").expect("secret");
            let keys = SessionKeys::derive(&other, &[1; 32], &[2; 32], Side::Listener);
            assert!(reads(keys).await.is_err(), "another secret");
        });
    }

    #[test]
    fn a_long_length_is_refused_and_a_cut_record_is_an_early_end() {
        let (got, end) = open(vec![0xff; 64]);
        assert!(got.is_empty());
        let e = end.expect("refused");
        assert_eq!(
            SealError::of(&e),
            Some(&SealError::Oversized { len: 0xffff_ffff })
        );
        let wire = sealed(&[b"whole", b"cut short"]);
        let (got, end) = open(wire[..wire.len() - 3].to_vec());
        assert_eq!(got, b"whole");
        assert_eq!(end.expect("cut").kind(), io::ErrorKind::UnexpectedEof);
        // Between records the stream simply ends.
        let (got, end) = open(records(&wire).remove(0));
        assert_eq!(got, b"whole");
        assert!(end.is_none(), "{end:?}");
    }
}
