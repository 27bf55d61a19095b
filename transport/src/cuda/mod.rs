//! The `cuda` backend (feature `cuda`, Linux): processes of one host sharing its CUDA devices.
//! Published regions live in **device memory** and are read **one-sidedly through CUDA IPC**: the
//! owner allocates each with `cuMemAlloc` (IPC-exportable, unlike cudarc's stream-ordered pool) and
//! its handle carries the allocation's IPC handle, the region's byte offset in it and its length
//! ([`Descriptor::Cuda`]` { memory: Some(`[`CudaMemory`]`) }`); a reader opens the allocation once
//! per process (`cuIpcOpenMemHandle`, cached and shared by the process's transports) and copies
//! device to device on its own stream (`cuMemcpyDtoDAsync`) into a [`Dest::Device`], or through
//! pinned host staging into a host destination. A reader in the owner's own process (which CUDA
//! IPC cannot serve) reads the memory directly. Accumulates and inbox sends are acknowledged by
//! the owner over its Unix socket with the peer protocol of [`crate::remote`], as with `shm`.
//!
//! # Choices
//! - **Accumulate path.** The contract's accumulate takes host bytes (`Bytes` of fp32), so they
//!   travel like `shm`'s: over the owner's Unix socket (handshake first), then the owner copies
//!   them host → device (pinned staging, then a device scratch buffer) and runs the NVRTC kernel
//!   `odc_add_f32` (odc-kernels' `accumulate.cu`) into the fp32 accumulator in device memory. Fencing (epoch) and
//!   deduplication (write id) are the shared owner core's (`local/accumulator.rs`), whose
//!   [`Sums`](crate::local) here is device memory; the checks and the kernel run under one lock,
//!   so C2 and C3 hold exactly as for every backend. **From device memory**
//!   (`CudaTransport::accumulate_device`, beside the contract): into an accumulator of this
//!   process the owner's kernel reads the writer's memory itself; into another process's, the
//!   writer copies it device to device into an exportable staging buffer that the owner opens
//!   through CUDA IPC and adds from (`Request::AccumulateDevice`, `push.rs`) — the same fences,
//!   no host copy. `odc_add_bf16` adds bf16 chunks; the contract's
//!   payloads are fp32, so only the benchmark and the kernel tests use it today.
//! - **Publication.** `publish` takes bytes already encoded in the region's dtype (the caller
//!   encodes the bf16 copy, as for every backend) and copies them host → device through pinned
//!   staging. A kernel that writes the bf16 copy from fp32 master weights in device memory belongs
//!   to servers that keep their weights on the device; it is not part of this backend.
//! - **Consistency (C1).** A region's version and seqlock live in host shared memory, in a
//!   data-less `shm` segment per region (`odc-{job}-{pid}-{n}` in the configured directory, which
//!   also records the owner's endpoint, instance and region, and whether the region was dropped).
//!   The owner makes the sequence odd, copies, records the version and makes it even; a reader
//!   loads the sequence, copies and waits for its copy to complete, and loads it again: equal and
//!   even means one whole publication, else it copies again. Host atomics cost nothing next to the
//!   copy, where sequence words in device memory would cost two small device-to-host copies per
//!   read.
//!
//! # How each clause holds
//! - **C1**: the seqlock above around every read (device or host destination). A read observes
//!   one whole publication and returns its version; a read that raced a publication is redone.
//! - **C2, C3**: the shared owner core (fencing, dedup, then the kernel, under one lock);
//!   `Ok(())` comes back only after the kernel finished. `take` copies the values back and zeroes
//!   them under the same lock. A device failure in `take` (which cannot return an error) is logged
//!   and returns NaNs, which the step's non-finite check refuses.
//! - **C4**: a reader checks, in order: deadline; descriptor (another host or job is
//!   [`TransportError::ForeignHandle`]); the control segment (gone, closed, of another owner,
//!   instance or region: [`TransportError::UnknownRegion`]) and the memory (an IPC handle whose
//!   offset and length do not fit its allocation names no region); kind (an accumulate or a send
//!   at a published region is [`TransportError::WrongKind`]); range; destination (a host one of the
//!   wrong size is [`TransportError::BadDestination`]; a device one of the wrong size too, and one
//!   that is not device memory of the reader's device inside one allocation is
//!   [`TransportError::Unsupported`]). Accumulators and inboxes are checked by the owner as over
//!   `shm`.
//! - **C5**: any split reads the same bytes (no publication in between).
//! - **C6, I6**: every wait for the device polls an event until the operation's deadline (owner
//!   operations, which have none, until 60 s); a read still copying then is
//!   [`TransportError::DeadlineExceeded`], and the copy is drained before the stream is used
//!   again. A read that missed its deadline may still land in a device destination until then.
//! - **C7**: inboxes are host memory in the owner's fabric, over the socket. A message whose
//!   values are device memory (`CudaTransport::send_device`, beside the contract: a gang's K/V, a
//!   collective's pieces) has them copied device to device into the owner's memory and held
//!   before its header is delivered under the same fences (`messages.rs`). Those buffers, the
//!   push staging and callers' scratch are reused, not allocated per transfer (`pool.rs`).
//!
//! # Without a driver
//! [`CudaTransport::new`], [`Device::open`] and [`device_count`] check for the driver library
//! before any cudarc call (cudarc panics without one) and fail with
//! [`TransportError::Unsupported`] whose text starts `no CUDA driver:`. The kernels also need
//! NVRTC (`libnvrtc.so`, `/usr/local/cuda/lib64`): without it registering an accumulator says
//! `no NVRTC:`.
//!
//! # Where it runs
//! Without a driver (CI) only the no-driver paths run. The conformance suite (in one process:
//! `tests/cuda_conformance.rs`; owner in a child process: `tests/cuda_process_conformance.rs`),
//! the kernel tests (`cuda::tests`) and `odc-bench transport --backends cuda` are built by
//! `benches/gpu/build.sh` and run on a GPU machine by `benches/gpu/run.sh` (their results:
//! `docs/transports.md`). Peer access between two devices (NVLink) needs a machine with two GPUs.

