//! The batched decoder: prompts of any lengths prefilled together, then every unfinished
//! response advanced one token per forward of the whole batch; a response leaves the batch (its
//! cache rows are dropped) when it draws a stop id or reaches its budget.
//!
//! Guarantees (tested in `super::tests`):
//! - response `i` draws only from `rngs[i]`, and its logits are its own (guarantee 2 of `cache`),
//!   so it is the response one-at-a-time decoding gives with that RNG, whatever else is in the
//!   batch (up to the float rounding of a batched product);
//! - a response ends at its first stop id (kept as its last token: [`Sampling::stop`] or its
//!   prompt's own [`Prompt::stop`]) or at `max_new_tokens`, and never runs past `max_seq_len`.

use candle_core::{Tensor, D};
use rand::Rng;

use super::cache::{prefill, KvCache};
use super::{forward_cached_rows, Generated, Prompt, Sampling, Weights};
use crate::model::error::{Error, Result};
use crate::model::ops::{log_softmax_last_dim, softmax_last_dim};

/// What a batched decode held: its key–value cache at its largest, against the tokens the
/// responses then had (prompt and generated, every response still in the batch).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DecodeStats {
    /// The cache's bytes at their largest ([`KvCache::bytes`]).
    pub peak_cache_bytes: usize,
    /// The tokens of the responses in the batch at that moment: the analytical cache is
    /// `2 × layers × KV heads × head_dim × tokens × 4` bytes.
    pub tokens_at_peak: usize,
}

/// Decodes `prompts` (response `i`, prompt-major, from `rngs[i]`); the log-probs only when
/// `scored` (else left empty).
pub(super) fn decode<R: Rng>(
    w: &Weights,
    prompts: &[Prompt<'_>],
    sampling: &Sampling,
    rngs: &mut [R],
    scored: bool,
) -> Result<(Vec<Generated>, DecodeStats)> {
    sampling.check()?;
    let owner: Vec<usize> = prompts
        .iter()
        .enumerate()
        .flat_map(|(p, prompt)| std::iter::repeat_n(p, prompt.samples))
        .collect();
    if rngs.len() != owner.len() {
        return Err(Error::Batch(format!(
            "{} generators for {} responses (one per response)",
            rngs.len(),
            owner.len()
        )));
    }
    if let Some(p) = (0..prompts.len()).find(|&p| prompts[p].tokens.is_empty()) {
        return Err(Error::Batch(format!("prompt {p} of the batch is empty")));
    }
    let max_seq_len = w.config.max_seq_len;
    let budgets: Vec<usize> = owner
        .iter()
        .map(|&p| {
            let room = max_seq_len.saturating_sub(prompts[p].tokens.len());
            sampling.max_new_tokens.min(room)
        })
        .collect();
    let mut out: Vec<Generated> = budgets
        .iter()
        .map(|&budget| Generated {
            tokens: Vec::with_capacity(budget),
            log_probs: Vec::with_capacity(if scored { budget } else { 0 }),
        })
        .collect();
    // Responses with room to draw, and the prompts they continue (each prefilled once).
    let mut active: Vec<usize> = (0..owner.len()).filter(|&r| budgets[r] > 0).collect();
    let mut fed: Vec<usize> = active.iter().map(|&r| owner[r]).collect();
    fed.dedup();
    let mut stats = DecodeStats::default();
    if fed.is_empty() {
        return Ok((out, stats));
    }
    let mut cache = KvCache::default();
    let texts: Vec<&[u32]> = fed.iter().map(|&p| prompts[p].tokens).collect();
    let last = prefill(w, &mut cache, &texts)?;
    // One row per response: its prompt's row, repeated for a group.
    let rows: Vec<usize> = active
        .iter()
        .map(|&r| fed.binary_search(&owner[r]).unwrap_or(0))
        .collect();
    cache.keep_rows(&rows)?;
    let mut logits = select(&last, &rows)?;
    loop {
        // The cache now holds every active response's tokens but the one about to be drawn.
        if cache.bytes() > stats.peak_cache_bytes {
            stats.peak_cache_bytes = cache.bytes();
            stats.tokens_at_peak = active
                .iter()
                .map(|&r| prompts[owner[r]].tokens.len() + out[r].tokens.len())
                .sum();
        }
        let next = pick_rows(&logits, sampling, &active, rngs)?;
        if scored {
            let rows: Vec<Vec<f32>> = log_softmax_last_dim(&logits)?.to_vec2()?;
            for ((&r, &token), lp) in active.iter().zip(&next).zip(&rows) {
                out[r].log_probs.push(lp[token as usize]);
            }
        }
        let mut keep = Vec::with_capacity(active.len());
        for (slot, (&r, &token)) in active.iter().zip(&next).enumerate() {
            out[r].tokens.push(token);
            let stop = sampling.stop.contains(&token) || prompts[owner[r]].stop.contains(&token);
            if !stop && out[r].tokens.len() < budgets[r] {
                keep.push(slot);
            }
        }
        if keep.is_empty() {
            return Ok((out, stats));
        }
        cache.keep_rows(&keep)?;
        let fed: Vec<u32> = keep.iter().map(|&slot| next[slot]).collect();
        active = keep.iter().map(|&slot| active[slot]).collect();
        logits = forward_cached_rows(w, &mut cache, active.len(), &fed)?;
    }
}

/// Rows `rows` of `t` (in that order, repeats allowed).
fn select(t: &Tensor, rows: &[usize]) -> Result<Tensor> {
    if rows.iter().copied().eq(0..t.dim(0)?) {
        return Ok(t.clone());
    }
    let index: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    let index = Tensor::from_vec(index, rows.len(), t.device())?;
    Ok(t.index_select(&index, 0)?)
}

/// A token per row of `logits: [rows, vocab]` (row `slot` belongs to response `active[slot]`,
/// which draws from `rngs[active[slot]]`): argmax at temperature 0, else a draw from the
/// softmax at the temperature, cut to its top-p nucleus when `top_p < 1`.
fn pick_rows<R: Rng>(
    logits: &Tensor,
    sampling: &Sampling,
    active: &[usize],
    rngs: &mut [R],
) -> Result<Vec<u32>> {
    if sampling.temperature == 0.0 {
        return Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?);
    }
    let probs: Vec<Vec<f32>> = softmax_last_dim(&(logits / sampling.temperature)?)?.to_vec2()?;
    Ok(probs
        .iter()
        .zip(active)
        .map(|(p, &row)| {
            if sampling.top_p < 1.0 {
                draw_nucleus(p, sampling.top_p, &mut rngs[row])
            } else {
                draw(p, &mut rngs[row])
            }
        })
        .collect())
}

