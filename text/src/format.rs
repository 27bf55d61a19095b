//! How text becomes a model's tokens: odc's plain format, or a model's own chat template.
//!
//! - [`TextFormat::Plain`]: `BOS question \n answer EOS` with any [`Tokenizer`] (odc's reference
//!   model and the byte tokenizer; [`Sample::from_problem`], [`prompt_tokens`]).
//! - [`TextFormat::Chat`]: a model directory's tokenizer and Jinja `chat_template`
//!   ([`HfTokenizer::from_dir`]): a problem is the conversation `[user: question, assistant:
//!   answer]` ([`Problem::messages`]), the loss on the assistant's turns, end-of-turn included
//!   ([`Sample::from_chat`]), and a prompt is the template around the user's question with the
//!   generation prompt ([`prompt_from_chat`]).
//!
//! Guarantee (tested): a format's [`TextFormat::prompt`] is the prefix of its
//! [`TextFormat::problem_sample`] that carries no loss, so what a model is prompted with at
//! evaluation or in RL is what it was trained to continue.

use std::sync::Arc;

use super::chat::Message;
use super::chat_sample::prompt_from_chat;
use super::hf_tokenizer::HfTokenizer;
use super::packing::{fitting_as, prompt_tokens, Sample};
use super::problem::Problem;
use super::tokenizer::Tokenizer;
use super::TextError;

/// See the [module docs](self).
#[derive(Clone)]
pub enum TextFormat {
    Plain(Arc<dyn Tokenizer>),
    Chat(Arc<HfTokenizer>),
}

impl std::fmt::Debug for TextFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TextFormat::Plain(t) => write!(f, "Plain({} ids)", t.vocab_size()),
            TextFormat::Chat(t) => write!(f, "Chat({t:?})"),
        }
    }
}

impl TextFormat {
    /// The tokenizer (for decoding, stop ids and the vocabulary size).
    pub fn tokenizer(&self) -> Arc<dyn Tokenizer> {
        match self {
            TextFormat::Plain(t) => t.clone(),
            TextFormat::Chat(t) => t.clone(),
        }
    }

    /// Whether conversations (chat JSONL) can be formatted: only with a chat template.
    pub fn is_chat(&self) -> bool {
        matches!(self, TextFormat::Chat(_))
    }

    /// `problem` as a training sample, the loss on its answer.
    pub fn problem_sample(&self, problem: &Problem) -> Result<Sample, TextError> {
        match self {
            TextFormat::Plain(t) => Sample::from_problem(&**t, problem),
            TextFormat::Chat(t) => Sample::from_chat(t, &problem.messages()),
        }
    }

    /// A conversation as a training sample, the loss on the assistant's turns; plain text has no
    /// turns, so it is an error naming the tokenizer.
    pub fn chat_sample(&self, messages: &[Message]) -> Result<Sample, TextError> {
        match self {
            TextFormat::Chat(t) => Sample::from_chat(t, messages),
            TextFormat::Plain(_) => Err(TextError::ChatTemplate {
                origin: "the plain text format".into(),
                reason: "a conversation needs a model's chat template (a model directory)".into(),
            }),
        }
    }

    /// The first `n` of `problems` whose training sample fits `max_len` tokens ([`fitting_as`]).
    pub fn fitting(
        &self,
        problems: impl IntoIterator<Item = Problem>,
        max_len: usize,
        n: usize,
    ) -> Result<Vec<Problem>, TextError> {
        fitting_as(problems, max_len, n, |p| self.problem_sample(p))
    }

    /// What a model continues to answer `question`.
    pub fn prompt(&self, question: &str) -> Result<Vec<u32>, TextError> {
        match self {
            TextFormat::Plain(t) => prompt_tokens(&**t, question),
            TextFormat::Chat(t) => prompt_from_chat(t, &[Message::user(question)]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ArithTask, ByteTokenizer};

    #[test]
    fn the_prompt_is_the_samples_unmasked_prefix() {
        use crate::test_tokenizers::{chat_dir, ChatModel};
        let dir = chat_dir("format", ChatModel::Qwen25);
        let formats = [
            TextFormat::Plain(Arc::new(ByteTokenizer)),
            TextFormat::Chat(Arc::new(HfTokenizer::from_dir(&dir.0).unwrap())),
        ];
        for format in &formats {
            for problem in ArithTask::train(2).problems(0..20) {
                let sample = format.problem_sample(&problem).unwrap();
                let prompt = format.prompt(&problem.question).unwrap();
                assert_eq!(&sample.tokens()[..prompt.len()], &prompt[..], "{format:?}");
                assert!(sample.loss_mask()[..prompt.len()].iter().all(|m| !m));
                assert!(
                    sample.loss_mask()[prompt.len()],
                    "{format:?}: the answer carries loss"
                );
            }
        }
        let plain = &formats[0];
        assert!(!plain.is_chat() && formats[1].is_chat());
        assert!(plain.chat_sample(&[Message::user("hi")]).is_err());
    }
}
