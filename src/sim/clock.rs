//! The virtual-time runner: the same [`Job`](crate::Job) — actors, policy, ledger, data paths,
//! local transport — on tokio's paused, auto-advancing current-thread runtime, where simulated
//! compute ([`SimDevice`](super::SimDevice)) and modelled transfers
//! ([`Throttled`](odc_transport::throttle::Throttled)) cost virtual time only while real bytes
//! still move.
//!
//! # Why tokio's paused clock, not madsim
//!
//! madsim replaces tokio (and so every crate built on it, ractor included) with its own executor:
//! running the real `Job` under it needs patched forks of ractor and tokio in the build. tokio's
//! own `start_paused(true)` runtime needs nothing but the `test-util` feature: the job's code is
//! unchanged, and the choice is made at run time ([`ClockMode`]), not by a fork (docs/design.md,
//! "Simulation"). What it does not give, and this module makes up for:
//!
//! - **Resolution.** tokio's timer counts whole milliseconds; under a paused clock a sleep ends on
//!   the next millisecond of virtual time. A simulation therefore runs its model [`DILATION`]
//!   times slower in virtual time (compute, link transfers and deadlines stretched, every measured
//!   duration shrunk back), so one tick is one modelled microsecond ([`ClockMode::dilation`]).
//! - **Time read by the runtime.** Stats, spans and the supervisor's deadlines read the job's
//!   [`Clock`] ([`JobBuilder::clock`](crate::JobBuilder::clock)): [`VirtualClock`] here. Transport
//!   deadlines already read tokio's clock (`odc_transport::now`).
//!
//! # Guarantees
//!
//! - A modelled wait of `d` ends exactly at the next tick at or after `d` (virtual), whatever the
//!   machine's load; wall time is spent only on real work (moving bytes, actors, policy).
//! - **Blocking work does not move the clock.** tokio stops auto-advancing while a
//!   `spawn_blocking` task runs on a current-thread runtime (the shard server's optimizer step runs
//!   there), so a deadline cannot fire because a blocking thread was slow in wall time: blocking
//!   work costs zero virtual time (tested below). The runtime spawns no other threads.
//! - **Deadlines (I6) hold in virtual time**: an operation past its deadline fails exactly as in
//!   wall time, at the deadline's virtual instant.
//! - **Determinism.** One thread polls every task in a fixed order and the clock moves only when
//!   all are idle, so the same inputs give the same virtual times: a benchmark's output is
//!   byte-identical across runs of the same seed (its figures are durations, never absolute
//!   times; [`VirtualClock`] starts at [`Timestamp::EPOCH`] in every run).

#[cfg(feature = "virtual-time")]
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use odc_actors::policy::clock::{Clock, SystemClock, Timestamp};
use odc_transport::throttle::Pace;

/// Virtual seconds per modelled second under [`ClockMode::Virtual`]: tokio's 1 ms timer tick is
/// one modelled microsecond.
pub const DILATION: u32 = 1000;

/// A [`Clock`] over tokio's clock, starting at [`Timestamp::EPOCH`] when made: virtual time on a
/// paused runtime (monotonic wall time elsewhere). Make it inside the runtime it measures.
///
/// ```
/// use odc::sim::clock::VirtualClock;
/// use odc::Clock;
/// let runtime = tokio::runtime::Builder::new_current_thread()
///     .enable_all()
///     .start_paused(true)
///     .build()
///     .unwrap();
/// runtime.block_on(async {
///     let clock = VirtualClock::new();
///     tokio::time::sleep(std::time::Duration::from_secs(3600)).await; // no wall time
///     assert_eq!(clock.now().as_nanos(), 3_600_000_000_000);
/// });
/// ```
#[derive(Debug, Clone, Copy)]
pub struct VirtualClock {
    origin: tokio::time::Instant,
}

impl VirtualClock {
    pub fn new() -> Self {
        VirtualClock {
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Default for VirtualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Timestamp {
        Timestamp::EPOCH + tokio::time::Instant::now().saturating_duration_since(self.origin)
    }
}

/// Which clock a simulation runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClockMode {
    /// Wall time: the emulation on this machine (multi-thread runtime, precise blocking sleeps).
    #[default]
    Wall,
    /// Virtual time: a fresh paused current-thread runtime per run ([`on_virtual_runtime`]).
    Virtual,
}

impl ClockMode {
    /// Name on the command line and in reports: `wall` or `virtual`.
    pub fn name(self) -> &'static str {
        match self {
            ClockMode::Wall => "wall",
            ClockMode::Virtual => "virtual",
        }
    }

    /// Runtime seconds per modelled second: 1 in wall time, [`DILATION`] in virtual time. A
    /// simulation multiplies its modelled durations (compute, transfers, timeouts) by it and
    /// divides what it measures by it.
    pub fn dilation(self) -> u32 {
        match self {
            ClockMode::Wall => 1,
            ClockMode::Virtual => DILATION,
        }
    }

