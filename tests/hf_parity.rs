//! odc's model against implementations that are not odc's, every position's logits within 1e-4
//! (f32):
//! - **Python `transformers`**: `tests/fixtures/hf/<case>/` are small random Llama, Qwen2 and
//!   Qwen3 models saved by `transformers`' own `save_pretrained` (config in transformers 5's
//!   layout, `rope_parameters` included) with the logits it computed for a fixed sequence
//!   (`scripts/hf_fixtures.py` makes them); odc opens each directory and must give the same
//!   logits — a checkpoint odc did not write, read and run by odc. With each case's
//!   `generate.json` (`--generate`: `transformers`' greedy `generate` of prompts of different
//!   lengths, 40 tokens each), odc's batched decoder must give the same tokens, token for token.
//! - **candle-transformers**: its `llama`, `qwen2` and `qwen3` read the same Hugging Face
//!   directory as odc (its `config.json` and safetensors, through their own serde configs and
//!   `VarBuilder`).
//!
//! Each case: a small random model of one family and variant (GQA, explicit head_dim, q/k/v
//! biases, q/k norms, tied or untied head, Llama 3 rope scaling; every parameter perturbed so that
//! biases and norm weights are not their neutral initial values), exported by
//! [`odc::model::hf::export_hf`] in f32, then
//! - candle-transformers loads the directory and gives the logits of each prefix's last position
//!   (its causal-LM heads return only the last position);
//! - odc loads the same directory ([`HfCheckpoint`]), checks it reads back the exact config and
//!   values, and runs its training forward on a pack of the sample and another one: the sample's
//!   logits must equal the reference's at every position, whatever is packed before it; and its
//!   cached decoder (one block implementation for both) must agree too.
#![cfg(feature = "candle")]

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::{llama, qwen2, qwen3};
use odc::model::hf::{export_hf, ExportDtype, ExportOptions, HfCheckpoint};
use odc::model::{
    forward_cached, generate, generate_batch, model_forward, unit_count, unit_init_values, KvCache,
    ModelConfig, PackedBatch, Prompt, RopeScaling, Sample, Sampling, Weights,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[path = "common/hf_fixtures.rs"]
mod hf_fixtures;
use hf_fixtures::{fixtures, json, max_abs_diff, packed_logits};

/// A directory of its own under the system's temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("odc-hf-parity-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Family {
    Llama,
    Qwen2,
    Qwen3,
}

fn base() -> ModelConfig {
    ModelConfig {
        vocab_size: 97,
        d_model: 32,
        n_layers: 2,
        n_heads: 4,
        d_ff: 56,
        max_seq_len: 64,
        init_std: 0.2,
        seed: 21,
        ..ModelConfig::tiny()
    }
}

/// The families and variants checked, each a small model with the layout's options.
fn cases() -> Vec<(&'static str, Family, ModelConfig)> {
    vec![
        (
            "llama-gqa-untied",
            Family::Llama,
            ModelConfig {
                n_kv_heads: Some(2),
                rope_theta: 500_000.0,
                ..base()
            },
        ),
        (
            // Llama 3.2 1B/3B and SmolLM2: tied; Llama 3.1+ rope scaling.
            "llama3-tied-rope-scaling",
            Family::Llama,
            ModelConfig {
                n_kv_heads: Some(1),
                tie_embeddings: true,
                rope_theta: 500_000.0,
                rope_scaling: Some(RopeScaling {
                    factor: 32.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 16,
                }),
                rms_eps: 1e-5,
                ..base()
            },
        ),
        (
            "qwen2-biases-tied",
            Family::Qwen2,
            ModelConfig {
                n_kv_heads: Some(2),
                qkv_bias: true,
                tie_embeddings: true,
                rope_theta: 1_000_000.0,
                rms_eps: 1e-6,
                ..base()
            },
        ),
        (
            "qwen2-biases-untied",
            Family::Qwen2,
            ModelConfig {
                n_kv_heads: Some(1),
                qkv_bias: true,
                rope_theta: 1_000_000.0,
                rms_eps: 1e-6,
                ..base()
            },
        ),
        (
            // Qwen3: q/k norms and a head_dim that is not hidden / heads.
            "qwen3-qk-norm-head-dim-tied",
            Family::Qwen3,
            ModelConfig {
                n_kv_heads: Some(2),
                head_dim: Some(12),
                qk_norm: true,
                tie_embeddings: true,
                rope_theta: 1_000_000.0,
                rms_eps: 1e-6,
                ..base()
            },
        ),
    ]
}

