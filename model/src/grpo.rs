//! GRPO's pieces (DeepSeekMath, arXiv 2402.03300; verl's `grpo` advantage estimator with a
//! `low_var_kl` penalty): group-normalised advantages and the clipped policy-gradient loss with a
//! KL term to a reference model, as a **sum over response tokens** (odc's loss convention: the
//! servers divide by the minibatch's loss tokens, giving verl's `token-mean`).
//!
//! Per target token `t` of a response with advantage `A`:
//!
//! ```text
//! r_t  = exp(lp_t − old_t)                              (old = lp detached: one update per batch)
//! pg_t = max(−A·r_t, −A·clip(r_t, 1 − ε, 1 + ε))
//! kl_t = exp(ref_t − lp_t) − (ref_t − lp_t) − 1         (k3: unbiased, ≥ 0)
//! loss = Σ_t w_t (pg_t + β·kl_t)
//! ```
//!
//! Guarantees (tested): a group whose rewards are all equal has all-zero advantages (nothing to
//! learn from it); one step on the loss raises the log-probability of an above-average response and
//! lowers a below-average one's; with `β > 0` and the policy equal to the reference the KL term
//! and its gradient are zero.

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::batch::Sample;
use super::error::{Error, Result};

/// The denominator's floor in [`group_advantages`].
pub const ADVANTAGE_EPS: f64 = 1e-6;

/// `(r − mean) / (std + eps)` within one group of responses to the same prompt (`std` unbiased, as
/// `torch.std`); a group of one, or of equal rewards, gets zeros.
pub fn group_advantages(rewards: &[f64]) -> Vec<f64> {
    let n = rewards.len();
    if n < 2 {
        return vec![0.0; n];
    }
    let mean = rewards.iter().sum::<f64>() / n as f64;
    let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let std = var.sqrt();
    if std == 0.0 {
        return vec![0.0; n];
    }
    rewards
        .iter()
        .map(|r| (r - mean) / (std + ADVANTAGE_EPS))
        .collect()
}

/// The loss's knobs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GrpoConfig {
    /// PPO clip range `ε`.
    pub clip_eps: f64,
    /// KL coefficient `β`.
    pub kl_coef: f64,
}

impl Default for GrpoConfig {
    /// verl's defaults: ε 0.2, β 0.001.
    fn default() -> Self {
        GrpoConfig {
            clip_eps: 0.2,
            kl_coef: 0.001,
        }
    }
}

/// What a response sample carries for GRPO besides its tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct RlSample {
    /// The response's group-normalised advantage.
    pub advantage: f32,
    /// Per token `t`, the reference model's `log p(token t | tokens < t)` (entry 0 unused), as
    /// long as the sample.
    pub ref_log_probs: Vec<f32>,
}

/// Per pack position (aligned with [`PackedBatch`](super::PackedBatch)'s targets: position `i`
/// predicts token `i + 1` of its sample), the advantage and the reference log-probability of the
/// predicted token: two `[T]` tensors.
pub fn rl_targets(
    samples: &[Sample],
    rl: &[RlSample],
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    rl_targets_with_pieces(samples, rl, &[], device)
}

/// [`rl_targets`] for a gang member's pack ([`PackedBatch::pack_with_pieces`](super::PackedBatch)):
/// the whole `samples`, then each split sample's tokens at its `positions` (its RL data): each
/// gets the sample's advantage and the reference log-probability of the token after it in the
/// whole sample (0 after its last), as the unsplit pack gives the same token. GRPO's loss is a sum
/// over response tokens, so the members' sums add up to the whole sample's.
pub fn rl_targets_with_pieces(
    samples: &[Sample],
    rl: &[RlSample],
    pieces: &[(&RlSample, &[usize])],
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    if samples.len() != rl.len() {
        return Err(Error::Batch(format!(
            "{} samples but RL data for {}",
            samples.len(),
            rl.len()
        )));
    }
    let whole: usize = samples.iter().map(|s| s.tokens.len()).sum();
    let total = whole + pieces.iter().map(|(_, p)| p.len()).sum::<usize>();
    let (mut adv, mut reference) = (Vec::with_capacity(total), Vec::with_capacity(total));
    for (i, (s, r)) in samples.iter().zip(rl).enumerate() {
        let n = s.tokens.len();
        if r.ref_log_probs.len() != n {
            return Err(Error::Batch(format!(
                "sample {i}: {n} tokens but {} reference log-probs",
                r.ref_log_probs.len()
            )));
        }
        adv.extend(std::iter::repeat_n(r.advantage, n));
        reference.extend(r.ref_log_probs.iter().skip(1));
        reference.push(0.0);
    }
    for &(r, positions) in pieces {
        let n = r.ref_log_probs.len();
        for &p in positions {
            if p >= n {
                return Err(Error::Batch(format!(
                    "the split sample's piece has position {p}, but {n} reference log-probs"
                )));
            }
            adv.push(r.advantage);
            reference.push(r.ref_log_probs.get(p + 1).copied().unwrap_or(0.0));
        }
    }
    Ok((
        Tensor::from_vec(adv, total, device)?,
        Tensor::from_vec(reference, total, device)?,
    ))
}

