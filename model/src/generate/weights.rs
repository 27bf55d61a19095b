//! [`Weights`]: the model's weights as plain tensors for inference, from flat units (host
//! values, or flat tensors on any device with no copy), in the trainers' compute precision.

use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::device::ComputePrecision;
use crate::error::Result;
use crate::params::{unit_tensors, unit_views};
use crate::transformer::{check_unit_count, unit_params, Unit};

/// The model's weights as plain tensors (no gradients), for inference.
#[derive(Debug, Clone)]
pub struct Weights {
    pub(super) config: ModelConfig,
    pub(super) units: Vec<Vec<Tensor>>,
}

impl Weights {
    /// From each unit's flat buffer (as `odc::Job::parameters` returns them).
    pub fn from_units(config: &ModelConfig, units: &[Vec<f32>], device: &Device) -> Result<Self> {
        config.validate()?;
        check_unit_count(config, units.len())?;
        let units = units
            .iter()
            .enumerate()
            .map(|(u, values)| unit_tensors(values, &unit_params(config, u)?, device))
            .collect::<Result<Vec<_>>>()?;
        Ok(Weights {
            config: config.clone(),
            units,
        })
    }

    /// From each unit's flat tensor (any dtype, any device: e.g. a unit read into device memory
    /// by `Job::published_units_into`, feature `cuda`), each parameter a view of it, no copy;
    /// [`Error::UnitParams`] when a unit's length is not the model's.
    pub fn from_flat(config: &ModelConfig, units: &[Tensor]) -> Result<Self> {
        config.validate()?;
        check_unit_count(config, units.len())?;
        let units = units
            .iter()
            .enumerate()
            .map(|(u, flat)| unit_views(flat, &unit_params(config, u)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Weights {
            config: config.clone(),
            units,
        })
    }

    /// The same weights for computing in `precision`, as a trainer computes: under
    /// [`ComputePrecision::Bf16`] every matrix (embedding, projections, MLP, head) in bf16 and
    /// the norms' weights in fp32; the decoder's activations and its cache then follow the
    /// embedding's dtype (bf16: half the cache), its logits are read in fp32.
    pub fn in_precision(self, precision: ComputePrecision) -> Result<Self> {
        let units = self
            .units
            .iter()
            .map(|unit| precision.cast(unit))
            .collect::<Result<Vec<_>>>()?;
        Ok(Weights {
            config: self.config,
            units,
        })
    }

    /// The dtype the decoder computes and caches in (the embedding's).
    pub fn dtype(&self) -> DType {
        self.units[0][0].dtype()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Each unit's tensors, in [`unit_params`] order (what [`crate::model_forward`] takes).
    pub fn units(&self) -> &[Vec<Tensor>] {
        &self.units
    }

    /// Block `layer`'s tensors as its forward takes them (its adapters' after them, under LoRA).
    pub(super) fn block_tensors(&self, layer: usize) -> Vec<Tensor> {
        let mut tensors = self.units[Unit::Block(layer).index(&self.config)].clone();
        if self.config.lora.is_some() {
            tensors.extend(
                self.units[Unit::Adapter(layer).index(&self.config)]
                    .iter()
                    .cloned(),
            );
        }
        tensors
    }
}
