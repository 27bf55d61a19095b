//! `odc-bench transport --backends cuda`: the `cuda` backend on one GPU, each row next to the
//! device's own limit measured in the same run (odc-bench feature `cuda`).
//!
//! # Rows
//!
//! - `cuda-ipc`: a reader pulls one whole published `f32` region whose **owner is a child
//!   process** (`odc-bench transport-owner --backend cuda`) into device memory of its own
//!   ([`Transport::read`](odc_transport::Transport::read) into [`Dest::Device`]: CUDA IPC, a
//!   device-to-device copy on the reader's stream, the control segment's seqlock). Limit:
//!   `cuMemcpyDtoDAsync` of the same bytes between two buffers of the reader's device, waited for
//!   the same way. GB/s count bytes copied.
//! - `cuda-acc-f32`, `cuda-acc-bf16`: the accumulate kernels adding an fp32 (bf16) chunk of
//!   `bytes / 4` elements into an fp32 accumulator. GB/s count bytes moved, read and written (12
//!   bytes an element for f32, 10 for bf16); the limit is the device copy of `bytes` bytes counted
//!   the same way (read + written: twice the bytes copied).
//! - `cuda-d2h`: the same pull into host memory ([`Dest::Bytes`]: the device copies into pinned
//!   staging, the host copies out of it piece by piece). Limit: the raw device-to-pinned copy of
//!   the same bytes (what staging costs before the host touches the bytes).
//! - `cuda-h2d`: host bytes into device memory through the pinned staging ([`Device::upload`]:
//!   what a publication or an accumulate payload costs). Limit: the raw pinned-to-device copy.
//!
//! Every side is checked once before it is timed (the bytes that arrived are compared with the
//! expected ones). Sides alternate in ABBA order; a measurement is a batch timed as a whole with
//! the host clock (each operation waits for the device, as the transport does); the row reports
//! the median rate of each side and their ratio, the per-round ratio range, and the median time of
//! one operation.
//!
//! Targets (issue 20): `cuda-ipc` ≥ 0.9x the device copy at 64 MiB and above; the accumulate
//! kernels ≥ 0.8x the copy bandwidth.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use odc_transport::cuda::{CudaConfig, CudaTransport, Device, DeviceBuffer};
use odc_transport::{codec, ClusterSecret, Dest, Dtype, RegionHandle};

use super::{
    check_handles, human_bytes, pattern, read_whole, Measured, OwnerKind, OwnerProcess,
    OwnerSettings, Rounds, MIB,
};

/// Sizes of a run without `--cuda-sizes`.
pub const DEFAULT_SIZES: [usize; 3] = [MIB, 64 * MIB, 1 << 30];
/// Largest size accepted (`--cuda-sizes`): the reader holds a few buffers of it on the device.
pub const MAX_BYTES: usize = 4 << 30;
/// Most operations of one measurement.
const MAX_ITERS: usize = 1_000_000;
/// Individually timed operations per latency pass, at most.
const LATENCY_PASS: usize = 200;

/// What a cuda run measures and how.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Sizes in bytes, multiples of 4.
    pub sizes: Vec<usize>,
    /// The CUDA device (ordinal) of the reader and of the owner child.
    pub device: u32,
    /// Limit/subject pairs per row, in ABBA order.
    pub rounds: usize,
    /// Length of one measurement.
    pub measure: Duration,
    /// The `odc-bench` executable that hosts the owner child.
    pub exe: PathBuf,
}

/// One side of a row: how one operation is done.
enum Side<'a> {
    /// `cuMemcpyDtoDAsync` of `src` into `dst`, waited for.
    Copy {
        device: &'a Device,
        dst: &'a DeviceBuffer,
        src: &'a DeviceBuffer,
    },
    /// A whole-region read through the transport into device memory.
    Pull {
        reader: &'a CudaTransport,
        handle: &'a RegionHandle,
        dst: &'a DeviceBuffer,
    },
    /// A whole-region read through the transport into host memory.
    PullHost {
        reader: &'a CudaTransport,
        handle: &'a RegionHandle,
        dst: &'a mut Vec<u8>,
    },
    /// The f32 accumulate kernel.
    AddF32 {
        device: &'a Device,
        acc: &'a DeviceBuffer,
        src: &'a DeviceBuffer,
    },
    /// The bf16 accumulate kernel.
    AddBf16 {
        device: &'a Device,
        acc: &'a DeviceBuffer,
        src: &'a DeviceBuffer,
    },
    /// Device to pinned staging, piece by piece (no host copy).
    StageOut {
        device: &'a Device,
        src: &'a DeviceBuffer,
    },
    /// Pinned staging to device, piece by piece (no host copy).
    StageIn {
        device: &'a Device,
        dst: &'a DeviceBuffer,
    },
    /// Host bytes to device through the staging.
    Upload {
        device: &'a Device,
        dst: &'a DeviceBuffer,
        src: &'a [u8],
    },
}