/// `Σ_t w_t (pg_t + β·kl_t)` (see the module docs); all arguments `[T]`, `log_probs` the policy's
/// log-probabilities of the targets (differentiable), `weights` 1 on response targets.
pub fn grpo_loss_sum(
    log_probs: &Tensor,
    advantages: &Tensor,
    ref_log_probs: &Tensor,
    weights: &Tensor,
    config: GrpoConfig,
) -> Result<Tensor> {
    let ratio = (log_probs - log_probs.detach())?.exp()?;
    let clipped = ratio.clamp(1.0 - config.clip_eps, 1.0 + config.clip_eps)?;
    let neg_adv = advantages.neg()?;
    let pg = (&neg_adv * &ratio)?.maximum(&(&neg_adv * &clipped)?)?;
    let diff = (ref_log_probs - log_probs)?;
    let kl = ((diff.exp()? - &diff)? - 1.0)?;
    let per_token = (pg + (kl * config.kl_coef)?)?;
    Ok((per_token * weights)?.sum_all()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::PackedBatch;
    use crate::params::as_tensors;
    use crate::transformer::{head_log_probs, unit_count, unit_forward, UnitOutput};
    use crate::ModelConfig;
    use candle_core::Var;

    #[test]
    fn equal_rewards_give_zero_advantages() {
        assert_eq!(group_advantages(&[0.1, 0.1, 0.1, 0.1]), vec![0.0; 4]);
        assert_eq!(group_advantages(&[1.0]), vec![0.0]);
        assert!(group_advantages(&[]).is_empty());
        let a = group_advantages(&[1.0, 0.0]);
        // mean 0.5, unbiased std 0.7071
        assert!((a[0] - 0.5 / 0.5f64.sqrt()).abs() < 1e-5 && (a[0] + a[1]).abs() < 1e-12);
        let b = group_advantages(&[1.1, 0.0, 0.1, 0.0]);
        assert!(b[0] > 0.0 && b[2] > b[1] && (b.iter().sum::<f64>()).abs() < 1e-9);
    }

    fn config() -> ModelConfig {
        ModelConfig {
            vocab_size: 12,
            d_model: 16,
            n_layers: 1,
            n_heads: 2,
            d_ff: 32,
            max_seq_len: 16,
            init_std: 0.3,
            seed: 9,
            ..ModelConfig::tiny()
        }
    }

    /// Per sample, the summed log-probability of its response tokens under `vars`, and the
    /// per-position log-probs `[T]`.
    fn response_log_probs(
        c: &ModelConfig,
        vars: &[Vec<Var>],
        samples: &[Sample],
    ) -> (Vec<f32>, Tensor, PackedBatch) {
        let batch = PackedBatch::pack(c, samples, &Device::Cpu).unwrap();
        let params: Vec<Vec<Tensor>> = vars.iter().map(|v| as_tensors(v)).collect();
        let mut hidden: Option<Tensor> = None;
        for (u, p) in params.iter().enumerate().take(unit_count(c) - 1) {
            match unit_forward(c, u, p, hidden.as_ref(), &batch).unwrap() {
                UnitOutput::Hidden(h) => hidden = Some(h),
                UnitOutput::Head(_) => unreachable!(),
            }
        }
        let (_, lp) = head_log_probs(
            c,
            &params[unit_count(c) - 1],
            hidden.as_ref().unwrap(),
            &batch,
        )
        .unwrap();
        let per = (&lp * &batch.target_weights)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut sums = Vec::new();
        let mut at = 0;
        for s in samples {
            sums.push(per[at..at + s.tokens.len()].iter().sum());
            at += s.tokens.len();
        }
        (sums, lp, batch)
    }

    /// Two responses to one prompt, rewards 1 and 0: one SGD step on the GRPO loss raises the
    /// log-probability of the rewarded response and widens its lead over the other's (hand-checked
    /// direction: advantages +0.707 and −0.707, ratio 1, gradient −A·∇lp).
    #[test]
    fn the_update_raises_the_above_average_response() {
        let c = config();
        let vars = crate::test_util::init_vars(&c);
        let prompt = [1u32, 2, 3];
        let response = |tail: &[u32]| {
            let tokens: Vec<u32> = prompt.iter().chain(tail).copied().collect();
            let mut loss_mask = vec![false; tokens.len()];
            loss_mask[prompt.len()..].fill(true);
            Sample { tokens, loss_mask }
        };
        let samples = vec![response(&[7, 8, 9]), response(&[4, 4, 5])];
        let advantages = group_advantages(&[1.0, 0.0]);
        let (before, lp, batch) = response_log_probs(&c, &vars, &samples);
        // The reference equals the policy: the KL term is 0 and adds no gradient.
        let lp_now: Vec<f32> = lp.to_vec1().unwrap();
        let mut at = 0;
        let rl: Vec<RlSample> = samples
            .iter()
            .zip(&advantages)
            .map(|(s, a)| {
                let n = s.tokens.len();
                let mut reference = vec![0.0];
                reference.extend(&lp_now[at..at + n - 1]);
                at += n;
                RlSample {
                    advantage: *a as f32,
                    ref_log_probs: reference,
                }
            })
            .collect();
        let (adv, reference) = rl_targets(&samples, &rl, &Device::Cpu).unwrap();
        let cfg = GrpoConfig {
            clip_eps: 0.2,
            kl_coef: 0.1,
        };
        let loss = grpo_loss_sum(&lp, &adv, &reference, &batch.target_weights, cfg).unwrap();
        // At ratio 1 the pg term is −Σ A·w; the KL term is 0.
        let expected: f64 = -advantages.iter().map(|a| a * 3.0).sum::<f64>();
        assert!((loss.to_scalar::<f32>().unwrap() as f64 - expected).abs() < 1e-4);
        let grads = loss.backward().unwrap();
        for var in vars.iter().flatten() {
            let g = grads.get(var.as_tensor()).unwrap();
            var.set(&(var.as_tensor() - (g * 0.05).unwrap()).unwrap())
                .unwrap();
        }
        let (after, _, _) = response_log_probs(&c, &vars, &samples);
        assert!(
            after[0] > before[0],
            "rewarded: {} -> {}",
            before[0],
            after[0]
        );
        // To first order the step moves the gap by lr·0.707·|∇lp₀ − ∇lp₁|² > 0; each response
        // alone can move either way (their gradients share the prompt's).
        assert!(
            after[0] - after[1] > before[0] - before[1],
            "the gap between rewarded and unrewarded: {} -> {}",
            before[0] - before[1],
            after[0] - after[1]
        );
    }

    #[test]
    fn rl_targets_align_with_pack_positions() {
        let samples = vec![
            Sample::all_loss(vec![1, 2, 3]),
            Sample::all_loss(vec![4, 5]),
        ];
        let rl = vec![
            RlSample {
                advantage: 0.5,
                ref_log_probs: vec![0.0, -1.0, -2.0],
            },
            RlSample {
                advantage: -1.0,
                ref_log_probs: vec![0.0, -3.0],
            },
        ];
        let (adv, reference) = rl_targets(&samples, &rl, &Device::Cpu).unwrap();
        assert_eq!(
            adv.to_vec1::<f32>().unwrap(),
            vec![0.5, 0.5, 0.5, -1.0, -1.0]
        );
        // Position i predicts token i + 1: its reference log-prob; last positions predict nothing.
        assert_eq!(
            reference.to_vec1::<f32>().unwrap(),
            vec![-1.0, -2.0, 0.0, -3.0, 0.0]
        );
        let short = vec![RlSample {
            advantage: 0.0,
            ref_log_probs: vec![0.0],
        }];
        assert!(rl_targets(&samples[..1], &short, &Device::Cpu).is_err());
        // A gang member's piece after the whole samples: positions 3, 0 and 4 of a 5-token
        // sample get its advantage and the reference log-prob of the token after each.
        let split = RlSample {
            advantage: 2.0,
            ref_log_probs: vec![0.0, -0.1, -0.2, -0.3, -0.4],
        };
        let piece = [(&split, &[3usize, 0, 4][..])];
        let (adv, reference) =
            rl_targets_with_pieces(&samples[1..], &rl[1..], &piece, &Device::Cpu).unwrap();
        assert_eq!(
            adv.to_vec1::<f32>().unwrap(),
            vec![-1.0, -1.0, 2.0, 2.0, 2.0]
        );
        assert_eq!(
            reference.to_vec1::<f32>().unwrap(),
            vec![-3.0, 0.0, -0.4, -0.1, 0.0]
        );
        let beyond = [(&split, &[5usize][..])];
        let e = rl_targets_with_pieces(&[], &[], &beyond, &Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("position 5"), "{e}");
    }
}
