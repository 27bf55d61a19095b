//! On-demand against the best collective baseline: the rows of one matrix cell (workload,
//! devices, samples per device, dispatch) measured against several collective variants (FSDP,
//! static CP of 2/4/8, dynamic CP), folded into one line.
//!
//! Each row's speedup is measured in one A/B (ABBA) of its own, so the ratio against the best
//! baseline is the **smallest** of the cell's speedups: on-demand over the fastest collective,
//! never a quotient of runs from different rows. A cell's balanced control is folded the same way
//! (its own rows' controls, each 1.00 when that comparison is fair).

use crate::report::BenchRow;

/// One cell against every baseline it was measured with.
#[derive(Debug, Clone, PartialEq)]
pub struct AgainstBest {
    pub workload: String,
    pub devices: usize,
    pub minibatch_per_device: usize,
    pub dispatch: String,
    /// The baseline with the smallest speedup (the fastest collective), and that speedup.
    pub best: String,
    pub speedup: f64,
    /// Every baseline's speedup and control, in the order the rows came.
    pub each: Vec<(String, f64, Option<f64>)>,
}

/// The cells of `rows` measured against more than one baseline, in the order they first appear.
/// Rows whose speedup is not finite are left out of the minimum.
///
/// ```
/// use odc_bench::baselines::against_best;
/// use odc_bench::report::BenchRow;
/// let row = |baseline: &str, speedup: f64| BenchRow {
///     workload: "longalign".into(), devices: 64, minibatch_per_device: 4, dispatch: "static".into(),
///     baseline: baseline.into(), collective_tokens_per_s: 1.0, ondemand_tokens_per_s: speedup,
///     speedup, collective_utilization: 0.5, ondemand_utilization: 0.9, bound_tokens_per_s: 2.0,
///     achievable_bound_tokens_per_s: 2.0, ondemand_over_achievable: 0.5,
///     control_speedup: Some(1.0), emulation_warning: None,
/// };
/// let cells = against_best(&[row("fsdp", 1.5), row("cp4", 1.9), row("dcp", 1.3)]);
/// assert_eq!(cells.len(), 1);
/// assert_eq!((cells[0].best.as_str(), cells[0].speedup), ("dcp", 1.3));
/// ```
pub fn against_best(rows: &[BenchRow]) -> Vec<AgainstBest> {
    let mut cells: Vec<AgainstBest> = Vec::new();
    for r in rows {
        let same = |c: &AgainstBest| {
            c.workload == r.workload
                && c.devices == r.devices
                && c.minibatch_per_device == r.minibatch_per_device
                && c.dispatch == r.dispatch
        };
        let entry = (r.baseline.clone(), r.speedup, r.control_speedup);
        match cells.iter_mut().find(|c| same(c)) {
            Some(c) => c.each.push(entry),
            None => cells.push(AgainstBest {
                workload: r.workload.clone(),
                devices: r.devices,
                minibatch_per_device: r.minibatch_per_device,
                dispatch: r.dispatch.clone(),
                best: String::new(),
                speedup: f64::NAN,
                each: vec![entry],
            }),
        }
    }
    cells.retain(|c| c.each.len() > 1);
    for c in &mut cells {
        let best = c
            .each
            .iter()
            .filter(|(_, s, _)| s.is_finite())
            .min_by(|a, b| a.1.total_cmp(&b.1));
        if let Some((name, speedup, _)) = best {
            c.best = name.clone();
            c.speedup = *speedup;
        }
    }
    cells
}

/// The cells as a Markdown table: on-demand over the best baseline, then each baseline's
/// speedup with its control in parentheses.
pub fn table(cells: &[AgainstBest]) -> String {
    let mut out = String::from(
        "| workload | devices | mb/dev | dispatch | best collective | on-demand / best | each (control) |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for c in cells {
        let each: Vec<String> = c
            .each
            .iter()
            .map(|(name, s, control)| match control {
                Some(k) => format!("{name} {s:.2}x ({k:.3})"),
                None => format!("{name} {s:.2}x"),
            })
            .collect();
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.2}x | {} |\n",
            c.workload,
            c.devices,
            c.minibatch_per_device,
            c.dispatch,
            c.best,
            c.speedup,
            each.join(", ")
        ));
    }
    out
}
