//! Runtime straggler handling: estimate each trainer's speed from completed work and let dispatch
//! use it.
//!
//! A pure policy core (see [`crate::policy`]): no clock. Times are plain `f64` seconds the caller
//! measured, so every decision is a function of its arguments and is unit-tested as such. The
//! supervisor drives it:
//! - on every completed micro-batch it calls [`SpeedEstimator::observe`] with the micro-batch's
//!   estimated cost (the cost model's unit) and the seconds the trainer spent on it;
//! - in dynamic dispatch, when a trainer is idle it asks [`choose_micro_batch`] which remaining
//!   micro-batch that trainer should take, if any;
//! - in static dispatch, between minibatches it plans with
//!   [`plan_static_weighted`](crate::policy::balancer::plan_static_weighted) on
//!   [`SpeedEstimator::relative_speeds`];
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
//! - **S3 longest-first when nothing is known**: with all speeds equal and every other trainer
//!   idle, [`choose_micro_batch`] returns the costliest micro-batch (index 0), exactly the plain
//!   greedy longest-first dispatch; so does a lone trainer, whatever the speeds.
//! - **S4 progress**: a trainer at least as fast as every other live trainer always gets the
//!   costliest micro-batch. In particular, when every live trainer is idle, the fastest gets work,
//!   so dispatch cannot stall as long as the caller re-offers work to idle trainers whenever a
//!   trainer finishes (a trainer told to wait may be the right one for the next decision).
//! - **S5 no needless passing**: [`choose_micro_batch`] passes over a costlier micro-batch only
//!   if another live trainer, taking it as soon as that trainer is free, would finish it earlier
//!   than the idle trainer; it leaves the idle trainer idle only if that holds for every remaining
//!   micro-batch. (The converse does not hold: the idle trainer may take a micro-batch a faster
//!   peer could finish earlier, when that peer is better used on a costlier one — the half-speed
//!   example of [`choose_micro_batch`].)

/// Default smoothing factor of [`SpeedEstimator`]: each new observation weighs 30%, so a trainer
/// that halves its speed is estimated within 10% of its new speed after seven micro-batches.
pub const DEFAULT_ALPHA: f64 = 0.3;

/// Relative tolerance under which the idle trainer's finish time counts as "no later" than another
/// trainer's: measured speeds are noisy, and leaving a trainer idle pays only when another one is
/// clearly (more than 10%) faster.
const TIE_TOLERANCE: f64 = 0.10;

/// Most trainers an estimator tracks: that of a plan ([`crate::policy::balancer::MAX_TRAINERS`]).
const MAX_TRAINERS: usize = crate::policy::balancer::MAX_TRAINERS;

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
/// use odc_actors::policy::straggler::SpeedEstimator;
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
    /// [`MAX_TRAINERS`](crate::policy::balancer::MAX_TRAINERS); higher slots are not tracked), every speed
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
    /// value is in `(0, 1]` — what [`plan_static_weighted`](crate::policy::balancer::plan_static_weighted)
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

