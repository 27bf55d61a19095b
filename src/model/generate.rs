//! Sampling from the model with a key–value cache, so a response of `n` tokens costs `n` one-token
//! forwards, not `n` forwards of a growing sequence.
//!
//! Guarantees (tested):
//! 1. **cache equivalence**: the logits of a prompt fed at once, or token by token through the
//!    cache, equal the training forward's logits of the same sequence (within 1e-4);
//! 2. greedy decoding (`temperature == 0`) is deterministic; sampling at `temperature > 0` draws
//!    from `softmax(logits / temperature)` with the caller's seeded RNG, so a run is reproducible;
//! 3. a response stops at the stop token (kept as its last token) or at `max_new_tokens`, and never
//!    runs past `max_seq_len` positions.

use candle_core::{Device, Tensor, D};
use rand::Rng;

use super::batch::MASKED;
use super::block::mlp_residual;
use super::config::ModelConfig;
use super::error::{Error, Result};
use super::ops::{rms_norm, rope, rope_cos_sin, softmax_last_dim};
use super::params::unit_tensors;
use super::transformer::{unit_count, unit_params};

/// The model's weights as plain tensors (no gradients), for inference.
#[derive(Debug, Clone)]
pub struct Weights {
    config: ModelConfig,
    units: Vec<Vec<Tensor>>,
}

impl Weights {
    /// From each unit's flat buffer (as [`Job::parameters`](crate::Job::parameters) returns them).
    pub fn from_units(config: &ModelConfig, units: &[Vec<f32>], device: &Device) -> Result<Self> {
        config.validate()?;
        if units.len() != unit_count(config) {
            return Err(Error::UnitParams {
                what: "units",
                expected: unit_count(config),
                got: units.len(),
            });
        }
        let units = units
            .iter()
            .enumerate()
            .map(|(u, values)| unit_tensors(values, &unit_params(config, u)?, device))
            .collect::<Result<Vec<_>>>()?;
        Ok(Weights {
            config: config.clone(),
            units,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
}

/// Keys and values of every block for the tokens fed so far, `[heads, t, head_dim]` each.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    /// Tokens fed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Feeds `tokens` after those in `cache` and returns their logits, `[tokens.len(), vocab]`.
pub fn forward_cached(w: &Weights, cache: &mut KvCache, tokens: &[u32]) -> Result<Tensor> {
    let c = &w.config;
    let n = tokens.len();
    if n == 0 {
        return Err(Error::Batch("no tokens to feed".into()));
    }
    let start = cache.len;
    if start + n > c.max_seq_len {
        return Err(Error::Batch(format!(
            "{} positions are past max_seq_len {}",
            start + n,
            c.max_seq_len
        )));
    }
    if let Some(t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
        return Err(Error::Batch(format!(
            "token {t} is past vocab_size {}",
            c.vocab_size
        )));
    }
    let device = w.units[0][0].device();
    cache.layers.resize(c.n_layers, None);
    let ids = Tensor::from_slice(tokens, n, device)?;
    let positions: Vec<u32> = (start as u32..(start + n) as u32).collect();
    let positions = Tensor::from_vec(positions, n, device)?;
    let (cos, sin) = rope_cos_sin(&positions, c.head_dim(), c.rope_theta)?;
    // New token i (position start + i) sees keys 0..=start + i.
    let total = start + n;
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..total).map(move |j| if j <= start + i { 0.0 } else { MASKED }))
        .collect();
    let mask = Tensor::from_vec(mask, (n, total), device)?;

    let mut x = w.units[0][0].index_select(&ids, 0)?;
    for layer in 0..c.n_layers {
        let p = &w.units[layer + 1];
        let n_in = rms_norm(&x, &p[0], c.rms_eps)?;
        let (h, hd) = (c.n_heads, c.head_dim());
        let heads = |m: &Tensor| -> Result<Tensor> {
            Ok(n_in
                .matmul(&m.t()?)?
                .reshape((n, h, hd))?
                .transpose(0, 1)?
                .contiguous()?)
        };
        let q = rope(&heads(&p[1])?, &cos, &sin)?;
        let k_new = rope(&heads(&p[2])?, &cos, &sin)?;
        let v_new = heads(&p[3])?;
        let (k, v) = match cache.layers[layer].take() {
            None => (k_new, v_new),
            Some((k, v)) => (
                Tensor::cat(&[&k, &k_new], 1)?,
                Tensor::cat(&[&v, &v_new], 1)?,
            ),
        };
        let scale = 1.0 / (hd as f64).sqrt();
        let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?.broadcast_add(&mask)?;
        let attn = softmax_last_dim(&scores)?
            .matmul(&v)?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((n, c.d_model))?
            .matmul(&p[4].t()?)?;
        cache.layers[layer] = Some((k, v));
        let hidden = (&x + attn)?;
        x = mlp_residual(c, &hidden, [&p[5], &p[6], &p[7], &p[8]])?;
    }
    let head = &w.units[c.n_layers + 1];
    cache.len = total;
    Ok(rms_norm(&x, &head[0], c.rms_eps)?.matmul(&head[1].t()?)?)
}

/// Per token `t` of `tokens`, `log p(token t | tokens < t)` under `w` (entry 0, which nothing
/// predicts, is 0): one cached forward over the sequence.
pub fn sequence_log_probs(w: &Weights, tokens: &[u32]) -> Result<Vec<f32>> {
    let mut cache = KvCache::default();
    let logits = forward_cached(w, &mut cache, tokens)?;
    let log_probs: Vec<Vec<f32>> = super::ops::log_softmax_last_dim(&logits)?.to_vec2()?;
    let mut out = Vec::with_capacity(tokens.len());
    out.push(0.0);
    for t in 1..tokens.len() {
        out.push(log_probs[t - 1][tokens[t] as usize]);
    }
    Ok(out)
}

/// How to draw a response.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the most likely token); otherwise the softmax temperature.
    pub temperature: f64,
    /// Most tokens generated after the prompt.
    pub max_new_tokens: usize,
    /// The token that ends a response (kept as its last token).
    pub stop: u32,
}