    /// `d` of the model in runtime time (saturating).
    pub fn stretch(self, d: Duration) -> Duration {
        d.checked_mul(self.dilation()).unwrap_or(Duration::MAX)
    }

    /// `d` of runtime time in the model.
    pub fn shrink(self, d: Duration) -> Duration {
        d / self.dilation()
    }

    /// How modelled waits spend time.
    pub fn pace(self) -> Pace {
        match self {
            ClockMode::Wall => Pace::Wall,
            ClockMode::Virtual => Pace::Virtual,
        }
    }

    /// The job's clock; in virtual time, call it inside the paused runtime.
    pub fn clock(self) -> Arc<dyn Clock> {
        match self {
            ClockMode::Wall => Arc::new(SystemClock),
            ClockMode::Virtual => Arc::new(VirtualClock::new()),
        }
    }
}

/// Run `make()`'s future to completion on a fresh paused, auto-advancing current-thread runtime
/// on a thread of its own (callable from inside another runtime), so each run starts at virtual
/// time zero and shares nothing with the caller's runtime.
#[cfg(feature = "virtual-time")]
pub async fn on_virtual_runtime<F, Fut, T>(make: F) -> crate::Result<T>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T>,
    T: Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("odc-virtual-time".into())
        .spawn(move || {
            let outcome = virtual_runtime().map(|runtime| runtime.block_on(make()));
            // The receiver is gone only when the caller stopped waiting.
            let _ = tx.send(outcome);
        })
        .map_err(|e| crate::Error::Internal(format!("starting the virtual-time thread: {e}")))?;
    match rx.await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(crate::Error::Internal(format!(
            "building the virtual-time runtime: {e}"
        ))),
        Err(_) => Err(crate::Error::Internal(
            "the virtual-time run panicked".into(),
        )),
    }
}

/// A paused, auto-advancing current-thread runtime (see the [module docs](self)).
#[cfg(feature = "virtual-time")]
pub fn virtual_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paused() -> tokio::runtime::Runtime {
        virtual_runtime().expect("runtime")
    }

    /// tokio's behaviour the guarantees rest on: auto-advance waits for a blocking task, so a
    /// timer (a deadline) does not fire while blocking work runs, however long it takes in wall
    /// time; the blocking work costs no virtual time.
    #[test]
    fn auto_advance_waits_for_blocking_work() {
        paused().block_on(async {
            let clock = VirtualClock::new();
            let deadline = tokio::time::sleep(Duration::from_millis(10));
            let blocking = tokio::task::spawn_blocking(|| {
                std::thread::sleep(Duration::from_millis(50));
            });
            tokio::pin!(deadline);
            let first = tokio::select! {
                biased;
                _ = blocking => "blocking",
                _ = &mut deadline => "deadline",
            };
            assert_eq!(first, "blocking", "the deadline fired during blocking work");
            assert_eq!(clock.now(), Timestamp::EPOCH, "blocking work is free");
            deadline.await;
            assert_eq!(clock.now(), Timestamp::from_nanos(10_000_000));
        });
    }

    /// Why [`DILATION`]: tokio's timer ends a sleep on the next whole millisecond of virtual time.
    #[test]
    fn timer_resolution_is_one_millisecond() {
        paused().block_on(async {
            let clock = VirtualClock::new();
            tokio::time::sleep(Duration::from_micros(1_500)).await;
            assert_eq!(clock.now(), Timestamp::from_nanos(2_000_000));
            tokio::time::sleep(Duration::ZERO).await;
            assert_eq!(clock.now(), Timestamp::from_nanos(2_000_000));
        });
    }

    #[test]
    fn modes_stretch_and_shrink() {
        let d = Duration::from_micros(7);
        assert_eq!(ClockMode::Wall.stretch(d), d);
        assert_eq!(ClockMode::Virtual.stretch(d), Duration::from_millis(7));
        assert_eq!(ClockMode::Virtual.shrink(Duration::from_millis(7)), d);
        assert_eq!(ClockMode::Virtual.stretch(Duration::MAX), Duration::MAX);
        assert_eq!(ClockMode::Virtual.pace(), Pace::Virtual);
        assert_eq!(ClockMode::default().name(), "wall");
    }

    #[tokio::test]
    async fn a_virtual_run_has_a_runtime_of_its_own() {
        let outer = tokio::time::timeout(
            Duration::from_secs(60),
            on_virtual_runtime(|| async {
                let clock = VirtualClock::new();
                tokio::time::sleep(Duration::from_secs(86_400)).await;
                clock.now()
            }),
        )
        .await
        .expect("finishes at once in wall time")
        .expect("runs");
        assert_eq!(outer, Timestamp::from_nanos(86_400 * 1_000_000_000));
    }
}
