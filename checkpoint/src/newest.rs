//! [`newest`]: the checkpoint a restarted run continues from (`examples/sft --resume auto`),
//! [`verify`]: whether a step directory is a checkpoint, and [`retain`]: `--keep-last`.

use std::path::{Path, PathBuf};

use crate::step_dir;

use super::layout::FILES;
use super::manifest::{self, Manifest};
use super::CheckpointError;

/// Checks the checkpoint in `step_dir` against its manifest: the manifest is there and complete,
/// names the model, optimizer and state files, and every file it names has its size and CRC32C.
/// Reads every byte. An error names the file and what differs.
pub fn verify(step_dir: &Path) -> Result<Manifest, CheckpointError> {
    let found = manifest::read(step_dir)?;
    // A sharded checkpoint has no model or optimizer file: its shard files are the manifest's.
    let sharded = !found.files.iter().any(|f| f.name == super::MODEL_FILE);
    manifest::check_files(step_dir, &found, if sharded { &FILES[2..] } else { &FILES })?;
    Ok(found)
}

/// The `step-<N>` directories of `dir`, largest `N` first; `None` when `dir` does not exist.
fn steps(dir: &Path) -> Result<Option<Vec<(u64, PathBuf)>>, CheckpointError> {
    step_dir::steps(dir).map_err(|source| CheckpointError::Io {
        path: dir.to_path_buf(),
        source,
    })
}

/// The newest checkpoint in `dir` that verifies ([`verify`]): from the `step-<N>` directory
/// with the largest `N` back, each newer one that does not verify is passed over with a warning
/// naming why (a missing manifest, a file of the wrong size, a checksum mismatch). `Ok(None)`
/// when `dir` does not exist or holds no `step-<N>` directory; an error, naming every reason,
/// when it holds some and none verifies: a damaged checkpoint is never loaded.
///
/// What is not a step directory is not looked at: [`save`](super::save)'s staging directories
/// (`.step-<N>.tmp-<pid>`, left by a process killed while writing), names other than `step-<N>`
/// in the form `save` writes, and files.
///
/// Every process of a job that calls this before the job starts sees the same directory (only a
/// running job writes new checkpoints), so on one host, or a shared filesystem, every rank
/// resumes from the same step.
///
/// ```
/// let dir = std::env::temp_dir().join(format!("odc-newest-doc-{}", std::process::id()));
/// assert_eq!(odc_checkpoint::newest(&dir).unwrap(), None);
/// ```
pub fn newest(dir: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    Ok(newest_by(dir, verify)?.map(|(path, _)| path))
}

/// The walk of [`newest`], with `accept` deciding whether a step directory is usable (and what
/// it gives: [`verify`]'s manifest, [`open`](super::open)'s checkpoint).
pub(super) fn newest_by<T>(
    dir: &Path,
    mut accept: impl FnMut(&Path) -> Result<T, CheckpointError>,
) -> Result<Option<(PathBuf, T)>, CheckpointError> {
    let Some(found) = steps(dir)? else {
        return Ok(None);
    };
    let mut reasons = Vec::new();
    for (_, path) in found {
        match accept(&path) {
            Ok(accepted) => return Ok(Some((path, accepted))),
            Err(e) => {
                tracing::warn!("{}: passed over: {e}", path.display());
                reasons.push(e.to_string());
            }
        }
    }
    if reasons.is_empty() {
        return Ok(None);
    }
    Err(CheckpointError::Invalid {
        path: dir.to_path_buf(),
        reason: format!(
            "no checkpoint verifies ({} tried): {}",
            reasons.len(),
            reasons.join("; ")
        ),
    })
}

/// Keeps the newest `keep_last` complete checkpoints of `dir` (those whose manifest says so; the
/// newest is the one just written) and deletes every `step-<N>` directory older than the oldest
/// kept, returning what it deleted. Nothing is deleted until `keep_last` complete ones exist, so
/// an older checkpoint goes only after a newer one is complete. `keep_last = 0` keeps everything.
pub fn retain(dir: &Path, keep_last: usize) -> Result<Vec<PathBuf>, CheckpointError> {
    step_dir::retain(dir, keep_last, |path| manifest::read(path).is_ok())
        .map_err(CheckpointError::from)
}

#[cfg(test)]
mod tests {
    use super::super::{save, NamedTensor, TensorMap, TrainState, MODEL_FILE, STATE_FILE};
    use super::*;
    use crate::test_util::temp_path;

