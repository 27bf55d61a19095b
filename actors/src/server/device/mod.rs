//! Shard servers on the GPU (feature `cuda`): when a server's node transport is odc-transport's
//! `cuda` backend, each of its shards lives in that transport's device memory — fp32 master
//! weights, the optimizer's buffers (AdamW's `exp_avg`, `exp_avg_sq`; SGD's momentum), the kept
//! gradient, the accumulator trainers push into and the published copy they pull — and the barrier
//! runs as NVRTC kernels (odc-kernels' `optimizer.cu`) on the device's one stream. A server
//! owns one device: its transport's.
//!
//! Guarantees (the same protocol as the host store, [`super::shard`]):
//! - **The optimizer's math is the host's.** A step is planned by
//!   [`optimizer::plan_step`](super::optimizer::plan_step) (the same checks, errors and per-step
//!   scalars as [`OptimizerState::step`](super::optimizer::OptimizerState::step)); the kernels write the host loops' fp32 operations in the
//!   same order, compiled without fused multiply-adds, so each element's update is bitwise the
//!   host's for the same inputs. The sum of squares that `Reduce` returns is the same sum in
//!   another order (f64 per thread, a tree per block, the blocks in order): it differs from the
//!   host's by reassociation only, and so may the clip factor the supervisor derives from it.
//! - **Non-finite gradients are seen.** A NaN or infinity in an accumulator makes the server's sum
//!   of squares NaN or infinite, which the barrier refuses (`policy::step`): nothing is applied,
//!   the supervisor discards the attempt.
//! - **I1.** The published copy is written only by `Apply`, by a kernel encoding the master weights
//!   straight into the published region (bf16: the host codec's rounding, bit for bit) under the
//!   transport's seqlock ([`DevicePublished::publish_from`](odc_transport::cuda::DevicePublished::publish_from)).
//! - **I2.** `Reduce` and `Discard` take the accumulator into the kept-gradient buffer with the
//!   transport's fenced take ([`DeviceAccumulator::take_into`](odc_transport::cuda::DeviceAccumulator::take_into), C3): the buffers are exchanged under
//!   the accumulate lock and the accumulator restarts from zero at the next epoch.
//! - **Read-out.** `Snapshot` publishes fp32 copies of the master weights and optimizer buffers as
//!   device regions (device to device) that any reader reaches over the data plane; the step count
//!   travels in the reply.
//! - **Frozen units** keep only their master weights and published copy on the device (no
//!   accumulator, gradient or optimizer buffers, no kernels compiled for them); `Apply`
//!   publishes the unchanged master weights as the new version.
//! - Every device wait is bounded (odc-transport's owner waits, 60 s), and a device failure is an
//!   error of the call, never a panic.
//!
//! The kernels' safe interface (lengths checked before a launch) is
//! [`super::optimizer_kernels`], written once for this device and the CPU's emulation.

use odc_transport::cuda::CudaTransport;

use crate::node::Node;

mod shard;
#[cfg(test)]
mod tests;

pub(super) use shard::DeviceShard;

/// The node's transport as the `cuda` backend, if it is one: its servers keep their shards on its
/// device.
pub(super) fn cuda_transport(node: &Node) -> Option<&CudaTransport> {
    node.transport
        .as_any()
        .and_then(|any| any.downcast_ref::<CudaTransport>())
}
