//! The transformer's hyper-parameters ([`ModelConfig`]), checked by [`ModelConfig::validate`], which
//! names the first bad field. The config is serde-serialisable so it can travel in a checkpoint.
//! With it, the choices a model is built with: LoRA's ([`LoraConfig`], in [`lora`]) and which
//! implementation each part of a block runs ([`Implementations`], in [`implementations`]).
//!
//! The bottom layer of [`crate::model`]: it imports nothing of the model but its error.

pub mod implementations;
pub mod lora;

use serde::{Deserialize, Serialize};

pub use implementations::{AttentionImpl, Blocks, HeadImpl, Implementations, MlpImpl};
pub use lora::{LoraConfig, LoraTarget};

use super::error::{Error, Result};

fn is_false(b: &bool) -> bool {
    !*b
}

/// Llama 3's rotary frequency rescaling (`rope_scaling` with `rope_type: "llama3"` in a Hugging Face
/// `config.json`): wavelengths shorter than `original_max_position_embeddings / high_freq_factor`
/// are kept, longer than `original_max_position_embeddings / low_freq_factor` divided by `factor`,
/// and those between interpolated smoothly.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// Shape and initialisation of the causal transformer of [`crate::model`]: odc's own reference
/// model ([`ModelConfig::tiny`]) and the Llama 3, Qwen2/2.5, Qwen3 and SmolLM2 layouts (read from
/// a Hugging Face `config.json` by [`crate::hf`]) are all configurations of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Number of token ids: at least the tokenizer's `vocab_size` (259 for the byte tokenizer).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of transformer blocks (units `1..=n_layers`).
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention: each serves `n_heads / n_kv_heads` query
    /// heads); `None` is `n_heads` (multi-head attention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_kv_heads: Option<usize>,
    /// Per-head width; `None` is `d_model / n_heads`. Must be even (rotary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Hidden width of the SwiGLU MLP.
    pub d_ff: usize,
    /// Longest sample (positions run `0..max_seq_len`); a packed micro-batch may be longer.
    pub max_seq_len: usize,
    /// Rotary embedding base.
    pub rope_theta: f64,
    /// Llama 3's rescaling of the rotary frequencies (`None`: plain rotary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Biases on the query, key and value projections (Qwen2).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qkv_bias: bool,
    /// RMSNorm of each query and key head before the rotary embedding (Qwen3).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qk_norm: bool,
    /// The LM head is the token embedding (no `lm_head.weight`): the head reads the embedding
    /// unit, whose gradient sums both uses.
    #[serde(default, skip_serializing_if = "is_false")]
    pub tie_embeddings: bool,
    /// LoRA adapters on the blocks' linear layers (`None`: full fine-tuning): the base units
    /// are frozen and each block gets an adapter unit ([`crate::lora`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraConfig>,
    /// Standard deviation of the normal initialisation of every matrix.
    pub init_std: f64,
    /// Seed of the initialisation; each unit draws from its own stream derived from it.
    pub seed: u64,
}

impl ModelConfig {
    /// A small model for a byte-level task (e.g. arithmetic) that trains on two CPU cores in
    /// minutes: 259 tokens (256 bytes + 3 specials), width 128, 4 blocks of 4 heads (head dim 32),
    /// MLP 384, samples up to 512 tokens; 919,424 parameters.
    pub fn tiny() -> Self {
        ModelConfig {
            vocab_size: 259,
            d_model: 128,
            n_layers: 4,
            n_heads: 4,
            n_kv_heads: None,
            head_dim: None,
            d_ff: 384,
            max_seq_len: 512,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rms_eps: 1e-5,
            qkv_bias: false,
            qk_norm: false,
            tie_embeddings: false,
            lora: None,
            init_std: 0.02,
            seed: 0,
        }
    }

