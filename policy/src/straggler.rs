//! Runtime straggler handling: estimate each trainer's speed from completed work and let dispatch
//! use it.
//!
//! A pure policy core (see [`crate`]): no clock. Times are plain `f64` seconds the caller
//! measured, so every decision is a function of its arguments and is unit-tested as such. The
//! supervisor drives it:
//! - on every completed micro-batch it calls [`SpeedEstimator::observe`] with the micro-batch's
//!   estimated cost (the cost model's unit) and the seconds the trainer spent on it;
//! - in dynamic dispatch, an idle trainer steals with earliest-finish estimates on these speeds
//!   ([`WorkQueue::steal`](crate::dispatch::WorkQueue::steal));
//! - between minibatches it plans with
//!   [`plan_static_weighted`](crate::balancer::plan_static_weighted) or
//!   [`plan_dynamic_weighted`](crate::balancer::plan_dynamic_weighted) on
//!   [`SpeedEstimator::speeds`];
//! - [`straggler_factor`] summarises the spread of speeds for reporting.
//!
//! ## Guarantees (tested)
//! - **S1 smoothing**: a trainer's speed is the exponential moving average of its observed
//!   `cost / seconds`, `speed ← α·sample + (1 − α)·speed`, the first observation initialising it.
//!   Observations that carry no information (non-finite or non-positive cost or seconds, a ratio
//!   that overflows or underflows, an unknown trainer) are ignored, so a speed, once known, is
//!   always finite and positive.
//! - **S2 totality**: [`SpeedEstimator::speeds`] gives every trainer a finite positive speed
//!   (unknown ones the mean of the known ones, or 1.0 when none is known).

/// Default smoothing factor of [`SpeedEstimator`]: each new observation weighs 30%, so a trainer
/// that halves its speed is estimated within 10% of its new speed after seven micro-batches.
pub const DEFAULT_ALPHA: f64 = 0.3;

/// Most trainers an estimator tracks: that of a plan ([`crate::balancer::MAX_TRAINERS`]).
const MAX_TRAINERS: usize = crate::balancer::MAX_TRAINERS;

fn valid_speed(speed: f64) -> bool {
    speed.is_finite() && speed > 0.0
}

/// Per-trainer speed in cost units per second, estimated from completed micro-batches and
/// smoothed by an exponential moving average (guarantees S1, S2 of the [module docs](self)).
///
/// Trainers are the supervisor's slots `0..trainers`, fixed at construction; a respawned trainer
/// reuses its slot and should be [`reset`](Self::reset).
///
/// ```
/// use odc_policy::straggler::SpeedEstimator;
/// let mut est = SpeedEstimator::new(2, 0.5);
/// est.observe(0, 10.0, 2.0); // first observation: 5 units/s
/// est.observe(0, 10.0, 1.0); // 10 units/s, smoothed: 0.5·10 + 0.5·5
/// assert_eq!(est.speed(0), Some(7.5));
/// assert_eq!(est.speed(1), None);
/// assert_eq!(est.speeds(), vec![7.5, 7.5]); // unknown: the mean of the known
/// assert_eq!(est.expected_seconds(0, 15.0), 2.0);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct SpeedEstimator {
    alpha: f64,
    speeds: Vec<Option<f64>>,
}

impl SpeedEstimator {
    /// An estimator for trainers `0..trainers` (at most
    /// [`MAX_TRAINERS`](crate::balancer::MAX_TRAINERS); higher slots are not tracked), every speed
    /// unknown. `alpha` is the weight of each new observation: a value above 1 is taken as 1 (no
    /// smoothing), a non-finite or non-positive one as [`DEFAULT_ALPHA`].
    pub fn new(trainers: usize, alpha: f64) -> Self {
        let alpha = if valid_speed(alpha) {
            alpha.min(1.0)
        } else {
            DEFAULT_ALPHA
        };
        Self {
            alpha,
            speeds: vec![None; trainers.min(MAX_TRAINERS)],
        }
    }

    /// The smoothing factor in use, in `(0, 1]`.
    pub fn alpha(&self) -> f64 {
        self.alpha
    }

