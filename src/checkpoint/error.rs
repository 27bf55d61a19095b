//! Why a checkpoint could not be written or read ([`CheckpointError`], naming the file), and the
//! two ways the module's files make one.

use std::path::{Path, PathBuf};

/// Why a checkpoint could not be written or read; names the file.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is not what a checkpoint holds (truncated, corrupted, a tensor missing or of
    /// another shape).
    #[error("{}: {reason}", path.display())]
    Invalid { path: PathBuf, reason: String },
    /// The state does not fit the model's tensor map.
    #[error("checkpoint does not fit the model: {0}")]
    Map(String),
}

impl From<odc_actors::policy::tensor_map::TensorMapError> for CheckpointError {
    fn from(e: odc_actors::policy::tensor_map::TensorMapError) -> Self {
        CheckpointError::Map(e.0)
    }
}

pub(super) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(super) fn invalid(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Invalid {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}
