//! The `shm` backend (Linux): processes of one host. Published regions live in shared memory and
//! are read **one-sidedly**: a reader maps the owner's segment read-only and copies straight out of
//! it into its destination, without the owner's involvement. Accumulates and inbox sends are
//! acknowledged by the owner: they travel over the owner's Unix socket with the peer protocol of
//! [`crate::remote`] (handshake on the cluster secret first), and the owner applies them to its
//! fabric before it answers.
//!
//! Names and cleanup: every file of a job is named after the job and the owner's pid —
//! segments `odc-{job}-{pid}-{n}` ([`segment`]), sockets `odc-{job}-{pid}-{n}.sock` — in one
//! directory (`/dev/shm` unless configured). An owner removes its segments when their guards drop
//! and its socket when the transport drops. After a crash they stay behind; the next transport of
//! the same job on the host ([`ShmTransport::new`]) removes every file of the job whose owner
//! process is gone (pid dead, or reused by a process with another start time) and logs what it
//! removed. A live owner's file is never removed or reused: creating a segment whose name exists
//! with a live owner is an error.
//!
//! How each clause holds:
//! - **C1**: per-chunk seqlocks ([`segment`]): a read retries a piece that a publication
//!   overlapped and restarts when pieces belong to different publications, so the destination ends
//!   up holding exactly one publication and the read returns its version. A publication is written
//!   in place (readers never see a torn copy, and a read waits at most for one publication).
//! - **C2, C3, C7**: the owner's fabric, as over `tcp`.
//! - **C4**: the reader checks, in order: deadline, descriptor (another host or job is
//!   [`TransportError::ForeignHandle`]; a segment that is gone, closed, of another owner or
//!   instance is [`TransportError::UnknownRegion`]), kind (a segment handle used for an accumulate
//!   or a send is [`TransportError::WrongKind`]), range, destination. Operations on accumulators and
//!   inboxes are checked by the owner as over `tcp`.
//! - **C6, I6**: a read that cannot see a stable publication by its deadline (an owner that died in
//!   the middle of one) is [`TransportError::DeadlineExceeded`] or, if the owner process is gone,
//!   [`TransportError::Unreachable`]; the socket path has the deadlines of [`crate::remote`].

pub(crate) mod segment;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::net::{UnixListener, UnixStream};

use self::segment::{SegmentError, SegmentReader, SegmentWriter};
use crate::codec;
use crate::error::wide;
use crate::remote::{
    foreign, other_backend, serve_split, Backend, Located, Remote, RemoteConfig, Served, UnixDial,
};
use crate::wire::{ClusterSecret, Target};
use crate::{
    Deadline, Descriptor, Dest, Dtype, EndpointId, Op, PublishedRegion, RegionHandle, RegionKind,
    TransportError,
};

/// Segment numbers of this process (names are per pid, so per process is enough); never reused.
/// Shared with the `cuda` backend's control segments, so the two never make the same name.
pub(crate) static NEXT_SEGMENT: AtomicU64 = AtomicU64::new(0);

/// How an [`ShmTransport`] names and places its files.
#[derive(Debug, Clone)]
pub struct ShmConfig {
    /// The job's id (`[A-Za-z0-9_.-]{1,64}`): every process of the job uses the same.
    pub job: String,
    /// Where segments and sockets live (`/dev/shm`).
    pub dir: PathBuf,
    /// Shared by every process of the job.
    pub secret: ClusterSecret,
    /// Bytes per seqlock chunk of a segment (rounded to a multiple of 8).
    pub chunk_bytes: usize,
    pub remote: RemoteConfig,
}

impl ShmConfig {
    /// Job `job` in `/dev/shm`, 256 KiB chunks.
    pub fn new(job: impl Into<String>, secret: ClusterSecret) -> Self {
        Self {
            job: job.into(),
            dir: PathBuf::from("/dev/shm"),
            secret,
            chunk_bytes: 256 * 1024,
            remote: RemoteConfig::default(),
        }
    }
}

/// The shared-memory backend: the served core ([`Remote`]) with published regions in segments
/// that readers map and copy without their owner. Create it inside a tokio runtime
/// ([`ShmTransport::new`]).
pub type ShmTransport = Remote<Shm>;

/// What is the shm backend's own: its files, and the segments this process has mapped.
pub struct Shm {
    host: String,
    job: String,
    dir: PathBuf,
    chunk_bytes: usize,
    socket: JobSocket,
    /// Segments this process has mapped, by name.
    mapped: Mutex<HashMap<String, Arc<SegmentReader>>>,
}

