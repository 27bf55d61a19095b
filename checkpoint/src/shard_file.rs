//! A shard server's part of a sharded checkpoint: one safetensors file holding, for every shard
//! it owns, the fp32 master values and the optimizer's buffers of that range of its unit, written
//! by the server itself from its own memory (host or device), so no other process carries them.
//!
//! - Tensors are named [`tensor_name`]`(unit, start, end, what)`: `unit3.1024-2048.params`,
//!   `unit3.1024-2048.exp_avg`. A reader assembles each unit from the ranges of every server's
//!   file, whatever number of servers it runs with (re-sharding on load).
//! - [`write`] streams the values to the file without copying them again (one copy of a server's
//!   shards is all a checkpoint holds), syncs it, and reports its size and CRC32C (read back) for
//!   the checkpoint's manifest.
//!
//! Guarantees (tested below): a written file parses back to exactly the values given; a failure
//! to write is an [`FileError`] naming the file.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::FileError;

type Result<T> = std::result::Result<T, FileError>;
use odc_policy::UnitId;

/// What a server wrote for a checkpoint: its file, and the id of the staging directory it wrote
/// into ([`claim`](crate::step_dir::claim)): the lead's token where it shares
/// the lead's directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrittenShards {
    pub file: ShardFile,
    pub dir_id: String,
}

/// The parameters' tensor in a shard file ([`tensor_name`]'s `what`).
pub const PARAMS: &str = "params";

/// `unit<unit>.<start>-<end>.<what>`: `what` is [`PARAMS`] or an optimizer buffer's name.
pub fn tensor_name(unit: UnitId, start: u64, end: u64, what: &str) -> String {
    format!("unit{unit}.{start}-{end}.{what}")
}

/// One shard's values, copied out of its store.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardValues {
    pub unit: UnitId,
    pub start: u64,
    pub end: u64,
    /// fp32 master weights, `end − start` of them.
    pub params: Vec<f32>,
    /// The optimizer's step count (0 for a frozen shard).
    pub steps: u64,
    /// The optimizer's buffers by name (none for a frozen shard).
    pub buffers: Vec<(String, Vec<f32>)>,
}

/// What a server reports of the file it wrote: for the manifest (size, CRC32C) and for the reader
/// (which ranges it holds, with their optimizer's step count and buffer names).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardFile {
    /// Its name in the step directory.
    pub file: String,
    pub bytes: u64,
    pub crc32c: u32,
    pub pieces: Vec<ShardPiece>,
}

/// One range of a unit in a [`ShardFile`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardPiece {
    pub unit: UnitId,
    pub start: u64,
    pub end: u64,
    pub steps: u64,
    pub buffers: Vec<String>,
}

fn fail(path: &Path, reason: impl std::fmt::Display) -> FileError {
    FileError {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// A tensor of `f32`s as safetensors sees it: little-endian bytes, borrowed where the machine is
/// little-endian (no copy), converted otherwise.
struct F32View<'a> {
    values: &'a [f32],
    shape: [usize; 1],
}

impl safetensors::View for F32View<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        #[cfg(target_endian = "little")]
        {
            // SAFETY: an f32 is 4 bytes without padding, and u8 has alignment 1; the slice
            // borrows `values` for as long as `self`. On a little-endian machine these are the
            // little-endian bytes the format stores.
            let bytes = unsafe {
                std::slice::from_raw_parts(self.values.as_ptr().cast::<u8>(), self.values.len() * 4)
            };
            std::borrow::Cow::Borrowed(bytes)
        }
        #[cfg(not(target_endian = "little"))]
        {
            std::borrow::Cow::Owned(self.values.iter().flat_map(|v| v.to_le_bytes()).collect())
        }
    }
    fn data_len(&self) -> usize {
        self.values.len() * 4
    }
}

/// Size and CRC32C of the file at `path`, read in chunks of 8 MiB: what a checkpoint's manifest
/// records of every file ([`crate::manifest`] measures with it too).
pub fn measure(path: &Path) -> std::io::Result<(u64, u32)> {
    use std::io::Read as _;
    let mut f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 8 << 20];
    let (mut bytes, mut crc) = (0u64, 0u32);
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok((bytes, crc));
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        bytes += n as u64;
    }
}

