//! The long-sequence table: for a workload and device counts, the step time with and without
//! splitting ([`super::split`]) against perfect balance; and [`join`], that table beside the
//! runtime's rows (`odc-bench sim`'s virtual-time A/B rows, [`BenchRow`]).
//!
//! Each row draws `samples_per_device · D` lengths with [`Workload::sample`] (one seed for every
//! row, so a larger row's minibatch extends a smaller one's), on H100 nodes of eight
//! ([`Topology::h100_devices`]), priced by one [`DeviceProfile`]. Figures are modelled, not
//! measured: compute from the profile, ring attention and parameter pulls from the topology's links.
//!
//! The joined table puts two sources side by side and says which is which: the runtime columns
//! (on-demand over collective, over the achievable and over the perfect-balance bound) come from
//! the real job on the virtual clock, the split columns from this module's model of its own
//! minibatch of the same workload, device count and seed. Rendering never panics: a value that is
//! not finite shows as `n/a`, a row the other side lacks as `–`.

use super::noise::{self, Dispatch, Noise};
use super::profile::DeviceProfile;
use super::split::{plan, plan_cp, plan_on_demand, Modelled, SplitError, SplitOptions, SplitPlan};
use super::topology::Topology;
use crate::report::BenchRow;
use crate::workload::Workload;
use odc_policy::split::{static_cp_sizes, ContextParallel, CpPlan, OnDemandPlan};

/// GPUs per node of the rows' topology ([`Topology::h100_devices`]: nodes of 8).
const NODE_GPUS: u32 = 8;

/// One row of the table.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SplitRow {
    pub workload: String,
    pub devices: u32,
    pub samples: usize,
    /// Perfect balance: total cost / D, seconds.
    pub perfect_s: f64,
    /// `max(perfect, costliest whole sample)`, seconds.
    pub achievable_unsplit_s: f64,
    /// Planned step without splitting, seconds.
    pub unsplit_s: f64,
    /// Planned step with splitting, seconds: on-demand's choice between its gangs and a CP
    /// placement run without lockstep ([`plan_on_demand`]).
    pub split_s: f64,
    /// What that plan is: `gangs`, or the CP placement (`cp8`, `dcp`, …).
    pub placement: String,
    /// Planned step with the gangs alone (what the runtime plans today), seconds.
    pub gangs_s: f64,
    /// Samples split.
    pub splits: usize,
    /// Shortest split sample, tokens.
    pub shortest_split_tokens: Option<u64>,
    /// Widest split (devices of one sample).
    pub widest_split: Option<u32>,
    /// The collective baselines' planned lockstep steps, seconds: FSDP with LB-Micro (no CP;
    /// `None` where a sample exceeds the budget), the best static CP size of 2 to 64 (those that
    /// divide the devices) with its step, and dynamic CP ([`plan_cp`]).
    pub fsdp_s: Option<f64>,
    pub static_cp: Option<(u32, f64)>,
    pub dynamic_cp_s: Option<f64>,
    /// Static CP as TransformerEngine's users run it ([`te_cp_size`]): one CP size, the smallest
    /// whose pieces fit the longest sample in the token budget (1: no CP, the FSDP step), with its
    /// step; `None` where none of 1 to 64 fits. (`static_cp`, the best size per row, stays beside
    /// it as a bound.)
    pub te_cp: Option<(u32, f64)>,
}

impl SplitRow {
    /// Perfect balance over the unsplit step (1.0 = perfectly balanced).
    pub fn unsplit_efficiency(&self) -> f64 {
        ratio(self.perfect_s, self.unsplit_s)
    }

    /// Perfect balance over the split step.
    pub fn split_efficiency(&self) -> f64 {
        ratio(self.perfect_s, self.split_s)
    }

    /// Unsplit step over split step.
    pub fn speedup(&self) -> f64 {
        ratio(self.unsplit_s, self.split_s)
    }

    /// The best collective baseline's step (the shortest of FSDP, static and dynamic CP) over
    /// the split step: on-demand with splitting against the best CP collective.
    pub fn over_best_collective(&self) -> Option<f64> {
        let steps = [
            self.fsdp_s,
            self.static_cp.map(|(_, s)| s),
            self.dynamic_cp_s,
        ];
        over_best(&steps, self.split_s)
    }
}

