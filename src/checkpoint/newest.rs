//! [`newest`]: the checkpoint a restarted run continues from (`examples/sft --resume auto`).

use std::path::{Path, PathBuf};

use super::{CheckpointError, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE};

/// The newest complete checkpoint in `dir`: the `step-<N>` directory with the largest `N` that
/// holds all three files ([`MODEL_FILE`], [`OPTIMIZER_FILE`], [`STATE_FILE`]). `None` when `dir`
/// does not exist or holds none.
///
/// What is not a checkpoint is passed over: [`save`](super::save)'s staging directories
/// (`.step-<N>.tmp-<pid>`, left by a process killed while writing), names other than
/// `step-<N>` in the form `save` writes, files, and a `step-<N>` missing one of its files (a
/// checkpoint being replaced when its writer was killed; logged). The files themselves are
/// checked when [`load`](super::load) reads them.
///
/// Every process of a job that calls this before the job starts sees the same directory (only a
/// running job writes new checkpoints), so on one host, or a shared filesystem, every rank
/// resumes from the same step.
///
/// ```
/// let dir = std::env::temp_dir().join(format!("odc-newest-doc-{}", std::process::id()));
/// assert_eq!(odc::checkpoint::newest(&dir).unwrap(), None);
/// ```
pub fn newest(dir: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(e)),
    };
    let mut best: Option<(u64, PathBuf)> = None;
    for entry in entries {
        let entry = entry.map_err(io)?;
        let Some(step) = entry.file_name().to_str().and_then(step_of) else {
            continue;
        };
        let path = entry.path();
        if !path.is_dir() || best.as_ref().is_some_and(|(b, _)| *b >= step) {
            continue;
        }
        let missing: Vec<&str> = [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE]
            .into_iter()
            .filter(|f| !path.join(f).is_file())
            .collect();
        if !missing.is_empty() {
            tracing::warn!(
                "{}: not a complete checkpoint (no {}); passed over",
                path.display(),
                missing.join(", ")
            );
            continue;
        }
        best = Some((step, path));
    }
    Ok(best.map(|(_, path)| path))
}

/// `N` of a directory named `step-<N>` exactly as [`step_dir`](super::step_dir) names it.
fn step_of(name: &str) -> Option<u64> {
    let step: u64 = name.strip_prefix("step-")?.parse().ok()?;
    (format!("step-{step}") == name).then_some(step)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::temp_path;

    /// A step directory with `files` in it.
    fn step(dir: &Path, name: &str, files: &[&str]) {
        let path = dir.join(name);
        std::fs::create_dir_all(&path).unwrap();
        for file in files {
            std::fs::write(path.join(file), b"x").unwrap();
        }
    }

    const ALL: [&str; 3] = [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE];

    #[test]
    fn the_largest_complete_step_by_number_not_by_name() {
        let dir = temp_path("odc-ckpt", "newest");
        step(&dir, "step-2", &ALL);
        step(&dir, "step-10", &ALL);
        // Newer, but not checkpoints: partial, staging, other names, a file.
        step(&dir, "step-11", &[MODEL_FILE, STATE_FILE]);
        step(&dir, ".step-12.tmp-4242", &ALL);
        step(&dir, "step-013", &ALL);
        step(&dir, "step-14x", &ALL);
        step(&dir, "step--15", &ALL);
        std::fs::write(dir.join("step-20"), b"a file").unwrap();
        assert_eq!(newest(&dir).unwrap(), Some(dir.join("step-10")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn none_when_the_directory_is_missing_or_holds_no_checkpoint() {
        let dir = temp_path("odc-ckpt", "newest-none");
        assert_eq!(newest(&dir).unwrap(), None, "missing");
        step(&dir, ".step-3.tmp-1", &ALL);
        step(&dir, "step-4", &[STATE_FILE]);
        assert_eq!(newest(&dir).unwrap(), None, "nothing complete");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_in_place_of_the_directory_is_an_error_naming_it() {
        let path = temp_path("odc-ckpt", "newest-file");
        std::fs::write(&path, b"not a directory").unwrap();
        let err = newest(&path).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()), "{err}");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn what_save_writes_is_found() {
        use super::super::{save, NamedTensor, TensorMap, TrainState};
        let dir = temp_path("odc-ckpt", "newest-saved");
        let map = TensorMap::new(vec![vec![NamedTensor::new("w", &[2])]]).unwrap();
        for s in [3, 6] {
            let state = TrainState {
                step: s,
                params: vec![vec![1.0, 2.0]],
                optimizer: vec![odc_actors::layout::UnitOptimizerInit {
                    steps: s,
                    buffers: Vec::new(),
                }],
            };
            save(&dir, &map, &state, &serde_json::Value::Null).unwrap();
        }
        assert_eq!(newest(&dir).unwrap(), Some(dir.join("step-6")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
