//! Sampling from the model with a key–value cache, so a response of `n` tokens costs `n` one-token
//! forwards, not `n` forwards of a growing sequence; many prompts and their groups decode as one
//! batch ([`generate_batch`]).
//!
//! - `weights`: the model's [`Weights`] as plain tensors; `sampling`: what a decode is asked
//!   for ([`Sampling`], [`Prompt`]) and what it gives ([`Generated`]);
//! - `cache`: the [`KvCache`] and the cached forward ([`forward_cached_rows`], [`prefill`] of
//!   prompts of different lengths);
//! - `decode`: the batched decoder every `generate*` function runs.
//!
//! Guarantees (tested):
//! 1. **cache equivalence**: the logits of a prompt fed at once, or token by token through the
//!    cache, equal the training forward's logits of the same sequence (within 1e-4);
//! 2. greedy decoding (`temperature == 0`) is deterministic; sampling at `temperature > 0` draws
//!    from `softmax(logits / temperature)` (cut to its top-p nucleus when `top_p < 1`) with the
//!    caller's seeded RNG, so a run is reproducible;
//! 3. a response stops at a stop id (kept as its last token) or at `max_new_tokens`, and never
//!    runs past `max_seq_len` positions;
//! 4. **batch equivalence**: [`generate_batch`] decodes prompts of different lengths, each
//!    continued `samples` times, as one batch (each prompt fed once, finished responses leaving
//!    the batch: their cache rows dropped in one copy once a quarter of the rows are finished),
//!    and each response is the one [`generate`] draws alone with the same RNG and
//!    stop ids: token for token in greedy decoding ([`generate_group`] is one prompt's group);
//! 5. [`generate_batch_with_log_probs`] also gives each sampled token's log-probability under the
//!    model (temperature 1), read off the logits the decoder computes anyway: they equal
//!    [`sequence_log_probs`] of prompt and response (within 1e-4), and so do
//!    [`batch_log_probs`]' of many sequences at once.

mod cache;
mod decode;
mod sampling;
mod weights;

pub use cache::{forward_cached, forward_cached_rows, prefill, KvCache};
pub use decode::DecodeStats;
pub use sampling::{Generated, Prompt, Sampling};
pub use weights::Weights;

use rand::Rng;

use super::batch::{PackedBatch, Sample};
use super::block::block_forward;
use super::error::{Error, Result};
use super::ops::log_softmax_last_dim;
use super::transformer::{head_target_log_probs, head_tensors, unit_count};

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

/// Per sequence of `sequences` and per token `t`, `log p(token t | tokens < t)` under `w` (entry 0,
/// which nothing predicts, is 0): one training forward of them all packed (no padding, each
/// attending within itself, the blocked attention and the chunked head: memory linear in the
/// tokens), not the decoder's cache.
pub fn batch_log_probs(w: &Weights, sequences: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
    if sequences.is_empty() {
        return Ok(Vec::new());
    }
    if let Some(i) = sequences.iter().position(|s| s.is_empty()) {
        return Err(Error::Batch(format!("sequence {i} of the batch is empty")));
    }
    let c = &w.config;
    let device = w.units[0][0].device();
    let samples: Vec<Sample> = sequences
        .iter()
        .map(|s| Sample::all_loss(s.to_vec()))
        .collect();
    let batch = PackedBatch::pack(c, &samples, device)?;
    let mut h = w.units[0][0].index_select(&batch.tokens, 0)?;
    for layer in 0..c.n_layers {
        h = block_forward(c, &w.block_tensors(layer), &h, &batch)?;
    }
    let head = head_tensors(c, &w.units[unit_count(c) - 1], &w.units[0][0]);
    // Position t's log-probability of the token after it (a sample's last position: none).
    let per: Vec<f32> = head_target_log_probs(c, &head, &h, &batch)?.to_vec1()?;
    let mut start = 0;
    let mut out = Vec::with_capacity(sequences.len());
    for s in sequences {
        let mut log_probs = Vec::with_capacity(s.len());
        log_probs.push(0.0);
        log_probs.extend_from_slice(&per[start..start + s.len() - 1]);
        out.push(log_probs);
        start += s.len();
    }
    Ok(out)
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
    let prompt = Prompt::new(prompt).samples(rngs.len());
    generate_batch(w, &[prompt], sampling, rngs)
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
    let prompt = Prompt::new(prompt).samples(rngs.len());
    generate_batch_with_log_probs(w, &[prompt], sampling, rngs)
}