mod driver;
pub mod event;
mod kernels;
mod library;
mod mapping;
mod messages;
mod owned;
mod pool;
mod push;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::net::UnixStream;

use self::driver::Waited;
pub use self::driver::{device_count, Device, DeviceBuffer, DeviceLauncher, STAGING_BYTES};
pub use self::library::check_driver;
use self::mapping::{Mapping, Unreached};
use self::owned::{export, own_memory, DeviceSums, PublishedGuard};
pub use self::owned::{DeviceAccumulator, DevicePublished};
pub use self::pool::DeviceValues;
use crate::error::wide;
use crate::remote::{
    other_backend, serve_split, Backend, Located, Remote, RemoteConfig, Served, UnixDial,
};
use crate::shm::segment::{SegmentError, SegmentReader, SegmentWriter};
use crate::shm::{host_id, same_host_and_job, JobSocket, NEXT_SEGMENT};
use crate::wire::{ClusterSecret, Target};
use crate::{
    codec, AccumulatorRegion, CudaMemory, Deadline, Descriptor, Dest, Dtype, EndpointId, Op,
    PublishedRegion, RegionHandle, RegionKind, TransportError,
};
pub use odc_kernels::launch::{Arg, Launcher};
pub use odc_kernels::nvrtc::{Module, BLOCK};

/// How a [`CudaTransport`] names its files and which device it uses.
#[derive(Debug, Clone)]
pub struct CudaConfig {
    /// The CUDA device (this process's ordinal) that holds the regions this transport owns and
    /// receives the device reads it does.
    pub device: u32,
    /// The job's id (`[A-Za-z0-9_.-]{1,64}`): every process of the job uses the same.
    pub job: String,
    /// Where control segments and the socket live (`/dev/shm`).
    pub dir: PathBuf,
    /// Shared by every process of the job.
    pub secret: ClusterSecret,
    pub remote: RemoteConfig,
}

impl CudaConfig {
    /// Device `device`, job `job`, files in `/dev/shm`.
    pub fn new(device: u32, job: impl Into<String>, secret: ClusterSecret) -> Self {
        Self {
            device,
            job: job.into(),
            dir: PathBuf::from("/dev/shm"),
            secret,
            remote: RemoteConfig::default(),
        }
    }
}

/// The CUDA backend: the served core ([`Remote`]) with published regions in device memory that
/// readers copy through CUDA IPC. Create it inside a tokio runtime ([`CudaTransport::new`]).
pub type CudaTransport = Remote<Cuda>;

