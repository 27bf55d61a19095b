//! The transformer's hyper-parameters ([`ModelConfig`]), checked by [`ModelConfig::validate`], which
//! names the first bad field. The config is serde-serialisable so it can travel in a checkpoint.

use serde::{Deserialize, Serialize};

use super::error::{Error, Result};

/// Shape and initialisation of the causal transformer of [`crate::model`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Number of token ids: at least the tokenizer's `vocab_size` (259 for the byte tokenizer).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of transformer blocks (units `1..=n_layers`).
    pub n_layers: usize,
    /// Attention heads; `d_model / n_heads` is the head dimension, which must be even (rotary).
    pub n_heads: usize,
    /// Hidden width of the SwiGLU MLP.
    pub d_ff: usize,
    /// Longest sample (positions run `0..max_seq_len`); a packed micro-batch may be longer.
    pub max_seq_len: usize,
    /// Rotary embedding base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
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
            d_ff: 384,
            max_seq_len: 512,
            rope_theta: 10_000.0,
            rms_eps: 1e-5,
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

    /// One block shaped like Qwen2.5-1.5B's (width 1536, 12 heads of 128, MLP 8960; multi-head
    /// attention where Qwen has 2 KV heads, so 50.7 M parameters per block against Qwen's 46.8 M):
    /// for per-unit calibration (`odc-bench calibrate`), not for training.
    pub fn block_1_5b() -> Self {
        ModelConfig {
            vocab_size: 259,
            d_model: 1536,
            n_layers: 1,
            n_heads: 12,
            d_ff: 8960,
            max_seq_len: 65_536,
            ..ModelConfig::tiny()
        }
    }

    /// One block shaped like Qwen2.5-7B's (width 3584, 28 heads of 128, MLP 18944; multi-head
    /// attention where Qwen has 4 KV heads: 255.1 M parameters per block against 233.1 M), for
    /// calibration.
    pub fn block_7b() -> Self {
        ModelConfig {
            vocab_size: 259,
            d_model: 3584,
            n_layers: 1,
            n_heads: 28,
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

    /// Per-head width, `d_model / n_heads`.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads.max(1)
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
        if self.d_model % self.n_heads != 0 {
            return bad(
                "n_heads",
                format!(
                    "must divide d_model = {}, is {}",
                    self.d_model, self.n_heads
                ),
            );
        }
        if self.head_dim() % 2 != 0 {
            return bad(
                "d_model",
                format!(
                    "must give an even head dimension (rotary), d_model / n_heads = {}",
                    self.head_dim()
                ),
            );
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
        assert_eq!(crate::model::param_count(&gpu).unwrap(), 99_507_456);
        assert_eq!((gpu.head_dim(), gpu.max_seq_len), (64, 4096));
        let block = |c: &ModelConfig| crate::model::unit_params(c, 1).unwrap();
        let numel = |c: &ModelConfig| block(c).iter().map(|p| p.numel()).sum::<usize>();
        assert_eq!(numel(&ModelConfig::block_1_5b()), 50_727_936);
        assert_eq!(numel(&ModelConfig::block_7b()), 255_073_280);
        let e = ModelConfig::preset("gpt-5").unwrap_err().to_string();
        assert!(e.contains("gpu-100m"), "{e}");
    }

    #[test]
    fn validate_names_the_bad_field() {
        let base = ModelConfig::tiny();
        type Break = fn(&mut ModelConfig);
        let cases: [(&str, Break); 11] = [
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
        ];
        for (field, break_it) in cases {
            let mut config = base.clone();
            break_it(&mut config);
            assert_eq!(field_of(&config), field, "{config:?}");
        }
    }

    #[test]
    fn config_round_trips_through_json() {
        let config = ModelConfig {
            seed: 7,
            ..ModelConfig::tiny()
        };
        let json = serde_json::to_string(&config).unwrap();
        let back: ModelConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, config);
    }
}
