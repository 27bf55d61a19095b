//! A checkpoint's manifest: `manifest.json`, written last into the step directory, names every
//! file of the checkpoint with its size in bytes and its CRC32C. A step directory is a checkpoint
//! only when its manifest says it is complete and every file it names matches it.
//!
//! Guarantees (tested below, one of them as a property):
//! - [`verify`] accepts a directory only if the manifest is there, complete, names the files
//!   every checkpoint holds, and every file it names has exactly its size and checksum;
//! - anything else is an error naming the file and what differs — never a panic: the manifest is
//!   read as untrusted input (a file name with a path in it is refused);
//! - [`write`] makes the manifest durable (the file is synced) before it returns.

use std::path::Path;

use crate::step_dir;
use serde::{Deserialize, Serialize};

use super::error::{invalid, io, CheckpointError};

/// The manifest's file name in a step directory.
pub const MANIFEST_FILE: &str = step_dir::MANIFEST_FILE;

/// Version of the manifest's format.
const FORMAT: u32 = 1;

/// What `manifest.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    /// The checkpoint's global step.
    pub step: u64,
    /// Written as `true`: a manifest is the last thing a writer writes.
    pub complete: bool,
    pub files: Vec<FileEntry>,
}

/// One file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Its name in the step directory.
    pub name: String,
    pub bytes: u64,
    /// CRC32C (Castagnoli) of its bytes.
    pub crc32c: u32,
}

impl FileEntry {
    /// Checks `bytes`, the content of this file, against the entry.
    pub fn check(&self, path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
        check(self, path, bytes.len() as u64, crc32c::crc32c(bytes))
    }
}

impl Manifest {
    /// The entry of file `name`, or an error naming the manifest.
    pub fn entry(&self, dir: &Path, name: &str) -> Result<&FileEntry, CheckpointError> {
        self.files.iter().find(|f| f.name == name).ok_or_else(|| {
            invalid(
                &dir.join(MANIFEST_FILE),
                format!("names no {name}: not a checkpoint of this format"),
            )
        })
    }
}

fn check(entry: &FileEntry, path: &Path, bytes: u64, crc: u32) -> Result<(), CheckpointError> {
    if bytes != entry.bytes {
        return Err(invalid(
            path,
            format!(
                "has {bytes} bytes, the manifest says {} (truncated or replaced)",
                entry.bytes
            ),
        ));
    }
    if crc != entry.crc32c {
        return Err(invalid(
            path,
            format!(
                "checksum (crc32c) {crc:08x}, the manifest says {:08x}: the file is corrupted",
                entry.crc32c
            ),
        ));
    }
    Ok(())
}

/// Size and CRC32C of the file at `path`, read in chunks.
fn measure(path: &Path) -> Result<(u64, u32), CheckpointError> {
    crate::shard_file::measure(path).map_err(io(path))
}

/// Writes the manifest of `files` (names in `dir`, measured now) for `step`, synced to disk.
pub fn write(dir: &Path, step: u64, files: &[&str]) -> Result<Manifest, CheckpointError> {
    write_with(dir, step, Vec::new(), files)
}

/// [`write`] with entries already `known` (files written and measured elsewhere, such as each
/// shard server's file: the writer does not read them again) before those `measured` now.
pub fn write_with(
    dir: &Path,
    step: u64,
    known: Vec<FileEntry>,
    measured: &[&str],
) -> Result<Manifest, CheckpointError> {
    let mut files = known;
    for &name in measured {
        let (bytes, crc32c) = measure(&dir.join(name))?;
        files.push(FileEntry {
            name: name.to_string(),
            bytes,
            crc32c,
        });
    }
    let json = encode(dir, step, files.clone())?;
    write_synced(&dir.join(MANIFEST_FILE), &json)?;
    Ok(Manifest {
        format: FORMAT,
        step,
        complete: true,
        files,
    })
}

/// The manifest of `files` for `step`, as `manifest.json` holds it (for the step directory
/// `dir`, which an error names).
pub fn encode(dir: &Path, step: u64, files: Vec<FileEntry>) -> Result<Vec<u8>, CheckpointError> {
    let manifest = Manifest {
        format: FORMAT,
        step,
        complete: true,
        files,
    };
    serde_json::to_vec_pretty(&manifest)
        .map_err(|e| invalid(&dir.join(MANIFEST_FILE), format!("cannot encode: {e}")))
}

/// Writes `bytes` to `path` and syncs the file.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    Ok(step_dir::write_synced(path, bytes)?)
}

/// Reads `dir`'s manifest, checked for form (not yet against the files).
pub fn read(dir: &Path) -> Result<Manifest, CheckpointError> {
    let path = dir.join(MANIFEST_FILE);
    let text = match std::fs::read(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(invalid(
                &path,
                "missing: the checkpoint is incomplete (its writer stopped before the end) or \
                 was written before checkpoints had manifests",
            ))
        }
        Err(e) => return Err(io(&path)(e)),
    };
    let manifest: Manifest = serde_json::from_slice(&text)
        .map_err(|e| invalid(&path, format!("not a checkpoint manifest: {e}")))?;
    if manifest.format != FORMAT {
        return Err(invalid(
            &path,
            format!("format {} (this build reads {FORMAT})", manifest.format),
        ));
    }
    if !manifest.complete {
        return Err(invalid(&path, "says the checkpoint is not complete"));
    }
    for f in &manifest.files {
        let plain = Path::new(&f.name)
            .file_name()
            .is_some_and(|n| n == f.name.as_str());
        if !plain || f.name == MANIFEST_FILE {
            return Err(invalid(&path, format!("names the file {:?}", f.name)));
        }
    }
    Ok(manifest)
}

