//! Learning-rate schedules: the factor the optimizer's base learning rate is multiplied by at each
//! global step, as a pure function of the step.
//!
//! The supervisor evaluates it when it commands `Apply` for global step `s` (the number of
//! optimizer steps taken before this one, counting the steps of a run this job resumed from), so
//! every shard server applies the same learning rate (docs/design.md I3: sharding never changes results),
//! and a resumed job continues the schedule where the checkpoint left it.
//!
//! [`LrSchedule::WarmupCosine`] is the schedule of HF `get_cosine_schedule_with_warmup` with a floor,
//! except that warm-up starts at `1 / warmup` rather than 0 (HF's first step has learning rate 0,
//! which wastes it):
//! - `s < warmup`: `(s + 1) / warmup`;
//! - after: `min + (1 − min) · ½ (1 + cos(π · p))`, `p = (s − warmup) / (total − warmup)` clamped
//!   to `[0, 1]`, so steps past `total` stay at `min`.

use serde::{Deserialize, Serialize};

/// See the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub enum LrSchedule {
    /// The base learning rate at every step.
    #[default]
    Constant,
    /// Linear warm-up, then cosine decay to `min_ratio` of the base rate at step `total_steps`.
    WarmupCosine {
        warmup_steps: u64,
        total_steps: u64,
        /// Floor of the factor, in `[0, 1]`.
        min_ratio: f64,
    },
}

impl LrSchedule {
    /// The factor of global step `step` (0-based).
    pub fn factor(&self, step: u64) -> f64 {
        match *self {
            LrSchedule::Constant => 1.0,
            LrSchedule::WarmupCosine {
                warmup_steps,
                total_steps,
                min_ratio,
            } => {
                let min = min_ratio.clamp(0.0, 1.0);
                if step < warmup_steps {
                    return (step + 1) as f64 / warmup_steps as f64;
                }
                let span = total_steps.saturating_sub(warmup_steps);
                let progress = if span == 0 {
                    1.0
                } else {
                    ((step - warmup_steps) as f64 / span as f64).min(1.0)
                };
                min + (1.0 - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }

    /// Checks the schedule: `min_ratio` finite in `[0, 1]`, `warmup_steps ≤ total_steps`.
    pub fn validate(&self) -> Result<(), String> {
        match *self {
            LrSchedule::Constant => Ok(()),
            LrSchedule::WarmupCosine {
                warmup_steps,
                total_steps,
                min_ratio,
            } => {
                if !(0.0..=1.0).contains(&min_ratio) {
                    return Err(format!(
                        "the schedule's min_ratio is {min_ratio}; it must be in [0, 1]"
                    ));
                }
                if warmup_steps > total_steps {
                    return Err(format!(
                        "the schedule warms up for {warmup_steps} steps but has only {total_steps}"
                    ));
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cosine(warmup_steps: u64, total_steps: u64, min_ratio: f64) -> LrSchedule {
        LrSchedule::WarmupCosine {
            warmup_steps,
            total_steps,
            min_ratio,
        }
    }

    #[test]
    fn constant_is_one_everywhere() {
        assert_eq!(LrSchedule::Constant.factor(0), 1.0);
        assert_eq!(LrSchedule::Constant.factor(u64::MAX), 1.0);
    }

    #[test]
    fn warmup_rises_linearly_from_one_step_to_full() {
        let s = cosine(4, 104, 0.0);
        let f: Vec<f64> = (0..5).map(|i| s.factor(i)).collect();
        assert_eq!(f, vec![0.25, 0.5, 0.75, 1.0, 1.0]);
    }

    #[test]
    fn cosine_reaches_half_at_mid_decay_and_the_floor_at_the_end() {
        let s = cosine(10, 110, 0.1);
        assert!((s.factor(60) - (0.1 + 0.9 * 0.5)).abs() < 1e-12);
        assert!((s.factor(110) - 0.1).abs() < 1e-12);
        assert!(
            (s.factor(10_000) - 0.1).abs() < 1e-12,
            "past the end it stays at the floor"
        );
        // Monotone non-increasing after the warm-up.
        let decay: Vec<f64> = (10..=110).map(|i| s.factor(i)).collect();
        assert!(decay.windows(2).all(|w| w[1] <= w[0]), "{decay:?}");
    }

    #[test]
    fn no_decay_span_sits_at_the_floor_after_warmup() {
        let s = cosine(3, 3, 0.2);
        assert_eq!(s.factor(2), 1.0);
        assert!((s.factor(3) - 0.2).abs() < 1e-12);
    }

    #[test]
    fn invalid_schedules_are_named() {
        assert!(cosine(5, 4, 0.0)
            .validate()
            .unwrap_err()
            .contains("warms up"));
        assert!(cosine(1, 4, 1.5)
            .validate()
            .unwrap_err()
            .contains("min_ratio"));
        assert!(cosine(1, 4, f64::NAN).validate().is_err());
        assert!(cosine(0, 4, 0.0).validate().is_ok());
    }
}
