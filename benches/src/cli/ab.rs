//! `odc-bench ab`: on-demand against collective on the same simulated devices, workload and seed,
//! ABBA, with the balanced control.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context as _};
use clap::{Args, ValueEnum};
use futures::StreamExt as _;
use odc::sim::clock::ClockMode;
use odc::sim::SpeedSchedule;
use odc::DispatchMode;
use odc_bench::ab::{self, Case, Controls, Settings, Side};
use odc_bench::floor::{self, EmulationFloor};
use odc_bench::input;
use odc_bench::report::{self, BenchReport, BenchRow, TableLayout};
use odc_bench::validate::{self, ClockRatio};
use odc_bench::workload::Workload;

use super::*;

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Dispatch {
    Static,
    Dynamic,
}

impl From<Dispatch> for DispatchMode {
    fn from(d: Dispatch) -> Self {
        match d {
            Dispatch::Static => DispatchMode::Static,
            Dispatch::Dynamic => DispatchMode::Dynamic,
        }
    }
}

/// `odc-bench ab --clock`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ClockArg {
    Wall,
    Virtual,
    Both,
}

#[derive(Args)]
#[command(
    after_help = "Limits, checked before anything runs: sequence lengths and --token-budget \
at most 1048576 tokens (MAX_SEQUENCE_TOKENS); --devices at most 4096; --minibatch-per-device at \
most 65536; devices × minibatch per device at most 1048576 samples; --steps at most 10000; --reps at \
most 1000; --units at most 1024; --unit-elems at most 16777216, units × unit elems and devices × \
unit elems at most 67108864; --time-scale-ms and --unit-transfer-ms at most 60000. Counts must be \
at least 1."
)]
pub(crate) struct AbArgs {
    /// Small matrix (LongAlign-like, RL-like and balanced rows at 8 devices, minibatch 4 per device,
    /// plus the straggler scenario); finishes in under 2 minutes on 2 cores.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Workloads: longalign, swesmith, rl, balanced (comma separated).
    #[arg(long, value_delimiter = ',')]
    pub(crate) workloads: Vec<String>,
    /// A file of sequence lengths (one positive integer per line, at most 1048576 =
    /// MAX_SEQUENCE_TOKENS; `#` comments) as the workload.
    #[arg(long)]
    pub(crate) lengths: Option<PathBuf>,
    /// Device counts (1 to 4096).
    #[arg(long, value_delimiter = ',', value_parser = devices)]
    pub(crate) devices: Vec<usize>,
    /// Minibatch sizes per device (samples per device per optimizer step; 1 to 65536).
    #[arg(long, value_delimiter = ',', value_parser = per_device)]
    pub(crate) minibatch_per_device: Vec<usize>,
    /// On-demand dispatch modes (each gets its own rows).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "static,dynamic"
    )]
    pub(crate) dispatch: Vec<Dispatch>,
    /// Token budget of a micro-batch, at most 1048576 (default: the smallest power of two
    /// ≥ 16,384 holding the workload's longest sequence).
    #[arg(long, value_parser = token_budget)]
    pub(crate) token_budget: Option<u64>,
    /// Minibatches per run (the straggler slows down from the middle one).
    #[arg(long, default_value_t = 6, value_parser = steps)]
    pub(crate) steps: u64,
    /// A/B repetitions per row, in ABBA order (collective first in even repetitions, on-demand
    /// first in odd ones); each row sums them.
    #[arg(long, default_value_t = 2, value_parser = reps)]
    pub(crate) reps: usize,
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Milliseconds of modelled compute per cost unit (a 32K-token sample of the 7B model is 13.1
    /// cost units). Rows whose modelled spans are too short next to the measured emulation floor
    /// say so and name a faithful value.
    #[arg(long, default_value_t = 4.0, value_parser = time_scale, allow_hyphen_values = true)]
    pub(crate) time_scale_ms: f64,
    /// Elements per unit (bytes moved per gather and push).
    #[arg(long, default_value_t = 16 * 1024, value_parser = unit_elems)]
    pub(crate) unit_elems: usize,
    /// Modelled milliseconds to move one unit over one device's link (default 0: no link model;
    /// 0.5 at the default time scale is about a 7B layer in fp32 over 12.5 GB/s per GPU). Each of
    /// a collective's many small ring transfers then pays a blocking-thread handoff that is large
    /// at this time scale, so the link model penalises collective mode beyond real ring latency.
    #[arg(long, default_value_t = 0.0, value_parser = transfer, allow_hyphen_values = true)]
    pub(crate) unit_transfer_ms: f64,
    /// Units (blocks) of the simulated model.
    #[arg(long, default_value_t = 4, value_parser = units)]
    pub(crate) units: usize,
    /// Skip the straggler scenario.
    #[arg(long)]
    pub(crate) no_straggler: bool,
    /// Costs the planner cannot see, paid by the simulated device of every row but the balanced
    /// controls (`odc::sim::Noise`, the draws of `sim --noise`): `calibrated` (per-sample
    /// log-σ 0.116, per-layer 0.05, one device in 64 at 0.8x), `SAMPLE,LAYER` log-σs, or `off`.
    /// The plans are made with the estimates.
    #[arg(long, value_parser = super::noise_arg)]
    pub(crate) noise: Option<NoiseArg>,
    /// One device in N at 0.8x under `--noise` (default 64 with `calibrated`, else 0: none).
    #[arg(long)]
    pub(crate) straggler_every: Option<u32>,
    /// Skip the balanced control rows (rows then carry a control only where the matrix has its
    /// own balanced rows).
    #[arg(long)]
    pub(crate) no_control: bool,
    /// Sequence splitting on the on-demand side: off (default), auto, or N (auto for samples of
    /// at least N tokens). The collective side splits only as `--baselines` says; a piece is
    /// emulated as its sample's compute over the gang's size, its members meeting at every unit;
    /// its ring is free here (`odc-bench sim` on a modelled cluster prices it and pays it).
    #[arg(long, default_value = "off", value_parser = split_policy)]
    pub(crate) split: odc::SplitPolicy,
    /// The collective baselines, each with rows (and balanced controls) of its own: `fsdp`
    /// (LB-Micro over whole samples, the default), `cp2`, `cp4`, `cp8` (static context
    /// parallelism, TransformerEngine's and Megatron's CP size: every sample split over a fixed
    /// group) and `dcp` (dynamic CP, Megatron-Core's hybrid CP: a group size per sample). With
    /// more than one, a last table sets on-demand against the best of them.
    #[arg(long, value_delimiter = ',', default_value = "fsdp", value_parser = context_parallel)]
    pub(crate) baselines: Vec<odc::ContextParallel>,
    /// Write the rows as JSON.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Write an SVG of speedup and utilization.
    #[arg(long)]
    pub(crate) plot: Option<PathBuf>,
    /// Write a Chrome/Perfetto trace of the first measured (non-control) row's on-demand run (and
    /// `PATH.collective.json` of its collective run).
    #[arg(long)]
    pub(crate) trace: Option<PathBuf>,
    /// `wall`: emulate in real time on this machine (the emulation floor applies). `virtual`: the
    /// same job on tokio's paused clock (compute and modelled transfers cost virtual time only;
    /// deterministic: the same seed gives the same JSON byte for byte; no emulation floor).
    /// `both`: every row under both clocks, with virtual/wall of tokens/s and speedup (validation:
    /// use a large --time-scale-ms and at most 16 devices, so no wall row is warned); --json then
    /// writes the virtual rows, PATH.wall.json the wall rows and PATH.clocks.json the ratios.
    #[arg(long, value_enum, default_value = "wall")]
    pub(crate) clock: ClockArg,
    /// Devices per shard server (default 1: a server on every device, as odc runs). Larger values
    /// cut the simulation's cost at scale (each trainer's gathers and pushes touch every server);
    /// without a link model nothing modelled changes, with one each server's link carries the
    /// shards of that many devices. At least one server per row.
    #[arg(long, default_value_t = 1, value_parser = devices)]
    pub(crate) devices_per_server: usize,
    /// The simulated device's cost model and its time scale in ms per cost unit (`odc-bench sim`:
    /// a device profile's fit); `None`: ODC's 7B fit at `--time-scale-ms`.
    #[arg(skip)]
    pub(crate) cost: Option<(odc::CostModel, String)>,
    /// The price of a gang's ring in those cost units, paid by the simulated device and known to
    /// the planner (`odc-bench sim` on a modelled cluster: the profile's); `None`: free.
    #[arg(skip)]
    pub(crate) ring: Option<odc::RingPrice>,
    #[command(flatten)]
    pub(crate) cluster: ClusterArgs,
    /// With `--links h100`: modelled bytes per emulated byte (a unit of `--unit-elems` stands for
    /// that many times its bytes of parameters).
    #[arg(long, default_value_t = 1.0, value_parser = bytes_scale)]
    pub(crate) bytes_scale: f64,
}