/// What is the cuda backend's own: its device, its files, the regions it has reached.
pub struct Cuda {
    device: Arc<Device>,
    host: String,
    job: String,
    dir: PathBuf,
    socket: JobSocket,
    /// Published regions this transport has reached, by control segment name.
    mappings: Mutex<HashMap<String, Arc<Mapping>>>,
    /// Exportable buffers of its accumulates and sends into other processes ([`push`]).
    push_staging: push::PushStaging,
    /// The values of device messages into this transport's inboxes ([`messages`]).
    messages: Arc<messages::DeviceMessages<DeviceValues>>,
    /// Device buffers for those values and for scratch ([`pool`]).
    buffers: Arc<pool::Pool<DeviceBuffer>>,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda")
            .field("device", &self.device.ordinal())
            .field("job", &self.job)
            .field("socket", &self.socket.path())
            .finish()
    }
}

/// A published region's device memory as its handle names it, and its owner's process.
pub struct Place {
    pid: u32,
    memory: CudaMemory,
}

impl Remote<Cuda> {
    /// Open device `config.device` (without a CUDA driver: `Unsupported`, `no CUDA driver: …`,
    /// before anything else happens), remove the job's stale files, listen on a fresh socket and
    /// serve this transport's accumulators and inboxes there.
    pub async fn new(config: CudaConfig) -> Result<Self, TransportError> {
        let device = Device::open(config.device)?;
        let (listener, socket) = JobSocket::listen(Cuda::NAME, &config.dir, &config.job)?;
        let cuda = Cuda {
            device,
            host: host_id(),
            job: config.job,
            dir: config.dir,
            socket,
            mappings: Mutex::new(HashMap::new()),
            push_staging: push::PushStaging::default(),
            messages: Arc::default(),
            buffers: Arc::default(),
        };
        let remote = Remote::start(
            listener,
            UnixDial,
            // One host: its Unix socket and the job's own files need no sealed frames.
            RemoteConfig {
                sealed_frames: false,
                ..config.remote
            },
            config.secret,
            cuda,
            serve_split::<UnixStream>,
        );
        let sources = push::IpcSources::new(
            Arc::clone(&remote.backend.device),
            Arc::clone(&remote.backend.messages),
            Arc::clone(&remote.backend.buffers),
        );
        // A fresh fabric: nothing set it before.
        let _ = remote.served.device_sources.set(Arc::new(sources));
        Ok(remote)
    }

    /// The device this transport owns regions on and reads into.
    pub fn device(&self) -> &Arc<Device> {
        &self.backend.device
    }

    /// The Unix socket this transport serves on.
    pub fn socket(&self) -> &Path {
        self.backend.socket.path()
    }
}

impl Cuda {
    fn descriptor_of(&self, served: &Served, memory: Option<CudaMemory>) -> Descriptor {
        Descriptor::Cuda {
            host: self.host.clone(),
            job: self.job.clone(),
            pid: std::process::id(),
            instance: served.instance,
            socket: self.socket.path().to_string_lossy().into_owned(),
            device: self.device.ordinal(),
            memory,
        }
    }

    /// The published region `memory` names, reached from this process (cached), if it is still
    /// the live region `located` names.
    fn mapping(
        &self,
        located: &Located<'_, Place>,
        place: &Place,
    ) -> Result<Arc<Mapping>, TransportError> {
        let (target, memory) = (&located.target, &place.memory);
        let unknown = TransportError::UnknownRegion {
            owner: target.owner,
            region: target.region,
        };
        let name = memory.segment.as_str();
        let cached = self.mappings.lock().get(name).cloned();
        if let Some(mapping) = cached {
            if mapping.segment.is_closed() {
                self.mappings.lock().remove(name);
                return Err(unknown);
            }
            if !mapping.is_for(memory) || !names(&mapping.segment, target) {
                return Err(unknown);
            }
            return Ok(mapping);
        }
        let reader = match SegmentReader::open(&self.dir, name, &self.job) {
            Ok(reader) => reader,
            Err(SegmentError::WrongJob { found, .. }) => {
                return Err(TransportError::ForeignHandle {
                    owner: target.owner,
                    region: target.region,
                    reason: format!("its control segment belongs to job {found:?}"),
                })
            }
            Err(_) => return Err(unknown),
        };
        if reader.is_closed() || !names(&reader, target) {
            return Err(unknown);
        }
        let reached = if place.pid == std::process::id() {
            match own_memory(target.instance, target.region) {
                Some(buffer) => Mapping::own(buffer, reader, memory),
                None => Err(Unreached::Unknown),
            }
        } else {
            Mapping::ipc(&self.device, reader, memory)
        };
        let mapping = match reached {
            Ok(mapping) => Arc::new(mapping),
            Err(Unreached::Unknown) => return Err(unknown),
            Err(Unreached::Driver(e)) => {
                return Err(TransportError::Unreachable {
                    owner: target.owner,
                    reason: format!(
                        "the device memory of region {} (process {}) cannot be opened: {e}",
                        target.region, place.pid
                    ),
                })
            }
        };
        self.device.reach_peer(mapping.ordinal)?;
        let mut mappings = self.mappings.lock();
        // Forget regions that were dropped meanwhile (closing their IPC mappings).
        mappings.retain(|_, m| !m.segment.is_closed());
        mappings.insert(name.to_owned(), Arc::clone(&mapping));
        Ok(mapping)
    }
}

