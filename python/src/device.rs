//! Where this rank's trainer computes, as `odc.init(device=…)` names it: `"cpu"` (the default:
//! gathers are host buffers, pushes host tensors) or `"cuda"` / `"cuda:N"`, the GPU path
//! (`crate::gpu`): shard servers on the device over odc's `cuda` transport,
//! gathers in device memory, pushes from it, with no byte through host memory.
//!
//! - **One device per rank, the transport's.** Under a launcher the `cuda` transport takes device
//!   `local_rank mod count` (as `odc launch --transport cuda` does); `"cuda"` means that device,
//!   and a `"cuda:N"` naming another is refused, naming both. Alone, `"cuda"` is device 0.
//! - **No driver, a clear error**: a machine without one gives the transport's `no CUDA driver:
//!   …` error when `"cuda"` is asked for, before any driver call; `"cpu"` never loads it.

use std::sync::Arc;

use odc::launch::World;
use odc::transport::Dtype;
use odc::{DeviceGrad, DeviceMemory, DeviceUnit};
use pyo3::prelude::*;

use crate::errors;

/// What `device=` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    Host,
    /// A CUDA device: its ordinal if named.
    Cuda(Option<u32>),
}

/// The place `text` names (`"cpu"`, `"cuda"`, `"cuda:N"`).
pub(crate) fn place(text: &str) -> PyResult<Place> {
    let bad = || {
        errors::invalid(format!(
            "device {text:?}: expected \"cpu\", \"cuda\" or \"cuda:N\""
        ))
    };
    match text {
        "cpu" => Ok(Place::Host),
        "cuda" => Ok(Place::Cuda(None)),
        _ => {
            let ordinal = text.strip_prefix("cuda:").ok_or_else(bad)?;
            Ok(Place::Cuda(Some(ordinal.parse().map_err(|_| bad())?)))
        }
    }
}

/// The device this rank's transport takes among `count`, checked against the one asked for.
pub(crate) fn ordinal(asked: Option<u32>, world: &World, count: u32) -> odc::Result<u32> {
    if world.world_size <= 1 {
        return Ok(asked.unwrap_or(0));
    }
    let local = odc::launch::local_device(count);
    match asked {
        Some(n) if n != local => Err(odc::Error::Config(format!(
            "device cuda:{n}: under a launcher this rank's cuda transport is on cuda:{local} \
             (local rank mod {count} devices): ask for \"cuda\" or \"cuda:{local}\""
        ))),
        _ => Ok(local),
    }
}

/// Under a launcher, the world's transport for the GPU path: `cuda`, unless another was asked
/// for (`ODC_TRANSPORT`), which is refused naming it.
pub(crate) fn use_cuda_transport(world: &mut World) -> PyResult<()> {
    if world.world_size <= 1 {
        return Ok(());
    }
    match world.transport.as_deref() {
        None | Some("cuda") => {
            world.transport = Some("cuda".into());
            Ok(())
        }
        Some(other) => Err(errors::invalid(format!(
            "device \"cuda\" with ODC_TRANSPORT={other}: the GPU path moves parameters and \
             gradients over the cuda transport (unset ODC_TRANSPORT or set it to cuda)"
        ))),
    }
}

/// The GPU path of one runtime: its device and the gradients whose pushes are in flight.
pub(crate) struct OnDevice {
    gpu: Arc<crate::gpu::Gpu>,
    holding: crate::gpu::Holding,
}

impl OnDevice {
    /// Device `asked` (see the module docs) for a process of `world`.
    pub(crate) fn open(asked: Option<u32>, world: &World) -> odc::Result<Arc<OnDevice>> {
        // The driver checked first: without one, the "no CUDA driver" error.
        let count = odc::transport::cuda::device_count()?;
        let gpu = crate::gpu::Gpu::open(ordinal(asked, world, count)?)?;
        Ok(Arc::new(OnDevice {
            gpu,
            holding: Default::default(),
        }))
    }

    pub(crate) fn ordinal(&self) -> u32 {
        self.gpu.ordinal()
    }

    /// Where the trainer's gathers land.
    pub(crate) fn memory(&self) -> Arc<dyn DeviceMemory> {
        Arc::new(crate::gpu::Memory(Arc::clone(&self.gpu)))
    }

    /// `tensor` (a CUDA gradient of `len` fp32 elements) as a push from device memory.
    pub(crate) fn grad(
        &self,
        tensor: &Bound<'_, PyAny>,
        len: usize,
        what: &str,
    ) -> PyResult<Arc<dyn DeviceGrad>> {
        self.holding.sweep(tensor.py());
        crate::gpu::grad(&self.gpu, &self.holding, tensor, len, what)
    }

    /// A gathered unit in device memory, for `torch.from_dlpack`.
    pub(crate) fn buffer(
        &self,
        py: Python<'_>,
        buffer: Arc<dyn DeviceUnit>,
        dtype: Dtype,
    ) -> PyResult<Py<PyAny>> {
        let buffer = crate::gpu::DeviceBuffer::new(&self.gpu, buffer, dtype);
        Ok(Py::new(py, buffer)?.into_any())
    }

    /// Frees the pushed gradients whose pushes are over: how many are still held.
    pub(crate) fn sweep(&self, py: Python<'_>) -> usize {
        self.holding.sweep(py)
    }
}
