//! The on-demand data path (odc): point to point with the shard servers.
//!
//! - A gather reads every chunk of every shard of the unit from its owner's published copy,
//!   one-sided (the owner's actor is not involved), all owners at once in one batch, decoding
//!   straight into the unit buffer; every chunk must carry the step's version (**I1**,
//!   [`Error::VersionMismatch`]).
//! - A push encodes the gradient once, straight from the caller's slice, into fp32 chunks tagged
//!   with the attempt's epoch and a write id unique per (micro-batch, unit, shard, chunk), so
//!   owners refuse late and duplicate writes (**I2**, transport C3), and with the micro-batch's
//!   assignment token, without which owners refuse the write (transport C8); it resolves when every
//!   owner acknowledged. The same pass checks every element is finite: a gradient with a NaN or
//!   ±inf is refused and nothing of it is sent.
//! - **Device memory** (feature `cuda-code`, the job's transport the `cuda` backend): a gather
//!   can land in the trainer's device memory (one device-to-device read per shard, in the
//!   published dtype, the version checked per shard) and a push can come from it (each shard's
//!   slice added by the owner's kernel, over CUDA IPC for another process's owner, once the
//!   gradient is ready), with the same tags and fences ([`crate::memory::device`]).
//! - Nothing here waits on another trainer (**I4**).

use std::sync::Arc;

use odc_transport::{codec, Transport, WriteTag};

use super::transfer::{self, Out};
use super::{DataPath, Gathered, NonFiniteElement, Op, Transfer};
use crate::directory::Directory;
use crate::error::{Error, Result};
use crate::memory::buffers::Lease;
use crate::memory::UnitValues;
use crate::metrics::TransferMetrics;

/// See the [module docs](self).
pub struct OnDemand {
    transport: Arc<dyn Transport>,
    directory: Arc<Directory>,
    chunk_elems: usize,
    metrics: TransferMetrics,
}

impl OnDemand {
    pub fn new(
        transport: Arc<dyn Transport>,
        directory: Arc<Directory>,
        chunk_elems: usize,
    ) -> Self {
        let metrics = TransferMetrics::new(transport.backend());
        OnDemand {
            transport,
            directory,
            chunk_elems: chunk_elems.max(1),
            metrics,
        }
    }
}

impl DataPath for OnDemand {
    fn begin(&self, _epoch: u64) {}

    fn gather(&self, op: Op, mut buffer: Arc<[f32]>, lease: Lease) -> Transfer<Gathered> {
        let (transport, directory) = (self.transport.clone(), self.directory.clone());
        let (chunk_elems, metrics) = (self.chunk_elems, self.metrics.clone());
        Box::pin(async move {
            let unit = op.key.unit;
            let routes = directory.routes(unit)?;
            // tokio's clock: virtual under a paused runtime, like the deadlines.
            let started = tokio::time::Instant::now();
            let out = unique(&mut buffer, unit)?;
            let len = out.len();
            let bytes = transfer::pull(
                transport.as_ref(),
                routes,
                unit,
                0..len,
                op.version,
                chunk_elems,
                Out::F32(out),
                op.deadline,
            )
            .await?;
            metrics.pulled(bytes, started.elapsed());
            Ok(Gathered {
                values: UnitValues::Host(buffer),
                bytes,
                lease,
            })
        })
    }

    #[cfg(feature = "cuda-code")]
    fn device_gathers(&self) -> bool {
        super::cuda_backend(&self.transport).is_some()
    }

    /// One buffer from `memory`, then every shard read into it device to device, one read per
    /// shard (the version checked per shard, I1).
    #[cfg(feature = "cuda-code")]
    fn gather_device(
        &self,
        op: Op,
        len: usize,
        memory: Arc<dyn crate::memory::DeviceMemory>,
        lease: Lease,
    ) -> Transfer<Gathered> {
        let (transport, directory) = (self.transport.clone(), self.directory.clone());
        let metrics = self.metrics.clone();
        Box::pin(async move {
            let unit = op.key.unit;
            let routes = directory.routes(unit)?;
            let dtype = transfer::published_dtype(routes, unit)?;
            let started = tokio::time::Instant::now();
            let buffer = memory.allocate(len, dtype).await?;
            let bytes = transfer::pull(
                transport.as_ref(),
                routes,
                unit,
                0..len,
                op.version,
                len.max(1),
                Out::Device(buffer.dest()),
                op.deadline,
            )
            .await?;
            metrics.pulled(bytes, started.elapsed());
            Ok(Gathered {
                values: UnitValues::Device { buffer, dtype },
                bytes,
                lease,
            })
        })
    }

    /// Every owner the `cuda` backend reaches (this process's, or another's on this host over
    /// CUDA IPC) takes a push from device memory.
    #[cfg(feature = "cuda-code")]
    fn device_pushes(&self) -> bool {
        super::cuda_backend(&self.transport).is_some()
    }

    /// Each shard's slice of `grad` added into its accumulator by the owner's kernel, once
    /// `grad` is ready.
    #[cfg(feature = "cuda-code")]
    fn push_device(&self, op: Op, grad: Arc<dyn crate::memory::DeviceGrad>) -> Transfer<u64> {
        let (transport, directory) = (self.transport.clone(), self.directory.clone());
        let metrics = self.metrics.clone();
        Box::pin(async move {
            let unit = op.key.unit;
            let routes = directory.routes(unit)?;
            transfer::check_pushable(routes, unit)?;
            grad.ready().await?;
            let cuda = super::cuda_backend(&transport)
                .ok_or_else(|| Error::Internal("a device push without the cuda backend".into()))?;
            let src = grad.src();
            let len = usize::try_from(src.bytes / 4).unwrap_or(usize::MAX);
            let bytes = transfer::push_device(cuda, routes, &op, 0..len, src).await?;
            metrics.pushed(bytes);
            Ok(bytes)
        })
    }

    fn push(&self, op: Op, grad: &[f32]) -> std::result::Result<Transfer<u64>, NonFiniteElement> {
        let unit = op.key.unit;
        let routes = match self
            .directory
            .routes(unit)
            .and_then(|routes| transfer::check_pushable(routes, unit).map(|()| routes))
        {
            Ok(routes) => routes,
            Err(e) => return Ok(Box::pin(std::future::ready(Err(e)))),
        };
        let tag = |shard, chunk| WriteTag {
            epoch: op.key.epoch,
            write_id: transfer::write_id(op.micro_batch, unit, shard, chunk),
            token: op.token,
        };
        // Encoded here, straight from the caller's gradient: the only copy of its bytes, and
        // the pass that checks it is finite.
        let writes = transfer::encode_writes(
            routes,
            0..grad.len(),
            grad,
            tag,
            self.chunk_elems,
            codec::encode_f32_finite,
        )
        .map_err(|(start, e)| NonFiniteElement {
            index: start + e.index,
            value: e.value,
        })?;
        let (transport, metrics) = (self.transport.clone(), self.metrics.clone());
        Ok(Box::pin(async move {
            let bytes =
                transfer::send_writes(transport.as_ref(), unit, writes, op.deadline).await?;
            metrics.pushed(bytes);
            Ok(bytes)
        }))
    }
}

/// The unit buffer as a mutable slice: the context hands every data path a fresh, unshared buffer.
pub(crate) fn unique(buffer: &mut Arc<[f32]>, unit: u32) -> Result<&mut [f32]> {
    Arc::get_mut(buffer).ok_or_else(|| {
        Error::Internal(format!(
            "the buffer for unit {unit} is shared before it was filled"
        ))
    })
}
