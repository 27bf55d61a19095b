//! Helpers the workspace's tests share (feature `testing`, which only dev-dependencies turn on):
//! nothing here is part of what a program embeds.

use std::path::PathBuf;

/// A path in the temporary directory unique to this process, call and `name`.
pub fn temp_path(prefix: &str, name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!("{prefix}-{}-{nanos}-{name}", std::process::id()))
}
