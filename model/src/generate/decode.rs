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

use super::cache::{forward_cached_rows, prefill, KvCache};
use super::sampling::{Generated, Prompt, Sampling};
use super::weights::Weights;
use crate::error::{Error, Result};
use crate::ops::{log_softmax_last_dim, softmax_last_dim};

/// What a batched decode held: its key–value cache at its largest, against the tokens the
/// responses then had (prompt and generated, every response still in the batch), and how often
/// it dropped finished responses' rows.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DecodeStats {
    /// The cache's bytes at their largest ([`KvCache::bytes`]).
    pub peak_cache_bytes: usize,
    /// The tokens of the responses in the batch at that moment: the analytical cache is
    /// `2 × layers × KV heads × head_dim × tokens × 4` bytes (× 2 in bf16).
    pub tokens_at_peak: usize,
    /// Times the cache dropped finished responses' rows (each a copy of the rows it keeps).
    pub compactions: usize,
}

/// A finished response's row stays in the cache (fed a token whose result nothing reads) until
/// at least this fraction of the rows are finished: then one copy drops them all, instead of a
/// copy of the whole cache each time a response ends.
const FINISHED_ROWS_KEPT: f64 = 0.25;

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
    // Every column the decode can fill, made at once: no copy of the cache as it grows.
    let longest = texts.iter().map(|t| t.len()).max().unwrap_or(0);
    cache.reserve(longest + active.iter().map(|&r| budgets[r]).max().unwrap_or(0));
    let last = prefill(w, &mut cache, &texts)?;
    // One row per response: its prompt's row, repeated for a group.
    let rows: Vec<usize> = active
        .iter()
        .map(|&r| fed.binary_search(&owner[r]).unwrap_or(0))
        .collect();
    cache.keep_rows(&rows)?;
    let mut logits = select(&last, &rows)?;
    // The cache's rows: each a response still drawing, or `None` once it finished (its row kept
    // until enough are finished: `FINISHED_ROWS_KEPT`).
    let mut slots: Vec<Option<usize>> = active.iter().copied().map(Some).collect();
    loop {
        // The cache now holds every active response's tokens but the one about to be drawn.
        if cache.bytes() > stats.peak_cache_bytes {
            stats.peak_cache_bytes = cache.bytes();
            stats.tokens_at_peak = active
                .iter()
                .map(|&r| prompts[owner[r]].tokens.len() + out[r].tokens.len())
                .sum();
        }
        // The live rows' logits (all of them while no row is finished).
        let live: Vec<usize> = (0..slots.len()).filter(|&i| slots[i].is_some()).collect();
        let live_logits = select(&logits, &live)?;
        let next = pick_rows(&live_logits, sampling, &active, rngs)?;
        if scored {
            // Only the drawn tokens' log-probs leave the device.
            let picked = Tensor::from_slice(&next, (next.len(), 1), logits.device())?;
            let lp = log_softmax_last_dim(&live_logits)?.gather(&picked, 1)?;
            for (&r, lp) in active.iter().zip(lp.flatten_all()?.to_vec1::<f32>()?) {
                out[r].log_probs.push(lp);
            }
        }
        // Each row's next token: a live row's draw; a finished row's is never read.
        let mut fed = vec![PAD_FED; slots.len()];
        for ((&slot, &r), &token) in live.iter().zip(&active).zip(&next) {
            out[r].tokens.push(token);
            fed[slot] = token;
            let stop = sampling.stop.contains(&token) || prompts[owner[r]].stop.contains(&token);
            if stop || out[r].tokens.len() >= budgets[r] {
                slots[slot] = None;
            }
        }
        active = slots.iter().flatten().copied().collect();
        if active.is_empty() {
            return Ok((out, stats));
        }
        let finished = slots.len() - active.len();
        // A finished row at the model's last position has no room for another column.
        let full = (0..slots.len())
            .any(|i| slots[i].is_none() && cache.len() + 1 - cache.padding(i) > max_seq_len);
        if full || finished as f64 >= FINISHED_ROWS_KEPT * slots.len() as f64 {
            let keep: Vec<usize> = (0..slots.len()).filter(|&i| slots[i].is_some()).collect();
            cache.keep_rows(&keep)?;
            fed = keep.iter().map(|&i| fed[i]).collect();
            slots = active.iter().copied().map(Some).collect();
            stats.compactions += 1;
        }
        logits = forward_cached_rows(w, &mut cache, slots.len(), &fed)?;
    }
}

