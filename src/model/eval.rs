//! Exact-match accuracy of greedy answers on held-out problems (GSM8K's metric): the model
//! continues each problem's prompt ([`prompt_tokens`]) greedily until EOS or a token limit, and an
//! answer counts when its number after `####` equals the reference's.

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::error::Result;
use super::generate::{generate, Sampling, Weights};
use crate::text::{exact_match, prompt_tokens, Problem, Tokenizer};

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
/// model's `max_seq_len`); prompts that leave no room count as wrong. A tokenizer's error is
/// [`Error::Text`](super::Error::Text).
pub fn evaluate(
    weights: &Weights,
    tokenizer: &dyn Tokenizer,
    problems: &[Problem],
    max_new_tokens: usize,
) -> Result<Evaluation> {
    let sampling = Sampling {
        temperature: 0.0,
        max_new_tokens,
        stop: tokenizer.eos(),
    };
    // Greedy decoding draws nothing; the generator still takes an RNG.
    let mut rng = StdRng::seed_from_u64(0);
    let (mut correct, mut tokens, mut example) = (0, 0, None);
    for problem in problems {
        let prompt = prompt_tokens(tokenizer, &problem.question)?;
        let answer = generate(weights, &prompt, sampling, &mut rng)?;
        tokens += answer.len();
        let text = tokenizer.decode(&answer)?;
        if exact_match(&text, &problem.answer) {
            correct += 1;
        }
        example.get_or_insert(text);
    }
    Ok(Evaluation {
        correct,
        problems: problems.len(),
        mean_answer_tokens: tokens as f64 / problems.len().max(1) as f64,
        example,
    })
}
