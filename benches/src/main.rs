//! `odc-bench` command line: `odc-bench ab` — the on-demand vs collective benchmark;
//! `odc-bench transport` — pull bandwidth and latency of each transport backend next to the
//! machine's own limit (see [`odc_bench::transport`]); `odc-bench sft-overhead` — an SFT step on
//! odc vs candle alone (CPU, or a GPU with MFU); `odc-bench calibrate` — per-unit compute time
//! against tokens, a profile for the simulator (see [`odc_bench::calibrate`]).
//!
//! Every input is checked before anything is allocated or run (limits in [`odc_bench::input`]);
//! an error is printed once, as `error: outer: cause: …`, and the exit status is 1 (2 for a flag
//! clap refuses).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context as _};
use clap::{Args, Parser, Subcommand, ValueEnum};
use futures::StreamExt as _;
use odc::sim::clock::ClockMode;
use odc::sim::SpeedSchedule;
use odc::DispatchMode;
use odc_bench::ab::{self, Case, Controls, Settings, Side};
use odc_bench::floor;
use odc_bench::input::{self, MAX_DEVICES, MAX_MINIBATCH_PER_DEVICE, MAX_SEQUENCE_TOKENS};
use odc_bench::report::{self, BenchReport, BenchRow, TableLayout};
use odc_bench::transport::{self as pulls, Backend, OwnerKind, TransportReport};
use odc_bench::validate::{self, ClockRatio};
use odc_bench::workload::Workload;

/// Counts live bytes for `odc-bench memory` (a relaxed atomic add per allocation elsewhere).
#[global_allocator]
static ALLOCATOR: odc_bench::memory::Counting = odc_bench::memory::Counting;

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
    /// Pull bandwidth of each transport backend (local, shm, tcp) at 4 KiB, 1 MiB and 64 MiB next
    /// to the machine's own limit measured in the same run (memcpy; a raw socket for tcp), in ABBA
    /// order, and the round-trip latency of a small pull. shm and tcp owners run in child
    /// processes.
    Transport(TransportArgs),
    /// Internal: the owner process of `odc-bench transport` (registers regions, prints their
    /// handles as one JSON line, serves until stdin closes).
    #[command(hide = true)]
    TransportOwner(OwnerArgs),
    /// Wall time per step of the `embed` example as N processes (`odc launch`, shm or tcp) next
    /// to the same job in one process, interleaved ABBA, with an A-vs-A control.
    Processes(ProcessesArgs),
    /// One SFT step of the reference transformer on odc (trainers and servers in one process,
    /// local transport, per-unit backward) vs the same step in candle alone, ABBA, with a
    /// candle-vs-candle control; tokens/s of both, and MFU on a GPU (`--device cuda`, feature
    /// `gpu`).
    SftOverhead(SftOverheadArgs),
    /// Per-unit forward + backward time against tokens per micro-batch for model presets, fitted
    /// as a·ŝ² + b·ŝ + c (ŝ = tokens / 32000), written as a profile for the simulator (`--json`;
    /// schema in odc_bench::calibrate).
    Calibrate(CalibrateArgs),
    /// Scale projection in virtual time: on-demand vs collective at 8–1,024 devices with the
    /// balanced control (the `ab` rows on tokio's paused clock, compute priced by an H100 device
    /// profile), and the long-sequence table: step time against perfect balance with and without
    /// context-parallel splitting (odc_bench::sim).
    Sim(SimArgs),
    /// A seeded random checkpoint in Hugging Face layout shaped like a public model
    /// (smollm2-135m, qwen2.5-0.5b, qwen3-0.6b, llama3.2-1b, qwen2.5-1.5b), for `hf-load` and
    /// `sft-overhead --model-dir`.
    HfMake(HfMakeArgs),
    /// Loading a Hugging Face checkpoint: opening (every header checked) and converting every
    /// unit to f32 as the shard servers do, seconds and peak memory against the file size.
    HfLoad(HfLoadArgs),
    /// Bytes pulled and pushed per step with LoRA against full fine-tuning of the same model
    /// (a model directory or a shape), trainers and servers in one process.
    LoraTraffic(LoraTrafficArgs),
    /// Bytes a trainer holds while it trains one sample (a counting allocator; RSS beside it)
    /// against sequence length and depth, next to the analytical expectation, for the old path
    /// (no resharding, plain attention, MLP and head) and the new one (odc_bench::memory).
    Memory(MemoryArgs),
}

#[derive(Args)]
struct MemoryArgs {
    /// The model's shape: tiny, or a public one (smollm2-135m, qwen2.5-0.5b, qwen3-0.6b,
    /// llama3.2-1b, qwen2.5-1.5b), with seeded random weights.
    #[arg(long, default_value = "qwen2.5-0.5b")]
    shape: String,
    /// Blocks of the model (default: the shape's), comma-separated for a depth sweep.
    #[arg(long, value_delimiter = ',')]
    layers: Vec<usize>,
    /// Tokens of the one sample per step, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096")]
    lengths: Vec<usize>,
    /// The paths to measure: old, new (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "new")]
    paths: Vec<odc_bench::memory::Path>,
    /// Write an SVG plot of measured bytes against length here.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Instead of memory: step time of resharding against keeping at each length, this many
    /// ABCCBA rounds (keep, reshard, keep again as the control).
    #[arg(long, default_value_t = 0)]
    speed_rounds: usize,
    /// Print the analytical expectation only, with its parts (no training).
    #[arg(long)]
    expected_only: bool,
    /// Plot (`--svg`) the rows of earlier runs' printed tables instead of measuring.
    #[arg(long, value_delimiter = ',')]
    plot_from: Vec<PathBuf>,
}

#[derive(Args)]
struct LoraTrafficArgs {
    /// A model directory (its config and weights) ...
    #[arg(long, conflicts_with = "shape")]
    model_dir: Option<PathBuf>,
    /// ... or a shape with seeded weights: smollm2-135m, qwen2.5-0.5b, qwen3-0.6b, llama3.2-1b,
    /// qwen2.5-1.5b.
    #[arg(long)]
    shape: Option<String>,
    /// LoRA's rank (all linear layers, alpha = 2 · rank).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=4096))]
    rank: u64,
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=1000))]
    steps: u64,
    /// Samples per step, each of --len random tokens.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=4096))]
    samples: u64,
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(2..=65_536))]
    len: u64,
}