/// The CP size a TransformerEngine (or Megatron `--context-parallel-size`) user fixes for a job
/// of `devices` trainers whose longest sample has `longest` tokens: the smallest of 1 (no CP),
/// 2, 4, …, 64 that divides the trainers and whose zig-zag pieces (`2⌈s / 2c⌉` tokens a member;
/// the whole sample at 1) fit the per-trainer `token_budget`, the memory a trainer has for
/// activations. Chosen once from memory, never by trying sizes against a step time. `None` when
/// no size fits.
pub fn te_cp_size(devices: u32, longest: u64, token_budget: u64) -> Option<u32> {
    if longest <= token_budget {
        return Some(1);
    }
    static_cp_sizes(devices, devices)
        .find(|&c| 2 * longest.div_ceil(2 * u64::from(c)) <= token_budget)
}

/// The collective baselines' plans of one row (`None` where one cannot place the samples): FSDP
/// with LB-Micro, TE CP ([`te_cp_size`]), the best static CP size by its planned step, dynamic
/// CP.
#[derive(Debug, Clone)]
pub struct Baselines {
    pub fsdp: Option<CpPlan>,
    pub te: Option<(u32, CpPlan)>,
    pub best_static: Option<(u32, CpPlan)>,
    pub dynamic: Option<CpPlan>,
}

impl Baselines {
    /// Every baseline planned for `lengths` on `topology` within `token_budget`.
    pub fn plan(
        lengths: &[u64],
        profile: &DeviceProfile,
        topology: &Topology,
        token_budget: u64,
    ) -> Baselines {
        let cp = |cp| plan_cp(lengths, profile, topology, cp, token_budget).ok();
        let sized = |c: u32| match c {
            1 => ContextParallel::Off,
            c => ContextParallel::Static(c),
        };
        let d = topology.devices();
        let best_static = static_cp_sizes(d, d)
            .filter_map(|c| cp(sized(c)).map(|p| (c, p)))
            .min_by(|a, b| a.1.step_s.total_cmp(&b.1.step_s));
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let te = te_cp_size(d, longest, token_budget).and_then(|c| cp(sized(c)).map(|p| (c, p)));
        Baselines {
            fsdp: cp(ContextParallel::Off),
            te,
            best_static,
            dynamic: cp(ContextParallel::Dynamic),
        }
    }
}

/// One row under noise: each side's step as the run pays it ([`super::noise`]), every plan made
/// with the estimates; the baselines' sizes are the planned rows' (TE CP's by memory, the best
/// static size by its planned step).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NoiseRow {
    pub workload: String,
    pub devices: u32,
    pub noise: Noise,
    /// Perfect balance of the actual costs over the devices' speeds.
    pub perfect_s: f64,
    /// On demand: its plan (`gangs`, or the CP placement it runs unlocked) and its actual step,
    /// the gangs' whole samples handed out by dynamic dispatch ([`noise::Dispatch::Dynamic`]).
    pub placement: String,
    pub on_demand_s: f64,
    /// The gangs' plan whatever on demand chose, with the plan's lists and with dynamic dispatch.
    pub gangs_static_s: f64,
    pub gangs_dynamic_s: f64,
    pub fsdp_s: Option<f64>,
    pub te_cp: Option<(u32, f64)>,
    pub best_static_cp: Option<(u32, f64)>,
    pub dynamic_cp_s: Option<f64>,
}

impl NoiseRow {
    /// Perfect balance over on demand's step.
    pub fn efficiency(&self) -> f64 {
        ratio(self.perfect_s, self.on_demand_s)
    }

    /// The best baseline's step over on demand's.
    pub fn over_best(&self) -> Option<f64> {
        let steps = [
            self.fsdp_s,
            self.te_cp.map(|(_, s)| s),
            self.best_static_cp.map(|(_, s)| s),
            self.dynamic_cp_s,
        ];
        over_best(&steps, self.on_demand_s)
    }
}

