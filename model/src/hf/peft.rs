//! PEFT's side of LoRA: an adapted model's units from its base checkpoint's ([`adapted_units`]),
//! the adapters written in PEFT's layout ([`export_peft`]), and the base model with the adapters
//! folded in ([`merge`], `--merge-lora`).
//!
//! Guarantees (tests are named after them):
//! 1. **PEFT's initialisation**: `A` is Kaiming-uniform (`a = √5`: uniform in `±1/√in`), `B`
//!    zeros, so an adapted model starts as its base model, logit for logit.
//! 2. **PEFT's layout**: [`export_peft`] writes `adapter_config.json` (`peft_type` `LORA`, `r`,
//!    `lora_alpha`, `target_modules`, `task_type` `CAUSAL_LM`) and `adapter_model.safetensors`
//!    with PEFT's names (`base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight`).
//! 3. **Merging is the forward**: [`merge`] folds each adapter into its base weight
//!    (`W + (alpha / r) · B A`); the merged base model's logits equal the adapted model's.

use std::collections::HashMap;
use std::path::Path;

use super::export::{write_safetensors, NamedValues};
use super::DiskDtype;
use crate::block::block_params;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::lora::target_dims;
use crate::transformer::{
    check_unit_count, unit_count, unit_init_values, unit_name, unit_params, Unit,
};

/// The units of the adapted model `config` from its base model's units (in the base layout, e.g.
/// [`HfCheckpoint::unit_specs`](super::HfCheckpoint::unit_specs)): the base units frozen,
/// each block's adapter unit (PEFT's initialisation, seeded) inserted after it.
pub fn adapted_units(
    config: &ModelConfig,
    base_units: Vec<odc_policy::layout::UnitSpec>,
) -> Result<Vec<odc_policy::layout::UnitSpec>> {
    let base = base_config(config);
    if base_units.len() != unit_count(&base) {
        return Err(Error::UnitParams {
            what: "base units",
            expected: unit_count(&base),
            got: base_units.len(),
        });
    }
    if config.lora.is_none() {
        return Ok(base_units);
    }
    let mut out = Vec::with_capacity(unit_count(config));
    for (u, unit) in base_units.into_iter().enumerate() {
        out.push(unit.frozen());
        if let Unit::Block(layer) = Unit::from_index(&base, u)? {
            let index = Unit::Adapter(layer).index(config);
            out.push(odc_policy::layout::UnitSpec::with_values(
                unit_name(config, index),
                unit_init_values(config, index)?,
            ));
        }
    }
    Ok(out)
}

/// The base model's config (no adapters) of an adapted `config`.
pub fn base_config(config: &ModelConfig) -> ModelConfig {
    ModelConfig {
        lora: None,
        ..config.clone()
    }
}

/// Units' flat values, one buffer per unit.
pub type UnitValues = Vec<Vec<f32>>;

/// The adapted model's units split into the base model's (in the base layout) and the adapters'
/// (one per block).
pub fn split_units(config: &ModelConfig, units: &[Vec<f32>]) -> Result<(UnitValues, UnitValues)> {
    check_unit_count(config, units.len())?;
    let (mut base, mut adapters) = (Vec::new(), Vec::new());
    for (u, values) in units.iter().enumerate() {
        match Unit::from_index(config, u)? {
            Unit::Adapter(_) => adapters.push(values.clone()),
            _ => base.push(values.clone()),
        }
    }
    Ok((base, adapters))
}

