//! How a reader opens a byte stream to an owner: [`Dial`], and its two kinds, [`TcpDial`] (an
//! owner's `host:port`: `tcp`, and the `rdma` backend's control connection) and [`UnixDial`] (an
//! owner's Unix socket: `shm`, and the `cuda` backend's acknowledged path). A dialled stream is
//! only bytes: the handshake and the requests on it are [`Peers`](super::Peers)'s.

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};

pub(crate) type BoxRead = Box<dyn AsyncRead + Send + Unpin>;
pub(crate) type BoxWrite = Box<dyn AsyncWrite + Send + Unpin>;

/// Opens a byte stream to a peer address (a TCP `host:port`, a Unix socket path).
#[async_trait::async_trait]
pub(crate) trait Dial: Send + Sync + 'static {
    async fn dial(&self, addr: &str) -> std::io::Result<(BoxRead, BoxWrite)>;
}

/// Dials an owner's TCP address, without Nagle's delay (a request is one frame, sent whole).
pub(crate) struct TcpDial;

#[async_trait::async_trait]
impl Dial for TcpDial {
    async fn dial(&self, addr: &str) -> std::io::Result<(BoxRead, BoxWrite)> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (read, write) = stream.into_split();
        Ok((Box::new(read), Box::new(write)))
    }
}

/// Dials an owner's Unix socket (a path).
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(crate) struct UnixDial;

#[async_trait::async_trait]
impl Dial for UnixDial {
    async fn dial(&self, addr: &str) -> std::io::Result<(BoxRead, BoxWrite)> {
        let stream = UnixStream::connect(addr).await?;
        let (read, write) = stream.into_split();
        Ok((Box::new(read), Box::new(write)))
    }
}
