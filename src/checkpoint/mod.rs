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
//!   `shard-<server>.safetensors`; [`open`] maps the files and reads each unit range by range
//!   from the pieces (they must tile it), so a job resumes with any number of servers and each
//!   server reads only its own range (`JobBuilder::resume_from`); [`load`] reads it whole.

mod error;
mod files;
mod layout;
pub mod manifest;
mod newest;
mod open;
pub mod sharded;
mod train_state;

pub use error::CheckpointError;
pub use files::{load, save};
pub(crate) use layout::fresh_staging;
pub use layout::{step_dir, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE};
pub use manifest::{Manifest, MANIFEST_FILE};
pub use newest::{newest, retain, verify};
pub use odc_actors::policy::tensor_map::{NamedTensor, TensorMap};
pub use open::{open, open_newest, Opened};
pub use train_state::TrainState;