/// Checks the checkpoint in `dir`: its manifest (see [`read`]) names every file of `required`,
/// and every file it names has its size and checksum. Reads every byte.
pub fn verify(dir: &Path, required: &[&str]) -> Result<Manifest, CheckpointError> {
    let manifest = read(dir)?;
    check_files(dir, &manifest, required)?;
    Ok(manifest)
}

/// Checks the files of `dir` against its `manifest` (already [`read`]): it names every file of
/// `required`, and every file it names has its size and checksum. Reads every byte.
pub fn check_files(
    dir: &Path,
    manifest: &Manifest,
    required: &[&str],
) -> Result<(), CheckpointError> {
    for name in required {
        manifest.entry(dir, name)?;
    }
    for entry in &manifest.files {
        let path = dir.join(&entry.name);
        let (bytes, crc) = match measure(&path) {
            Ok(m) => m,
            Err(CheckpointError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                return Err(invalid(&path, "missing, though the manifest names it"))
            }
            Err(e) => return Err(e),
        };
        check(entry, &path, bytes, crc)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::temp_path;
    use proptest::prelude::*;

    /// A step directory with files `a` and `b` and their manifest.
    fn written(tag: &str) -> std::path::PathBuf {
        let dir = temp_path("odc-manifest", tag);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("a"),
            vec![7u8; 12 << 20 | 5], /* past one 8 MiB read */
        )
        .unwrap();
        std::fs::write(dir.join("b"), b"bee").unwrap();
        write(&dir, 3, &["a", "b"]).unwrap();
        dir
    }

    #[test]
    fn what_was_written_verifies_and_every_fault_is_named() {
        let dir = written("faults");
        let m = verify(&dir, &["a", "b"]).unwrap();
        assert_eq!((m.step, m.files.len()), (3, 2));
        assert_eq!(m.files[1].crc32c, crc32c::crc32c(b"bee"));
        let fault = |f: &dyn Fn(), wanted: &str| {
            f();
            let e = verify(&dir, &["a", "b"]).unwrap_err().to_string();
            assert!(e.contains(wanted), "{wanted}: {e}");
        };
        fault(
            &|| std::fs::write(dir.join("b"), b"bEe").unwrap(),
            "b: checksum",
        );
        fault(
            &|| std::fs::write(dir.join("b"), b"be").unwrap(),
            "b: has 2 bytes",
        );
        fault(
            &|| std::fs::remove_file(dir.join("b")).unwrap(),
            "b: missing",
        );
        std::fs::write(dir.join("b"), b"bee").unwrap();
        verify(&dir, &["a", "b"]).unwrap();
        let e = verify(&dir, &["a", "b", "c"]).unwrap_err().to_string();
        assert!(e.contains("names no c"), "{e}");
        let json = dir.join(MANIFEST_FILE);
        let good = std::fs::read(&json).unwrap();
        std::fs::write(&json, &good[..good.len() / 2]).unwrap();
        let e = verify(&dir, &[]).unwrap_err().to_string();
        assert!(e.contains("not a checkpoint manifest"), "{e}");
        let mut m: Manifest = serde_json::from_slice(&good).unwrap();
        m.complete = false;
        std::fs::write(&json, serde_json::to_vec(&m).unwrap()).unwrap();
        assert!(verify(&dir, &[])
            .unwrap_err()
            .to_string()
            .contains("not complete"));
        m.complete = true;
        m.files[0].name = "../a".into();
        std::fs::write(&json, serde_json::to_vec(&m).unwrap()).unwrap();
        assert!(verify(&dir, &[])
            .unwrap_err()
            .to_string()
            .contains("\"../a\""));
        std::fs::remove_file(&json).unwrap();
        let e = verify(&dir, &[]).unwrap_err().to_string();
        assert!(e.contains("manifest.json: missing"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// A checkpoint is accepted exactly when every file's size and checksum match: any
        /// single change to a file's bytes (a flip, a cut, an extension) is refused, naming it.
        #[test]
        fn accepted_only_when_every_size_and_checksum_matches(
            content in prop::collection::vec(any::<u8>(), 1..2048),
            at in any::<prop::sample::Index>(),
            flip in 1u8..=255,
            change in 0u8..3,
        ) {
            let dir = temp_path("odc-manifest", "prop");
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("f"), &content).unwrap();
            write(&dir, 1, &["f"]).unwrap();
            prop_assert!(verify(&dir, &["f"]).is_ok());
            let mut damaged = content.clone();
            match change {
                0 => damaged[at.index(content.len())] ^= flip,
                1 => damaged.truncate(at.index(content.len())),
                _ => damaged.push(flip),
            }
            std::fs::write(dir.join("f"), &damaged).unwrap();
            let e = verify(&dir, &["f"]).unwrap_err().to_string();
            prop_assert!(e.contains("f: "), "{}", e);
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}
