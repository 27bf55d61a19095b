//! Accumulates from device memory into another process's accumulator, device to device over
//! CUDA IPC (`CudaTransport::accumulate_device` when the owner is not this process).
//!
//! - **Writer** ([`PushStaging`]): the source (a trainer's tensor, in memory CUDA IPC cannot
//!   export: cudarc's stream-ordered pool) is copied device to device into an exportable
//!   staging buffer (`cuMemAlloc`, its IPC handle taken once), whose handle, offset and length
//!   travel in a `Request::AccumulateDevice` over the owner's socket. A buffer goes back to the
//!   pool only once the owner acknowledged (its kernel finished reading it); after a failed or
//!   timed-out request it is dropped, never reused while the owner might still read it.
//! - **Owner** ([`IpcSources`]): opens the writer's allocation once (`cuIpcOpenMemHandle`, kept
//!   open while the transport lives, so a writer's pool is mapped once), checks the range lies in
//!   it, and runs the fenced device add of the shared owner core (C2, C3, C8 as every
//!   accumulate). A writer in the owner's own process (another transport instance there, which
//!   CUDA IPC cannot serve) is found in this process's table of exported buffers instead.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::driver::{Device, DeviceBuffer};
use super::mapping::{open_ipc, IpcMapping};
use super::messages::DeviceMessages;
use super::owned::export;
use super::pool::{Capacity, DeviceValues, Pool};
use crate::remote::DeviceSources;
use crate::wire::{IpcSource, IPC_HANDLE_BYTES};
use crate::{RegionId, TransportError, WriteTag};

/// IPC handle → (allocation base, size).
type Exported = HashMap<[u8; IPC_HANDLE_BYTES], (u64, usize)>;

/// This process's exported staging buffers.
static EXPORTED: Mutex<Option<Exported>> = Mutex::new(None);

/// One exportable buffer and its IPC handle.
pub(super) struct Staged {
    buffer: DeviceBuffer,
    handle: [u8; IPC_HANDLE_BYTES],
    offset: u64,
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let Some(table) = EXPORTED.lock().as_mut() {
            table.remove(&self.handle);
        }
    }
}

impl Staged {
    /// The buffer's device address.
    pub(super) fn ptr(&self) -> u64 {
        self.buffer.ptr()
    }

    /// The first `bytes` of the buffer as the owner opens them.
    pub(super) fn source(&self, bytes: u64) -> IpcSource {
        IpcSource {
            ipc_handle: self.handle,
            offset: self.offset,
            bytes,
        }
    }
}

impl Capacity for Staged {
    fn capacity(&self) -> usize {
        self.buffer.len()
    }
}

/// A writer's pool of exportable staging buffers (see the [module docs](self)).
#[derive(Default)]
pub(super) struct PushStaging {
    pool: Pool<Staged>,
}

impl PushStaging {
    /// A buffer of at least `bytes` bytes on `device`: a free one of the pool, else a new one
    /// ([`super::pool`]'s size classes), exported.
    pub(super) fn take(
        &self,
        device: &Arc<Device>,
        bytes: usize,
    ) -> Result<Staged, TransportError> {
        self.pool.take(bytes, |size| {
            let buffer = device.alloc(size)?;
            let (handle, offset) = export(device, &buffer)?;
            let handle: [u8; IPC_HANDLE_BYTES] =
                handle
                    .try_into()
                    .map_err(|h: Vec<u8>| TransportError::Unsupported {
                        what: format!("cuda: an IPC handle of {} bytes", h.len()),
                    })?;
            EXPORTED.lock().get_or_insert_with(HashMap::new).insert(
                handle,
                (buffer.ptr() - offset, offset as usize + buffer.len()),
            );
            Ok(Staged {
                buffer,
                handle,
                offset,
            })
        })
    }

    /// `staged` back to the pool (its owner acknowledged: nothing reads it any more).
    pub(super) fn give_back(&self, staged: Staged) {
        self.pool.give_back(staged);
    }
}