/// Speed-aware dynamic dispatch for one idle trainer: which of the `remaining` micro-batches it
/// should take now, or `None` to stay idle because every remaining micro-batch is better left to
/// a faster trainer.
///
/// - `remaining`: costs of the undispatched micro-batches, sorted descending; the result is an
///   index into it.
/// - `idle_speed`: the idle trainer's speed (cost units per second).
/// - `others`: for every *other live* trainer, `(seconds until it is free, speed)`: 0 seconds for
///   an idle one, the estimated rest of its current micro-batch for a busy one (0 when overdue).
///
/// Policy: greedy earliest-finish-time list scheduling on uniform machines. The remaining
/// micro-batches are placed costliest first, each on the trainer that would finish it first
/// (`free + cost / speed`; the idle trainer is free now), as if every trainer followed this rule;
/// the idle trainer takes the first micro-batch that lands on it. With equal speeds that is the
/// costliest (plain longest-first); a slower trainer leaves the costly micro-batches to the
/// faster trainers that will finish them first and takes a cheaper one it finishes before they
/// could get to it; when that is none of them, it stays idle. Ties (within a relative 1e-9) go to
/// the idle trainer. The guarantees S3–S5 of the [module docs](self) hold; `O(len · others)`.
///
/// Lenient input: an empty `remaining` gives `None`; a NaN or negative cost counts as 0; an
/// invalid `idle_speed` (not finite and positive) falls back to plain longest-first (`Some(0)`);
/// a peer with an invalid speed or a NaN free time is ignored, a negative free time counts as 0.
/// An unsorted `remaining` still gives a valid index.
///
/// ```
/// use odc_actors::policy::straggler::choose_micro_batch;
/// // A half-speed trainer next to an idle full-speed one: the fast one should take the 10
/// // (done at 10 s), the slow one the 1 (done at 2 s, not at 20 s).
/// assert_eq!(choose_micro_batch(&[10.0, 1.0], 0.5, &[(0.0, 1.0)]), Some(1));
/// // Equal speeds: plain longest-first.
/// assert_eq!(choose_micro_batch(&[10.0, 1.0], 1.0, &[(0.0, 1.0)]), Some(0));
/// ```
pub fn choose_micro_batch(
    remaining: &[f64],
    idle_speed: f64,
    others: &[(f64, f64)],
) -> Option<usize> {
    if remaining.is_empty() {
        return None;
    }
    if !valid_speed(idle_speed) {
        return Some(0);
    }
    // (seconds until free, speed) of every peer that can take work.
    let mut peers: Vec<(f64, f64)> = others
        .iter()
        .filter(|&&(free, speed)| valid_speed(speed) && !free.is_nan())
        .map(|&(free, speed)| (free.max(0.0), speed))
        .collect();
    for (index, &cost) in remaining.iter().enumerate() {
        let cost = cost.max(0.0); // NaN → 0 as well
        let mine = cost / idle_speed;
        let theirs = peers
            .iter()
            .enumerate()
            .map(|(p, &(free, speed))| (p, free + cost / speed))
            .min_by(|x, y| x.1.total_cmp(&y.1).then(x.0.cmp(&y.0)));
        match theirs {
            Some((p, finish)) if mine > finish * (1.0 + TIE_TOLERANCE) => peers[p].0 = finish,
            _ => return Some(index),
        }
    }
    None
}

