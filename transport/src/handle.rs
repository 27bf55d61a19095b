//! What a peer needs to address a region: identities, element types, kinds, the serializable
//! [`RegionHandle`] with its backend [`Descriptor`], and a write's [`WriteTag`] with the owner's
//! [`WriteGuard`]. Plain data: the bottom of the crate, importing nothing of it.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// A shard server's (or any region owner's) identity on the data plane.
pub type EndpointId = u32;
/// A region's identity, unique within its backend's namespace (for `local`: its fabric) and never
/// reused.
pub type RegionId = u64;

/// Element type of a region. Accumulators are always [`Dtype::F32`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }
}

/// What a region is for; operations check it ([`TransportError::WrongKind`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RegionKind {
    /// Parameters the owner publishes once per version; peers read them one-sidedly (C1).
    Published,
    /// fp32 gradient accumulator; peers add into it (C2, C3).
    Accumulator,
    /// Two-sided messages: peers send, the owner receives by tag (C7).
    Inbox,
}

/// Where and how a backend reaches a region. The one part of a [`RegionHandle`] that differs
/// between backends; a backend refuses a descriptor it cannot use with
/// [`TransportError::ForeignHandle`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Descriptor {
    /// A region of the [`local`](crate::local) backend: `fabric` (one per
    /// [`LocalTransport`](crate::local::LocalTransport)) in the OS process `process`.
    Local { process: u32, fabric: u64 },
    /// A region of the [`tcp`](crate::tcp) backend: served by the transport instance `instance`
    /// listening at `addr` (`host:port`).
    Tcp { addr: String, instance: u64 },
    /// A region of the [`shm`](crate::shm) backend on the host `host` (its boot id), job `job`:
    /// a published region is read one-sidedly from the shared-memory segment `segment`; accumulates
    /// and sends go to the owner instance `instance` over the Unix socket `socket`.
    Shm {
        host: String,
        job: String,
        instance: u64,
        socket: String,
        segment: Option<String>,
    },
    /// A region of the `rdma` backend (`odc_transport::rdma`, feature `rdma`; the variant itself
    /// always exists, so handles deserialize everywhere): served by the transport instance
    /// `instance`, whose control endpoint (accumulates, sends, queue-pair exchange) listens at
    /// `addr` (`host:port`), on the NIC port `gid`. A published region also has `memory`: where
    /// it lies in the owner's registered memory, read one-sidedly with RDMA READ.
    Rdma {
        addr: String,
        instance: u64,
        gid: String,
        memory: Option<RdmaMemory>,
    },
    /// A region of the `cuda` backend (`odc_transport::cuda`, feature `cuda`; the variant itself
    /// always exists, so handles deserialize everywhere): owned by the transport instance
    /// `instance` of the process `pid` on the host `host` (its boot id), job `job`, whose regions
    /// live on its CUDA device `device` (the owner's ordinal: informational, a reader locates the
    /// memory itself). Accumulates and sends go to the owner over the Unix socket `socket`. A
    /// published region also has `memory`: its device allocation, read one-sidedly through CUDA
    /// IPC.
    Cuda {
        host: String,
        job: String,
        pid: u32,
        instance: u64,
        socket: String,
        device: u32,
        memory: Option<CudaMemory>,
    },
}

/// Where a published region of the `cuda` backend lies in its owner's device memory: the CUDA IPC
/// handle of the allocation (`cuIpcGetMemHandle`, 64 bytes), the byte offset of the region's data
/// within that allocation, the data's length in bytes, and the name of the shared-memory control
/// segment that carries the region's identity, version and seqlock (`shm::segment`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CudaMemory {
    pub ipc_handle: Vec<u8>,
    pub offset: u64,
    pub len_bytes: u64,
    pub segment: String,
}

/// Where a published region of the `rdma` backend lies in its owner's registered memory: the
/// remote address and rkey of the memory region (header, seqlock words and data), its length in
/// bytes, and the seqlock chunk size the layout was built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RdmaMemory {
    pub remote_addr: u64,
    pub rkey: u32,
    pub len_bytes: u64,
    pub chunk_bytes: u64,
}

impl Descriptor {
    /// The backend that issued handles with this descriptor.
    pub fn backend(&self) -> &'static str {
        match self {
            Descriptor::Local { .. } => "local",
            Descriptor::Tcp { .. } => "tcp",
            Descriptor::Shm { .. } => "shm",
            Descriptor::Rdma { .. } => "rdma",
            Descriptor::Cuda { .. } => "cuda",
        }
    }
}

/// Everything a peer needs to address a region: plain data, cheap to clone, serializable (no
/// `usize`), sent in control messages. A handle received from another endpoint is all a reader
/// needs; whether it can use it depends on its backend and on [`RegionHandle::descriptor`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionHandle {
    pub owner: EndpointId,
    pub id: RegionId,
    pub kind: RegionKind,
    /// Element type. An inbox carries opaque bytes: its handle says [`Dtype::F32`], which means
    /// nothing there.
    pub dtype: Dtype,
    /// Length in elements (0 for an inbox).
    pub len: u64,
    /// When the handle was taken: the publication version of a published region, the epoch of
    /// an accumulator or an inbox. Informational: operations use the region's current state.
    pub version: u64,
    pub descriptor: Descriptor,
}

impl RegionHandle {
    /// [`RegionHandle::len`] as a `usize` (saturating on targets with a narrower `usize`).
    pub fn elements(&self) -> usize {
        usize::try_from(self.len).unwrap_or(usize::MAX)
    }
}

/// Identifies one write (accumulate or send) for fencing (contract C3, C7), and carries the
/// writer's proof that it may write (C8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WriteTag {
    /// Must equal the region's current epoch.
    pub epoch: u64,
    /// Unique per write within an epoch; a repeat is refused.
    pub write_id: u128,
    /// Opaque to the transport: an accumulator whose owner installed a [`WriteGuard`]
    /// ([`AccumulatorRegion::admit_only`]) applies a write only if the guard admits its tag (the
    /// runtime puts its assignment token here). Inboxes ignore it: a message is received by its
    /// epoch and write id alone.
    pub token: u128,
}

/// The owner's admission rule for writes into an accumulator (C8): called with the tag of every
/// accumulate that passed the shape checks, before the region is touched; `false` refuses the
/// write with [`TransportError::RefusedWrite`]. It must be cheap and must not block (it runs on
/// the owner's serving path); it sees the tag only, never the payload.
pub type WriteGuard = Arc<dyn Fn(&WriteTag) -> bool + Send + Sync>;