pub(crate) fn workloads(args: &AbArgs) -> anyhow::Result<Vec<Workload>> {
    let mut out = Vec::new();
    for name in &args.workloads {
        match Workload::from_name(name) {
            Some(w) => out.push(w),
            None => bail!("unknown workload {name:?} (longalign, swesmith, rl, balanced)"),
        }
    }
    if let Some(path) = &args.lengths {
        // The error names the file and the line.
        out.push(Workload::from_file(path)?);
    }
    if out.is_empty() {
        let names: &[&str] = if args.quick {
            &["longalign", "rl", "balanced"]
        } else {
            &["longalign", "swesmith", "rl", "balanced"]
        };
        out = names
            .iter()
            .filter_map(|n| Workload::from_name(n))
            .collect();
    }
    Ok(out)
}

pub(crate) fn or_default(
    v: &[usize],
    quick: &[usize],
    full: &[usize],
    is_quick: bool,
) -> Vec<usize> {
    if !v.is_empty() {
        v.to_vec()
    } else if is_quick {
        quick.to_vec()
    } else {
        full.to_vec()
    }
}

pub(crate) fn print_row(layout: &TableLayout, row: &BenchRow) {
    println!("{}", layout.line(row));
    if let Some(w) = &row.emulation_warning {
        println!("    ! emulation: {w}");
    }
}

