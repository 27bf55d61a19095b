//! `odc-bench transport`: pull bandwidth and small-pull latency of each transport backend
//! (`local`, `shm`, `tcp`), each next to the machine's own limit measured in the same run.
//!
//! # What is measured
//!
//! For every backend and pull size (default 4 KiB, 1 MiB and 64 MiB) a reader pulls one whole
//! published `f32` region into a destination buffer of its own, one read at a time
//! ([`Transport::read`] into [`Dest::Bytes`]), and the same bytes are pulled by the *limit*:
//!
//! - `local` and `shm`: `copy_from_slice` of the same number of bytes between two buffers of the
//!   reading process (what a one-sided copy out of memory costs on this machine);
//! - `tcp`: a raw tokio [`TcpStream`] over loopback from a child process that, on an 8-byte request
//!   naming the size, writes that many bytes from a preallocated buffer; the reader takes them with
//!   `read_exact` straight into the same destination. The shape is the transport's (same process
//!   split, request then response, one connection, `TCP_NODELAY`), without its framing,
//!   authentication, parts or copies.
//!
//! # Process split
//!
//! `shm` and `tcp` numbers mean *owner and reader in different processes*: the command re-executes
//! itself ([`std::env::current_exe`]) as the hidden `odc-bench transport-owner`, which registers
//! one region per size with the real backend, prints an [`OwnerReady`] line (the serialized
//! [`RegionHandle`]s) on stdout and then waits until its stdin closes. The raw-socket limit runs in
//! a child of its own (`transport-owner --backend raw-tcp`). For `local`, owner and reader are two
//! [`LocalTransport`]s of this process — that is what local means. Children are stopped by closing
//! their stdin (so an `shm` owner removes its segments) and killed if they do not exit promptly,
//! also when the benchmark fails ([`OwnerProcess`]'s `Drop`).
//!
//! # Method
//!
//! - **Warm-up and check**: before anything is timed every side pulls into a zeroed destination
//!   and the bytes are compared with what the owner published (a transport that moved nothing
//!   cannot look fast); connections are established, segments mapped, and every buffer was written
//!   once when it was made (pre-faulted), so no side pays page faults the other does not.
//! - **Calibration**: each side runs doubling batches until one takes a quarter of the measurement
//!   time; its rate sets the side's iteration count so one measurement lasts about
//!   `measure` (150 ms by default).
//! - **Interleaved ABBA**: `rounds` pairs in the order limit, backend, backend, limit, … so drift
//!   (other work on shared cores, frequency changes) hits both sides alike. A measurement is one
//!   batch timed as a whole; the row reports the median rate of each side and `ratio` = backend /
//!   limit of those medians (the JSON's `ratio` is exactly `gbytes_per_s / limit_gbytes_per_s`).
//!   The table also shows the range of the per-round ratios, a direct view of the noise.
//! - **Latency**: after each measurement a short pass times single reads one by one; `latency_us`
//!   is the median over all rounds (for 4 KiB: the small-pull round trip). The limit's is shown
//!   next to it.
//! - **Page faults**: the minor page faults of the reading process per pull are counted for both
//!   sides (`/proc/self/stat`); a limit that faults is flagged (its ratio would flatter the
//!   backend), and a backend that faults shows where its time goes (fresh receive buffers).
//!
//! # Reading the numbers
//!
//! - The memcpy limit is *one* `memcpy` call of the whole size. glibc switches to non-temporal
//!   (streaming) stores for a single copy above its `x86_non_temporal_threshold` (48 MiB on the
//!   2-core development VM: `ld.so --list-tunables`), which a backend that copies the same bytes in
//!   smaller pieces does not get; at 64 MiB that alone was worth about 1.5x there. (shm copies a
//!   range over several stable seqlock chunks in one call for this reason; only a read that
//!   races a publication falls back to one copy per chunk, `--shm-chunk-bytes`.)
//! - At 4 KiB the bandwidth columns are per-pull overhead, not bandwidth: judge those rows by their
//!   latency.
//! - On shared cores the per-round ratio range shows how much other work moved the measurements;
//!   rows whose range is wide are flagged as noisy.
//!
//! GB/s are 10⁹ bytes per second.
//!
//! The `cuda` backend's rows (IPC pulls, accumulate kernels, pinned staging; odc-bench feature
//! `cuda`) are [`cuda`]'s.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use odc_transport::local::LocalTransport;
#[cfg(target_os = "linux")]
use odc_transport::shm::{ShmConfig, ShmTransport};
use odc_transport::tcp::{TcpConfig, TcpTransport};
use odc_transport::{
    deadline_in, ClusterSecret, Dest, Dtype, PublishedRegion, RegionHandle, RemoteConfig, Transport,
};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::report::ReportError;

#[cfg(all(any(feature = "cuda", feature = "gpu"), target_os = "linux"))]
pub mod cuda;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Pull sizes of a run without `--sizes`.
pub const DEFAULT_SIZES: [usize; 3] = [4 * KIB, MIB, 64 * MIB];
/// Largest pull size accepted (the parent holds a source and a destination of this size, each
/// owner a region).
pub const MAX_PULL_BYTES: usize = 256 * MIB;
/// Bounds of `--tcp-part-bytes` (a part must fit the transport's default frame cap).
pub const TCP_PART_BYTES: (usize, usize) = (4 * KIB, 64 * MIB);
/// Bounds of `--shm-chunk-bytes`.
pub const SHM_CHUNK_BYTES: (usize, usize) = (8, 64 * MIB);
/// Most ABBA rounds (`--rounds`).
pub const MAX_ROUNDS: usize = 1_000;
/// Bounds of `--measure-ms`.
pub const MEASURE_MS: (u64, u64) = (1, 10_000);

/// The environment variable that hands the cluster secret to an owner child (not its argv, which
/// other users can read).
pub const SECRET_ENV: &str = "ODC_SECRET";

/// How long an owner child has to print its handles.
pub const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Deadline of one pull (a pull that takes longer has hung).
pub const PULL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a stopped owner child has to exit before it is killed.
pub const STOP_GRACE: Duration = Duration::from_secs(5);
/// An owner child exits after this long even if its stdin never closes.
pub const OWNER_MAX_LIFE: Duration = Duration::from_secs(3600);
/// Individually timed pulls per latency pass, at most.
const LATENCY_PASS: usize = 1_000;
/// Most pulls of one measurement.
const MAX_ITERS: usize = 50_000_000;
/// A per-round ratio spread (highest / lowest) above this marks a row as noisy.
const NOISY_SPREAD: f64 = 1.25;
/// A ratio above 1 by more than this is flagged: the limit, not the backend, decided the row.
const ABOVE_ONE: f64 = 0.05;

