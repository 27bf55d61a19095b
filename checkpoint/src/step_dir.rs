//! A checkpoint's step directory as one host sees it. A job names the checkpoint directory by one
//! path; on a shared filesystem every process sees the same directory there, and with per-host
//! directories each host has its own (a local disk at the same path). Shard servers write into
//! whichever they see:
//!
//! - [`claim`]: the lead makes the staging directory and claims it with its token (`dir.id`);
//!   a server claims it before writing its file, making it first where its host does not see the
//!   lead's (per-host). The token it finds is the directory's id: servers reporting the lead's
//!   share its directory, the others are grouped by the id they found (one group per host).
//! - [`publish`]: the staging directory, its files written and synced, is synced and renamed into
//!   place (a step being replaced moved aside first, removed after), and its parent synced; the
//!   lead does so on its host, and one server of each other host on that host
//!   ([`PublishShardsCmd`], before the lead's).
//!
//! Guarantees (tested below): one id per directory however many writers claim it at once, and
//! the first claimer's; a published directory holds no `dir.id`; every failure is an
//! [`FileError`] naming the path.

use std::io::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::FileError;

type Result<T> = std::result::Result<T, FileError>;

/// The claim's file in a staging directory.
pub const DIR_ID: &str = "dir.id";

/// Publish this host's part of a checkpoint (per-host directories): write `files` (name and
/// bytes: the checkpoint's state and this host's manifest) into `staging`, sync, and rename it to
/// `target` ([`publish_with`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishShardsCmd {
    pub staging: String,
    pub target: String,
    pub files: Vec<(String, Vec<u8>)>,
    /// Then keep this host's newest `keep_last` step directories (0: all).
    pub keep_last: usize,
}

fn fail(path: &Path, e: impl std::fmt::Display) -> FileError {
    FileError {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

/// Claims `staging` with `token` (made if this host does not have it yet) and returns the
/// directory's id: `token` if this call claimed it first, else the earlier claimer's. Atomic
/// among processes: the token is written to a file of its own and hard-linked as `dir.id`, which
/// fails if one is there.
pub fn claim(staging: &Path, token: &str) -> Result<String> {
    std::fs::create_dir_all(staging).map_err(|e| fail(staging, e))?;
    let id = staging.join(DIR_ID);
    let mine = staging.join(format!(".{DIR_ID}.{token}.{}", std::process::id()));
    write_synced(&mine, token.as_bytes())?;
    let linked = std::fs::hard_link(&mine, &id);
    let _ = std::fs::remove_file(&mine);
    match linked {
        Ok(()) => Ok(token.to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            std::fs::read_to_string(&id).map_err(|e| fail(&id, e))
        }
        Err(e) => Err(fail(&id, e)),
    }
}

/// Writes `bytes` to `path` and syncs the file.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = std::fs::File::create(path).map_err(|e| fail(path, e))?;
    file.write_all(bytes).map_err(|e| fail(path, e))?;
    file.sync_all().map_err(|e| fail(path, e))
}

/// Syncs the directory `dir` itself (what was created, removed or renamed in it).
pub fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| fail(dir, e))
}

/// Publishes `staging` (its files written and synced) as `target`: drops the claim, syncs
/// `staging`, moves an existing `target` aside, renames, syncs the parent, removes what was
/// moved aside.
pub fn publish(staging: &Path, target: &Path) -> Result<()> {
    match std::fs::remove_file(staging.join(DIR_ID)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(&staging.join(DIR_ID), e)),
    }
    sync_dir(staging)?;
    let parent = target
        .parent()
        .ok_or_else(|| fail(target, "a step directory needs a parent"))?;
    let name = target
        .file_name()
        .ok_or_else(|| fail(target, "a step directory needs a name"))?;
    let aside = parent.join(format!(
        ".{}.old-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let replaced = target.exists();
    if replaced {
        std::fs::rename(target, &aside).map_err(|e| fail(target, e))?;
    }
    std::fs::rename(staging, target).map_err(|e| fail(target, e))?;
    sync_dir(parent)?;
    if replaced {
        std::fs::remove_dir_all(&aside).map_err(|e| fail(&aside, e))?;
    }
    Ok(())
}

/// A host's part of a checkpoint, published by one of its servers: `files` (name, bytes: the
/// state and the host's manifest) written synced into `staging`, then [`publish`]ed as `target`;
/// then, where `keep_last` is positive, the host's older step directories are pruned as the
/// lead prunes its own ([`retain`]: those with a manifest count as complete). A file name must
/// be plain (no path in it).
pub fn publish_with(
    staging: &Path,
    target: &Path,
    files: &[(String, Vec<u8>)],
    keep_last: usize,
) -> Result<()> {
    if !staging.is_dir() {
        return Err(fail(staging, "no such staging directory on this host"));
    }
    for (name, bytes) in files {
        let plain = Path::new(name)
            .file_name()
            .is_some_and(|n| n == name.as_str());
        if !plain || name == DIR_ID {
            return Err(fail(
                staging,
                format!("will not write a file named {name:?}"),
            ));
        }
        write_synced(&staging.join(name), bytes)?;
    }
    publish(staging, target)?;
    if let (Some(parent), true) = (target.parent(), keep_last > 0) {
        retain(parent, keep_last, |step| step.join(MANIFEST_FILE).is_file())?;
    }
    Ok(())
}

/// A checkpoint's manifest file (written last: a step directory with one is complete;
/// [`crate::manifest`] writes and reads it).
pub const MANIFEST_FILE: &str = "manifest.json";

/// `N` of a directory named `step-<N>` exactly as a checkpoint's step directory is named.
pub fn step_of(name: &str) -> Option<u64> {
    let step: u64 = name.strip_prefix("step-")?.parse().ok()?;
    (format!("step-{step}") == name).then_some(step)
}

/// The `step-<N>` directories of `dir`, largest `N` first; `None` when `dir` does not exist.
pub fn steps(dir: &Path) -> std::io::Result<Option<Vec<(u64, std::path::PathBuf)>>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry?;
        let Some(step) = entry.file_name().to_str().and_then(step_of) else {
            continue;
        };
        let path = entry.path();
        if path.is_dir() {
            found.push((step, path));
        }
    }
    found.sort_by_key(|x| std::cmp::Reverse(x.0));
    Ok(Some(found))
}