/// The responses to every prompt of `prompts` (`samples` each, prompt-major: response `i` draws
/// from `rngs[i]`, one generator per response), decoded as one batch: the prompts prefilled
/// together (left-padded to the longest), then one forward of every unfinished response per
/// token. A prompt that leaves no room under `max_seq_len` gets empty responses.
pub fn generate_batch<R: Rng>(
    w: &Weights,
    prompts: &[Prompt<'_>],
    sampling: &Sampling,
    rngs: &mut [R],
) -> Result<Vec<Vec<u32>>> {
    Ok(generate_batch_measured(w, prompts, sampling, rngs)?.0)
}

/// [`generate_batch`], and what its cache held ([`DecodeStats`]).
pub fn generate_batch_measured<R: Rng>(
    w: &Weights,
    prompts: &[Prompt<'_>],
    sampling: &Sampling,
    rngs: &mut [R],
) -> Result<(Vec<Vec<u32>>, DecodeStats)> {
    let (generated, stats) = decode::decode(w, prompts, sampling, rngs, false)?;
    Ok((generated.into_iter().map(|g| g.tokens).collect(), stats))
}

/// [`generate_batch`], with each token's log-probability ([`Generated`]).
pub fn generate_batch_with_log_probs<R: Rng>(
    w: &Weights,
    prompts: &[Prompt<'_>],
    sampling: &Sampling,
    rngs: &mut [R],
) -> Result<Vec<Generated>> {
    Ok(decode::decode(w, prompts, sampling, rngs, true)?.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{PackedBatch, Sample};
    use crate::config::ModelConfig;
    use crate::device::ComputePrecision;
    use crate::test_util::max_abs_diff;
    use crate::transformer::{model_forward, unit_count, unit_init_values};
    use candle_core::{DType, Device, Tensor};
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

    /// Weights cut as views from each unit's flat tensor (a bf16 one too, as a bf16 pull lands)
    /// score exactly as weights built from the same values; a unit of the wrong length is
    /// refused.
    #[test]
    fn weights_from_flat_units_score_as_weights_from_values() {
        let c = real_layout();
        let tokens = [1, 5, 9, 2, 14, 3];
        for dtype in [DType::F32, DType::BF16] {
            let flat: Vec<Tensor> = (0..unit_count(&c))
                .map(|u| {
                    let values = unit_init_values(&c, u).unwrap();
                    Tensor::new(values.as_slice(), &Device::Cpu)?.to_dtype(dtype)
                })
                .collect::<candle_core::Result<_>>()
                .unwrap();
            // The same values (rounded to `dtype`) through the host path.
            let values: Vec<Vec<f32>> = flat
                .iter()
                .map(|t| t.to_dtype(DType::F32)?.to_vec1())
                .collect::<candle_core::Result<_>>()
                .unwrap();
            let want = Weights::from_units(&c, &values, &Device::Cpu).unwrap();
            let got = Weights::from_flat(&c, &flat)
                .and_then(|w| w.in_precision(ComputePrecision::F32))
                .unwrap();
            assert_eq!(
                sequence_log_probs(&got, &tokens).unwrap(),
                sequence_log_probs(&want, &tokens).unwrap(),
                "{dtype:?}"
            );
            let mut short = flat.clone();
            short[1] = short[1].narrow(0, 1, short[1].elem_count() - 1).unwrap();
            let e = Weights::from_flat(&c, &short).unwrap_err();
            assert!(matches!(e, Error::UnitParams { .. }), "{e}");
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
        let s = Sampling::new(0.0, 50, vec![15]);
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
        let s = Sampling::new(1.5, 12, vec![99]);
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
        let (_, per) = crate::transformer::head_log_probs(
            &c,
            &w.units[c.n_layers + 1],
            &{
                let mut h = w.units[0][0].index_select(&batch.tokens, 0).unwrap();
                for l in 0..c.n_layers {
                    h = crate::block::block_forward(&c, &w.units[l + 1], &h, &batch).unwrap();
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
        let s = Sampling::new(1.5, 15, vec![7]);
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
        let s = Sampling::new(1.5, 12, vec![7]);
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
        let s = Sampling::new(f64::NAN, 1, vec![0]);
        assert!(generate(&w, &[1], &s, &mut StdRng::seed_from_u64(0)).is_err());
    }

    /// Guarantee 2 of `cache`: each prompt of a left-padded batch gets the logits it gets alone,
    /// at its last token and (through the cache) at the tokens fed after it.
    #[test]
    fn a_padded_batch_gives_each_prompt_its_own_logits() {
        for c in [config(), real_layout()] {
            let w = weights(&c);
            let prompts: [&[u32]; 3] = [&[3], &[1, 5, 9, 2, 14, 3, 3], &[7, 7, 0]];
            let mut cache = KvCache::default();
            let last = prefill(&w, &mut cache, &prompts).unwrap();
            assert_eq!((cache.rows(), cache.len(), cache.padding(0)), (3, 7, 6));
            let next = forward_cached_rows(&w, &mut cache, 3, &[4, 11, 2]).unwrap();
            for (i, (prompt, fed)) in prompts.iter().zip([4u32, 11, 2]).enumerate() {
                let mut alone = KvCache::default();
                let own = forward_cached(&w, &mut alone, prompt).unwrap();
                let own_last = own.narrow(0, prompt.len() - 1, 1).unwrap();
                let got = last.narrow(0, i, 1).unwrap();
                assert!(max_abs_diff(&got, &own_last) < 1e-4, "prompt {i}");
                let own_next = forward_cached(&w, &mut alone, &[fed]).unwrap();
                let got = next.narrow(0, i, 1).unwrap();
                assert!(
                    max_abs_diff(&got, &own_next) < 1e-4,
                    "prompt {i}, next token"
                );
            }
        }
    }

    /// Guarantee 4, greedy: a batch of prompts of different lengths, with stop ids of their own,
    /// decodes each prompt token for token as it decodes alone.
    #[test]
    fn batched_greedy_decoding_equals_one_at_a_time() {
        for c in [config(), real_layout()] {
            let w = weights(&c);
            let s = Sampling::greedy(14, vec![15]);
            let texts: [&[u32]; 5] = [&[1, 2, 3], &[4], &[9, 8, 7, 6, 5, 4, 3], &[2, 2], &[11; 20]];
            let stops: [&[u32]; 5] = [&[], &[6, 13], &[], &[1], &[]];
            let prompts: Vec<Prompt<'_>> = texts
                .iter()
                .zip(stops)
                .map(|(t, stop)| Prompt::new(t).stop(stop))
                .collect();
            let mut rngs: Vec<StdRng> = (0..5).map(StdRng::seed_from_u64).collect();
            let batch = generate_batch(&w, &prompts, &s, &mut rngs).unwrap();
            let mut ended = 0;
            for (i, (prompt, response)) in prompts.iter().zip(&batch).enumerate() {
                let own = Sampling {
                    stop: [s.stop.as_slice(), prompt.stop].concat(),
                    ..s.clone()
                };
                let alone = generate(&w, prompt.tokens, &own, &mut StdRng::seed_from_u64(0));
                assert_eq!(response, &alone.unwrap(), "prompt {i}");
                // Within the budget and the model's positions.
                let room = c.max_seq_len - prompt.tokens.len();
                assert!(response.len() <= s.max_new_tokens.min(room), "prompt {i}");
                ended += usize::from(response.last().is_some_and(|t| own.stop.contains(t)));
            }
            // The 20-token prompt has 4 positions left: its budget, not 14.
            assert!(batch[4].len() <= 4);
            assert!(
                batch
                    .iter()
                    .map(Vec::len)
                    .collect::<std::collections::HashSet<_>>()
                    .len()
                    > 1
            );
            assert!(ended > 0, "no response ended at a stop id: {batch:?}");
        }
    }

    /// Finished responses leave the cache in few copies: their rows stay (fed, unread) until a
    /// quarter of the rows are finished, then one copy drops them all. Every response is still
    /// the one drawn alone, and the copies are fewer than one per step in which some response
    /// finished (what dropping rows as they finish costs).
    #[test]
    fn finished_rows_leave_the_cache_in_few_copies() {
        let c = ModelConfig {
            max_seq_len: 64,
            ..real_layout()
        };
        let w = weights(&c);
        let s = Sampling::new(1.0, 24, vec![3, 5]);
        let texts: [&[u32]; 4] = [&[1, 2], &[4], &[9, 8, 7], &[6, 6, 6, 6]];
        let prompts: Vec<Prompt<'_>> = texts.iter().map(|t| Prompt::new(t).samples(4)).collect();
        let mut rngs: Vec<StdRng> = (0..16).map(StdRng::seed_from_u64).collect();
        let (batch, stats) = generate_batch_measured(&w, &prompts, &s, &mut rngs).unwrap();
        for (i, response) in batch.iter().enumerate() {
            let alone = generate(&w, texts[i / 4], &s, &mut StdRng::seed_from_u64(i as u64));
            assert_eq!(response, &alone.unwrap(), "response {i}");
        }
        // Steps in which a response finished, the last (every remaining one) aside.
        let ends: std::collections::BTreeSet<usize> = batch.iter().map(Vec::len).collect();
        let eager = ends.len() - 1;
        println!(
            "{} ends over {} steps: {} copies, {eager} dropping rows as they finish",
            batch.len(),
            ends.len(),
            stats.compactions
        );
        assert!(eager >= 4, "too few staggered ends to tell: {ends:?}");
        assert!(stats.compactions < eager, "{} copies", stats.compactions);
    }

    /// Guarantee 4, sampling: groups of several prompts in one batch draw what each draws alone
    /// with the same generators; top-p at a tiny mass is greedy.
    #[test]
    fn batched_groups_draw_what_each_prompt_draws_alone() {
        let c = real_layout();
        let w = weights(&c);
        let s = Sampling {
            temperature: 1.2,
            top_p: 0.9,
            max_new_tokens: 10,
            stop: vec![7],
        };
        let texts: [&[u32]; 3] = [&[1, 2, 3], &[4], &[9, 8, 7, 6, 5]];
        let prompts: Vec<Prompt<'_>> = texts.iter().map(|t| Prompt::new(t).samples(3)).collect();
        let seeds = |p: usize| (0..3).map(move |i| StdRng::seed_from_u64((10 * p + i) as u64));
        let mut rngs: Vec<StdRng> = (0..3).flat_map(seeds).collect();
        let batch = generate_batch_with_log_probs(&w, &prompts, &s, &mut rngs).unwrap();
        assert_eq!(batch.len(), 9);
        for (p, text) in texts.iter().enumerate() {
            let mut rngs: Vec<StdRng> = seeds(p).collect();
            let alone = generate_group_with_log_probs(&w, text, &s, &mut rngs).unwrap();
            for (i, own) in alone.iter().enumerate() {
                let got = &batch[3 * p + i];
                assert_eq!(got.tokens, own.tokens, "prompt {p}, response {i}");
                for (a, b) in got.log_probs.iter().zip(&own.log_probs) {
                    assert!((a - b).abs() < 1e-4, "prompt {p}, response {i}: {a} vs {b}");
                }
            }
        }
        let distinct: std::collections::HashSet<&Vec<u32>> =
            batch.iter().map(|g| &g.tokens).collect();
        assert!(distinct.len() > 3, "the draws hardly differ");
        // A nucleus of almost no mass holds the most likely token only.
        let nucleus = Sampling {
            top_p: 1e-6,
            ..s.clone()
        };
        let greedy = Sampling {
            temperature: 0.0,
            ..s.clone()
        };
        let mut rngs: Vec<StdRng> = (0..9).map(|i| StdRng::seed_from_u64(i as u64)).collect();
        let drawn = generate_batch(&w, &prompts, &nucleus, &mut rngs).unwrap();
        let mut rngs: Vec<StdRng> = (0..9).map(|i| StdRng::seed_from_u64(i as u64)).collect();
        assert_eq!(
            drawn,
            generate_batch(&w, &prompts, &greedy, &mut rngs).unwrap()
        );
    }

    /// Guarantee 5: many sequences' log-probs at once are each one's own.
    #[test]
    fn batch_log_probs_are_each_sequences_own() {
        let c = real_layout();
        let w = weights(&c);
        let sequences: [&[u32]; 4] = [
            &[3, 1, 4, 1, 5, 9],
            &[2],
            &[7, 7],
            &[1, 2, 3, 4, 5, 6, 7, 8, 9],
        ];
        let batch = batch_log_probs(&w, &sequences).unwrap();
        for (tokens, got) in sequences.iter().zip(&batch) {
            let want = sequence_log_probs(&w, tokens).unwrap();
            assert_eq!(got.len(), want.len());
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "{tokens:?}: {a} vs {b}");
            }
        }
        assert!(batch_log_probs(&w, &[]).unwrap().is_empty());
    }

    #[test]
    fn bad_batches_are_errors_naming_what_was_wrong() {
        let c = config();
        let w = weights(&c);
        let s = Sampling::greedy(4, vec![]);
        let mut two: Vec<StdRng> = (0..2).map(StdRng::seed_from_u64).collect();
        let prompts = [Prompt::new(&[1, 2]).samples(3)];
        let e = generate_batch(&w, &prompts, &s, &mut two).unwrap_err();
        assert!(
            e.to_string().contains("2 generators for 3 responses"),
            "{e}"
        );
        let empty = [Prompt::new(&[1]), Prompt::new(&[])];
        let e = generate_batch(&w, &empty, &s, &mut two).unwrap_err();
        assert!(
            e.to_string().contains("prompt 1 of the batch is empty"),
            "{e}"
        );
        let bad = Sampling {
            top_p: 0.0,
            ..s.clone()
        };
        let e = generate_batch(&w, &[Prompt::new(&[1])], &bad, &mut two[..1]).unwrap_err();
        assert!(e.to_string().contains("top_p"), "{e}");
        let past = [Prompt::new(&[1]), Prompt::new(&[16])];
        assert!(generate_batch(&w, &past, &s, &mut two).is_err());
        // A prompt with no room left gets an empty response beside the others.
        let full = [Prompt::new(&[1; 24]), Prompt::new(&[1])];
        let out = generate_batch(&w, &full, &s, &mut two).unwrap();
        assert!(out[0].is_empty() && !out[1].is_empty());
    }

    /// Decoding in bf16 ([`Weights::in_precision`]): the sampled tokens' log-probs are the
    /// training forward's in bf16 on the same tokens within bf16's tolerance (GRPO's ratio
    /// assumes it), and the cache holds half the bytes of fp32's.
    #[test]
    fn bf16_decoding_scores_as_the_bf16_training_forward_in_half_the_cache() {
        let c = ModelConfig {
            max_seq_len: 64,
            ..real_layout()
        };
        let w32 = weights(&c);
        let w16 = w32.clone().in_precision(ComputePrecision::Bf16).unwrap();
        assert_eq!(w16.dtype(), DType::BF16);
        let texts: [&[u32]; 2] = [&[1, 2, 3, 9], &[4]];
        let prompts: Vec<Prompt<'_>> = texts.iter().map(|t| Prompt::new(t).samples(2)).collect();
        let s = Sampling::new(1.0, 10, vec![]);
        let rngs = || -> Vec<StdRng> { (0..4).map(StdRng::seed_from_u64).collect() };
        let scored = generate_batch_with_log_probs(&w16, &prompts, &s, &mut rngs()).unwrap();
        let owners = [0, 0, 1, 1];
        let sequences: Vec<Vec<u32>> = scored
            .iter()
            .zip(owners)
            .map(|(g, p)| texts[p].iter().chain(&g.tokens).copied().collect())
            .collect();
        let views: Vec<&[u32]> = sequences.iter().map(|s| s.as_slice()).collect();
        let forward = batch_log_probs(&w16, &views).unwrap();
        let exact = batch_log_probs(&w32, &views).unwrap();
        let (mut worst, mut bf16_itself) = (0f32, 0f32);
        for (((g, want), fp32), p) in scored.iter().zip(&forward).zip(&exact).zip(owners) {
            let from = texts[p].len();
            for ((got, want), fp32) in g.log_probs.iter().zip(&want[from..]).zip(&fp32[from..]) {
                assert!(got.is_finite() && *got <= 0.0, "{got}");
                worst = worst.max((got - want).abs());
                bf16_itself = bf16_itself.max((want - fp32).abs());
            }
        }
        println!(
            "bf16 decoding vs the bf16 training forward: max |Δ log p| {worst}; the bf16 forward \
             vs fp32's: {bf16_itself}"
        );
        // bf16's own error (its forward against fp32's) is the scale: the sampler's log-probs
        // agree with the trainer's within twice it (and a plain bound).
        assert!(
            worst <= 2.0 * bf16_itself + 1e-3 && worst < 0.1,
            "log-probs differ by {worst}"
        );
        let bytes = |w: &Weights| {
            let s = Sampling::greedy(5, vec![]);
            generate_batch_measured(w, &prompts, &s, &mut rngs())
                .unwrap()
                .1
                .peak_cache_bytes
        };
        assert_eq!(2 * bytes(&w16), bytes(&w32));
    }

    /// What the batch's cache holds: every row as wide as the whole decode can fill (the longest
    /// prompt and `max_new_tokens`, made once: no copy as it grows), fp32 keys and values per KV
    /// head, against the analytical bytes of the tokens in it; a cache fed without a reservation
    /// doubles (64 columns at least).
    #[test]
    fn the_cache_holds_rows_times_its_capacity() {
        let c = ModelConfig {
            max_seq_len: 4096,
            ..real_layout()
        };
        let w = weights(&c);
        let texts: [&[u32]; 2] = [&[1, 2, 3], &[4]];
        let prompts: Vec<Prompt<'_>> = texts.iter().map(|t| Prompt::new(t).samples(2)).collect();
        let mut rngs: Vec<StdRng> = (0..4).map(StdRng::seed_from_u64).collect();
        let s = Sampling::greedy(5, vec![]);
        let (out, stats) = generate_batch_measured(&w, &prompts, &s, &mut rngs).unwrap();
        assert!(out.iter().all(|r| r.len() == 5));
        let per_token = 2 * c.n_layers * c.kv_heads() * c.head_dim() * 4;
        // Four rows of 3 + 5 columns; at the first draw they held the prompts' 3 + 3 + 1 + 1
        // tokens.
        assert_eq!(stats.peak_cache_bytes, 4 * 8 * per_token);
        assert_eq!(stats.tokens_at_peak, 8);
        let mut cache = KvCache::default();
        forward_cached(&w, &mut cache, &[1, 2, 3]).unwrap();
        assert_eq!(cache.bytes(), 64 * per_token);
        forward_cached(&w, &mut cache, &[1; 62]).unwrap();
        assert_eq!(cache.bytes(), 128 * per_token);
    }
}