    /// A model for one GPU to matter: 12 blocks of width 768 (12 heads of 64), SwiGLU MLP 2560,
    /// samples up to 4,096 tokens, the byte tokenizer's 259 ids; 99,507,456 parameters (8.26 M
    /// per block). Under bf16 mixed precision the attention scores a unit keeps for its backward
    /// take ~26 bytes per head per (query, key) pair: a 2,048-token sample ~1.3 GB per block
    /// (16 GB for the 12), a 4,096-token sample ~5.2 GB per block (63 GB) — so on an 80 GB GPU
    /// shared by two processes, samples up to 2,048 tokens (see `super::attention`).
    pub fn gpu_100m() -> Self {
        ModelConfig {
            vocab_size: 259,
            d_model: 768,
            n_layers: 12,
            n_heads: 12,
            d_ff: 2560,
            max_seq_len: 4096,
            ..ModelConfig::tiny()
        }
    }

    /// One block shaped like Qwen2.5-1.5B's (width 1536, 12 heads of 128 over 2 KV heads, q/k/v
    /// biases, MLP 8960: 46.8 M parameters per block): for per-unit calibration (`odc-bench
    /// calibrate`), not for training.
    pub fn block_1_5b() -> Self {
        ModelConfig {
            vocab_size: 259,
            d_model: 1536,
            n_layers: 1,
            n_heads: 12,
            n_kv_heads: Some(2),
            qkv_bias: true,
            d_ff: 8960,
            max_seq_len: 65_536,
            ..ModelConfig::tiny()
        }
    }

    /// One block shaped like Qwen2.5-7B's (width 3584, 28 heads of 128 over 4 KV heads, q/k/v
    /// biases, MLP 18944: 233.1 M parameters per block), for calibration.
    pub fn block_7b() -> Self {
        ModelConfig {
            vocab_size: 259,
            d_model: 3584,
            n_layers: 1,
            n_heads: 28,
            n_kv_heads: Some(4),
            qkv_bias: true,
            d_ff: 18944,
            max_seq_len: 65_536,
            ..ModelConfig::tiny()
        }
    }