    /// Number of trainer slots tracked.
    pub fn trainers(&self) -> usize {
        self.speeds.len()
    }

    /// Records that `trainer` completed work of estimated `cost` in `seconds`. Ignored (the
    /// estimate is unchanged) when `trainer` is not a tracked slot, when `cost` or `seconds` is
    /// not finite and positive, or when `cost / seconds` overflows or underflows to zero.
    pub fn observe(&mut self, trainer: usize, cost: f64, seconds: f64) {
        let Some(slot) = self.speeds.get_mut(trainer) else {
            return;
        };
        if !valid_speed(cost) || !valid_speed(seconds) {
            return;
        }
        let sample = cost / seconds;
        if !valid_speed(sample) {
            return;
        }
        *slot = Some(match *slot {
            None => sample,
            // `old + α·(sample − old)` cannot overflow; clamping keeps rounding from leaving the
            // interval between the two, so the speed stays finite and positive.
            Some(old) => {
                (old + self.alpha * (sample - old)).clamp(old.min(sample), old.max(sample))
            }
        });
    }

    /// The estimated speed of `trainer`, `None` while nothing is known of it (or it is not a
    /// tracked slot).
    pub fn speed(&self, trainer: usize) -> Option<f64> {
        self.speeds.get(trainer).copied().flatten()
    }

    /// The speed assumed for a trainer with no estimate: the mean of the known speeds, or 1.0
    /// when none is known.
    fn fallback(&self) -> f64 {
        // Incremental mean: no overflow however large the speeds.
        let (mean, known) = self
            .speeds
            .iter()
            .flatten()
            .fold((0.0, 0.0), |(mean, n), &s| {
                (mean + (s - mean) / (n + 1.0), n + 1.0)
            });
        if known > 0.0 {
            mean
        } else {
            1.0
        }
    }

    /// The speed of every tracked trainer, in slot order; a trainer with no estimate gets the mean
    /// of the known speeds (1.0 when none is known). Every value is finite and positive.
    pub fn speeds(&self) -> Vec<f64> {
        let fallback = self.fallback();
        self.speeds.iter().map(|s| s.unwrap_or(fallback)).collect()
    }

    /// [`speeds`](Self::speeds) divided by the fastest, so the fastest trainer is at 1.0 and every
    /// value is in `(0, 1]` — what [`plan_static_weighted`](crate::balancer::plan_static_weighted)
    /// takes. (A ratio that would underflow to 0 is clamped to the smallest positive normal
    /// `f64`.)
    pub fn relative_speeds(&self) -> Vec<f64> {
        let speeds = self.speeds();
        let fastest = speeds.iter().copied().fold(0.0, f64::max);
        speeds
            .into_iter()
            .map(|s| (s / fastest).max(f64::MIN_POSITIVE))
            .collect()
    }

    /// Forgets what is known of `trainer` (a respawned trainer starts unknown). Unknown slots are
    /// ignored.
    pub fn reset(&mut self, trainer: usize) {
        if let Some(slot) = self.speeds.get_mut(trainer) {
            *slot = None;
        }
    }

    /// Seconds `trainer` is expected to need for work of `cost`: `cost / speed`, with the speed of
    /// [`speeds`](Self::speeds) (the mean of the known ones for an unknown trainer). A cost that
    /// is not positive (or NaN) needs 0 seconds.
    pub fn expected_seconds(&self, trainer: usize, cost: f64) -> f64 {
        if cost.is_nan() || cost <= 0.0 {
            return 0.0;
        }
        cost / self.speed(trainer).unwrap_or_else(|| self.fallback())
    }
}

