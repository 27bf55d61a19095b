//! The owner's side: published regions in device memory (with their control segment and IPC
//! export) and accumulator values in device memory (a [`Sums`] under the shared owner core), and
//! the device-side owner APIs of both ([`DevicePublished`], [`DeviceAccumulator`]) for an owner
//! whose values are in device memory too (a shard server on the GPU).

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use bytes::Bytes;
use cudarc::driver::sys;
use parking_lot::Mutex;

use super::driver::{allocation_of, Device, DeviceBuffer, OWNER_WAIT, STAGING_BYTES};
use super::kernels::Elementwise;
use super::library::failed;
use crate::codec;
use crate::local::accumulator::Sums;
use crate::local::AccumulatorGuard;
use crate::shm::segment::SegmentWriter;
use crate::{
    AccumulatorRegion, Descriptor, Dtype, PublishedRegion, RegionHandle, RegionId, TransportError,
    WriteGuard,
};

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

impl PublishedGuard {
    /// Publish `values` (fp32 in device memory, one per element of the region) as `version`:
    /// encoded on the device into the region's memory (fp32: a device copy; bf16: the
    /// `odc_encode_bf16` kernel, the host codec's rounding bit for bit), inside the control
    /// segment's seqlock (C1). Nothing crosses to the host.
    pub(super) fn publish_device(
        &self,
        version: u64,
        values: &DeviceBuffer,
    ) -> Result<(), TransportError> {
        let region = self.handle.id;
        let len = usize::try_from(self.handle.len).unwrap_or(usize::MAX);
        if !values.is_on(&self.device) || values.len() != len.saturating_mul(4) {
            return Err(TransportError::Unsupported {
                what: format!(
                    "cuda: publish of region {region} ({len} elements) from {values:?}: the \
                     values must be {len} fp32 elements in memory of device {}",
                    self.device.ordinal()
                ),
            });
        }
        let kernels = match self.handle.dtype {
            Dtype::F32 => None,
            Dtype::Bf16 => Some(self.device.kernels()?),
        };
        self.writer.publish_outside(version, || {
            let mut lane = self.device.lane()?;
            match kernels {
                None => lane.copy(self.memory.ptr(), values.ptr(), values.len())?,
                Some(kernels) => kernels.enqueue(
                    &lane.stream,
                    Elementwise::EncodeBf16,
                    self.memory.ptr(),
                    values.ptr(),
                    len,
                )?,
            }
            lane.finish_owner(&format!("publish of region {region} from device memory"))
        })
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
        let len = usize::try_from(self.handle.len).unwrap_or(usize::MAX);
        codec::check_exact(self.handle.dtype, &data, len).map_err(|e| e.for_region(region))?;
        self.writer.publish_outside(version, || {
            self.device
                .lane()?
                .upload(self.memory.ptr(), &data, crate::deadline_in(OWNER_WAIT))
                .map_err(|w| w.into_error(&format!("publish of region {region}")))
        })
    }

    /// The device memory as it is, as `version`: only the control segment's seqlock and version.
    fn republish(&self, version: u64) -> Result<(), TransportError> {
        self.writer.publish_outside(version, || Ok(()))
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
    /// A device failure left the values unknown: every later add is refused and every take is
    /// NaN (an error for [`DeviceSums::exchange`]), so no step uses them.
    broken: Option<String>,
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
            broken: None,
        })
    }

    fn check_intact(&self) -> Result<(), TransportError> {
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(TransportError::Unsupported {
                what: format!(
                    "cuda: the accumulator's values were lost to a device failure: {why}"
                ),
            }),
        }
    }

    /// Exchange the values with `into` (as many fp32 elements, memory of the same device) and
    /// zero the buffer that now holds the values: afterwards `into` holds the sums and the
    /// accumulator starts from zero, with no copy of the sums. A device failure while zeroing
    /// leaves the region broken (said once here, then by every add and take).
    pub(super) fn exchange(&mut self, into: &mut DeviceBuffer) -> Result<(), TransportError> {
        self.check_intact()?;
        if !into.is_on(&self.device) || into.len() != self.values.len() {
            return Err(TransportError::Unsupported {
                what: format!(
                    "cuda: take of an accumulator of {} elements into {into:?}: it must be as \
                     many fp32 elements in memory of device {}",
                    self.len,
                    self.device.ordinal()
                ),
            });
        }
        std::mem::swap(&mut self.values, into);
        let zeroed = self.device.zero(&self.values);
        if let Err(e) = &zeroed {
            self.broken = Some(e.to_string());
        }
        zeroed
    }

    fn try_take(&mut self) -> Result<Vec<f32>, TransportError> {
        self.check_intact()?;
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
        self.check_intact()?;
        let kernels = self.device.kernels()?;
        let mut lane = self.device.lane()?;
        let scratch = lane.scratch()?;
        for (i, piece) in data.chunks(STAGING_BYTES).enumerate() {
            let at = self.values.ptr() + ((offset * 4 + i * STAGING_BYTES) as u64);
            lane.upload(scratch, piece, crate::deadline_in(OWNER_WAIT))
                .map_err(|w| w.into_error("staging an accumulate"))?;
            kernels.enqueue(
                &lane.stream,
                Elementwise::AddF32,
                at,
                scratch,
                piece.len() / 4,
            )?;
            lane.finish_owner("accumulate kernel")?;
        }
        Ok(())
    }

    fn add_device(
        &mut self,
        offset: usize,
        src: u64,
        elements: usize,
    ) -> Result<(), TransportError> {
        self.check_intact()?;
        let kernels = self.device.kernels()?;
        let mut lane = self.device.lane()?;
        let at = self.values.ptr() + (offset * 4) as u64;
        kernels.enqueue(&lane.stream, Elementwise::AddF32, at, src, elements)?;
        lane.finish_owner("accumulate kernel (device source)")
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

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// A published region in device memory whose owner keeps the values in device memory too:
/// besides the host-side [`PublishedRegion::publish`], [`DevicePublished::publish_from`] encodes
/// fp32 values of the owner's device straight into the region (fp32 copied, bf16 by a kernel),
/// under the same seqlock and version protocol. Get one from
/// [`CudaTransport::register_device_published`](super::CudaTransport::register_device_published).
pub struct DevicePublished {
    pub(super) guard: PublishedGuard,
}

impl std::fmt::Debug for DevicePublished {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePublished")
            .field("region", &self.guard.handle.id)
            .field("dtype", &self.guard.handle.dtype)
            .field("len", &self.guard.handle.len)
            .finish()
    }
}