/// Whether the control segment `segment` is the region `target` names (owner, instance, id).
fn names(segment: &SegmentReader, target: &Target) -> bool {
    segment.endpoint() == target.owner
        && segment.instance() == target.instance
        && segment.handle_id() == target.region
}

/// Owner-side APIs for values kept in device memory (a shard server on the GPU): regions whose
/// publications and takes stay on the device. Reach them from an `Arc<dyn Transport>` through
/// [`Transport::as_any`](crate::Transport::as_any) and a downcast to [`CudaTransport`].
impl Remote<Cuda> {
    /// Register a published region of `values.len() / 4` elements of `dtype` whose first
    /// publication (`version`) is `values` (fp32 in memory of this transport's device), encoded
    /// on the device; later ones come from [`DevicePublished::publish_from`]. Readers reach it as
    /// any published region of this backend (CUDA IPC, or directly in this process).
    pub fn register_device_published(
        &self,
        owner: EndpointId,
        dtype: Dtype,
        values: &DeviceBuffer,
        version: u64,
    ) -> Result<DevicePublished, TransportError> {
        let id = self.served.fabric.next_region_id();
        let len = codec::element_count(Dtype::F32, values.len()).map_err(|e| e.for_region(id))?;
        // The first publication is at `version` too: the seqlock's writer starts there and the
        // encode below rewrites the memory under it.
        let guard = self.backend.publish_region(
            &self.served,
            id,
            owner,
            dtype,
            len,
            version,
            |_| Ok(()),
        )?;
        guard.publish_device(version, values)?;
        Ok(DevicePublished { guard })
    }

    /// Add `src` (fp32 values in memory of this transport's device, complete: nothing still
    /// writes it) into the accumulator `handle` at element `offset`: a push straight from a
    /// trainer's device memory, no host staging. Into an accumulator of this process: the
    /// owner's kernel reads `src` itself. Into another process's on this host: `src` is copied
    /// device to device into an exportable buffer that the owner opens through CUDA IPC and adds
    /// from ([`push`]). Otherwise as [`Transport::accumulate`](crate::Transport::accumulate):
    /// the same range, admission (C8) and fencing checks (C2, C3) under the same lock, `Ok` once
    /// the owner's kernel finished. A source that is not memory of this device, or not whole
    /// fp32s, is refused before anything moves.
    pub async fn accumulate_device(
        &self,
        handle: &RegionHandle,
        offset: usize,
        src: crate::DeviceDest,
        tag: crate::WriteTag,
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        crate::check_deadline(deadline, handle.owner, handle.id, Op::Accumulate)?;
        let located = self.backend.locate(&self.served, handle)?;
        if located.memory.is_some() {
            return Err(TransportError::Unsupported {
                what: format!(
                    "cuda: an accumulate from device memory into region {} of owner {}, a \
                     published region",
                    handle.id, handle.owner
                ),
            });
        }
        if src.bytes % 4 != 0 {
            return Err(TransportError::BadDestination {
                region: handle.id,
                expected: src.bytes / 4 * 4,
                got: src.bytes,
            });
        }
        let device = &self.backend.device;
        device.check_dest(&src)?;
        let elements = usize::try_from(src.bytes / 4).unwrap_or(usize::MAX);
        if self.peers.local().owns(&located.target) {
            return self.peers.local().fabric.serve_accumulate_device(
                located.target.owner,
                located.target.region,
                offset,
                src.ptr,
                elements,
                tag,
            );
        }
        let on_deadline = || TransportError::DeadlineExceeded {
            owner: handle.owner,
            region: handle.id,
            op: Op::Accumulate,
        };
        let staged = self.stage(&[(src.ptr, elements * 4)], deadline, on_deadline)?;
        let source = staged.source(src.bytes);
        let done = crate::remote::ops::accumulate_device(
            &self.peers,
            located.addr,
            located.target,
            offset,
            tag,
            source,
            deadline,
        )
        .await;
        // Only an acknowledged buffer is reused: after a failure the owner may still read it.
        if done.is_ok() {
            self.backend.push_staging.give_back(staged);
        }
        done
    }