#[derive(Args)]
struct HfMakeArgs {
    /// smollm2-135m, qwen2.5-0.5b, qwen3-0.6b, llama3.2-1b or qwen2.5-1.5b.
    #[arg(long)]
    shape: String,
    /// bf16 or f32 on disk.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// The directory to write (must not exist, or be empty).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct HfLoadArgs {
    /// The model directory.
    #[arg(long)]
    model_dir: PathBuf,
    /// Shard servers the conversion is split over.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1024))]
    servers: u32,
}

#[derive(Args)]
struct CalibrateArgs {
    /// cpu, cuda or cuda:N (a GPU needs a build with the `gpu` feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, or bf16 (mixed precision; the default on CUDA).
    #[arg(long)]
    precision: Option<String>,
    /// Model presets (comma-separated): tiny, gpu-100m, block-1.5b, block-7b.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "gpu-100m,block-1.5b,block-7b"
    )]
    models: Vec<String>,
    /// Tokens per micro-batch (one sample each), comma-separated; a size that fails (out of
    /// memory) ends that unit's ladder.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024,2048,4096,8192,16384",
        value_parser = clap::value_parser!(u64).range(2..=1_048_576))]
    tokens: Vec<u64>,
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=100))]
    warmup: u32,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    reps: u32,
    /// Write the profile here (JSON).
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct SftOverheadArgs {
    /// Steps per block (after one warm-up block per side).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1_000))]
    steps: u32,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// Problems per minibatch.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4_096))]
    batch_size: u32,
    /// Most tokens per micro-batch.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(512..=1_048_576))]
    token_budget: u64,
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    trainers: u32,
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    servers: u32,
    /// odc's dispatch: `dynamic` (micro-batches of decreasing size, stealing) or `static`.
    #[arg(long, value_enum, default_value = "dynamic")]
    dispatch: Dispatch,
    /// Where both sides compute: cpu, cuda or cuda:N (a GPU needs a build with the `gpu`
    /// feature). On a GPU the data are synthetic samples of --min-len..=--max-len tokens.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, or bf16 (mixed precision; the default on CUDA).
    #[arg(long)]
    precision: Option<String>,
    /// The model preset (default: tiny on the CPU, gpu-100m on CUDA).
    #[arg(long)]
    model: Option<String>,
    /// Shortest synthetic sample (GPU runs).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(2..=65_536))]
    min_len: u64,
    /// Longest synthetic sample (GPU runs): keep the attention scores within the device's
    /// memory (see ModelConfig::gpu_100m).
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u64).range(2..=65_536))]
    max_len: u64,
    /// The device's dense bf16 peak in TFLOP/s, MFU's denominator (H100 SXM: 989).
    #[arg(long, default_value_t = 989.0)]
    peak_tflops: f64,
    /// A Hugging Face model directory (`hf-make` writes one): its config and weights on both
    /// sides instead of a preset, trained on synthetic samples of --min-len..=--max-len tokens.
    #[arg(long, conflicts_with = "model")]
    model_dir: Option<PathBuf>,
    /// odc's trainers: what they keep of a unit between forward and backward (true, false, N
    /// last stages, auto). Candle alone keeps everything.
    #[arg(long, default_value = "auto")]
    reshard_after_forward: odc::model::Reshard,
}

#[derive(Args)]
struct ProcessesArgs {
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=64))]
    nprocs: u32,
    #[arg(long, value_enum, default_value = "shm")]
    transport: ProcessTransport,
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    steps: u32,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// The `embed` example (default: examples/embed beside this executable).
    #[arg(long)]
    embed: Option<PathBuf>,
    /// The `odc` launcher (default: odc beside this executable).
    #[arg(long)]
    odc: Option<PathBuf>,
    /// Extra compute per micro-batch that does not occupy a core (as a GPU's would), in ms.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=10_000))]
    compute_delay_ms: u32,
}

#[derive(Clone, Copy, ValueEnum)]
enum ProcessTransport {
    Shm,
    Tcp,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    Local,
    Shm,
    Tcp,
    /// The cuda backend's rows on one GPU (built with `--features cuda`).
    Cuda,
}

impl BackendArg {
    /// The host backend, `None` for `cuda` (which has rows of its own).
    fn host(self) -> Option<Backend> {
        match self {
            BackendArg::Local => Some(Backend::Local),
            BackendArg::Shm => Some(Backend::Shm),
            BackendArg::Tcp => Some(Backend::Tcp),
            BackendArg::Cuda => None,
        }
    }

    fn name(self) -> &'static str {
        self.host().map_or("cuda", Backend::name)
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum OwnerBackendArg {
    Shm,
    Tcp,
    RawTcp,
    Cuda,
}

fn pull_size(s: &str) -> Result<usize, String> {
    pulls::parse_bytes(s, 4, pulls::MAX_PULL_BYTES)
}
/// A region size of an owner child, or a `--cuda-sizes` entry (the cuda rows go to 4 GiB).
fn cuda_size(s: &str) -> Result<usize, String> {
    pulls::parse_bytes(s, 4, 4 << 30)
}
fn tcp_part_bytes(s: &str) -> Result<usize, String> {
    let (min, max) = pulls::TCP_PART_BYTES;
    pulls::parse_bytes(s, min, max)
}
fn shm_chunk_bytes(s: &str) -> Result<usize, String> {
    let (min, max) = pulls::SHM_CHUNK_BYTES;
    pulls::parse_bytes(s, min, max)
}
fn rounds(s: &str) -> Result<usize, String> {
    input::count(s, pulls::MAX_ROUNDS)
}
fn measure_ms(s: &str) -> Result<u64, String> {
    input::count(s, pulls::MEASURE_MS.1)
}

#[derive(Args)]
#[command(
    after_help = "Sizes (--sizes, --tcp-part-bytes, --shm-chunk-bytes) are bytes, optionally with \
KiB, MiB or GiB, multiples of 4; --sizes at most 256 MiB, --tcp-part-bytes 4 KiB to 64 MiB, \
--shm-chunk-bytes 8 bytes to 64 MiB; --rounds at most 1000; --measure-ms at most 10000."
)]
struct TransportArgs {
    /// A few seconds: 2 rounds of ~5 ms measurements (a smoke run, not evidence).
    #[arg(long)]
    quick: bool,
    /// Backends (comma separated).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "local,shm,tcp"
    )]
    backends: Vec<BackendArg>,
    /// Pull sizes (comma separated; default 4KiB,1MiB,64MiB).
    #[arg(long, value_delimiter = ',', value_parser = pull_size)]
    sizes: Vec<usize>,
    /// Limit/backend pairs per row, in ABBA order (default 8; 2 with --quick).
    #[arg(long, value_parser = rounds)]
    rounds: Option<usize>,
    /// Milliseconds per measurement (default 150; 5 with --quick).
    #[arg(long, value_parser = measure_ms)]
    measure_ms: Option<u64>,
    /// tcp: bytes per part of a large read (the transport's read_part_bytes; default 4 MiB).
    #[arg(long, value_parser = tcp_part_bytes)]
    tcp_part_bytes: Option<usize>,
    /// shm: bytes per seqlock chunk of a segment (default 256 KiB).
    #[arg(long, value_parser = shm_chunk_bytes)]
    shm_chunk_bytes: Option<usize>,
    /// cuda: sizes of the cuda rows (comma separated; default 1MiB,64MiB,1GiB; at most 4 GiB).
    #[arg(long, value_delimiter = ',', value_parser = cuda_size)]
    cuda_sizes: Vec<usize>,
    /// cuda: the device (ordinal) of the reader and of the owner process.
    #[arg(long, default_value_t = 0)]
    cuda_device: u32,
    /// Write the rows as JSON: {"rows":[{"backend","bytes","gbytes_per_s","limit_gbytes_per_s",
    /// "ratio","latency_us"}]}.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct OwnerArgs {
    #[arg(long, value_enum)]
    backend: OwnerBackendArg,
    /// Region sizes (comma separated).
    #[arg(long, value_delimiter = ',', value_parser = cuda_size, required = true)]
    bytes: Vec<usize>,
    /// The shm job id (the parent's).
    #[arg(long, default_value = "odc-bench")]
    job: String,
    #[arg(long, value_parser = tcp_part_bytes, default_value_t = 4 << 20)]
    tcp_part_bytes: usize,
    #[arg(long, value_parser = shm_chunk_bytes, default_value_t = 256 << 10)]
    shm_chunk_bytes: usize,
    /// cuda: the device the regions live on.
    #[arg(long, default_value_t = 0)]
    cuda_device: u32,
}