impl std::fmt::Debug for Shm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shm")
            .field("job", &self.job)
            .field("socket", &self.socket.path())
            .finish()
    }
}

/// This host's identity: its boot id (two hosts, or two boots, never share one).
pub(crate) fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_owned())
        .unwrap_or_else(|_| "unknown-host".into())
}

fn unsupported(what: String) -> TransportError {
    TransportError::Unsupported { what }
}

impl Remote<Shm> {
    /// Remove the job's stale files, listen on a fresh socket and serve this transport's
    /// accumulators and inboxes there.
    pub async fn new(config: ShmConfig) -> Result<Self, TransportError> {
        let (listener, socket) = JobSocket::listen(Shm::NAME, &config.dir, &config.job)?;
        let shm = Shm {
            host: host_id(),
            job: config.job,
            dir: config.dir,
            chunk_bytes: config.chunk_bytes.max(8) / 8 * 8,
            socket,
            mapped: Mutex::new(HashMap::new()),
        };
        Ok(Remote::start(
            listener,
            UnixDial,
            // One host: its Unix socket and the job's own files need no sealed frames.
            RemoteConfig {
                sealed_frames: false,
                ..config.remote
            },
            config.secret,
            shm,
            serve_split::<UnixStream>,
        ))
    }

    /// The Unix socket this transport serves on.
    pub fn socket(&self) -> &Path {
        self.backend.socket.path()
    }
}

/// The Unix socket a transport of a job serves on (`odc-{job}-{pid}-{n}.sock`, the `shm` and the
/// `cuda` backends'); its file is removed when this is dropped.
#[derive(Debug)]
pub(crate) struct JobSocket(PathBuf);

impl JobSocket {
    /// Check the job id, remove the job's stale files in `dir` ([`sweep`]) and listen on a fresh
    /// socket there for `backend`.
    pub(crate) fn listen(
        backend: &str,
        dir: &Path,
        job: &str,
    ) -> Result<(UnixListener, Self), TransportError> {
        if !segment::job_is_valid(job) {
            return Err(unsupported(format!(
                "{backend} backend: job id {job:?} is not [A-Za-z0-9_.-]{{1,64}}"
            )));
        }
        sweep(dir, job);
        let n = NEXT_SEGMENT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("odc-{job}-{}-{n}.sock", std::process::id()));
        let listener = UnixListener::bind(&path).map_err(|e| {
            unsupported(format!(
                "{backend} backend cannot listen on {}: {e}",
                path.display()
            ))
        })?;
        Ok((listener, Self(path)))
    }

    /// The socket's path.
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for JobSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Shm {
    fn descriptor_of(&self, served: &Served, segment: Option<String>) -> Descriptor {
        Descriptor::Shm {
            host: self.host.clone(),
            job: self.job.clone(),
            instance: served.instance,
            socket: self.socket.path().to_string_lossy().into_owned(),
            segment,
        }
    }

    /// The mapped segment `name` if it is still the region `target` names.
    fn segment(&self, name: &str, target: &Target) -> Result<Arc<SegmentReader>, TransportError> {
        let unknown = TransportError::UnknownRegion {
            owner: target.owner,
            region: target.region,
        };
        let cached = self.mapped.lock().get(name).cloned();
        let reader = match cached {
            Some(reader) if reader.is_closed() => {
                self.mapped.lock().remove(name);
                return Err(unknown);
            }
            Some(reader) => reader,
            None => {
                let reader = match SegmentReader::open(&self.dir, name, &self.job) {
                    Ok(reader) => Arc::new(reader),
                    Err(SegmentError::WrongJob { found, .. }) => {
                        return Err(TransportError::ForeignHandle {
                            owner: target.owner,
                            region: target.region,
                            reason: format!("its segment belongs to job {found:?}"),
                        })
                    }
                    // Gone (dropped, or its owner's files were cleaned up), or not a segment.
                    Err(_) => return Err(unknown),
                };
                if reader.is_closed() {
                    return Err(unknown);
                }
                let mut mapped = self.mapped.lock();
                // Forget mappings of regions that were dropped meanwhile.
                mapped.retain(|_, r| !r.is_closed());
                mapped.insert(name.to_owned(), Arc::clone(&reader));
                reader
            }
        };
        if reader.endpoint() != target.owner
            || reader.instance() != target.instance
            || reader.handle_id() != target.region
        {
            return Err(unknown);
        }
        Ok(reader)
    }

    /// One-sided read from a mapped segment into `into` (C1).
    fn read_segment(
        &self,
        reader: &SegmentReader,
        target: &Target,
        range: Range<usize>,
        into: Dest<'_>,
        deadline: Deadline,
    ) -> Result<u64, TransportError> {
        let region = target.region;
        let elements = reader.elements();
        if range.start > range.end || range.end > elements {
            return Err(TransportError::OutOfRange {
                region,
                start: wide(range.start),
                end: wide(range.end),
                len: wide(elements),
            });
        }
        let dtype = match reader.elem_size() {
            4 => Dtype::F32,
            2 => Dtype::Bf16,
            other => {
                return Err(unsupported(format!(
                    "segment of region {region} has {other}-byte elements"
                )))
            }
        };
        into.spec().check_host(region, dtype, range.len())?;
        let size = dtype.size();
        let bytes = range.start * size..range.end * size;
        let result = match into {
            Dest::Bytes(buf) => reader.read(bytes, deadline, &mut |src, at| {
                if let Some(out) = buf.get_mut(at..at + src.len()) {
                    out.copy_from_slice(src);
                }
            }),
            Dest::F32(out) => {
                let mut bad = false;
                let version = reader.read(bytes, deadline, &mut |src, at| {
                    let first = at / size;
                    match out.get_mut(first..first + src.len() / size) {
                        Some(out) => bad |= codec::decode_into(dtype, src, out).is_err(),
                        None => bad = true,
                    }
                });
                if bad {
                    return Err(unsupported(format!(
                        "segment of region {region} handed out a piece that does not fit"
                    )));
                }
                version
            }
            // Refused by `check_host` above.
            Dest::Device(device) => {
                return Err(unsupported(format!(
                    "read of region {region} into device memory ({} bytes)",
                    device.bytes
                )))
            }
        };
        result.map_err(|e| match e {
            SegmentError::Deadline { .. } if !reader.owner_alive() => TransportError::Unreachable {
                owner: target.owner,
                reason: format!(
                    "the owner process of segment {} is gone (it died while publishing)",
                    reader.name()
                ),
            },
            SegmentError::Deadline { .. } => TransportError::DeadlineExceeded {
                owner: target.owner,
                region,
                op: Op::Read,
            },
            other => unsupported(format!("read of region {region}: {other}")),
        })
    }

    /// An accumulate or a send aimed at a segment (a published region): refused by kind, after the
    /// handle checks.
    fn wrong_kind_for_segment(
        &self,
        name: &str,
        target: &Target,
        expected: RegionKind,
    ) -> TransportError {
        match self.segment(name, target) {
            Ok(_) => TransportError::WrongKind {
                region: target.region,
                expected,
                actual: RegionKind::Published,
            },
            Err(e) => e,
        }
    }
}