/// The rows of [`split_rows`]' minibatches run under `noise` (see [`NoiseRow`]).
pub fn noise_rows(
    workload: &Workload,
    devices: &[u32],
    samples_per_device: usize,
    seed: u64,
    profile: &DeviceProfile,
    token_budget: u64,
    noise: &Noise,
) -> Result<Vec<NoiseRow>, SplitError> {
    devices
        .iter()
        .map(|&d| {
            let topology = Topology::h100_devices(d)?;
            let lengths = workload.sample(samples_per_device * d as usize, seed);
            let costs = Modelled {
                profile,
                topology: &topology,
            };
            let options = SplitOptions {
                token_budget,
                ..SplitOptions::default()
            };
            let gangs = plan(&lengths, profile, &topology, options)?;
            let run_gangs =
                |p: &SplitPlan, dispatch| noise::gangs_s(p, &lengths, &costs, noise, dispatch);
            let gangs_static_s = run_gangs(&gangs, Dispatch::Static);
            let gangs_dynamic_s = run_gangs(&gangs, Dispatch::Dynamic);
            let chosen = plan_on_demand(gangs, &lengths, profile, &topology, options)?;
            let (placement, on_demand_s) = match &chosen {
                OnDemandPlan::Gangs(p) => ("gangs".into(), run_gangs(p, Dispatch::Dynamic)),
                OnDemandPlan::Rounds { cp, plan, .. } => {
                    (cp.name(), noise::unlocked_s(plan, &lengths, &costs, noise))
                }
            };
            let b = Baselines::plan(&lengths, profile, &topology, token_budget);
            let run = |p: &CpPlan| noise::lockstep_s(p, &lengths, &costs, noise);
            let sized = |p: &Option<(u32, CpPlan)>| p.as_ref().map(|(c, p)| (*c, run(p)));
            let (over, under): (Vec<u64>, Vec<u64>) =
                lengths.iter().partition(|&&s| s > token_budget);
            let fewest = over.len() as u64 + under.iter().sum::<u64>().div_ceil(token_budget);
            Ok(NoiseRow {
                workload: workload.name(),
                devices: d,
                noise: *noise,
                perfect_s: noise::perfect_s(&lengths, fewest, &costs, noise),
                placement,
                on_demand_s,
                gangs_static_s,
                gangs_dynamic_s,
                fsdp_s: b.fsdp.as_ref().map(run),
                te_cp: sized(&b.te),
                best_static_cp: sized(&b.best_static),
                dynamic_cp_s: b.dynamic.as_ref().map(run),
            })
        })
        .collect()
}

