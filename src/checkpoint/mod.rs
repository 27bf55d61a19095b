//! Checkpoints: a job's [`TrainState`] (global step, fp32 master values, optimizer state) on disk,
//! in a directory per step that candle and Python's `safetensors` read:
//!
//! ```text
//! DIR/step-<N>/model.safetensors      the parameters, by the model's names and shapes (fp32)
//! DIR/step-<N>/optimizer.safetensors  `<param>.<buffer>` per optimizer buffer (`exp_avg`, ...)
//! DIR/step-<N>/state.json             step, unit names, optimizer steps, and the caller's state
//!                                     (config, data position, RNG) as JSON
//! ```
//!
//! Guarantees (tested in `files.rs`):
//! - **round trip**: [`load`] of what [`save`] wrote gives back the same state, bit for bit, and the
//!   caller's JSON; a job resumed from it continues exactly (docs/design.md I3, `tests/checkpoint.rs`);
//! - **atomic**: a step directory appears complete or not at all (written beside it, then renamed);
//! - **bad files are errors naming the file**: missing, truncated, corrupted, a tensor missing,
//!   of another shape or dtype — never a panic, never a partly loaded state;
//! - **newest**: [`newest`] finds the `step-<N>` with the largest `N` holding all three files,
//!   passing over staging directories and partial ones (`newest.rs`): what a restarted run
//!   resumes from.

mod files;
mod newest;
mod tensors;
mod train_state;

pub use files::{load, save, step_dir, CheckpointError, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE};
pub use newest::newest;
pub use tensors::{NamedTensor, TensorMap};
pub use train_state::TrainState;
