//! # odc-checkpoint — the checkpoint files
//!
//! Below the runtime: `odc-actors`' shard servers write their part through [`shard_file`] and
//! [`step_dir`], and the root crate's `Job` publishes, verifies and opens what they wrote
//! (`odc::checkpoint` re-exports this crate).
//!
//! Checkpoints: a job's [`TrainState`] (global step, fp32 master values, optimizer state) on disk,
//! in a directory per step that candle and Python's `safetensors` read:
//!
//! ```text
//! DIR/step-<N>/model.safetensors      the parameters, by the model's names and shapes (fp32)
//! DIR/step-<N>/optimizer.safetensors  `<param>.<buffer>` per optimizer buffer (`exp_avg`, ...)
//! DIR/step-<N>/state.json             step, unit names, optimizer steps, and the caller's state
//!                                     (config, data position, RNG) as JSON
//! DIR/step-<N>/manifest.json          written last: every file's size and CRC32C
//! ```
//!
//! Guarantees (tested in `files.rs`, `manifest.rs`, `newest.rs`):
//! - **round trip**: [`load`] of what [`save`] wrote gives back the same state, bit for bit, and the
//!   caller's JSON; a job resumed from it continues exactly (docs/design.md I3, `tests/checkpoint.rs`);
//! - **durable and atomic**: every file, the manifest and the staging directory are synced before
//!   the rename that publishes `step-<N>`, and `DIR` after it: a step directory appears complete
//!   or not at all, also after a power loss;
//! - **verified**: [`load`] checks every file against the manifest (size, CRC32C) before parsing
//!   it; a missing manifest, a flipped bit, a truncated or emptied file is an error naming the
//!   file — never a panic, never a partly loaded state, never a silently wrong model;
//! - **newest that verifies**: [`newest`] walks back from the `step-<N>` with the largest `N` to
//!   the newest one that [`verify`]s, logging why each newer one was passed over, and fails only
//!   when none verifies: what a restarted run resumes from;
//! - **retention**: [`retain`] deletes older checkpoints only once the newer ones it keeps are
//!   complete (`--keep-last`);
//! - **sharded** ([`sharded`], `Job::save_checkpoint`): every shard server writes its own
//!   `shard-<server>.safetensors` ([`shard_file`], in a staging directory [`step_dir`] claims and
//!   publishes); [`open`] maps the files and reads each unit range by range
//!   from the pieces (they must tile it), so a job resumes with any number of servers and each
//!   server reads only its own range (`JobBuilder::resume_from`); [`load`] reads it whole.

mod error;
mod files;
mod layout;
pub mod manifest;
mod newest;
mod open;
pub mod shard_file;
pub mod sharded;
pub mod step_dir;
mod train_state;

pub use error::{CheckpointError, FileError};
pub use files::{load, save};
pub use layout::{fresh_staging, step_dir, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE};
pub use manifest::{Manifest, MANIFEST_FILE};
pub use newest::{newest, retain, verify};
pub use odc_policy::tensor_map::{NamedTensor, TensorMap};
pub use open::{open, open_newest, Opened};
pub use train_state::TrainState;

/// Test-only helpers shared by the crate's unit tests.
#[cfg(test)]
pub(crate) mod test_util {
    pub(crate) use odc_policy::testing::temp_path;
}