impl Side<'_> {
    async fn run(&mut self) -> anyhow::Result<()> {
        match self {
            Side::Copy { device, dst, src } => device.copy(dst, src)?,
            Side::Pull {
                reader,
                handle,
                dst,
            } => read_whole(*reader, handle, Dest::Device(dst.dest())).await?,
            Side::PullHost {
                reader,
                handle,
                dst,
            } => read_whole(*reader, handle, Dest::Bytes(dst)).await?,
            Side::AddF32 { device, acc, src } => device.add_f32(acc, src)?,
            Side::AddBf16 { device, acc, src } => device.add_bf16(acc, src)?,
            Side::StageOut { device, src } => device.stage_out(src)?,
            Side::StageIn { device, dst } => device.stage_in(dst)?,
            Side::Upload { device, dst, src } => device.upload(dst, 0, src)?,
        }
        Ok(())
    }

    async fn batch(&mut self, iters: usize) -> anyhow::Result<f64> {
        let started = Instant::now();
        for _ in 0..iters {
            self.run().await?;
        }
        Ok(started.elapsed().as_secs_f64())
    }

    /// Operations per measurement of about `measure`, after a warm-up of about `warm`.
    async fn calibrate(&mut self, warm: Duration, measure: Duration) -> anyhow::Result<usize> {
        let mut n = 1usize;
        loop {
            let seconds = self.batch(n).await?;
            if seconds >= warm.as_secs_f64() || n >= MAX_ITERS {
                let per_op = seconds / n as f64;
                let iters = (measure.as_secs_f64() / per_op.max(1e-12)).ceil();
                return Ok((iters as usize).clamp(2, MAX_ITERS));
            }
            n = n.saturating_mul(2);
        }
    }

    /// One measurement: seconds per operation of a batch, and single operations' times appended
    /// to `times`.
    async fn measure(&mut self, iters: usize, times: &mut Vec<f64>) -> anyhow::Result<f64> {
        let seconds = self.batch(iters).await?;
        for _ in 0..(iters / 4).clamp(1, LATENCY_PASS) {
            let started = Instant::now();
            self.run().await?;
            times.push(started.elapsed().as_secs_f64());
        }
        Ok(seconds / iters as f64)
    }
}

/// ABBA of `limit` against `subject`; each side's rate is `*_bytes` per operation.
async fn compare(
    name: &str,
    bytes: usize,
    (limit, limit_bytes): (&mut Side<'_>, f64),
    (subject, subject_bytes): (&mut Side<'_>, f64),
    settings: &Settings,
) -> anyhow::Result<Measured> {
    let warm = settings.measure / 4;
    let limit_iters = limit.calibrate(warm, settings.measure).await?;
    let subject_iters = subject.calibrate(warm, settings.measure).await?;
    let mut rounds = Rounds::default();
    for round in 0..settings.rounds {
        let mut rates = [0.0f64; 2];
        for side in Rounds::order(round) {
            let times = &mut rounds.times[side];
            rates[side] = if side == 0 {
                limit_bytes / limit.measure(limit_iters, times).await?
            } else {
                subject_bytes / subject.measure(subject_iters, times).await?
            };
        }
        rounds.push(rates);
    }
    Ok(rounds.into_measured(
        name,
        bytes,
        (limit_iters, subject_iters),
        (f64::NAN, f64::NAN),
    ))
}

/// `values` as `f32` elements, a pattern of small integers (sums stay exact and finite however
/// often the kernels add them).
fn small_values(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i % 7) as f32 - 3.0).collect()
}

fn check(what: &str, got: &[u8], expected: &[u8]) -> anyhow::Result<()> {
    if got.len() != expected.len() {
        bail!(
            "{what}: {} bytes arrived, {} expected",
            got.len(),
            expected.len()
        );
    }
    if let Some(at) = got.iter().zip(expected).position(|(a, b)| a != b) {
        bail!("{what} delivered wrong bytes (first difference at byte {at})");
    }
    Ok(())
}

