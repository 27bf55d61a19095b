//! Sampling from the model with a key–value cache, so a response of `n` tokens costs `n` one-token
//! forwards, not `n` forwards of a growing sequence.
//!
//! Guarantees (tested):
//! 1. **cache equivalence**: the logits of a prompt fed at once, or token by token through the
//!    cache, equal the training forward's logits of the same sequence (within 1e-4);
//! 2. greedy decoding (`temperature == 0`) is deterministic; sampling at `temperature > 0` draws
//!    from `softmax(logits / temperature)` with the caller's seeded RNG, so a run is reproducible;
//! 3. a response stops at the stop token (kept as its last token) or at `max_new_tokens`, and never
//!    runs past `max_seq_len` positions;
//! 4. **group equivalence**: [`generate_group`] decodes a group of responses to one prompt as one
//!    batch (the prompt fed once, finished responses leaving the batch), and each response is the
//!    one [`generate`] draws with the same RNG; the batched logits equal each row's own;
//! 5. [`generate_group_with_log_probs`] also gives each sampled token's log-probability under the
//!    model (temperature 1), read off the logits the decoder computes anyway: they equal
//!    [`sequence_log_probs`] of prompt and response (within 1e-4).

use candle_core::{DType, Device, Tensor, D};
use rand::Rng;

use super::attention::{attend, repeat_kv};
use super::batch::MASKED;
use super::block::{block_forward_with, BlockWeights};
use super::config::{MlpImpl, ModelConfig};
use super::error::{Error, Result};
use super::ops::{log_softmax_last_dim, rms_norm, rope_cos_sin, softmax_last_dim};
use super::params::unit_tensors;
use super::transformer::{check_unit_count, head_tensors, unit_count, unit_params, Unit};

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
        check_unit_count(config, units.len())?;
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

    /// Block `layer`'s tensors as its forward takes them (its adapters' after them, under LoRA).
    fn block_tensors(&self, layer: usize) -> Vec<Tensor> {
        let mut tensors = self.units[Unit::Block(layer).index(&self.config)].clone();
        if self.config.lora.is_some() {
            tensors.extend(
                self.units[Unit::Adapter(layer).index(&self.config)]
                    .iter()
                    .cloned(),
            );
        }
        tensors
    }
}

/// Keys and values of every block for the tokens fed so far: `rows` sequences at the same
/// positions (one, or a group of responses to one prompt). Each block's keys and values live in
/// buffers of `[rows, kv_heads, capacity, head_dim]` (capacity: the positions fed so far rounded
/// up to a power of two, at least 64, at most `max_seq_len`; grown by copying when a feed passes
/// it); a feed writes its
/// positions in place and attention reads the filled prefix as a view, so a token costs no copy of
/// the cache (not `Clone`: a copy would share the buffers).
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
    rows: usize,
}

impl KvCache {
    /// Tokens fed so far (per row).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sequences in the cache (0 before the first feed).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Copies a one-row cache into `rows` identical rows: a prompt fed once, then continued by
    /// a group of responses.
    pub fn repeat_rows(&mut self, rows: usize) -> Result<()> {
        if self.rows != 1 || rows == 0 {
            return Err(Error::Batch(format!(
                "only a one-row cache can be repeated (into at least one row); it has {} rows",
                self.rows
            )));
        }
        for (k, v) in self.layers.iter_mut() {
            let repeat = |t: &Tensor| -> Result<Tensor> {
                let mut dims = t.dims().to_vec();
                dims[0] = rows;
                Ok(t.broadcast_as(dims)?.contiguous()?)
            };
            (*k, *v) = (repeat(k)?, repeat(v)?);
        }
        self.rows = rows;
        Ok(())
    }

