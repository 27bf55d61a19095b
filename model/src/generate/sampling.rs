//! What a decode is asked for: how to draw ([`Sampling`]), the prompts of a batch ([`Prompt`]),
//! and a response with its tokens' log-probabilities ([`Generated`]).

use crate::error::{Error, Result};

/// How to draw a response.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the most likely token); otherwise the softmax temperature.
    pub temperature: f64,
    /// Top-p (nucleus) sampling at `temperature > 0`: draw among the most likely tokens whose
    /// mass reaches `top_p`, in `(0, 1]`; 1 keeps them all (Hugging Face's default).
    pub top_p: f64,
    /// Most tokens generated after the prompt.
    pub max_new_tokens: usize,
    /// The tokens that end a response (the one drawn is kept as its last token): the
    /// tokenizer's [`stop_ids`](odc_text::Tokenizer::stop_ids), e.g. Llama 3's `<|eot_id|>`
    /// and `<|end_of_text|>`.
    pub stop: Vec<u32>,
}

impl Sampling {
    /// Sampling at `temperature` (0: greedy) from the whole distribution (`top_p` 1), at most
    /// `max_new_tokens`, ending at `stop`.
    pub fn new(temperature: f64, max_new_tokens: usize, stop: Vec<u32>) -> Self {
        Sampling {
            temperature,
            top_p: 1.0,
            max_new_tokens,
            stop,
        }
    }

    /// Greedy decoding of at most `max_new_tokens`, ending at `stop`.
    pub fn greedy(max_new_tokens: usize, stop: Vec<u32>) -> Self {
        Sampling::new(0.0, max_new_tokens, stop)
    }

    /// An error naming the setting that is out of range.
    pub(super) fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::Batch(format!(
                "temperature must be finite and >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Batch(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// A prompt of a batch: continued `samples` times (a GRPO group; 1 for an answer), each
/// continuation ending at a stop id of [`Sampling::stop`] or at one of its own `stop`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prompt<'a> {
    pub tokens: &'a [u32],
    pub samples: usize,
    pub stop: &'a [u32],
}

impl<'a> Prompt<'a> {
    /// `tokens`, continued once, with no stop ids of its own.
    pub fn new(tokens: &'a [u32]) -> Self {
        Prompt {
            tokens,
            samples: 1,
            stop: &[],
        }
    }

    /// Continued `samples` times.
    pub fn samples(self, samples: usize) -> Self {
        Prompt { samples, ..self }
    }

    /// Ending also at `stop`.
    pub fn stop(self, stop: &'a [u32]) -> Self {
        Prompt { stop, ..self }
    }
}

/// A sampled response and the log-probability of each of its tokens under the model that drew
/// it (at temperature 1: `log p(token | prompt, earlier tokens)`, what GRPO's ratio and KL use).
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub log_probs: Vec<f32>,
}