impl DevicePublished {
    /// Publish `values` (fp32, one per element, memory of this transport's device) as `version`:
    /// encoded on the device in the region's dtype (bf16: round to nearest even, bit for bit
    /// [`codec::encode`]); readers see the old or the new publication whole (C1). Values of the
    /// wrong length or of another device are refused before anything changes.
    pub fn publish_from(&self, version: u64, values: &DeviceBuffer) -> Result<(), TransportError> {
        self.guard.publish_device(version, values)
    }
}

impl PublishedRegion for DevicePublished {
    fn handle(&self) -> RegionHandle {
        self.guard.handle()
    }

    fn publish(&self, version: u64, data: Bytes) -> Result<(), TransportError> {
        self.guard.publish(version, data)
    }

    fn republish(&self, version: u64) -> Result<(), TransportError> {
        self.guard.republish(version)
    }

    fn version(&self) -> u64 {
        self.guard.version()
    }
}

/// An accumulator whose values are in device memory, for an owner that keeps its gradient in
/// device memory too: besides [`AccumulatorRegion::take`] (the sums copied to the host),
/// [`DeviceAccumulator::take_into`] hands the sums over in device memory. Fencing, deduplication
/// and admission are the shared owner core's, as for every accumulator of the backend. Get one
/// from [`CudaTransport::register_device_accumulator`](super::CudaTransport::register_device_accumulator).
pub struct DeviceAccumulator {
    pub(super) descriptor: Descriptor,
    pub(super) guard: AccumulatorGuard,
    pub(super) device: Arc<Device>,
    pub(super) len: usize,
}

impl std::fmt::Debug for DeviceAccumulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceAccumulator")
            .field("handle", &self.handle())
            .finish()
    }
}

impl DeviceAccumulator {
    /// Take the sums into `into` (fp32, as many elements as the region, memory of this
    /// transport's device) and move to `next_epoch` — atomically with respect to accumulates, as
    /// [`AccumulatorRegion::take`] (C3): the sums and `into`'s buffer are exchanged under the
    /// accumulate lock and the accumulator's new buffer is zeroed there, so nothing is copied.
    /// A buffer of the wrong size or device is refused before anything changes; a device failure
    /// is an error and leaves the region refusing every later accumulate.
    pub fn take_into(
        &self,
        next_epoch: u64,
        into: &mut DeviceBuffer,
    ) -> Result<(), TransportError> {
        if !into.is_on(&self.device) || into.len() != self.len.saturating_mul(4) {
            return Err(TransportError::Unsupported {
                what: format!(
                    "cuda: take of accumulator {} ({} elements) into {into:?}: it must be as \
                     many fp32 elements in memory of device {}",
                    self.guard.handle().id,
                    self.len,
                    self.device.ordinal()
                ),
            });
        }
        self.guard.take_with(next_epoch, |sums| {
            match sums.as_any_mut().downcast_mut::<DeviceSums>() {
                Some(device) => device.exchange(into),
                None => Err(TransportError::Unsupported {
                    what: "cuda: an accumulator whose values are not in device memory".into(),
                }),
            }
        })
    }
}

impl AccumulatorRegion for DeviceAccumulator {
    fn handle(&self) -> RegionHandle {
        RegionHandle {
            descriptor: self.descriptor.clone(),
            ..self.guard.handle()
        }
    }

    fn take(&self, next_epoch: u64) -> Vec<f32> {
        self.guard.take(next_epoch)
    }

    fn take_applied(&self, next_epoch: u64) -> Result<crate::Applied, TransportError> {
        self.guard.take_applied(next_epoch)
    }

    fn progress(&self) -> Option<tokio::sync::watch::Receiver<crate::Progress>> {
        self.guard.progress()
    }

    fn epoch(&self) -> u64 {
        self.guard.epoch()
    }

    fn admit_only(&self, guard: WriteGuard) -> Result<(), TransportError> {
        self.guard.admit_only(guard)
    }
}