    /// Keeps only the rows `keep` (indices of the current rows), in that order: the
    /// responses still being generated.
    pub fn keep_rows(&mut self, keep: &[usize]) -> Result<()> {
        if keep.is_empty() || keep.iter().any(|&r| r >= self.rows) {
            return Err(Error::Batch(format!(
                "rows {keep:?} to keep are not a non-empty subset of the cache's {}",
                self.rows
            )));
        }
        if keep.len() == self.rows {
            return Ok(());
        }
        let device = match self.layers.first() {
            Some((k, _)) => k.device().clone(),
            None => return Err(Error::Batch("an empty cache has no rows to keep".into())),
        };
        let index: Vec<u32> = keep.iter().map(|&r| r as u32).collect();
        let index = Tensor::from_vec(index, keep.len(), &device)?;
        for (k, v) in self.layers.iter_mut() {
            (*k, *v) = (k.index_select(&index, 0)?, v.index_select(&index, 0)?);
        }
        self.rows = keep.len();
        Ok(())
    }
}

/// Feeds `tokens` after those in `cache` and returns their logits, `[tokens.len(), vocab]`.
pub fn forward_cached(w: &Weights, cache: &mut KvCache, tokens: &[u32]) -> Result<Tensor> {
    forward_cached_rows(w, cache, 1, tokens)
}

/// Feeds `rows` sequences of `tokens.len() / rows` tokens each (row-major) after those in `cache`,
/// all at the same positions, and returns their logits, `[tokens.len(), vocab]` (row-major). A
/// cache that already holds tokens must hold `rows` rows.
pub fn forward_cached_rows(
    w: &Weights,
    cache: &mut KvCache,
    rows: usize,
    tokens: &[u32],
) -> Result<Tensor> {
    let c = &w.config;
    if tokens.is_empty() || rows == 0 || tokens.len() % rows != 0 {
        return Err(Error::Batch(format!(
            "{} tokens do not make {rows} non-empty rows",
            tokens.len()
        )));
    }
    if !cache.is_empty() && cache.rows != rows {
        return Err(Error::Batch(format!(
            "{rows} rows fed to a cache of {}",
            cache.rows
        )));
    }
    let n = tokens.len() / rows;
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
    let (kv_heads, hd) = (c.kv_heads(), c.head_dim());
    // Capacity for the positions used so far, doubled as they grow (at most max_seq_len): a
    // model whose config allows 128K positions does not allocate them for a 300-token answer.
    let total = start + n;
    let capacity = cache
        .layers
        .first()
        .map_or(0, |(k, _)| k.dim(2).unwrap_or(0));
    if total > capacity {
        let grown = total
            .next_power_of_two()
            .max(64)
            .min(c.max_seq_len.max(total));
        let buffer = || Tensor::zeros((rows, kv_heads, grown, hd), DType::F32, device);
        let mut layers = Vec::with_capacity(c.n_layers);
        for layer in 0..c.n_layers {
            let (k, v) = (buffer()?, buffer()?);
            if let (Some((old_k, old_v)), true) = (cache.layers.get(layer), start > 0) {
                k.slice_set(&old_k.narrow(2, 0, start)?.contiguous()?, 2, 0)?;
                v.slice_set(&old_v.narrow(2, 0, start)?.contiguous()?, 2, 0)?;
            }
            layers.push((k, v));
        }
        cache.layers = layers;
    }
    // candle's CPU matmul reads strided views; other backends want them contiguous.
    let view =
        |t: Tensor| -> Result<Tensor> { Ok(if device.is_cpu() { t } else { t.contiguous()? }) };
    let ids = Tensor::from_slice(tokens, tokens.len(), device)?;
    let positions: Vec<u32> = (start as u32..(start + n) as u32).collect();
    let positions = Tensor::from_vec(positions, n, device)?;
    let (cos, sin) = rope_cos_sin(&positions, &c.rope_inv_freq())?;
    // New token i (position start + i) sees keys 0..=start + i of its own row.
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..total).map(move |j| if j <= start + i { 0.0 } else { MASKED }))
        .collect();
    let mask = Tensor::from_vec(mask, (n, total), device)?;
    let groups = c.n_heads / kv_heads;

    // Hidden states stay `[rows * n, d_model]`; only attention sees `[rows, heads, n, head_dim]`.
    let mut x = w.units[0][0].index_select(&ids, 0)?;
    for layer in 0..c.n_layers {
        let params = w.block_tensors(layer);
        let block = BlockWeights::new(c, &params)?;
        let (k_buf, v_buf) = &cache.layers[layer];
        // The block's attention: the new keys and values go into the cache in place, and the
        // queries read the filled prefix.
        let mut cached = |q: &Tensor, k_new: &Tensor, v_new: &Tensor| -> Result<Tensor> {
            k_buf.slice_set(k_new, 2, start)?;
            v_buf.slice_set(v_new, 2, start)?;
            let k = view(repeat_kv(&k_buf.narrow(2, 0, total)?, groups)?)?;
            let v = view(repeat_kv(&v_buf.narrow(2, 0, total)?, groups)?)?;
            attend(q, &k, &v, &mask)
        };
        // Decoding keeps no graph: candle's ops (the chunked MLP would copy gate and up per call).
        let mlp = MlpImpl::Full;
        x = block_forward_with(c, &block, &x, rows, (&cos, &sin), &mut cached, mlp)?;
    }
    cache.len = total;
    cache.rows = rows;
    let head = head_tensors(c, &w.units[unit_count(c) - 1], &w.units[0][0]);
    Ok(rms_norm(&x, &head[0], c.rms_eps)?.matmul(&head[1].t()?)?)
}

