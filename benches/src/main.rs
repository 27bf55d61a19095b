//! `odc-bench` command line: `odc-bench ab` — the on-demand vs collective benchmark.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context as _};
use clap::{Args, Parser, Subcommand, ValueEnum};
use odc::sim::SpeedSchedule;
use odc::DispatchMode;
use odc_bench::ab::{self as bench, Case, Settings, Side};
use odc_bench::report::{self, BenchReport, BenchRow};
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
    /// Collective (FSDP-style) vs on-demand on the same simulated devices, workload and seed,
    /// interleaved (A B A B ...).
    Ab(AbArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum Dispatch {
    Static,
    Dynamic,
}

#[derive(Args)]
struct AbArgs {
    /// Small matrix (LongAlign-like, RL-like and balanced rows at 8 devices, minibatch 4 per device,
    /// plus the straggler scenario); finishes in under 2 minutes on 2 cores.
    #[arg(long)]
    quick: bool,
    /// Workloads: longalign, swesmith, rl, balanced (comma separated).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// A file of sequence lengths (one positive integer per line) as the workload.
    #[arg(long)]
    lengths: Option<PathBuf>,
    /// Device counts.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,
    /// Minibatch sizes per device (samples per device per optimizer step).
    #[arg(long, value_delimiter = ',')]
    minibatch_per_device: Vec<usize>,
    /// On-demand dispatch modes (each gets its own rows).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "static,dynamic"
    )]
    dispatch: Vec<Dispatch>,
    /// Token budget of a micro-batch (default: the smallest power of two ≥ 16,384 holding every
    /// sampled sequence).
    #[arg(long)]
    token_budget: Option<u64>,
    /// Minibatches per run (the straggler slows down from the middle one).
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// A/B repetitions per row, interleaved (A B A B …); each row sums them.
    #[arg(long, default_value_t = 2)]
    reps: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Milliseconds of modelled compute per cost unit (a 32K-token sample of the 7B model is 13.1
    /// cost units).
    #[arg(long, default_value_t = 4.0)]
    time_scale_ms: f64,
    /// Elements per unit (bytes moved per gather and push).
    #[arg(long, default_value_t = 16 * 1024)]
    unit_elems: usize,
    /// Modelled milliseconds to move one unit over one device's link (default 0: no link model;
    /// 0.5 at the default time scale is about a 7B layer in fp32 over 12.5 GB/s per GPU). Each of
    /// a collective's many small ring transfers then pays a blocking-thread handoff that is large
    /// at this time scale, so the link model penalises collective mode beyond real ring latency.
    #[arg(long, default_value_t = 0.0)]
    unit_transfer_ms: f64,
    /// Units (blocks) of the simulated model.
    #[arg(long, default_value_t = 4)]
    units: usize,
    /// Skip the straggler scenario.
    #[arg(long)]
    no_straggler: bool,
    /// Write the rows as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write an SVG of speedup and utilization.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Write a Chrome/Perfetto trace of the first row's on-demand run (and `PATH.collective.json`
    /// of its collective run).
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
        out.push(
            Workload::from_file(path)
                .with_context(|| format!("workload file {}", path.display()))?,
        );
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

fn print_row(row: &BenchRow) {
    print!(
        "{}",
        report::format_table(std::slice::from_ref(row))
            .lines()
            .last()
            .map(|l| format!("{l}\n"))
            .unwrap_or_default()
    );
}

async fn ab(args: AbArgs) -> anyhow::Result<()> {
    if args.devices.contains(&0) || args.minibatch_per_device.contains(&0) {
        bail!("--devices and --minibatch-per-device must be positive");
    }
    if !(args.time_scale_ms.is_finite() && args.time_scale_ms > 0.0) {
        bail!(
            "--time-scale-ms must be positive, got {}",
            args.time_scale_ms
        );
    }
    let workloads = workloads(&args)?;
    let devices = or_default(&args.devices, &[8], &[4, 8, 16], args.quick);
    let per_device = or_default(&args.minibatch_per_device, &[4], &[1, 2, 4, 8], args.quick);
    let mut settings = Settings {
        steps: args.steps.max(2),
        seed: args.seed,
        ..Settings::default()
    };
    settings.device.seconds_per_cost = args.time_scale_ms / 1e3;
    settings.device.unit_elems = args.unit_elems.max(1);
    settings.device.units = args.units.max(1);
    if !(args.unit_transfer_ms.is_finite() && args.unit_transfer_ms >= 0.0) {
        bail!(
            "--unit-transfer-ms must be a non-negative number, got {}",
            args.unit_transfer_ms
        );
    }
    settings.unit_transfer_seconds = args.unit_transfer_ms / 1e3;
    if args.token_budget == Some(0) {
        bail!("--token-budget must be positive");
    }
    settings.token_budget = args.token_budget;
    let sides: Vec<Side> = args
        .dispatch
        .iter()
        .map(|d| match d {
            Dispatch::Static => Side::on_demand(DispatchMode::Static, false),
            Dispatch::Dynamic => Side::on_demand(DispatchMode::Dynamic, false),
        })
        .collect();
    let d = &settings.device;
    println!(
        "odc-bench ab: simulated {}-unit model, {} elements ({} KiB fp32) per unit; time scale: 1 cost unit = {} ms (a 32K-token sample of the 7B cost model = {:.0} ms); {} steps per run, {} rep(s), seed {}",
        d.units,
        d.unit_elems,
        d.unit_elems * 4 / 1024,
        args.time_scale_ms,
        d.cost.cost(32_000) * args.time_scale_ms,
        settings.steps,
        args.reps,
        args.seed
    );
    let started = Instant::now();
    let mut rows = Vec::new();
    let (mut comm, mut busy, mut bytes) = (0.0, 0.0, 0u64);
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
    println!(
        "{}",
        report::format_table(&[]).lines().next().unwrap_or_default()
    );
    for (case, sides) in &cases {
        for &side in sides {
            let (row, _, b) = bench::compare(case, side, &settings, args.reps).await?;
            comm += b.comm_wait;
            busy += b.busy;
            bytes += b.bytes;
            print_row(&row);
            rows.push(row);
        }
    }
    let exposed = if busy > 0.0 { comm / busy } else { 0.0 };
    match settings.link_bytes_per_sec() {
        Some(bw) => println!(
            "\non-demand communication/compute: modelled {:.3} (link time of the bytes moved at {} ms per unit / compute), exposed {:.3} (pull + push wait / compute); {:.1} s",
            if busy > 0.0 { bytes as f64 / bw / busy } else { 0.0 },
            args.unit_transfer_ms,
            exposed,
            started.elapsed().as_secs_f64()
        ),
        None => println!(
            "\non-demand communication/compute: no link model (--unit-transfer-ms), so communication is the local transport's real cost: exposed {:.3} (pull + push wait / compute); {:.1} s",
            exposed,
            started.elapsed().as_secs_f64()
        ),
    }
    if let Some(path) = &args.trace {
        let (case, sides) = &cases[0];
        let od = bench::run(case, sides[0], &settings, true).await?;
        odc::trace::write_chrome_trace(path, &od.spans, &format!("on-demand {}", case.name))?;
        let mut coll_path = path.clone().into_os_string();
        coll_path.push(".collective.json");
        let coll = bench::run(case, Side::COLLECTIVE, &settings, true).await?;
        odc::trace::write_chrome_trace(
            &PathBuf::from(&coll_path),
            &coll.spans,
            &format!("collective {}", case.name),
        )?;
        println!(
            "trace: {} and {}",
            path.display(),
            PathBuf::from(coll_path).display()
        );
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

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    match cli.command {
        Command::Ab(args) => runtime.block_on(ab(args)),
    }
}
