//! Why a checkpoint could not be written or read ([`CheckpointError`], naming the file), the two
//! ways the crate's files make one, and what a shard server's part fails with ([`FileError`]).

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

impl From<odc_policy::tensor_map::TensorMapError> for CheckpointError {
    fn from(e: odc_policy::tensor_map::TensorMapError) -> Self {
        CheckpointError::Map(e.0)
    }
}

/// A file a shard server wrote or published could not be ([`crate::shard_file`],
/// [`crate::step_dir`]): plain data, the path and the reason as text, so that it crosses the
/// control plane inside the runtime's error (`odc_actors::Error::Checkpoint`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[error("{path}: {reason}")]
pub struct FileError {
    pub path: String,
    pub reason: String,
}

impl From<FileError> for CheckpointError {
    /// The file's error as the checkpoint's, naming the same path.
    fn from(e: FileError) -> Self {
        CheckpointError::Invalid {
            path: PathBuf::from(e.path),
            reason: e.reason,
        }
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