    /// Send a message into the inbox `handle` whose values lie in device memory: `values`
    /// (ranges of memory of this transport's device, complete: nothing still writes them, in
    /// order) are copied device to device into the owner's device memory and held there, then
    /// `header` (host bytes saying what the values are) is delivered under the inbox's fences
    /// (C7), as [`Transport::send`](crate::Transport::send) delivers a message; `Ok` once held.
    /// The receiver takes both with [`CudaTransport::recv_device`]. Into an inbox of this
    /// transport the values are copied directly; into another transport's on this host (another
    /// process, or this one) through an exportable staging buffer that the owner opens through
    /// CUDA IPC (`Request::SendDevice`). A range that is not memory of this device is refused
    /// before anything moves; a refused header drops its values (see [`messages`]).
    pub async fn send_device(
        &self,
        handle: &RegionHandle,
        tag: crate::WriteTag,
        header: Bytes,
        values: &[crate::DeviceDest],
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        crate::check_deadline(deadline, handle.owner, handle.id, Op::Send)?;
        let located = self.backend.locate(&self.served, handle)?;
        if located.memory.is_some() || handle.kind != RegionKind::Inbox {
            return Err(TransportError::WrongKind {
                region: handle.id,
                expected: RegionKind::Inbox,
                actual: handle.kind,
            });
        }
        let device = &self.backend.device;
        let mut srcs = Vec::with_capacity(values.len());
        for value in values {
            device.check_dest(value)?;
            srcs.push((
                value.ptr,
                usize::try_from(value.bytes).unwrap_or(usize::MAX),
            ));
        }
        let on_deadline = || TransportError::DeadlineExceeded {
            owner: handle.owner,
            region: handle.id,
            op: Op::Send,
        };
        let target = located.target;
        if self.peers.local().owns(&target) {
            let messages = &self.backend.messages;
            messages.check_free(target.region, &tag)?;
            let held = push::gathered(&self.backend.buffers, device, &srcs, deadline, on_deadline)?;
            messages.hold(target.region, &tag, held)?;
            let delivered =
                self.peers
                    .local()
                    .fabric
                    .serve_send(target.owner, target.region, tag, header);
            if delivered.is_err() {
                messages.forget(target.region, &tag);
            }
            return delivered;
        }
        let bytes: usize = srcs.iter().map(|&(_, n)| n).sum();
        let staged = self.stage(&srcs, deadline, on_deadline)?;
        let source = staged.source(wide(bytes));
        let done = crate::remote::ops::send_device(
            &self.peers,
            located.addr,
            target,
            tag,
            source,
            header,
            deadline,
        )
        .await;
        // As for a device accumulate: only an acknowledged buffer is reused.
        if done.is_ok() {
            self.backend.push_staging.give_back(staged);
        }
        done
    }

    /// The bytes at `srcs` (device addresses of this device and their lengths, in order) copied
    /// into an exportable staging buffer for an owner in another transport to open ([`push`]),
    /// waited for. The caller gives it back once the owner acknowledged.
    fn stage(
        &self,
        srcs: &[(u64, usize)],
        deadline: Deadline,
        on_deadline: impl FnOnce() -> TransportError,
    ) -> Result<push::Staged, TransportError> {
        let device = &self.backend.device;
        let bytes = srcs.iter().map(|&(_, n)| n).sum();
        let staged = self.backend.push_staging.take(device, bytes)?;
        let mut lane = device.lane()?;
        let mut at = 0u64;
        for &(src, n) in srcs {
            lane.copy(staged.ptr() + at, src, n)?;
            at += n as u64;
        }
        lane.finish(deadline).map_err(|w| match w {
            Waited::Deadline => on_deadline(),
            Waited::Failed(e) => e,
        })?;
        drop(lane);
        Ok(staged)
    }

