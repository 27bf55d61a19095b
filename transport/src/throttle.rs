//! The link throttle: the one priced wrapper ([`crate::priced`]) with a [`LinkPricer`], which
//! models link bandwidth. Every transfer occupies the link of the region's owner for
//! `bytes / bytes_per_sec` seconds, transfers on one link queue behind each other (serialised,
//! FIFO by arrival), transfers on different links overlap. Reads, accumulates and inbox sends are
//! priced; the bytes still move through the wrapped backend, so contents and every contract
//! clause C1–C8 are the inner backend's.
//!
//! The link bookkeeping is [`LinkSchedule`], a pure function of the arrivals (no clock inside),
//! tested deterministically. [`Throttled`] asks it when a transfer is done and waits until then
//! at its [`Pace`]: in wall time ([`Pace::Wall`], the default) with `std::thread::sleep` on a
//! blocking thread, not tokio's millisecond timer wheel, so sub-millisecond transfers are not
//! inflated; in virtual time ([`Pace::Virtual`]) on tokio's timer, which under a paused,
//! auto-advancing runtime costs no wall time (the clock jumps to the transfer's end once every task
//! is idle). Arrivals and deadlines are read from tokio's clock ([`crate::now`]) in both.
//!
//! Deadlines (C6): an operation whose deadline has passed is refused before it reserves the link.
//! A transfer whose modelled end lies past its deadline waits until the deadline and fails with
//! [`TransportError::DeadlineExceeded`](crate::TransportError::DeadlineExceeded): an accumulate or
//! a send is then not applied (the bytes
//! would cross the link before the owner applies them); a read has already written its
//! destination, whose contents are then unspecified. The link stays reserved for the whole
//! modelled transfer either way.
//!
//! Used by the simulated devices of the A/B benchmark to give communication a modelled cost that
//! scales with bytes and contention (many readers of one owner wait for each other).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::deadline::now;
pub use crate::priced::Pace;
use crate::priced::{Priced, Pricer};
use crate::wrap::Wrapped;
use crate::{EndpointId, RegionHandle, Transport};

/// Maps an owner endpoint to the link its transfers use (several endpoints may share a link).
pub type LinkOf = Arc<dyn Fn(EndpointId) -> u32 + Send + Sync>;

/// The longest one transfer is modelled to take; longer (or non-finite) ones are clamped to it.
const MAX_TRANSFER: Duration = Duration::from_secs(365 * 24 * 3600);

/// When each link is next free. Pure bookkeeping: the caller passes the time a transfer arrives.
///
/// A transfer arriving at `now` on a link starts when the link is free (or at `now`, if it is
/// already free) and occupies it for its duration; transfers on different links never interact.
///
/// ```
/// use std::time::{Duration, Instant};
/// use odc_transport::throttle::LinkSchedule;
///
/// let t0 = Instant::now();
/// let mut links = LinkSchedule::default();
/// let first = links.reserve(0, t0, 1.0);
/// let second = links.reserve(0, t0, 1.0);
/// assert_eq!(second, first + Duration::from_secs(1));
/// ```
#[derive(Debug, Clone, Default)]
pub struct LinkSchedule {
    free_at: HashMap<u32, Instant>,
}

impl LinkSchedule {
    /// Reserve `link` for a transfer of `seconds` arriving at `now`; return when it is done.
    /// Negative or NaN durations count as zero, longer than a year as a year.
    pub fn reserve(&mut self, link: u32, now: Instant, seconds: f64) -> Instant {
        let duration = Duration::try_from_secs_f64(seconds.max(0.0))
            .unwrap_or(MAX_TRANSFER)
            .min(MAX_TRANSFER);
        let free = self.free_at.get(&link).copied().unwrap_or(now);
        let start = free.max(now);
        let done = start.checked_add(duration).unwrap_or(start);
        self.free_at.insert(link, done);
        done
    }
}

/// The link throttle's pricer: a link per owner (or as `link_of` groups them) of
/// `bytes_per_sec`, FIFO by arrival ([`LinkSchedule`]).
pub struct LinkPricer {
    bytes_per_sec: f64,
    link_of: LinkOf,
    links: Mutex<LinkSchedule>,
    pace: Pace,
}

impl std::fmt::Debug for LinkPricer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkPricer")
            .field("bytes_per_sec", &self.bytes_per_sec)
            .field("pace", &self.pace)
            .finish()
    }
}

impl LinkPricer {
    /// Modelled seconds `bytes` occupy a link.
    pub fn seconds(&self, bytes: usize) -> f64 {
        if self.bytes_per_sec.is_finite() && self.bytes_per_sec > 0.0 {
            bytes as f64 / self.bytes_per_sec
        } else {
            0.0
        }
    }

