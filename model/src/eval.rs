//! Evaluation on held-out data, two ways:
//! - exact-match accuracy of greedy answers on held-out problems (GSM8K's metric): the model
//!   continues each problem's prompt ([`prompt_tokens`]) greedily until EOS or a token limit, and
//!   an answer counts when its number after `####` equals the reference's. Problems are answered
//!   in batches of [`EVAL_BATCH`] (one batched decode each, [`generate_batch`]);
//! - the eval loss ([`eval_loss`], `transformers`' `eval_loss`): the token mean of the
//!   next-token cross-entropy over held-out samples' loss tokens (the answers, the assistant's
//!   turns), as training computes it, with no gradient. Samples are packed in order into packs of
//!   at most a token budget, each pack's loss summed in f64 in pack order, so the figure does not
//!   depend on the number of workers.

use rand::rngs::StdRng;
use rand::SeedableRng;

use candle_core::DType;

use super::batch::{PackedBatch, Sample};
use super::error::Result;
use super::generate::{generate_batch, Prompt, Sampling, Weights};
use super::shares::{map_batches_in_shares, map_in_shares};
use super::transformer::model_loss;
use odc_text::{exact_match, prompt_tokens, Problem, TextError, Tokenizer};

/// Problems answered together in one batched decode: the batches are cut from the whole list, so
/// a result does not depend on the number of workers (nor, with
/// [`batch_share_range`](super::batch_share_range), of ranks).
pub const EVAL_BATCH: usize = 16;

/// What an evaluation measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// Problems answered exactly, out of those asked.
    pub correct: usize,
    pub problems: usize,
    /// Mean length of the generated answers in tokens.
    pub mean_answer_tokens: f64,
    /// The first answer, decoded (to show what the model writes).
    pub example: Option<String>,
}

impl Evaluation {
    /// `correct / problems` (0 when no problem was asked).
    pub fn accuracy(&self) -> f64 {
        if self.problems == 0 {
            0.0
        } else {
            self.correct as f64 / self.problems as f64
        }
    }
}

/// Greedy answers of `weights` to `problems`, each at most `max_new_tokens` long (and within the
/// model's `max_seq_len`); prompts that leave no room count as wrong. `workers` threads (at least
/// one) answer contiguous shares of the batches of [`EVAL_BATCH`] problems at once — greedy
/// decoding is deterministic, so the result does not depend on their number. A tokenizer's error is
/// [`Error::Text`](super::Error::Text).
pub fn evaluate(
    weights: &Weights,
    tokenizer: &dyn Tokenizer,
    problems: &[Problem],
    max_new_tokens: usize,
    workers: usize,
) -> Result<Evaluation> {
    let prompt = |problem: &Problem| prompt_tokens(tokenizer, &problem.question);
    evaluate_prompted(
        weights,
        tokenizer,
        problems,
        max_new_tokens,
        workers,
        &prompt,
    )
}

/// [`evaluate`] with each problem's prompt made by `prompt` — e.g. the model's chat template
/// around the question ([`prompt_from_chat`](odc_text::prompt_from_chat)); answers stop at any
/// of the tokenizer's [`stop_ids`](Tokenizer::stop_ids).
pub fn evaluate_prompted(
    weights: &Weights,
    tokenizer: &dyn Tokenizer,
    problems: &[Problem],
    max_new_tokens: usize,
    workers: usize,
    prompt: &(dyn Fn(&Problem) -> std::result::Result<Vec<u32>, TextError> + Sync),
) -> Result<Evaluation> {
    let sampling = Sampling::greedy(max_new_tokens, tokenizer.stop_ids());
    let answers = map_batches_in_shares(
        problems,
        workers,
        EVAL_BATCH,
        |batch| -> Result<Vec<(String, usize)>> {
            let texts: Vec<Vec<u32>> = batch
                .iter()
                .map(prompt)
                .collect::<std::result::Result<_, _>>()?;
            let prompts: Vec<Prompt<'_>> = texts.iter().map(|p| Prompt::new(p)).collect();
            // Greedy decoding draws nothing; the decoder still takes a generator per answer.
            let mut rngs: Vec<StdRng> =
                (0..batch.len()).map(|_| StdRng::seed_from_u64(0)).collect();
            let answers = generate_batch(weights, &prompts, &sampling, &mut rngs)?;
            answers
                .into_iter()
                .map(|answer| Ok((tokenizer.decode(&answer)?, answer.len())))
                .collect()
        },
    )?;
    let correct = answers
        .iter()
        .zip(problems)
        .filter(|((text, _), problem)| exact_match(text, &problem.answer))
        .count();
    let tokens: usize = answers.iter().map(|(_, n)| n).sum();
    Ok(Evaluation {
        correct,
        problems: problems.len(),
        mean_answer_tokens: tokens as f64 / problems.len().max(1) as f64,
        example: answers.into_iter().next().map(|(text, _)| text),
    })
}