/// Runs the cuda rows; `on_row` sees each as it is measured. Returns them and the device's
/// name. Without a CUDA driver: the backend's "no CUDA driver" error.
pub async fn run(
    settings: &Settings,
    on_row: impl FnMut(&Measured),
) -> anyhow::Result<(Vec<Measured>, String)> {
    let device = Device::open(settings.device).context("cuda")?;
    let secret = ClusterSecret::random();
    let job = format!("odc-bench-cuda-{}", std::process::id());
    let (owner, ready) = OwnerProcess::start(
        &settings.exe,
        &OwnerSettings {
            kind: OwnerKind::Cuda,
            sizes: settings.sizes.clone(),
            job: job.clone(),
            tcp_part_bytes: 4 * MIB,
            shm_chunk_bytes: 256 << 10,
            // The cuda owner's socket is a Unix one (one host): never sealed.
            sealed_frames: false,
            cuda_device: settings.device,
        },
        &secret,
    )?;
    check_handles(&ready, &settings.sizes, "the cuda owner process")?;
    let reader = CudaTransport::new(CudaConfig::new(settings.device, job, secret))
        .await
        .context("starting the cuda reader")?;
    let mut rows = Rows {
        settings,
        on_row,
        rows: Vec::new(),
    };
    for (&n, handle) in settings.sizes.iter().zip(&ready.handles) {
        let buffers = Buffers::new(&device, n)?;
        rows.ipc(&buffers, &reader, handle).await?;
        rows.accumulate(&buffers).await?;
        rows.staging(&buffers, &reader, handle).await?;
    }
    drop(reader);
    owner.stop()?;
    Ok((rows.rows, device.name()))
}

/// One size's buffers on the device: a source holding the expected bytes, and a destination.
struct Buffers<'a> {
    device: &'a Arc<Device>,
    /// Bytes of each buffer.
    n: usize,
    /// The bytes the owner publishes ([`pattern`]).
    expected: Vec<u8>,
    src: DeviceBuffer,
    dst: DeviceBuffer,
}

impl<'a> Buffers<'a> {
    fn new(device: &'a Arc<Device>, n: usize) -> anyhow::Result<Buffers<'a>> {
        let at = |what: &str| format!("cuda, {what}, {}", human_bytes(n));
        let expected = pattern(n);
        let src = device.alloc(n).with_context(|| at("allocating"))?;
        let dst = device.alloc(n).with_context(|| at("allocating"))?;
        device.upload(&src, 0, &expected)?;
        Ok(Buffers {
            device,
            n,
            expected,
            src,
            dst,
        })
    }

    /// `what` at this size, for errors.
    fn at(&self, what: &str) -> String {
        format!("cuda, {what}, {}", human_bytes(self.n))
    }

    /// Whether `buffer` holds `expected` (`what` names the operation that filled it).
    fn check(&self, what: &str, buffer: &DeviceBuffer, expected: &[u8]) -> anyhow::Result<()> {
        check(&self.at(what), &self.device.download(buffer)?, expected)
    }

    /// The limit of most rows: the device copy of `src` into `dst`.
    fn copy(&self) -> Side<'_> {
        Side::Copy {
            device: self.device,
            dst: &self.dst,
            src: &self.src,
        }
    }
}

/// The rows measured so far, each shown to `on_row` as it comes.
struct Rows<'s, F> {
    settings: &'s Settings,
    on_row: F,
    rows: Vec<Measured>,
}

