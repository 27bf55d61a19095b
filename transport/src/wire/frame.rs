//! Length-prefixed frames: a 4-byte big-endian body length, then the body.
//!
//! The reader checks the length against its cap before it reserves anything, so a peer's length
//! field can make it allocate at most the cap (and before authentication the cap is a few hundred
//! bytes). A frame's body is handed out as `Bytes` split off the receive buffer: no copy.
//!
//! A body can also be taken in two steps, so a large payload lands where its reader wants it
//! rather than in a fresh buffer: [`FrameReader::next_head`] hands out the length and the first
//! few bytes, then [`FrameReader::read_body`] copies the rest into the caller's memory (or
//! [`FrameReader::rest_of_body`] buffers it; the next frame's read discards whatever is left).
//! Reads never go past the current frame's body, so a payload of the wrong length can never
//! consume the next frame, and every step is cancel safe: progress is kept in the reader.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::WireError;

/// Bytes of the length prefix.
pub const PREFIX: usize = 4;

/// How far a read for a frame's head (or for bytes to discard) may read ahead into the buffer;
/// what it takes of a payload is copied from there, the rest goes straight to its destination.
const READ_AHEAD: usize = 64 * 1024;

/// Payloads up to this size are copied next to their head and written with one call (fewer
/// syscalls for small messages); larger ones are written from their own buffer.
const COALESCE: usize = 64 * 1024;

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The peer closed the stream between frames.
    #[error("the peer closed the connection")]
    Closed,
    /// The stream failed, or ended inside a frame.
    #[error("connection failed: {0}")]
    Io(#[from] std::io::Error),
    /// The length prefix is over the cap.
    #[error(transparent)]
    Wire(#[from] WireError),
}

/// Reads frames off a byte stream, with a cap that can change (it rises after the handshake).
#[derive(Debug)]
pub struct FrameReader<R> {
    inner: R,
    buf: BytesMut,
    cap: usize,
    /// Bytes of the current frame's body not taken yet (after [`FrameReader::next_head`]); the
    /// first `min(body_left, buf.len())` of them are in `buf`.
    body_left: usize,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(inner: R, cap: usize) -> Self {
        Self {
            inner,
            buf: BytesMut::with_capacity(8 * 1024),
            cap,
            body_left: 0,
        }
    }

    /// The stream, for another layer to take over once the frames read so far were read with
    /// [`FrameReader::next_exact`] (the handshake's): then nothing past them is buffered. Bytes
    /// buffered otherwise would be lost, so that is a bug (checked in debug builds).
    pub fn into_inner(self) -> R {
        debug_assert_eq!(self.buffered(), 0, "bytes read past the frames taken");
        self.inner
    }

    /// The largest body accepted from now on.
    pub fn set_cap(&mut self, cap: usize) {
        self.cap = cap;
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The next frame's body (the rest of a frame begun with [`FrameReader::next_head`] is
    /// discarded first). Cancel safe: bytes already read stay buffered.
    pub async fn next(&mut self) -> Result<Bytes, FrameError> {
        self.discard_body().await?;
        loop {
            if let Some(body) = self.split()? {
                return Ok(body);
            }
            self.fill(usize::MAX).await?;
        }
    }

    /// The next frame's body, reading no byte past it from the stream (at most two reads a
    /// frame: the prefix, then the body), so the stream can change hands after it with nothing
    /// lost: the handshake reads its frames this way. Cancel safe.
    pub async fn next_exact(&mut self) -> Result<Bytes, FrameError> {
        self.discard_body().await?;
        loop {
            let want = match self.split()? {
                Some(body) => return Ok(body),
                None => self.prefix()?.map_or(PREFIX, |len| PREFIX + len),
            };
            self.fill(want - self.buf.len()).await?;
        }
    }

    /// Bytes read from the stream and not handed out yet (0 after [`FrameReader::next_exact`] on
    /// a fresh reader).
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next frame's body length and its first `min(want, length)` bytes; the rest of the body
    /// ([`FrameReader::body_left`] bytes) is for [`FrameReader::read_body`] or
    /// [`FrameReader::rest_of_body`], and whatever of it is left when the next frame is read is
    /// discarded. The length is checked against the cap before anything is reserved. Cancel safe.
    pub async fn next_head(&mut self, want: usize) -> Result<(usize, Bytes), FrameError> {
        self.discard_body().await?;
        loop {
            if let Some(len) = self.prefix()? {
                let take = want.min(len);
                if self.buf.len() >= PREFIX + take {
                    self.buf.advance(PREFIX);
                    self.body_left = len - take;
                    return Ok((len, self.buf.split_to(take).freeze()));
                }
            }
            // Room to read ahead: a small frame then arrives whole in one read. Once the frames
            // split off earlier are dropped, this reuses the buffer's allocation.
            self.buf.reserve(READ_AHEAD);
            self.fill(READ_AHEAD).await?;
        }
    }

    /// Bytes of the current frame's body not taken yet.
    pub fn body_left(&self) -> usize {
        self.body_left
    }

    /// Bytes of the current frame's body already in the buffer (taking them reads nothing).
    pub fn body_buffered(&self) -> usize {
        self.body_left.min(self.buf.len())
    }

    /// Copy the next bytes of the current frame's body into `out`: at least one and at most
    /// `min(out.len(), body_left)`, returned; 0 only when `out` is empty or the body is all
    /// taken. Bytes already buffered are copied from the buffer, the rest is read from the stream
    /// straight into `out`. A stream that ends first is [`FrameError::Io`]. Cancel safe.
    pub async fn read_body(&mut self, out: &mut [u8]) -> Result<usize, FrameError> {
        let n = out.len().min(self.body_left);
        if n == 0 {
            return Ok(0);
        }
        let taken = if self.buf.is_empty() {
            match self.inner.read(&mut out[..n]).await? {
                0 => return Err(self.cut()),
                taken => taken,
            }
        } else {
            let taken = n.min(self.buf.len());
            out[..taken].copy_from_slice(&self.buf[..taken]);
            self.buf.advance(taken);
            taken
        };
        self.body_left -= taken;
        Ok(taken)
    }

    /// The rest of the current frame's body, buffered (at most the cap: the length was checked).
    /// Cancel safe.
    pub async fn rest_of_body(&mut self) -> Result<Bytes, FrameError> {
        let need = self.body_left;
        while self.buf.len() < need {
            self.buf.reserve(need - self.buf.len());
            self.fill(usize::MAX).await?;
        }
        self.body_left = 0;
        Ok(self.buf.split_to(need).freeze())
    }

    /// Drop the rest of the current frame's body, reading ahead at most [`READ_AHEAD`] bytes at a
    /// time. Cancel safe.
    async fn discard_body(&mut self) -> Result<(), FrameError> {
        while self.body_left > 0 {
            if self.buf.is_empty() {
                self.fill(self.body_left.min(READ_AHEAD)).await?;
            }
            let taken = self.body_left.min(self.buf.len());
            self.buf.advance(taken);
            self.body_left -= taken;
        }
        Ok(())
    }

    /// Read at most `most` more bytes into the buffer (at least one). The stream ending is
    /// [`FrameError::Closed`] between frames, [`FrameError::Io`] inside one.
    async fn fill(&mut self, most: usize) -> Result<(), FrameError> {
        if self
            .inner
            .read_buf(&mut (&mut self.buf).limit(most))
            .await?
            == 0
        {
            return Err(if self.buf.is_empty() && self.body_left == 0 {
                FrameError::Closed
            } else {
                self.cut()
            });
        }
        Ok(())
    }

    /// The error for a stream that ended inside a frame.
    fn cut(&self) -> FrameError {
        FrameError::Io(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "stream ended inside a frame ({} bytes buffered, {} of the body not received)",
                self.buf.len(),
                self.body_left
            ),
        ))
    }

    /// The length of the frame whose prefix starts the buffer, if the prefix is there, checked
    /// against the cap.
    fn prefix(&self) -> Result<Option<usize>, WireError> {
        let Some(prefix) = self.buf.get(..PREFIX) else {
            return Ok(None);
        };
        let mut len_bytes = [0u8; PREFIX];
        len_bytes.copy_from_slice(prefix);
        let len = u32::from_be_bytes(len_bytes) as usize;
        if len > self.cap {
            return Err(WireError::Oversized {
                len: len as u64,
                cap: self.cap as u64,
            });
        }
        Ok(Some(len))
    }

    /// A whole frame off the buffer, if one is there; otherwise make room for the rest of it.
    fn split(&mut self) -> Result<Option<Bytes>, WireError> {
        let Some(len) = self.prefix()? else {
            return Ok(None);
        };
        let total = PREFIX + len;
        if self.buf.len() >= total {
            self.buf.advance(PREFIX);
            return Ok(Some(self.buf.split_to(len).freeze()));
        }
        // At most the cap (checked above) plus the prefix.
        self.buf.reserve(total - self.buf.len());
        Ok(None)
    }
}