    /// Reserve the owner's link for `bytes`: when the transfer is done (`None`: free).
    fn occupy(&self, owner: EndpointId, bytes: usize) -> Option<Instant> {
        let seconds = self.seconds(bytes);
        (seconds > 0.0).then(|| {
            self.links
                .lock()
                .reserve((self.link_of)(owner), now(), seconds)
        })
    }
}

impl Pricer for LinkPricer {
    fn pace(&self) -> Pace {
        self.pace
    }
    fn read(&self, handle: &RegionHandle, range: Range<usize>, _: u64) -> Option<Instant> {
        self.occupy(
            handle.owner,
            range.len().saturating_mul(handle.dtype.size()),
        )
    }
    fn accumulate(&self, handle: &RegionHandle, _: usize, bytes: usize) -> Option<Instant> {
        self.occupy(handle.owner, bytes)
    }
    fn send(&self, inbox: &RegionHandle, bytes: usize) -> Option<Instant> {
        // The message crosses the inbox owner's link.
        self.occupy(inbox.owner, bytes)
    }
}

/// See the [module docs](self): the one priced wrapper ([`crate::priced`]) with link pricing.
pub type Throttled = Wrapped<Priced<LinkPricer>>;

impl Wrapped<Priced<LinkPricer>> {
    /// Wrap `inner` with links of `bytes_per_sec` each; `link_of` maps owners to links. A
    /// non-finite or non-positive bandwidth means no throttling.
    pub fn new(inner: Arc<dyn Transport>, bytes_per_sec: f64, link_of: LinkOf) -> Self {
        Wrapped(Priced::new(
            inner,
            LinkPricer {
                bytes_per_sec,
                link_of,
                links: Mutex::new(LinkSchedule::default()),
                pace: Pace::Wall,
            },
        ))
    }

    /// Wait for transfers at `pace` (default [`Pace::Wall`]).
    pub fn with_pace(mut self, pace: Pace) -> Self {
        self.0.pricer_mut().pace = pace;
        self
    }

    /// One link per owner endpoint.
    pub fn per_endpoint(inner: Arc<dyn Transport>, bytes_per_sec: f64) -> Self {
        Self::new(inner, bytes_per_sec, Arc::new(|e| e))
    }