/// A backend under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Owner and reader: two [`LocalTransport`]s of this process.
    Local,
    /// Owner in a child process; one-sided reads out of its `/dev/shm` segments.
    Shm,
    /// Owner in a child process; reads served over loopback TCP.
    Tcp,
}

impl Backend {
    /// All backends, in the order a default run measures them.
    pub const ALL: [Backend; 3] = [Backend::Local, Backend::Shm, Backend::Tcp];

    /// The name used on the command line, in the table and in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Shm => "shm",
            Backend::Tcp => "tcp",
        }
    }

    /// What this backend's limit is.
    pub fn limit(self) -> &'static str {
        match self {
            Backend::Local | Backend::Shm => "memcpy",
            Backend::Tcp => "raw socket",
        }
    }
}

/// What an owner child serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnerKind {
    /// Regions of an [`ShmTransport`].
    Shm,
    /// Regions of a [`TcpTransport`].
    Tcp,
    /// The raw-socket limit: bytes from a buffer on a plain [`TcpStream`].
    RawTcp,
    /// Regions of a `CudaTransport` (feature `cuda`).
    Cuda,
}

impl OwnerKind {
    /// The `--backend` value of `odc-bench transport-owner`.
    pub fn name(self) -> &'static str {
        match self {
            OwnerKind::Shm => "shm",
            OwnerKind::Tcp => "tcp",
            OwnerKind::RawTcp => "raw-tcp",
            OwnerKind::Cuda => "cuda",
        }
    }
}

/// What an owner child prints on stdout, as one JSON line, once it serves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OwnerReady {
    /// One handle per requested size, in the order of `--bytes` (`shm`, `tcp`).
    pub handles: Vec<RegionHandle>,
    /// Where the raw-socket owner listens (`raw-tcp`).
    pub addr: Option<String>,
}

/// One row of the report: a backend at one pull size. The `--json` schema.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransportRow {
    /// `local`, `shm` or `tcp`.
    pub backend: String,
    /// Bytes per pull.
    pub bytes: u64,
    /// Median pull bandwidth of the backend, 10⁹ bytes/s.
    pub gbytes_per_s: f64,
    /// Median bandwidth of the limit (memcpy or raw socket) in the same run, 10⁹ bytes/s.
    pub limit_gbytes_per_s: f64,
    /// `gbytes_per_s / limit_gbytes_per_s`.
    pub ratio: f64,
    /// Median time of one pull of `bytes`, in microseconds (for 4 KiB: the round trip).
    pub latency_us: f64,
}

/// A row with what only the table shows.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    /// The row of the JSON.
    pub row: TransportRow,
    /// Median time of one pull by the limit, in microseconds.
    pub limit_latency_us: f64,
    /// Lowest and highest ratio of the paired measurements of one round.
    pub ratio_range: (f64, f64),
    /// Pulls per measurement: (limit, backend).
    pub iters: (usize, usize),
    /// Minor page faults of this (the reading) process per pull during the measurements:
    /// (limit, backend); `NaN` where the count is not available.
    pub faults_per_pull: (f64, f64),
}

/// The `--json` file: `{"rows":[...]}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TransportReport {
    /// One row per backend and size, in the order measured.
    pub rows: Vec<TransportRow>,
}

impl TransportReport {
    /// Pretty-printed JSON.
    pub fn to_json(&self) -> String {
        crate::report::rows_json(self)
    }

    /// Parses a report written by [`TransportReport::to_json`].
    pub fn from_json(json: &str) -> Result<Self, ReportError> {
        Ok(serde_json::from_str(json)?)
    }

    /// Writes [`TransportReport::to_json`] (plus a final newline) to `path`.
    pub fn write_json(&self, path: &Path) -> Result<(), ReportError> {
        crate::report::write_file(path, self.to_json() + "\n")
    }
}

/// What a run measures and how.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Backends, in order.
    pub backends: Vec<Backend>,
    /// Pull sizes in bytes, each a multiple of 4 up to [`MAX_PULL_BYTES`].
    pub sizes: Vec<usize>,
    /// Limit/backend pairs per row, in ABBA order.
    pub rounds: usize,
    /// Length of one measurement.
    pub measure: Duration,
    /// `tcp`: bytes per part of a large read ([`RemoteConfig::read_part_bytes`]).
    pub tcp_part_bytes: usize,
    /// `shm`: bytes per seqlock chunk ([`ShmConfig::chunk_bytes`]).
    pub shm_chunk_bytes: usize,
    /// `tcp`: frames sealed after the handshake ([`RemoteConfig::sealed_frames`], the default).
    pub sealed_frames: bool,
    /// The `odc-bench` executable that hosts the owner children.
    pub exe: PathBuf,
}

impl Settings {
    /// The default run (`quick`: a few seconds, two rounds of short measurements).
    pub fn new(exe: PathBuf, quick: bool) -> Self {
        Self {
            backends: Backend::ALL.to_vec(),
            sizes: DEFAULT_SIZES.to_vec(),
            rounds: if quick { 2 } else { 8 },
            measure: Duration::from_millis(if quick { 5 } else { 150 }),
            tcp_part_bytes: RemoteConfig::default().read_part_bytes,
            shm_chunk_bytes: 256 * KIB,
            sealed_frames: true,
            exe,
        }
    }
}

/// A byte size: a number with an optional unit `K`/`KiB`, `M`/`MiB`, `G`/`GiB` (powers of 1024,
/// case-insensitive), at least `min` and at most `max`, a multiple of 4.
///
/// ```
/// use odc_bench::transport::parse_bytes;
/// assert_eq!(parse_bytes("4KiB", 4, 1 << 30), Ok(4096));
/// assert_eq!(parse_bytes("64m", 4, 1 << 30), Ok(64 << 20));
/// assert_eq!(parse_bytes("1000", 4, 1 << 30), Ok(1000));
/// assert!(parse_bytes("6", 4, 1 << 30).is_err());
/// assert!(parse_bytes("2GiB", 4, 1 << 30).is_err());
/// ```
pub fn parse_bytes(text: &str, min: usize, max: usize) -> Result<usize, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => KIB,
        "m" | "mib" => MIB,
        "g" | "gib" => 1 << 30,
        _ => {
            return Err(format!(
                "{text:?} is not a byte size (a number, optionally followed by KiB, MiB or GiB)"
            ))
        }
    };
    let n: usize = digits.parse().map_err(|_| {
        format!("{text:?} is not a byte size (a number, optionally followed by KiB, MiB or GiB)")
    })?;
    let bytes = n
        .checked_mul(scale)
        .filter(|&b| b <= max)
        .ok_or_else(|| format!("{text:?} is more than {} bytes", max))?;
    if bytes < min {
        return Err(format!("{text:?} is less than {min} bytes"));
    }
    if bytes % 4 != 0 {
        return Err(format!(
            "{text:?} ({bytes} bytes) is not a multiple of 4 (regions hold f32 elements)"
        ));
    }
    Ok(bytes)
}

