//! The model's one error type: a bad configuration (naming the field), a malformed packed batch, a
//! parameter buffer of the wrong size, a device that cannot be opened or moved to, a tokenizer's
//! error (evaluation), a bad Hugging Face checkpoint or `config.json` (naming the file and the
//! tensor or field), or an error from candle itself.

/// Errors of [`crate::model`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A [`ModelConfig`](super::ModelConfig) field has a value the model cannot be built with.
    #[error("invalid model config: `{field}` {reason}")]
    Config {
        /// The offending field, as spelled in the struct.
        field: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// A gang's exchange failed: a peer missed its deadline, the gang was aborted, or a message
    /// was malformed (sequence splitting, [`crate::gang`]).
    #[error("gang: {0}")]
    Gang(String),
    /// A packed micro-batch is inconsistent (lengths differ, a token is out of the vocabulary, …).
    #[error("invalid packed batch: {0}")]
    Batch(String),
    /// A unit's parameters (a flat buffer, or a list of tensors) do not match its parameter list.
    #[error("unit parameters: expected {expected} {what}, got {got}")]
    UnitParams {
        /// `"values"` (a flat buffer) or `"tensors"`.
        what: &'static str,
        /// How many the unit's parameter list needs.
        expected: usize,
        /// How many were given.
        got: usize,
    },
    /// A unit index past the model's last unit.
    #[error("no unit {unit}: the model has {units} units")]
    NoSuchUnit {
        /// The index asked for.
        unit: usize,
        /// `n_layers + 2`.
        units: usize,
    },
    /// A compute device could not be named or opened (a bad `--device`, no CUDA driver, a build
    /// without the `cuda` feature, a failed transfer to or from the device).
    #[error("{0}")]
    Device(String),
    /// A tokenizer could not encode a prompt or decode an answer (it names its file).
    #[error(transparent)]
    Text(#[from] odc_text::TextError),
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A Hugging Face model directory's file (safetensors, index, `config.json`) cannot be read or
    /// does not hold what its config describes: names the file, the tensor where there is one,
    /// and what was expected ([`crate::hf`]).
    #[error("{}{}: {reason}", .path.display(), tensor_part(.tensor))]
    Checkpoint {
        /// The file (or, when the directory lacks one, the directory).
        path: std::path::PathBuf,
        /// The tensor, by its Hugging Face name, where the defect is one tensor's.
        tensor: Option<String>,
        /// What is wrong and what was expected.
        reason: String,
    },
    /// A Hugging Face `config.json` field has the wrong type, or a value odc does not implement
    /// (another activation, sliding window, MoE, another rope type, ...).
    #[error("{}: `{field}` {reason}", .path.display())]
    HfConfig {
        /// The `config.json`.
        path: std::path::PathBuf,
        /// The field as spelled in the file (`rope_scaling.rope_type` for a nested one).
        field: String,
        /// What it holds and what was expected.
        reason: String,
    },
}

fn tensor_part(tensor: &Option<String>) -> String {
    tensor
        .as_deref()
        .map(|t| format!(": tensor `{t}`"))
        .unwrap_or_default()
}

/// `Result` with the model's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
