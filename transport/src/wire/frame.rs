//! Length-prefixed frames: a 4-byte big-endian body length, then the body.
//!
//! The reader checks the length against its cap before it reserves anything, so a peer's length
//! field can make it allocate at most the cap (and before authentication the cap is a few hundred
//! bytes). A frame's body is handed out as `Bytes` split off the receive buffer: no copy.

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::WireError;

/// Bytes of the length prefix.
pub const PREFIX: usize = 4;

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
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(inner: R, cap: usize) -> Self {
        Self {
            inner,
            buf: BytesMut::with_capacity(8 * 1024),
            cap,
        }
    }

    /// The largest body accepted from now on.
    pub fn set_cap(&mut self, cap: usize) {
        self.cap = cap;
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The next frame's body. Cancel safe: bytes already read stay buffered.
    pub async fn next(&mut self) -> Result<Bytes, FrameError> {
        loop {
            if let Some(body) = self.split()? {
                return Ok(body);
            }
            if self.inner.read_buf(&mut self.buf).await? == 0 {
                return Err(if self.buf.is_empty() {
                    FrameError::Closed
                } else {
                    FrameError::Io(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "stream ended inside a frame ({} bytes buffered)",
                            self.buf.len()
                        ),
                    ))
                });
            }
        }
    }

    /// A whole frame off the buffer, if one is there; otherwise make room for the rest of it.
    fn split(&mut self) -> Result<Option<Bytes>, WireError> {
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

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(future)
    }

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