/// `bytes` as the table shows it: `4 KiB`, `1 MiB`, or a plain count.
pub fn human_bytes(bytes: usize) -> String {
    if bytes >= MIB && bytes % MIB == 0 {
        format!("{} MiB", bytes / MIB)
    } else if bytes >= KIB && bytes % KIB == 0 {
        format!("{} KiB", bytes / KIB)
    } else {
        format!("{bytes} B")
    }
}

/// The bytes every owner publishes and every limit copies: a deterministic, non-repeating-looking
/// pattern (so a transport that moved the wrong bytes fails the check), built in a few `memcpy`s.
pub fn pattern(len: usize) -> Vec<u8> {
    // A prime period, so the pattern lines up with no power-of-two boundary.
    const PERIOD: usize = 65_521;
    let mut out = Vec::with_capacity(len);
    let mut x: u32 = 0x9E37_79B9;
    for _ in 0..PERIOD.min(len) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        out.push((x >> 24) as u8);
    }
    while out.len() < len {
        let more = out.len().min(len - out.len());
        out.extend_from_within(..more);
    }
    out
}

/// Minor page faults of this process so far (Linux: `/proc/self/stat`), if known.
fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // After the command name in parentheses: state, ppid, pgrp, session, tty_nr, tpgid, flags,
    // minflt.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(7)?.parse().ok()
}

/// Median of `values` (0 when empty); sorts them.
fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

// ---------------------------------------------------------------------------------------------
// Owner side (the hidden `transport-owner` subcommand).
// ---------------------------------------------------------------------------------------------

/// What an owner child is asked to serve.
#[derive(Debug, Clone)]
pub struct OwnerSettings {
    pub kind: OwnerKind,
    /// Region sizes in bytes (`raw-tcp`: the largest is the buffer served from).
    pub sizes: Vec<usize>,
    /// The shm job id, the same in parent and child.
    pub job: String,
    pub tcp_part_bytes: usize,
    pub shm_chunk_bytes: usize,
    /// `tcp`: frames sealed after the handshake.
    pub sealed_frames: bool,
    /// `cuda`: the device (ordinal) the regions live on.
    pub cuda_device: u32,
}

/// The body of `odc-bench transport-owner`: serve, print [`OwnerReady`] on stdout, wait until
/// stdin closes (or [`OWNER_MAX_LIFE`]), then drop everything (an `shm` owner removes its
/// segments).
pub async fn serve_owner(settings: OwnerSettings) -> anyhow::Result<()> {
    if settings.sizes.is_empty() {
        bail!("no --bytes to serve");
    }
    let secret = || -> anyhow::Result<ClusterSecret> {
        let text = std::env::var(SECRET_ENV)
            .with_context(|| format!("the cluster secret ({SECRET_ENV}) is not set"))?;
        ClusterSecret::new(text).map_err(|e| anyhow!("{SECRET_ENV}: {e}"))
    };
    let stdin_closed = stdin_closed();
    match settings.kind {
        OwnerKind::Shm => {
            #[cfg(target_os = "linux")]
            {
                let mut config = ShmConfig::new(settings.job.clone(), secret()?);
                config.chunk_bytes = settings.shm_chunk_bytes;
                let transport = ShmTransport::new(config)
                    .await
                    .context("starting the shm owner")?;
                let guards = register(&transport, &settings.sizes)?;
                announce(&guards, None)?;
                wait_until(stdin_closed).await;
                drop(guards);
            }
            #[cfg(not(target_os = "linux"))]
            bail!("the shm backend exists on Linux only");
        }
        OwnerKind::Tcp => {
            let transport = TcpTransport::bind(TcpConfig {
                remote: remote_config(settings.tcp_part_bytes, settings.sealed_frames),
                ..TcpConfig::loopback(secret()?)
            })
            .await
            .context("starting the tcp owner")?;
            let guards = register(&transport, &settings.sizes)?;
            announce(&guards, None)?;
            wait_until(stdin_closed).await;
            drop(guards);
        }
        OwnerKind::Cuda => {
            #[cfg(all(any(feature = "cuda", feature = "gpu"), target_os = "linux"))]
            cuda::serve(
                &settings.sizes,
                &settings.job,
                settings.cuda_device,
                secret()?,
                stdin_closed,
            )
            .await?;
            #[cfg(not(all(any(feature = "cuda", feature = "gpu"), target_os = "linux")))]
            bail!("odc-bench was built without the cuda feature (cargo build --features cuda)");
        }
        OwnerKind::RawTcp => {
            let largest = settings.sizes.iter().copied().max().unwrap_or(0);
            let data = std::sync::Arc::new(pattern(largest));
            let listener = TcpListener::bind("127.0.0.1:0")
                .await
                .context("raw-tcp owner: cannot listen on loopback")?;
            let addr = listener
                .local_addr()
                .context("raw-tcp owner: no local address")?
                .to_string();
            let server = tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    tokio::spawn(serve_raw(stream, std::sync::Arc::clone(&data)));
                }
            });
            announce(&[], Some(addr))?;
            wait_until(stdin_closed).await;
            server.abort();
        }
    }
    Ok(())
}

/// A raw-socket connection: read an 8-byte little-endian size, answer with that many bytes of
/// `data`; until the peer closes or asks for more than there is.
async fn serve_raw(mut stream: TcpStream, data: std::sync::Arc<Vec<u8>>) {
    if stream.set_nodelay(true).is_err() {
        return;
    }
    let mut request = [0u8; 8];
    while stream.read_exact(&mut request).await.is_ok() {
        let Some(bytes) = usize::try_from(u64::from_le_bytes(request))
            .ok()
            .and_then(|n| data.get(..n))
        else {
            return;
        };
        if stream.write_all(bytes).await.is_err() {
            return;
        }
    }
}

fn remote_config(read_part_bytes: usize, sealed_frames: bool) -> RemoteConfig {
    RemoteConfig {
        read_part_bytes,
        sealed_frames,
        ..RemoteConfig::default()
    }
}

/// One published f32 region of [`pattern`] bytes per size.
fn register(
    transport: &dyn Transport,
    sizes: &[usize],
) -> anyhow::Result<Vec<Box<dyn PublishedRegion>>> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let endpoint = u32::try_from(i).unwrap_or(u32::MAX);
            transport
                .register_published(endpoint, Dtype::F32, pattern(n).into(), 1)
                .with_context(|| format!("registering a {} region", human_bytes(n)))
        })
        .collect()
}

