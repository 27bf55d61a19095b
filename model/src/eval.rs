//! Exact-match accuracy of greedy answers on held-out problems (GSM8K's metric): the model
//! continues each problem's prompt ([`prompt_tokens`]) greedily until EOS or a token limit, and an
//! answer counts when its number after `####` equals the reference's. Problems are answered in
//! batches of [`EVAL_BATCH`] (one batched decode each, [`generate_batch`]).

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::error::Result;
use super::generate::{generate_batch, Prompt, Sampling, Weights};
use super::shares::map_batches_in_shares;
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

#[cfg(test)]
mod tests {
    use super::*;
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
}
