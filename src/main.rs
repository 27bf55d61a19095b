//! The `odc` command: `odc launch --nprocs N --transport shm|tcp|cuda -- PROGRAM ARGS…` starts a local
//! multi-process job (like `torchrun --standalone`) and exits with the worst exit status of its
//! ranks; `--max-restarts N` starts the whole job again after a failure, up to N times (like
//! torchrun's). (Benchmarks are `odc-bench`.) Built with the `cli` feature
//! (`cargo build --release --features cli --bin odc`), so library users do not depend on clap.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use odc::launch::{launch, LaunchConfig};

#[derive(Parser)]
#[command(name = "odc", version, about = "odc: on-demand communication runtime")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum TransportArg {
    Shm,
    Tcp,
    /// CUDA IPC between the processes of this host (the ranks' programs need odc's `cuda`
    /// feature; each uses device `ODC_LOCAL_RANK mod device_count`).
    Cuda,
}

#[derive(Subcommand)]
enum Command {
    /// Start PROGRAM as N ranks of one job on this host (ODC_RANK, ODC_WORLD_SIZE,
    /// ODC_COORDINATOR, ODC_SECRET, ODC_JOB, ODC_TRANSPORT, ODC_RESTART_COUNT set for each); exit
    /// with the worst exit status (of the last attempt, with --max-restarts).
    Launch {
        /// Processes to start.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
        nprocs: u32,
        /// Data plane between the ranks.
        #[arg(long, value_enum, default_value = "shm")]
        transport: TransportArg,
        /// Seconds the other ranks may run on after one failed (and after SIGTERM).
        #[arg(long, default_value_t = 10.0)]
        grace_secs: f64,
        /// Stop every rank after this many seconds (exit status 124); bounds the whole launch,
        /// restarts included.
        #[arg(long)]
        timeout_secs: Option<f64>,
        /// After a rank fails (non-zero exit or a signal), stop the others and start every rank
        /// again, at most this many times (ODC_RESTART_COUNT: 0, 1, ...); the program resumes
        /// from its own checkpoints.
        #[arg(long, default_value_t = 0)]
        max_restarts: u32,
        /// Send the data plane's frames between hosts unsealed (ODC_INSECURE_FRAMES=1 for every
        /// rank: no per-frame authentication; each rank logs it). For clusters that want the
        /// bytes back on a network they trust.
        #[arg(long)]
        insecure_frames: bool,
        /// The program and its arguments (after `--`).
        #[arg(required = true, last = true)]
        command: Vec<String>,
    },
}

fn seconds(flag: &str, value: f64) -> Result<Duration, String> {
    if value.is_finite() && (0.0..=1e9).contains(&value) {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(format!(
            "--{flag} must be a number of seconds between 0 and 1e9, got {value}"
        ))
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Command::Launch {
        nprocs,
        transport,
        grace_secs,
        timeout_secs,
        max_restarts,
        insecure_frames,
        command,
    } = cli.command;
    let config = match (|| -> Result<LaunchConfig, String> {
        let (program, args) = command.split_first().ok_or("no program given after --")?;
        Ok(LaunchConfig {
            nprocs,
            transport: match transport {
                TransportArg::Shm => "shm",
                TransportArg::Tcp => "tcp",
                TransportArg::Cuda => "cuda",
            }
            .into(),
            program: program.clone(),
            args: args.to_vec(),
            grace: seconds("grace-secs", grace_secs)?,
            timeout: timeout_secs
                .map(|t| seconds("timeout-secs", t))
                .transpose()?,
            max_restarts,
            insecure_frames,
        })
    })() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(launch(&config)) {
        Ok(status) => ExitCode::from(u8::try_from(status.clamp(0, 255)).unwrap_or(1)),
        Err(e) => {
            eprintln!("error: odc launch: {e}");
            ExitCode::FAILURE
        }
    }
}