/// Print the ready line.
fn announce(guards: &[Box<dyn PublishedRegion>], addr: Option<String>) -> anyhow::Result<()> {
    let ready = OwnerReady {
        handles: guards.iter().map(|g| g.handle()).collect(),
        addr,
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(&ready)?)
        .and_then(|()| out.flush())
        .context("writing the handles to stdout")
}

/// Resolves when stdin reaches its end (the parent closed it, or died). A plain thread reads it,
/// so the runtime never waits on a blocking read at shutdown.
fn stdin_closed() -> tokio::sync::oneshot::Receiver<()> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut sink = [0u8; 256];
        let mut stdin = std::io::stdin().lock();
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
        let _ = tx.send(());
    });
    rx
}

async fn wait_until(closed: tokio::sync::oneshot::Receiver<()>) {
    if tokio::time::timeout(OWNER_MAX_LIFE, closed).await.is_err() {
        eprintln!(
            "odc-bench transport-owner: stdin still open after {} s; exiting",
            OWNER_MAX_LIFE.as_secs()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Parent side.
// ---------------------------------------------------------------------------------------------

/// An owner child process. Dropping it closes its stdin, gives it [`STOP_GRACE`] to exit and
/// kills it otherwise; it is always reaped.
pub struct OwnerProcess {
    what: String,
    child: Child,
    stdin: Option<ChildStdin>,
    stderr: Option<JoinHandle<Vec<u8>>>,
}

impl OwnerProcess {
    /// Start `exe transport-owner` for `settings` and wait (at most [`READY_TIMEOUT`]) for its
    /// ready line.
    pub fn start(
        exe: &Path,
        settings: &OwnerSettings,
        secret: &ClusterSecret,
    ) -> anyhow::Result<(OwnerProcess, OwnerReady)> {
        let what = format!("the {} owner process", settings.kind.name());
        let sizes: Vec<String> = settings.sizes.iter().map(usize::to_string).collect();
        let mut child = Command::new(exe)
            .arg("transport-owner")
            .args(["--backend", settings.kind.name()])
            .args(["--bytes", &sizes.join(",")])
            .args(["--job", &settings.job])
            .args(["--tcp-part-bytes", &settings.tcp_part_bytes.to_string()])
            .args(["--shm-chunk-bytes", &settings.shm_chunk_bytes.to_string()])
            .args((!settings.sealed_frames).then_some("--insecure-frames"))
            .args(["--cuda-device", &settings.cuda_device.to_string()])
            .env(SECRET_ENV, secret.expose())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {what} ({})", exe.display()))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take().map(|mut pipe| {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let _ = pipe.read_to_end(&mut buf);
                buf
            })
        });
        let mut owner = OwnerProcess {
            what,
            child,
            stdin,
            stderr,
        };
        let (tx, rx) = mpsc::channel();
        if let Some(stdout) = stdout {
            std::thread::spawn(move || {
                let mut lines = BufReader::new(stdout);
                let mut first = String::new();
                let read = lines.read_line(&mut first).map(|_| first);
                let _ = tx.send(read);
                // Keep draining, so the child never blocks on a full pipe.
                let _ = std::io::copy(&mut lines, &mut std::io::sink());
            });
        }
        let line = match rx.recv_timeout(READY_TIMEOUT) {
            Ok(Ok(line)) if !line.trim().is_empty() => line,
            Ok(Ok(_)) | Ok(Err(_)) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = owner.wait_exit(STOP_GRACE);
                let said = owner.stderr_text();
                bail!(
                    "{} exited before it was ready ({}){said}",
                    owner.what,
                    status.map_or_else(|| "still running; killed".into(), |s| s.to_string()),
                );
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                owner.kill();
                let said = owner.stderr_text();
                bail!(
                    "{} did not print its handles within {} s; killed{said}",
                    owner.what,
                    READY_TIMEOUT.as_secs(),
                );
            }
        };
        let ready: OwnerReady = serde_json::from_str(line.trim()).with_context(|| {
            format!("{} printed {:?}, not its handles", owner.what, line.trim())
        })?;
        Ok((owner, ready))
    }

    /// Wait up to `grace` for the child to exit; its status, or `None` if it had to be killed.
    fn wait_exit(&mut self, grace: Duration) -> Option<ExitStatus> {
        let started = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if started.elapsed() < grace => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => {
                    self.kill();
                    return None;
                }
            }
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// `: <the child's stderr>` when it said anything (after it exited).
    fn stderr_text(&mut self) -> String {
        let text = self
            .stderr
            .take()
            .and_then(|t| t.join().ok())
            .map(|b| String::from_utf8_lossy(&b).trim().to_string())
            .unwrap_or_default();
        if text.is_empty() {
            String::new()
        } else {
            format!(": {text}")
        }
    }

    /// Close stdin and wait for a clean exit (at most [`STOP_GRACE`], then killed).
    pub fn stop(mut self) -> anyhow::Result<()> {
        self.stdin = None;
        match self.wait_exit(STOP_GRACE) {
            Some(status) if status.success() => Ok(()),
            Some(status) => {
                let said = self.stderr_text();
                bail!("{} failed ({status}){said}", self.what)
            }
            None => bail!(
                "{} did not exit within {} s of its stdin closing; killed",
                self.what,
                STOP_GRACE.as_secs()
            ),
        }
    }
}

impl Drop for OwnerProcess {
    fn drop(&mut self) {
        self.stdin = None;
        if !matches!(self.child.try_wait(), Ok(Some(_))) {
            self.wait_exit(STOP_GRACE);
        }
    }
}

/// A read of the whole region of `handle` into `dest` (at most [`PULL_TIMEOUT`]).
async fn read_whole(
    reader: &dyn Transport,
    handle: &RegionHandle,
    dest: Dest<'_>,
) -> anyhow::Result<()> {
    let elements = handle.elements();
    reader
        .read(handle, 0..elements, dest, deadline_in(PULL_TIMEOUT))
        .await?;
    Ok(())
}