/// The response to `prompt`: generated tokens only (ending with `sampling.stop` if it was drawn).
pub fn generate(
    w: &Weights,
    prompt: &[u32],
    sampling: Sampling,
    rng: &mut impl Rng,
) -> Result<Vec<u32>> {
    if !(sampling.temperature.is_finite() && sampling.temperature >= 0.0) {
        return Err(Error::Batch(format!(
            "temperature must be finite and >= 0, got {}",
            sampling.temperature
        )));
    }
    let mut cache = KvCache::default();
    let room = w.config.max_seq_len.saturating_sub(prompt.len());
    let budget = sampling.max_new_tokens.min(room);
    let mut out = Vec::with_capacity(budget);
    if budget == 0 {
        return Ok(out);
    }
    let mut logits = forward_cached(w, &mut cache, prompt)?;
    loop {
        let last = logits.get(logits.dim(0)? - 1)?;
        let next = pick(&last, sampling.temperature, rng)?;
        out.push(next);
        if next == sampling.stop || out.len() >= budget {
            return Ok(out);
        }
        logits = forward_cached(w, &mut cache, &[next])?;
    }
}

/// A token from `logits: [vocab]`: argmax at temperature 0, else a draw.
fn pick(logits: &Tensor, temperature: f64, rng: &mut impl Rng) -> Result<u32> {
    if temperature == 0.0 {
        return Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?);
    }
    let probs: Vec<f32> = softmax_last_dim(&(logits / temperature)?)?.to_vec1()?;
    let mut u: f32 = rng.random();
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return Ok(i as u32);
        }
        u -= p;
    }
    // Rounding left u just above the total: the last token with any mass.
    Ok(probs.iter().rposition(|p| *p > 0.0).unwrap_or(0) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::batch::{PackedBatch, Sample};
    use crate::model::ops::tests::max_abs_diff;
    use crate::model::transformer::{model_forward, unit_init_values};
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn config() -> ModelConfig {
        ModelConfig {
            vocab_size: 16,
            d_model: 32,
            n_layers: 2,
            n_heads: 4,
            d_ff: 48,
            max_seq_len: 24,
            init_std: 0.3,
            seed: 5,
            ..ModelConfig::tiny()
        }
    }

    fn weights(c: &ModelConfig) -> Weights {
        let units: Vec<Vec<f32>> = (0..unit_count(c))
            .map(|u| unit_init_values(c, u).unwrap())
            .collect();
        Weights::from_units(c, &units, &Device::Cpu).unwrap()
    }

    #[test]
    fn cached_logits_equal_the_training_forward() {
        let c = config();
        let w = weights(&c);
        let tokens: Vec<u32> = vec![1, 5, 9, 2, 14, 3, 3, 7];
        let batch =
            PackedBatch::pack(&c, &[Sample::all_loss(tokens.clone())], &Device::Cpu).unwrap();
        let full = model_forward(&c, &w.units, &batch).unwrap().logits;
        // All at once.
        let mut cache = KvCache::default();
        let at_once = forward_cached(&w, &mut cache, &tokens).unwrap();
        assert!(max_abs_diff(&at_once, &full) < 1e-4);
        // A prefix, then one token at a time.
        let mut cache = KvCache::default();
        let mut rows = vec![forward_cached(&w, &mut cache, &tokens[..3]).unwrap()];
        for t in &tokens[3..] {
            rows.push(forward_cached(&w, &mut cache, &[*t]).unwrap());
        }
        assert_eq!(cache.len(), tokens.len());
        let stepped = Tensor::cat(&rows, 0).unwrap();
        assert!(
            max_abs_diff(&stepped, &full) < 1e-4,
            "{}",
            max_abs_diff(&stepped, &full)
        );
    }

    #[test]
    fn greedy_is_deterministic_and_stops_within_bounds() {
        let c = config();
        let w = weights(&c);
        let s = Sampling {
            temperature: 0.0,
            max_new_tokens: 50,
            stop: 15,
        };
        let mut rng = StdRng::seed_from_u64(1);
        let a = generate(&w, &[1, 2, 3], s, &mut rng).unwrap();
        let b = generate(&w, &[1, 2, 3], s, &mut rng).unwrap();
        assert_eq!(a, b);
        assert!(!a.is_empty() && a.len() <= 24 - 3, "{} tokens", a.len());
        assert!(a
            .iter()
            .position(|&t| t == 15)
            .is_none_or(|i| i == a.len() - 1));
    }

    #[test]
    fn sampling_is_reproducible_per_seed_and_varies_across_seeds() {
        let c = config();
        let w = weights(&c);
        let s = Sampling {
            temperature: 1.5,
            max_new_tokens: 12,
            stop: 99,
        };
        let draw = |seed| generate(&w, &[4], s, &mut StdRng::seed_from_u64(seed)).unwrap();
        assert_eq!(draw(3), draw(3));
        let distinct: std::collections::HashSet<Vec<u32>> = (0..8).map(draw).collect();
        assert!(distinct.len() > 1, "every seed drew the same response");
        assert!(draw(4).iter().all(|&t| (t as usize) < c.vocab_size));
    }

    #[test]
    fn sequence_log_probs_are_the_training_forwards() {
        let c = config();
        let w = weights(&c);
        let tokens: Vec<u32> = vec![3, 1, 4, 1, 5, 9];
        let lp = sequence_log_probs(&w, &tokens).unwrap();
        let batch =
            PackedBatch::pack(&c, &[Sample::all_loss(tokens.clone())], &Device::Cpu).unwrap();
        let (_, per) = crate::model::transformer::head_log_probs(
            &c,
            &w.units[c.n_layers + 1],
            &{
                let mut h = w.units[0][0].index_select(&batch.tokens, 0).unwrap();
                for l in 0..c.n_layers {
                    h = crate::model::block::block_forward(&c, &w.units[l + 1], &h, &batch)
                        .unwrap();
                }
                h
            },
            &batch,
        )
        .unwrap();
        let per: Vec<f32> = per.to_vec1().unwrap();
        assert_eq!(lp.len(), tokens.len());
        for t in 1..tokens.len() {
            assert!(
                (lp[t] - per[t - 1]).abs() < 1e-4,
                "token {t}: {} vs {}",
                lp[t],
                per[t - 1]
            );
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let c = config();
        let w = weights(&c);
        let mut cache = KvCache::default();
        assert!(forward_cached(&w, &mut cache, &[]).is_err());
        assert!(forward_cached(&w, &mut cache, &[16]).is_err());
        assert!(forward_cached(&w, &mut cache, &[1; 25]).is_err());
        let s = Sampling {
            temperature: f64::NAN,
            max_new_tokens: 1,
            stop: 0,
        };
        assert!(generate(&w, &[1], s, &mut StdRng::seed_from_u64(0)).is_err());
    }
}