/// Per token `t` of `tokens`, `log p(token t | tokens < t)` under `w` (entry 0, which nothing
/// predicts, is 0): one cached forward over the sequence.
pub fn sequence_log_probs(w: &Weights, tokens: &[u32]) -> Result<Vec<f32>> {
    let mut cache = KvCache::default();
    let logits = forward_cached(w, &mut cache, tokens)?;
    let log_probs: Vec<Vec<f32>> = log_softmax_last_dim(&logits)?.to_vec2()?;
    let mut out = Vec::with_capacity(tokens.len());
    out.push(0.0);
    for t in 1..tokens.len() {
        out.push(log_probs[t - 1][tokens[t] as usize]);
    }
    Ok(out)
}

/// How to draw a response.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the most likely token); otherwise the softmax temperature.
    pub temperature: f64,
    /// Most tokens generated after the prompt.
    pub max_new_tokens: usize,
    /// The tokens that end a response (the one drawn is kept as its last token): the
    /// tokenizer's [`stop_ids`](crate::text::Tokenizer::stop_ids), e.g. Llama 3's `<|eot_id|>`
    /// and `<|end_of_text|>`.
    pub stop: Vec<u32>,
}

/// The response to `prompt`: generated tokens only (ending with a stop token if one was drawn).
pub fn generate(
    w: &Weights,
    prompt: &[u32],
    sampling: &Sampling,
    rng: &mut impl Rng,
) -> Result<Vec<u32>> {
    let mut responses = generate_group(w, prompt, sampling, std::slice::from_mut(rng))?;
    Ok(responses.pop().unwrap_or_default())
}

/// One response to `prompt` per RNG of `rngs` (a GRPO group), decoded together: the prompt is fed
/// once, then every unfinished response advances one token per batched forward, and a response
/// leaves the batch when it ends. Response `i` draws only from `rngs[i]`, so it is the response
/// [`generate`] gives with that RNG (up to the float rounding of a batched product).
pub fn generate_group<R: Rng>(
    w: &Weights,
    prompt: &[u32],
    sampling: &Sampling,
    rngs: &mut [R],
) -> Result<Vec<Vec<u32>>> {
    Ok(decode_group(w, prompt, sampling, rngs, false)?
        .into_iter()
        .map(|g| g.tokens)
        .collect())
}

/// A sampled response and the log-probability of each of its tokens under the model that drew
/// it (at temperature 1: `log p(token | prompt, earlier tokens)`, what GRPO's ratio and KL use).
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub log_probs: Vec<f32>,
}

/// [`generate_group`], with each token's log-probability ([`Generated`]), read off the logits
/// the decoder computes anyway: no extra forward (equal to [`sequence_log_probs`] of prompt and
/// response within float rounding).
pub fn generate_group_with_log_probs<R: Rng>(
    w: &Weights,
    prompt: &[u32],
    sampling: &Sampling,
    rngs: &mut [R],
) -> Result<Vec<Generated>> {
    decode_group(w, prompt, sampling, rngs, true)
}