#[derive(Clone, Copy, ValueEnum)]
enum Dispatch {
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

/// `odc-bench ab --clock`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ClockArg {
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
    /// `wall`: emulate in real time on this machine (the emulation floor applies). `virtual`: the
    /// same job on tokio's paused clock (compute and modelled transfers cost virtual time only;
    /// deterministic: the same seed gives the same JSON byte for byte; no emulation floor).
    /// `both`: every row under both clocks, with virtual/wall of tokens/s and speedup (validation:
    /// use a large --time-scale-ms and at most 16 devices, so no wall row is warned); --json then
    /// writes the virtual rows, PATH.wall.json the wall rows and PATH.clocks.json the ratios.
    #[arg(long, value_enum, default_value = "wall")]
    clock: ClockArg,
    /// Devices per shard server (default 1: a server on every device, as odc runs). Larger values
    /// cut the simulation's cost at scale (each trainer's gathers and pushes touch every server);
    /// without a link model nothing modelled changes, with one each server's link carries the
    /// shards of that many devices. At least one server per row.
    #[arg(long, default_value_t = 1, value_parser = devices)]
    devices_per_server: usize,
    /// The simulated device's cost model and its time scale in ms per cost unit (`odc-bench sim`:
    /// a device profile's fit); `None`: ODC's 7B fit at `--time-scale-ms`.
    #[arg(skip)]
    cost: Option<(odc::CostModel, String)>,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// With `--links h100`: modelled bytes per emulated byte (a unit of `--unit-elems` stands for
    /// that many times its bytes of parameters).
    #[arg(long, default_value_t = 1.0, value_parser = bytes_scale)]
    bytes_scale: f64,
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

/// Runs the matrix, prints and writes what `args` asks for, and returns the rows.
async fn ab(args: AbArgs) -> anyhow::Result<BenchReport> {
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
    let validation_paths = match (&args.json, args.clock) {
        (Some(p), ClockArg::Both) => {
            Some((with_suffix(p, ".wall.json"), with_suffix(p, ".clocks.json")))
        }
        _ => None,
    };
    if let Some((wall, clocks)) = &validation_paths {
        input::check_output("--json", wall)?;
        input::check_output("--json", clocks)?;
    }
    // The rows' own clock: virtual unless only wall time is asked for.
    let clock = match args.clock {
        ClockArg::Wall => ClockMode::Wall,
        ClockArg::Virtual | ClockArg::Both => ClockMode::Virtual,
    };
    let wall_too = args.clock == ClockArg::Both;

    let workloads = workloads(&args)?;
    let mut settings = Settings {
        steps: args.steps,
        seed: args.seed,
        token_budget: args.token_budget,
        unit_transfer_seconds: args.unit_transfer_ms / 1e3,
        clock,
        devices_per_server: args.devices_per_server,
        fabric: args.cluster.fabric(args.bytes_scale),
        pull_precision: args.cluster.precision(),
        ..Settings::default()
    };
    settings.device.seconds_per_cost = args.time_scale_ms / 1e3;
    settings.device.unit_elems = args.unit_elems;
    settings.device.units = args.units;
    if let Some((cost, _)) = &args.cost {
        settings.device.cost = *cost;
    }
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
    if let Some(f) = &settings.fabric {
        println!(
            "links: nodes of {} H100s, NVLink 450 GB/s and 3 µs per GPU and direction inside a node, a 400 Gb/s NIC (10 µs) per GPU across nodes, FIFO ports; {} routing{}; pulls in {:?}, gradients in fp32; 1 emulated byte = {:.0} modelled bytes",
            f.gpus_per_node,
            match f.routing {
                odc_bench::sim::topology::Routing::Direct => "direct",
                odc_bench::sim::topology::Routing::Striped => "striped (Zeppelin)",
            },
            if f.hpz { ", HPZ (a copy per node)" } else { "" },
            settings.pull_precision,
            f.bytes_scale,
        );
    }
    let emulation_floor = if clock == ClockMode::Wall || wall_too {
        let most_devices = devices.iter().copied().max().unwrap_or(1);
        let mut f = floor::measure(most_devices, floor::REQUEST).await;
        f.ring_step = odc::sim::ring_step_latency(most_devices as u32, 50)
            .await
            .context("measuring the emulation's ring latency")?;
        println!("{}", f.describe());
        Some(f)
    } else {
        println!(
            "emulation floor: does not apply in virtual time (waits cost no wall time and are exact to the modelled microsecond), so no row carries an emulation warning"
        );
        None
    };
    let wall_settings = Settings {
        clock: ClockMode::Wall,
        ..settings.clone()
    };
    let mut wall_rows = Vec::new();
    let mut ratios: Vec<ClockRatio> = Vec::new();
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
    let mut wall_controls = Controls::default();
    let floor = (clock == ClockMode::Wall)
        .then_some(emulation_floor.as_ref())
        .flatten();
    // Virtual-time rows do not depend on what else runs: rows go side by side (each row's runs
    // too, on threads of their own), printed in order. A window of 4 rows per core keeps every
    // core busy while a slow row (a 1,024-device collective) holds the head of the window. Wall
    // rows run one at a time.
    let jobs = if clock == ClockMode::Virtual && !wall_too {
        4 * std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        1
    };
    let mut measured = futures::stream::iter(
        entries
            .iter()
            .map(|e| ab::compare(&e.case, e.side, &settings, args.reps, floor)),
    )
    .buffered(jobs);
    for e in &entries {
        let name = || {
            format!(
                "row {}/{}/{}/{}",
                e.case.name,
                e.case.devices,
                e.case.minibatch_per_device,
                e.side.dispatch_name()
            )
        };
        let wall_row = if wall_too {
            let (mut row, _, _) = ab::compare(
                &e.case,
                e.side,
                &wall_settings,
                args.reps,
                emulation_floor.as_ref(),
            )
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
        controls.attach(e, &mut row);
        if wall_too {
            print!("virtual ");
        }
        comm += b.comm_wait;
        busy += b.busy;
        bytes += b.bytes;
        print_row(&layout, &row);
        if let Some(wall) = wall_row {
            let ratio = ClockRatio::of(&wall, &row);
            println!("    {}", ratio.line());
            ratios.push(ratio);
            wall_rows.push(wall);
        }
        rows.push(row);
    }
    println!();
    if !ratios.is_empty() {
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
        _ if settings.fabric.is_some() => println!(
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
        None if clock == ClockMode::Virtual => println!(
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
    if let Some((wall_path, clocks_path)) = &validation_paths {
        BenchReport { rows: wall_rows }.write_json(wall_path)?;
        let mut json = serde_json::to_string_pretty(&ratios).context("serialising the ratios")?;
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

/// The first value of `values` that appears twice.
fn repeated<T: PartialEq + Copy>(values: &[T]) -> Option<T> {
    values
        .iter()
        .enumerate()
        .find(|(i, v)| values[..*i].contains(v))
        .map(|(_, v)| *v)
}

async fn transport(args: TransportArgs) -> anyhow::Result<()> {
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
async fn cuda_rows(
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
fn cuda_target_lines(rows: &[pulls::Measured]) -> Vec<String> {
    pulls::cuda::target_lines(rows)
}

/// Without the feature `--backends cuda` was refused before anything ran.
#[cfg(not(all(any(feature = "cuda", feature = "gpu"), target_os = "linux")))]
async fn cuda_rows(
    _: &TransportArgs,
    _: &pulls::Settings,
    _: impl FnMut(&pulls::Measured),
) -> anyhow::Result<(Vec<pulls::Measured>, Vec<String>)> {
    bail!("this odc-bench was built without the cuda feature")
}

#[cfg(not(all(any(feature = "cuda", feature = "gpu"), target_os = "linux")))]
fn cuda_target_lines(_: &[pulls::Measured]) -> Vec<String> {
    Vec::new()
}

async fn transport_owner(args: OwnerArgs) -> anyhow::Result<()> {
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
        shm_chunk_bytes: args.shm_chunk_bytes,
        cuda_device: args.cuda_device,
    })
    .await
}

fn processes(args: ProcessesArgs) -> anyhow::Result<()> {
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

/// `--device` and `--precision` (bf16 by default on CUDA).
fn device_and_precision(
    device: &str,
    precision: Option<&str>,
) -> anyhow::Result<(odc::model::DeviceSpec, odc::model::ComputePrecision)> {
    let device: odc::model::DeviceSpec = device.parse()?;
    let precision = match precision {
        Some(p) => p.parse()?,
        None if device.is_cuda() => odc::model::ComputePrecision::Bf16,
        None => odc::model::ComputePrecision::F32,
    };
    Ok((device, precision))
}

async fn sft_overhead(args: SftOverheadArgs) -> anyhow::Result<()> {
    use odc_bench::sft_overhead as so;
    let (device, precision) = device_and_precision(&args.device, args.precision.as_deref())?;
    let (model_name, model, init) = match &args.model_dir {
        Some(dir) => {
            let checkpoint = odc::model::hf::HfCheckpoint::open(dir)
                .with_context(|| format!("--model-dir {}", dir.display()))?;
            let config = checkpoint.config().clone();
            (
                dir.display().to_string(),
                config,
                Some(checkpoint.all_unit_values()?),
            )
        }
        None => {
            let name = args
                .model
                .clone()
                .unwrap_or_else(|| if device.is_cuda() { "gpu-100m" } else { "tiny" }.into());
            let model = odc::model::ModelConfig::preset(&name)?;
            (name, model, None)
        }
    };
    if !(args.peak_tflops.is_finite() && args.peak_tflops > 0.0) {
        bail!("--peak-tflops must be positive, got {}", args.peak_tflops);
    }
    if args.min_len > args.max_len || args.max_len as usize > model.max_seq_len {
        bail!(
            "--min-len {} .. --max-len {} must be ordered and within the model's max_seq_len {}",
            args.min_len,
            args.max_len,
            model.max_seq_len
        );
    }
    let settings = so::Settings {
        steps: args.steps,
        rounds: args.rounds,
        batch_size: args.batch_size as usize,
        token_budget: args.token_budget,
        trainers: args.trainers as usize,
        servers: args.servers as usize,
        dispatch: args.dispatch.into(),
        model,
        init,
        device,
        precision,
        reshard: args.reshard_after_forward,
        data: if device.is_cuda() || args.model_dir.is_some() {
            so::Data::Synthetic {
                min_len: args.min_len as usize,
                max_len: args.max_len as usize,
            }
        } else {
            so::Data::Arithmetic
        },
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "odc-bench sft-overhead: {model_name} transformer ({} parameters) on {device} in \
         {precision}, {} samples per step ({:?}), budget {} tokens; odc: {} trainers + {} \
         servers, local transport; ABBA x {} rounds of {} steps; {cores} cores",
        odc::model::param_count(&settings.model)?,
        settings.batch_size,
        settings.data,
        settings.token_budget,
        settings.trainers,
        settings.servers,
        settings.rounds,
        settings.steps
    );
    if cfg!(debug_assertions) {
        println!("! a debug build: the numbers are not evidence (use --release)");
    }
    if settings.trainers > cores && !device.is_cuda() {
        println!(
            "! {} trainers share {cores} cores with candle's own threads: contention, not odc, can \
             decide the ratio",
            settings.trainers
        );
    }
    let outcome = so::run(&settings, |line| println!("{line}")).await?;
    let (candle_tps, odc_tps) = outcome.tokens_per_s();
    let ratio = outcome.ratio();
    // On a GPU the target is 1.15 (two trainers sharing one GPU); on the CPU 1.10.
    let target = if device.is_cuda() { 1.15 } else { 1.10 };
    println!(
        "candle alone {candle_tps:.0} tokens/s, odc {odc_tps:.0} tokens/s ({:.0} tokens/step): \
         ratio {ratio:.3} (odc / candle time per step), control {:.3}; micro-batches per step \
         candle {:.1}, odc {:.1}; last losses candle {:.4}, odc {:.4}; target <= {target:.2}: {}",
        outcome.tokens_per_step,
        outcome.control_ratio(),
        outcome.candle_micro_batches,
        outcome.odc_micro_batches,
        outcome.candle_loss,
        outcome.odc_loss,
        if ratio <= target { "met" } else { "MISSED" }
    );
    let (candle_mfu, odc_mfu) = outcome.mfu(args.peak_tflops * 1e12);
    // One line for scripts (benches/gpu/run.sh).
    println!(
        "result sft-overhead device={device} precision={precision} model={model_name} \
         ratio={ratio:.3} control={:.3} candle_tokens_per_s={candle_tps:.0} \
         odc_tokens_per_s={odc_tps:.0} candle_mfu={candle_mfu:.3} odc_mfu={odc_mfu:.3} \
         peak_tflops={} flops_per_step={:.3e} target={target:.2} verdict={}",
        outcome.control_ratio(),
        args.peak_tflops,
        outcome.flops_per_step,
        if ratio <= target { "met" } else { "MISSED" }
    );
    Ok(())
}

fn hf_make(args: HfMakeArgs) -> anyhow::Result<()> {
    use odc::model::hf::ExportDtype;
    let config = odc_bench::hf::shape(&args.shape)?;
    let dtype = match args.dtype.as_str() {
        "bf16" => ExportDtype::Bf16,
        "f32" => ExportDtype::F32,
        other => bail!("--dtype {other:?}: expected bf16 or f32"),
    };
    let started = std::time::Instant::now();
    let summary = odc_bench::hf::make(&config, dtype, &args.out)?;
    println!(
        "odc-bench hf-make: {} ({} parameters) in {}: {} file(s), {:.1} MB of tensors, {:.1} s",
        args.shape,
        odc::model::param_count(&config)?,
        args.out.display(),
        summary.safetensors_files.len(),
        summary.tensor_bytes as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn lora_traffic(args: LoraTrafficArgs) -> anyhow::Result<()> {
    let (name, config, init) = match (&args.model_dir, &args.shape) {
        (Some(dir), _) => {
            let checkpoint = odc::model::hf::HfCheckpoint::open(dir)
                .with_context(|| format!("--model-dir {}", dir.display()))?;
            (
                dir.display().to_string(),
                checkpoint.config().clone(),
                Some(checkpoint.all_unit_values()?),
            )
        }
        (None, Some(shape)) => (shape.clone(), odc_bench::hf::shape(shape)?, None),
        (None, None) => bail!("give --model-dir or --shape"),
    };
    let adapted = odc::model::ModelConfig {
        lora: Some(odc::model::LoraConfig::new(args.rank as usize)),
        ..config.clone()
    };
    let run = |c: odc::model::ModelConfig| {
        let init = init.clone();
        async move {
            odc_bench::hf::traffic(
                &c,
                init.as_deref(),
                args.steps,
                args.samples as usize,
                args.len as usize,
                (2, 2),
            )
            .await
        }
    };
    let full = run(config.clone()).await?;
    let lora = run(adapted).await?;
    let mb = |b: f64| b / 1e6;
    println!(
        "odc-bench lora-traffic: {name}, {} steps of {} samples x {} tokens, 2 trainers + 2 servers, bf16 pulls",
        args.steps, args.samples, args.len
    );
    for (what, t) in [("full", &full), ("lora", &lora)] {
        println!(
            "{what:>4}: {} trainable, {} frozen parameters; per step pulled {:.1} MB, pushed {:.1} MB ({:.1} micro-batches)",
            t.trainable,
            t.frozen,
            mb(t.pulled),
            mb(t.pushed),
            t.micro_batches
        );
    }
    println!(
        "result lora-traffic rank={} pushed_ratio={:.4} pulled_ratio={:.3} trainable_ratio={:.4}",
        args.rank,
        lora.pushed / full.pushed.max(1.0),
        lora.pulled / full.pulled.max(1.0),
        lora.trainable as f64 / full.trainable.max(1) as f64
    );
    Ok(())
}

fn hf_load(args: HfLoadArgs) -> anyhow::Result<()> {
    let r = odc_bench::hf::load(&args.model_dir, args.servers as usize)?;
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "odc-bench hf-load: {} ({} parameters, {:.1} MB on disk), {} server(s)\n\
         open (config, headers, every tensor checked) {:.3} s; convert to f32 masters {:.3} s \
         ({:.0} MB/s of file, {:.1} MB of f32, largest slice {:.1} MB)\n\
         peak resident {:.1} MB (before opening {:.1} MB); at the end resident anonymous {:.1} MB, \
         file-backed {:.1} MB",
        args.model_dir.display(),
        r.parameters,
        mb(r.file_bytes),
        args.servers,
        r.open_s,
        r.convert_s,
        mb(r.file_bytes) / r.convert_s.max(1e-9),
        mb(r.f32_bytes),
        mb(r.largest_slice_bytes),
        mb(r.peak_rss),
        mb(r.peak_rss_before),
        mb(r.rss_anon),
        mb(r.rss_file)
    );
    println!(
        "result hf-load parameters={} file_bytes={} open_s={:.4} convert_s={:.4} peak_rss_bytes={} \
         peak_rss_before_bytes={} largest_slice_bytes={}",
        r.parameters,
        r.file_bytes,
        r.open_s,
        r.convert_s,
        r.peak_rss,
        r.peak_rss_before,
        r.largest_slice_bytes
    );
    Ok(())
}

fn calibrate(args: CalibrateArgs) -> anyhow::Result<()> {
    use odc_bench::calibrate as cal;
    let (spec, precision) = device_and_precision(&args.device, args.precision.as_deref())?;
    for name in &args.models {
        odc::model::ModelConfig::preset(name)?;
    }
    let mut tokens: Vec<usize> = args.tokens.iter().map(|&t| t as usize).collect();
    tokens.sort_unstable();
    tokens.dedup();
    let device = odc::model::open_device(spec, 0)?;
    let name = device_name(&device, spec);
    println!(
        "odc-bench calibrate: {} on {name} in {precision}; tokens {tokens:?}; warm-up {}, median \
         of {}",
        args.models.join(", "),
        args.warmup,
        args.reps
    );
    if cfg!(debug_assertions) {
        println!("! a debug build: the numbers are not evidence (use --release)");
    }
    let settings = cal::Settings {
        models: args.models.clone(),
        tokens,
        warmup: args.warmup,
        reps: args.reps,
        precision,
    };
    let profile = cal::run(&settings, &device, &name, |line| println!("{line}"))?;
    for unit in &profile.units {
        let fit = unit.fit.map_or("no fit (fewer than 3 sizes)".into(), |f| {
            format!(
                "a = {:.3}, b = {:.3}, c = {:.3} ms (rmse {:.3} ms)",
                f.a, f.b, f.c, f.rmse_ms
            )
        });
        let pack = unit.pack_check.as_ref().map_or(String::new(), |p| {
            format!(
                "; pack of 4 x {}: {:.3} ms vs predicted {:.3}",
                p.samples[0], p.ms, p.predicted_ms
            )
        });
        println!(
            "result calibrate model={} unit={} params={} points={} largest={} {fit}{pack}",
            unit.model,
            unit.unit,
            unit.params,
            unit.points.len(),
            unit.points.last().map_or(0, |p| p.tokens)
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&profile)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("profile: {}", path.display());
    }
    Ok(())
}

/// `cuda:N (name)` or `cpu`.
fn device_name(device: &candle_core::Device, spec: odc::model::DeviceSpec) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => {
            #[cfg(feature = "gpu")]
            if let Ok(cuda) = device.as_cuda_device() {
                if let Ok(name) = cuda.cuda_stream().context().name() {
                    return format!("cuda:{gpu_id} ({name})");
                }
            }
            format!("cuda:{gpu_id}")
        }
        _ => spec.to_string(),
    }
}

async fn memory(args: MemoryArgs) -> anyhow::Result<()> {
    use odc_bench::memory as mem;
    let shape = if args.shape == "tiny" {
        odc::model::ModelConfig::tiny()
    } else {
        odc_bench::hf::shape(&args.shape)?
    };
    let depths = if args.layers.is_empty() {
        vec![shape.n_layers]
    } else {
        args.layers.clone()
    };
    let gb = |b: u64| b as f64 / 1e9;
    if !args.plot_from.is_empty() {
        let out = args
            .svg
            .as_ref()
            .context("--plot-from writes the plot given with --svg")?;
        let mut points = Vec::new();
        for file in &args.plot_from {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?;
            points.extend(mem::parse_rows(&text));
        }
        if points.is_empty() {
            bail!("no table rows in {:?}", args.plot_from);
        }
        let title = format!(
            "{} shape, {} blocks, fp32 CPU: trainer peak memory against sample length",
            args.shape, points[0].layers
        );
        std::fs::write(out, mem::svg(&points, &title))
            .with_context(|| format!("writing {}", out.display()))?;
        println!("plot of {} rows: {}", points.len(), out.display());
        return Ok(());
    }
    if args.expected_only {
        for &layers in &depths {
            let config = odc::model::ModelConfig {
                n_layers: layers,
                ..shape.clone()
            };
            for &path in &args.paths {
                for &tokens in &args.lengths {
                    let e = mem::expected(&config, tokens, path)?;
                    let parts: Vec<String> = e
                        .parts
                        .iter()
                        .map(|(what, b)| format!("{what} {:.3}", gb(*b)))
                        .collect();
                    println!(
                        "expected path={path} layers={layers} tokens={tokens} {:.3} GB at {}: {}",
                        gb(e.total()),
                        e.phase,
                        parts.join("; ")
                    );
                }
            }
        }
        return Ok(());
    }
    if args.speed_rounds > 0 {
        let config = odc::model::ModelConfig {
            n_layers: depths[0],
            ..shape.clone()
        };
        println!(
            "odc-bench memory --speed-rounds {}: {} with {} layers, one trainer and one server, \
             fp32 on the CPU; median step seconds, ABCCBA (keep, reshard, keep again)",
            args.speed_rounds, args.shape, depths[0]
        );
        for &tokens in &args.lengths {
            let s = mem::speed(&config, tokens, args.speed_rounds).await?;
            println!(
                "result memory-speed tokens={tokens} keep_s={:.3} reshard_s={:.3} \
                 reshard_vs_keep={:.3} control={:.3} tokens_per_s_keep={:.0} \
                 tokens_per_s_reshard={:.0}",
                s.keep_s,
                s.reshard_s,
                s.ratio(),
                s.control(),
                tokens as f64 / s.keep_s,
                tokens as f64 / s.reshard_s
            );
        }
        return Ok(());
    }
    println!(
        "odc-bench memory: {} ({} heads over {} KV, hidden {}, vocab {}), fp32 on the CPU, one \
         trainer and one server in this process, one sample per step; measured = the allocator's \
         peak during a step's micro-batch minus its level at its start (after a 16-token warm-up step)",
        args.shape,
        shape.n_heads,
        shape.kv_heads(),
        shape.d_model,
        shape.vocab_size
    );
    println!(
        "{:<4} {:>6} {:>7} {:>12} {:>12} {:>6}  {:>12} {:>8} {:>9}  expected peak phase",
        "path",
        "layers",
        "tokens",
        "measured GB",
        "expected GB",
        "ratio",
        "peak RSS GB",
        "step s",
        "tokens/s"
    );
    let mut points = Vec::new();
    for &layers in &depths {
        let config = odc::model::ModelConfig {
            n_layers: layers,
            max_seq_len: shape
                .max_seq_len
                .max(*args.lengths.iter().max().unwrap_or(&0)),
            ..shape.clone()
        };
        for &path in &args.paths {
            for &tokens in &args.lengths {
                let p = mem::measure(&config, tokens, path).await?;
                println!(
                    "{:<4} {:>6} {:>7} {:>12.3} {:>12.3} {:>6.2}  {:>12.2} {:>8.1} {:>9.0}  {}",
                    p.path.to_string(),
                    p.layers,
                    p.tokens,
                    gb(p.measured),
                    gb(p.expected.total()),
                    p.measured as f64 / p.expected.total().max(1) as f64,
                    gb(p.peak_rss),
                    p.step_s,
                    p.tokens as f64 / p.step_s,
                    p.expected.phase
                );
                points.push(p);
            }
        }
    }
    // Bytes per added token between consecutive lengths (linear growth: equal).
    for &path in &args.paths {
        for &layers in &depths {
            let line: Vec<&mem::Point> = points
                .iter()
                .filter(|p| p.path == path && p.layers == layers)
                .collect();
            for pair in line.windows(2) {
                let (a, b) = (pair[0], pair[1]);
                println!(
                    "result memory path={path} layers={layers} bytes_per_token {}->{} = {:.0}",
                    a.tokens,
                    b.tokens,
                    (b.measured as f64 - a.measured as f64) / (b.tokens - a.tokens) as f64
                );
            }
        }
    }
    if let Some(path) = &args.svg {
        let title = format!(
            "{} ({} layers): trainer peak memory against sample length",
            args.shape, depths[0]
        );
        let first_depth: Vec<mem::Point> = points
            .iter()
            .filter(|p| p.layers == depths[0])
            .cloned()
            .collect();
        std::fs::write(path, mem::svg(&first_depth, &title))
            .with_context(|| format!("writing {}", path.display()))?;
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
            Command::Ab(args) => runtime.block_on(ab(args)).map(drop),
            Command::Transport(args) => runtime.block_on(transport(args)),
            Command::TransportOwner(args) => runtime.block_on(transport_owner(args)),
            Command::Processes(args) => processes(args),
            Command::SftOverhead(args) => runtime.block_on(sft_overhead(args)),
            Command::Calibrate(args) => calibrate(args),
            Command::Sim(args) => runtime.block_on(sim(args)),
            Command::HfMake(args) => hf_make(args),
            Command::HfLoad(args) => hf_load(args),
            Command::LoraTraffic(args) => runtime.block_on(lora_traffic(args)),
            Command::Memory(args) => runtime.block_on(memory(args)),
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

#[derive(Args)]
struct SimArgs {
    /// Device counts (nodes of 8 GPUs in the long-sequence table).
    #[arg(long, value_delimiter = ',', value_parser = devices, default_value = "8,64,256,1024")]
    devices: Vec<usize>,
    /// Workloads: longalign, swesmith, rl, balanced (the balanced control runs at every device
    /// count anyway).
    #[arg(long, value_delimiter = ',', default_value = "longalign,swesmith,rl")]
    workloads: Vec<String>,
    /// A file of sequence lengths (one positive integer per line), as another workload.
    #[arg(long)]
    lengths: Option<PathBuf>,
    /// Samples per device in a minibatch.
    #[arg(long, default_value_t = 4, value_parser = per_device)]
    minibatch_per_device: usize,
    /// Minibatches per run.
    #[arg(long, default_value_t = 2, value_parser = steps)]
    steps: u64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The built-in H100 profile's layer shape (PAPERS.md's table): 7b or 1.5b.
    #[arg(long, default_value = "7b")]
    model: String,
    /// Transformer blocks of the modelled model.
    #[arg(long, default_value_t = 28)]
    layers: u32,
    /// A profile of measured points (`odc-bench calibrate --json`) to use instead of the
    /// built-in table; `--model` then names its model (or `block-<model>`).
    #[arg(long)]
    profile: Option<PathBuf>,
    /// On-demand dispatch. `static` (default, ODC's LB-Mini): each device's samples packed into
    /// as few micro-batches as the token budget allows. `dynamic` makes more, smaller
    /// micro-batches; with links modelled each pays a full parameter gather and gradient push,
    /// which from 64 devices costs more than it balances.
    #[arg(long, value_enum, default_value = "static")]
    dispatch: Dispatch,
    /// Devices per shard server in the runtime rows (default: one server for all devices). The
    /// modelled placement stays one shard per device (a server's regions are striped over its
    /// devices' links), so this only changes the simulation's cost: one server is the cheapest
    /// (one read per gather).
    #[arg(long, value_parser = devices)]
    devices_per_server: Option<usize>,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Skip the runtime rows (only the long-sequence table, from the models).
    #[arg(long)]
    no_runtime: bool,
    /// Write the runtime rows as JSON (and PATH.split.json: the long-sequence table).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write an SVG of speedup against devices, as ODC's figure: on-demand/collective per workload
    /// (runtime rows), and on-demand/achievable with the long-sequence table's step time against
    /// perfect balance without and with splitting.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// The modelled cluster of `odc-bench sim` and `odc-bench ab`.
#[derive(Args, Clone)]
struct ClusterArgs {
    /// Links: `h100` = nodes of `--gpus-per-node` H100s, NVLink 450 GB/s inside a node, a
    /// 400 Gb/s NIC per GPU across nodes, as FIFO queues per device and direction; `none` =
    /// communication is free in virtual time (`ab`: or `--unit-transfer-ms`'s one link per
    /// device). Default: `h100` for `sim`, `none` for `ab`.
    #[arg(long, value_enum)]
    links: Option<LinksArg>,
    #[arg(long, default_value_t = 8, value_parser = gpus_per_node)]
    gpus_per_node: u32,
    /// Turn off ODC's hierarchical partitioning (HPZ, on by default): the first pull of a unit in a
    /// node leaves a copy there, spread over its GPUs; the node's later pulls of it stay on
    /// NVLink.
    #[arg(long)]
    no_hpz: bool,
    /// On-demand cross-node transfers: `striped` (default: over every NIC of the node through
    /// NVLink proxies, Zeppelin's routing layer) or `direct` (source and destination NICs only).
    /// The collective's ring always crosses nodes on every NIC (NCCL's channels).
    #[arg(long, value_enum, default_value = "striped")]
    routing: RoutingArg,
    /// What parameters are pulled (on-demand) and all-gathered (collective) as. Default: bf16 for
    /// `sim`, f32 for `ab`.
    #[arg(long, value_enum)]
    pull_precision: Option<PrecisionArg>,
}

impl ClusterArgs {
    /// The modelled cluster, if `--links h100` (`sim` sets it by default), at `bytes_scale`
    /// modelled bytes per emulated byte.
    fn fabric(&self, bytes_scale: f64) -> Option<odc_bench::fabric::FabricConfig> {
        (self.links == Some(LinksArg::H100)).then_some(odc_bench::fabric::FabricConfig {
            gpus_per_node: self.gpus_per_node,
            routing: match self.routing {
                RoutingArg::Direct => odc_bench::sim::topology::Routing::Direct,
                RoutingArg::Striped => odc_bench::sim::topology::Routing::Striped,
            },
            hpz: !self.no_hpz,
            bytes_scale,
        })
    }

    /// The pull precision (fp32 without `--pull-precision`; `sim` sets bf16 by default).
    fn precision(&self) -> odc::Precision {
        match self.pull_precision {
            Some(PrecisionArg::Bf16) => odc::Precision::Bf16,
            None | Some(PrecisionArg::F32) => odc::Precision::F32,
        }
    }
}

/// `--links`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LinksArg {
    H100,
    None,
}

/// `--routing`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RoutingArg {
    Direct,
    Striped,
}

/// `--pull-precision`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PrecisionArg {
    Bf16,
    F32,
}

fn bytes_scale(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && (1.0..=1e9).contains(&x) => Ok(x),
        _ => Err(format!(
            "{s:?}: the bytes scale must be a number from 1 to 1e9"
        )),
    }
}

fn gpus_per_node(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(g @ 1..=64) => Ok(g),
        _ => Err(format!(
            "{s:?}: GPUs per node must be an integer from 1 to 64"
        )),
    }
}

/// `odc-bench sim`: the `ab` matrix on the virtual clock with an H100 profile's cost, then the
/// long-sequence table of `odc_bench::sim::report`.
async fn sim(args: SimArgs) -> anyhow::Result<()> {
    use odc_bench::sim::profile::{DeviceProfile, ModelShape};
    use odc_bench::sim::report::{join, joined_table, split_rows, split_table};

    let profile = match &args.profile {
        Some(path) => DeviceProfile::from_file(path, &args.model, args.layers)?,
        None => DeviceProfile::builtin(args.model.parse::<ModelShape>()?, args.layers)?,
    };
    let split_path = args.json.as_ref().map(|p| with_suffix(p, ".split.json"));
    if let Some(path) = &split_path {
        input::check_output("--json", path)?;
    }
    if let Some(path) = &args.plot {
        input::check_output("--plot", path)?;
    }
    let workloads = workloads(&sim_ab_args(&args, None))?;
    // The runtime's cost model is the profile's block fit `a·ŝ² + b·ŝ` (seconds per block),
    // times the blocks: 1 cost unit = layers × 1 ms.
    let block = profile.block();
    let cost = odc::CostModel::quadratic(block.a_s * 1e3, block.b_s * 1e3);
    println!(
        "odc-bench sim: profile {} ({} blocks of {} M parameters); runtime rows priced by its fit a = {:.2} ms, b = {:.2} ms per block (ŝ = tokens / 32,000), {}",
        profile.source,
        profile.layers,
        profile.layer_params / 1_000_000,
        block.a_s * 1e3,
        block.b_s * 1e3,
        if args.cluster.links == Some(LinksArg::None) {
            "no link model (communication free)"
        } else {
            "links of H100 nodes"
        }
    );
    let runtime = if args.no_runtime {
        Vec::new()
    } else {
        let name = format!("{} fit × {} blocks", profile.source, profile.layers);
        let mut ab_args = sim_ab_args(&args, Some((cost, name)));
        // `sim`'s defaults: links of H100 nodes, bf16 pulls; one emulated element stands for
        // `layers / units` blocks' parameters.
        ab_args.cluster.links.get_or_insert(LinksArg::H100);
        ab_args
            .cluster
            .pull_precision
            .get_or_insert(PrecisionArg::Bf16);
        let modelled_unit = profile.layer_params as f64 * f64::from(profile.layers);
        ab_args.bytes_scale = modelled_unit / (ab_args.units * ab_args.unit_elems) as f64;
        ab(ab_args).await?.rows
    };

    println!();
    println!(
        "Long sequences: step time against perfect balance without and with context-parallel splitting ({} samples per device, nodes of 8 H100s; modelled from the profile and the topology, not measured)",
        args.minibatch_per_device
    );
    let devices: Vec<u32> = args.devices.iter().map(|&d| d as u32).collect();
    let mut rows = Vec::new();
    for w in workloads.iter().filter(|w| w.name() != "balanced") {
        let budget = ab::default_token_budget(w);
        rows.extend(split_rows(
            w,
            &devices,
            args.minibatch_per_device,
            args.seed,
            &profile,
            budget,
        )?);
    }
    print!("{}", split_table(&rows));
    if !runtime.is_empty() {
        println!();
        println!(
            "Runtime rows (virtual time) beside the model's splitting columns, per workload and device count:"
        );
        print!("{}", joined_table(&join(&runtime, &rows)));
    }
    if let Some(path) = &split_path {
        let json = serde_json::json!({ "profile": profile.source, "rows": rows });
        std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        odc_bench::sim::plot::write(path, &profile.source, profile.layers, &runtime, &rows)?;
        println!("plot: {}", path.display());
    }
    Ok(())
}

/// The `ab` arguments of `odc-bench sim`'s runtime rows: virtual clock, one repetition, no
/// straggler, the balanced control on.
fn sim_ab_args(args: &SimArgs, cost: Option<(odc::CostModel, String)>) -> AbArgs {
    AbArgs {
        quick: false,
        workloads: args.workloads.clone(),
        lengths: args.lengths.clone(),
        devices: args.devices.clone(),
        minibatch_per_device: vec![args.minibatch_per_device],
        dispatch: vec![args.dispatch],
        token_budget: None,
        steps: args.steps,
        reps: 1,
        seed: args.seed,
        // 1 cost unit = 1 ms per block.
        time_scale_ms: f64::from(args.layers.max(1)),
        unit_elems: 16 * 1024,
        unit_transfer_ms: 0.0,
        units: 4,
        no_straggler: true,
        no_control: false,
        json: args.json.clone(),
        // `sim` draws its own plot from the rows.
        plot: None,
        trace: None,
        clock: ClockArg::Virtual,
        // One server for every row by default: the largest row's device count.
        devices_per_server: args
            .devices_per_server
            .unwrap_or_else(|| args.devices.iter().copied().max().unwrap_or(1)),
        cost,
        cluster: args.cluster.clone(),
        bytes_scale: 1.0,
    }
}