/// One side of a comparison: how one pull is done.
enum Puller<'a> {
    /// `copy_from_slice` from `src`.
    Memcpy(&'a [u8]),
    /// Request `n` bytes on a raw socket, `read_exact` them.
    Raw(&'a mut TcpStream),
    /// A whole-region read through a transport.
    Transport {
        reader: &'a dyn Transport,
        handle: &'a RegionHandle,
    },
}

impl Puller<'_> {
    async fn pull(&mut self, dest: &mut [u8]) -> anyhow::Result<()> {
        match self {
            Puller::Memcpy(src) => {
                dest.copy_from_slice(src);
                std::hint::black_box(&*dest);
                Ok(())
            }
            Puller::Raw(stream) => {
                let exchange = async {
                    stream.write_all(&(dest.len() as u64).to_le_bytes()).await?;
                    stream.read_exact(dest).await
                };
                match tokio::time::timeout(PULL_TIMEOUT, exchange).await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(e)) => Err(anyhow!("raw socket pull: {e}")),
                    Err(_) => bail!("raw socket pull: no answer within {PULL_TIMEOUT:?}"),
                }
            }
            Puller::Transport { reader, handle } => {
                read_whole(*reader, handle, Dest::Bytes(dest)).await
            }
        }
    }

    /// `iters` pulls timed as one batch; seconds.
    async fn batch(&mut self, dest: &mut [u8], iters: usize) -> anyhow::Result<f64> {
        let started = Instant::now();
        for _ in 0..iters {
            self.pull(dest).await?;
        }
        Ok(started.elapsed().as_secs_f64())
    }

    /// `n` pulls, each timed on its own (seconds each, appended to `out`).
    async fn singles(
        &mut self,
        dest: &mut [u8],
        n: usize,
        out: &mut Vec<f64>,
    ) -> anyhow::Result<()> {
        for _ in 0..n {
            let started = Instant::now();
            self.pull(dest).await?;
            out.push(started.elapsed().as_secs_f64());
        }
        Ok(())
    }

    /// One measurement: `iters` pulls timed as a batch, then a latency pass of single pulls
    /// timed one by one (appended to `times`). Returns bytes/s and the batch's minor page faults
    /// per pull (`NaN` if unknown).
    async fn measure(
        &mut self,
        dest: &mut [u8],
        iters: usize,
        times: &mut Vec<f64>,
    ) -> anyhow::Result<(f64, f64)> {
        let faults_before = minor_faults();
        let seconds = self.batch(dest, iters).await?;
        let faults = match (faults_before, minor_faults()) {
            (Some(a), Some(b)) => b.saturating_sub(a) as f64 / iters as f64,
            _ => f64::NAN,
        };
        let rate = (dest.len() * iters) as f64 / seconds.max(1e-12);
        let singles = (iters / 4).clamp(1, LATENCY_PASS);
        self.singles(dest, singles, times).await?;
        Ok((rate, faults))
    }

    /// Pull into a zeroed `dest` and compare with `expected`.
    async fn check(&mut self, dest: &mut [u8], expected: &[u8], what: &str) -> anyhow::Result<()> {
        dest.fill(0);
        self.pull(dest).await?;
        if dest != expected {
            let at = dest
                .iter()
                .zip(expected)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            bail!(
                "{what} delivered wrong bytes ({} pull differs at byte {at})",
                human_bytes(dest.len())
            );
        }
        Ok(())
    }

    /// Warm up for about `warm` and return the pulls per measurement of length `measure`.
    async fn calibrate(
        &mut self,
        dest: &mut [u8],
        warm: Duration,
        measure: Duration,
    ) -> anyhow::Result<usize> {
        let mut n = 1usize;
        loop {
            let seconds = self.batch(dest, n).await?;
            if seconds >= warm.as_secs_f64() || n >= MAX_ITERS {
                let per_pull = seconds / n as f64;
                let iters = (measure.as_secs_f64() / per_pull.max(1e-12)).ceil();
                return Ok((iters as usize).clamp(2, MAX_ITERS));
            }
            n = n.saturating_mul(2);
        }
    }
}

/// Interleaved ABBA measurement of `limit` against `backend` at `dest.len()` bytes.
async fn compare(
    backend_name: &str,
    limit: &mut Puller<'_>,
    pulled: &mut Puller<'_>,
    dest: &mut [u8],
    expected: &[u8],
    settings: &Settings,
) -> anyhow::Result<Measured> {
    limit.check(dest, expected, "the limit").await?;
    pulled.check(dest, expected, backend_name).await?;
    let warm = settings.measure / 4;
    let limit_iters = limit.calibrate(dest, warm, settings.measure).await?;
    let backend_iters = pulled.calibrate(dest, warm, settings.measure).await?;
    let mut rounds = Rounds::default();
    let mut faults = [0.0f64; 2];
    for round in 0..settings.rounds {
        let mut rates = [0.0f64; 2];
        for side in Rounds::order(round) {
            let times = &mut rounds.times[side];
            let (rate, f) = if side == 0 {
                limit.measure(dest, limit_iters, times).await?
            } else {
                pulled.measure(dest, backend_iters, times).await?
            };
            rates[side] = rate;
            faults[side] += f / settings.rounds as f64;
        }
        rounds.push(rates);
    }
    Ok(rounds.into_measured(
        backend_name,
        dest.len(),
        (limit_iters, backend_iters),
        (faults[0], faults[1]),
    ))
}

/// What the ABBA rounds of one row measured, side 0 the limit and side 1 the backend (or other
/// subject).
#[derive(Default)]
pub(crate) struct Rounds {
    /// Each side's rate (bytes/s) in each round.
    rates: [Vec<f64>; 2],
    /// Each round's subject rate / limit rate.
    ratios: Vec<f64>,
    /// Each side's single operations' seconds (the latency passes).
    pub(crate) times: [Vec<f64>; 2],
}

impl Rounds {
    /// The sides in the order round `round` measures them: the limit first in even rounds, the
    /// subject first in odd ones (ABBA).
    pub(crate) fn order(round: usize) -> [usize; 2] {
        if round % 2 == 0 {
            [0, 1]
        } else {
            [1, 0]
        }
    }

    /// Records one round's rates, `[limit, subject]`.
    pub(crate) fn push(&mut self, rates: [f64; 2]) {
        self.rates[0].push(rates[0]);
        self.rates[1].push(rates[1]);
        self.ratios.push(rates[1] / rates[0]);
    }

    /// The row `backend` at `bytes`: medians of the rates and times, the range of the ratios.
    pub(crate) fn into_measured(
        mut self,
        backend: &str,
        bytes: usize,
        iters: (usize, usize),
        faults_per_pull: (f64, f64),
    ) -> Measured {
        let gbytes_per_s = median(&mut self.rates[1]) / 1e9;
        let limit_gbytes_per_s = median(&mut self.rates[0]) / 1e9;
        Measured {
            row: TransportRow {
                backend: backend.to_string(),
                bytes: bytes as u64,
                gbytes_per_s,
                limit_gbytes_per_s,
                ratio: crate::report::ratio(gbytes_per_s, limit_gbytes_per_s),
                latency_us: median(&mut self.times[1]) * 1e6,
            },
            limit_latency_us: median(&mut self.times[0]) * 1e6,
            ratio_range: (
                self.ratios.iter().copied().fold(f64::INFINITY, f64::min),
                self.ratios.iter().copied().fold(0.0, f64::max),
            ),
            iters,
            faults_per_pull,
        }
    }
}

