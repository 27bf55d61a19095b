//! A transport wrapper that models link bandwidth: every transfer occupies the link of the
//! region's owner for `bytes / bytes_per_sec` seconds, transfers on one link queue behind each
//! other (serialised, FIFO by arrival), transfers on different links overlap. The bytes still move
//! through the wrapped backend, so contents and every contract C1–C5 are the inner backend's.
//!
//! Used by the simulated devices of the A/B benchmark to give communication a modelled cost that
//! scales with bytes and contention (many readers of one owner wait for each other). Waiting uses
//! `std::thread::sleep` on a blocking thread, not tokio's millisecond timer wheel, so
//! sub-millisecond transfers are not inflated.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;

use crate::{
    AccumulatorRegion, Dtype, EndpointId, PublishedRegion, ReadChunk, RegionHandle, Transport,
    TransportError, WriteTag,
};

/// Maps an owner endpoint to the link its transfers use (several endpoints may share a link).
pub type LinkOf = Arc<dyn Fn(EndpointId) -> u32 + Send + Sync>;

/// See the [module docs](self).
pub struct Throttled {
    inner: Arc<dyn Transport>,
    bytes_per_sec: f64,
    link_of: LinkOf,
    /// When each link is next free.
    links: Mutex<HashMap<u32, Instant>>,
}

impl std::fmt::Debug for Throttled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Throttled")
            .field("inner", &self.inner.backend())
            .field("bytes_per_sec", &self.bytes_per_sec)
            .finish()
    }
}

impl Throttled {
    /// Wrap `inner` with links of `bytes_per_sec` each; `link_of` maps owners to links. A
    /// non-finite or non-positive bandwidth means no throttling.
    pub fn new(inner: Arc<dyn Transport>, bytes_per_sec: f64, link_of: LinkOf) -> Self {
        Throttled {
            inner,
            bytes_per_sec,
            link_of,
            links: Mutex::new(HashMap::new()),
        }
    }

    /// One link per owner endpoint.
    pub fn per_endpoint(inner: Arc<dyn Transport>, bytes_per_sec: f64) -> Self {
        Self::new(inner, bytes_per_sec, Arc::new(|e| e))
    }

    /// Modelled seconds `bytes` occupy a link.
    pub fn seconds(&self, bytes: usize) -> f64 {
        if self.bytes_per_sec.is_finite() && self.bytes_per_sec > 0.0 {
            bytes as f64 / self.bytes_per_sec
        } else {
            0.0
        }
    }

    /// Reserve the owner's link for `bytes` and wait until the transfer would have finished.
    async fn occupy(&self, owner: EndpointId, bytes: usize) {
        let seconds = self.seconds(bytes);
        if seconds <= 0.0 {
            return;
        }
        let done = {
            let mut links = self.links.lock();
            let now = Instant::now();
            let free = links.entry((self.link_of)(owner)).or_insert(now);
            let start = (*free).max(now);
            *free = start + Duration::from_secs_f64(seconds);
            *free
        };
        let wait = done.saturating_duration_since(Instant::now());
        if wait.is_zero() {
            return;
        }
        if tokio::task::spawn_blocking(move || std::thread::sleep(wait))
            .await
            .is_err()
        {
            tokio::time::sleep_until(done.into()).await;
        }
    }
}

#[async_trait::async_trait]
impl Transport for Throttled {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn register_published(
        &self,
        owner: EndpointId,
        dtype: Dtype,
        initial: Bytes,
        version: u64,
    ) -> Result<Box<dyn PublishedRegion>, TransportError> {
        self.inner
            .register_published(owner, dtype, initial, version)
    }

    fn register_accumulator(
        &self,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<Box<dyn AccumulatorRegion>, TransportError> {
        self.inner.register_accumulator(owner, len, epoch)
    }

    async fn read(
        &self,
        handle: &RegionHandle,
        range: Range<usize>,
    ) -> Result<ReadChunk, TransportError> {
        // Check first: a refused request moves no bytes.
        let chunk = self.inner.read(handle, range).await?;
        self.occupy(handle.owner, chunk.bytes.len()).await;
        Ok(chunk)
    }

    async fn accumulate(
        &self,
        handle: &RegionHandle,
        offset: usize,
        data: Bytes,
        tag: WriteTag,
    ) -> Result<(), TransportError> {
        // The bytes cross the link before the owner applies them.
        self.occupy(handle.owner, data.len()).await;
        self.inner.accumulate(handle, offset, data, tag).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec;
    use crate::local::LocalTransport;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn transfers_on_one_link_serialise_and_on_two_links_overlap() {
        let inner: Arc<dyn Transport> = Arc::new(LocalTransport::new());
        // 4,000 bytes per 100 ms.
        let t = Arc::new(Throttled::per_endpoint(inner, 40_000.0));
        let data = codec::encode(Dtype::F32, &[1.0; 1000]);
        let a = t
            .register_published(0, Dtype::F32, data.clone(), 0)
            .unwrap();
        let b = t.register_published(1, Dtype::F32, data, 0).unwrap();
        let timed = |handles: Vec<RegionHandle>| {
            let t = t.clone();
            async move {
                let start = Instant::now();
                let reads = handles.iter().map(|h| t.read(h, 0..1000));
                for r in futures::future::join_all(reads).await {
                    r.unwrap();
                }
                start.elapsed()
            }
        };
        let same = timed(vec![a.handle(), a.handle()]).await;
        let apart = timed(vec![a.handle(), b.handle()]).await;
        // Two 100 ms transfers: back to back on one link, side by side on two.
        assert!(same >= Duration::from_millis(195), "{same:?}");
        assert!(apart < same, "{apart:?} vs {same:?}");
    }
}
