//! The model on odc's runtime: the one place where [`crate::model`] (a leaf crate that knows no
//! trainer, server or transport) meets trainers, shard servers and transports.
//!
//! - [`transformer`]: [`TransformerCompute`], the [`Compute`](crate::Compute) that runs one packed
//!   micro-batch stage by stage against a trainer's context (gathers, forward, backward, pushes);
//! - [`job`]: the [`JobBuilder`](crate::JobBuilder)s of the model (its units and a compute per
//!   trainer);
//! - [`gang_link`]: a gang's exchange over the trainers' transport ([`TransportLink`], the
//!   model's [`GangLink`](crate::model::gang::GangLink) over the runtime's `GangChannel`);
//! - `staging` (feature `cuda`): a trainer's pinned host staging on a CUDA device, and
//!   `resident` (feature `cuda`): its device memory as the data path's gather buffers and push
//!   sources; [`host_staging`] counts what still crossed host memory;
//! - [`sampler`]: the sampler's weights, read from the servers' published copies.

pub mod gang_link;
pub mod host_staging;
pub mod job;
#[cfg(feature = "cuda")]
pub mod resident;
pub mod sampler;
#[cfg(feature = "cuda")]
pub mod staging;
pub mod transformer;

pub use gang_link::TransportLink;
pub use host_staging::{host_staging_bytes, HOST_STAGING_BYTES};
pub use job::{
    served_reference, transformer_job, transformer_job_of, transformer_job_on, MICRO_BATCH_MIN_FILL,
};
pub use sampler::published_weights;
pub use transformer::{DeviceTransfers, Objective, Placement, SampleStore, TransformerCompute};
