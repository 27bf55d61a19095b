//! `odc-bench processes`: the `embed` example as N processes against one, ABBA with a control.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

#[derive(Args)]
pub(crate) struct ProcessesArgs {
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=64))]
    pub(crate) nprocs: u32,
    #[arg(long, value_enum, default_value = "shm")]
    pub(crate) transport: ProcessTransport,
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub(crate) steps: u32,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub(crate) rounds: u32,
    /// The `embed` example (default: examples/embed beside this executable).
    #[arg(long)]
    pub(crate) embed: Option<PathBuf>,
    /// The `odc` launcher (default: odc beside this executable).
    #[arg(long)]
    pub(crate) odc: Option<PathBuf>,
    /// Extra compute per micro-batch that does not occupy a core (as a GPU's would), in ms.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=10_000))]
    pub(crate) compute_delay_ms: u32,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum ProcessTransport {
    Shm,
    Tcp,
}

pub(crate) fn processes(args: ProcessesArgs) -> anyhow::Result<()> {
    use odc_bench::processes as p;
    let settings = p::Settings {
        embed: match args.embed {
            Some(path) => path,
            None => p::sibling("embed", true)?,
        },
        odc: match args.odc {
            Some(path) => path,
            None => p::sibling("odc", false)?,
        },
        nprocs: args.nprocs,
        transport: match args.transport {
            ProcessTransport::Shm => "shm".into(),
            ProcessTransport::Tcp => "tcp".into(),
        },
        steps: args.steps,
        rounds: args.rounds,
        compute_delay_ms: args.compute_delay_ms,
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "odc-bench processes: embed, {n} trainers + {n} servers, {} steps, {} processes over {} \
         vs one process; ABBA x {} rounds; {cores} cores",
        settings.steps,
        settings.nprocs,
        settings.transport,
        settings.rounds,
        n = settings.nprocs
    );
    if !p::is_release(&settings.embed) {
        println!(
            "! {} is not a release build: the numbers are not evidence",
            settings.embed.display()
        );
    }
    if settings.nprocs as usize > cores {
        println!(
            "! {} processes share {cores} cores: oversubscription, not communication, can decide \
             the ratio",
            settings.nprocs
        );
    }
    let outcome = p::run(&settings, |line| println!("{line}"))?;
    let range = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{lo:.3}..{hi:.3}")
    };
    println!(
        "one process {:.2} ms/step, {} processes {:.2} ms/step: ratio {:.3} (rounds {}), control \
         {:.3} (rounds {}); target <= 1.2: {}",
        outcome.single * 1e3,
        settings.nprocs,
        outcome.multi * 1e3,
        outcome.ratio,
        range(&outcome.round_ratios),
        outcome.control,
        range(&outcome.control_ratios),
        if outcome.ratio <= 1.2 {
            "met"
        } else {
            "MISSED"
        }
    );
    Ok(())
}
