//! A step directory's layout: its files' names, `state.json`, where a checkpoint is staged
//! before it is published, and the publication itself (the manifest written last, every file
//! and directory synced, the rename).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::shard_file::ShardFile;

use super::error::{io, CheckpointError};
use super::manifest::{self, FileEntry, Manifest};

/// The parameters' file in a step directory.
pub const MODEL_FILE: &str = "model.safetensors";
/// The optimizer state's file.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The step, layout and the caller's state.
pub const STATE_FILE: &str = "state.json";
/// Version of the directory format `state.json` names.
pub(super) const FORMAT: u32 = 1;

/// `state.json`.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct StateFile {
    pub(super) format: u32,
    pub(super) step: u64,
    /// Per unit, its tensors' names (a check that the files are of this model).
    pub(super) units: Vec<Vec<String>>,
    /// Per unit, the optimizer's step count.
    pub(super) optimizer_steps: Vec<u64>,
    /// Per unit, the optimizer's buffers (`<tensor>.<buffer>` in the optimizer file).
    pub(super) optimizer_buffers: Vec<Vec<String>>,
    /// The caller's state (config, data position, RNG...).
    pub(super) extra: serde_json::Value,
    /// A sharded checkpoint's files, one per shard server, and the ranges each holds
    /// ([`super::sharded`]); empty for one written by [`save`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) shards: Vec<ShardFile>,
}

/// `dir/step-<step>`.
pub fn step_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step}"))
}

/// The files of every checkpoint, which its manifest must name.
pub(super) const FILES: [&str; 3] = [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE];

/// Creates `dir` if needed and an empty [`staging_dir`] in it.
pub fn fresh_staging(dir: &Path, step: u64) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let staging = staging_dir(dir, step);
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(io(&staging))?;
    }
    std::fs::create_dir(&staging).map_err(io(&staging))?;
    Ok(staging)
}

/// `dir/.step-<step>.tmp-<pid>`: where a checkpoint of `step` is written before it is published.
pub(super) fn staging_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!(".step-{step}.tmp-{}", std::process::id()))
}

/// Publishes the checkpoint written into `staging` as `dir/step-<step>`: the manifest (`known`
/// entries, then `measured` files), synced, the staging directory synced, renamed into place
/// (an existing step moved aside first and removed after), and `dir` synced.
pub(super) fn publish(
    dir: &Path,
    staging: &Path,
    step: u64,
    known: Vec<FileEntry>,
    measured: &[&str],
) -> Result<PathBuf, CheckpointError> {
    manifest::write_with(staging, step, known, measured)?;
    let target = step_dir(dir, step);
    crate::step_dir::publish(staging, &target)?;
    Ok(target)
}

/// Reads `name` of `step_dir` and checks it against the manifest: size and CRC32C.
pub(super) fn read_checked(
    step_dir: &Path,
    manifest: &Manifest,
    name: &str,
) -> Result<Vec<u8>, CheckpointError> {
    let path = step_dir.join(name);
    let bytes = std::fs::read(&path).map_err(io(&path))?;
    manifest.entry(step_dir, name)?.check(&path, &bytes)?;
    Ok(bytes)
}