/// `path` with `suffix` appended to its file name (the collective trace beside the on-demand one).
pub(crate) fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut p = path.to_path_buf().into_os_string();
    p.push(suffix);
    PathBuf::from(p)
}

/// Runs the matrix, prints and writes what `args` asks for, and returns the rows.
pub(crate) async fn ab(args: AbArgs) -> anyhow::Result<BenchReport> {
    // Sizes and outputs first: nothing is allocated, read or run before they pass.
    let devices = or_default(&args.devices, &[8], &[4, 8, 16], args.quick);
    let per_device = or_default(&args.minibatch_per_device, &[4], &[1, 2, 4, 8], args.quick);
    input::check_sizes(&devices, &per_device, args.units, args.unit_elems)?;
    let outputs = Outputs::check(&args)?;
    let plan = plan_matrix(&args, devices, &per_device)?;
    plan.settings.check_relay()?;

    print_setup(&args, &plan.settings);
    let floor = emulation_floor(args.clock, &plan.devices).await?;
    print_control_and_bounds(&args, plan.control_tokens);
    let started = Instant::now();
    let runs = run_rows(&args, &plan, floor.as_ref()).await?;

    println!();
    print_clock_validation(&runs.ratios);
    print_controls(&runs);
    print_emulation_warnings(&runs.rows);
    print_communication(&args, &plan.settings, &runs, started);
    let best = odc_bench::baselines::against_best(&runs.rows);
    if !best.is_empty() {
        println!();
        println!("On-demand against the best collective baseline (the smallest speedup of each cell's rows, each measured in its own A/B; controls in parentheses):");
        print!("{}", odc_bench::baselines::table(&best));
    }
    if let Some(paths) = &outputs.trace {
        write_traces(paths, &plan).await?;
    }
    write_outputs(&args, &outputs, runs)
}