/// The base model with every adapter folded in: `W ← W + (alpha / r) · B A` (in f64, rounded to
/// f32), in the base layout ([`base_config`]).
pub fn merge(config: &ModelConfig, units: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
    let Some(lora) = &config.lora else {
        return Ok(units.to_vec());
    };
    let base = base_config(config);
    let (mut merged, adapters) = split_units(config, units)?;
    for (layer, adapter) in adapters.iter().enumerate() {
        let block = &mut merged[Unit::Block(layer).index(&base)];
        let specs = block_params(&base, layer);
        let offsets: HashMap<&str, usize> = specs
            .iter()
            .scan(0, |at, s| {
                let start = *at;
                *at += s.numel();
                Some((s.name.as_str(), start))
            })
            .collect();
        let mut at = 0;
        for t in &lora.targets {
            let (input, output) = target_dims(&base, *t);
            let r = lora.rank;
            let a = &adapter[at..at + r * input];
            let b = &adapter[at + r * input..at + r * input + output * r];
            at += r * input + output * r;
            let name = format!("model.layers.{layer}.{}.weight", t.module());
            let start = *offsets.get(name.as_str()).ok_or_else(|| Error::Config {
                field: "lora.targets",
                reason: format!("{name} is not a parameter of the base block"),
            })?;
            let w = &mut block[start..start + output * input];
            for o in 0..output {
                for i in 0..input {
                    let delta: f64 = (0..r)
                        .map(|k| b[o * r + k] as f64 * a[k * input + i] as f64)
                        .sum();
                    let cell = &mut w[o * input + i];
                    *cell = (*cell as f64 + lora.scale() * delta) as f32;
                }
            }
        }
    }
    Ok(merged)
}