/// The noise rows as a Markdown table: on demand's actual step and its share of perfect balance,
/// each baseline's actual step and its ratio over on demand's.
pub fn noise_table(rows: &[NoiseRow]) -> String {
    let mut out = String::from(
        "| workload | devices | on demand (s) | its plan | perfect/on demand | gangs, static lists (s) | gangs, dynamic (s) | fsdp (s) | TE CP (s) | best static CP (s) | dynamic CP (s) | vs fsdp | vs TE CP | vs best static CP | vs dynamic CP | vs best |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let secs = |x: Option<f64>| x.map_or_else(|| "–".into(), |s| format!("{s:.2}"));
    let sized = |x: Option<(u32, f64)>| {
        x.map_or_else(
            || "–".into(),
            |(c, s)| match c {
                1 => format!("{s:.2} (no CP)"),
                c => format!("{s:.2} (cp{c})"),
            },
        )
    };
    let over =
        |x: Option<f64>, on: f64| x.map_or_else(|| "–".into(), |s| format!("{:.2}x", ratio(s, on)));
    for r in rows {
        let on = r.on_demand_s;
        out.push_str(&format!(
            "| {} | {} | {:.2} | {} | {:.3} | {:.2} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.workload,
            r.devices,
            on,
            r.placement,
            r.efficiency(),
            r.gangs_static_s,
            r.gangs_dynamic_s,
            secs(r.fsdp_s),
            sized(r.te_cp),
            sized(r.best_static_cp),
            secs(r.dynamic_cp_s),
            over(r.fsdp_s, on),
            over(r.te_cp.map(|x| x.1), on),
            over(r.best_static_cp.map(|x| x.1), on),
            over(r.dynamic_cp_s, on),
            r.over_best()
                .map_or_else(|| "–".into(), |x| format!("{x:.2}x")),
        ));
    }
    out
}

/// The shortest of the baselines' `steps` (those that ran) over `ours`.
fn over_best(steps: &[Option<f64>], ours: f64) -> Option<f64> {
    let best = steps.iter().flatten().fold(f64::INFINITY, |a, &b| a.min(b));
    best.is_finite().then(|| ratio(best, ours))
}

/// `x / y`, 1.0 when both are zero.
fn ratio(x: f64, y: f64) -> f64 {
    if y > 0.0 {
        x / y
    } else {
        1.0
    }
}

/// The rows for `workload` at each device count (see the module docs).
pub fn split_rows(
    workload: &Workload,
    devices: &[u32],
    samples_per_device: usize,
    seed: u64,
    profile: &DeviceProfile,
    token_budget: u64,
) -> Result<Vec<SplitRow>, SplitError> {
    devices
        .iter()
        .map(|&d| {
            let topology = Topology::h100_devices(d)?;
            let lengths = workload.sample(samples_per_device * d as usize, seed);
            let options = |split| SplitOptions {
                token_budget,
                split,
                ..SplitOptions::default()
            };
            let without = plan(&lengths, profile, &topology, options(false))?;
            let gangs = plan(&lengths, profile, &topology, options(true))?;
            let gangs_s = gangs.step_s;
            let chosen = plan_on_demand(gangs, &lengths, profile, &topology, options(true))?;
            let (split_s, placement, pieces): (f64, String, Vec<(u64, u32)>) = match &chosen {
                OnDemandPlan::Gangs(p) => (
                    p.step_s,
                    "gangs".into(),
                    p.gangs.iter().map(|g| (g.tokens, g.cost.k)).collect(),
                ),
                OnDemandPlan::Rounds { cp, plan, step_s } => (
                    *step_s,
                    cp.name(),
                    plan.gangs.iter().map(|g| (g.tokens, g.cost.k)).collect(),
                ),
            };
            let b = Baselines::plan(&lengths, profile, &topology, token_budget);
            let sized = |p: &Option<(u32, CpPlan)>| p.as_ref().map(|(c, p)| (*c, p.step_s));
            Ok(SplitRow {
                workload: workload.name(),
                devices: d,
                samples: lengths.len(),
                perfect_s: without.perfect_s,
                achievable_unsplit_s: without.achievable_unsplit_s,
                unsplit_s: without.step_s,
                split_s,
                placement,
                gangs_s,
                splits: pieces.len(),
                shortest_split_tokens: pieces.iter().map(|p| p.0).min(),
                widest_split: pieces.iter().map(|p| p.1).max(),
                fsdp_s: b.fsdp.as_ref().map(|p| p.step_s),
                static_cp: sized(&b.best_static),
                dynamic_cp_s: b.dynamic.as_ref().map(|p| p.step_s),
                te_cp: sized(&b.te),
            })
        })
        .collect()
}

/// The rows as a Markdown table.
pub fn split_table(rows: &[SplitRow]) -> String {
    let mut out = String::from(
        "| workload | devices | samples | perfect (s) | unsplit (s) | perfect/unsplit | split (s) | perfect/split | speedup | splits | shortest split (tokens) | widest |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let opt = |x: Option<String>| x.unwrap_or_else(|| "–".into());
        out.push_str(&format!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2}x | {} | {} | {} |\n",
            r.workload,
            r.devices,
            r.samples,
            r.perfect_s,
            r.unsplit_s,
            r.unsplit_efficiency(),
            r.split_s,
            r.split_efficiency(),
            r.speedup(),
            r.splits,
            opt(r.shortest_split_tokens.map(|t| t.to_string())),
            opt(r.widest_split.map(|k| k.to_string())),
        ));
    }
    out
}