/// Where `ab` writes beside `--json` and `--plot`; every output is checked before anything runs.
struct Outputs {
    /// `--trace`: the on-demand run's trace and the collective run's beside it.
    trace: Option<(PathBuf, PathBuf)>,
    /// `--clock both --json`: the wall rows and the virtual/wall ratios beside the JSON.
    validation: Option<(PathBuf, PathBuf)>,
}

impl Outputs {
    /// Checks every output `args` names ([`input::check_output`]) and derives the files beside
    /// them.
    fn check(args: &AbArgs) -> anyhow::Result<Outputs> {
        let trace = args
            .trace
            .as_ref()
            .map(|p| (p.clone(), with_suffix(p, ".collective.json")));
        for (flag, path) in [("--json", &args.json), ("--plot", &args.plot)] {
            if let Some(path) = path {
                input::check_output(flag, path)?;
            }
        }
        if let Some((od, coll)) = &trace {
            input::check_output("--trace", od)?;
            input::check_output("--trace", coll)?;
        }
        let validation = match (&args.json, args.clock) {
            (Some(p), ClockArg::Both) => {
                Some((with_suffix(p, ".wall.json"), with_suffix(p, ".clocks.json")))
            }
            _ => None,
        };
        if let Some((wall, clocks)) = &validation {
            input::check_output("--json", wall)?;
            input::check_output("--json", clocks)?;
        }
        Ok(Outputs { trace, validation })
    }
}

/// The matrix `ab` runs: its rows in order, under one set of settings.
struct Plan {
    settings: Settings,
    /// The matrix's device counts (the emulation floor is measured at the largest).
    devices: Vec<usize>,
    /// The rows, balanced controls first ([`ab::plan`]).
    entries: Vec<ab::Entry>,
    /// Tokens of every sample of a balanced control row.
    control_tokens: u64,
}

/// The rows of `args` at `devices` × `per_device`: every workload and dispatch, the straggler
/// scenario and the balanced controls; every row's token budget and modelled times checked.
fn plan_matrix(args: &AbArgs, devices: Vec<usize>, per_device: &[usize]) -> anyhow::Result<Plan> {
    let workloads = workloads(args)?;
    let settings = settings(args);
    let sides: Vec<Side> = args
        .dispatch
        .iter()
        .flat_map(|&d| {
            let side = Side::on_demand(d.into(), false);
            args.baselines.iter().map(move |&b| side.against(b))
        })
        .collect();
    let mut cases = Vec::new();
    for w in &workloads {
        for &n in &devices {
            for &m in per_device {
                let case = Case {
                    name: w.name(),
                    workload: w.clone(),
                    devices: n,
                    minibatch_per_device: m,
                    speeds: SpeedSchedule::uniform(),
                };
                cases.push((case, sides.clone()));
            }
        }
    }
    if !args.no_straggler {
        cases.push(straggler_case(
            &workloads[0],
            &devices,
            per_device,
            settings.steps,
        ));
    }
    // The balanced control fits any budget the other workloads fit.
    let control_tokens = args.token_budget.unwrap_or(u64::MAX).min(16_384);
    let entries = ab::plan(&cases, !args.no_control, control_tokens);
    check_budgets(&entries, &settings)?;
    Ok(Plan {
        settings,
        devices,
        entries,
        control_tokens,
    })
}