/// An owner's view of its writers' staging buffers (see the [module docs](self)).
pub(super) struct IpcSources {
    device: Arc<Device>,
    open: Mutex<HashMap<[u8; IPC_HANDLE_BYTES], Arc<IpcMapping>>>,
    /// The values of device messages into this owner's inboxes, until their receivers take them.
    messages: Arc<DeviceMessages<DeviceValues>>,
    /// Where those values are copied.
    buffers: Arc<Pool<DeviceBuffer>>,
}

impl IpcSources {
    pub(super) fn new(
        device: Arc<Device>,
        messages: Arc<DeviceMessages<DeviceValues>>,
        buffers: Arc<Pool<DeviceBuffer>>,
    ) -> Self {
        IpcSources {
            device,
            open: Mutex::new(HashMap::new()),
            messages,
            buffers,
        }
    }
}

/// The bytes at `srcs` (device addresses of this context and their lengths, in order) copied
/// into a buffer of `buffers` on `device`, waited for.
pub(super) fn gathered(
    buffers: &Arc<Pool<DeviceBuffer>>,
    device: &Arc<Device>,
    srcs: &[(u64, usize)],
    deadline: crate::Deadline,
    on_deadline: impl FnOnce() -> TransportError,
) -> Result<DeviceValues, TransportError> {
    let bytes = srcs.iter().map(|&(_, n)| n).sum();
    let values = DeviceValues::take(buffers, device, bytes)?;
    let mut lane = device.lane()?;
    let mut at = 0u64;
    for &(src, n) in srcs {
        lane.copy(values.ptr() + at, src, n)?;
        at += n as u64;
    }
    lane.finish(deadline).map_err(|w| match w {
        super::driver::Waited::Deadline => on_deadline(),
        super::driver::Waited::Failed(e) => e,
    })?;
    drop(lane);
    Ok(values)
}

impl DeviceSources for IpcSources {
    fn open(
        &self,
        source: &IpcSource,
    ) -> Result<(u64, Arc<dyn Any + Send + Sync>), TransportError> {
        let own = EXPORTED
            .lock()
            .as_ref()
            .and_then(|table| table.get(&source.ipc_handle).copied());
        if let Some((base, size)) = own {
            // The writer's buffer stays alive until this add is acknowledged.
            return within(base, size, source).map(|ptr| (ptr, Arc::new(()) as Arc<_>));
        }
        let cached = self.open.lock().get(&source.ipc_handle).cloned();
        let mapping = match cached {
            Some(mapping) => mapping,
            None => {
                let mapping = open_ipc(&self.device, &source.ipc_handle)?;
                self.open.lock().insert(source.ipc_handle, mapping.clone());
                mapping
            }
        };
        let (base, size) = mapping.range();
        within(base, size, source).map(|ptr| (ptr, mapping as Arc<_>))
    }

    fn hold(
        &self,
        region: RegionId,
        tag: &WriteTag,
        source: &IpcSource,
    ) -> Result<(), TransportError> {
        self.messages.check_free(region, tag)?;
        let (ptr, _mapped) = self.open(source)?;
        let bytes = usize::try_from(source.bytes).unwrap_or(usize::MAX);
        let deadline = crate::deadline_in(super::driver::OWNER_WAIT);
        let values = gathered(
            &self.buffers,
            &self.device,
            &[(ptr, bytes)],
            deadline,
            || TransportError::Unsupported {
                what: format!(
                    "cuda: copying a device message of {bytes} bytes into inbox {region} did \
                     not finish within {} s",
                    super::driver::OWNER_WAIT.as_secs()
                ),
            },
        )?;
        self.messages.hold(region, tag, values)
    }

    fn forget(&self, region: RegionId, tag: &WriteTag) {
        self.messages.forget(region, tag);
    }
}

/// The address of `source` in an allocation of `size` bytes at `base`, if it lies inside.
fn within(base: u64, size: usize, source: &IpcSource) -> Result<u64, TransportError> {
    let fits = source
        .offset
        .checked_add(source.bytes)
        .is_some_and(|end| end <= size as u64);
    if !fits {
        return Err(TransportError::Unsupported {
            what: format!(
                "cuda: an accumulate source of {} bytes at offset {} of an allocation of {size} \
                 bytes",
                source.bytes, source.offset
            ),
        });
    }
    Ok(base + source.offset)
}
