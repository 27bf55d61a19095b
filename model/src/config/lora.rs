//! LoRA's hyper-parameters as PEFT names them ([`LoraConfig`]: `r`, `lora_alpha`,
//! `target_modules`) and the layers it can adapt ([`LoraTarget`]). The adapters' math is
//! [`crate::lora`]; PEFT's files and merging are [`crate::hf::peft`].

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A linear layer of a block that LoRA can adapt (PEFT's `target_modules` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LoraTarget {
    #[serde(rename = "q_proj")]
    Q,
    #[serde(rename = "k_proj")]
    K,
    #[serde(rename = "v_proj")]
    V,
    #[serde(rename = "o_proj")]
    O,
    #[serde(rename = "gate_proj")]
    Gate,
    #[serde(rename = "up_proj")]
    Up,
    #[serde(rename = "down_proj")]
    Down,
}

impl LoraTarget {
    /// Every linear layer of a block (PEFT's `"all-linear"` on these models).
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// PEFT's name: `q_proj`, …, `down_proj`.
    pub fn name(self) -> &'static str {
        match self {
            LoraTarget::Q => "q_proj",
            LoraTarget::K => "k_proj",
            LoraTarget::V => "v_proj",
            LoraTarget::O => "o_proj",
            LoraTarget::Gate => "gate_proj",
            LoraTarget::Up => "up_proj",
            LoraTarget::Down => "down_proj",
        }
    }

    /// The module path inside a block: `self_attn.q_proj`, `mlp.gate_proj`, ….
    pub fn module(self) -> &'static str {
        match self {
            LoraTarget::Q => "self_attn.q_proj",
            LoraTarget::K => "self_attn.k_proj",
            LoraTarget::V => "self_attn.v_proj",
            LoraTarget::O => "self_attn.o_proj",
            LoraTarget::Gate => "mlp.gate_proj",
            LoraTarget::Up => "mlp.up_proj",
            LoraTarget::Down => "mlp.down_proj",
        }
    }

    /// A target from PEFT's name.
    pub fn parse(name: &str) -> Result<Self> {
        LoraTarget::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| Error::Config {
                field: "lora.targets",
                reason: format!(
                    "{name:?} is not one of {}",
                    LoraTarget::ALL.map(LoraTarget::name).join(", ")
                ),
            })
    }
}

/// LoRA's hyper-parameters (PEFT's `r`, `lora_alpha`, `target_modules`; no dropout, no bias).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// The adapters' rank `r`.
    pub rank: usize,
    /// `lora_alpha`: the update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// The adapted layers of every block, in this order in the adapter unit.
    pub targets: Vec<LoraTarget>,
}

impl LoraConfig {
    /// Rank `rank` on every linear layer, `alpha = 2 · rank` (a scale of 2, the common recipe).
    pub fn new(rank: usize) -> Self {
        LoraConfig {
            rank,
            alpha: 2.0 * rank as f64,
            targets: LoraTarget::ALL.to_vec(),
        }
    }

    /// `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank.max(1) as f64
    }

    /// Checks the fields, naming the first that is invalid.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| {
            Err(Error::Config {
                field: "lora",
                reason,
            })
        };
        if self.rank == 0 {
            return bad("rank must be nonzero".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return bad(format!("alpha must be finite and > 0, is {}", self.alpha));
        }
        if self.targets.is_empty() {
            return bad("needs at least one target module".into());
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(t) = self.targets.iter().find(|t| !seen.insert(**t)) {
            return bad(format!("target {} is listed twice", t.name()));
        }
        Ok(())
    }
}