/// The settings of every run of `args`; the rows' own clock is virtual unless only wall time is
/// asked for.
fn settings(args: &AbArgs) -> Settings {
    let mut settings = Settings {
        steps: args.steps,
        seed: args.seed,
        token_budget: args.token_budget,
        unit_transfer_seconds: args.unit_transfer_ms / 1e3,
        clock: match args.clock {
            ClockArg::Wall => ClockMode::Wall,
            ClockArg::Virtual | ClockArg::Both => ClockMode::Virtual,
        },
        devices_per_server: args.devices_per_server,
        links: args.cluster.links_config(args.bytes_scale),
        pull_precision: args.cluster.precision(),
        price_transfers: !args.cluster.no_transfer_price,
        split: args.split,
        ..Settings::default()
    };
    settings.device.seconds_per_cost = args.time_scale_ms / 1e3;
    settings.device.unit_elems = args.unit_elems;
    settings.device.units = args.units;
    if let Some((cost, _)) = &args.cost {
        settings.device.cost = *cost;
    }
    settings.device.ring = args.ring;
    if let Some(noise) = args.noise {
        settings.device.noise = noise.noise(args.seed, args.straggler_every);
    }
    settings
}

/// The straggler scenario: the first workload at 8 devices and 4 per device (or the first of
/// each), its last device at half speed from the middle step, under both dispatches with and
/// without rebalancing.
fn straggler_case(
    workload: &Workload,
    devices: &[usize],
    per_device: &[usize],
    steps: u64,
) -> (Case, Vec<Side>) {
    let n = devices
        .iter()
        .copied()
        .find(|&n| n == 8)
        .unwrap_or(devices[0]);
    let m = per_device
        .iter()
        .copied()
        .find(|&m| m == 4)
        .unwrap_or(per_device[0]);
    let speeds = SpeedSchedule::uniform().with_change(n - 1, steps / 2, 0.5);
    let sides = vec![
        Side::on_demand(DispatchMode::Dynamic, false),
        Side::on_demand(DispatchMode::Dynamic, true),
        Side::on_demand(DispatchMode::Static, false),
        Side::on_demand(DispatchMode::Static, true),
    ];
    let case = Case {
        name: format!("{}+straggler", workload.name()),
        workload: workload.clone(),
        devices: n,
        minibatch_per_device: m,
        speeds,
    };
    (case, sides)
}

/// Token budgets hold every sequence, and modelled times fit a duration, for every row.
fn check_budgets(entries: &[ab::Entry], settings: &Settings) -> anyhow::Result<()> {
    for e in entries {
        let budget = ab::token_budget(&e.case, settings);
        let longest = e.case.workload.max_tokens();
        if budget < longest {
            return Err(input::InputError::BudgetBelowLongest {
                budget,
                workload: e.case.workload.name(),
                longest,
            }
            .into());
        }
        input::check_modelled_time(
            &settings.device,
            budget,
            e.case.slowest_speed(settings.steps),
        )?;
    }
    Ok(())
}

/// The lines that say what is simulated: the model, the time scale, the runs, the clock and the
/// modelled cluster's links.
fn print_setup(args: &AbArgs, settings: &Settings) {
    let d = &settings.device;
    println!(
        "odc-bench ab: simulated {}-unit model, {} elements ({} KiB fp32) per unit; time scale: 1 cost unit = {} ms (a 32K-token sample of the {} = {:.0} ms); {} steps per run, {} rep(s) in ABBA order, seed {}{}; clock: {}",
        d.units,
        d.unit_elems,
        d.unit_elems * 4 / 1024,
        args.time_scale_ms,
        args.cost
            .as_ref()
            .map_or("7B cost model", |(_, name)| name.as_str()),
        d.cost.cost(32_000) * args.time_scale_ms,
        settings.steps,
        args.reps,
        args.seed,
        if args.devices_per_server > 1 {
            format!("; {} devices per shard server", args.devices_per_server)
        } else {
            String::new()
        },
        match args.clock {
            ClockArg::Wall => "wall (emulated in real time on this machine)".to_string(),
            ClockArg::Virtual => format!(
                "virtual (tokio's paused clock, the model stretched {}x so its 1 ms tick is 1 µs modelled; figures in modelled seconds, identical for the same seed)",
                odc::sim::clock::DILATION
            ),
            ClockArg::Both => "both (each row in wall time, then in virtual time, with virtual/wall ratios)".to_string(),
        }
    );
    if let Some(f) = &settings.links {
        println!(
            "links: nodes of {} H100s, NVLink 450 GB/s and 3 µs per GPU and direction inside a node, a 400 Gb/s NIC (10 µs) per GPU across nodes, FIFO ports; {} routing{}{}; pulls in {:?}, gradients in fp32; 1 emulated byte = {:.0} modelled bytes",
            f.gpus_per_node,
            match f.routing {
                odc_bench::sim::topology::Routing::Direct => "direct",
                odc_bench::sim::topology::Routing::Striped => "striped (Zeppelin)",
            },
            if f.hpz { ", HPZ (a copy per node)" } else { "" },
            if f.relay {
                ", on-demand pushes relayed through the node (each relay flushed once its node's writes are in)"
            } else {
                ""
            },
            settings.pull_precision,
            f.bytes_scale,
        );
    }
}

