//! `odc-bench` command line: `odc-bench ab` — the on-demand vs collective benchmark.
//!
//! Every input is checked before anything is allocated or run (limits in [`odc_bench::input`]);
//! an error is printed once, as `error: outer: cause: …`, and the exit status is 1 (2 for a flag
//! clap refuses).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context as _};
use clap::{Args, Parser, Subcommand, ValueEnum};
use odc::sim::SpeedSchedule;
use odc::DispatchMode;
use odc_bench::ab::{self, Case, Controls, Settings, Side};
use odc_bench::floor;
use odc_bench::input::{self, MAX_DEVICES, MAX_MINIBATCH_PER_DEVICE, MAX_SEQUENCE_TOKENS};
use odc_bench::report::{self, BenchReport, BenchRow, TableLayout};
use odc_bench::workload::Workload;

#[derive(Parser)]
#[command(
    name = "odc-bench",
    version,
    about = "odc-bench: the evidence for odc (on-demand vs collective communication)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Collective (FSDP-style) vs on-demand on the same simulated devices, workload and seed, in
    /// ABBA order, with a balanced control at every devices × minibatch × dispatch.
    Ab(AbArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum Dispatch {
    Static,
    Dynamic,
}

fn devices(s: &str) -> Result<usize, String> {
    input::count(s, MAX_DEVICES)
}
fn per_device(s: &str) -> Result<usize, String> {
    input::count(s, MAX_MINIBATCH_PER_DEVICE)
}
fn steps(s: &str) -> Result<u64, String> {
    input::count(s, input::MAX_STEPS)
}
fn reps(s: &str) -> Result<usize, String> {
    input::count(s, input::MAX_REPS)
}
fn units(s: &str) -> Result<usize, String> {
    input::count(s, input::MAX_UNITS)
}
fn unit_elems(s: &str) -> Result<usize, String> {
    input::count(s, input::MAX_UNIT_ELEMS)
}
fn token_budget(s: &str) -> Result<u64, String> {
    input::count(s, MAX_SEQUENCE_TOKENS).map_err(|e| format!("{e} (the maximum sequence length)"))
}
fn time_scale(s: &str) -> Result<f64, String> {
    input::milliseconds(s, false)
}
fn transfer(s: &str) -> Result<f64, String> {
    input::milliseconds(s, true)
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
struct AbArgs {
    /// Small matrix (LongAlign-like, RL-like and balanced rows at 8 devices, minibatch 4 per device,
    /// plus the straggler scenario); finishes in under 2 minutes on 2 cores.
    #[arg(long)]
    quick: bool,
    /// Workloads: longalign, swesmith, rl, balanced (comma separated).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// A file of sequence lengths (one positive integer per line, at most 1048576 =
    /// MAX_SEQUENCE_TOKENS; `#` comments) as the workload.
    #[arg(long)]
    lengths: Option<PathBuf>,
    /// Device counts (1 to 4096).
    #[arg(long, value_delimiter = ',', value_parser = devices)]
    devices: Vec<usize>,
    /// Minibatch sizes per device (samples per device per optimizer step; 1 to 65536).
    #[arg(long, value_delimiter = ',', value_parser = per_device)]
    minibatch_per_device: Vec<usize>,
    /// On-demand dispatch modes (each gets its own rows).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "static,dynamic"
    )]
    dispatch: Vec<Dispatch>,
    /// Token budget of a micro-batch, at most 1048576 (default: the smallest power of two
    /// ≥ 16,384 holding the workload's longest sequence).
    #[arg(long, value_parser = token_budget)]
    token_budget: Option<u64>,
    /// Minibatches per run (the straggler slows down from the middle one).
    #[arg(long, default_value_t = 6, value_parser = steps)]
    steps: u64,
    /// A/B repetitions per row, in ABBA order (collective first in even repetitions, on-demand
    /// first in odd ones); each row sums them.
    #[arg(long, default_value_t = 2, value_parser = reps)]
    reps: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Milliseconds of modelled compute per cost unit (a 32K-token sample of the 7B model is 13.1
    /// cost units). Rows whose modelled spans are too short next to the measured emulation floor
    /// say so and name a faithful value.
    #[arg(long, default_value_t = 4.0, value_parser = time_scale, allow_hyphen_values = true)]
    time_scale_ms: f64,
    /// Elements per unit (bytes moved per gather and push).
    #[arg(long, default_value_t = 16 * 1024, value_parser = unit_elems)]
    unit_elems: usize,
    /// Modelled milliseconds to move one unit over one device's link (default 0: no link model;
    /// 0.5 at the default time scale is about a 7B layer in fp32 over 12.5 GB/s per GPU). Each of
    /// a collective's many small ring transfers then pays a blocking-thread handoff that is large
    /// at this time scale, so the link model penalises collective mode beyond real ring latency.
    #[arg(long, default_value_t = 0.0, value_parser = transfer, allow_hyphen_values = true)]
    unit_transfer_ms: f64,
    /// Units (blocks) of the simulated model.
    #[arg(long, default_value_t = 4, value_parser = units)]
    units: usize,
    /// Skip the straggler scenario.
    #[arg(long)]
    no_straggler: bool,
    /// Skip the balanced control rows (rows then carry a control only where the matrix has its
    /// own balanced rows).
    #[arg(long)]
    no_control: bool,
    /// Write the rows as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write an SVG of speedup and utilization.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Write a Chrome/Perfetto trace of the first measured (non-control) row's on-demand run (and
    /// `PATH.collective.json` of its collective run).
    #[arg(long)]
    trace: Option<PathBuf>,
}

fn workloads(args: &AbArgs) -> anyhow::Result<Vec<Workload>> {
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

fn or_default(v: &[usize], quick: &[usize], full: &[usize], is_quick: bool) -> Vec<usize> {
    if !v.is_empty() {
        v.to_vec()
    } else if is_quick {
        quick.to_vec()
    } else {
        full.to_vec()
    }
}

fn print_row(layout: &TableLayout, row: &BenchRow) {
    println!("{}", layout.line(row));
    if let Some(w) = &row.emulation_warning {
        println!("    ! emulation: {w}");
    }
}

/// `path` with `suffix` appended to its file name (the collective trace beside the on-demand one).
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut p = path.to_path_buf().into_os_string();
    p.push(suffix);
    PathBuf::from(p)
}

async fn ab(args: AbArgs) -> anyhow::Result<()> {
    // Sizes and outputs first: nothing is allocated, read or run before they pass.
    let devices = or_default(&args.devices, &[8], &[4, 8, 16], args.quick);
    let per_device = or_default(&args.minibatch_per_device, &[4], &[1, 2, 4, 8], args.quick);
    input::check_sizes(&devices, &per_device, args.units, args.unit_elems)?;
    let trace_paths = args
        .trace
        .as_ref()
        .map(|p| (p.clone(), with_suffix(p, ".collective.json")));
    for (flag, path) in [("--json", &args.json), ("--plot", &args.plot)] {
        if let Some(path) = path {
            input::check_output(flag, path)?;
        }
    }
    if let Some((od, coll)) = &trace_paths {
        input::check_output("--trace", od)?;
        input::check_output("--trace", coll)?;
    }

    let workloads = workloads(&args)?;
    let mut settings = Settings {
        steps: args.steps,
        seed: args.seed,
        token_budget: args.token_budget,
        unit_transfer_seconds: args.unit_transfer_ms / 1e3,
        ..Settings::default()
    };
    settings.device.seconds_per_cost = args.time_scale_ms / 1e3;
    settings.device.unit_elems = args.unit_elems;
    settings.device.units = args.units;
    let sides: Vec<Side> = args
        .dispatch
        .iter()
        .map(|d| match d {
            Dispatch::Static => Side::on_demand(DispatchMode::Static, false),
            Dispatch::Dynamic => Side::on_demand(DispatchMode::Dynamic, false),
        })
        .collect();

    let mut cases = Vec::new();
    for w in &workloads {
        for &n in &devices {
            for &m in &per_device {
                cases.push((
                    Case {
                        name: w.name(),
                        workload: w.clone(),
                        devices: n,
                        minibatch_per_device: m,
                        speeds: SpeedSchedule::uniform(),
                    },
                    sides.clone(),
                ));
            }
        }
    }
    if !args.no_straggler {
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
        let w = workloads[0].clone();
        let speeds = SpeedSchedule::uniform().with_change(n - 1, settings.steps / 2, 0.5);
        let sides = vec![
            Side::on_demand(DispatchMode::Dynamic, false),
            Side::on_demand(DispatchMode::Dynamic, true),
            Side::on_demand(DispatchMode::Static, false),
            Side::on_demand(DispatchMode::Static, true),
        ];
        cases.push((
            Case {
                name: format!("{}+straggler", w.name()),
                workload: w,
                devices: n,
                minibatch_per_device: m,
                speeds,
            },
            sides,
        ));
    }
    // The balanced control fits any budget the other workloads fit.
    let control_tokens = args.token_budget.unwrap_or(u64::MAX).min(16_384);
    let entries = ab::plan(&cases, !args.no_control, control_tokens);

    // Token budgets hold every sequence, and modelled times fit a duration, for every row.
    for e in &entries {
        let budget = ab::token_budget(&e.case, &settings);
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

    let d = &settings.device;
    println!(
        "odc-bench ab: simulated {}-unit model, {} elements ({} KiB fp32) per unit; time scale: 1 cost unit = {} ms (a 32K-token sample of the 7B cost model = {:.0} ms); {} steps per run, {} rep(s) in ABBA order, seed {}",
        d.units,
        d.unit_elems,
        d.unit_elems * 4 / 1024,
        args.time_scale_ms,
        d.cost.cost(32_000) * args.time_scale_ms,
        settings.steps,
        args.reps,
        args.seed
    );
    let most_devices = devices.iter().copied().max().unwrap_or(1);
    let mut emulation_floor = floor::measure(most_devices, floor::REQUEST).await;
    emulation_floor.ring_step = odc::sim::ring_step_latency(most_devices as u32, 50)
        .await
        .context("measuring the emulation's ring latency")?;
    println!("{}", emulation_floor.describe());
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
    let started = Instant::now();
    let mut rows = Vec::new();
    let (mut comm, mut busy, mut bytes) = (0.0, 0.0, 0u64);
    let mut controls = Controls::default();
    let names: Vec<(String, String)> = entries
        .iter()
        .map(|e| (e.case.name.clone(), e.side.dispatch_name()))
        .collect();
    let layout = TableLayout::fit(names.iter().map(|(w, d)| (w.as_str(), d.as_str())));
    print!("{}", layout.header());
    for e in &entries {
        let (mut row, _, b) = ab::compare(
            &e.case,
            e.side,
            &settings,
            args.reps,
            Some(&emulation_floor),
        )
        .await
        .with_context(|| {
            format!(
                "row {}/{}/{}/{}",
                e.case.name,
                e.case.devices,
                e.case.minibatch_per_device,
                e.side.dispatch_name()
            )
        })?;
        controls.attach(e, &mut row);
        comm += b.comm_wait;
        busy += b.busy;
        bytes += b.bytes;
        print_row(&layout, &row);
        rows.push(row);
    }
    println!();
    if let Some((lo, hi)) = controls.range() {
        println!("balanced control speedup: {lo:.2}x to {hi:.2}x (1.00x = fair)");
        for r in rows.iter().filter(|r| {
            r.workload == "balanced" && r.control_speedup.is_some_and(|c| (c - 1.0).abs() > 0.05)
        }) {
            println!(
                "  ! control at {} devices, {} per device, {} reads {:.2}x, not 1.00x: the setup itself shifts the comparison there by that factor; read that point's rows relative to it",
                r.devices, r.minibatch_per_device, r.dispatch, r.speedup
            );
        }
    }
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
    let exposed = if busy > 0.0 { comm / busy } else { 0.0 };
    match settings.link_bytes_per_sec() {
        Some(bw) => println!(
            "on-demand communication/compute: modelled {:.3} (link time of the bytes moved at {} ms per unit / compute), exposed {:.3} (pull + push wait / compute); {:.1} s",
            if busy > 0.0 { bytes as f64 / bw / busy } else { 0.0 },
            args.unit_transfer_ms,
            exposed,
            started.elapsed().as_secs_f64()
        ),
        None => println!(
            "on-demand communication/compute: no link model (--unit-transfer-ms), so communication is the local transport's real cost: exposed {:.3} (pull + push wait / compute); {:.1} s",
            exposed,
            started.elapsed().as_secs_f64()
        ),
    }
    if let Some((od_path, coll_path)) = &trace_paths {
        let e = entries.iter().find(|e| !e.control).unwrap_or(&entries[0]);
        let od = ab::run(&e.case, e.side, &settings, true).await?;
        odc::trace::write_chrome_trace(od_path, &od.spans, &format!("on-demand {}", e.case.name))?;
        let coll = ab::run(&e.case, Side::COLLECTIVE, &settings, true).await?;
        odc::trace::write_chrome_trace(
            coll_path,
            &coll.spans,
            &format!("collective {}", e.case.name),
        )?;
        println!("trace: {} and {}", od_path.display(), coll_path.display());
    }
    let report = BenchReport { rows };
    if let Some(path) = &args.json {
        report.write_json(path)?;
        println!("json: {}", path.display());
    }
    if let Some(path) = &args.plot {
        report::write_svg(path, &report.rows)?;
        println!("plot: {}", path.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")
        .and_then(|runtime| match cli.command {
            Command::Ab(args) => runtime.block_on(ab(args)),
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", odc_bench::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn help_states_the_maximum_sequence_length() {
        let help = Cli::command()
            .find_subcommand_mut("ab")
            .map(|c| c.render_long_help().to_string())
            .unwrap_or_default();
        assert!(help.contains(&MAX_SEQUENCE_TOKENS.to_string()), "{help}");
        assert!(help.contains("MAX_SEQUENCE_TOKENS"), "{help}");
        assert_eq!(odc_bench::workload::MAX_SEQUENCE_TOKENS, 1 << 20);
    }
}