/// The rows against the collective baselines, as a Markdown table: on-demand's split step (the
/// planner's, no lockstep) beside FSDP (LB-Micro), TransformerEngine-style static CP (one size,
/// sized by memory; `*` where its groups span nodes), the best static CP size (a bound) and
/// dynamic CP (lockstep rounds), and each baseline's step over the split step.
pub fn baseline_table(rows: &[SplitRow]) -> String {
    let mut out = String::from(
        "| workload | devices | split (s) | on-demand plan | fsdp (s) | TE CP (s) | best static CP (s) | dynamic CP (s) | vs fsdp | vs TE CP | vs best static CP | vs dynamic CP | vs best | gangs only (s) | gangs vs best |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let secs = |x: Option<f64>| x.map_or_else(|| "–".into(), |s| format!("{s:.2}"));
    let over = |x: Option<f64>, split: f64| {
        x.map_or_else(|| "–".into(), |s| format!("{:.2}x", ratio(s, split)))
    };
    for r in rows {
        let stat = r.static_cp.map(|(_, s)| s);
        let te = r.te_cp.map(|(_, s)| s);
        let te_cell = r.te_cp.map_or_else(
            || "–".into(),
            |(c, s)| match c {
                1 => format!("{s:.2} (no CP)"),
                c if c > r.devices.min(NODE_GPUS) => format!("{s:.2} (cp{c}*)"),
                c => format!("{s:.2} (cp{c})"),
            },
        );
        out.push_str(&format!(
            "| {} | {} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {} |\n",
            r.workload,
            r.devices,
            r.split_s,
            r.placement,
            secs(r.fsdp_s),
            te_cell,
            r.static_cp
                .map_or_else(|| "–".into(), |(c, s)| format!("{s:.2} (cp{c})")),
            secs(r.dynamic_cp_s),
            over(r.fsdp_s, r.split_s),
            over(te, r.split_s),
            over(stat, r.split_s),
            over(r.dynamic_cp_s, r.split_s),
            r.over_best_collective()
                .map_or_else(|| "–".into(), |x| format!("{x:.2}x")),
            r.gangs_s,
            r.over_best_collective().map_or_else(
                || "–".into(),
                |x| format!("{:.2}x", x * ratio(r.split_s, r.gangs_s))
            ),
        ));
    }
    out
}

/// A runtime row beside the split table's row of the same workload and device count.
#[derive(Debug, Clone, PartialEq)]
pub struct JoinedRow {
    pub workload: String,
    pub devices: usize,
    /// The collective side (`fsdp`, `cp8`, `dcp`, …).
    pub baseline: String,
    /// On-demand over collective tokens/s (runtime).
    pub speedup: f64,
    /// On-demand over the achievable bound (runtime).
    pub ondemand_of_achievable: Option<f64>,
    /// On-demand over the perfect-balance bound (runtime).
    pub ondemand_of_perfect: Option<f64>,
    /// The model's row; `None` where the split table lacks the workload (the balanced control).
    pub split: Option<SplitRow>,
}

/// Every runtime row, in order, with the first split row of its workload and device count.
pub fn join(runtime: &[BenchRow], split: &[SplitRow]) -> Vec<JoinedRow> {
    runtime
        .iter()
        .map(|r| JoinedRow {
            workload: r.workload.clone(),
            devices: r.devices,
            baseline: r.baseline.clone(),
            speedup: r.speedup,
            ondemand_of_achievable: r.ondemand_of_achievable(),
            ondemand_of_perfect: r.ondemand_of_bound(),
            split: split
                .iter()
                .find(|s| s.workload == r.workload && s.devices as usize == r.devices)
                .cloned(),
        })
        .collect()
}

/// The joined rows as a Markdown table (see the module docs).
pub fn joined_table(rows: &[JoinedRow]) -> String {
    let mut out = String::from(
        "| workload | devices | collective | on-demand/collective | on-demand/achievable | on-demand/perfect | unsplit/perfect (model) | split/perfect (model) | split speedup (model) |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    let num = |v: f64, suffix: &str| {
        if v.is_finite() {
            format!("{v:.2}{suffix}")
        } else {
            "n/a".into()
        }
    };
    let opt = |v: Option<f64>| v.map_or_else(|| "n/a".into(), |v| num(v, ""));
    for r in rows {
        let model = |f: fn(&SplitRow) -> f64, suffix: &str| {
            r.split
                .as_ref()
                .map_or_else(|| "–".into(), |s| num(f(s), suffix))
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.workload,
            r.devices,
            r.baseline,
            num(r.speedup, "x"),
            opt(r.ondemand_of_achievable),
            opt(r.ondemand_of_perfect),
            model(SplitRow::unsplit_efficiency, ""),
            model(SplitRow::split_efficiency, ""),
            model(SplitRow::speedup, "x"),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::profile::ModelShape;
    use crate::sim::split::DEFAULT_TOKEN_BUDGET;
    use crate::test_util::runtime_row;

    fn seven_b() -> DeviceProfile {
        DeviceProfile::builtin(ModelShape::B7, 28).unwrap()
    }

    #[test]
    fn rows_compare_both_plans_with_perfect_balance() {
        let profile = seven_b();
        let mut rows = Vec::new();
        for (w, spd) in [(Workload::SweSmith, 4), (Workload::LongAlign, 1)] {
            rows.extend(split_rows(&w, &[8, 64], spd, 0, &profile, DEFAULT_TOKEN_BUDGET).unwrap());
        }
        assert_eq!(rows.len(), 4);
        // One long sample per device: splitting must not lose (it did before the planner tried
        // splitting fewer samples), and at 64 devices it wins.
        assert!(rows[3].speedup() > 1.5, "{:?}", rows[3]);
        for r in &rows {
            assert_eq!(r.samples % r.devices as usize, 0);
            for x in [r.perfect_s, r.unsplit_s, r.split_s] {
                assert!(x.is_finite() && x > 0.0, "{r:?}");
            }
            assert!(r.unsplit_s >= r.achievable_unsplit_s - 1e-9, "{r:?}");
            assert!(r.split_s <= r.unsplit_s + 1e-9, "{r:?}");
            assert!(r.split_efficiency() <= 1.0 + 1e-9);
        }
        // Balanced control: 1.00 with and without splitting.
        let balanced = split_rows(
            &Workload::Balanced { tokens: 16_384 },
            &[8, 64],
            4,
            0,
            &profile,
            DEFAULT_TOKEN_BUDGET,
        )
        .unwrap();
        for r in &balanced {
            assert_eq!(r.splits, 0);
            assert!((r.unsplit_efficiency() - 1.0).abs() < 1e-9, "{r:?}");
            assert!((r.speedup() - 1.0).abs() < 1e-12, "{r:?}");
        }
        let table = split_table(&rows);
        assert_eq!(table.lines().count(), 2 + rows.len());
        assert!(table.contains("| swesmith | 64 | 256 |"), "{table}");
    }

    #[test]
    fn the_joined_table_pairs_runtime_and_model_rows_by_workload_and_devices() {
        let split = split_rows(
            &Workload::LongAlign,
            &[8, 64],
            1,
            0,
            &seven_b(),
            DEFAULT_TOKEN_BUDGET,
        )
        .unwrap();
        let runtime = [
            runtime_row("longalign", 64, 1.44),
            runtime_row("balanced", 64, 1.0),
            runtime_row("longalign", 8, f64::NAN),
            runtime_row("longalign", 16, 1.2),
        ];
        let joined = join(&runtime, &split);
        assert_eq!(joined.len(), runtime.len());
        assert_eq!(joined[0].split.as_ref(), Some(&split[1]));
        assert_eq!(joined[2].split.as_ref(), Some(&split[0]));
        // The control and a device count the model lacks have no model columns.
        assert!(joined[1].split.is_none() && joined[3].split.is_none());
        assert_eq!(joined[0].ondemand_of_achievable, Some(144.0 / 180.0));
        assert_eq!(joined[0].ondemand_of_perfect, Some(144.0 / 200.0));

        let table = joined_table(&joined);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 2 + runtime.len(), "{table}");
        let s = &split[1];
        assert_eq!(
            lines[2],
            format!(
                "| longalign | 64 | fsdp | 1.44x | 0.80 | 0.72 | {:.2} | {:.2} | {:.2}x |",
                s.unsplit_efficiency(),
                s.split_efficiency(),
                s.speedup()
            )
        );
        assert_eq!(
            lines[3],
            "| balanced | 64 | fsdp | 1.00x | 0.56 | 0.50 | – | – | – |"
        );
        // NaN tokens/s: n/a, never a panic.
        assert!(
            lines[4].starts_with("| longalign | 8 | fsdp | n/a | n/a | n/a |"),
            "{table}"
        );
        assert_eq!(joined_table(&[]).lines().count(), 2);
    }

    #[test]
    fn te_style_cp_is_the_smallest_size_that_fits_the_longest_sample() {
        // 4,096 tokens a trainer: 10,000 tokens need pieces of at most 4,096, so cp4 (2 × 1,250
        // a member), not cp2 (2 × 2,500 = 5,000).
        assert_eq!(te_cp_size(64, 10_000, 4096), Some(4));
        assert_eq!(te_cp_size(64, 8_192, 4096), Some(2));
        // What fits one trainer runs without CP.
        assert_eq!(te_cp_size(64, 4_096, 4096), Some(1));
        // A size must divide the trainers: 24 takes 2, 4, 8, not 16.
        assert_eq!(te_cp_size(24, 60_000, 4096), None);
        assert_eq!(te_cp_size(64, 60_000, 4096), Some(16));
        assert_eq!(te_cp_size(64, 600_000, 4096), None);
        // In a row, its step is static CP's at that size, never below the best size's bound.
        let rows = split_rows(
            &Workload::LongAlign,
            &[64],
            1,
            0,
            &seven_b(),
            DEFAULT_TOKEN_BUDGET,
        )
        .unwrap();
        let r = &rows[0];
        let longest = Workload::LongAlign.sample(64, 0).into_iter().max().unwrap();
        let (c, te) = r.te_cp.expect("a size fits LongAlign-like lengths");
        assert_eq!(Some(c), te_cp_size(64, longest, DEFAULT_TOKEN_BUDGET));
        let (_, best) = r.static_cp.unwrap();
        let best = best.min(r.fsdp_s.unwrap_or(f64::INFINITY));
        assert!(te >= best - 1e-12, "{r:?}");
        let table = baseline_table(&rows);
        let cell = match c {
            1 => "(no CP)".to_string(),
            c => format!("(cp{c}"),
        };
        assert!(table.contains(&cell), "{table}");
        assert_eq!(table.lines().next().unwrap().matches('|').count(), 16);
    }

    #[test]
    fn without_noise_the_noise_rows_are_the_planned_rows() {
        let profile = seven_b();
        let planned = split_rows(&Workload::Rl, &[64], 4, 0, &profile, 65_536).unwrap();
        let noisy =
            noise_rows(&Workload::Rl, &[64], 4, 0, &profile, 65_536, &Noise::none()).unwrap();
        let (p, n) = (&planned[0], &noisy[0]);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.max(1.0);
        assert!(close(n.on_demand_s, p.split_s), "{n:?} vs {p:?}");
        assert_eq!(n.placement, p.placement);
        assert!(close(n.fsdp_s.unwrap(), p.fsdp_s.unwrap()));
        assert!(close(n.dynamic_cp_s.unwrap(), p.dynamic_cp_s.unwrap()));
        assert_eq!(n.best_static_cp.unwrap().0, p.static_cp.unwrap().0);
        assert!(close(n.best_static_cp.unwrap().1, p.static_cp.unwrap().1));
        assert!(
            close(n.perfect_s, p.perfect_s),
            "{} vs {}",
            n.perfect_s,
            p.perfect_s
        );
        let table = noise_table(&noisy);
        assert_eq!(table.lines().count(), 3);
        // Under noise the same seed gives the same row.
        let calibrated = Noise::calibrated(5);
        let a = noise_rows(&Workload::Rl, &[64], 4, 0, &profile, 65_536, &calibrated).unwrap();
        let b = noise_rows(&Workload::Rl, &[64], 4, 0, &profile, 65_536, &calibrated).unwrap();
        assert_eq!(a, b);
    }

    /// Prints the table for the heavy-tailed workloads:
    /// `cargo test -p odc-bench --lib sim::report -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn print_split_table() {
        for (name, profile) in [
            ("7b", seven_b()),
            (
                "1.5b",
                DeviceProfile::builtin(ModelShape::B1_5, 28).unwrap(),
            ),
        ] {
            let mut rows = Vec::new();
            for w in [Workload::SweSmith, Workload::LongAlign] {
                for spd in [1, 4] {
                    rows.extend(
                        split_rows(
                            &w,
                            &[8, 64, 256, 1024],
                            spd,
                            0,
                            &profile,
                            DEFAULT_TOKEN_BUDGET,
                        )
                        .unwrap(),
                    );
                }
            }
            println!(
                "\n{name}, 28 layers ({}):\n{}",
                profile.source,
                split_table(&rows)
            );
        }
    }
}
