//! A [`JobBuilder`](crate::JobBuilder) for the model: its units (seeded, given, or a checkpoint's;
//! with RL's reference served after them) and a [`TransformerCompute`] per trainer.

use std::sync::Arc;

use super::transformer::{DeviceTransfers, Objective, Placement, SampleStore, TransformerCompute};
use crate::model::config::ModelConfig;
use crate::model::device::open_device;
use crate::model::error::{Error, Result};
use crate::model::params::ParamSpec;
use crate::model::transformer::{check_unit_count, layout_units, unit_name, unit_trainable};
use crate::{Compute, UnitSpec};

/// [`transformer_job`]'s fill floor of a micro-batch, as a fraction of the token budget.
pub const MICRO_BATCH_MIN_FILL: f64 = 0.5;

/// A [`JobBuilder`](crate::JobBuilder) with the model's units (starting from `init`, one flat
/// buffer per unit, or the seeded initialisation) and a [`TransformerCompute`] of `objective` on
/// the CPU per trainer; the caller adds trainers, servers, optimizer and data.
///
/// Dynamic dispatch fills micro-batches to at least half the token budget
/// ([`MICRO_BATCH_MIN_FILL`]; `JobBuilder::micro_batch_min_fill` overrides it): each micro-batch
/// is a pass over every unit (a gather, a forward and a backward of each), which on a small model
/// costs about as much as the last few samples guided packing would put alone.
pub fn transformer_job(
    config: &ModelConfig,
    init: Option<Vec<Vec<f32>>>,
    samples: Arc<dyn SampleStore>,
    objective: Objective,
) -> Result<crate::JobBuilder> {
    transformer_job_on(config, init, samples, objective, Placement::default())
}

/// [`transformer_job`] with each trainer's compute on `placement`'s device and precision. The
/// device is opened once here, so a bad `--device` or a missing driver fails before the job is
/// built; each trainer then opens its own (its own stream) at its first micro-batch. On a CUDA
/// device with [`DeviceTransfers::Device`] (the default) a one-process job keeps its shard
/// servers on that device too ([`crate::JobBuilder::servers_on_device`]).
pub fn transformer_job_on(
    config: &ModelConfig,
    init: Option<Vec<Vec<f32>>>,
    samples: Arc<dyn SampleStore>,
    objective: Objective,
    placement: Placement,
) -> Result<crate::JobBuilder> {
    let units = match init {
        None => layout_units(config)?,
        Some(values) => {
            check_unit_count(config, values.len())?;
            values
                .into_iter()
                .enumerate()
                .map(|(u, v)| UnitSpec::with_values(unit_name(config, u), v))
                .collect()
        }
    };
    transformer_job_of(config, units, samples, objective, placement)
}

/// A frozen copy of the model's units `policy` to serve after them ([`UnitSpec::served`]),
/// named `reference.<unit>`: RL's reference model, which the sampler reads as it reads the policy
/// ([`published_weights`](super::published_weights) from
/// [`unit_count`](crate::model::unit_count) on). Each copy shares its unit's initial values
/// (given, a checkpoint's, a model directory's mapped files): no second copy in this process's
/// memory.
pub fn served_reference(config: &ModelConfig, policy: &[UnitSpec]) -> Result<Vec<UnitSpec>> {
    check_unit_count(config, policy.len())?;
    Ok(policy
        .iter()
        .map(|u| {
            let name = format!("reference.{}", u.name);
            UnitSpec::from_init(name, u.len, u.init.clone()).served()
        })
        .collect())
}

/// [`transformer_job_on`] starting from `units` as they are — e.g. a Hugging Face checkpoint's
/// [`HfCheckpoint::unit_specs`](crate::model::hf::HfCheckpoint::unit_specs), which each shard server
/// reads its own slice of (under LoRA through [`crate::model::hf::peft::adapted_units`]). Their count and
/// lengths must be the model's; which are trainable is the config's (under LoRA, only the
/// adapters).
pub fn transformer_job_of(
    config: &ModelConfig,
    units: Vec<UnitSpec>,
    samples: Arc<dyn SampleStore>,
    objective: Objective,
    placement: Placement,
) -> Result<crate::JobBuilder> {
    // The servers' device: the trainers' own, unless the transfers go through the host.
    let servers_on = match placement.device.is_cuda() {
        true => {
            let device = open_device(placement.device, placement.local_rank)?;
            (placement.transfers == DeviceTransfers::Device)
                .then(|| crate::model::device::location_ordinal(&device) as u32)
        }
        false => None,
    };
    let prototype =
        TransformerCompute::on(config.clone(), placement, samples)?.with_objective(objective);
    check_unit_count(config, units.len())?;
    // What trains is the config's to say: under LoRA only the adapters.
    let mut units = units;
    for (u, unit) in units.iter_mut().enumerate() {
        unit.trainable = unit_trainable(config, u)?;
    }
    for (u, unit) in units.iter().enumerate() {
        let expected: usize = prototype.specs[u].iter().map(ParamSpec::numel).sum();
        if unit.len != expected {
            return Err(Error::UnitParams {
                what: "values",
                expected,
                got: unit.len,
            });
        }
    }
    Ok(crate::Job::builder()
        .units(units)
        .micro_batch_min_fill(MICRO_BATCH_MIN_FILL)
        .servers_on_device(servers_on)
        .compute(move |_trainer| Box::new(prototype.clone()) as Box<dyn Compute>))
}
