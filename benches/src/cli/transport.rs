//! `odc-bench transport` (pull bandwidth and latency of each backend beside the machine's limit)
//! and its hidden owner process.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context as _};
use clap::{Args, ValueEnum};
use odc_bench::input;
use odc_bench::transport::{self as pulls, Backend, OwnerKind, TransportReport};

use super::*;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum BackendArg {
    Local,
    Shm,
    Tcp,
    /// The cuda backend's rows on one GPU (built with `--features cuda`).
    Cuda,
}

impl BackendArg {
    /// The host backend, `None` for `cuda` (which has rows of its own).
    pub(crate) fn host(self) -> Option<Backend> {
        match self {
            BackendArg::Local => Some(Backend::Local),
            BackendArg::Shm => Some(Backend::Shm),
            BackendArg::Tcp => Some(Backend::Tcp),
            BackendArg::Cuda => None,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        self.host().map_or("cuda", Backend::name)
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum OwnerBackendArg {
    Shm,
    Tcp,
    RawTcp,
    Cuda,
}

pub(crate) fn pull_size(s: &str) -> Result<usize, String> {
    pulls::parse_bytes(s, 4, pulls::MAX_PULL_BYTES)
}
/// A region size of an owner child, or a `--cuda-sizes` entry (the cuda rows go to 4 GiB).
pub(crate) fn cuda_size(s: &str) -> Result<usize, String> {
    pulls::parse_bytes(s, 4, 4 << 30)
}
pub(crate) fn tcp_part_bytes(s: &str) -> Result<usize, String> {
    let (min, max) = pulls::TCP_PART_BYTES;
    pulls::parse_bytes(s, min, max)
}
pub(crate) fn shm_chunk_bytes(s: &str) -> Result<usize, String> {
    let (min, max) = pulls::SHM_CHUNK_BYTES;
    pulls::parse_bytes(s, min, max)
}
pub(crate) fn rounds(s: &str) -> Result<usize, String> {
    input::count(s, pulls::MAX_ROUNDS)
}
pub(crate) fn measure_ms(s: &str) -> Result<u64, String> {
    input::count(s, pulls::MEASURE_MS.1)
}

#[derive(Args)]
#[command(
    after_help = "Sizes (--sizes, --tcp-part-bytes, --shm-chunk-bytes) are bytes, optionally with \
KiB, MiB or GiB, multiples of 4; --sizes at most 256 MiB, --tcp-part-bytes 4 KiB to 64 MiB, \
--shm-chunk-bytes 8 bytes to 64 MiB; --rounds at most 1000; --measure-ms at most 10000."
)]
pub(crate) struct TransportArgs {
    /// A few seconds: 2 rounds of ~5 ms measurements (a smoke run, not evidence).
    #[arg(long)]
    pub(crate) quick: bool,
    /// Backends (comma separated).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "local,shm,tcp"
    )]
    pub(crate) backends: Vec<BackendArg>,
    /// Pull sizes (comma separated; default 4KiB,1MiB,64MiB).
    #[arg(long, value_delimiter = ',', value_parser = pull_size)]
    pub(crate) sizes: Vec<usize>,
    /// Limit/backend pairs per row, in ABBA order (default 8; 2 with --quick).
    #[arg(long, value_parser = rounds)]
    pub(crate) rounds: Option<usize>,
    /// Milliseconds per measurement (default 150; 5 with --quick).
    #[arg(long, value_parser = measure_ms)]
    pub(crate) measure_ms: Option<u64>,
    /// tcp: bytes per part of a large read (the transport's read_part_bytes; default 4 MiB).
    #[arg(long, value_parser = tcp_part_bytes)]
    pub(crate) tcp_part_bytes: Option<usize>,
    /// shm: bytes per seqlock chunk of a segment (default 256 KiB).
    #[arg(long, value_parser = shm_chunk_bytes)]
    pub(crate) shm_chunk_bytes: Option<usize>,
    /// tcp: frames unsealed after the handshake (`ODC_INSECURE_FRAMES`'s data plane: no per-frame
    /// authentication), to set against the default sealed frames.
    #[arg(long)]
    pub(crate) insecure_frames: bool,
    /// cuda: sizes of the cuda rows (comma separated; default 1MiB,64MiB,1GiB; at most 4 GiB).
    #[arg(long, value_delimiter = ',', value_parser = cuda_size)]
    pub(crate) cuda_sizes: Vec<usize>,
    /// cuda: the device (ordinal) of the reader and of the owner process.
    #[arg(long, default_value_t = 0)]
    pub(crate) cuda_device: u32,
    /// Write the rows as JSON: {"rows":[{"backend","bytes","gbytes_per_s","limit_gbytes_per_s",
    /// "ratio","latency_us"}]}.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct OwnerArgs {
    #[arg(long, value_enum)]
    pub(crate) backend: OwnerBackendArg,
    /// Region sizes (comma separated).
    #[arg(long, value_delimiter = ',', value_parser = cuda_size, required = true)]
    pub(crate) bytes: Vec<usize>,
    /// The shm job id (the parent's).
    #[arg(long, default_value = "odc-bench")]
    pub(crate) job: String,
    #[arg(long, value_parser = tcp_part_bytes, default_value_t = 4 << 20)]
    pub(crate) tcp_part_bytes: usize,
    #[arg(long, value_parser = shm_chunk_bytes, default_value_t = 256 << 10)]
    pub(crate) shm_chunk_bytes: usize,
    /// tcp: frames unsealed after the handshake.
    #[arg(long)]
    pub(crate) insecure_frames: bool,
    /// cuda: the device the regions live on.
    #[arg(long, default_value_t = 0)]
    pub(crate) cuda_device: u32,
}