    fn map() -> TensorMap {
        TensorMap::new(vec![vec![NamedTensor::new("w", &[64])]]).unwrap()
    }

    /// Saves a checkpoint of `step` in `dir`.
    fn saved(dir: &Path, step: u64) -> PathBuf {
        let state = TrainState {
            step,
            params: vec![(0..64).map(|i| i as f32 + step as f32).collect()],
            optimizer: vec![odc_policy::layout::UnitOptimizerInit {
                steps: step,
                buffers: Vec::new(),
            }],
        };
        save(dir, &map(), &state, &serde_json::Value::Null).unwrap()
    }

    #[test]
    fn the_largest_verified_step_by_number_not_by_name() {
        let dir = temp_path("odc-ckpt", "newest");
        saved(&dir, 2);
        saved(&dir, 10);
        // Not step directories: staging, other names, a file.
        for name in [".step-12.tmp-4242", "step-013", "step-14x", "step--15"] {
            std::fs::create_dir_all(dir.join(name)).unwrap();
        }
        std::fs::write(dir.join("step-20"), b"a file").unwrap();
        assert_eq!(newest(&dir).unwrap(), Some(dir.join("step-10")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// What a test does to a step directory.
    type Damage = dyn Fn(&Path);

    /// Every fault of issue 30 in the newest checkpoint: the previous one is used.
    #[test]
    fn a_damaged_newest_checkpoint_is_passed_over_for_the_previous_one() {
        let dir = temp_path("odc-ckpt", "walk-back");
        let damage: [(&str, &Damage); 5] = [
            ("a bit flip", &|p| {
                let f = p.join(MODEL_FILE);
                let mut b = std::fs::read(&f).unwrap();
                let mid = b.len() - 100;
                b[mid] ^= 0x40;
                std::fs::write(&f, b).unwrap();
            }),
            ("a truncation", &|p| {
                let f = p.join(MODEL_FILE);
                let b = std::fs::read(&f).unwrap();
                std::fs::write(&f, &b[..b.len() / 2]).unwrap();
            }),
            ("an empty file", &|p| {
                std::fs::write(p.join(STATE_FILE), b"").unwrap()
            }),
            ("a missing manifest", &|p| {
                std::fs::remove_file(p.join(manifest::MANIFEST_FILE)).unwrap()
            }),
            ("a missing file", &|p| {
                std::fs::remove_file(p.join(STATE_FILE)).unwrap()
            }),
        ];
        for (what, damage) in damage {
            let good = saved(&dir, 10);
            let bad = saved(&dir, 20);
            damage(&bad);
            assert!(verify(&bad).is_err(), "{what}");
            assert_eq!(newest(&dir).unwrap(), Some(good), "{what}");
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn none_when_nothing_is_there_and_an_error_when_nothing_verifies() {
        let dir = temp_path("odc-ckpt", "newest-none");
        assert_eq!(newest(&dir).unwrap(), None, "missing");
        std::fs::create_dir_all(dir.join(".step-3.tmp-1")).unwrap();
        assert_eq!(newest(&dir).unwrap(), None, "only a staging directory");
        let only = saved(&dir, 4);
        std::fs::write(only.join(STATE_FILE), b"{}").unwrap();
        let e = newest(&dir).unwrap_err().to_string();
        assert!(e.contains("no checkpoint verifies (1 tried)"), "{e}");
        assert!(e.contains("state.json"), "{e}");
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
    fn retain_deletes_older_checkpoints_only_once_newer_ones_are_complete() {
        let dir = temp_path("odc-ckpt", "retain");
        saved(&dir, 1);
        saved(&dir, 2);
        assert!(retain(&dir, 3).unwrap().is_empty(), "fewer than 3 complete");
        saved(&dir, 3);
        // Step 4 is incomplete (its writer died before the manifest): it does not count.
        let four = saved(&dir, 4);
        std::fs::remove_file(four.join(manifest::MANIFEST_FILE)).unwrap();
        assert_eq!(retain(&dir, 2).unwrap(), vec![dir.join("step-1")]);
        assert!(dir.join("step-2").exists() && dir.join("step-3").exists());
        saved(&dir, 5);
        assert_eq!(retain(&dir, 2).unwrap(), vec![dir.join("step-2")]);
        assert!(retain(&dir, 0).unwrap().is_empty(), "0 keeps everything");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