impl<F: FnMut(&Measured)> Rows<'_, F> {
    /// The row `name`: [`compare`] of `limit` against `subject` at `buffers`' size (`what` names
    /// it in errors).
    async fn compare(
        &mut self,
        (name, what): (&str, &str),
        buffers: &Buffers<'_>,
        limit: (&mut Side<'_>, f64),
        subject: (&mut Side<'_>, f64),
    ) -> anyhow::Result<()> {
        let m = compare(name, buffers.n, limit, subject, self.settings)
            .await
            .with_context(|| buffers.at(what))?;
        (self.on_row)(&m);
        self.rows.push(m);
        Ok(())
    }

    /// `cuda-ipc`: the IPC pull of `handle` into device memory against the device copy.
    async fn ipc(
        &mut self,
        b: &Buffers<'_>,
        reader: &CudaTransport,
        handle: &RegionHandle,
    ) -> anyhow::Result<()> {
        let mut pull = Side::Pull {
            reader,
            handle,
            dst: &b.dst,
        };
        pull.run().await.with_context(|| b.at("IPC pull"))?;
        b.check("IPC pull", &b.dst, &b.expected)?;
        let mut copy = b.copy();
        copy.run().await?;
        b.check("device copy", &b.dst, &b.expected)?;
        let n = b.n as f64;
        self.compare(("cuda-ipc", "IPC pull"), b, (&mut copy, n), (&mut pull, n))
            .await
    }

    /// `cuda-acc-f32`, `cuda-acc-bf16`: the accumulate kernels against the device copy.
    async fn accumulate(&mut self, b: &Buffers<'_>) -> anyhow::Result<()> {
        let device = b.device;
        let elements = b.n / 4;
        let grad = small_values(elements);
        let acc = device.alloc(b.n)?;
        let f32_src = device.alloc(b.n)?;
        device.upload(&f32_src, 0, &codec::encode_f32(&grad))?;
        let add = Side::AddF32 {
            device,
            acc: &acc,
            src: &f32_src,
        };
        let moved = 12.0 * elements as f64;
        self.accumulate_row(
            ("cuda-acc-f32", "f32 accumulate"),
            b,
            (add, moved),
            &acc,
            &grad,
        )
        .await?;
        drop(f32_src);
        let bf16_src = device.alloc(elements * 2)?;
        device.upload(&bf16_src, 0, &codec::encode(Dtype::Bf16, &grad))?;
        let zeros = device.alloc(b.n)?;
        device.copy(&acc, &zeros)?;
        drop(zeros);
        let add = Side::AddBf16 {
            device,
            acc: &acc,
            src: &bf16_src,
        };
        let moved = 10.0 * elements as f64;
        self.accumulate_row(
            ("cuda-acc-bf16", "bf16 accumulate"),
            b,
            (add, moved),
            &acc,
            &grad,
        )
        .await
    }

    /// One accumulate row: `add` run once into the zeroed `acc` must leave `grad` there; then
    /// `add`, counted as `moved` bytes read + written per operation, against the device copy,
    /// counted the same way (twice the bytes copied).
    async fn accumulate_row(
        &mut self,
        (name, what): (&str, &str),
        b: &Buffers<'_>,
        (mut add, moved): (Side<'_>, f64),
        acc: &DeviceBuffer,
        grad: &[f32],
    ) -> anyhow::Result<()> {
        add.run().await?;
        b.check(&format!("{what} kernel"), acc, &codec::encode_f32(grad))?;
        let copied = 2.0 * b.n as f64;
        self.compare((name, what), b, (&mut b.copy(), copied), (&mut add, moved))
            .await
    }

    /// `cuda-d2h`, `cuda-h2d`: pulls into host memory and uploads from it, through the pinned
    /// staging, against the raw staging copies.
    async fn staging(
        &mut self,
        b: &Buffers<'_>,
        reader: &CudaTransport,
        handle: &RegionHandle,
    ) -> anyhow::Result<()> {
        let n = b.n as f64;
        let mut host = vec![0u8; b.n];
        let mut pull_host = Side::PullHost {
            reader,
            handle,
            dst: &mut host,
        };
        pull_host.run().await.with_context(|| b.at("host pull"))?;
        check(&b.at("host pull"), &host, &b.expected)?;
        let mut pull_host = Side::PullHost {
            reader,
            handle,
            dst: &mut host,
        };
        let mut stage_out = Side::StageOut {
            device: b.device,
            src: &b.src,
        };
        let (limit, subject) = ((&mut stage_out, n), (&mut pull_host, n));
        self.compare(("cuda-d2h", "host pull"), b, limit, subject)
            .await?;
        let mut upload = Side::Upload {
            device: b.device,
            dst: &b.dst,
            src: &b.expected,
        };
        upload.run().await?;
        b.check("upload", &b.dst, &b.expected)?;
        let mut stage_in = Side::StageIn {
            device: b.device,
            dst: &b.dst,
        };
        let (limit, subject) = ((&mut stage_in, n), (&mut upload, n));
        self.compare(("cuda-h2d", "upload"), b, limit, subject)
            .await
    }
}

/// The lines under the table for the cuda rows.
pub fn legend(settings: &Settings, device_name: &str) -> Vec<String> {
    vec![
        format!(
            "cuda rows: device {} ({device_name}); the owner of cuda-ipc and cuda-d2h regions is \
             a child process on the same device; every operation waits for the device (host \
             clock, {} rounds of ~{} ms per side, ABBA)",
            settings.device,
            settings.rounds,
            settings.measure.as_millis()
        ),
        "cuda-ipc: Transport::read into device memory (CUDA IPC, device-to-device copy on the \
         reader's stream, seqlock) vs limit cuMemcpyDtoDAsync of the same bytes on the reader's \
         device; GB/s = bytes copied per second"
            .into(),
        "cuda-acc-f32 / cuda-acc-bf16: the accumulate kernel on bytes/4 elements, GB/s = bytes \
         read + written (12 or 10 per element) vs limit the device copy of `bytes`, counted read + \
         written (2 x bytes)"
            .into(),
        "cuda-d2h: Transport::read into host memory (through the pinned staging) vs limit the raw \
         device-to-pinned copy; cuda-h2d: host bytes to the device through the pinned staging vs \
         limit the raw pinned-to-device copy"
            .into(),
    ]
}

/// One line per cuda target whose row was measured: `cuda-ipc` ≥ 0.9x at 64 MiB and above,
/// `cuda-acc-*` ≥ 0.8x at 64 MiB and above.
pub fn target_lines(rows: &[Measured]) -> Vec<String> {
    rows.iter()
        .filter(|m| m.row.bytes >= 64 * MIB as u64)
        .filter_map(|m| {
            let min = match m.row.backend.as_str() {
                "cuda-ipc" => 0.9,
                "cuda-acc-f32" | "cuda-acc-bf16" => 0.8,
                _ => return None,
            };
            Some(format!(
                "target {} {}: {:.2}x device copy (>= {min:.2}x): {}",
                m.row.backend,
                human_bytes(usize::try_from(m.row.bytes).unwrap_or(usize::MAX)),
                m.row.ratio,
                if m.row.ratio >= min { "met" } else { "MISSED" }
            ))
        })
        .collect()
}

/// The owner child's side: a [`CudaTransport`] on `device` with one published `f32` region of
/// [`pattern`] bytes per size.
pub(super) async fn serve(
    sizes: &[usize],
    job: &str,
    device: u32,
    secret: ClusterSecret,
    stdin_closed: tokio::sync::oneshot::Receiver<()>,
) -> anyhow::Result<()> {
    let transport = Arc::new(
        CudaTransport::new(CudaConfig::new(device, job, secret))
            .await
            .context("starting the cuda owner")?,
    );
    let guards = super::register(transport.as_ref(), sizes)?;
    super::announce(&guards, None)?;
    super::wait_until(stdin_closed).await;
    drop(guards);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::TransportRow;

    fn measured(backend: &str, bytes: u64, ratio: f64) -> Measured {
        Measured {
            row: TransportRow {
                backend: backend.into(),
                bytes,
                gbytes_per_s: ratio,
                limit_gbytes_per_s: 1.0,
                ratio,
                latency_us: 1.0,
            },
            limit_latency_us: 1.0,
            ratio_range: (ratio, ratio),
            iters: (1, 1),
            faults_per_pull: (f64::NAN, f64::NAN),
        }
    }

    #[test]
    fn cuda_targets_apply_from_64_mib() {
        let rows = [
            measured("cuda-ipc", MIB as u64, 0.5),
            measured("cuda-ipc", 64 * MIB as u64, 0.95),
            measured("cuda-acc-f32", 64 * MIB as u64, 0.7),
            measured("cuda-acc-bf16", 1 << 30, 0.85),
            measured("cuda-d2h", 1 << 30, 0.1),
        ];
        let lines = target_lines(&rows);
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(lines[0].starts_with("target cuda-ipc 64 MiB") && lines[0].ends_with(": met"));
        assert!(lines[1].starts_with("target cuda-acc-f32") && lines[1].ends_with("MISSED"));
        assert!(lines[2].contains("1024 MiB") && lines[2].ends_with(": met"));
    }

    #[test]
    fn small_values_stay_exact_under_repeated_adds() {
        let v = small_values(10);
        assert_eq!(v.len(), 10);
        assert!(v.iter().all(|x| x.fract() == 0.0 && x.abs() <= 3.0));
    }
}
