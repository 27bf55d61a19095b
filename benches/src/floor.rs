//! The emulation's own floor: what one simulated compute span really costs on this machine.
//!
//! The simulated device ([`odc::sim`]) waits out each compute span with
//! `spawn_blocking(std::thread::sleep)` and takes what a wait overshot off the micro-batch's next
//! wait. That keeps totals right while spans are long next to the overshoot; once a span is shorter
//! than a few overshoots, the handoff to a blocking thread dominates and the emulation models the
//! machine, not the device. [`measure`] issues many short spans the same way, concurrently from as
//! many tasks as the run has devices, and reports the overshoot's median and 90th percentile;
//! [`EmulationFloor::warning`] says when a row's shortest modelled span is below
//! [`FAITHFUL_FACTOR`] times the floor, and at which time scale the row would be faithful.
//!
//! # Guarantees
//!
//! - [`measure`] returns finite, non-negative quantiles with `median ≤ p90` for any concurrency
//!   (including 0, treated as 1) and never panics.
//! - [`EmulationFloor::warning`] is `None` exactly when the span is at least [`FAITHFUL_FACTOR`] ×
//!   [`EmulationFloor::floor`] (or the span or floor is not a positive finite number), and the time
//!   scale it names makes the span at least that long.

use std::time::{Duration, Instant};

/// The length of one measured span request (a short span of the simulated device).
pub const REQUEST: Duration = Duration::from_micros(50);
/// How many times the floor a modelled span must last to be faithful.
pub const FAITHFUL_FACTOR: f64 = 5.0;
/// Spans measured in all (at least [`MIN_SPANS_PER_TASK`] per task).
const SPANS: usize = 4_000;
/// Spans per task at high concurrency.
const MIN_SPANS_PER_TASK: usize = 8;

/// The measured cost of one simulated compute span under load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EmulationFloor {
    /// The requested span length.
    pub request: Duration,
    /// Tasks issuing spans at once (the run's largest device count).
    pub concurrency: usize,
    /// Spans measured (after one warm-up span per task).
    pub spans: usize,
    /// Median of (actual − requested) span length.
    pub median: Duration,
    /// 90th percentile of the same.
    pub p90: Duration,
    /// What one step of a collective ring costs in this process ([`odc::sim::ring_step_latency`]);
    /// zero when not measured.
    pub ring_step: Duration,
}

/// Share of a collective micro-batch the emulation's own ring latency may take before a row is
/// flagged: collective mode exposes rings that compute cannot hide (a step's first all-gather, a
/// micro-batch's last reduce-scatter), whose steps cost microseconds on GPUs.
pub const RING_EXPOSED_LIMIT: f64 = 0.01;

/// Issues `concurrency` tasks that each wait out short spans as the simulated device does
/// (`spawn_blocking(std::thread::sleep(request))`), back to back, and measures their overshoot.
/// Runs on the current tokio runtime; takes tens of milliseconds at small concurrency.
pub async fn measure(concurrency: usize, request: Duration) -> EmulationFloor {
    let concurrency = concurrency.max(1);
    let per_task = SPANS.div_ceil(concurrency).max(MIN_SPANS_PER_TASK);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        tasks.spawn(async move {
            let mut overshoots = Vec::with_capacity(per_task);
            // One warm-up span: the blocking pool starts its threads lazily.
            for i in 0..=per_task {
                let start = Instant::now();
                let _ = tokio::task::spawn_blocking(move || std::thread::sleep(request)).await;
                if i > 0 {
                    overshoots.push(start.elapsed().saturating_sub(request));
                }
            }
            overshoots
        });
    }
    let mut all = Vec::with_capacity(concurrency * per_task);
    while let Some(done) = tasks.join_next().await {
        if let Ok(overshoots) = done {
            all.extend(overshoots);
        }
    }
    all.sort_unstable();
    EmulationFloor {
        request,
        concurrency,
        spans: all.len(),
        median: quantile(&all, 0.5),
        p90: quantile(&all, 0.9),
        ring_step: Duration::ZERO,
    }
}

/// The `q` quantile of sorted `values` (nearest rank); zero for none.
fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