/// Read exactly one frame of at most `cap` bytes (used where a reader is not kept).
pub async fn read_frame<R: AsyncRead + Unpin>(inner: R, cap: usize) -> Result<Bytes, FrameError> {
    FrameReader::new(inner, cap).next().await
}

/// Write one frame whose body is `head` followed by `payload`.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    out: &mut W,
    head: &[u8],
    payload: &[u8],
) -> std::io::Result<()> {
    let len = u32::try_from(head.len() + payload.len()).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "a frame of {} bytes does not fit a 4-byte length",
                head.len() + payload.len()
            ),
        )
    })?;
    let mut first = Vec::with_capacity(PREFIX + head.len() + payload.len().min(COALESCE));
    first.extend_from_slice(&len.to_be_bytes());
    first.extend_from_slice(head);
    if payload.len() <= COALESCE {
        first.extend_from_slice(payload);
        out.write_all(&first).await?;
    } else {
        out.write_all(&first).await?;
        out.write_all(payload).await?;
    }
    out.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::block_on;

    #[test]
    fn frames_round_trip_through_a_stream() {
        block_on(async {
            let (mut a, b) = tokio::io::duplex(1024);
            let writer = tokio::spawn(async move {
                write_frame(&mut a, b"head", b"payload")
                    .await
                    .expect("write");
                write_frame(&mut a, b"", &vec![7u8; 100_000])
                    .await
                    .expect("write");
            });
            let mut reader = FrameReader::new(b, 1 << 20);
            assert_eq!(&reader.next().await.expect("first")[..], b"headpayload");
            assert_eq!(reader.next().await.expect("second").len(), 100_000);
            writer.await.expect("writer");
            assert!(matches!(reader.next().await, Err(FrameError::Closed)));
        });
    }

    #[test]
    fn oversized_length_is_refused_before_allocating() {
        block_on(async {
            let (mut a, b) = tokio::io::duplex(64);
            a.write_all(&u32::MAX.to_be_bytes()).await.expect("write");
            let mut reader = FrameReader::new(b, 256);
            match reader.next().await {
                Err(FrameError::Wire(WireError::Oversized { len, cap })) => {
                    assert_eq!((len, cap), (u32::MAX as u64, 256));
                }
                other => panic!("expected Oversized, got {other:?}"),
            }
            assert!(reader.buf.capacity() < 64 * 1024, "nothing reserved");
        });
    }

    #[test]
    fn exact_reads_take_nothing_past_the_frame() {
        block_on(async {
            let (mut a, b) = tokio::io::duplex(1024);
            let mut bytes = 5u32.to_be_bytes().to_vec();
            bytes.extend_from_slice(b"hello and what follows");
            a.write_all(&bytes).await.expect("write");
            let mut reader = FrameReader::new(b, 256);
            assert_eq!(&reader.next_exact().await.expect("frame")[..], b"hello");
            assert_eq!(reader.buffered(), 0);
            let mut rest = [0u8; 17];
            reader.inner.read_exact(&mut rest).await.expect("the rest");
            assert_eq!(&rest, b" and what follows");
        });
    }

    #[test]
    fn stream_ending_inside_a_frame_is_an_error() {
        block_on(async {
            let (mut a, b) = tokio::io::duplex(64);
            a.write_all(&10u32.to_be_bytes()).await.expect("write");
            a.write_all(b"abc").await.expect("write");
            drop(a);
            let mut reader = FrameReader::new(b, 256);
            assert!(matches!(reader.next().await, Err(FrameError::Io(_))));
        });
    }
}