/// A token index drawn from the distribution `probs`.
fn draw(probs: &[f32], rng: &mut impl Rng) -> u32 {
    let mut u: f32 = rng.random();
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return i as u32;
        }
        u -= p;
    }
    // Rounding left u just above the total: the last token with any mass.
    probs.iter().rposition(|p| *p > 0.0).unwrap_or(0) as u32
}

/// A token drawn from the top-p nucleus of `probs`: the most likely tokens (ties: lower index
/// first) until their mass reaches `top_p` (the one that crosses it included), renormalised — as
/// Hugging Face's `top_p` does.
fn draw_nucleus(probs: &[f32], top_p: f64, rng: &mut impl Rng) -> u32 {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let mut mass = 0.0f64;
    let mut kept = 0;
    for &i in &order {
        mass += f64::from(probs[i]);
        kept += 1;
        if mass >= top_p {
            break;
        }
    }
    let mut u = rng.random::<f64>() * mass;
    for &i in &order[..kept] {
        let p = f64::from(probs[i]);
        if u < p {
            return i as u32;
        }
        u -= p;
    }
    order[kept.saturating_sub(1)] as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn the_nucleus_keeps_the_most_likely_tokens_until_top_p() {
        let probs = [0.1f32, 0.5, 0.15, 0.25];
        let mut rng = StdRng::seed_from_u64(3);
        // 0.5 alone reaches 0.4: only token 1.
        assert!((0..50).all(|_| draw_nucleus(&probs, 0.4, &mut rng) == 1));
        // 0.5 + 0.25 reaches 0.7: tokens 1 and 3, both drawn, nothing else.
        let drawn: std::collections::BTreeSet<u32> = (0..200)
            .map(|_| draw_nucleus(&probs, 0.7, &mut rng))
            .collect();
        assert_eq!(drawn, [1, 3].into());
        // The whole distribution at top_p 1.
        let drawn: std::collections::BTreeSet<u32> = (0..400)
            .map(|_| draw_nucleus(&probs, 1.0, &mut rng))
            .collect();
        assert_eq!(drawn, [0, 1, 2, 3].into());
    }
}
