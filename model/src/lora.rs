//! LoRA adapters (PEFT's `LoraConfig`, [`LoraConfig`]): each adapted linear layer `y = x Wᵀ`
//! becomes `y = x Wᵀ + (alpha / r) · (x Aᵀ) Bᵀ`, `A: [r, in]`, `B: [out, r]`, with the base
//! weights frozen.
//!
//! **Units.** The adapters of block `l` are a small unit of their own, right after the block's
//! unit ([`crate::transformer::Unit::Adapter`]), so a trainer gathers them with the block
//! it adapts; the base units (embedding, blocks, head) are frozen: pulled and never pushed,
//! reduced or optimised ([`crate::transformer::unit_trainable`]). Only the adapters'
//! gradients cross the network and only they have optimizer state — a parameter server gets
//! PEFT's savings by construction.
//!
//! Guarantees (tests are named after them):
//! 1. **PEFT's initialisation** ([`adapter_params`]): `A` is Kaiming-uniform (`a = √5`: uniform
//!    in `±1/√in`), `B` zeros, so an adapted model starts as its base model, logit for logit
//!    (tested in [`crate::hf::peft`], with merging and PEFT's layout).
//! 2. **The update is added where the layer is** ([`AdapterWeights::add`]): the attention's
//!    projections and the MLP's matrices each add their adapter's `scale · (x Aᵀ) Bᵀ`.

use candle_core::Tensor;

use crate::config::{LoraConfig, LoraTarget, ModelConfig};
use crate::error::{Error, Result};
use crate::params::{ParamInit, ParamSpec};

/// `(in, out)` features of the layer `target` adapts in `config`.
pub fn target_dims(config: &ModelConfig, target: LoraTarget) -> (usize, usize) {
    let (d, f, hd) = (config.d_model, config.d_ff, config.head_dim());
    let (q, kv) = (config.n_heads * hd, config.kv_heads() * hd);
    match target {
        LoraTarget::Q => (d, q),
        LoraTarget::K | LoraTarget::V => (d, kv),
        LoraTarget::O => (q, d),
        LoraTarget::Gate | LoraTarget::Up => (d, f),
        LoraTarget::Down => (f, d),
    }
}

/// The parameters of block `layer`'s adapter unit: per target, `…{module}.lora_A.weight
/// [r, in]` then `…lora_B.weight [out, r]`.
pub fn adapter_params(config: &ModelConfig, lora: &LoraConfig, layer: usize) -> Vec<ParamSpec> {
    lora.targets
        .iter()
        .flat_map(|t| {
            let (input, output) = target_dims(config, *t);
            let name = |m: &str| format!("model.layers.{layer}.{}.{m}.weight", t.module());
            [
                ParamSpec::new(
                    name("lora_A"),
                    &[lora.rank, input],
                    ParamInit::UniformFanIn(input),
                ),
                ParamSpec::new(name("lora_B"), &[output, lora.rank], ParamInit::Zeros),
            ]
        })
        .collect()
}

/// One block's adapters by target, and their scale.
#[derive(Debug, Clone, Copy)]
pub struct AdapterWeights<'a> {
    pub scale: f64,
    pairs: [Option<(&'a Tensor, &'a Tensor)>; 7],
}

impl<'a> AdapterWeights<'a> {
    /// `tensors` in [`adapter_params`] order.
    pub fn new(lora: &LoraConfig, tensors: &'a [Tensor]) -> Result<Self> {
        if tensors.len() != 2 * lora.targets.len() {
            return Err(Error::UnitParams {
                what: "adapter tensors",
                expected: 2 * lora.targets.len(),
                got: tensors.len(),
            });
        }
        let mut pairs = [None; 7];
        for (t, pair) in lora.targets.iter().zip(tensors.chunks(2)) {
            let slot = LoraTarget::ALL
                .iter()
                .position(|x| x == t)
                .unwrap_or_default();
            pairs[slot] = Some((&pair[0], &pair[1]));
        }
        Ok(AdapterWeights {
            scale: lora.scale(),
            pairs,
        })
    }

    /// Whether `target` has an adapter.
    pub fn adapts(&self, target: LoraTarget) -> bool {
        self.pair(target).is_some()
    }

    fn pair(&self, target: LoraTarget) -> Option<(&'a Tensor, &'a Tensor)> {
        let slot = LoraTarget::ALL
            .iter()
            .position(|t| *t == target)
            .unwrap_or_default();
        self.pairs[slot]
    }

    /// `y + scale · (x Aᵀ) Bᵀ` when `target` is adapted, else `y`; `x: [tokens, in]`,
    /// `y: [tokens, out]`.
    pub fn add(&self, target: LoraTarget, x: &Tensor, y: Tensor) -> Result<Tensor> {
        match self.pair(target) {
            None => Ok(y),
            Some((a, b)) => {
                let a = a.to_dtype(x.dtype())?;
                let b = b.to_dtype(x.dtype())?;
                let update = x.matmul(&a.t()?)?.matmul(&b.t()?)?;
                Ok((y + (update * self.scale)?)?)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transformer::unit_count;

    /// Rank-4 adapters on every linear layer of a 2-block model.
    fn adapted() -> ModelConfig {
        ModelConfig {
            n_layers: 2,
            lora: Some(LoraConfig::new(4)),
            ..ModelConfig::tiny()
        }
    }

    #[test]
    fn adapter_units_follow_their_blocks_and_only_they_train() {
        use crate::transformer::{stages, unit_trainable, Unit};
        let c = adapted();
        assert_eq!(unit_count(&c), 2 * 2 + 2);
        assert_eq!(stages(&c), vec![vec![0], vec![1, 2], vec![3, 4], vec![5]]);
        for u in 0..unit_count(&c) {
            let unit = Unit::from_index(&c, u).unwrap();
            assert_eq!(unit.index(&c), u);
            assert_eq!(
                unit_trainable(&c, u).unwrap(),
                matches!(unit, Unit::Adapter(_))
            );
        }
        let bad = LoraConfig {
            targets: vec![LoraTarget::Q, LoraTarget::Q],
            ..LoraConfig::new(4)
        };
        assert!(bad.validate().unwrap_err().to_string().contains("twice"));
        assert!(LoraConfig::new(0).validate().is_err());
        assert_eq!(LoraTarget::parse("gate_proj").unwrap(), LoraTarget::Gate);
        assert!(LoraTarget::parse("lm_head").is_err());
    }
}
