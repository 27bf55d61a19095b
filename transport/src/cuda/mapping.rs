//! The reader's side: a published region's memory as this process reaches it — an IPC mapping of
//! another process's allocation (opened once per allocation and process, shared by every
//! transport of the process, closed when the last user goes), or the memory itself for a region
//! of this process — together with its control segment.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::driver::{allocation_of, Device, DeviceBuffer};
use super::library::failed;
use crate::shm::segment::SegmentReader;
use crate::{CudaMemory, TransportError};

/// Every IPC mapping of this process, by IPC handle: CUDA lets a process open an exported
/// allocation once, so transports of one process share the mapping.
static OPEN: Mutex<Option<HashMap<Vec<u8>, Weak<IpcMapping>>>> = Mutex::new(None);

/// Another process's allocation mapped into this one (`cuIpcOpenMemHandle`), closed on drop.
pub(super) struct IpcMapping {
    /// The device whose context opened it (closed with it current).
    device: Arc<Device>,
    base: sys::CUdeviceptr,
    size: usize,
    /// Where the memory lives, as this process numbers devices.
    ordinal: u32,
}

impl IpcMapping {
    /// The mapped allocation: its address in this process and its size in bytes.
    pub(super) fn range(&self) -> (sys::CUdeviceptr, usize) {
        (self.base, self.size)
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // Copies out of the mapping are waited for (under the lane) before their read returns, or
        // drained by the next use of the lane: drain now, then unmap.
        match self.device.lane() {
            Ok(mut lane) => {
                let _ = lane.finish_owner("closing an IPC mapping");
                // SAFETY: `base` came from cuIpcOpenMemHandle in this process and is closed once;
                // no copy from it is in flight (drained above).
                if let Err(e) = unsafe { sys::cuIpcCloseMemHandle(self.base) }.result() {
                    tracing::warn!("odc cuda: cuIpcCloseMemHandle failed: {e}");
                }
            }
            Err(e) => tracing::warn!("odc cuda: cannot close an IPC mapping: {e}"),
        }
    }
}

/// Open (or find open) the allocation `handle` names, from `device`'s context, and make it
/// readable from `device` (peer access where it lives on another device). Errors are the
/// driver's, for the caller to name.
pub(super) fn open_ipc(
    device: &Arc<Device>,
    handle: &[u8],
) -> Result<Arc<IpcMapping>, TransportError> {
    let mut open = OPEN.lock();
    let table = open.get_or_insert_with(HashMap::new);
    if let Some(mapping) = table.get(handle).and_then(Weak::upgrade) {
        device.reach_peer(mapping.ordinal)?;
        return Ok(mapping);
    }
    let mut raw = sys::CUipcMemHandle_st { reserved: [0; 64] };
    for (dst, &src) in raw.reserved.iter_mut().zip(handle) {
        *dst = src as std::ffi::c_char;
    }
    device.bind()?;
    let mut base: sys::CUdeviceptr = 0;
    // SAFETY: the handle is 64 bytes of plain data (checked by the caller); a handle that names
    // no live allocation is an error from the driver, not a fault. Lazy peer access lets a
    // mapping of another device's memory be used from this context.
    unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut base,
            raw,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    }
    .result()
    .map_err(|e| failed("cuIpcOpenMemHandle", e))?;
    let mut ordinal: i32 = -1;
    // SAFETY: a query about the address just mapped.
    let queried = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast::<std::ffi::c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            base,
        )
    };
    let size = allocation_of(base).map(|(_, size)| size);
    let mapping = Arc::new(IpcMapping {
        device: Arc::clone(device),
        base,
        size: size.as_ref().copied().unwrap_or(0),
        ordinal: u32::try_from(ordinal).unwrap_or(device.ordinal()),
    });
    queried
        .result()
        .map_err(|e| failed("cuPointerGetAttribute of an IPC mapping", e))?;
    size?;
    device.reach_peer(mapping.ordinal)?;
    table.retain(|_, m| m.strong_count() > 0);
    table.insert(handle.to_vec(), Arc::downgrade(&mapping));
    Ok(mapping)
}

/// A published region as a reader reaches it: its control segment (identity, liveness, version,
/// seqlock) and the device address of its data in this process.
pub(super) struct Mapping {
    pub(super) segment: SegmentReader,
    /// The device address of the region's first byte.
    pub(super) data: sys::CUdeviceptr,
    /// The device the memory lives on (this process's ordinal).
    pub(super) ordinal: u32,
    /// What the handle said, to tell a handle that names other memory through the same segment.
    memory: CudaMemory,
    /// What keeps the memory reachable while this mapping lives: another process's allocation
    /// mapped here, or this process's own buffer.
    _ipc: Option<Arc<IpcMapping>>,
    _own: Option<Arc<DeviceBuffer>>,
}

/// Why a region's memory could not be reached.
pub(super) enum Unreached {
    /// The handle names no live region (as the contract says `UnknownRegion`).
    Unknown,
    /// The driver refused (the owner died, or a device problem): the reason.
    Driver(TransportError),
}

impl Mapping {
    /// Whether this mapping is for exactly `memory`.
    pub(super) fn is_for(&self, memory: &CudaMemory) -> bool {
        self.memory == *memory
    }

    /// Reach another process's region: its IPC handle opened (or found open), the handle's
    /// offset and length checked against the allocation.
    pub(super) fn ipc(
        device: &Arc<Device>,
        segment: SegmentReader,
        memory: &CudaMemory,
    ) -> Result<Self, Unreached> {
        if memory.ipc_handle.len() != 64 {
            return Err(Unreached::Unknown);
        }
        let mapping = open_ipc(device, &memory.ipc_handle).map_err(Unreached::Driver)?;
        let fits = memory
            .offset
            .checked_add(memory.len_bytes)
            .is_some_and(|end| end <= mapping.size as u64);
        if !fits {
            return Err(Unreached::Unknown);
        }
        Ok(Self {
            segment,
            data: mapping.base + memory.offset,
            ordinal: mapping.ordinal,
            memory: memory.clone(),
            _ipc: Some(mapping),
            _own: None,
        })
    }

    /// Reach a region of this process: its memory itself.
    pub(super) fn own(
        buffer: Arc<DeviceBuffer>,
        segment: SegmentReader,
        memory: &CudaMemory,
    ) -> Result<Self, Unreached> {
        if memory.len_bytes != buffer.len() as u64 {
            return Err(Unreached::Unknown);
        }
        Ok(Self {
            segment,
            data: buffer.ptr(),
            ordinal: buffer.dest().device,
            memory: memory.clone(),
            _ipc: None,
            _own: Some(buffer),
        })
    }
}
