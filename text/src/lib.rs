//! # odc-text — post-training text
//!
//! Problems, conversations, tokenizers and chat templates, packed samples and rewards, for the
//! SFT and GRPO recipes and for the model's evaluation (`odc::text` re-exports this crate). Pure
//! Rust, CPU-cheap, no model and no runtime: it depends only on `odc-policy`, for the length a
//! sample gives the balancer.
//!
//! The pieces and what each guarantees (tests are named after the guarantees):
//!
//! - [`problem`]: a [`Problem`] is a question and a GSM8K-style answer whose last `#### ` line
//!   holds the final answer ([`Problem::final_answer`]); as chat ([`Problem::messages`]), the
//!   question is the user's turn and the answer the assistant's.
//! - [`arith`]: [`ArithTask`] generates grade-school arithmetic word problems. (1) A problem is a
//!   pure function of (seed, split, index), the same on every platform. (2) Every step line is
//!   exact integer arithmetic on numbers in `2..=1000`, and the `####` line repeats the last
//!   result. (3) Step counts are long-tailed (`P(n) ∝ n^-1.5` for 1–12 steps), so token lengths
//!   vary wildly. (4) The train and eval splits share no question.
//! - [`gsm8k`]: [`gsm8k::load`] reads GSM8K-format JSONL; every malformed line is an error naming
//!   the file, the 1-based line and what was wrong.
//! - [`conversation`]: [`conversation::load`] reads chat JSONL (`{"messages": [{"role",
//!   "content"}, …]}`, TRL's, axolotl's and verl's format) the same way; a role other than
//!   system/user/assistant/tool, non-string content or a conversation without an assistant turn
//!   is an error naming the line.
//! - [`tokenizer`]: the [`Tokenizer`] trait and [`ByteTokenizer`] (the default), whose round trip
//!   is lossless for any UTF-8 text and which never fails.
//! - [`hf_tokenizer`]: [`HfTokenizer`] reads a Hugging Face model directory (`tokenizer.json`,
//!   `tokenizer_config.json`, `generation_config.json`): BOS (optional), EOS, PAD and every stop
//!   id as those files say, the model's `chat_template`, a vocabulary size that covers every id it
//!   emits; a bad file or field is an error naming the file and the field.
//! - [`chat`]: [`ChatTemplate`] renders the model's own Jinja chat template as `transformers`
//!   does; [`Sample::from_chat`] puts the loss on the assistant's turns, end-of-turn token
//!   included, never on headers or other turns; [`prompt_from_chat`] is the prompt a model
//!   answers.
//! - [`packing`]: a [`Sample`] of a problem is `BOS question \n answer EOS` (BOS when the
//!   tokenizer has one) with loss only on the answer and EOS; [`pack`] fills rows up to a token
//!   budget in order, with positions restarting at each sample and segment ids that change
//!   exactly at sample boundaries; a sample over the budget is an error naming it.
//!   [`sample_metas`] gives odc's balancer the real lengths.
//! - [`reward`](mod@reward): GRPO rewards from the `####` line: [`exact_match`],
//!   [`format_reward`] and their weighted sum [`reward()`].

pub mod arith;
pub mod chat;
mod chat_sample;
pub mod conversation;
pub mod format;
pub mod gsm8k;
pub mod hf_tokenizer;
mod jsonl;
pub mod packing;
pub mod problem;
pub mod reward;
#[cfg(test)]
mod test_tokenizers;
pub mod tokenizer;

pub use arith::{ArithTask, Split};
pub use chat::{ChatTemplate, Message};
pub use chat_sample::prompt_from_chat;
pub use format::TextFormat;
pub use hf_tokenizer::HfTokenizer;
pub use packing::{fitting, fitting_as, pack, prompt_tokens, sample_metas, Packed, Sample};
pub use problem::Problem;
pub use reward::{exact_match, extract_answer, format_reward, reward, weighted_reward};
pub use tokenizer::{ByteTokenizer, Tokenizer};

use std::path::PathBuf;

/// What was wrong with text data or a tokenizer; each variant names the file and line, the file,
/// or the sample.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// The file could not be opened.
    #[error("cannot open {}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file could not be read past a line.
    #[error("cannot read {} at line {line}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The 1-based line that could not be read.
        line: usize,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A line is not a well-formed record.
    #[error("{}:{line}: {reason}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// The 1-based line.
        line: usize,
        /// What was wrong with it.
        reason: String,
    },
    /// A tokenizer file is not usable (or a model's configuration file is not a JSON object), or
    /// its tokenizer could not encode or decode.
    #[error("tokenizer {}: {reason}", path.display())]
    Tokenizer {
        /// The tokenizer's file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// A field of a model's configuration file (`tokenizer_config.json`,
    /// `generation_config.json`) has the wrong type, or names a token or id the vocabulary lacks.
    #[error("{}: field \"{field}\": {reason}", path.display())]
    ConfigField {
        /// The configuration file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What was wrong.
        reason: String,
    },
    /// A chat template does not compile, fails to render (its own `raise_exception` included),
    /// or renders earlier turns differently as a conversation grows.
    #[error("chat template {origin}: {reason}")]
    ChatTemplate {
        /// Where the template came from (its file).
        origin: String,
        /// What was wrong.
        reason: String,
    },
    /// A sample's tokens and loss mask disagree in length, or it has no tokens.
    #[error(
        "a sample needs at least one token and one mask entry per token; \
         got {tokens} tokens and {mask} mask entries"
    )]
    SampleShape {
        /// Its token count.
        tokens: usize,
        /// Its mask length.
        mask: usize,
    },
    /// A sample does not fit the packing budget.
    #[error("sample {index} has {tokens} tokens, over the packing budget of {budget}")]
    OverBudget {
        /// Its index in the input.
        index: usize,
        /// Its token count.
        tokens: usize,
        /// The budget.
        budget: usize,
    },
}

/// Test-only helpers shared by the crate's unit tests.
#[cfg(test)]
pub(crate) mod test_util {
    pub(crate) use odc_policy::testing::temp_path;
}