/// The emulation floor of wall-time rows, measured at the largest of `devices` and printed;
/// `None` (and a line that says why) when every row runs in virtual time.
async fn emulation_floor(
    clock: ClockArg,
    devices: &[usize],
) -> anyhow::Result<Option<EmulationFloor>> {
    if clock == ClockArg::Virtual {
        println!(
            "emulation floor: does not apply in virtual time (waits cost no wall time and are exact to the modelled microsecond), so no row carries an emulation warning"
        );
        return Ok(None);
    }
    let most_devices = devices.iter().copied().max().unwrap_or(1);
    let mut f = floor::measure(most_devices, floor::REQUEST).await;
    f.ring_step = odc::sim::ring_step_latency(most_devices as u32, 50)
        .await
        .context("measuring the emulation's ring latency")?;
    println!("{}", f.describe());
    Ok(Some(f))
}

/// How to read the `control` and bounds columns.
fn print_control_and_bounds(args: &AbArgs, control_tokens: u64) {
    if args.no_control {
        println!("control: none (--no-control)");
    } else {
        println!(
            "control: balanced rows (every sample {control_tokens} tokens) run first at every devices × mb/dev × dispatch; with nothing to balance, their speedup reads 1.00x when the comparison is fair, and each row's `control` column is its control's speedup"
        );
    }
    println!(
        "bounds: od/bound = on-demand / perfect balance (samples split); od/achievable = on-demand / achievable (per step, max of even spread and the costliest sample on the fastest device)"
    );
}

/// What the rows' runs hand the report.
#[derive(Default)]
struct Runs {
    /// The rows under their own clock, in the order run, each with its control's speedup.
    rows: Vec<BenchRow>,
    /// `--clock both`: the same rows in wall time.
    wall_rows: Vec<BenchRow>,
    /// `--clock both`: each row's virtual/wall ratios.
    ratios: Vec<ClockRatio>,
    /// The balanced controls' speedups.
    controls: Controls,
    /// The on-demand sides' seconds waiting on pulls and pushes, summed over the rows.
    comm_wait: f64,
    /// The on-demand sides' busy device-seconds, summed over the rows.
    busy: f64,
    /// The on-demand sides' bytes moved, summed over the rows.
    bytes: u64,
}