/// The group decoder; the log-probs only when `scored` (else left empty).
fn decode_group<R: Rng>(
    w: &Weights,
    prompt: &[u32],
    sampling: &Sampling,
    rngs: &mut [R],
    scored: bool,
) -> Result<Vec<Generated>> {
    if !(sampling.temperature.is_finite() && sampling.temperature >= 0.0) {
        return Err(Error::Batch(format!(
            "temperature must be finite and >= 0, got {}",
            sampling.temperature
        )));
    }
    let group = rngs.len();
    let room = w.config.max_seq_len.saturating_sub(prompt.len());
    let budget = sampling.max_new_tokens.min(room);
    let mut out: Vec<Generated> = vec![
        Generated {
            tokens: Vec::with_capacity(budget),
            log_probs: Vec::with_capacity(if scored { budget } else { 0 }),
        };
        group
    ];
    if budget == 0 || group == 0 {
        return Ok(out);
    }
    let mut cache = KvCache::default();
    let logits = forward_cached(w, &mut cache, prompt)?;
    // Every response starts from the prompt's last logits.
    let last = logits.narrow(0, logits.dim(0)? - 1, 1)?;
    let mut logits = last.broadcast_as((group, last.dim(1)?))?.contiguous()?;
    cache.repeat_rows(group)?;
    let mut active: Vec<usize> = (0..group).collect();
    loop {
        let next = pick_rows(&logits, sampling.temperature, &active, rngs)?;
        if scored {
            let rows: Vec<Vec<f32>> = log_softmax_last_dim(&logits)?.to_vec2()?;
            for ((&row, &token), lp) in active.iter().zip(&next).zip(&rows) {
                out[row].log_probs.push(lp[token as usize]);
            }
        }
        let mut keep = Vec::with_capacity(active.len());
        for (slot, (&row, &token)) in active.iter().zip(&next).enumerate() {
            out[row].tokens.push(token);
            if !sampling.stop.contains(&token) && out[row].tokens.len() < budget {
                keep.push(slot);
            }
        }
        if keep.is_empty() {
            return Ok(out);
        }
        cache.keep_rows(&keep)?;
        let fed: Vec<u32> = keep.iter().map(|&slot| next[slot]).collect();
        active = keep.iter().map(|&slot| active[slot]).collect();
        logits = forward_cached_rows(w, &mut cache, active.len(), &fed)?;
    }
}