impl EmulationFloor {
    /// The floor spans are compared with: the median overshoot, the typical real cost of a span
    /// beyond its request (the device carries each overshoot over to the next wait, so it is the
    /// typical overshoot, not the tail, that decides whether spans keep their modelled length).
    pub fn floor(&self) -> Duration {
        self.median
    }

    /// One line for the bench's header.
    pub fn describe(&self) -> String {
        format!(
            "emulation floor: a {} compute span issued by {} concurrent task(s) overshoots by {} (median) / {} (p90) over {} spans; modelled spans shorter than {:.0}× the median ({}) are not faithful",
            human(self.request.as_secs_f64()),
            self.concurrency,
            human(self.median.as_secs_f64()),
            human(self.p90.as_secs_f64()),
            self.spans,
            FAITHFUL_FACTOR,
            human(FAITHFUL_FACTOR * self.floor().as_secs_f64()),
        ) + &if self.ring_step > Duration::ZERO {
            format!(
                "; one collective ring step costs {} here (a few µs over NVLink)",
                human(self.ring_step.as_secs_f64())
            )
        } else {
            String::new()
        }
    }

    /// `None` if a modelled span of `span_seconds` (described by `what`) at `time_scale_ms` is at
    /// least [`FAITHFUL_FACTOR`] × the floor; otherwise a warning naming the time scale from which
    /// it would be.
    ///
    /// ```
    /// use std::time::Duration;
    /// use odc_bench::floor::EmulationFloor;
    /// let f = EmulationFloor {
    ///     request: Duration::from_micros(50), concurrency: 8, spans: 4000,
    ///     median: Duration::from_micros(40), p90: Duration::from_micros(100),
    ///     ring_step: Duration::ZERO,
    /// };
    /// assert_eq!(f.warning(600e-6, "forward span", 4.0), None);
    /// let w = f.warning(100e-6, "forward span", 4.0).unwrap();
    /// assert!(w.contains("--time-scale-ms 8.0"), "{w}");
    /// ```
    pub fn warning(&self, span_seconds: f64, what: &str, time_scale_ms: f64) -> Option<String> {
        let needed = FAITHFUL_FACTOR * self.floor().as_secs_f64();
        if !(span_seconds.is_finite() && span_seconds > 0.0 && needed > 0.0)
            || span_seconds >= needed
        {
            return None;
        }
        let scale = round_up_2(time_scale_ms * needed / span_seconds);
        Some(format!(
            "{what} {} < {:.0}× the emulation floor ({}): faithful from --time-scale-ms {scale}",
            human(span_seconds),
            FAITHFUL_FACTOR,
            human(self.floor().as_secs_f64()),
        ))
    }
}

impl EmulationFloor {
    /// `None` if the rings collective mode exposes per micro-batch — `exposed_rings` passes of
    /// `devices − 1` ring steps at [`EmulationFloor::ring_step`]: the last reduce-scatter of every
    /// micro-batch, plus the first all-gather of a step spread over its micro-batches — take at
    /// most [`RING_EXPOSED_LIMIT`] of a mean micro-batch of `micro_batch_seconds` modelled compute
    /// at `time_scale_ms`; otherwise a
    /// warning naming the share and the time scale from which it would be within the limit. It
    /// flags rows where the emulation's ring latency, not the paradigm, could decide part of the
    /// collective side's cost.
    ///
    /// ```
    /// use std::time::Duration;
    /// use odc_bench::floor::EmulationFloor;
    /// let f = EmulationFloor {
    ///     request: Duration::from_micros(50), concurrency: 8, spans: 4000,
    ///     median: Duration::from_micros(40), p90: Duration::from_micros(100),
    ///     ring_step: Duration::from_micros(20),
    /// };
    /// // 16 devices, two passes: 30 steps of 20 µs = 0.6 ms per micro-batch.
    /// assert_eq!(f.ring_warning(16, 2.0, 0.1, 4.0), None);
    /// let w = f.ring_warning(16, 2.0, 0.03, 4.0).unwrap();
    /// assert!(w.contains("2.0%") && w.contains("--time-scale-ms 8."), "{w}");
    /// ```
    pub fn ring_warning(
        &self,
        devices: usize,
        exposed_rings: f64,
        micro_batch_seconds: f64,
        time_scale_ms: f64,
    ) -> Option<String> {
        let steps = exposed_rings * devices.saturating_sub(1) as f64;
        let exposed = steps * self.ring_step.as_secs_f64();
        if !(micro_batch_seconds.is_finite() && micro_batch_seconds > 0.0 && exposed > 0.0) {
            return None;
        }
        let share = exposed / micro_batch_seconds;
        if share <= RING_EXPOSED_LIMIT {
            return None;
        }
        let scale = round_up_2(time_scale_ms * share / RING_EXPOSED_LIMIT);
        Some(format!(
            "the emulation's own ring latency ({steps:.0} ring steps of {} per micro-batch) is {:.1}% of a mean collective micro-batch, against {:.0}% allowed: within it from --time-scale-ms {scale}",
            human(self.ring_step.as_secs_f64()),
            share * 100.0,
            RING_EXPOSED_LIMIT * 100.0,
        ))
    }
}