/// What [`eval_loss`] measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalLoss {
    /// The token-mean cross-entropy (NaN when no sample has a loss token).
    pub loss: f64,
    /// The loss tokens it is over, and the samples.
    pub tokens: usize,
    pub samples: usize,
}

/// The eval loss of `weights` on `samples` (see the [module docs](self)): packs of at most
/// `token_budget` tokens (a longer sample alone), `workers` threads at once.
pub fn eval_loss(
    weights: &Weights,
    samples: &[Sample],
    token_budget: usize,
    workers: usize,
) -> Result<EvalLoss> {
    let mut packs: Vec<&[Sample]> = Vec::new();
    let (mut start, mut tokens) = (0, 0);
    for (i, s) in samples.iter().enumerate() {
        if i > start && tokens + s.tokens.len() > token_budget {
            packs.push(&samples[start..i]);
            (start, tokens) = (i, 0);
        }
        tokens += s.tokens.len();
    }
    if start < samples.len() {
        packs.push(&samples[start..]);
    }
    let config = weights.config();
    let device = weights.units()[0][0].device().clone();
    let sums = map_in_shares(&packs, workers, |pack| -> Result<(f64, usize)> {
        let batch = PackedBatch::pack(config, pack, &device)?;
        let out = model_loss(config, weights.units(), &batch)?;
        let sum = out.loss_sum.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        Ok((sum, batch.loss_tokens))
    })?;
    let (sum, tokens) = sums
        .iter()
        .fold((0.0, 0), |(s, t), (sum, n)| (s + sum, t + n));
    Ok(EvalLoss {
        loss: match tokens {
            0 => f64::NAN,
            n => sum / n as f64,
        },
        tokens,
        samples: samples.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{PackedBatch, Sample};
    use crate::{unit_count, unit_init_values, ModelConfig};
    use odc_text::{ArithTask, ByteTokenizer};

    #[test]
    fn workers_share_the_problems_without_changing_the_result() {
        let config = ModelConfig {
            max_seq_len: 320,
            ..ModelConfig::tiny()
        };
        let params: Vec<Vec<f32>> = (0..unit_count(&config))
            .map(|u| unit_init_values(&config, u).unwrap())
            .collect();
        let weights = Weights::from_units(&config, &params, &candle_core::Device::Cpu).unwrap();
        let problems: Vec<Problem> = ArithTask::eval(1).problems(0..5).collect();
        let one = evaluate(&weights, &ByteTokenizer, &problems, 12, 1).unwrap();
        for workers in [2, 3, 8] {
            assert_eq!(
                evaluate(&weights, &ByteTokenizer, &problems, 12, workers).unwrap(),
                one
            );
        }
        assert_eq!(one.problems, 5);
        assert!(one.mean_answer_tokens > 0.0 && one.mean_answer_tokens <= 12.0);
        assert!(one.example.is_some());
        let none = evaluate(&weights, &ByteTokenizer, &[], 12, 2).unwrap();
        assert_eq!((none.problems, none.accuracy()), (0, 0.0));
    }

    #[test]
    fn the_eval_loss_is_the_token_mean_of_the_whole_models_loss_whatever_the_packs() {
        let config = ModelConfig::tiny();
        let params: Vec<Vec<f32>> = (0..unit_count(&config))
            .map(|u| unit_init_values(&config, u).unwrap())
            .collect();
        let device = candle_core::Device::Cpu;
        let weights = Weights::from_units(&config, &params, &device).unwrap();
        let samples: Vec<Sample> = (0..7u32)
            .map(|i| {
                let tokens: Vec<u32> = (0..9 + 3 * i).map(|t| (t * 7 + i) % 200).collect();
                // The loss on the second half only, as an answer's.
                let n = tokens.len();
                Sample {
                    loss_mask: (0..n).map(|t| t >= n / 2).collect(),
                    tokens,
                }
            })
            .collect();
        // The reference: each sample alone through the model with its logits (`model_forward`).
        let units: Vec<Vec<candle_core::Tensor>> = weights.units().to_vec();
        let (mut sum, mut tokens) = (0.0, 0);
        for s in &samples {
            let batch = PackedBatch::pack(&config, std::slice::from_ref(s), &device).unwrap();
            let out = crate::model_forward(&config, &units, &batch).unwrap();
            sum += f64::from(out.loss_sum.to_scalar::<f32>().unwrap());
            tokens += batch.loss_tokens;
        }
        let want = sum / tokens as f64;
        for (budget, workers) in [(1, 1), (40, 2), (1000, 3)] {
            let got = eval_loss(&weights, &samples, budget, workers).unwrap();
            assert_eq!((got.tokens, got.samples), (tokens, 7));
            assert!(
                (got.loss - want).abs() < 1e-5,
                "{budget}: {} vs {want}",
                got.loss
            );
        }
        assert!(eval_loss(&weights, &[], 100, 2).unwrap().loss.is_nan());
    }
}
