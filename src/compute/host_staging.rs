//! Proof of residence: the parameter and gradient bytes a trainer on a GPU moved through host
//! memory, counted where they cross (the pinned staging of `staging`: a unit's upload, a
//! gradient's download; the sampler's weights read through the host, [`super::sampler`]), and
//! a gang's K/V sent or received through host memory by a member on a GPU
//! ([`super::gang_link`]). A
//! one-process job on one GPU whose transfers stay on the device
//! ([`DeviceTransfers::Device`](super::DeviceTransfers)) counts 0; the metric is
//! [`HOST_STAGING_BYTES`], by direction (`up`, `down`). A trainer on the CPU stages nothing: its
//! values live in host memory.

use std::sync::atomic::{AtomicU64, Ordering};

/// The Prometheus counter of the bytes (label `direction`: `up` to the device, `down` from it).
pub const HOST_STAGING_BYTES: &str = "odc_host_staging_bytes_total";

static STAGED: AtomicU64 = AtomicU64::new(0);

/// Bytes of parameters, gradients and gang messages that crossed host memory from or to a GPU in
/// this process so far.
pub fn host_staging_bytes() -> u64 {
    STAGED.load(Ordering::Relaxed)
}

/// `bytes` crossed host memory towards (`up`) or from (`down`) a device.
pub(crate) fn staged(direction: &'static str, bytes: u64) {
    STAGED.fetch_add(bytes, Ordering::Relaxed);
    metrics::counter!(HOST_STAGING_BYTES, "direction" => direction).increment(bytes);
}