/// Remove the job's files in `dir` whose owner process is gone: segments (by the segment layer)
/// and sockets `odc-{job}-{pid}-{n}.sock` (the `cuda` backend names its files the same way).
pub(crate) fn sweep(dir: &Path, job: &str) {
    match segment::sweep_stale(dir, Some(job)) {
        Ok(removed) if !removed.is_empty() => tracing::warn!(
            job,
            "odc shm: removed {} stale segment(s) of dead processes: {}",
            removed.len(),
            removed.join(", ")
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(job, "odc shm: cannot sweep {}: {e}", dir.display()),
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = format!("odc-{job}-");
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name
            .strip_prefix(&prefix)
            .and_then(|rest| rest.strip_suffix(".sock"))
        else {
            continue;
        };
        let Some(pid) = rest
            .split_once('-')
            .and_then(|(pid, n)| n.parse::<u64>().ok().and(pid.parse::<u32>().ok()))
        else {
            continue;
        };
        if segment::owner_gone(pid, None) && std::fs::remove_file(entry.path()).is_ok() {
            tracing::warn!(
                job,
                "odc shm: removed stale socket {name} of dead process {pid}"
            );
        }
    }
}

/// The owner's guard of a published segment.
struct SegmentGuard {
    writer: SegmentWriter,
    handle: RegionHandle,
    dtype: Dtype,
    len: usize,
}

impl PublishedRegion for SegmentGuard {
    fn handle(&self) -> RegionHandle {
        RegionHandle {
            version: self.writer.version(),
            ..self.handle.clone()
        }
    }

    fn publish(&self, version: u64, data: Bytes) -> Result<(), TransportError> {
        let region = self.handle.id;
        codec::check_exact(self.dtype, &data, self.len).map_err(|e| e.for_region(region))?;
        self.writer
            .publish(version, &data)
            .map_err(|e| unsupported(format!("publish of region {region}: {e}")))
    }

    fn republish(&self, version: u64) -> Result<(), TransportError> {
        self.writer.republish(version);
        Ok(())
    }

    fn version(&self) -> u64 {
        self.writer.version()
    }
}

impl Backend for Shm {
    /// A published region has a segment; its name stays in the handle (read again below), so
    /// that locating a handle allocates nothing.
    type Memory = ();

    const NAME: &'static str = "shm";

    fn descriptor(&self, served: &Served) -> Descriptor {
        self.descriptor_of(served, None)
    }

    fn locate<'h>(
        &self,
        _: &Served,
        handle: &'h RegionHandle,
    ) -> Result<Located<'h, ()>, TransportError> {
        match &handle.descriptor {
            Descriptor::Shm {
                host,
                job,
                instance,
                socket,
                segment,
            } => {
                same_host_and_job(
                    handle,
                    (host, job),
                    (&self.host, &self.job),
                    "shm handles do not cross hosts",
                )?;
                Ok(Located {
                    addr: socket,
                    memory: segment.as_ref().map(|_| ()),
                    target: Target {
                        owner: handle.owner,
                        instance: *instance,
                        region: handle.id,
                    },
                })
            }
            _ => Err(other_backend(handle, "shm", "regions of shm owners")),
        }
    }

    fn register_published(
        &self,
        served: &Served,
        owner: EndpointId,
        dtype: Dtype,
        initial: Bytes,
        version: u64,
    ) -> Result<Box<dyn PublishedRegion>, TransportError> {
        let id = served.fabric.next_region_id();
        let len = codec::element_count(dtype, initial.len()).map_err(|e| e.for_region(id))?;
        let chunk = self.chunk_bytes.max(dtype.size()) / dtype.size() * dtype.size();
        let chunk = (chunk / 8).max(1) * 8;
        let writer = SegmentWriter::create_for(
            &self.dir,
            &self.job,
            owner,
            served.instance,
            id,
            NEXT_SEGMENT.fetch_add(1, Ordering::Relaxed),
            dtype.size(),
            len,
            chunk,
            &initial,
            version,
        )
        .map_err(|e| unsupported(format!("shm backend cannot create region {id}: {e}")))?;
        let handle = RegionHandle {
            owner,
            id,
            kind: RegionKind::Published,
            dtype,
            len: wide(len),
            version,
            descriptor: self.descriptor_of(served, Some(writer.name().to_owned())),
        };
        Ok(Box::new(SegmentGuard {
            writer,
            handle,
            dtype,
            len,
        }))
    }

    async fn read_memory(
        &self,
        _: &Served,
        handle: &RegionHandle,
        located: &Located<'_, ()>,
        _: &(),
        range: Range<usize>,
        into: Dest<'_>,
        deadline: Deadline,
    ) -> Result<u64, TransportError> {
        let segment = segment_of(handle);
        let reader = self.segment(segment, &located.target)?;
        self.read_segment(&reader, &located.target, range, into, deadline)
    }

    async fn wrong_kind(
        &self,
        _: &Served,
        handle: &RegionHandle,
        located: &Located<'_, ()>,
        _: &(),
        _: Op,
        expected: RegionKind,
        _: Deadline,
    ) -> TransportError {
        self.wrong_kind_for_segment(segment_of(handle), &located.target, expected)
    }
}

/// The segment a located shm handle names (`locate` found one).
fn segment_of(handle: &RegionHandle) -> &str {
    match &handle.descriptor {
        Descriptor::Shm {
            segment: Some(name),
            ..
        } => name,
        _ => "",
    }
}

/// A handle of a host-local backend (`shm`, `cuda`) issued on `host` for `job`: refused unless
/// they are this transport's (`ours`), naming which differs; `crossing` says why a host matters.
pub(crate) fn same_host_and_job(
    handle: &RegionHandle,
    (host, job): (&str, &str),
    ours: (&str, &str),
    crossing: &str,
) -> Result<(), TransportError> {
    if host != ours.0 {
        return Err(foreign(
            handle,
            format!(
                "it was issued on host {host}, this is host {}; {crossing}",
                ours.0
            ),
        ));
    }
    if job != ours.1 {
        return Err(foreign(
            handle,
            format!(
                "it belongs to job {job:?}, this transport to job {:?}",
                ours.1
            ),
        ));
    }
    Ok(())
}