/// `x` rounded up to two significant digits, as text without float noise (`52.3` → `53`,
/// `0.1234` → `0.13`, `1234` → `1300`).
fn round_up_2(x: f64) -> String {
    if !(x.is_finite() && x > 0.0) {
        return format!("{x}");
    }
    let exponent = x.log10().floor() as i32 - 1;
    let step = 10f64.powi(exponent);
    let mut v = (x / step).ceil() * step;
    // Guard against the division rounding a value just below x.
    if v < x {
        v += step;
    }
    let decimals = usize::try_from(-exponent).unwrap_or(0);
    format!("{v:.decimals$}")
}

/// Seconds as `NN µs`, `N.N ms` or `N.NN s`.
pub fn human(seconds: f64) -> String {
    if !seconds.is_finite() {
        return "n/a".into();
    }
    if seconds < 1e-3 {
        format!("{:.0} µs", seconds * 1e6)
    } else if seconds < 1.0 {
        format!("{:.1} ms", seconds * 1e3)
    } else {
        format!("{seconds:.2} s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floor(median_us: u64) -> EmulationFloor {
        EmulationFloor {
            request: REQUEST,
            concurrency: 4,
            spans: 100,
            median: Duration::from_micros(median_us),
            p90: Duration::from_micros(2 * median_us),
            ring_step: Duration::ZERO,
        }
    }

    #[test]
    fn quantiles_of_known_values() {
        let v: Vec<Duration> = (1..=10).map(Duration::from_micros).collect();
        assert_eq!(quantile(&v, 0.5), Duration::from_micros(6));
        assert_eq!(quantile(&v, 0.9), Duration::from_micros(9));
        assert_eq!(quantile(&v, 1.0), Duration::from_micros(10));
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
    }

    #[test]
    fn rounding_up_to_two_digits() {
        assert_eq!(round_up_2(52.3), "53");
        assert_eq!(round_up_2(52.0), "52");
        assert_eq!(round_up_2(0.1234), "0.13");
        assert_eq!(round_up_2(1234.0), "1300");
        assert_eq!(round_up_2(9.91), "10.0");
    }

    #[test]
    fn warning_names_a_faithful_time_scale() {
        let f = floor(100);
        assert_eq!(f.warning(500e-6, "span", 4.0), None);
        assert_eq!(f.warning(f64::NAN, "span", 4.0), None);
        assert_eq!(f.warning(0.0, "span", 4.0), None);
        assert_eq!(floor(0).warning(1e-9, "span", 4.0), None);
        let w = f.warning(23e-6, "forward span", 4.0).unwrap();
        // 4 ms × 500 µs / 23 µs = 86.96 → 87.
        assert!(w.contains("--time-scale-ms 87"), "{w}");
        assert!(w.contains("23 µs") && w.contains("100 µs"), "{w}");
        // The named scale makes the span faithful.
        let scaled = 23e-6 * 87.0 / 4.0;
        assert_eq!(f.warning(scaled, "forward span", 87.0), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn measure_reports_ordered_finite_quantiles() {
        let f = tokio::time::timeout(Duration::from_secs(60), measure(0, REQUEST))
            .await
            .expect("measuring the floor finishes");
        assert_eq!(f.concurrency, 1);
        assert!(f.spans >= MIN_SPANS_PER_TASK);
        assert!(f.median <= f.p90);
        assert!(f.describe().contains("p90"));
    }
}