/// A token per row of `logits: [rows, vocab]` (row `slot` belongs to response `active[slot]`,
/// which draws from `rngs[active[slot]]`): argmax at temperature 0, else a draw.
fn pick_rows<R: Rng>(
    logits: &Tensor,
    temperature: f64,
    active: &[usize],
    rngs: &mut [R],
) -> Result<Vec<u32>> {
    if temperature == 0.0 {
        return Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?);
    }
    let probs: Vec<Vec<f32>> = softmax_last_dim(&(logits / temperature)?)?.to_vec2()?;
    Ok(probs
        .iter()
        .zip(active)
        .map(|(p, &row)| draw(p, &mut rngs[row]))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::batch::{PackedBatch, Sample};
    use crate::model::test_util::max_abs_diff;
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

    /// The same shape in a Hugging Face layout: GQA, explicit head_dim, biases, q/k norms, tied.
    fn real_layout() -> ModelConfig {
        ModelConfig {
            n_kv_heads: Some(2),
            head_dim: Some(6),
            qkv_bias: true,
            qk_norm: true,
            tie_embeddings: true,
            ..config()
        }
    }

    #[test]
    fn cached_logits_equal_the_training_forward() {
        for c in [config(), real_layout()] {
            cached_logits_equal_the_training_forward_on(&c);
        }
    }

    fn cached_logits_equal_the_training_forward_on(c: &ModelConfig) {
        let c = c.clone();
        let w = weights(&c);
        let tokens: Vec<u32> = vec![1, 5, 9, 2, 14, 3, 3, 7];
        let batch =
            PackedBatch::pack(&c, &[Sample::all_loss(tokens.clone())], &Device::Cpu).unwrap();
        let full = model_forward(&c, &w.units, &batch).unwrap().logits.unwrap();
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

    /// The cache holds the positions used, not `max_seq_len`: it grows by doubling, and what it
    /// held before survives the growth (the logits still equal the training forward's).
    #[test]
    fn the_cache_grows_with_the_positions_used() {
        let c = ModelConfig {
            max_seq_len: 4096,
            ..real_layout()
        };
        let w = weights(&c);
        let tokens: Vec<u32> = (0..150).map(|i| (i * 7 % 16) as u32).collect();
        let batch =
            PackedBatch::pack(&c, &[Sample::all_loss(tokens.clone())], &Device::Cpu).unwrap();
        let full = model_forward(&c, &w.units, &batch).unwrap().logits.unwrap();
        let mut cache = KvCache::default();
        let mut rows = vec![forward_cached(&w, &mut cache, &tokens[..10]).unwrap()];
        let capacity = |cache: &KvCache| cache.layers[0].0.dim(2).unwrap();
        assert_eq!(capacity(&cache), 64);
        for chunk in tokens[10..].chunks(7) {
            rows.push(forward_cached(&w, &mut cache, chunk).unwrap());
        }
        assert_eq!(capacity(&cache), 256, "doubled twice, far below 4096");
        let stepped = Tensor::cat(&rows, 0).unwrap();
        assert!(max_abs_diff(&stepped, &full) < 1e-4);
    }

    #[test]
    fn greedy_is_deterministic_and_stops_within_bounds() {
        let c = config();
        let w = weights(&c);
        let s = Sampling {
            temperature: 0.0,
            max_new_tokens: 50,
            stop: vec![15],
        };
        let mut rng = StdRng::seed_from_u64(1);
        let a = generate(&w, &[1, 2, 3], &s, &mut rng).unwrap();
        let b = generate(&w, &[1, 2, 3], &s, &mut rng).unwrap();
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
            stop: vec![99],
        };
        let draw = |seed| generate(&w, &[4], &s, &mut StdRng::seed_from_u64(seed)).unwrap();
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
    fn batched_rows_give_each_rows_own_logits_and_keep_rows_continues_them() {
        let c = config();
        let w = weights(&c);
        let rows: [&[u32]; 3] = [&[1, 5, 9], &[2, 14, 3], &[7, 7, 0]];
        let mut single: Vec<(KvCache, Tensor)> = rows
            .iter()
            .map(|r| {
                let mut cache = KvCache::default();
                let logits = forward_cached(&w, &mut cache, r).unwrap();
                (cache, logits)
            })
            .collect();
        let mut cache = KvCache::default();
        let flat: Vec<u32> = rows.concat();
        let batched = forward_cached_rows(&w, &mut cache, 3, &flat).unwrap();
        assert_eq!((cache.rows(), cache.len()), (3, 3));
        for (i, (_, logits)) in single.iter().enumerate() {
            let row = batched.narrow(0, 3 * i, 3).unwrap();
            assert!(max_abs_diff(&row, logits) < 1e-4, "row {i}");
        }
        // Rows 0 and 2 go on; row 1 has left the batch.
        cache.keep_rows(&[0, 2]).unwrap();
        let next = forward_cached_rows(&w, &mut cache, 2, &[4, 11]).unwrap();
        for (slot, (row, token)) in [(0usize, 4u32), (2, 11)].into_iter().enumerate() {
            let own = forward_cached(&w, &mut single[row].0, &[token]).unwrap();
            let got = next.narrow(0, slot, 1).unwrap();
            assert!(max_abs_diff(&got, &own) < 1e-4, "row {row} after keep_rows");
        }
    }

    #[test]
    fn a_group_decodes_each_response_as_generate_does_with_its_rng() {
        let c = config();
        let w = weights(&c);
        let s = Sampling {
            temperature: 1.5,
            max_new_tokens: 15,
            stop: vec![7],
        };
        let prompt = [1u32, 2, 3];
        let mut rngs: Vec<StdRng> = (0..6).map(StdRng::seed_from_u64).collect();
        let group = generate_group(&w, &prompt, &s, &mut rngs).unwrap();
        assert_eq!(group.len(), 6);
        for (seed, response) in group.iter().enumerate() {
            let alone = generate(&w, &prompt, &s, &mut StdRng::seed_from_u64(seed as u64)).unwrap();
            assert_eq!(response, &alone, "response {seed}");
        }
        // Responses left the batch at different lengths (some at the stop token).
        let lengths: std::collections::HashSet<usize> = group.iter().map(Vec::len).collect();
        assert!(lengths.len() > 1, "every response had the same length");
        assert!(group.iter().any(|r| r.last() == Some(&7) && r.len() < 15));
        // Greedy: every row is the greedy response.
        let greedy = Sampling {
            temperature: 0.0,
            ..s.clone()
        };
        let mut rngs: Vec<StdRng> = (0..3).map(StdRng::seed_from_u64).collect();
        let rows = generate_group(&w, &prompt, &greedy, &mut rngs).unwrap();
        let alone = generate(&w, &prompt, &greedy, &mut StdRng::seed_from_u64(9)).unwrap();
        assert_eq!(rows, vec![alone; 3]);
        let mut none: Vec<StdRng> = Vec::new();
        assert!(generate_group(&w, &prompt, &s, &mut none)
            .unwrap()
            .is_empty());
    }

    /// Guarantee 5: the decoder's log-probs are the sampled tokens' under a full forward.
    #[test]
    fn a_groups_log_probs_are_the_sequences_own() {
        let c = config();
        let w = weights(&c);
        // Drawn at 1.5; the log-probs are the model's own (temperature 1).
        let s = Sampling {
            temperature: 1.5,
            max_new_tokens: 12,
            stop: vec![7],
        };
        let prompt = [4u32, 2, 9];
        let mut rngs: Vec<StdRng> = (0..4).map(StdRng::seed_from_u64).collect();
        let scored = generate_group_with_log_probs(&w, &prompt, &s, &mut rngs).unwrap();
        let mut rngs: Vec<StdRng> = (0..4).map(StdRng::seed_from_u64).collect();
        let plain = generate_group(&w, &prompt, &s, &mut rngs).unwrap();
        assert_eq!(scored.len(), 4);
        for (g, tokens) in scored.iter().zip(&plain) {
            assert_eq!(&g.tokens, tokens, "the same draws");
            assert_eq!(g.log_probs.len(), g.tokens.len());
            let sequence: Vec<u32> = prompt.iter().chain(&g.tokens).copied().collect();
            let want = sequence_log_probs(&w, &sequence).unwrap();
            for (t, (got, want)) in g.log_probs.iter().zip(&want[prompt.len()..]).enumerate() {
                assert!(got.is_finite() && *got <= 0.0, "token {t}: {got}");
                assert!((got - want).abs() < 1e-4, "token {t}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn bad_row_shapes_are_errors() {
        let c = config();
        let w = weights(&c);
        let mut cache = KvCache::default();
        assert!(forward_cached_rows(&w, &mut cache, 2, &[1, 2, 3]).is_err());
        assert!(forward_cached_rows(&w, &mut cache, 0, &[1]).is_err());
        forward_cached_rows(&w, &mut cache, 2, &[1, 2]).unwrap();
        assert!(forward_cached_rows(&w, &mut cache, 3, &[1, 2, 3]).is_err());
        assert!(cache.repeat_rows(4).is_err());
        assert!(cache.keep_rows(&[]).is_err());
        assert!(cache.keep_rows(&[2]).is_err());
        assert!(KvCache::default().keep_rows(&[0]).is_err());
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
            stop: vec![0],
        };
        assert!(generate(&w, &[1], &s, &mut StdRng::seed_from_u64(0)).is_err());
    }
}
