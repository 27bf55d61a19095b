//! Time as plain data: [`Timestamp`] (nanoseconds since the UNIX epoch) and the [`Clock`] the
//! actors inject into the pure cores.
//!
//! Guarantees:
//! - a [`Timestamp`] is a `u64` newtype: `Copy`, ordered, comparable across processes of one host
//!   (it is wall-clock based), safe to put in control messages (no `Instant`);
//! - [`SystemClock`] is **monotonic within a process**: it anchors one `(Instant, SystemTime)` pair
//!   the first time it is used and adds the monotonic time elapsed since, so a wall-clock jump
//!   (NTP) never makes it go backwards; [`SystemClock::at`] maps an `Instant` onto the same scale;
//! - [`ManualClock`] only moves when told to (tests).
//!
//! The policy cores never read a clock: they take `now: Timestamp` as an argument. `SystemClock`
//! is the one place here that reads one, and only the actors call it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Nanoseconds since the UNIX epoch. Arithmetic saturates (at the epoch and at `u64::MAX`, about
/// the year 2554) instead of panicking.
///
/// ```
/// use std::time::Duration;
/// use odc_policy::clock::Timestamp;
/// let t = Timestamp::from_nanos(1_000);
/// let later = t + Duration::from_micros(2);
/// assert_eq!(later.as_nanos(), 3_000);
/// assert_eq!(later.saturating_duration_since(t), Duration::from_micros(2));
/// assert_eq!(t.saturating_duration_since(later), Duration::ZERO);
/// ```
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The UNIX epoch.
    pub const EPOCH: Timestamp = Timestamp(0);

    pub const fn from_nanos(nanos: u64) -> Self {
        Timestamp(nanos)
    }

    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// `time` on this scale (saturating before the epoch and after `u64::MAX` nanoseconds).
    pub fn from_system_time(time: SystemTime) -> Self {
        let since = time.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
        Timestamp(u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    pub fn saturating_add(self, d: Duration) -> Timestamp {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Timestamp(self.0.saturating_add(nanos))
    }

    pub fn saturating_sub(self, d: Duration) -> Timestamp {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Timestamp(self.0.saturating_sub(nanos))
    }
}

impl std::ops::Add<Duration> for Timestamp {
    type Output = Timestamp;

    /// Saturating, see [`Timestamp::saturating_add`].
    fn add(self, d: Duration) -> Timestamp {
        self.saturating_add(d)
    }
}

impl std::ops::AddAssign<Duration> for Timestamp {
    fn add_assign(&mut self, d: Duration) {
        *self = self.saturating_add(d);
    }
}

impl std::fmt::Display for Timestamp {
    /// Seconds since the epoch with nanosecond digits, e.g. `1700000000.000000123s`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}.{:09}s",
            self.0 / 1_000_000_000,
            self.0 % 1_000_000_000
        )
    }
}

/// A source of [`Timestamp`]s.
pub trait Clock: Send + Sync {
    fn now(&self) -> Timestamp;
}

/// The process's clock: wall-clock anchored once, monotonic after (see the [module docs](self)).
///
/// ```
/// use odc_policy::clock::{Clock, SystemClock};
/// let a = SystemClock.now();
/// let b = SystemClock.now();
/// assert!(b >= a);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

/// The process-wide anchor of [`SystemClock`].
fn anchor() -> &'static (Instant, Timestamp) {
    static ANCHOR: OnceLock<(Instant, Timestamp)> = OnceLock::new();
    ANCHOR.get_or_init(|| {
        (
            Instant::now(),
            Timestamp::from_system_time(SystemTime::now()),
        )
    })
}

impl SystemClock {
    /// `instant` on the [`SystemClock`] scale (an `Instant` taken before the anchor maps before
    /// it), so spans measured with `Instant`s line up with [`SystemClock::now`].
    pub fn at(instant: Instant) -> Timestamp {
        let &(base, wall) = anchor();
        match instant.checked_duration_since(base) {
            Some(after) => wall.saturating_add(after),
            None => wall.saturating_sub(base.saturating_duration_since(instant)),
        }
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        SystemClock::at(Instant::now())
    }
}

/// A clock that moves only when told to, for tests of time-driven policies.
///
/// ```
/// use std::time::Duration;
/// use odc_policy::clock::{Clock, ManualClock, Timestamp};
/// let clock = ManualClock::new(Timestamp::from_nanos(5));
/// clock.advance(Duration::from_nanos(10));
/// assert_eq!(clock.now(), Timestamp::from_nanos(15));
/// clock.set(Timestamp::EPOCH);
/// assert_eq!(clock.now(), Timestamp::EPOCH);
/// ```
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    pub fn new(start: Timestamp) -> Self {
        ManualClock(AtomicU64::new(start.as_nanos()))
    }

    pub fn set(&self, to: Timestamp) {
        self.0.store(to.as_nanos(), Ordering::SeqCst);
    }

    pub fn advance(&self, by: Duration) {
        let now = self.now();
        self.set(now + by);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_nanos(self.0.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamp_arithmetic_saturates() {
        let max = Timestamp::from_nanos(u64::MAX);
        assert_eq!(max + Duration::from_secs(1), max);
        assert_eq!(max + Duration::MAX, max);
        assert_eq!(
            Timestamp::EPOCH.saturating_sub(Duration::from_secs(1)),
            Timestamp::EPOCH
        );
        assert_eq!(
            Timestamp::EPOCH.saturating_duration_since(max),
            Duration::ZERO
        );
        let mut t = Timestamp::from_nanos(1);
        t += Duration::from_nanos(2);
        assert_eq!(t.as_nanos(), 3);
        assert_eq!(
            Timestamp::from_nanos(1_500_000_000).to_string(),
            "1.500000000s"
        );
        assert_eq!(
            Timestamp::from_system_time(UNIX_EPOCH - Duration::from_secs(1)),
            Timestamp::EPOCH
        );
    }

    #[test]
    fn system_clock_is_monotonic_and_maps_instants() {
        let before = Instant::now();
        let a = SystemClock.now();
        let b = SystemClock.now();
        assert!(b >= a);
        let after = Instant::now();
        assert!(SystemClock::at(before) <= a && SystemClock::at(after) >= b);
        let later = after + Duration::from_millis(3);
        assert_eq!(
            SystemClock::at(later).saturating_duration_since(SystemClock::at(after)),
            Duration::from_millis(3)
        );
        // Close to the wall clock (anchored on it).
        let wall = Timestamp::from_system_time(SystemTime::now());
        let skew = wall
            .saturating_duration_since(a)
            .max(a.saturating_duration_since(wall));
        assert!(skew < Duration::from_secs(60), "{skew:?}");
    }

    #[test]
    fn manual_clock_moves_only_when_told() {
        let c = ManualClock::default();
        assert_eq!(c.now(), Timestamp::EPOCH);
        c.advance(Duration::from_millis(1));
        assert_eq!(c.now(), Timestamp::from_nanos(1_000_000));
    }
}