    /// Receive message `tag` of `inbox` (an inbox this transport registered), as
    /// [`InboxRegion::recv`](crate::InboxRegion::recv) does: its header, and the values that
    /// came with it if it was sent by [`CudaTransport::send_device`] (in this transport's device
    /// memory; [`CudaTransport::copy_out`] moves them where the receiver wants them), or `None`
    /// for a message sent from host memory.
    pub async fn recv_device(
        &self,
        inbox: &dyn crate::InboxRegion,
        tag: crate::WriteTag,
        deadline: Deadline,
    ) -> Result<(Bytes, Option<DeviceValues>), TransportError> {
        let header = inbox.recv(tag, deadline).await?;
        let values = self.backend.messages.take(inbox.handle().id, &tag);
        Ok((header, values))
    }

    /// Copy `values` whole into `dests` (memory of this transport's device, in order, as many
    /// bytes in all, nothing else using it) and wait, at most until `deadline`. Destinations
    /// that do not add up to the values, or are not memory of this device, are refused before
    /// anything is copied.
    pub fn copy_out(
        &self,
        values: &DeviceValues,
        dests: &[crate::DeviceDest],
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        let device = &self.backend.device;
        let total = dests.iter().map(|d| d.bytes).sum::<u64>();
        if total != wide(values.len()) || !values.is_on(device) {
            return Err(TransportError::Unsupported {
                what: format!(
                    "cuda: copying {values:?} into {} destinations of {total} bytes on device {}",
                    dests.len(),
                    device.ordinal()
                ),
            });
        }
        for dest in dests {
            device.check_dest(dest)?;
        }
        let mut lane = device.lane()?;
        let mut at = 0;
        for dest in dests {
            let n = usize::try_from(dest.bytes).unwrap_or(usize::MAX);
            lane.copy(dest.ptr, values.ptr() + at, n)?;
            at += dest.bytes;
        }
        lane.finish(deadline)
            .map_err(|w| w.into_error("copying a device message out"))
    }

    /// `bytes` bytes of this transport's device memory for the caller's own use (contents
    /// whatever they were), from the buffers it reuses; back to them when dropped.
    pub fn scratch(&self, bytes: usize) -> Result<DeviceValues, TransportError> {
        DeviceValues::take(&self.backend.buffers, &self.backend.device, bytes)
    }

    /// Copy `src` into `dst` (memory of this transport's device, the same size, not
    /// overlapping, nothing else writing either) and wait, at most until `deadline`.
    pub fn copy_device(
        &self,
        src: crate::DeviceDest,
        dst: crate::DeviceDest,
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        self.device_pair(src, dst, 1, "copy")?;
        let mut lane = self.backend.device.lane()?;
        let bytes = usize::try_from(src.bytes).unwrap_or(usize::MAX);
        lane.copy(dst.ptr, src.ptr, bytes)?;
        lane.finish(deadline)
            .map_err(|w| w.into_error("a device copy"))
    }

    /// Add the fp32 values at `src` into those at `dst` (memory of this transport's device, the
    /// same size, whole fp32s; the accumulate kernel) and wait, at most until `deadline`.
    pub fn add_device(
        &self,
        src: crate::DeviceDest,
        dst: crate::DeviceDest,
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        self.device_pair(src, dst, 4, "add")?;
        let device = &self.backend.device;
        let kernels = device.kernels()?;
        let mut lane = device.lane()?;
        let n = usize::try_from(src.bytes / 4).unwrap_or(usize::MAX);
        kernels.enqueue(
            &lane.stream,
            kernels::Elementwise::AddF32,
            dst.ptr,
            src.ptr,
            n,
        )?;
        lane.finish(deadline)
            .map_err(|w| w.into_error("a device add"))
    }

