//! Small random checkpoints in Hugging Face layout, written from Rust (no network, no downloaded
//! weights), for this crate's tests and integration tests: one per family and variant, each with
//! the values a load must give.
//!
//! | preset | family | variant | on disk |
//! |---|---|---|---|
//! | [`TestCheckpoint::llama_gqa`] | llama | GQA (4 heads / 2 KV), untied | f32 |
//! | [`TestCheckpoint::qwen2_tied`] | qwen2 | q/k/v biases, GQA, tied | bf16 (write it sharded) |
//! | [`TestCheckpoint::qwen3_tied`] | qwen3 | q/k norms, `head_dim` 16 ≠ 32/4, tied | f16 |
//! | [`TestCheckpoint::llama3_scaled`] | llama | Llama 3 `rope_scaling`, tied | bf16 |
//!
//! ```
//! use odc_model::hf::testing::{TempDir, TestCheckpoint};
//! use odc_model::hf::HfCheckpoint;
//! let dir = TempDir::new("doc-qwen2");
//! let model = TestCheckpoint::qwen2_tied();
//! model.write(dir.path(), 3).unwrap(); // 3 shards and model.safetensors.index.json
//! let loaded = HfCheckpoint::open(dir.path()).unwrap();
//! assert_eq!(loaded.config(), &model.config);
//! assert_eq!(loaded.unit_values(1).unwrap(), model.units[1]);
//! ```
//!
//! `config.json` is written by hand here, field by field as `transformers` writes it, not by
//! [`export`](super::export): the reader is tested against an independent writer.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

use super::super::config::{ModelConfig, RopeScaling};
use super::super::params::ParamInit;
use super::super::transformer::{unit_count, unit_params};
use super::config::{normalised, HfFamily};
use super::dtype::DiskDtype;
use super::{CONFIG_FILE, INDEX_FILE, SINGLE_FILE};

/// One tensor as stored: any safetensors dtype, so tests can write wrong ones.
#[derive(Debug, Clone, PartialEq)]
pub struct TestTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl TestTensor {
    /// `values` stored as `dtype` (rounded to nearest even).
    pub fn new(name: &str, dtype: DiskDtype, shape: &[usize], values: &[f32]) -> Self {
        TestTensor {
            name: name.into(),
            dtype: dtype.safetensors(),
            shape: shape.to_vec(),
            bytes: dtype.encode(values),
        }
    }
}

/// A random model in Hugging Face layout, before and after storage.
#[derive(Debug, Clone)]
pub struct TestCheckpoint {
    pub family: HfFamily,
    /// The model (as [`HfCheckpoint::open`](super::HfCheckpoint::open) reads it back).
    pub config: ModelConfig,
    /// `config.json`.
    pub json: Value,
    /// The tensors' element type.
    pub dtype: DiskDtype,
    /// The tensors in the model's order, Hugging Face names (no `lm_head.weight` when tied).
    pub tensors: Vec<TestTensor>,
    /// Per unit, the flat f32 buffer a load gives (the written values, as `dtype` stores them).
    pub units: Vec<Vec<f32>>,
}

impl TestCheckpoint {
    /// A model of `config` (its layout's family) with random values stored as `dtype`, drawn
    /// from `seed`: matrices uniform in ±0.5, norm weights 1 ± 0.25, biases ±0.25.
    pub fn new(config: ModelConfig, dtype: DiskDtype, seed: u64) -> Self {
        let config = normalised(&ModelConfig {
            init_std: 0.02,
            seed: 0,
            ..config
        });
        let family = HfFamily::of(&config).unwrap_or(HfFamily::Llama);
        let mut rng = StdRng::seed_from_u64(seed);
        let (mut tensors, mut units) = (Vec::new(), Vec::new());
        for u in 0..unit_count(&config) {
            let mut unit = Vec::new();
            for spec in unit_params(&config, u).unwrap_or_default() {
                let values: Vec<f32> = (0..spec.numel())
                    .map(|_| match spec.init {
                        ParamInit::Normal => rng.random_range(-0.5f32..0.5),
                        ParamInit::Ones => 1.0 + rng.random_range(-0.25f32..0.25),
                        ParamInit::Zeros | ParamInit::UniformFanIn(_) => {
                            rng.random_range(-0.25f32..0.25)
                        }
                    })
                    .collect();
                unit.extend(dtype.round(&values));
                tensors.push(TestTensor::new(&spec.name, dtype, &spec.shape, &values));
            }
            units.push(unit);
        }
        let json = config_json(family, &config, dtype);
        TestCheckpoint {
            family,
            config,
            json,
            dtype,
            tensors,
            units,
        }
    }

