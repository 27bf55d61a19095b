//! The owner's side: published regions in device memory (with their control segment and IPC
//! export) and accumulator values in device memory (a [`Sums`] under the shared owner core).

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use bytes::Bytes;
use cudarc::driver::sys;
use parking_lot::Mutex;

use super::driver::{allocation_of, failed, Device, DeviceBuffer, OWNER_WAIT, STAGING_BYTES};
use crate::codec;
use crate::error::wide;
use crate::local::accumulator::Sums;
use crate::shm::segment::SegmentWriter;
use crate::{Dtype, PublishedRegion, RegionHandle, RegionId, TransportError};

/// The published regions of every `cuda` transport of this process, by (instance, region id): a
/// reader in the same process reads their memory directly (CUDA IPC cannot open a handle in the
/// process that exported it).
static OWN: Mutex<Option<OwnTable>> = Mutex::new(None);

/// (transport instance, region id) → the region's memory.
type OwnTable = HashMap<(u64, RegionId), Weak<DeviceBuffer>>;

/// The memory of a published region of this process, if it is still registered.
pub(super) fn own_memory(instance: u64, region: RegionId) -> Option<Arc<DeviceBuffer>> {
    OWN.lock()
        .as_ref()
        .and_then(|own| own.get(&(instance, region)))
        .and_then(Weak::upgrade)
}

/// The IPC export of `buffer`: the allocation's 64-byte handle and the buffer's byte offset in it
/// (`cuMemGetAddressRange` base + offset, so a buffer inside a larger allocation works too).
pub(super) fn export(
    device: &Device,
    buffer: &DeviceBuffer,
) -> Result<(Vec<u8>, u64), TransportError> {
    device.bind()?;
    let (base, _) = allocation_of(buffer.ptr())?;
    let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
    // SAFETY: `base` is the start of a live cuMemAlloc allocation of this context (not pool
    // memory, which cuIpcGetMemHandle refuses); the handle is plain data written by the driver.
    unsafe { sys::cuIpcGetMemHandle(&mut handle, base) }
        .result()
        .map_err(|e| failed("cuIpcGetMemHandle", e))?;
    let bytes = handle.reserved.iter().map(|&c| c as u8).collect();
    Ok((bytes, buffer.ptr() - base))
}

/// The owner's guard of a published region: its device memory and its control segment. Dropping
/// it closes the segment (readers learn the region is gone), forgets it for same-process readers
/// and frees the memory once no same-process reader holds it (readers in other processes hold
/// their IPC mapping).
pub(super) struct PublishedGuard {
    /// Dropped first (fields drop in order): the segment says "closed" before the memory goes.
    pub(super) writer: SegmentWriter,
    pub(super) memory: Arc<DeviceBuffer>,
    pub(super) device: Arc<Device>,
    pub(super) handle: RegionHandle,
    pub(super) instance: u64,
}

impl PublishedGuard {
    /// Record `memory` for same-process readers.
    pub(super) fn announce(&self) {
        OWN.lock().get_or_insert_with(HashMap::new).insert(
            (self.instance, self.handle.id),
            Arc::downgrade(&self.memory),
        );
    }
}

impl Drop for PublishedGuard {
    fn drop(&mut self) {
        if let Some(own) = OWN.lock().as_mut() {
            own.remove(&(self.instance, self.handle.id));
            own.retain(|_, memory| memory.strong_count() > 0);
        }
    }
}

impl PublishedRegion for PublishedGuard {
    fn handle(&self) -> RegionHandle {
        RegionHandle {
            version: self.writer.version(),
            ..self.handle.clone()
        }
    }

    /// Host-side bytes (already encoded in the region's dtype: the bf16 copy is encoded by the
    /// caller, as for every backend) copied into device memory through pinned staging, inside
    /// the control segment's seqlock (C1).
    fn publish(&self, version: u64, data: Bytes) -> Result<(), TransportError> {
        let region = self.handle.id;
        let elements = codec::element_count(self.handle.dtype, data.len())
            .map_err(|e| e.for_region(region))?;
        if wide(elements) != self.handle.len {
            return Err(TransportError::LengthMismatch {
                region,
                elements: wide(elements),
                len: self.handle.len,
            });
        }
        self.writer.publish_outside(version, || {
            self.device
                .lane()?
                .upload(self.memory.ptr(), &data, crate::deadline_in(OWNER_WAIT))
                .map_err(|w| w.into_error(&format!("publish of region {region}")))
        })
    }

    fn version(&self) -> u64 {
        self.writer.version()
    }
}

/// The fp32 values of an accumulator in device memory. A payload is staged to the device
/// (pinned staging, then the device scratch buffer) and added by the `odc_add_f32` kernel; a take
/// copies the values back through the staging and zeroes them.
#[derive(Debug)]
pub(super) struct DeviceSums {
    device: Arc<Device>,
    values: DeviceBuffer,
    len: usize,
}

impl DeviceSums {
    /// `len` zeroed values on `device`; the kernels are compiled now, so a machine without NVRTC
    /// fails here, at registration, not at the first accumulate.
    pub(super) fn new(device: &Arc<Device>, len: usize) -> Result<Self, TransportError> {
        device.kernels()?;
        let bytes = len
            .checked_mul(4)
            .ok_or_else(|| TransportError::Unsupported {
                what: format!("cuda: an accumulator of {len} elements does not fit in memory"),
            })?;
        Ok(Self {
            device: Arc::clone(device),
            values: device.alloc(bytes)?,
            len,
        })
    }

    fn try_take(&mut self) -> Result<Vec<f32>, TransportError> {
        let mut values = vec![0.0f32; self.len];
        let mut lane = self.device.lane()?;
        lane.download(
            self.values.ptr(),
            self.len * 4,
            crate::deadline_in(OWNER_WAIT),
            &mut |piece, at| {
                let first = at / 4;
                let out = values
                    .get_mut(first..first + piece.len() / 4)
                    .ok_or_else(|| TransportError::Unsupported {
                        what: "cuda: take: a piece that does not fit".into(),
                    })?;
                codec::decode_into(Dtype::F32, piece, out).map_err(|e| e.for_region(0))
            },
        )
        .map_err(|w| w.into_error("take of an accumulator"))?;
        lane.zero(self.values.ptr(), self.len * 4)?;
        lane.finish_owner("zeroing an accumulator")?;
        Ok(values)
    }
}

impl Sums for DeviceSums {
    fn add(&mut self, offset: usize, data: &[u8]) -> Result<(), TransportError> {
        let kernels = self.device.kernels()?;
        let mut lane = self.device.lane()?;
        let scratch = lane.scratch()?;
        for (i, piece) in data.chunks(STAGING_BYTES).enumerate() {
            let at = self.values.ptr() + ((offset * 4 + i * STAGING_BYTES) as u64);
            lane.upload(scratch, piece, crate::deadline_in(OWNER_WAIT))
                .map_err(|w| w.into_error("staging an accumulate"))?;
            kernels.add_f32(&lane.stream, at, scratch, piece.len() / 4)?;
            lane.finish_owner("accumulate kernel")?;
        }
        Ok(())
    }

    /// A device failure here cannot be returned (the trait's `take` is infallible): it is logged
    /// and the values come back as NaN, which the step's non-finite check refuses, so a lost
    /// accumulation never reaches the parameters silently.
    fn take(&mut self) -> Vec<f32> {
        self.try_take().unwrap_or_else(|e| {
            tracing::error!(
                "odc cuda: taking an accumulator of {} elements failed: {e}; returning NaN",
                self.len
            );
            vec![f32::NAN; self.len]
        })
    }
}
