//! Virtual time checked against wall time (`odc-bench ab --clock both`): every row runs under both
//! clocks, and [`ClockRatio`] holds virtual / wall of its tokens/s and speedup. Where the wall-time
//! emulation is faithful (a large time scale, at most 16 devices, no emulation warning) the two
//! model the same system, so the ratios should lie within [`TARGET`] of 1.

use crate::report::{self, BenchRow};

/// Largest |ratio − 1| for virtual time to count as validated against a faithful wall-time row.
pub const TARGET: f64 = 0.03;

/// Virtual / wall of one row's figures.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ClockRatio {
    pub workload: String,
    pub devices: usize,
    pub minibatch_per_device: usize,
    pub dispatch: String,
    /// Collective tokens/s, virtual / wall.
    pub collective_tokens_per_s: f64,
    /// On-demand tokens/s, virtual / wall.
    pub ondemand_tokens_per_s: f64,
    /// On-demand speedup over collective, virtual / wall.
    pub speedup: f64,
    /// Whether the wall row carried an emulation warning (its ratio then says little).
    pub wall_warned: bool,
}

impl ClockRatio {
    /// The ratios of `virtual_row` to `wall` (the same cell under the two clocks).
    ///
    /// ```
    /// use odc_bench::report::BenchRow;
    /// use odc_bench::validate::ClockRatio;
    /// let wall = BenchRow {
    ///     workload: "rl".into(), devices: 4, minibatch_per_device: 2, dispatch: "static".into(),
    ///     baseline: "fsdp".into(), collective_tokens_per_s: 100.0, ondemand_tokens_per_s: 120.0, speedup: 1.2,
    ///     collective_utilization: 0.5, ondemand_utilization: 0.6, bound_tokens_per_s: 200.0,
    ///     achievable_bound_tokens_per_s: 150.0, ondemand_over_achievable: 0.8,
    ///     control_speedup: None, emulation_warning: None,
    /// };
    /// let virt = BenchRow { ondemand_tokens_per_s: 123.0, speedup: 1.23, ..wall.clone() };
    /// let r = ClockRatio::of(&wall, &virt);
    /// assert_eq!(r.collective_tokens_per_s, 1.0);
    /// assert!((r.ondemand_tokens_per_s - 1.025).abs() < 1e-12);
    /// assert!((r.worst() - 0.025).abs() < 1e-12);
    /// ```
    pub fn of(wall: &BenchRow, virtual_row: &BenchRow) -> ClockRatio {
        ClockRatio {
            workload: wall.workload.clone(),
            devices: wall.devices,
            minibatch_per_device: wall.minibatch_per_device,
            dispatch: wall.dispatch.clone(),
            collective_tokens_per_s: report::ratio(
                virtual_row.collective_tokens_per_s,
                wall.collective_tokens_per_s,
            ),
            ondemand_tokens_per_s: report::ratio(
                virtual_row.ondemand_tokens_per_s,
                wall.ondemand_tokens_per_s,
            ),
            speedup: report::ratio(virtual_row.speedup, wall.speedup),
            wall_warned: wall.emulation_warning.is_some(),
        }
    }

    /// Largest |ratio − 1| of the three (infinite if one is not finite or zero).
    pub fn worst(&self) -> f64 {
        [
            self.collective_tokens_per_s,
            self.ondemand_tokens_per_s,
            self.speedup,
        ]
        .into_iter()
        .map(|r| {
            if r.is_finite() && r > 0.0 {
                (r - 1.0).abs()
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
    }

    /// One line for the table: `virtual/wall: collective 1.002, on-demand 0.998, speedup 0.996`.
    pub fn line(&self) -> String {
        format!(
            "virtual/wall: collective tok/s {:.3}, on-demand tok/s {:.3}, speedup {:.3}{}",
            self.collective_tokens_per_s,
            self.ondemand_tokens_per_s,
            self.speedup,
            if self.worst() <= TARGET {
                ""
            } else if self.wall_warned {
                " (off target; the wall row carries an emulation warning)"
            } else {
                " (off target)"
            }
        )
    }
}
