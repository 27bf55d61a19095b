//! The sampler's weights: the policy as the shard servers publish it, read at the step's version
//! where the sampler decodes (RL's generation, held-out evaluation). verl and TRL hand the
//! trainer's weights to their generation engine each step; here the sampler reads them as a
//! trainer gathers them ([`Job::published_units`]).
//!
//! The policy is the job's first units; a reference the job serves
//! ([`UnitSpec::served`](odc_actors::layout::UnitSpec::served)) follows them, read the same way.
//!
//! Guarantees:
//! - **On policy**: the weights are the published copies of the job's current version, every
//!   chunk checked against it (I1), in the published dtype: what the trainers compute with
//!   (under bf16 pulls the masters rounded to bf16), cast for `precision` as a trainer casts
//!   (matrices in its dtype, vectors in fp32).
//! - **No host round trip on a GPU** where the job's transport reaches device memory (a
//!   one-process job whose servers are on the GPU, or `odc launch --transport cuda`): one
//!   device-to-device read per shard into the sampler's device, each unit one buffer whose
//!   parameters are views of it. Otherwise the values come through host memory (on the CPU each
//!   unit's values become its tensor without a copy), and on a GPU those bytes are counted in
//!   [`super::host_staging`] (`up`).

use candle_core::{Device, Tensor};

use crate::model::device::ComputePrecision;
use crate::model::generate::Weights;
use crate::model::{unit_count, ModelConfig};
use crate::Job;
use odc_actors::layout::UnitId;

fn user(e: impl std::fmt::Display) -> crate::Error {
    crate::Error::User {
        message: format!("the sampler's weights: {e}"),
    }
}

/// The model of `config` whose units are `job`'s from `first` on (0: the policy; a served
/// reference after it), at the job's current version, on `device` in `precision` (see the
/// [module docs](self)). Between steps only (`crate::Error::Step(StepError::Busy)` during one).
pub async fn published_weights(
    job: &mut Job,
    config: &ModelConfig,
    first: usize,
    device: &Device,
    precision: ComputePrecision,
) -> crate::Result<Weights> {
    let units = first as UnitId..(first + unit_count(config)) as UnitId;
    #[cfg(feature = "cuda")]
    if device.is_cuda() && job.reads_device_memory().await? {
        let memory = super::resident::Memory::new(device).map_err(user)?;
        let units = job.published_units_into(units, &memory).await?;
        let flat = units
            .iter()
            .map(|u| super::resident::flat_tensor(u).cloned())
            .collect::<crate::model::Result<Vec<_>>>()
            .map_err(user)?;
        let weights = Weights::from_flat(config, &flat).map_err(user)?;
        return weights.in_precision(precision).map_err(user);
    }
    let units = job.published_units(units).await?;
    if !device.is_cpu() {
        let bytes: usize = units.iter().map(|u| u.len() * 4).sum();
        super::host_staging::staged("up", bytes as u64);
    }
    // Each unit's values become its tensor (moved, not copied, on the CPU), its parameters
    // views of it.
    let flat = units
        .into_iter()
        .map(|values| {
            let len = values.len();
            Tensor::from_vec(values, len, device)
        })
        .collect::<candle_core::Result<Vec<_>>>()
        .map_err(user)?;
    Weights::from_flat(config, &flat)
        .and_then(|w| w.in_precision(precision))
        .map_err(user)
}
