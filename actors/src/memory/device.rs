//! A trainer's device memory as its transfers see it: what a compute on a GPU hands its
//! [`TrainerContext`](crate::trainer::TrainerContext) so that a gather lands in device memory and a
//! gradient leaves from it, without a host copy (the device-resident data path).
//!
//! The traits are plain: this crate never touches a device itself. The compute implements them
//! over its own device (candle's stream); the data path hands their addresses to a transport that
//! reaches that device (odc-transport's `cuda` backend).
//!
//! Invariants an implementation keeps:
//! - **A buffer handed out is free.** [`DeviceMemory::allocate`] resolves only once nothing on
//!   the device still uses the memory (the compute's stream passed the point it was allocated
//!   at), so a transport may write it at once from its own stream.
//! - **A gradient is read only once computed.** [`DeviceGrad::ready`] resolves once the device
//!   finished writing it; its memory stays alive as long as the value does.
//! - Host bytes never stand in for device ones: a data path that cannot reach device memory says
//!   so ([`crate::datapath::DataPath::device_gathers`], `device_pushes`), and the compute keeps
//!   the host path for it.

use std::any::Any;
use std::sync::Arc;

use odc_transport::{DeviceDest, Dtype};

use super::Transfer;

/// Device memory a gather wrote, owned by the compute's device (its value is the buffer).
pub trait DeviceUnit: Send + Sync + 'static {
    /// The whole buffer.
    fn dest(&self) -> DeviceDest;
    /// The implementation, for the compute that made it.
    fn as_any(&self) -> &dyn Any;
}

/// Where a trainer's device gathers get their buffers (see the [module docs](self)).
pub trait DeviceMemory: Send + Sync + 'static {
    /// `elements` elements of `dtype`, free for a transport to write (see the module docs).
    fn allocate(&self, elements: usize, dtype: Dtype) -> Transfer<Arc<dyn DeviceUnit>>;
}

/// A unit's gradient in device memory: fp32, the whole unit.
pub trait DeviceGrad: Send + Sync + 'static {
    /// The values: `4 ×` the unit's length in bytes.
    fn src(&self) -> DeviceDest;
    /// Resolves once the device finished computing them.
    fn ready(&self) -> Transfer<()>;
}

/// A gathered unit's values: host `f32`s, or a device buffer of the published dtype.
#[derive(Clone)]
pub enum UnitValues {
    Host(Arc<[f32]>),
    Device {
        buffer: Arc<dyn DeviceUnit>,
        dtype: Dtype,
    },
}

impl UnitValues {
    /// The host values, if that is where they are.
    pub fn as_host(&self) -> Option<&Arc<[f32]>> {
        match self {
            UnitValues::Host(values) => Some(values),
            UnitValues::Device { .. } => None,
        }
    }
}

impl std::fmt::Debug for UnitValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UnitValues::Host(values) => write!(f, "UnitValues::Host({} values)", values.len()),
            UnitValues::Device { buffer, dtype } => {
                write!(f, "UnitValues::Device({:?}, {dtype:?})", buffer.dest())
            }
        }
    }
}
