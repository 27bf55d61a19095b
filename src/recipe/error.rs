//! [`RecipeError`]: why a recipe could not set up, run or finish a job. Each variant names the
//! flag, the file or the phase; where a lower layer's error is the cause it is kept as the
//! source, so a binary's report (`anyhow`'s) shows the chain.

use crate::checkpoint::CheckpointError;
use crate::launch::WorldError;

/// Why a recipe failed; names the flag, the file or the phase.
#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    /// A setting is not one the recipe takes; the text names the flag and the value.
    #[error("{0}")]
    Invalid(String),
    /// A checkpoint could not be found, opened or read; `context` names it and the phase.
    #[error("{context}")]
    Checkpoint {
        context: String,
        #[source]
        source: CheckpointError,
    },
    /// The model refused (a configuration, a value, a unit); its text names what.
    #[cfg(feature = "candle")]
    #[error(transparent)]
    Model(#[from] crate::model::Error),
    /// A model's files could not be read or written; `context` names the directory and the flag.
    #[cfg(feature = "candle")]
    #[error("{context}")]
    ModelFiles {
        context: String,
        #[source]
        source: crate::model::Error,
    },
    /// A user's reward command failed, hung or printed what is not a reward; the text names the
    /// command and what it did.
    #[error("{0}")]
    Reward(String),
    /// The launcher's environment holds a value odc cannot use.
    #[error("reading the launcher's environment")]
    World(#[source] WorldError),
    /// The runtime refused or failed (building, stepping or reading the job).
    #[error(transparent)]
    Runtime(#[from] crate::Error),
    /// The operating system refused (starting the tokio runtime); `context` names what.
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl RecipeError {
    /// A model files' error under `context`.
    #[cfg(feature = "candle")]
    pub(crate) fn files(context: impl Into<String>) -> impl FnOnce(crate::model::Error) -> Self {
        let context = context.into();
        move |source| RecipeError::ModelFiles { context, source }
    }

    /// A checkpoint error under `context`.
    pub(crate) fn checkpoint(context: impl Into<String>) -> impl FnOnce(CheckpointError) -> Self {
        let context = context.into();
        move |source| RecipeError::Checkpoint { context, source }
    }
}
