//! What a trainer keeps of a unit between its forward and its backward: FSDP2's
//! `reshard_after_forward`, per stage of the model ([`crate::transformer::stages`]).
//!
//! - [`Reshard::Never`] keeps every stage's gathered weights (as the graph's tensors) and graph
//!   until its backward: one pull per unit per micro-batch, but a trainer ends every forward
//!   holding the whole model (FSDP's `reshard_after_forward=False`).
//! - [`Reshard::KeepLast`]`(n)` releases a stage's weights and graph once its forward is done and
//!   keeps only its input (activation checkpointing at unit boundaries); the backward re-gathers
//!   the stage (the context prefetches the next one below while it computes), recomputes its
//!   forward, back-propagates, pushes and releases it. The last `n` stages (at least one: the
//!   head, whose backward starts right after its forward) keep theirs. `KeepLast(1)` is FSDP's
//!   `reshard_after_forward=True` (FSDP2 does not reshard the root module either).
//! - [`Reshard::Auto`] (the default) is `KeepLast(1)` for models of more than
//!   [`RESHARD_ABOVE_PARAMS`] parameters, where the weights a trainer would hold outweigh a
//!   second pull and a recompute (about a third of a step), and `Never` below.
//!
//! Invariants (tested below and in `tests/transformer.rs`): the gradients and the loss do not
//! depend on the choice (within fp32 rounding); resharding pulls every released unit twice per
//! micro-batch and a kept one once.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::transformer::param_count;

/// Models above this many parameters reshard by default ([`Reshard::Auto`]).
pub const RESHARD_ABOVE_PARAMS: usize = 300_000_000;

/// See the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reshard {
    /// `KeepLast(1)` above [`RESHARD_ABOVE_PARAMS`] parameters, else `Never`.
    #[default]
    Auto,
    /// Keep every stage from its forward to its backward (no second pull).
    Never,
    /// Release every stage but the last `n` (at least 1) after its forward; re-gather and
    /// recompute in the backward.
    KeepLast(usize),
}

impl Reshard {
    /// FSDP's `reshard_after_forward=True`.
    pub const ALWAYS: Reshard = Reshard::KeepLast(1);

    /// The choice for `config`: `Auto` decided by its size; `KeepLast(0)` is `KeepLast(1)`.
    pub fn resolve(self, config: &ModelConfig) -> Result<Reshard> {
        Ok(match self {
            Reshard::Auto if param_count(config)? > RESHARD_ABOVE_PARAMS => Reshard::ALWAYS,
            Reshard::Auto => Reshard::Never,
            Reshard::KeepLast(n) => Reshard::KeepLast(n.max(1)),
            Reshard::Never => Reshard::Never,
        })
    }

    /// Whether stage `stage` of `stages` keeps its weights and graph after its forward.
    pub fn keeps(self, stage: usize, stages: usize) -> bool {
        match self {
            Reshard::Auto | Reshard::Never => true,
            Reshard::KeepLast(n) => stage + n.max(1) >= stages,
        }
    }
}

impl std::str::FromStr for Reshard {
    type Err = String;

    /// `auto`, `true` (`KeepLast(1)`), `false` (`Never`), or `N` (`KeepLast(N)`).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Reshard::Auto),
            "true" => Ok(Reshard::ALWAYS),
            "false" => Ok(Reshard::Never),
            n => n.parse::<usize>().map(Reshard::KeepLast).map_err(|_| {
                format!(
                    "reshard-after-forward is auto, true, false or a number of last stages to \
                     keep, not {s:?}"
                )
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_stages_are_kept_and_the_head_always() {
        let kept = |r: Reshard| (0..5).filter(|&s| r.keeps(s, 5)).collect::<Vec<_>>();
        assert_eq!(kept(Reshard::Never), vec![0, 1, 2, 3, 4]);
        assert_eq!(kept(Reshard::ALWAYS), vec![4]);
        assert_eq!(kept(Reshard::KeepLast(0)), vec![4], "the head at least");
        assert_eq!(kept(Reshard::KeepLast(2)), vec![3, 4]);
        assert_eq!(kept(Reshard::KeepLast(9)), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn auto_reshards_only_large_models() {
        let tiny = ModelConfig::tiny();
        assert_eq!(Reshard::Auto.resolve(&tiny).unwrap(), Reshard::Never);
        let large = ModelConfig {
            vocab_size: 151_936,
            d_model: 896,
            n_layers: 24,
            n_heads: 14,
            n_kv_heads: Some(2),
            d_ff: 4864,
            ..ModelConfig::tiny()
        };
        assert_eq!(Reshard::Auto.resolve(&large).unwrap(), Reshard::ALWAYS);
        assert_eq!(Reshard::Never.resolve(&large).unwrap(), Reshard::Never);
    }

    #[test]
    fn flags_parse_as_fsdp_spells_them() {
        assert_eq!("true".parse(), Ok(Reshard::ALWAYS));
        assert_eq!("false".parse(), Ok(Reshard::Never));
        assert_eq!("auto".parse(), Ok(Reshard::Auto));
        assert_eq!("3".parse(), Ok(Reshard::KeepLast(3)));
        let err = "yes".parse::<Reshard>().unwrap_err();
        assert!(err.contains("\"yes\""), "{err}");
    }
}