/// The model's seeded initialisation with every value perturbed (biases and norm weights away
/// from 0 and 1), so that a parameter read or applied wrongly shows in the logits.
fn random_units(config: &ModelConfig) -> Vec<Vec<f32>> {
    let mut rng = StdRng::seed_from_u64(config.seed ^ 0x5eed);
    (0..unit_count(config))
        .map(|u| {
            unit_init_values(config, u)
                .expect("a valid config")
                .into_iter()
                .map(|v| v + rng.random_range(-0.1f32..0.1))
                .collect()
        })
        .collect()
}

fn f32_export() -> ExportOptions<'static> {
    ExportOptions {
        dtype: ExportDtype::F32,
        ..ExportOptions::default()
    }
}

/// `config.json` as candle-transformers' serde configs read it, with transformers' defaults for
/// keys an odc export leaves out because transformers does not need them.
fn reference_config_json(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("config.json")).expect("config.json");
    let mut json: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let object = json.as_object_mut().expect("an object");
    let defaults = [
        ("sliding_window", serde_json::json!(4096)),
        ("max_window_layers", serde_json::json!(28)),
        ("use_sliding_window", serde_json::json!(false)),
        ("attention_bias", serde_json::json!(false)),
        ("hidden_act", serde_json::json!("silu")),
    ];
    for (key, value) in defaults {
        if object.get(key).is_none_or(|v| v.is_null()) {
            object.insert(key.into(), value);
        }
    }
    json
}

fn safetensors_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("the export")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    files
}

/// candle-transformers' logits `[len, vocab]` of `tokens`: the last position of each prefix.
fn reference_logits(family: Family, dir: &Path, tokens: &[u32]) -> Tensor {
    let device = Device::Cpu;
    let json = reference_config_json(dir);
    let files = safetensors_files(dir);
    // SAFETY: the files are this test's own export, not modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &device) }
        .expect("candle-transformers maps the export");
    let ids = |n: usize| {
        Tensor::new(&tokens[..n], &device)
            .unwrap()
            .unsqueeze(0)
            .unwrap()
    };
    // Every prefix of `tokens` run from an empty cache: the logits of its last position.
    let each_prefix = |forward: &mut dyn FnMut(&Tensor) -> Tensor| -> Vec<Tensor> {
        (1..=tokens.len())
            .map(|n| {
                let logits = forward(&ids(n));
                logits.flatten_all().unwrap().to_dtype(DType::F32).unwrap()
            })
            .collect()
    };
    let rows: Vec<Tensor> = match family {
        Family::Llama => {
            let config: llama::LlamaConfig = serde_json::from_value(json).expect("llama config");
            let config = config.into_config(false);
            let model = llama::Llama::load(vb, &config).expect("llama loads");
            each_prefix(&mut |ids| {
                let mut cache = llama::Cache::new(false, DType::F32, &config, &device).unwrap();
                model.forward(ids, 0, &mut cache).unwrap()
            })
        }
        Family::Qwen2 => {
            let config: qwen2::Config = serde_json::from_value(json).expect("qwen2 config");
            let mut model = qwen2::ModelForCausalLM::new(&config, vb).expect("qwen2 loads");
            each_prefix(&mut |ids| {
                model.clear_kv_cache();
                model.forward(ids, 0).unwrap()
            })
        }
        Family::Qwen3 => {
            let config: qwen3::Config = serde_json::from_value(json).expect("qwen3 config");
            let mut model = qwen3::ModelForCausalLM::new(&config, vb).expect("qwen3 loads");
            each_prefix(&mut |ids| {
                model.clear_kv_cache();
                model.forward(ids, 0).unwrap()
            })
        }
    };
    Tensor::stack(&rows, 0).unwrap()
}

fn spread(t: &Tensor) -> f32 {
    let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// `scripts/hf_fixtures.py --generate`: `transformers`' greedy `generate` of prompts of different
/// lengths (40 new tokens each, f32, one at a time; its batched, left-padded run agreed) equals
/// odc's batched decoder on the same checkpoints, all prompts in one left-padded batch, and each
/// prompt alone: token for token.
#[test]
fn greedy_generation_equals_python_transformers_generate() {
    let mut cases = 0;
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let fixture = json(&dir.join("generate.json"));
        let prompts: Vec<Vec<u32>> = serde_json::from_value(fixture["prompts"].clone()).unwrap();
        let want: Vec<Vec<u32>> = serde_json::from_value(fixture["greedy"].clone()).unwrap();
        let checkpoint = HfCheckpoint::open(&dir).expect("odc opens transformers' checkpoint");
        let units = checkpoint.all_unit_values().unwrap();
        let weights = Weights::from_units(checkpoint.config(), &units, &Device::Cpu).unwrap();
        let sampling = Sampling::greedy(want[0].len(), Vec::new());
        let batch: Vec<Prompt<'_>> = prompts.iter().map(|p| Prompt::new(p)).collect();
        let mut rngs: Vec<StdRng> = (0..batch.len()).map(|_| StdRng::seed_from_u64(0)).collect();
        let got = generate_batch(&weights, &batch, &sampling, &mut rngs).unwrap();
        assert_eq!(got, want, "{name}: the batch");
        for (prompt, want) in prompts.iter().zip(&want) {
            let alone = generate(&weights, prompt, &sampling, &mut StdRng::seed_from_u64(0));
            assert_eq!(&alone.unwrap(), want, "{name}: {prompt:?} alone");
        }
        cases += 1;
    }
    assert_eq!(cases, 4, "every case has its generate.json");
}