/// A destination buffer of `n` bytes, every page written once (pre-faulted).
fn faulted(n: usize) -> Vec<u8> {
    vec![0xA5; n]
}

fn check_handles(ready: &OwnerReady, sizes: &[usize], what: &str) -> anyhow::Result<()> {
    if ready.handles.len() != sizes.len() {
        bail!(
            "{what} printed {} handles for {} sizes",
            ready.handles.len(),
            sizes.len()
        );
    }
    for (handle, &n) in ready.handles.iter().zip(sizes) {
        if handle.elements().checked_mul(4) != Some(n) {
            bail!(
                "{what} printed a handle of {} elements for a {} region",
                handle.len,
                human_bytes(n)
            );
        }
    }
    Ok(())
}

/// Runs the benchmark; `on_row` sees each row as it is measured.
pub async fn run(
    settings: &Settings,
    mut on_row: impl FnMut(&Measured),
) -> anyhow::Result<Vec<Measured>> {
    let largest = settings.sizes.iter().copied().max().unwrap_or(0);
    let source = pattern(largest);
    let owners = Owners {
        settings,
        secret: ClusterSecret::random(),
        job: format!("odc-bench-{}", std::process::id()),
    };
    let mut rows = Vec::new();
    let mut row = |m: Measured| {
        on_row(&m);
        rows.push(m);
    };
    for &backend in &settings.backends {
        match backend {
            Backend::Local => run_local(settings, &source, &mut row).await?,
            Backend::Shm => {
                #[cfg(target_os = "linux")]
                run_shm(&owners, &source, &mut row).await?;
                #[cfg(not(target_os = "linux"))]
                bail!("the shm backend exists on Linux only");
            }
            Backend::Tcp => run_tcp(&owners, &source, &mut row).await?,
        }
    }
    Ok(rows)
}

/// What the owner children of one run share: the run's settings, its secret and its shm job.
struct Owners<'a> {
    settings: &'a Settings,
    secret: ClusterSecret,
    job: String,
}

impl Owners<'_> {
    /// Starts an owner child of `kind` serving every size of the run.
    fn start(&self, kind: OwnerKind) -> anyhow::Result<(OwnerProcess, OwnerReady)> {
        let owner_settings = OwnerSettings {
            kind,
            sizes: self.settings.sizes.clone(),
            job: self.job.clone(),
            tcp_part_bytes: self.settings.tcp_part_bytes,
            shm_chunk_bytes: self.settings.shm_chunk_bytes,
            sealed_frames: self.settings.sealed_frames,
            cuda_device: 0,
        };
        OwnerProcess::start(&self.settings.exe, &owner_settings, &self.secret)
    }
}

/// One row: `limit` against `reader`'s whole-region pull of `handle`, both checked against and
/// timed on `expected` (the region's bytes).
async fn pull_row(
    backend_name: &str,
    limit: &mut Puller<'_>,
    reader: &dyn Transport,
    handle: &RegionHandle,
    expected: &[u8],
    settings: &Settings,
) -> anyhow::Result<Measured> {
    let n = expected.len();
    let mut dest = faulted(n);
    let mut pulled = Puller::Transport { reader, handle };
    compare(
        backend_name,
        limit,
        &mut pulled,
        &mut dest,
        expected,
        settings,
    )
    .await
    .with_context(|| format!("{backend_name}, {}", human_bytes(n)))
}

/// The `local` rows: owner and reader two [`LocalTransport`]s of this process; the limit copies
/// from the very bytes the region holds (same memory, same alignment).
async fn run_local(
    settings: &Settings,
    source: &[u8],
    row: &mut impl FnMut(Measured),
) -> anyhow::Result<()> {
    let owner = LocalTransport::new();
    let reader = LocalTransport::new();
    for (i, &n) in settings.sizes.iter().enumerate() {
        // `Clone::clone` lets the parameter name their type.
        let published = pattern(n).into();
        let endpoint = u32::try_from(i).unwrap_or(u32::MAX);
        let guard = owner
            .register_published(endpoint, Dtype::F32, Clone::clone(&published), 1)
            .with_context(|| format!("registering a {} region", human_bytes(n)))?;
        let mut limit = Puller::Memcpy(&published[..]);
        let name = Backend::Local.name();
        row(pull_row(
            name,
            &mut limit,
            &reader,
            &guard.handle(),
            &source[..n],
            settings,
        )
        .await?);
    }
    Ok(())
}

/// The `shm` rows: the owner a child process, the limit a memcpy in this one.
#[cfg(target_os = "linux")]
async fn run_shm(
    owners: &Owners<'_>,
    source: &[u8],
    row: &mut impl FnMut(Measured),
) -> anyhow::Result<()> {
    let settings = owners.settings;
    let (owner, ready) = owners.start(OwnerKind::Shm)?;
    check_handles(&ready, &settings.sizes, "the shm owner process")?;
    let mut config = ShmConfig::new(owners.job.clone(), owners.secret.clone());
    config.chunk_bytes = settings.shm_chunk_bytes;
    let reader = ShmTransport::new(config)
        .await
        .context("starting the shm reader")?;
    for (&n, handle) in settings.sizes.iter().zip(&ready.handles) {
        let mut limit = Puller::Memcpy(&source[..n]);
        let name = Backend::Shm.name();
        row(pull_row(name, &mut limit, &reader, handle, &source[..n], settings).await?);
    }
    drop(reader);
    owner.stop()
}

/// The `tcp` rows: the owner a child process, the limit a raw socket to another child.
async fn run_tcp(
    owners: &Owners<'_>,
    source: &[u8],
    row: &mut impl FnMut(Measured),
) -> anyhow::Result<()> {
    let settings = owners.settings;
    let (owner, ready) = owners.start(OwnerKind::Tcp)?;
    check_handles(&ready, &settings.sizes, "the tcp owner process")?;
    let (raw_owner, raw_ready) = owners.start(OwnerKind::RawTcp)?;
    let addr = raw_ready
        .addr
        .clone()
        .ok_or_else(|| anyhow!("the raw-tcp owner printed no address"))?;
    let mut stream = tokio::time::timeout(PULL_TIMEOUT, TcpStream::connect(&addr))
        .await
        .map_err(|_| anyhow!("connecting to the raw-tcp owner at {addr}: timed out"))?
        .with_context(|| format!("connecting to the raw-tcp owner at {addr}"))?;
    stream.set_nodelay(true)?;
    let reader = TcpTransport::bind(TcpConfig {
        remote: remote_config(settings.tcp_part_bytes, settings.sealed_frames),
        ..TcpConfig::loopback(owners.secret.clone())
    })
    .await
    .context("starting the tcp reader")?;
    for (&n, handle) in settings.sizes.iter().zip(&ready.handles) {
        let mut limit = Puller::Raw(&mut stream);
        let name = Backend::Tcp.name();
        row(pull_row(name, &mut limit, &reader, handle, &source[..n], settings).await?);
    }
    drop(reader);
    drop(stream);
    owner.stop()?;
    raw_owner.stop()
}