/// What a finished row is fed (any id the vocabulary holds: its results are never read).
const PAD_FED: u32 = 0;

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
    let probs = softmax_last_dim(&(logits / sampling.temperature)?)?;
    if sampling.top_p >= 1.0 {
        return draw_rows(&probs, active, rngs);
    }
    let probs: Vec<Vec<f32>> = probs.to_vec2()?;
    Ok(probs
        .iter()
        .zip(active)
        .map(|(p, &row)| draw_nucleus(p, sampling.top_p, &mut rngs[row]))
        .collect())
}

/// Columns per block of [`draw_rows`]' two-level draw.
const DRAW_BLOCK: usize = 256;

/// A token per row of `probs: [rows, vocab]`, each drawn with one uniform of its response's
/// generator, reading little of the distribution back from the device: the mass of each block
/// of [`DRAW_BLOCK`] columns (`rows × vocab / 256` values), then the block the uniform falls in
/// (`rows × 256`), where [`draw_at`] finishes. A row's draw depends on its own probabilities and
/// uniform only, so it is the same in any batch.
fn draw_rows<R: Rng>(probs: &Tensor, active: &[usize], rngs: &mut [R]) -> Result<Vec<u32>> {
    let (rows, vocab) = probs.dims2()?;
    let blocks = vocab.div_ceil(DRAW_BLOCK);
    let padded = match blocks * DRAW_BLOCK - vocab {
        0 => probs.clone(),
        pad => {
            let zeros = Tensor::zeros((rows, pad), probs.dtype(), probs.device())?;
            Tensor::cat(&[probs, &zeros], 1)?
        }
    };
    let mass: Vec<Vec<f32>> = padded
        .reshape((rows, blocks, DRAW_BLOCK))?
        .sum(2)?
        .to_vec2()?;
    let mut at = Vec::with_capacity(rows);
    for (row_mass, &r) in mass.iter().zip(active) {
        let mut u: f32 = rngs[r].random();
        // Rounding may leave `u` past the whole mass: then the last token with any, as `draw_at`.
        let last = row_mass.iter().rposition(|m| *m > 0.0).unwrap_or(0);
        let mut block = 0;
        while block < last && u >= row_mass[block] {
            u -= row_mass[block];
            block += 1;
        }
        at.push((block, u));
    }
    let columns: Vec<u32> = at
        .iter()
        .flat_map(|&(block, _)| (0..DRAW_BLOCK).map(move |j| (block * DRAW_BLOCK + j) as u32))
        .collect();
    let columns = Tensor::from_vec(columns, (rows, DRAW_BLOCK), probs.device())?;
    let within: Vec<Vec<f32>> = padded.gather(&columns, 1)?.to_vec2()?;
    Ok(at
        .iter()
        .zip(&within)
        .map(|(&(block, u), p)| (block * DRAW_BLOCK) as u32 + draw_at(p, u))
        .collect())
}

/// A token index drawn from the distribution `probs` with the uniform `u`.
#[cfg(test)]
fn draw(probs: &[f32], rng: &mut impl Rng) -> u32 {
    draw_at(probs, rng.random())
}

/// The index where `u` (in `[0, 1)` of the mass) falls in `probs`, walked in order.
fn draw_at(probs: &[f32], mut u: f32) -> u32 {
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

    /// The two-level draw picks what one walk over the whole row picks with the same uniform
    /// (probabilities in multiples of 2^-20, whose sums are exact in f32), over rows of a vocabulary
    /// that is not a multiple of the block, in one batch.
    #[test]
    fn the_blocked_draw_equals_the_walk_over_the_whole_row() {
        let vocab = 3 * DRAW_BLOCK + 77;
        let mut rng = StdRng::seed_from_u64(9);
        let rows: Vec<Vec<f32>> = (0..6)
            .map(|_| {
                let weights: Vec<u32> = (0..vocab).map(|_| rng.random_range(0..64)).collect();
                let total: u32 = weights.iter().sum();
                // Scaled to multiples of 2^-20 that sum to at most 1.
                let unit = (1u32 << 20) / total;
                weights
                    .iter()
                    .map(|&w| (w * unit) as f32 / (1u32 << 20) as f32)
                    .collect()
            })
            .collect();
        let flat: Vec<f32> = rows.concat();
        let probs = Tensor::from_vec(flat, (6, vocab), &candle_core::Device::Cpu).unwrap();
        let active: Vec<usize> = (0..6).collect();
        for seed in 0..40u64 {
            let mut blocked: Vec<StdRng> = (0..6)
                .map(|r| StdRng::seed_from_u64(seed * 7 + r))
                .collect();
            let got = draw_rows(&probs, &active, &mut blocked).unwrap();
            for (r, row) in rows.iter().enumerate() {
                let mut one = StdRng::seed_from_u64(seed * 7 + r as u64);
                assert_eq!(got[r], draw(row, &mut one), "seed {seed}, row {r}");
                assert!((got[r] as usize) < vocab);
            }
        }
    }
}