    /// Refuse a `what` from `src` into `dst` unless both are memory of this device of the same
    /// size, a multiple of `unit` bytes.
    fn device_pair(
        &self,
        src: crate::DeviceDest,
        dst: crate::DeviceDest,
        unit: u64,
        what: &str,
    ) -> Result<(), TransportError> {
        if src.bytes != dst.bytes || src.bytes % unit != 0 {
            return Err(TransportError::Unsupported {
                what: format!(
                    "cuda: a device {what} of {} bytes into {} bytes (whole elements of {unit} \
                     bytes, the same size)",
                    src.bytes, dst.bytes
                ),
            });
        }
        let device = &self.backend.device;
        device.check_dest(&src)?;
        device.check_dest(&dst)
    }

    /// Register an accumulator of `len` fp32 elements at `epoch`, in memory of this transport's
    /// device, whose sums the owner can take into device memory
    /// ([`DeviceAccumulator::take_into`]). Writers reach it as any accumulator of this backend.
    pub fn register_device_accumulator(
        &self,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<DeviceAccumulator, TransportError> {
        self.backend
            .device_accumulator(&self.served, owner, len, epoch)
    }
}

impl Cuda {
    /// See [`CudaTransport::register_device_accumulator`].
    fn device_accumulator(
        &self,
        served: &Served,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<DeviceAccumulator, TransportError> {
        let sums = DeviceSums::new(&self.device, len)?;
        let guard = served.register_accumulator_in(owner, len, epoch, Box::new(sums))?;
        Ok(DeviceAccumulator {
            descriptor: self.descriptor_of(served, None),
            guard,
            device: Arc::clone(&self.device),
            len,
        })
    }

    /// A published region `id` of `len` elements of `dtype` in fresh device memory that `fill`
    /// writes first, exported for IPC, with its control segment at `version`, announced to
    /// same-process readers.
    #[allow(clippy::too_many_arguments)]
    fn publish_region(
        &self,
        served: &Served,
        id: crate::RegionId,
        owner: EndpointId,
        dtype: Dtype,
        len: usize,
        version: u64,
        fill: impl FnOnce(&DeviceBuffer) -> Result<(), TransportError>,
    ) -> Result<PublishedGuard, TransportError> {
        let bytes = len
            .checked_mul(dtype.size())
            .ok_or_else(|| TransportError::Unsupported {
                what: format!("cuda: a region of {len} elements does not fit in memory"),
            })?;
        let memory = Arc::new(self.device.alloc(bytes)?);
        fill(&memory)?;
        let (ipc_handle, offset) = export(&self.device, &memory)?;
        let writer = SegmentWriter::create_for(
            &self.dir,
            &self.job,
            owner,
            served.instance,
            id,
            NEXT_SEGMENT.fetch_add(1, Ordering::Relaxed),
            dtype.size(),
            0,
            8,
            &[],
            version,
        )
        .map_err(|e| TransportError::Unsupported {
            what: format!("cuda backend cannot create the control segment of region {id}: {e}"),
        })?;
        let handle = RegionHandle {
            owner,
            id,
            kind: RegionKind::Published,
            dtype,
            len: wide(len),
            version,
            descriptor: self.descriptor_of(
                served,
                Some(CudaMemory {
                    ipc_handle,
                    offset,
                    len_bytes: wide(bytes),
                    segment: writer.name().to_owned(),
                }),
            ),
        };
        let guard = PublishedGuard {
            device: Arc::clone(&self.device),
            memory,
            writer,
            handle,
            instance: served.instance,
        };
        guard.announce();
        Ok(guard)
    }
}

impl Backend for Cuda {
    /// A published region's device memory and its owner's process.
    type Memory = Place;

    const NAME: &'static str = "cuda";

    fn descriptor(&self, served: &Served) -> Descriptor {
        self.descriptor_of(served, None)
    }

    fn locate<'h>(
        &self,
        _: &Served,
        handle: &'h RegionHandle,
    ) -> Result<Located<'h, Place>, TransportError> {
        match &handle.descriptor {
            Descriptor::Cuda {
                host,
                job,
                pid,
                instance,
                socket,
                memory,
                ..
            } => {
                same_host_and_job(
                    handle,
                    (host, job),
                    (&self.host, &self.job),
                    "CUDA IPC does not cross hosts",
                )?;
                Ok(Located {
                    addr: socket,
                    memory: memory.as_ref().map(|memory| Place {
                        pid: *pid,
                        memory: memory.clone(),
                    }),
                    target: Target {
                        owner: handle.owner,
                        instance: *instance,
                        region: handle.id,
                    },
                })
            }
            _ => Err(other_backend(handle, "cuda", "regions of cuda owners")),
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
        let guard = self.publish_region(served, id, owner, dtype, len, version, |memory| {
            self.device.upload(memory, 0, &initial)
        })?;
        Ok(Box::new(guard))
    }