// ---------------------------------------------------------------------------------------------
// The table.
// ---------------------------------------------------------------------------------------------

/// Column titles of the table.
const HEADERS: [&str; 9] = [
    "backend",
    "bytes",
    "GB/s",
    "limit GB/s",
    "ratio",
    "ratio range",
    "latency us",
    "limit us",
    "faults/pull",
];
/// Column widths.
const WIDTHS: [usize; 9] = [13, 8, 9, 10, 6, 11, 10, 9, 13];

fn join(cells: [String; 9]) -> String {
    let mut out = String::new();
    for (i, (cell, w)) in cells.iter().zip(WIDTHS).enumerate() {
        if i > 0 {
            out.push_str("  ");
        }
        if i == 0 {
            out.push_str(&format!("{cell:<w$}"));
        } else {
            out.push_str(&format!("{cell:>w$}"));
        }
    }
    out.trim_end().to_string()
}

fn num(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:.decimals$}")
    } else {
        "n/a".into()
    }
}

/// The header line and the rule under it, each ending in a newline.
pub fn table_header() -> String {
    let mut out = join(HEADERS.map(String::from));
    out.push('\n');
    out.push_str(&"-".repeat(WIDTHS.iter().sum::<usize>() + 2 * (WIDTHS.len() - 1)));
    out.push('\n');
    out
}

/// One row's line, without a newline.
pub fn table_line(m: &Measured) -> String {
    let r = &m.row;
    let latency_decimals = |us: f64| if us < 100.0 { 2 } else { 0 };
    join([
        r.backend.clone(),
        human_bytes(usize::try_from(r.bytes).unwrap_or(usize::MAX)),
        num(r.gbytes_per_s, 3),
        num(r.limit_gbytes_per_s, 3),
        num(r.ratio, 2),
        format!("{}-{}", num(m.ratio_range.0, 2), num(m.ratio_range.1, 2)),
        num(r.latency_us, latency_decimals(r.latency_us)),
        num(m.limit_latency_us, latency_decimals(m.limit_latency_us)),
        format!(
            "{} / {}",
            num(m.faults_per_pull.1, 0),
            num(m.faults_per_pull.0, 0)
        ),
    ])
}

/// What may have decided a row other than the backend: `None` when nothing stands out.
pub fn row_warning(m: &Measured) -> Option<String> {
    let r = &m.row;
    let mut said = Vec::new();
    if r.ratio > 1.0 + ABOVE_ONE {
        said.push(format!(
            "ratio {:.2} > 1: the limit measured slower than the backend it bounds, so the limit \
             measurement, not the backend, decides this row (every buffer is pre-faulted and the \
             faults column says whether faults played a part; the ratio range shows noise from \
             other work on the cores)",
            r.ratio
        ));
    }
    let (limit_faults, backend_faults) = m.faults_per_pull;
    if limit_faults >= 1.0 {
        said.push(format!(
            "the limit paid {limit_faults:.0} page faults per pull, so it reads low and the ratio \
             flatters the backend"
        ));
    }
    if backend_faults >= 1.0 {
        said.push(format!(
            "the backend paid {backend_faults:.0} page faults per pull in this process (fresh \
             buffers each pull), the limit {limit_faults:.0}"
        ));
    }
    let (lo, hi) = m.ratio_range;
    if lo > 0.0 && hi / lo > NOISY_SPREAD {
        said.push(format!(
            "noisy: per-round ratios range {lo:.2}-{hi:.2} (other work on the cores moved the \
             measurements); the medians are the evidence, rerun for a quieter machine"
        ));
    }
    (!said.is_empty()).then(|| said.join("; "))
}

/// The lines under the table: what the limits are, how to read the columns.
pub fn legend(settings: &Settings, backends: &[Backend]) -> Vec<String> {
    let mut out = vec![format!(
        "GB/s = 10^9 bytes/s, median of {} measurements of ~{} ms per side in ABBA order (limit, \
         backend, backend, limit, ...); ratio = GB/s / limit GB/s; ratio range = lowest to highest \
         ratio of one round's pair; latency = median time of one pull of that size (4 KiB: the \
         small-pull round trip), limit us the same for the limit; faults/pull = minor \
         page faults of this (the reading) process per pull, backend / limit",
        settings.rounds,
        settings.measure.as_millis()
    )];
    for b in backends {
        out.push(match b {
            Backend::Local => "limit of local: memcpy (copy_from_slice) of the same bytes between \
                two pre-faulted buffers of this process; owner and reader are two LocalTransports \
                of this process"
                .to_string(),
            Backend::Shm => format!(
                "limit of shm: memcpy, as for local; the shm owner is a child process (its \
                 /dev/shm segments, {} seqlock chunks), read one-sidedly by this process",
                human_bytes(settings.shm_chunk_bytes)
            ),
            Backend::Tcp => format!(
                "limit of tcp: a raw tokio TcpStream over loopback from a child process that writes \
                 the requested bytes from a pre-faulted buffer on an 8-byte request, read_exact \
                 into the same destination (same process split, request/response, TCP_NODELAY; no \
                 framing, no authentication, no parts); the tcp owner is a child process, reads \
                 larger than {} travel in pipelined parts",
                human_bytes(settings.tcp_part_bytes)
            ),
        });
    }
    out
}

/// A target the benchmark is judged against.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    pub backend: Backend,
    pub bytes: usize,
    /// `Some(x)`: ratio at least `x`; otherwise latency at most `max_latency_us`.
    pub min_ratio: Option<f64>,
    pub max_latency_us: Option<f64>,
}

/// The targets: `shm` 64 MiB ≥ 0.8x memcpy, `tcp` 64 MiB ≥ 0.9x raw socket, 4 KiB round trip in
/// process (local) ≤ 20 µs, over tcp loopback ≤ 60 µs.
pub const TARGETS: [Target; 4] = [
    Target {
        backend: Backend::Shm,
        bytes: 64 * MIB,
        min_ratio: Some(0.8),
        max_latency_us: None,
    },
    Target {
        backend: Backend::Tcp,
        bytes: 64 * MIB,
        min_ratio: Some(0.9),
        max_latency_us: None,
    },
    Target {
        backend: Backend::Local,
        bytes: 4 * KIB,
        min_ratio: None,
        max_latency_us: Some(20.0),
    },
    Target {
        backend: Backend::Tcp,
        bytes: 4 * KIB,
        min_ratio: None,
        max_latency_us: Some(60.0),
    },
];

