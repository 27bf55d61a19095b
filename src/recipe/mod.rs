//! Recipes: what every training entry does around its loop, written once for the SFT and GRPO
//! examples and the Python package, so that each entry is a straight loop that a reader follows
//! top to bottom, as llm.c's train loop is:
//!
//! ```text
//! flags → Process::start → (resume) → JobRecipe::builder … .build()
//!       → for step in first..steps { job.step(); Progress; Evaluator; checkpoint_due }
//!       → export
//! ```
//!
//! - [`process`]: this process's part of a run: the launcher's world, the lead rank, its share
//!   of the host's cores, the tokio runtime, metrics on the port plus the rank, lines printed
//!   once;
//! - [`placement`]: where the trainers compute, from the flags' words;
//! - [`fleet`]: how many trainers and shard servers, and on which ranks;
//! - [`job`]: [`JobRecipe`], a transformer's job with AdamW, its fleet and a checkpoint to
//!   resume;
//! - [`resume`]: `--resume DIR|auto`, and when a checkpoint is due;
//! - [`evaluator`]: where the lead answers held-out problems, on the servers' published weights;
//! - [`export`]: the trained model in Hugging Face layout, PEFT's adapters or the merged model;
//! - [`progress`]: a run's rate, its smoothed loss, its MFU and its lines;
//! - [`log`]: every logged figure to JSONL and to TensorBoard ([`tensorboard`]'s event files);
//! - [`reward_command`]: a user's reward as a command (GRPO's `--reward-command`).
//!
//! Without the `candle` feature (the Python package, where PyTorch computes) only [`process`],
//! [`fleet`], [`resume`], [`progress`], [`log`] and [`reward_command`] are here; the rest builds odc's own model's jobs.
//!
//! Every error is a [`RecipeError`] naming the flag, the file or the phase. Nothing here parses
//! a command line or draws a progress bar: those are the entry's (clap and indicatif stay out of
//! what embedding odc pulls in).

pub mod error;
#[cfg(feature = "candle")]
pub mod evaluator;
#[cfg(feature = "candle")]
pub mod export;
pub mod fleet;
#[cfg(feature = "candle")]
pub mod job;
pub mod log;
#[cfg(feature = "candle")]
pub mod placement;
pub mod process;
pub mod progress;
pub mod resume;
pub mod reward_command;
pub mod tensorboard;

pub use error::RecipeError;
#[cfg(feature = "candle")]
pub use evaluator::Evaluator;
#[cfg(feature = "candle")]
pub use export::{export, export_dtype, Export};
pub use fleet::Fleet;
#[cfg(feature = "candle")]
pub use job::{adamw, JobRecipe};
pub use log::Log;
#[cfg(feature = "candle")]
pub use placement::{peak, placement};
pub use process::Process;
pub use progress::{Peak, Progress};
pub use resume::{checkpoint_due, Resume};
pub use reward_command::{RewardCommand, RewardInput};

/// What a recipe's function returns.
pub type Result<T> = std::result::Result<T, RecipeError>;