/// The fixtures of `scripts/hf_fixtures.py`: each directory's logits by Python `transformers`.
#[test]
fn logits_equal_python_transformers_on_its_own_checkpoints() {
    let cases = fixtures();
    let device = Device::Cpu;
    for dir in cases {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let fixture = json(&dir.join("logits.json"));
        let tokens: Vec<u32> = serde_json::from_value(fixture["tokens"].clone()).unwrap();
        let rows: Vec<Vec<f32>> = serde_json::from_value(fixture["logits"].clone()).unwrap();
        let reference = Tensor::new(rows, &device).unwrap();
        let checkpoint = HfCheckpoint::open(&dir).expect("odc opens transformers' checkpoint");
        let config = checkpoint.config().clone();
        let units = checkpoint.all_unit_values().unwrap();
        let ours = packed_logits(&config, &units, &[11, 12, 13], &tokens);
        let diff = max_abs_diff(&ours, &reference);
        eprintln!("{name}: odc vs Python transformers: max |Δ| = {diff:e}");
        assert!(
            spread(&reference) > 0.5,
            "{name}: logits too flat to compare"
        );
        assert!(diff < 1e-4, "{name}: max |Δ| = {diff}");
        let weights = Weights::from_units(&config, &units, &device).unwrap();
        let cached = forward_cached(&weights, &mut KvCache::default(), &tokens).unwrap();
        assert!(
            max_abs_diff(&cached, &reference) < 1e-4,
            "{name}: cached decoding"
        );

        // odc's exports of transformers' checkpoint, for `scripts/hf_fixtures.py
        // --check-export` to load with `from_pretrained` (kept under cargo's test temp dir):
        // the f32 one reads back bit for bit.
        for (dtype, suffix) in [(ExportDtype::F32, "f32"), (ExportDtype::Bf16, "bf16")] {
            let out = Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join("hf-exports")
                .join(format!("{name}-{suffix}"));
            let _ = std::fs::remove_dir_all(&out);
            let options = ExportOptions {
                dtype,
                source: Some(&dir),
                ..ExportOptions::default()
            };
            export_hf(&out, &config, &units, &options).expect("export");
            if dtype == ExportDtype::F32 {
                let back = HfCheckpoint::open(&out).unwrap().all_unit_values().unwrap();
                assert_eq!(back, units, "{name}: f32 export round trip");
            }
        }

        // Random rank-4 adapters on every linear layer, exported in PEFT's layout and merged (f32),
        // for `scripts/hf_fixtures.py --check-peft`: PEFT applying the adapters to transformers'
        // base model must give the merged model's logits.
        let adapted_config = ModelConfig {
            lora: Some(odc::model::LoraConfig::new(4)),
            ..config.clone()
        };
        let mut rng = StdRng::seed_from_u64(3);
        let adapted: Vec<Vec<f32>> = odc::model::hf::peft::adapted_units(
            &adapted_config,
            units
                .iter()
                .enumerate()
                .map(|(u, v)| odc::UnitSpec::with_values(format!("u{u}"), v.clone()))
                .collect(),
        )
        .unwrap()
        .iter()
        .map(|unit| {
            let values = unit.init.slice(0..unit.len).unwrap();
            if unit.trainable {
                values
                    .iter()
                    .map(|v| v + rng.random_range(-0.2f32..0.2))
                    .collect()
            } else {
                values
            }
        })
        .collect();
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hf-exports");
        let lora_dir = root.join(format!("{name}-lora"));
        let merged_dir = root.join(format!("{name}-merged"));
        for d in [&lora_dir, &merged_dir] {
            let _ = std::fs::remove_dir_all(d);
        }
        odc::model::hf::peft::export_peft(
            &lora_dir,
            &adapted_config,
            &adapted,
            &dir.display().to_string(),
        )
        .unwrap();
        let merged = odc::model::hf::peft::merge(&adapted_config, &adapted).unwrap();
        let options = ExportOptions {
            dtype: ExportDtype::F32,
            source: Some(&dir),
            ..ExportOptions::default()
        };
        export_hf(&merged_dir, &config, &merged, &options).unwrap();
    }
}

