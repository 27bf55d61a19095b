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