/// Slowest over fastest of the valid (finite, positive) `speeds`: 1.0 when all are equal, 0.5
/// with one trainer at half speed; 1.0 when there are no valid speeds.
///
/// ```
/// use odc_policy::straggler::straggler_factor;
/// assert_eq!(straggler_factor(&[1.0, 0.5, 1.0]), 0.5);
/// assert_eq!(straggler_factor(&[]), 1.0);
/// ```
pub fn straggler_factor(speeds: &[f64]) -> f64 {
    let valid = speeds.iter().copied().filter(|&s| valid_speed(s));
    let (slowest, fastest) = valid.fold((f64::INFINITY, 0.0_f64), |(lo, hi), s| {
        (lo.min(s), hi.max(s))
    });
    if fastest > 0.0 {
        slowest / fastest
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn close(x: f64, y: f64) -> bool {
        (x - y).abs() <= 1e-12 * y.abs().max(1.0)
    }

    #[test]
    fn s1_first_observation_initialises_then_ema() {
        let mut est = SpeedEstimator::new(3, 0.3);
        assert_eq!(est.alpha(), 0.3);
        assert_eq!(est.trainers(), 3);
        est.observe(1, 12.0, 3.0);
        assert_eq!(est.speed(1), Some(4.0));
        est.observe(1, 10.0, 1.0);
        assert!(close(est.speed(1).unwrap(), 0.3 * 10.0 + 0.7 * 4.0));
        est.observe(1, 2.0, 1.0);
        assert!(close(
            est.speed(1).unwrap(),
            0.3 * 2.0 + 0.7 * (0.3 * 10.0 + 0.7 * 4.0)
        ));
        assert_eq!(est.speed(0), None);
        assert_eq!(est.speed(2), None);
    }

    #[test]
    fn s1_alpha_one_keeps_only_the_last_observation() {
        let mut est = SpeedEstimator::new(1, 1.0);
        est.observe(0, 8.0, 2.0);
        est.observe(0, 3.0, 1.0);
        assert_eq!(est.speed(0), Some(3.0));
    }

    #[test]
    fn s1_invalid_alpha_is_sanitised() {
        assert_eq!(SpeedEstimator::new(1, 0.0).alpha(), DEFAULT_ALPHA);
        assert_eq!(SpeedEstimator::new(1, -0.5).alpha(), DEFAULT_ALPHA);
        assert_eq!(SpeedEstimator::new(1, f64::NAN).alpha(), DEFAULT_ALPHA);
        assert_eq!(SpeedEstimator::new(1, f64::INFINITY).alpha(), DEFAULT_ALPHA);
        assert_eq!(SpeedEstimator::new(1, 7.0).alpha(), 1.0);
    }

    #[test]
    fn s1_uninformative_observations_are_ignored() {
        let mut est = SpeedEstimator::new(2, 0.5);
        est.observe(0, 4.0, 2.0);
        let bad = [
            (0, 0.0, 1.0),
            (0, -1.0, 1.0),
            (0, f64::NAN, 1.0),
            (0, f64::INFINITY, 1.0),
            (0, 1.0, 0.0),
            (0, 1.0, -2.0),
            (0, 1.0, f64::NAN),
            (0, 1.0, f64::INFINITY),
            (0, f64::MAX, f64::MIN_POSITIVE), // overflows
            (0, f64::MIN_POSITIVE, f64::MAX), // underflows to 0
            (2, 1.0, 1.0),                    // not a slot
            (usize::MAX, 1.0, 1.0),
        ];
        for (trainer, cost, seconds) in bad {
            est.observe(trainer, cost, seconds);
            assert_eq!(est.speed(0), Some(2.0), "({trainer}, {cost}, {seconds})");
        }
        assert_eq!(est.speed(1), None);
        assert_eq!(est.trainers(), 2);
    }

    #[test]
    fn s2_unknown_trainers_get_the_mean_of_the_known() {
        let mut est = SpeedEstimator::new(4, 0.3);
        assert_eq!(est.speeds(), vec![1.0; 4]);
        assert_eq!(est.relative_speeds(), vec![1.0; 4]);
        est.observe(0, 6.0, 1.0);
        est.observe(2, 2.0, 1.0);
        assert_eq!(est.speeds(), vec![6.0, 4.0, 2.0, 4.0]);
        let relative = est.relative_speeds();
        assert_eq!(relative[0], 1.0);
        assert!(close(relative[2], 1.0 / 3.0));
        assert!(relative.iter().all(|&r| r > 0.0 && r <= 1.0));
        assert_eq!(SpeedEstimator::new(0, 0.3).speeds(), Vec::<f64>::new());
        assert_eq!(
            SpeedEstimator::new(0, 0.3).relative_speeds(),
            Vec::<f64>::new()
        );
    }

    #[test]
    fn s2_huge_speeds_do_not_overflow_the_mean() {
        let mut est = SpeedEstimator::new(3, 0.3);
        est.observe(0, f64::MAX, 1.0);
        est.observe(1, f64::MAX, 1.0);
        let speeds = est.speeds();
        assert!(
            speeds.iter().all(|s| s.is_finite() && *s > 0.0),
            "{speeds:?}"
        );
        assert!(close(speeds[2], f64::MAX));
    }

    #[test]
    fn reset_forgets_a_respawned_trainer() {
        let mut est = SpeedEstimator::new(2, 0.3);
        est.observe(0, 1.0, 1.0);
        est.observe(1, 3.0, 1.0);
        est.reset(1);
        assert_eq!(est.speed(1), None);
        assert_eq!(est.speeds(), vec![1.0, 1.0]);
        est.observe(1, 5.0, 1.0);
        assert_eq!(
            est.speed(1),
            Some(5.0),
            "first observation after reset initialises"
        );
        est.reset(9);
        assert_eq!(est.speed(0), Some(1.0));
    }

    #[test]
    fn expected_seconds_is_cost_over_speed() {
        let mut est = SpeedEstimator::new(3, 0.3);
        assert_eq!(est.expected_seconds(0, 3.0), 3.0);
        est.observe(0, 8.0, 2.0);
        est.observe(1, 2.0, 1.0);
        assert_eq!(est.expected_seconds(0, 8.0), 2.0);
        assert_eq!(est.expected_seconds(1, 8.0), 4.0);
        assert_eq!(est.expected_seconds(2, 9.0), 3.0, "unknown: mean speed 3");
        assert_eq!(
            est.expected_seconds(7, 9.0),
            3.0,
            "not a slot: mean speed 3"
        );
        assert_eq!(est.expected_seconds(0, 0.0), 0.0);
        assert_eq!(est.expected_seconds(0, -1.0), 0.0);
        assert_eq!(est.expected_seconds(0, f64::NAN), 0.0);
    }

    #[test]
    fn s1_estimator_follows_a_mid_run_slowdown() {
        let mut est = SpeedEstimator::new(1, DEFAULT_ALPHA);
        for _ in 0..10 {
            est.observe(0, 2.0, 1.0);
        }
        assert!(close(est.speed(0).unwrap(), 2.0));
        // The device halves its speed: within 10% after seven micro-batches, as documented.
        for _ in 0..6 {
            est.observe(0, 2.0, 2.0);
        }
        assert!(est.speed(0).unwrap() > 1.1, "not yet after six");
        est.observe(0, 2.0, 2.0);
        let speed = est.speed(0).unwrap();
        assert!(speed > 1.0 && speed < 1.1, "{speed}");
    }

    #[test]
    fn straggler_factor_is_slowest_over_fastest() {
        assert_eq!(straggler_factor(&[2.0, 2.0]), 1.0);
        assert_eq!(straggler_factor(&[1.0, 0.5, 0.75]), 0.5);
        assert_eq!(straggler_factor(&[4.0, f64::NAN, 0.0, -1.0, 1.0]), 0.25);
        assert_eq!(straggler_factor(&[f64::NAN]), 1.0);
        assert_eq!(straggler_factor(&[]), 1.0);
    }

    proptest! {
        #[test]
        fn s1_speeds_stay_finite_and_positive(
            observations in prop::collection::vec(
                (0usize..6, prop::num::f64::ANY, prop::num::f64::ANY), 0..60),
            alpha in prop::num::f64::ANY,
        ) {
            let mut est = SpeedEstimator::new(4, alpha);
            prop_assert!(est.alpha() > 0.0 && est.alpha() <= 1.0);
            for (trainer, cost, seconds) in observations {
                est.observe(trainer, cost, seconds);
            }
            prop_assert_eq!(est.speeds().len(), 4);
            for s in est.speeds().into_iter().chain(est.relative_speeds()) {
                prop_assert!(s.is_finite() && s > 0.0);
            }
            for r in est.relative_speeds() {
                prop_assert!(r <= 1.0);
            }
        }
    }
}