#[test]
fn logits_equal_candle_transformers_at_every_position() {
    let tokens: Vec<u32> = vec![5, 17, 3, 88, 42, 42, 9, 60, 1, 33, 71, 2];
    let before: Vec<u32> = vec![11, 12, 13, 14, 15];
    for (name, family, config) in cases() {
        config.validate().expect(name);
        let dir = TempDir::new(name);
        let out = dir.0.join("model");
        let units = random_units(&config);
        export_hf(&out, &config, &units, &f32_export()).expect("export");

        // odc reads back exactly what it wrote.
        let checkpoint = HfCheckpoint::open(&out).expect("odc opens its export");
        let read = checkpoint.config().clone();
        assert_eq!(
            ModelConfig {
                init_std: config.init_std,
                seed: config.seed,
                max_seq_len: config.max_seq_len,
                ..read.clone()
            },
            config,
            "{name}: the config round trip"
        );
        for (u, values) in units.iter().enumerate() {
            assert_eq!(
                &checkpoint.unit_values(u).expect("unit"),
                values,
                "{name}: unit {u}"
            );
        }

        let reference = reference_logits(family, &out, &tokens);
        assert!(
            spread(&reference) > 0.5,
            "{name}: logits too flat to compare"
        );

        // Training's forward on a pack: another sample first, then this one.
        let ours = packed_logits(&read, &units, &before, &tokens);
        let diff = max_abs_diff(&ours, &reference);
        eprintln!("{name}: training forward vs candle-transformers: max |Δ| = {diff:e}");
        assert!(diff < 1e-4, "{name}: max |Δ| = {diff}");

        // Cached decoding: a prefix, then a token at a time.
        let weights = Weights::from_units(&read, &units, &Device::Cpu).unwrap();
        let mut cache = KvCache::default();
        let mut rows = vec![forward_cached(&weights, &mut cache, &tokens[..4]).unwrap()];
        for t in &tokens[4..] {
            rows.push(forward_cached(&weights, &mut cache, &[*t]).unwrap());
        }
        let cached = Tensor::cat(&rows, 0).unwrap();
        let diff = max_abs_diff(&cached, &reference);
        eprintln!("{name}: cached decoding vs candle-transformers: max |Δ| = {diff:e}");
        assert!(diff < 1e-4, "{name}: cached max |Δ| = {diff}");
    }
}

/// The check can fail: a model whose q/k norms, biases or rope scaling are dropped disagrees
/// with the reference far beyond the tolerance.
#[test]
fn parity_fails_when_a_layout_option_is_dropped() {
    let tokens: Vec<u32> = vec![5, 17, 3, 88, 42, 42, 9, 60, 1, 33, 71, 2];
    for (name, family, config) in cases() {
        let wrong = ModelConfig {
            qk_norm: false,
            qkv_bias: false,
            rope_scaling: None,
            ..config.clone()
        };
        if wrong == config {
            continue;
        }
        let dir = TempDir::new(&format!("{name}-dropped"));
        let out = dir.0.join("model");
        let units = random_units(&config);
        export_hf(&out, &config, &units, &f32_export()).expect("export");
        let reference = reference_logits(family, &out, &tokens);
        // The same values, read as the layout without the option (extra tensors ignored).
        let device = Device::Cpu;
        let params: Vec<Vec<Tensor>> = (0..unit_count(&wrong))
            .map(|u| {
                let all = odc::model::unit_params(&config, u).unwrap();
                let mut at = 0;
                let mut tensors = Vec::new();
                for spec in &all {
                    let n = spec.numel();
                    let keep = odc::model::unit_params(&wrong, u)
                        .unwrap()
                        .iter()
                        .any(|s| s.name == spec.name);
                    if keep {
                        tensors.push(
                            Tensor::from_slice(
                                &units[u][at..at + n],
                                spec.shape.as_slice(),
                                &device,
                            )
                            .unwrap(),
                        );
                    }
                    at += n;
                }
                tensors
            })
            .collect();
        let batch =
            PackedBatch::pack(&wrong, &[Sample::all_loss(tokens.clone())], &device).unwrap();
        let logits = model_forward(&wrong, &params, &batch)
            .unwrap()
            .logits
            .unwrap();
        let diff = max_abs_diff(&logits, &reference);
        eprintln!("{name} without its options: max |Δ| = {diff:e}");
        assert!(
            diff > 1e-2,
            "{name}: dropping an option changed the logits by {diff} only"
        );
    }
}