/// Keeps the newest `keep_last` checkpoints of `dir` that `complete` accepts and deletes every
/// `step-<N>` directory older than the oldest kept, returning what it deleted. Nothing is deleted
/// until `keep_last` complete ones exist; `keep_last = 0` keeps everything. A directory another
/// process removed first is not an error (every host of a shared directory may prune it).
pub fn retain(
    dir: &Path,
    keep_last: usize,
    complete: impl Fn(&Path) -> bool,
) -> Result<Vec<std::path::PathBuf>> {
    let Some(found) = steps(dir).map_err(|e| fail(dir, e))? else {
        return Ok(Vec::new());
    };
    if keep_last == 0 {
        return Ok(Vec::new());
    }
    let kept: Vec<u64> = found
        .iter()
        .filter(|(_, path)| complete(path))
        .map(|(step, _)| *step)
        .take(keep_last)
        .collect();
    let Some(&oldest_kept) = kept.get(keep_last - 1) else {
        return Ok(Vec::new());
    };
    let mut deleted = Vec::new();
    for (step, path) in found.into_iter().filter(|(s, _)| *s < oldest_kept) {
        match std::fs::remove_dir_all(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(fail(&path, e)),
        }
        tracing::info!(
            "{}: deleted (keep the last {keep_last}; step {step})",
            path.display()
        );
        deleted.push(path);
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("odc-step-dir-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// Eight writers claiming one directory at once all find the same id, and it is one of theirs.
    #[test]
    fn one_id_per_directory_the_first_claimers() {
        let root = temp("claim");
        let staging = root.join(".step-3.tmp");
        let ids: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|i| {
                    let staging = staging.clone();
                    s.spawn(move || claim(&staging, &format!("server-{i}")).unwrap())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(ids.iter().all(|id| id == &ids[0]), "{ids:?}");
        assert!(ids[0].starts_with("server-"));
        assert_eq!(
            claim(&staging, "lead").unwrap(),
            ids[0],
            "a later claim finds it"
        );
        let names: Vec<_> = std::fs::read_dir(&staging).unwrap().collect();
        assert_eq!(names.len(), 1, "only dir.id is left of the claims");
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A host's files are published with the claim dropped, replacing an older step; a bad name
    /// or a missing staging directory is an error naming it.
    #[test]
    fn publish_with_writes_renames_and_replaces() {
        let root = temp("publish");
        let staging = root.join(".step-4.tmp");
        let target = root.join("step-4");
        std::fs::create_dir_all(&target).unwrap();
        std::fs::write(target.join("old"), b"old").unwrap();
        claim(&staging, "server-1").unwrap();
        let files = vec![("state.json".to_string(), b"{}".to_vec())];
        publish_with(&staging, &target, &files, 0).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&target)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["state.json"]);
        assert!(!staging.exists());
        let e = publish_with(&staging, &target, &files, 0).unwrap_err();
        assert!(e.to_string().contains("no such staging directory"), "{e}");
        claim(&staging, "server-1").unwrap();
        let bad = vec![("../x".to_string(), Vec::new())];
        let e = publish_with(&staging, &target, &bad, 0).unwrap_err();
        assert!(e.to_string().contains("../x"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