/// Writes the adapters in PEFT's layout into `dir` (created; must not hold an adapter already):
/// `adapter_config.json` and `adapter_model.safetensors` (f32, PEFT's names, `format: pt`).
/// `base_model` is `base_model_name_or_path` (the model directory, or a hub id).
pub fn export_peft(
    dir: &Path,
    config: &ModelConfig,
    units: &[Vec<f32>],
    base_model: &str,
) -> Result<()> {
    let Some(lora) = &config.lora else {
        return Err(Error::Config {
            field: "lora",
            reason: "the model has no adapters to export".into(),
        });
    };
    let io = |what: &str, e: std::io::Error| Error::Checkpoint {
        path: dir.to_path_buf(),
        tensor: None,
        reason: format!("{what}: {e}"),
    };
    std::fs::create_dir_all(dir).map_err(|e| io("creating the directory", e))?;
    let mut tensors = Vec::new();
    for (u, values) in units.iter().enumerate() {
        if !matches!(Unit::from_index(config, u)?, Unit::Adapter(_)) {
            continue;
        }
        let mut at = 0;
        for spec in unit_params(config, u)? {
            let n = spec.numel();
            let values = values.get(at..at + n).ok_or(Error::UnitParams {
                what: "values",
                expected: at + n,
                got: values.len(),
            })?;
            tensors.push(NamedValues {
                name: format!("base_model.model.{}", spec.name),
                shape: spec.shape,
                values,
            });
            at += n;
        }
    }
    let refs: Vec<&NamedValues<'_>> = tensors.iter().collect();
    write_safetensors(
        &dir.join("adapter_model.safetensors"),
        &refs,
        DiskDtype::F32,
    )?;
    let adapter_config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": lora.targets.iter().map(|t| t.name()).collect::<Vec<_>>(),
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
    });
    let text = serde_json::to_string_pretty(&adapter_config).map_err(|e| Error::Checkpoint {
        path: dir.join("adapter_config.json"),
        tensor: None,
        reason: e.to_string(),
    })?;
    std::fs::write(dir.join("adapter_config.json"), text)
        .map_err(|e| io("writing adapter_config.json", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{PackedBatch, Sample};
    use crate::config::{LoraConfig, LoraTarget};
    use crate::lora::adapter_params;
    use crate::params::unit_tensors;
    use crate::test_util::max_abs_diff;
    use crate::transformer::model_forward;
    use candle_core::{Device, Tensor};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// A Qwen2-like layout (GQA, biases, tied) with rank-4 adapters on every linear layer.
    fn adapted() -> ModelConfig {
        ModelConfig {
            vocab_size: 40,
            d_model: 32,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: Some(2),
            d_ff: 48,
            max_seq_len: 32,
            qkv_bias: true,
            tie_embeddings: true,
            init_std: 0.2,
            seed: 4,
            lora: Some(LoraConfig {
                rank: 4,
                alpha: 8.0,
                targets: LoraTarget::ALL.to_vec(),
            }),
            ..ModelConfig::tiny()
        }
    }

    fn init_units(c: &ModelConfig) -> Vec<Vec<f32>> {
        (0..unit_count(c))
            .map(|u| unit_init_values(c, u).unwrap())
            .collect()
    }

    fn logits(c: &ModelConfig, units: &[Vec<f32>]) -> Tensor {
        let params: Vec<Vec<Tensor>> = units
            .iter()
            .enumerate()
            .map(|(u, v)| unit_tensors(v, &unit_params(c, u).unwrap(), &Device::Cpu).unwrap())
            .collect();
        let batch = PackedBatch::pack(
            c,
            &[
                Sample::all_loss(vec![1, 5, 9, 2, 33, 7]),
                Sample::all_loss(vec![3, 3, 8]),
            ],
            &Device::Cpu,
        )
        .unwrap();
        model_forward(c, &params, &batch).unwrap().logits.unwrap()
    }

    #[test]
    fn pefts_initialisation_starts_as_the_base_model() {
        let c = adapted();
        let units = init_units(&c);
        let base = base_config(&c);
        let (base_units, adapters) = split_units(&c, &units).unwrap();
        assert_eq!(adapters.len(), 2);
        // A uniform within ±1/√in, B zeros.
        let specs = adapter_params(&c, c.lora.as_ref().unwrap(), 0);
        let mut at = 0;
        for spec in &specs {
            let values = &adapters[0][at..at + spec.numel()];
            if spec.name.ends_with("lora_A.weight") {
                let bound = 1.0 / (spec.shape[1] as f32).sqrt();
                assert!(
                    values.iter().all(|v| v.abs() <= bound) && values.iter().any(|v| *v != 0.0)
                );
            } else {
                assert!(values.iter().all(|v| *v == 0.0), "{}", spec.name);
            }
            at += spec.numel();
        }
        assert_eq!(
            max_abs_diff(&logits(&c, &units), &logits(&base, &base_units)),
            0.0
        );
    }

    #[test]
    fn merging_is_the_forward() {
        let c = adapted();
        let mut rng = StdRng::seed_from_u64(9);
        let mut units = init_units(&c);
        for values in units.iter_mut() {
            for v in values.iter_mut() {
                *v += rng.random_range(-0.1f32..0.1);
            }
        }
        let adapted_logits = logits(&c, &units);
        let merged = merge(&c, &units).unwrap();
        let base = base_config(&c);
        let (base_units, _) = split_units(&c, &units).unwrap();
        let merged_logits = logits(&base, &merged);
        let diff = max_abs_diff(&adapted_logits, &merged_logits);
        assert!(diff < 1e-4, "merged vs adapted: {diff}");
        // The adapters matter: the base alone is far off.
        assert!(max_abs_diff(&adapted_logits, &logits(&base, &base_units)) > 1e-2);
    }

    #[test]
    fn pefts_layout_names_shapes_and_config() {
        let c = adapted();
        let units = init_units(&c);
        let dir = std::env::temp_dir().join(format!("odc-lora-peft-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        export_peft(&dir, &c, &units, "Qwen/Qwen2.5-0.5B-Instruct").unwrap();
        let bytes = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            metadata
                .metadata()
                .as_ref()
                .and_then(|m| m.get("format"))
                .map(String::as_str),
            Some("pt")
        );
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let a = file
            .tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
            .unwrap();
        assert_eq!(a.shape(), &[4, 32]);
        let b = file
            .tensor("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight")
            .unwrap();
        assert_eq!(b.shape(), &[32, 4]);
        let k = file
            .tensor("base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight")
            .unwrap();
        assert_eq!(k.shape(), &[16, 4], "k_proj's out is kv_heads · head_dim");
        assert_eq!(file.names().len(), 2 * 2 * 7);
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(config["peft_type"], "LORA");
        assert_eq!(config["task_type"], "CAUSAL_LM");
        assert_eq!(config["r"], 4);
        assert_eq!(config["lora_alpha"], 8.0);
        assert_eq!(
            config["base_model_name_or_path"],
            "Qwen/Qwen2.5-0.5B-Instruct"
        );
        assert_eq!(config["target_modules"].as_array().unwrap().len(), 7);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