/// Runs every row of `plan` (with `--clock both`, its wall-time twin first) and prints the table
/// as the rows come.
async fn run_rows(
    args: &AbArgs,
    plan: &Plan,
    floor: Option<&EmulationFloor>,
) -> anyhow::Result<Runs> {
    let settings = &plan.settings;
    let wall_too = args.clock == ClockArg::Both;
    let names: Vec<(String, String)> = plan
        .entries
        .iter()
        .map(|e| (e.case.name.clone(), e.side.names()))
        .collect();
    let layout = TableLayout::fit(names);
    print!("{}", layout.header());
    let wall_settings = Settings {
        clock: ClockMode::Wall,
        ..settings.clone()
    };
    let rows_floor = (settings.clock == ClockMode::Wall)
        .then_some(floor)
        .flatten();
    // Virtual-time rows do not depend on what else runs: rows go side by side (each row's runs
    // too, on threads of their own), printed in order. A window of 4 rows per core keeps every
    // core busy while a slow row (a 1,024-device collective) holds the head of the window. Wall
    // rows run one at a time.
    let jobs = if settings.clock == ClockMode::Virtual && !wall_too {
        4 * std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        1
    };
    let mut measured = futures::stream::iter(
        plan.entries
            .iter()
            .map(|e| ab::compare(&e.case, e.side, settings, args.reps, rows_floor)),
    )
    .buffered(jobs);
    let mut runs = Runs::default();
    let mut wall_controls = Controls::default();
    for e in &plan.entries {
        let name = || {
            format!(
                "row {}/{}/{}/{}",
                e.case.name,
                e.case.devices,
                e.case.minibatch_per_device,
                e.side.names()
            )
        };
        let wall_row = if wall_too {
            let (mut row, _, _) = ab::compare(&e.case, e.side, &wall_settings, args.reps, floor)
                .await
                .with_context(|| format!("{} (wall time)", name()))?;
            wall_controls.attach(e, &mut row);
            print!("wall    ");
            print_row(&layout, &row);
            Some(row)
        } else {
            None
        };
        let (mut row, _, b) = measured
            .next()
            .await
            .context("a row was not measured")?
            .with_context(name)?;
        runs.controls.attach(e, &mut row);
        if wall_too {
            print!("virtual ");
        }
        runs.comm_wait += b.comm_wait;
        runs.busy += b.busy;
        runs.bytes += b.bytes;
        print_row(&layout, &row);
        if let Some(wall) = wall_row {
            let ratio = ClockRatio::of(&wall, &row);
            println!("    {}", ratio.line());
            runs.ratios.push(ratio);
            runs.wall_rows.push(wall);
        }
        runs.rows.push(row);
    }
    Ok(runs)
}

/// `--clock both`: how far virtual time strays from wall time over the rows whose wall row is
/// faithful.
fn print_clock_validation(ratios: &[ClockRatio]) {
    if ratios.is_empty() {
        return;
    }
    let faithful: Vec<&ClockRatio> = ratios.iter().filter(|r| !r.wall_warned).collect();
    let worst = faithful.iter().map(|r| r.worst()).fold(0.0, f64::max);
    println!(
        "virtual vs wall: {} of {} rows have an unwarned wall row; among them the largest |virtual/wall - 1| of tokens/s and speedup is {:.1}% (target {:.0}%: {})",
        faithful.len(),
        ratios.len(),
        worst * 100.0,
        validate::TARGET * 100.0,
        if faithful.is_empty() {
            "no faithful row"
        } else if worst <= validate::TARGET {
            "met"
        } else {
            "MISSED"
        }
    );
}

/// The balanced controls' speedups, and a warning for each control far from 1.00x.
fn print_controls(runs: &Runs) {
    let Some((lo, hi)) = runs.controls.range() else {
        return;
    };
    println!("balanced control speedup: {lo:.2}x to {hi:.2}x (1.00x = fair)");
    for r in runs.rows.iter().filter(|r| {
        r.workload == "balanced" && r.control_speedup.is_some_and(|c| (c - 1.0).abs() > 0.05)
    }) {
        println!(
            "  ! control at {} devices, {} per device, {} reads {:.2}x, not 1.00x: the setup itself shifts the comparison there by that factor; read that point's rows relative to it",
            r.devices, r.minibatch_per_device, r.dispatch, r.speedup
        );
    }
}

/// How many rows the emulation floor may have decided.
fn print_emulation_warnings(rows: &[BenchRow]) {
    let warned = rows
        .iter()
        .filter(|r| r.emulation_warning.is_some())
        .count();
    if warned > 0 {
        println!(
            "emulation: {warned} of {} rows carry a warning (see `! emulation` under them): modelled spans below {:.0}x the measured floor, or the emulation's own ring latency above {:.0}% of a collective micro-batch; the emulation, not the system, may decide part of those rows",
            rows.len(),
            floor::FAITHFUL_FACTOR,
            floor::RING_EXPOSED_LIMIT * 100.0
        );
    }
}