    /// Modelled seconds `bytes` occupy a link.
    pub fn seconds(&self, bytes: usize) -> f64 {
        self.0.pricer().seconds(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec;
    use crate::local::LocalTransport;
    use crate::{Dest, Dtype, Op, TransportError, WriteTag};
    use bytes::Bytes;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn transfers_on_one_link_serialise() {
        let t0 = Instant::now();
        let mut links = LinkSchedule::default();
        let first = links.reserve(3, t0, 0.25);
        let second = links.reserve(3, t0, 0.5);
        assert_eq!(first, t0 + secs(0.25));
        assert_eq!(
            second,
            first + secs(0.5),
            "second starts when the first is done"
        );
    }

    #[test]
    fn transfers_on_different_links_overlap() {
        let t0 = Instant::now();
        let mut links = LinkSchedule::default();
        let a = links.reserve(0, t0, 0.25);
        let b = links.reserve(1, t0, 0.25);
        assert_eq!(a, t0 + secs(0.25));
        assert_eq!(b, t0 + secs(0.25), "another link is not delayed");
    }

    #[test]
    fn transfer_arriving_after_the_link_is_free_starts_at_its_arrival() {
        let t0 = Instant::now();
        let mut links = LinkSchedule::default();
        let first = links.reserve(0, t0, 0.25);
        let later = t0 + secs(1.0);
        let second = links.reserve(0, later, 0.5);
        assert!(later > first);
        assert_eq!(second, later + secs(0.5));
    }

    #[test]
    fn transfer_arriving_while_the_link_is_busy_queues() {
        let t0 = Instant::now();
        let mut links = LinkSchedule::default();
        let first = links.reserve(0, t0, 1.0);
        let second = links.reserve(0, t0 + secs(0.5), 1.0);
        assert_eq!(second, first + secs(1.0));
    }

    #[test]
    fn degenerate_durations_are_clamped() {
        let t0 = Instant::now();
        let mut links = LinkSchedule::default();
        assert_eq!(links.reserve(0, t0, -1.0), t0);
        assert_eq!(links.reserve(1, t0, f64::NAN), t0);
        assert_eq!(links.reserve(2, t0, f64::INFINITY), t0 + MAX_TRANSFER);
    }

    #[test]
    fn no_bandwidth_means_no_throttling() {
        let inner: Arc<dyn Transport> = Arc::new(LocalTransport::new());
        for bandwidth in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let t = Throttled::per_endpoint(Arc::clone(&inner), bandwidth);
            assert_eq!(t.seconds(1 << 30), 0.0);
        }
        let t = Throttled::per_endpoint(inner, 1000.0);
        assert_eq!(t.seconds(500), 0.5);
    }

    /// A transfer modelled to take 1000 s cannot meet a deadline 50 ms away: it fails with
    /// `DeadlineExceeded`, and an accumulate or a send that missed it is not applied. (Asserts on
    /// outcomes only, never on elapsed time.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn transfer_past_its_deadline_fails_and_writes_nothing() {
        // A whole-test timeout: a hang fails the test instead of CI.
        tokio::time::timeout(std::time::Duration::from_secs(120), async {
            let inner: Arc<dyn Transport> = Arc::new(LocalTransport::new());
            let t = Throttled::per_endpoint(Arc::clone(&inner), 4.0);
            let deadline = || crate::deadline_in(Duration::from_millis(50));
            let tag = WriteTag {
                epoch: 0,
                write_id: 1,
                token: 0,
            };

            let acc = t.register_accumulator(5, 1000, 0).expect("register");
            let result = t
                .accumulate(
                    &acc.handle(),
                    0,
                    codec::encode_f32(&[1.0; 1000]),
                    tag,
                    deadline(),
                )
                .await;
            assert!(
                matches!(result, Err(TransportError::DeadlineExceeded { owner: 5, op: Op::Accumulate, region }) if region == acc.handle().id),
                "{result:?}"
            );
            assert_eq!(acc.take(1), vec![0.0; 1000], "not applied");

            // Another owner's link is free, but this message is just as long.
            let inbox = t.register_inbox(6, 0).expect("register");
            let result = t
                .send(
                    &inbox.handle(),
                    tag,
                    Bytes::from(vec![0u8; 4000]),
                    deadline(),
                )
                .await;
            assert!(
                matches!(
                    result,
                    Err(TransportError::DeadlineExceeded {
                        owner: 6,
                        op: Op::Send,
                        ..
                    })
                ),
                "{result:?}"
            );
            // The refused message is not there (its write id is still free).
            let unthrottled = inner
                .send(
                    &inbox.handle(),
                    tag,
                    Bytes::from_static(b"x"),
                    crate::deadline_in(Duration::from_secs(10)),
                )
                .await;
            assert_eq!(unthrottled, Ok(()));

            let params = t
                .register_published(7, Dtype::F32, codec::encode_f32(&[1.0; 1000]), 1)
                .expect("register");
            let mut out = vec![0.0f32; 1000];
            let result = t
                .read(&params.handle(), 0..1000, Dest::F32(&mut out), deadline())
                .await;
            assert!(
                matches!(
                    result,
                    Err(TransportError::DeadlineExceeded {
                        owner: 7,
                        op: Op::Read,
                        ..
                    })
                ),
                "{result:?}"
            );
        })
        .await
        .expect("test timed out");
    }

    /// Virtual pace (C6 under a paused clock): transfers cost tokio's virtual time only, exactly
    /// as modelled; two on one link queue; one whose modelled end lies past its deadline fails at
    /// the deadline and is not applied.
    #[test]
    fn virtual_pace_costs_modelled_virtual_time() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let inner: Arc<dyn Transport> = Arc::new(LocalTransport::new());
            // 1000 bytes per second: 250 f32 elements take one second.
            let t = Throttled::per_endpoint(inner, 1000.0).with_pace(Pace::Virtual);
            let acc = t.register_accumulator(3, 250, 0).expect("register");
            let handle = acc.handle();
            let tag = |write_id| WriteTag {
                epoch: 0,
                write_id,
                token: 0,
            };
            let far = || crate::deadline_in(Duration::from_secs(3600));
            let t0 = tokio::time::Instant::now();
            let data = codec::encode_f32(&[1.0; 250]);
            let (a, b) = tokio::join!(
                t.accumulate(&handle, 0, data.clone(), tag(1), far()),
                t.accumulate(&handle, 0, data.clone(), tag(2), far()),
            );
            assert_eq!((a, b), (Ok(()), Ok(())));
            assert_eq!(t0.elapsed(), secs(2.0), "two transfers queue on one link");

            let t1 = tokio::time::Instant::now();
            let short = crate::deadline_in(Duration::from_millis(500));
            let late = t.accumulate(&handle, 0, data, tag(3), short).await;
            assert!(
                matches!(late, Err(TransportError::DeadlineExceeded { owner: 3, .. })),
                "{late:?}"
            );
            assert_eq!(t1.elapsed(), secs(0.5), "fails at its deadline");
            assert_eq!(acc.take(1), vec![2.0; 250], "the late one is not applied");
        });
    }
}
