//! [`SegmentError`]: everything that can go wrong with a segment, each naming the segment or path.

use std::io;
use std::path::Path;

/// Everything that can go wrong with a segment. Each variant names the segment (or path).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SegmentError {
    #[error("shared-memory segment I/O on {path}: {error}")]
    Io { path: String, error: String },
    #[error("segment {name} is not usable: {what}")]
    BadHeader { name: String, what: String },
    #[error("segment {name} belongs to job {found:?}, expected job {expected:?}")]
    WrongJob {
        name: String,
        expected: String,
        found: String,
    },
    #[error("segment {name} already exists and its owner (pid {pid}) is alive")]
    Exists { name: String, pid: u32 },
    #[error(
        "byte range {start}..{end} is out of bounds or not element aligned for segment {name} \
         of {len} bytes in {elem_size}-byte elements"
    )]
    OutOfRange {
        name: String,
        start: usize,
        end: usize,
        len: usize,
        elem_size: usize,
    },
    #[error("{found} bytes given for segment {name} of {expected} bytes")]
    LengthMismatch {
        name: String,
        expected: usize,
        found: usize,
    },
    #[error(
        "read of segment {name} missed its deadline (a publication in progress, or an owner \
         that died in the middle of one)"
    )]
    Deadline { name: String },
    #[error("invalid segment parameters: {what}")]
    Invalid { what: String },
}

pub(super) fn io_error(path: &Path, error: &io::Error) -> SegmentError {
    SegmentError::Io {
        path: path.display().to_string(),
        error: error.to_string(),
    }
}
