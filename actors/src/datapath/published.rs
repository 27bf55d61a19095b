//! The servers' published copies read from outside the trainers: what RL's sampler decodes with.
//! verl and TRL hand the trainer's weights to their generation engine each step; odc's sampler
//! reads them where the trainers do, from the published copies, at the step's version.
//!
//! [`Published`] is where every shard's published copy is and the version they hold (the
//! supervisor's answer between steps, [`crate::supervisor::messages::SupervisorMsg::Published`]). A unit is
//! read as a trainer's gather reads it ([`super::on_demand`]): every shard at once, one-sided,
//! each chunk checked against the version (**I1**: one of another version fails the read with
//! [`crate::Error::VersionMismatch`], so a sampler never mixes two steps' weights), decoded into
//! host `f32`s or, with the `cuda` backend, copied device to device in the published dtype.
//!
//! Nothing here is counted for I5 (no trainer's buffers) or pushed: the reader only reads.

use std::ops::Range;
use std::sync::Arc;

use odc_transport::{Deadline, Transport};
use serde::{Deserialize, Serialize};

use super::transfer::{self, Out};
use crate::directory::{Directory, ShardRoute};
use crate::error::Result;
use crate::layout::UnitId;
#[cfg(feature = "cuda-code")]
use crate::memory::UnitValues;

/// Where the published copies are and their version (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Published {
    /// The version every published chunk holds: the optimizer steps applied.
    pub version: u64,
    #[serde(with = "crate::trainer::messages::shared_directory")]
    pub directory: Arc<Directory>,
}

impl Published {
    /// Unit `unit`'s elements, decoded to `f32`, at [`Published::version`]; returns them and the
    /// bytes moved.
    pub async fn read_host(
        &self,
        transport: &dyn Transport,
        unit: UnitId,
        deadline: Deadline,
    ) -> Result<(Vec<f32>, u64)> {
        let (_, len) = self.unit(unit)?;
        let mut values = vec![0.0; len];
        let bytes = self
            .read_into(transport, unit, Out::F32(&mut values), deadline)
            .await?;
        Ok((values, bytes))
    }

    /// Unit `unit` in device memory from `memory`, in the published dtype, one device-to-device
    /// read per shard (the `cuda` backend; any other transport cannot reach device memory and
    /// the read fails saying so).
    #[cfg(feature = "cuda-code")]
    pub async fn read_device(
        &self,
        transport: &dyn Transport,
        unit: UnitId,
        memory: &dyn crate::memory::DeviceMemory,
        deadline: Deadline,
    ) -> Result<(UnitValues, u64)> {
        if transport
            .as_any()
            .and_then(|t| t.downcast_ref::<odc_transport::cuda::CudaTransport>())
            .is_none()
        {
            return Err(crate::Error::Config(format!(
                "unit {unit}: the job's {} transport cannot read into device memory",
                transport.backend()
            )));
        }
        let (routes, len) = self.unit(unit)?;
        let dtype = transfer::published_dtype(routes, unit)?;
        let buffer = memory.allocate(len, dtype).await?;
        let bytes = self
            .read_into(transport, unit, Out::Device(buffer.dest()), deadline)
            .await?;
        Ok((UnitValues::Device { buffer, dtype }, bytes))
    }

    /// Unit `unit`'s routes and its length.
    fn unit(&self, unit: UnitId) -> Result<(&[ShardRoute], usize)> {
        let routes = self.directory.routes(unit)?;
        Ok((
            routes,
            routes.iter().map(|r| r.range().end).max().unwrap_or(0),
        ))
    }

    /// The whole of unit `unit` at [`Published::version`] into `out`; the bytes moved.
    async fn read_into(
        &self,
        transport: &dyn Transport,
        unit: UnitId,
        out: Out<'_>,
        deadline: Deadline,
    ) -> Result<u64> {
        let (routes, len) = self.unit(unit)?;
        let version = self.version;
        transfer::pull(
            transport,
            routes,
            unit,
            0..len,
            version,
            len.max(1),
            out,
            deadline,
        )
        .await
    }
}

/// Units `units`' host values from `published`, all read at once; the values in unit order and
/// the bytes moved.
pub async fn read_host(
    published: &Published,
    transport: &dyn Transport,
    units: Range<UnitId>,
    deadline: Deadline,
) -> Result<(Vec<Vec<f32>>, u64)> {
    each_unit(units, |u| published.read_host(transport, u, deadline)).await
}

/// Units `units` in device memory from `memory` (see [`Published::read_device`]), all read at
/// once; the values in unit order and the bytes moved.
#[cfg(feature = "cuda-code")]
pub async fn read_device(
    published: &Published,
    transport: &dyn Transport,
    units: Range<UnitId>,
    memory: &dyn crate::memory::DeviceMemory,
    deadline: Deadline,
) -> Result<(Vec<UnitValues>, u64)> {
    each_unit(units, |u| {
        published.read_device(transport, u, memory, deadline)
    })
    .await
}

/// `read` of every unit of `units` at once: the values in unit order and the bytes moved in all.
async fn each_unit<T, F>(units: Range<UnitId>, read: impl Fn(UnitId) -> F) -> Result<(Vec<T>, u64)>
where
    F: std::future::Future<Output = Result<(T, u64)>>,
{
    let mut values = Vec::with_capacity(units.len());
    let mut bytes = 0;
    for result in futures::future::join_all(units.map(read)).await {
        let (unit, moved) = result?;
        values.push(unit);
        bytes += moved;
    }
    Ok((values, bytes))
}