/// On-demand communication against compute over all rows, and the seconds the rows took.
fn print_communication(args: &AbArgs, settings: &Settings, runs: &Runs, started: Instant) {
    let (comm, busy, bytes) = (runs.comm_wait, runs.busy, runs.bytes);
    let exposed = if busy > 0.0 { comm / busy } else { 0.0 };
    match settings.link_bytes_per_sec() {
        _ if settings.links.is_some() => println!(
            "on-demand communication/compute: the modelled cluster's links: exposed {:.3} (pull + push wait / compute); {:.1} s",
            exposed,
            started.elapsed().as_secs_f64()
        ),
        Some(bw) => println!(
            "on-demand communication/compute: modelled {:.3} (link time of the bytes moved at {} ms per unit / compute), exposed {:.3} (pull + push wait / compute); {:.1} s",
            if busy > 0.0 { bytes as f64 / bw / busy } else { 0.0 },
            args.unit_transfer_ms,
            exposed,
            started.elapsed().as_secs_f64()
        ),
        None if settings.clock == ClockMode::Virtual => println!(
            "on-demand communication/compute: no link model (--unit-transfer-ms), so communication costs no virtual time: exposed {:.3} (pull + push wait / compute); {:.1} s",
            exposed,
            started.elapsed().as_secs_f64()
        ),
        None => println!(
            "on-demand communication/compute: no link model (--unit-transfer-ms), so communication is the local transport's real cost: exposed {:.3} (pull + push wait / compute); {:.1} s",
            exposed,
            started.elapsed().as_secs_f64()
        ),
    }
}

/// `--trace`: the first measured (non-control) row run once more on each side, traced.
async fn write_traces(
    (od_path, coll_path): &(PathBuf, PathBuf),
    plan: &Plan,
) -> anyhow::Result<()> {
    let settings = &plan.settings;
    let e = plan
        .entries
        .iter()
        .find(|e| !e.control)
        .unwrap_or(&plan.entries[0]);
    let od = ab::run(&e.case, e.side, settings, true).await?;
    odc::trace::write_chrome_trace(od_path, &od.spans, &format!("on-demand {}", e.case.name))?;
    let coll = ab::run(&e.case, Side::COLLECTIVE, settings, true).await?;
    odc::trace::write_chrome_trace(
        coll_path,
        &coll.spans,
        &format!("collective {}", e.case.name),
    )?;
    println!("trace: {} and {}", od_path.display(), coll_path.display());
    Ok(())
}

/// `--json` (with `--clock both`, the wall rows and the ratios beside it) and `--plot`; returns
/// the rows.
fn write_outputs(args: &AbArgs, outputs: &Outputs, runs: Runs) -> anyhow::Result<BenchReport> {
    let report = BenchReport { rows: runs.rows };
    if let Some(path) = &args.json {
        report.write_json(path)?;
        println!("json: {}", path.display());
    }
    if let Some((wall_path, clocks_path)) = &outputs.validation {
        BenchReport {
            rows: runs.wall_rows,
        }
        .write_json(wall_path)?;
        let mut json =
            serde_json::to_string_pretty(&runs.ratios).context("serialising the ratios")?;
        json.push('\n');
        std::fs::write(clocks_path, json)
            .with_context(|| format!("writing {}", clocks_path.display()))?;
        println!(
            "json: {} (wall rows), {} (virtual/wall ratios)",
            wall_path.display(),
            clocks_path.display()
        );
    }
    if let Some(path) = &args.plot {
        report::write_svg(path, &report.rows)?;
        println!("plot: {}", path.display());
    }
    Ok(report)
}

pub(crate) fn split_policy(s: &str) -> Result<odc::SplitPolicy, String> {
    s.parse()
}

pub(crate) fn context_parallel(s: &str) -> Result<odc::ContextParallel, String> {
    s.parse()
}