    /// Llama layout with grouped-query attention (4 heads over 2 KV heads), untied, f32.
    pub fn llama_gqa() -> Self {
        Self::new(llama_gqa_config(), DiskDtype::F32, 1)
    }

    /// Qwen2 layout: q/k/v biases, 4 heads over 2 KV heads, tied embeddings, bf16.
    pub fn qwen2_tied() -> Self {
        let config = ModelConfig {
            vocab_size: 40,
            d_model: 24,
            d_ff: 40,
            rope_theta: 1e6,
            rms_eps: 1e-6,
            qkv_bias: true,
            tie_embeddings: true,
            ..llama_gqa_config()
        };
        Self::new(config, DiskDtype::Bf16, 2)
    }

    /// Qwen3 layout: q/k norms, explicit `head_dim` 16 (width 32 over 4 heads would give 8),
    /// tied embeddings, f16.
    pub fn qwen3_tied() -> Self {
        let config = ModelConfig {
            vocab_size: 40,
            head_dim: Some(16),
            rope_theta: 1e6,
            rms_eps: 1e-6,
            qk_norm: true,
            tie_embeddings: true,
            ..llama_gqa_config()
        };
        Self::new(config, DiskDtype::F16, 3)
    }

    /// Llama 3.2's layout: Llama 3 `rope_scaling` (factor 8, frequencies 1 and 4, original
    /// length 16), θ 500000, tied embeddings, bf16.
    pub fn llama3_scaled() -> Self {
        let config = ModelConfig {
            n_kv_heads: Some(1),
            max_seq_len: 128,
            rope_theta: 500_000.0,
            rope_scaling: Some(RopeScaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 16,
            }),
            tie_embeddings: true,
            ..llama_gqa_config()
        };
        Self::new(config, DiskDtype::Bf16, 4)
    }

    /// Every preset with the number of files to write it as: `(name, checkpoint, shards)`.
    pub fn presets() -> Vec<(&'static str, TestCheckpoint, usize)> {
        vec![
            ("llama-gqa-f32", Self::llama_gqa(), 1),
            ("qwen2-tied-bf16-sharded", Self::qwen2_tied(), 3),
            ("qwen3-tied-f16", Self::qwen3_tied(), 1),
            ("llama3-scaled-bf16", Self::llama3_scaled(), 1),
        ]
    }

    /// The tensor named `name`.
    pub fn tensor_mut(&mut self, name: &str) -> Option<&mut TestTensor> {
        self.tensors.iter_mut().find(|t| t.name == name)
    }

    /// Removes and returns the tensor named `name`.
    pub fn remove(&mut self, name: &str) -> Option<TestTensor> {
        let i = self.tensors.iter().position(|t| t.name == name)?;
        Some(self.tensors.remove(i))
    }

    /// Writes the model into `dir` (created if needed): `config.json`, small stub tokenizer
    /// files (`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`), and the
    /// tensors as `model.safetensors` (`shards` ≤ 1) or as `shards` files
    /// `model-0000i-of-0000N.safetensors` (consecutive runs of the tensors) with
    /// `model.safetensors.index.json`.
    pub fn write(&self, dir: &Path, shards: usize) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        write_json(&dir.join(CONFIG_FILE), &self.json)?;
        write_json(
            &dir.join("tokenizer_config.json"),
            &json!({"eos_token": "<|end|>", "model_max_length": self.config.max_seq_len}),
        )?;
        write_json(
            &dir.join("tokenizer.json"),
            &json!({"version": "1.0", "model": {"type": "stub"}}),
        )?;
        write_json(
            &dir.join("generation_config.json"),
            &json!({"eos_token_id": [1, 2]}),
        )?;
        if shards <= 1 {
            return write_safetensors(&dir.join(SINGLE_FILE), &self.tensors);
        }
        let per = self.tensors.len().div_ceil(shards);
        let mut weight_map = BTreeMap::new();
        let mut total = 0;
        for (i, chunk) in self.tensors.chunks(per.max(1)).enumerate() {
            let file = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
            write_safetensors(&dir.join(&file), chunk)?;
            for t in chunk {
                weight_map.insert(t.name.clone(), file.clone());
                total += t.bytes.len();
            }
        }
        write_json(
            &dir.join(INDEX_FILE),
            &json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
        )
    }
}