/// Slowest over fastest of the valid (finite, positive) `speeds`: 1.0 when all are equal, 0.5
/// with one trainer at half speed; 1.0 when there are no valid speeds.
///
/// ```
/// use odc_actors::policy::straggler::straggler_factor;
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
    fn choose_half_speed_trainer_takes_the_cheap_one() {
        assert_eq!(
            choose_micro_batch(&[10.0, 1.0], 0.5, &[(0.0, 1.0)]),
            Some(1)
        );
    }

    #[test]
    fn choose_equal_speeds_is_longest_first() {
        assert_eq!(
            choose_micro_batch(&[10.0, 1.0], 1.0, &[(0.0, 1.0)]),
            Some(0)
        );
        assert_eq!(
            choose_micro_batch(&[10.0, 7.0, 1.0], 0.3, &[(0.0, 0.3), (4.0, 0.3)]),
            Some(0)
        );
    }

    #[test]
    fn choose_very_slow_trainer_stays_idle() {
        let fast_free = [(0.0, 1.0), (0.0, 1.0)];
        assert_eq!(choose_micro_batch(&[5.0, 4.0, 3.0], 0.01, &fast_free), None);
        assert_eq!(choose_micro_batch(&[1.0], 0.5, &[(0.0, 1.0)]), None);
        // The same trainer takes work when the fast ones are busy for long enough.
        // ... when the fast ones are busy for long enough: one of them would finish the 5 at 405,
        // the other the 4 at 404, but the slow trainer finishes the 4 at 400.
        let fast_busy = [(400.0, 1.0), (400.0, 1.0)];
        assert_eq!(
            choose_micro_batch(&[5.0, 4.0, 3.0], 0.01, &fast_busy),
            Some(1)
        );
    }

    #[test]
    fn choose_middle_micro_batch_when_that_is_where_it_lands() {
        // The fast peer takes the 10 (done at 10); the half-speed trainer finishes the 4 at 8,
        // before the peer could (14).
        assert_eq!(
            choose_micro_batch(&[10.0, 4.0, 1.0], 0.5, &[(0.0, 1.0)]),
            Some(1)
        );
    }

    #[test]
    fn choose_lenient_input() {
        assert_eq!(choose_micro_batch(&[], 1.0, &[]), None);
        assert_eq!(choose_micro_batch(&[], 1.0, &[(0.0, 1.0)]), None);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(
                choose_micro_batch(&[10.0, 1.0], bad, &[(0.0, 100.0)]),
                Some(0)
            );
        }
        // Peers with invalid speeds or NaN free times are ignored.
        let broken = [
            (0.0, 0.0),
            (0.0, -1.0),
            (0.0, f64::NAN),
            (0.0, f64::INFINITY),
            (f64::NAN, 100.0),
        ];
        assert_eq!(choose_micro_batch(&[10.0, 1.0], 0.5, &broken), Some(0));
        // Negative free time counts as 0; NaN costs as 0.
        assert_eq!(
            choose_micro_batch(&[10.0, 1.0], 0.5, &[(-5.0, 1.0)]),
            Some(1)
        );
        assert_eq!(choose_micro_batch(&[f64::NAN], 0.5, &[(0.0, 1.0)]), Some(0));
        assert_eq!(
            choose_micro_batch(&[f64::INFINITY], 0.5, &[(0.0, 1.0)]),
            Some(0)
        );
    }

    #[test]
    fn straggler_factor_is_slowest_over_fastest() {
        assert_eq!(straggler_factor(&[2.0, 2.0]), 1.0);
        assert_eq!(straggler_factor(&[1.0, 0.5, 0.75]), 0.5);
        assert_eq!(straggler_factor(&[4.0, f64::NAN, 0.0, -1.0, 1.0]), 0.25);
        assert_eq!(straggler_factor(&[f64::NAN]), 1.0);
        assert_eq!(straggler_factor(&[]), 1.0);
    }

    /// Dynamic dispatch in simulated time: every trainer starts idle; whenever one finishes, every
    /// idle trainer (in index order) is offered work by `pick`. Returns the makespan.
    fn simulate(
        costs: &[f64],
        speeds: &[f64],
        pick: impl Fn(&[f64], usize, &[f64], &[f64], f64) -> Option<usize>,
    ) -> f64 {
        let mut remaining = costs.to_vec();
        remaining.sort_by(|x, y| y.total_cmp(x));
        let mut busy_until = vec![0.0_f64; speeds.len()];
        let mut now = 0.0_f64;
        while !remaining.is_empty() {
            for t in 0..speeds.len() {
                if busy_until[t] > now || remaining.is_empty() {
                    continue;
                }
                if let Some(i) = pick(&remaining, t, speeds, &busy_until, now) {
                    busy_until[t] = now + remaining.remove(i) / speeds[t];
                }
            }
            // Advance to the next completion (a trainer that could not be given work waits).
            match busy_until
                .iter()
                .copied()
                .filter(|&b| b > now)
                .reduce(f64::min)
            {
                Some(next) => now = next,
                None => break,
            }
        }
        assert!(remaining.is_empty(), "dispatch stalled with {remaining:?}");
        busy_until.iter().copied().fold(0.0, f64::max)
    }

    fn speed_aware(
        remaining: &[f64],
        t: usize,
        speeds: &[f64],
        busy_until: &[f64],
        now: f64,
    ) -> Option<usize> {
        let others: Vec<(f64, f64)> = (0..speeds.len())
            .filter(|&o| o != t)
            .map(|o| ((busy_until[o] - now).max(0.0), speeds[o]))
            .collect();
        choose_micro_batch(remaining, speeds[t], &others)
    }

    #[test]
    fn s4_speed_aware_dispatch_beats_longest_first_with_a_half_speed_trainer() {
        // Eight trainers, trainer 0 at half speed (it is offered work first at every decision).
        let mut speeds = vec![1.0; 8];
        speeds[0] = 0.5;
        let costs: Vec<f64> = (0..32).map(|i| 1.0 + ((i * 37) % 23) as f64).collect();
        let plain = simulate(&costs, &speeds, |_, _, _, _, _| Some(0));
        let aware = simulate(&costs, &speeds, speed_aware);
        let bound = costs.iter().sum::<f64>() / speeds.iter().sum::<f64>();
        assert!(
            aware < plain,
            "speed-aware {aware} vs longest-first {plain}"
        );
        assert!(aware <= 1.1 * bound, "speed-aware {aware} vs bound {bound}");
    }

    fn descending(mut costs: Vec<f64>) -> Vec<f64> {
        costs.sort_by(|x, y| y.total_cmp(x));
        costs
    }

    proptest! {
        #[test]
        fn s3_equal_speeds_all_free_is_longest_first(
            remaining in prop::collection::vec(0.0f64..100.0, 1..40).prop_map(descending),
            speed in 1e-3f64..1e3,
            peers in 0usize..16,
        ) {
            let others = vec![(0.0, speed); peers];
            prop_assert_eq!(choose_micro_batch(&remaining, speed, &others), Some(0));
        }

        #[test]
        fn s3_lone_trainer_always_takes_the_costliest(
            remaining in prop::collection::vec(0.0f64..100.0, 1..40).prop_map(descending),
            speed in 1e-3f64..1e3,
        ) {
            prop_assert_eq!(choose_micro_batch(&remaining, speed, &[]), Some(0));
        }

        #[test]
        fn s4_fastest_trainer_takes_the_costliest(
            remaining in prop::collection::vec(0.0f64..100.0, 1..40).prop_map(descending),
            others in prop::collection::vec((0.0f64..50.0, 0.01f64..1.0), 0..16),
            boost in 1.0f64..4.0,
        ) {
            let fastest = others.iter().map(|o| o.1).fold(1.0, f64::max) * boost;
            prop_assert_eq!(choose_micro_batch(&remaining, fastest, &others), Some(0));
        }

        #[test]
        fn s5_passes_over_work_only_for_a_faster_finish(
            remaining in prop::collection::vec(0.0f64..100.0, 0..40).prop_map(descending),
            idle_speed in 0.01f64..4.0,
            others in prop::collection::vec((0.0f64..50.0, 0.01f64..4.0), 0..16),
        ) {
            // Whether another trainer, taking it when free, finishes `c` earlier than the idle one.
            let better_elsewhere = |c: f64| {
                let theirs = others
                    .iter()
                    .map(|&(free, speed)| free + c / speed)
                    .fold(f64::INFINITY, f64::min);
                c / idle_speed > theirs
            };
            let passed = match choose_micro_batch(&remaining, idle_speed, &others) {
                None => remaining.len(),
                Some(i) => {
                    prop_assert!(i < remaining.len());
                    i
                }
            };
            for &c in &remaining[..passed] {
                prop_assert!(better_elsewhere(c), "passed over {} in {:?}", c, remaining);
            }
        }

        #[test]
        fn choose_never_panics_or_leaves_range(
            remaining in prop::collection::vec(prop::num::f64::ANY, 0..20),
            idle_speed in prop::num::f64::ANY,
            others in prop::collection::vec((prop::num::f64::ANY, prop::num::f64::ANY), 0..8),
        ) {
            if let Some(i) = choose_micro_batch(&remaining, idle_speed, &others) {
                prop_assert!(i < remaining.len());
            }
            let lone = choose_micro_batch(&remaining, idle_speed, &[]);
            prop_assert_eq!(lone.is_some(), !remaining.is_empty());
        }

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