/// One line per target whose row was measured: the value, the target, met or MISSED.
pub fn target_lines(rows: &[Measured]) -> Vec<String> {
    TARGETS
        .iter()
        .filter_map(|t| {
            let m = rows
                .iter()
                .find(|m| m.row.backend == t.backend.name() && m.row.bytes == t.bytes as u64)?;
            let (value, goal, met) = match (t.min_ratio, t.max_latency_us) {
                (Some(min), _) => (
                    format!("{:.2}x {}", m.row.ratio, t.backend.limit()),
                    format!(">= {min:.2}x"),
                    m.row.ratio >= min,
                ),
                (None, Some(max)) => (
                    format!("{:.2} us round trip", m.row.latency_us),
                    format!("<= {max:.0} us"),
                    m.row.latency_us <= max,
                ),
                (None, None) => return None,
            };
            Some(format!(
                "target {} {}: {value} ({goal}): {}",
                t.backend.name(),
                human_bytes(t.bytes),
                if met { "met" } else { "MISSED" }
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(backend: &str, bytes: u64, gb: f64, limit: f64) -> Measured {
        Measured {
            row: TransportRow {
                backend: backend.into(),
                bytes,
                gbytes_per_s: gb,
                limit_gbytes_per_s: limit,
                ratio: gb / limit,
                latency_us: 12.5,
            },
            limit_latency_us: 3.0,
            ratio_range: (0.9, 1.0),
            iters: (10, 10),
            faults_per_pull: (0.0, 0.0),
        }
    }

    #[test]
    fn byte_sizes_parse_with_units_and_limits() {
        assert_eq!(parse_bytes("4096", 4, MAX_PULL_BYTES), Ok(4096));
        assert_eq!(parse_bytes("4k", 4, MAX_PULL_BYTES), Ok(4096));
        assert_eq!(parse_bytes("1MiB", 4, MAX_PULL_BYTES), Ok(MIB));
        assert_eq!(parse_bytes(" 64 MiB", 4, MAX_PULL_BYTES), Ok(64 * MIB));
        assert!(parse_bytes("0", 4, MAX_PULL_BYTES)
            .unwrap_err()
            .contains("less than 4"));
        assert!(parse_bytes("1GiB", 4, MAX_PULL_BYTES)
            .unwrap_err()
            .contains("more than"));
        assert!(parse_bytes("10", 4, MAX_PULL_BYTES)
            .unwrap_err()
            .contains("multiple of 4"));
        assert!(parse_bytes("lots", 4, MAX_PULL_BYTES)
            .unwrap_err()
            .contains("not a byte size"));
        assert!(parse_bytes("4TB", 4, MAX_PULL_BYTES).is_err());
        assert!(parse_bytes("99999999999999999999", 4, MAX_PULL_BYTES).is_err());
    }

    #[test]
    fn pattern_is_deterministic_and_not_periodic_on_powers_of_two() {
        let a = pattern(200_000);
        assert_eq!(a, pattern(200_000));
        assert_eq!(&pattern(1000)[..], &a[..1000]);
        assert_ne!(&a[..4096], &a[4096..8192]);
        assert_ne!(&a[..65_536], &a[65_536..131_072]);
        assert!(pattern(0).is_empty());
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(4096), "4 KiB");
        assert_eq!(human_bytes(64 * MIB), "64 MiB");
        assert_eq!(human_bytes(1000), "1000 B");
        assert_eq!(human_bytes(1536 * KIB), "1536 KiB");
    }

    #[test]
    fn json_has_exactly_the_schema() {
        let report = TransportReport {
            rows: vec![measured("shm", 64 * MIB as u64, 9.0, 10.0).row],
        };
        let v: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(v.as_object().unwrap().keys().collect::<Vec<_>>(), ["rows"]);
        let row = v["rows"][0].as_object().unwrap();
        let mut keys: Vec<&str> = row.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "backend",
                "bytes",
                "gbytes_per_s",
                "latency_us",
                "limit_gbytes_per_s",
                "ratio"
            ]
        );
        assert!(row["bytes"].is_u64());
        assert_eq!(
            TransportReport::from_json(&report.to_json()).unwrap(),
            report
        );
    }

    #[test]
    fn table_lines_up_and_flags_rows() {
        let ok = measured("tcp", 4096, 0.2, 0.4);
        let header = table_header();
        let line = table_line(&ok);
        assert!(line.starts_with("tcp"), "{line}");
        assert!(line.contains("4 KiB") && line.contains("0.50") && line.contains("12.50"));
        assert!(line.ends_with("0 / 0"), "{line}");
        let ratio_end = |l: &str, s: &str| l.find(s).map(|i| i + s.len());
        assert_eq!(
            ratio_end(header.lines().next().unwrap(), "limit GB/s"),
            ratio_end(&line, "0.400")
        );
        assert_eq!(row_warning(&ok), None);
        let mut above = measured("shm", 4096, 1.3, 1.0);
        above.ratio_range = (0.8, 1.6);
        let warning = row_warning(&above).unwrap();
        assert!(
            warning.contains("ratio 1.30 > 1") && warning.contains("noisy"),
            "{warning}"
        );
        assert!(!warning.contains("faults per pull"), "{warning}");
        let mut faulting = ok.clone();
        faulting.faults_per_pull = (3.0, 4096.0);
        assert!(table_line(&faulting).ends_with("4096 / 3"));
        let warning = row_warning(&faulting).unwrap();
        assert!(
            warning.contains("limit paid 3 page faults") && warning.contains("4096 page faults"),
            "{warning}"
        );
        let mut weird = ok.clone();
        weird.row.gbytes_per_s = f64::NAN;
        assert!(table_line(&weird).contains("n/a"));
    }

    #[test]
    fn targets_say_met_or_missed() {
        let mut shm = measured("shm", 64 * MIB as u64, 9.0, 10.0);
        shm.row.ratio = 0.9;
        let mut tcp = measured("tcp", 64 * MIB as u64, 5.0, 10.0);
        tcp.row.ratio = 0.5;
        let mut local = measured("local", 4096, 1.0, 1.0);
        local.row.latency_us = 0.5;
        let lines = target_lines(&[shm, tcp, local]);
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(lines[0].starts_with("target shm 64 MiB") && lines[0].ends_with(": met"));
        assert!(lines[1].starts_with("target tcp 64 MiB") && lines[1].ends_with("MISSED"));
        assert!(lines[2].contains("0.50 us") && lines[2].ends_with(": met"));
    }
}