pub(crate) async fn transport(args: TransportArgs) -> anyhow::Result<()> {
    if let Some(path) = &args.json {
        input::check_output("--json", path)?;
    }
    if let Some(b) = repeated(&args.backends) {
        bail!("--backends names {} twice", b.name());
    }
    if let Some(n) = repeated(&args.cuda_sizes) {
        bail!("--cuda-sizes names {} twice", pulls::human_bytes(n));
    }
    let with_cuda = args.backends.contains(&BackendArg::Cuda);
    if with_cuda
        && !cfg!(all(
            any(feature = "cuda", feature = "gpu"),
            target_os = "linux"
        ))
    {
        bail!(
            "--backends cuda: this odc-bench was built without the cuda feature (cargo build \
             --release -p odc-bench --features cuda; Linux only)"
        );
    }
    #[cfg(all(any(feature = "cuda", feature = "gpu"), target_os = "linux"))]
    if with_cuda {
        odc_transport::cuda::check_driver().context("--backends cuda")?;
    }
    if let Some(n) = repeated(&args.sizes) {
        bail!("--sizes names {} twice", pulls::human_bytes(n));
    }
    let exe = std::env::current_exe()
        .context("finding the odc-bench executable (it runs the owner processes)")?;
    let mut settings = pulls::Settings::new(exe, args.quick);
    settings.backends = args.backends.iter().filter_map(|b| b.host()).collect();
    if !args.sizes.is_empty() {
        settings.sizes = args.sizes.clone();
    }
    if let Some(r) = args.rounds {
        settings.rounds = r;
    }
    if let Some(ms) = args.measure_ms {
        settings.measure = std::time::Duration::from_millis(ms);
    }
    settings.sealed_frames = !args.insecure_frames;
    if let Some(b) = args.tcp_part_bytes {
        settings.tcp_part_bytes = b;
    }
    if let Some(b) = args.shm_chunk_bytes {
        settings.shm_chunk_bytes = b;
    }
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    println!(
        "odc-bench transport: {} per backend ({}), each next to this machine's limit \
         measured in the same run; {} round(s) in ABBA order, ~{} ms per measurement; {} core(s); \
         {} build",
        {
            let list = |sizes: &[usize]| {
                sizes
                    .iter()
                    .map(|&n| pulls::human_bytes(n))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let mut what = Vec::new();
            if !settings.backends.is_empty() {
                what.push(format!("pulls of {}", list(&settings.sizes)));
            }
            if with_cuda {
                let sizes = if args.cuda_sizes.is_empty() {
                    vec![1 << 20, 64 << 20, 1 << 30]
                } else {
                    args.cuda_sizes.clone()
                };
                what.push(format!("cuda rows at {}", list(&sizes)));
            }
            what.join("; ")
        },
        args.backends
            .iter()
            .map(|b| b.name())
            .collect::<Vec<_>>()
            .join(", "),
        settings.rounds,
        settings.measure.as_millis(),
        cores,
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
    if cfg!(debug_assertions) {
        println!("! debug build: the numbers are not evidence; run with --release");
    }
    let started = Instant::now();
    print!("{}", pulls::table_header());
    let show = |m: &pulls::Measured| {
        println!("{}", pulls::table_line(m));
        if let Some(w) = pulls::row_warning(m) {
            println!("    ! {w}");
        }
    };
    let mut rows = if settings.backends.is_empty() {
        Vec::new()
    } else {
        pulls::run(&settings, show).await?
    };
    let mut legend = pulls::legend(&settings, &settings.backends);
    let mut targets = pulls::target_lines(&rows);
    if with_cuda {
        let (cuda_rows, cuda_legend) = cuda_rows(&args, &settings, show).await?;
        targets.extend(cuda_target_lines(&cuda_rows));
        legend.extend(cuda_legend);
        rows.extend(cuda_rows);
    }
    println!();
    for line in legend {
        println!("{line}");
    }
    for line in targets {
        println!("{line}");
    }
    println!("{:.1} s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        let report = TransportReport {
            rows: rows.into_iter().map(|m| m.row).collect(),
        };
        report.write_json(path)?;
        println!("json: {}", path.display());
    }
    Ok(())
}

/// The cuda backend's rows and their legend (`--backends cuda`).
#[cfg(all(any(feature = "cuda", feature = "gpu"), target_os = "linux"))]
pub(crate) async fn cuda_rows(
    args: &TransportArgs,
    settings: &pulls::Settings,
    show: impl FnMut(&pulls::Measured),
) -> anyhow::Result<(Vec<pulls::Measured>, Vec<String>)> {
    let cuda = pulls::cuda::Settings {
        sizes: if args.cuda_sizes.is_empty() {
            pulls::cuda::DEFAULT_SIZES.to_vec()
        } else {
            args.cuda_sizes.clone()
        },
        device: args.cuda_device,
        rounds: settings.rounds,
        measure: settings.measure,
        exe: settings.exe.clone(),
    };
    let (rows, device) = pulls::cuda::run(&cuda, show).await?;
    Ok((rows, pulls::cuda::legend(&cuda, &device)))
}

#[cfg(all(any(feature = "cuda", feature = "gpu"), target_os = "linux"))]
pub(crate) fn cuda_target_lines(rows: &[pulls::Measured]) -> Vec<String> {
    pulls::cuda::target_lines(rows)
}

/// Without the feature `--backends cuda` was refused before anything ran.
#[cfg(not(all(any(feature = "cuda", feature = "gpu"), target_os = "linux")))]
pub(crate) async fn cuda_rows(
    _: &TransportArgs,
    _: &pulls::Settings,
    _: impl FnMut(&pulls::Measured),
) -> anyhow::Result<(Vec<pulls::Measured>, Vec<String>)> {
    bail!("this odc-bench was built without the cuda feature")
}

#[cfg(not(all(any(feature = "cuda", feature = "gpu"), target_os = "linux")))]
pub(crate) fn cuda_target_lines(_: &[pulls::Measured]) -> Vec<String> {
    Vec::new()
}

pub(crate) async fn transport_owner(args: OwnerArgs) -> anyhow::Result<()> {
    pulls::serve_owner(pulls::OwnerSettings {
        kind: match args.backend {
            OwnerBackendArg::Shm => OwnerKind::Shm,
            OwnerBackendArg::Tcp => OwnerKind::Tcp,
            OwnerBackendArg::RawTcp => OwnerKind::RawTcp,
            OwnerBackendArg::Cuda => OwnerKind::Cuda,
        },
        sizes: args.bytes,
        job: args.job,
        tcp_part_bytes: args.tcp_part_bytes,
        sealed_frames: !args.insecure_frames,
        shm_chunk_bytes: args.shm_chunk_bytes,
        cuda_device: args.cuda_device,
    })
    .await
}