/// `config.json` as `transformers` writes it for `family`.
fn config_json(family: HfFamily, c: &ModelConfig, dtype: DiskDtype) -> Value {
    let mut j = json!({
        "architectures": [family.architecture()],
        "model_type": family.model_type(),
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "hidden_size": c.d_model,
        "initializer_range": 0.02,
        "intermediate_size": c.d_ff,
        "max_position_embeddings": c.max_seq_len,
        "num_attention_heads": c.n_heads,
        "num_hidden_layers": c.n_layers,
        "num_key_value_heads": c.kv_heads(),
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling.map(|s| json!({
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
            "rope_type": "llama3",
        })),
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": match dtype {
            DiskDtype::F32 => "float32",
            DiskDtype::Bf16 => "bfloat16",
            DiskDtype::F16 => "float16",
        },
        "transformers_version": "4.51.0",
        "use_cache": true,
        "vocab_size": c.vocab_size,
    });
    if let Some(obj) = j.as_object_mut() {
        if let Some(hd) = c.head_dim {
            obj.insert("head_dim".into(), hd.into());
        }
        match family {
            HfFamily::Llama => {
                obj.insert("attention_bias".into(), false.into());
                obj.insert("mlp_bias".into(), false.into());
                obj.insert("pretraining_tp".into(), 1.into());
            }
            HfFamily::Qwen2 | HfFamily::Qwen3 => {
                obj.insert("use_sliding_window".into(), false.into());
                obj.insert("sliding_window".into(), 4096.into());
                obj.insert("max_window_layers".into(), c.n_layers.into());
                if family == HfFamily::Qwen3 {
                    obj.insert("attention_bias".into(), false.into());
                }
            }
        }
    }
    j
}

/// [`TestCheckpoint::llama_gqa`]'s config, the base of the other presets: 4 heads over 2 KV
/// heads, width 32, 2 blocks, untied.
fn llama_gqa_config() -> ModelConfig {
    ModelConfig {
        vocab_size: 48,
        d_model: 32,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: Some(2),
        d_ff: 48,
        max_seq_len: 64,
        seed: 0,
        ..ModelConfig::tiny()
    }
}

/// Writes `tensors` as one safetensors file with metadata `{"format": "pt"}`.
pub fn write_safetensors(path: &Path, tensors: &[TestTensor]) -> std::io::Result<()> {
    let views = tensors
        .iter()
        .map(|t| {
            TensorView::new(t.dtype, t.shape.clone(), &t.bytes)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| std::io::Error::other(format!("{}: {e}", t.name)))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path)
        .map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))
}

fn write_json(path: &Path, value: &Value) -> std::io::Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(std::io::Error::other)?;
    std::fs::write(path, text)
}

/// A fresh directory under the system's temporary directory, removed (with its contents) when
/// dropped.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates `odc-hf-<name>-<pid>-<nanos>-<n>`.
    pub fn new(name: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path =
            std::env::temp_dir().join(format!("odc-hf-{name}-{}-{nanos}-{n}", std::process::id()));
        // A failure shows up at the first write into it.
        let _ = std::fs::create_dir_all(&path);
        TempDir(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