    /// The named configurations ([`Self::PRESETS`]): `tiny`, `gpu-100m`, `block-1.5b`,
    /// `block-7b`.
    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "tiny" => Ok(Self::tiny()),
            "gpu-100m" => Ok(Self::gpu_100m()),
            "block-1.5b" => Ok(Self::block_1_5b()),
            "block-7b" => Ok(Self::block_7b()),
            other => Err(Error::Config {
                field: "preset",
                reason: format!("{other:?} is not one of {}", Self::PRESETS.join(", ")),
            }),
        }
    }

    /// The names [`Self::preset`] knows.
    pub const PRESETS: [&'static str; 4] = ["tiny", "gpu-100m", "block-1.5b", "block-7b"];

    /// Per-head width: `head_dim`, else `d_model / n_heads`.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads.max(1))
    }

    /// Key/value heads: `n_kv_heads`, else `n_heads`.
    pub fn kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// The rotary inverse frequencies `theta^(-2i / head_dim)`, `i < head_dim / 2`, rescaled as
    /// Llama 3 does when [`Self::rope_scaling`] is set (the arithmetic of `transformers`'
    /// `_compute_llama3_parameters`).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let head_dim = self.head_dim();
        let plain =
            (0..head_dim / 2).map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / head_dim as f64));
        let Some(s) = self.rope_scaling else {
            return plain.map(|f| f as f32).collect();
        };
        let old = s.original_max_position_embeddings as f64;
        let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
        plain
            .map(|freq| {
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let scaled = if wavelen < high_wavelen {
                    freq
                } else if wavelen > low_wavelen {
                    freq / s.factor
                } else {
                    let smooth = (old / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * freq / s.factor + smooth * freq
                };
                scaled as f32
            })
            .collect()
    }

    /// Checks every field, returning [`Error::Config`] naming the first that is invalid.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, reason: String| Err(Error::Config { field, reason });
        for (field, value) in [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("d_ff", self.d_ff),
            ("max_seq_len", self.max_seq_len),
        ] {
            if value == 0 {
                return bad(field, "must be nonzero".into());
            }
        }
        if self.vocab_size > u32::MAX as usize {
            return bad("vocab_size", "must fit token ids in u32".into());
        }
        match self.head_dim {
            Some(0) => return bad("head_dim", "must be nonzero".into()),
            Some(h) if h % 2 != 0 => {
                return bad("head_dim", format!("must be even (rotary), is {h}"))
            }
            Some(_) => {}
            None if self.d_model % self.n_heads != 0 => {
                return bad(
                    "n_heads",
                    format!(
                        "must divide d_model = {} (or set head_dim), is {}",
                        self.d_model, self.n_heads
                    ),
                )
            }
            None if self.head_dim() % 2 != 0 => {
                return bad(
                    "d_model",
                    format!(
                        "must give an even head dimension (rotary), d_model / n_heads = {}",
                        self.head_dim()
                    ),
                )
            }
            None => {}
        }
        match self.n_kv_heads {
            Some(kv) if kv == 0 || self.n_heads % kv != 0 => {
                return bad(
                    "n_kv_heads",
                    format!(
                        "must be nonzero and divide n_heads = {}, is {kv}",
                        self.n_heads
                    ),
                )
            }
            _ => {}
        }
        if let Some(lora) = &self.lora {
            lora.validate()?;
        }
        if let Some(s) = &self.rope_scaling {
            if !(s.factor.is_finite() && s.factor >= 1.0) {
                return bad(
                    "rope_scaling",
                    format!("factor must be >= 1, is {}", s.factor),
                );
            }
            if !(s.low_freq_factor.is_finite()
                && s.high_freq_factor.is_finite()
                && 0.0 < s.low_freq_factor
                && s.low_freq_factor < s.high_freq_factor)
            {
                return bad(
                    "rope_scaling",
                    format!(
                        "needs 0 < low_freq_factor < high_freq_factor, has {} and {}",
                        s.low_freq_factor, s.high_freq_factor
                    ),
                );
            }
            if s.original_max_position_embeddings == 0 {
                return bad(
                    "rope_scaling",
                    "original_max_position_embeddings must be nonzero".into(),
                );
            }
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return bad(
                "rope_theta",
                format!("must be finite and > 1, is {}", self.rope_theta),
            );
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return bad(
                "rms_eps",
                format!("must be finite and > 0, is {}", self.rms_eps),
            );
        }
        if !(self.init_std.is_finite() && self.init_std > 0.0) {
            return bad(
                "init_std",
                format!("must be finite and > 0, is {}", self.init_std),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(config: &ModelConfig) -> &'static str {
        match config.validate() {
            Err(Error::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn tiny_is_valid() {
        ModelConfig::tiny().validate().unwrap();
        assert_eq!(ModelConfig::tiny().head_dim(), 32);
    }

    #[test]
    fn presets_are_valid_and_sized_as_stated() {
        for name in ModelConfig::PRESETS {
            ModelConfig::preset(name).unwrap().validate().unwrap();
        }
        assert_eq!(ModelConfig::preset("tiny").unwrap(), ModelConfig::tiny());
        let gpu = ModelConfig::gpu_100m();
        assert_eq!(crate::param_count(&gpu).unwrap(), 99_507_456);
        assert_eq!((gpu.head_dim(), gpu.max_seq_len), (64, 4096));
        let block = |c: &ModelConfig| crate::unit_params(c, 1).unwrap();
        let numel = |c: &ModelConfig| block(c).iter().map(|p| p.numel()).sum::<usize>();
        assert_eq!(numel(&ModelConfig::block_1_5b()), 46_797_824);
        assert_eq!(numel(&ModelConfig::block_7b()), 233_057_792);
        let e = ModelConfig::preset("gpt-5").unwrap_err().to_string();
        assert!(e.contains("gpu-100m"), "{e}");
    }

    #[test]
    fn validate_names_the_bad_field() {
        let base = ModelConfig::tiny();
        type Break = fn(&mut ModelConfig);
        let cases: [(&str, Break); 16] = [
            ("vocab_size", |c| c.vocab_size = 0),
            ("d_model", |c| c.d_model = 0),
            ("n_layers", |c| c.n_layers = 0),
            ("n_heads", |c| c.n_heads = 0),
            ("d_ff", |c| c.d_ff = 0),
            ("max_seq_len", |c| c.max_seq_len = 0),
            ("n_heads", |c| c.n_heads = 3),
            // 128 / 128 = 1: divisible, but the head dimension is odd.
            ("d_model", |c| c.n_heads = 128),
            ("rope_theta", |c| c.rope_theta = f64::NAN),
            ("rms_eps", |c| c.rms_eps = 0.0),
            ("init_std", |c| c.init_std = -1.0),
            ("head_dim", |c| c.head_dim = Some(7)),
            ("head_dim", |c| c.head_dim = Some(0)),
            ("n_kv_heads", |c| c.n_kv_heads = Some(3)),
            ("n_kv_heads", |c| c.n_kv_heads = Some(0)),
            ("rope_scaling", |c| {
                c.rope_scaling = Some(RopeScaling {
                    factor: 8.0,
                    low_freq_factor: 4.0,
                    high_freq_factor: 1.0,
                    original_max_position_embeddings: 8192,
                })
            }),
        ];
        for (field, break_it) in cases {
            let mut config = base.clone();
            break_it(&mut config);
            assert_eq!(field_of(&config), field, "{config:?}");
        }
    }

    #[test]
    fn explicit_head_dim_and_kv_heads() {
        let c = ModelConfig {
            d_model: 64,
            n_heads: 4,
            n_kv_heads: Some(2),
            head_dim: Some(32),
            ..ModelConfig::tiny()
        };
        c.validate().unwrap();
        assert_eq!((c.head_dim(), c.kv_heads()), (32, 2));
        // An explicit head_dim need not divide d_model.
        ModelConfig {
            n_heads: 3,
            head_dim: Some(16),
            ..ModelConfig::tiny()
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn rope_scaling_keeps_short_wavelengths_and_divides_long_ones() {
        let plain = ModelConfig {
            head_dim: Some(64),
            rope_theta: 500_000.0,
            ..ModelConfig::tiny()
        };
        let scaled = ModelConfig {
            rope_scaling: Some(RopeScaling {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
            ..plain.clone()
        };
        let (p, s) = (plain.rope_inv_freq(), scaled.rope_inv_freq());
        assert_eq!(p.len(), 32);
        let wavelen = |f: f32| 2.0 * std::f64::consts::PI / f as f64;
        for (a, b) in p.iter().zip(&s) {
            if wavelen(*a) < 8192.0 / 4.0 {
                assert_eq!(a, b);
            } else if wavelen(*a) > 8192.0 {
                assert!((a / 32.0 - b).abs() <= 1e-6 * a, "{a} {b}");
            } else {
                assert!(b < a && *b > a / 32.0, "{a} {b} interpolated");
            }
        }
        assert!(p.iter().zip(&s).any(|(a, b)| a == b));
        assert!(p.iter().zip(&s).any(|(a, b)| a != b));
    }

    #[test]
    fn config_without_the_new_fields_still_reads() {
        // A checkpoint's config written before GQA, head_dim, biases, q/k norms and ties.
        let old = r#"{"vocab_size":259,"d_model":128,"n_layers":4,"n_heads":4,"d_ff":384,
            "max_seq_len":512,"rope_theta":10000.0,"rms_eps":1e-5,"init_std":0.02,"seed":0}"#;
        let c: ModelConfig = serde_json::from_str(old).unwrap();
        assert_eq!(c, ModelConfig::tiny());
        // And the reference model writes none of them.
        let json = serde_json::to_string(&ModelConfig::tiny()).unwrap();
        assert!(
            !json.contains("n_kv_heads") && !json.contains("tie"),
            "{json}"
        );
    }

    #[test]
    fn config_round_trips_through_json() {
        let config = ModelConfig {
            seed: 7,
            n_kv_heads: Some(2),
            head_dim: Some(16),
            qkv_bias: true,
            qk_norm: true,
            tie_embeddings: true,
            rope_scaling: Some(RopeScaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
            ..ModelConfig::tiny()
        };
        let json = serde_json::to_string(&config).unwrap();
        let back: ModelConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, config);
    }
}