    /// In device memory: an accumulate is added there by the NVRTC kernel.
    fn register_accumulator(
        &self,
        served: &Served,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<Box<dyn AccumulatorRegion>, TransportError> {
        Ok(Box::new(
            self.device_accumulator(served, owner, len, epoch)?,
        ))
    }

    /// A one-sided read of a published region (C1; C4 order after the descriptor).
    async fn read_memory(
        &self,
        _: &Served,
        handle: &RegionHandle,
        located: &Located<'_, Place>,
        place: &Place,
        range: Range<usize>,
        into: Dest<'_>,
        deadline: Deadline,
    ) -> Result<u64, TransportError> {
        let mapping = self.mapping(located, place)?;
        let memory = &place.memory;
        let (owner, region, dtype) = (handle.owner, handle.id, handle.dtype);
        let size = dtype.size();
        let elements = usize::try_from(memory.len_bytes).unwrap_or(usize::MAX) / size;
        if handle.len != wide(elements) || memory.len_bytes % size as u64 != 0 {
            return Err(TransportError::UnknownRegion { owner, region });
        }
        if range.start > range.end || range.end > elements {
            return Err(TransportError::OutOfRange {
                region,
                start: wide(range.start),
                end: wide(range.end),
                len: wide(elements),
            });
        }
        let bytes = range.len() * size;
        let src = mapping.data + (range.start * size) as u64;
        let deadline_error = TransportError::DeadlineExceeded {
            owner,
            region,
            op: Op::Read,
        };
        let waited = |w: Waited| match w {
            Waited::Deadline => deadline_error.clone(),
            Waited::Failed(e) => e,
        };
        let mut into = into;
        match &mut into {
            Dest::Device(dest) => {
                if dest.bytes != wide(bytes) {
                    return Err(TransportError::BadDestination {
                        region,
                        expected: wide(bytes),
                        got: dest.bytes,
                    });
                }
                self.device.check_dest(dest)?;
            }
            other => other.spec().check_host(region, dtype, range.len())?,
        }
        let device = &self.device;
        let mut copy = || -> Result<(), TransportError> {
            if bytes == 0 {
                return Ok(());
            }
            let mut lane = device.lane()?;
            match &mut into {
                Dest::Device(dest) => {
                    lane.copy(dest.ptr, src, bytes)?;
                    lane.finish(deadline).map_err(waited)
                }
                Dest::Bytes(buf) => lane
                    .download(src, bytes, deadline, &mut |piece, at| {
                        buf[at..at + piece.len()].copy_from_slice(piece);
                        Ok(())
                    })
                    .map_err(waited),
                Dest::F32(out) => lane
                    .download(src, bytes, deadline, &mut |piece, at| {
                        let first = at / size;
                        let out =
                            out.get_mut(first..first + piece.len() / size)
                                .ok_or_else(|| TransportError::Unsupported {
                                    what: format!(
                                        "read of region {region}: a piece that does not fit"
                                    ),
                                })?;
                        codec::decode_into(dtype, piece, out).map_err(|e| e.for_region(region))
                    })
                    .map_err(waited),
            }
        };
        match mapping.segment.read_outside(deadline, &mut copy) {
            Ok(result) => result,
            Err(_) if !mapping.segment.owner_alive() => Err(TransportError::Unreachable {
                owner,
                reason: format!(
                    "the owner process of region {region} is gone (it died while publishing)"
                ),
            }),
            Err(_) => Err(deadline_error),
        }
    }

    /// An accumulate or a send aimed at a published region: `WrongKind` if it exists, after the
    /// handle checks.
    async fn wrong_kind(
        &self,
        _: &Served,
        _: &RegionHandle,
        located: &Located<'_, Place>,
        place: &Place,
        _: Op,
        expected: RegionKind,
        _: Deadline,
    ) -> TransportError {
        match self.mapping(located, place) {
            Ok(_) => TransportError::WrongKind {
                region: located.target.region,
                expected,
                actual: RegionKind::Published,
            },
            Err(e) => e,
        }
    }
}

#[cfg(test)]
mod tests;
