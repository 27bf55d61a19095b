//! `--resume DIR|auto` ([`Resume`]) and when a checkpoint is due ([`checkpoint_due`]).
//!
//! Guarantees:
//! - `auto` is the newest complete checkpoint of the checkpoint directory that opens
//!   ([`crate::checkpoint::open_newest`]: a newer one that does not is passed over with a warning
//!   naming why), or none: the run then starts from scratch and the lead says so on stderr. So
//!   one command line both starts a run and continues it after a crash, as
//!   `odc launch --max-restarts N` needs; every rank finds the same checkpoint (the ranks share
//!   the directory).
//! - A named directory must open; its error names the directory.
//! - Opening maps and verifies a checkpoint's files; it does not read them whole: each shard
//!   server reads its own ranges.
//! - A checkpoint is due after every `every` steps and after the last (`every` 0: never).

use std::path::{Path, PathBuf};

use super::{RecipeError, Result};
use crate::checkpoint::{self, Opened, TensorMap};

/// Where a run continues from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// This checkpoint (a `step-<N>` directory).
    From(PathBuf),
    /// The newest complete checkpoint of the checkpoint directory, if any.
    Newest,
}

impl Resume {
    /// `--resume`'s value: `auto`, else a directory (`./auto` names a directory called auto).
    pub fn parse(value: &Path) -> Resume {
        match value.as_os_str() == "auto" {
            true => Resume::Newest,
            false => Resume::From(value.to_path_buf()),
        }
    }

    /// The checkpoint to continue from and its directory (`None`: from scratch), opened against
    /// the model's `tensors`; `checkpoint_dir` is where [`Resume::Newest`] looks.
    pub fn open(
        &self,
        checkpoint_dir: &Path,
        tensors: &TensorMap,
        lead: bool,
    ) -> Result<Option<(PathBuf, Opened)>> {
        match self {
            Resume::From(dir) => {
                let opened = checkpoint::open(dir, tensors).map_err(RecipeError::checkpoint(
                    format!("resuming from {}", dir.display()),
                ))?;
                Ok(Some((dir.clone(), opened)))
            }
            Resume::Newest => {
                let newest = checkpoint::open_newest(checkpoint_dir, tensors).map_err(
                    RecipeError::checkpoint("--resume auto: looking for the newest checkpoint"),
                )?;
                if newest.is_none() && lead {
                    eprintln!(
                        "--resume auto: no checkpoint in {}: starting from scratch",
                        checkpoint_dir.display()
                    );
                }
                Ok(newest)
            }
        }
    }
}

/// Whether step `done` (1-based) of `steps` is one to checkpoint after, every `every` steps.
pub fn checkpoint_due(every: u64, done: u64, steps: u64) -> bool {
    every > 0 && (done % every == 0 || done == steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_the_newest_and_anything_else_a_directory() {
        assert_eq!(Resume::parse(Path::new("auto")), Resume::Newest);
        assert_eq!(
            Resume::parse(Path::new("./auto")),
            Resume::From(PathBuf::from("./auto"))
        );
        assert_eq!(
            Resume::parse(Path::new("ckpt/step-50")),
            Resume::From(PathBuf::from("ckpt/step-50"))
        );
    }

    #[test]
    fn a_checkpoint_is_due_every_n_steps_and_after_the_last() {
        let due: Vec<u64> = (1..=7).filter(|&d| checkpoint_due(3, d, 7)).collect();
        assert_eq!(due, [3, 6, 7]);
        assert!(!(1..=7).any(|d| checkpoint_due(0, d, 7)));
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_it_and_auto_finds_none_in_an_empty_one() {
        let tensors = TensorMap::flat(&[("w".into(), 4)]).unwrap();
        let missing = std::env::temp_dir().join(format!("odc-recipe-{}-none", std::process::id()));
        let e = Resume::From(missing.join("step-3"))
            .open(&missing, &tensors, false)
            .unwrap_err();
        assert!(e.to_string().contains("step-3"), "{e}");
        assert!(Resume::Newest
            .open(&missing, &tensors, false)
            .unwrap()
            .is_none());
    }
}