/// Writes `shards` to `dir/file` (synced) and reports it. Streams the values to the file without
/// another copy of them (on a little-endian machine), then reads the file back for its CRC32C:
/// the extra memory of a write is a buffer, not a copy of the shards.
pub fn write(dir: &Path, file: &str, shards: &[ShardValues]) -> Result<ShardFile> {
    let path = dir.join(file);
    let mut views: Vec<(String, F32View<'_>)> = Vec::new();
    let mut pieces = Vec::with_capacity(shards.len());
    for s in shards {
        let len = (s.end - s.start) as usize;
        let tensors = std::iter::once((PARAMS, s.params.as_slice()))
            .chain(s.buffers.iter().map(|(n, v)| (n.as_str(), v.as_slice())));
        for (what, values) in tensors {
            if values.len() != len {
                return Err(fail(
                    &path,
                    format!(
                        "unit {} {}..{}: {what} has {} values",
                        s.unit,
                        s.start,
                        s.end,
                        values.len()
                    ),
                ));
            }
            let name = tensor_name(s.unit, s.start, s.end, what);
            views.push((
                name,
                F32View {
                    values,
                    shape: [len],
                },
            ));
        }
        pieces.push(ShardPiece {
            unit: s.unit,
            start: s.start,
            end: s.end,
            steps: s.steps,
            buffers: s.buffers.iter().map(|(n, _)| n.clone()).collect(),
        });
    }
    let metadata = std::collections::HashMap::from([("format".into(), "odc-shard".into())]);
    safetensors::serialize_to_file(views, Some(metadata), &path).map_err(|e| fail(&path, e))?;
    std::fs::File::open(&path)
        .and_then(|f| f.sync_all())
        .map_err(|e| fail(&path, e))?;
    let (bytes, crc32c) = measure(&path).map_err(|e| fail(&path, e))?;
    Ok(ShardFile {
        file: file.to_string(),
        bytes,
        crc32c,
        pieces,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_file_holds_exactly_its_ranges_and_is_reported() {
        let dir = std::env::temp_dir().join(format!("odc-shard-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let shards = vec![
            ShardValues {
                unit: 0,
                start: 2,
                end: 5,
                params: vec![1.0, 2.0, 3.0],
                steps: 7,
                buffers: vec![("exp_avg".into(), vec![0.5, 0.25, 0.125])],
            },
            ShardValues {
                unit: 3,
                start: 0,
                end: 1,
                params: vec![-1.5],
                steps: 0,
                buffers: Vec::new(),
            },
        ];
        let report = write(&dir, "shard-00001.safetensors", &shards).unwrap();
        let bytes = std::fs::read(dir.join(&report.file)).unwrap();
        assert_eq!(
            (report.bytes, report.crc32c),
            (bytes.len() as u64, crc32c::crc32c(&bytes))
        );
        assert_eq!(report.pieces[0].buffers, vec!["exp_avg".to_string()]);
        assert_eq!((report.pieces[1].unit, report.pieces[1].steps), (3, 0));
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let values = |name: &str| -> Vec<f32> {
            file.tensor(name)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        };
        assert_eq!(values(&tensor_name(0, 2, 5, PARAMS)), vec![1.0, 2.0, 3.0]);
        assert_eq!(
            values(&tensor_name(0, 2, 5, "exp_avg")),
            vec![0.5, 0.25, 0.125]
        );
        assert_eq!(values(&tensor_name(3, 0, 1, PARAMS)), vec![-1.5]);
        // A buffer of the wrong length is an error naming the file, before anything is written.
        let mut bad = shards.clone();
        bad[0].buffers[0].1.pop();
        let e = write(&dir, "bad.safetensors", &bad)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bad.safetensors") && e.contains("exp_avg has 2 values"),
            "{e}"
        );
        assert!(!dir.join("bad.safetensors").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
