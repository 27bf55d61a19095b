//! Sharded checkpoints: every shard server writes its own shards
//! (`odc_actors::server::shard_file`, one `shard-<server>.safetensors` each, from wherever they
//! live), and the lead adds only `state.json` (with the shard map) and the manifest, whose entries
//! for the shard files are the servers' own reports: no byte of another server's shards passes
//! through the lead ([`finish`]). [`open`](super::open) reads them back range by range,
//! whatever number of servers wrote them, so a job resumed with 2 or 3 servers from 4 re-shards
//! as it starts, each server reading only its own ranges (`JobBuilder::resume_from`).
//!
//! ```text
//! DIR/step-<N>/shard-00000.safetensors  server 0's ranges: `unit<u>.<start>-<end>.params`, and
//! DIR/step-<N>/shard-00001.safetensors  `.<buffer>` per optimizer buffer (fp32)
//! DIR/step-<N>/state.json               as for `save`, plus `shards`: each file's ranges
//! DIR/step-<N>/manifest.json            every file's size and CRC32C, written last
//! ```
//!
//! Guarantees (tested in `tests.rs` of this module and by the job tests): the ranges of a unit
//! must tile it exactly, every piece of a unit must agree on its optimizer's step count and
//! buffers, and every file is checked against the manifest before it is read; anything else is an
//! error naming the file or the unit.

use std::path::{Path, PathBuf};

use odc_actors::server::shard_file::{ShardFile, ShardPiece};

use super::files::{invalid, publish, CheckpointError, StateFile, FORMAT, STATE_FILE};
use super::manifest::{self, FileEntry};
use super::TensorMap;

/// Publishes the sharded checkpoint of `step` whose shard files the servers wrote into
/// `staging` (reported as `files`): checks that they tile every unit of `tensors`, writes
/// `state.json` (with `extra`), the manifest (the servers' sizes and CRC32Cs, and state.json's),
/// syncs and renames it into `dir/step-<step>`.
pub fn finish(
    dir: &Path,
    staging: &Path,
    step: u64,
    tensors: &TensorMap,
    files: Vec<ShardFile>,
    extra: &serde_json::Value,
) -> Result<PathBuf, CheckpointError> {
    let units = tensors.units().len();
    let (steps, buffers) = plan(staging, tensors, &files)?;
    debug_assert_eq!(steps.len(), units);
    let state = StateFile {
        format: FORMAT,
        step,
        units: tensors
            .units()
            .iter()
            .map(|u| u.iter().map(|t| t.name.clone()).collect())
            .collect(),
        optimizer_steps: steps,
        optimizer_buffers: buffers,
        extra: extra.clone(),
        shards: files,
    };
    let json_path = staging.join(STATE_FILE);
    let json = serde_json::to_vec_pretty(&state)
        .map_err(|e| invalid(&json_path, format!("cannot encode: {e}")))?;
    manifest::write_synced(&json_path, &json)?;
    let known = state
        .shards
        .iter()
        .map(|f| FileEntry {
            name: f.file.clone(),
            bytes: f.bytes,
            crc32c: f.crc32c,
        })
        .collect();
    publish(dir, staging, step, known, &[STATE_FILE])
}

/// Per unit, the optimizer's step count and buffer names, after checking that the pieces of
/// `files` tile every unit of `tensors` and agree on them.
pub(super) fn plan(
    at: &Path,
    tensors: &TensorMap,
    files: &[ShardFile],
) -> Result<(Vec<u64>, Vec<Vec<String>>), CheckpointError> {
    let units = tensors.units().len();
    let mut pieces: Vec<Vec<(&ShardPiece, &str)>> = vec![Vec::new(); units];
    for f in files {
        let plain = Path::new(&f.file)
            .file_name()
            .is_some_and(|n| n == f.file.as_str());
        if !plain {
            return Err(invalid(at, format!("a shard file named {:?}", f.file)));
        }
        for p in &f.pieces {
            let Some(list) = pieces.get_mut(p.unit as usize) else {
                return Err(invalid(
                    &at.join(&f.file),
                    format!("holds unit {}, the model has {units}", p.unit),
                ));
            };
            list.push((p, &f.file));
        }
    }
    let mut steps = Vec::with_capacity(units);
    let mut buffers = Vec::with_capacity(units);
    for (u, list) in pieces.iter_mut().enumerate() {
        list.sort_by_key(|(p, _)| p.start);
        let len = tensors.unit_len(u) as u64;
        let mut at_elem = 0u64;
        for &(&ShardPiece { start, end, .. }, file) in list.iter() {
            if start != at_elem || end < start {
                return Err(invalid(
                    &at.join(file),
                    format!(
                        "unit {u}: range {start}..{end} where {at_elem} was expected (the \
                         shards do not tile the unit)"
                    ),
                ));
            }
            at_elem = end;
        }
        if at_elem != len {
            return Err(invalid(
                at,
                format!("unit {u}: the shards hold {at_elem} of its {len} elements"),
            ));
        }
        let first = list.first().map(|(p, _)| (p.steps, p.buffers.clone()));
        let (s, b) = first.unwrap_or((0, Vec::new()));
        if let Some(&(_, file)) = list.iter().find(|(p, _)| p.steps != s || p.buffers != b) {
            return Err(invalid(
                &at.join(file),
                format!("unit {u}: its shards disagree on the optimizer's steps or buffers"),
            ));
        }
        steps.push(s);
        buffers.push(b);
    }
    Ok((steps, buffers))
}

/// The checkpoint in `step_dir` (sharded or not) rewritten as one consolidated checkpoint under
/// `out` (`out/step-<N>/model.safetensors` by the model's tensor names, as
/// [`save`](super::save) writes: what candle and Python's `safetensors` read directly).
pub fn consolidate(
    step_dir: &Path,
    tensors: &TensorMap,
    out: &Path,
) -> Result<PathBuf, CheckpointError> {
    let (state, extra) = super::load(step_dir, tensors)?;
    super::save(out, tensors, &state, &extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(unit: u32, start: u64, end: u64, steps: u64) -> ShardPiece {
        ShardPiece {
            unit,
            start,
            end,
            steps,
            buffers: vec!["exp_avg".into()],
        }
    }

    fn file(name: &str, pieces: Vec<ShardPiece>) -> ShardFile {
        ShardFile {
            file: name.into(),
            bytes: 0,
            crc32c: 0,
            pieces,
        }
    }

    /// The shards must tile every unit exactly and agree on its optimizer state; each fault is
    /// named.
    #[test]
    fn shards_must_tile_every_unit_and_agree() {
        let map = TensorMap::flat(&[("a".into(), 10), ("b".into(), 4)]).unwrap();
        let at = Path::new("/ckpt/.step-3.tmp-1");
        let good = vec![
            file(
                "shard-00000.safetensors",
                vec![piece(0, 0, 5, 3), piece(1, 0, 2, 3)],
            ),
            file(
                "shard-00001.safetensors",
                vec![piece(0, 5, 10, 3), piece(1, 2, 4, 3)],
            ),
        ];
        let (steps, buffers) = plan(at, &map, &good).unwrap();
        assert_eq!(steps, vec![3, 3]);
        assert_eq!(buffers[1], vec!["exp_avg".to_string()]);
        let cases: Vec<(Vec<ShardFile>, &str)> = vec![
            (
                vec![file(
                    "shard-00000.safetensors",
                    vec![piece(0, 0, 5, 3), piece(1, 0, 4, 3)],
                )],
                "unit 0: the shards hold 5 of its 10 elements",
            ),
            (
                vec![
                    file(
                        "shard-00000.safetensors",
                        vec![piece(0, 0, 6, 3), piece(1, 0, 4, 3)],
                    ),
                    file("shard-00001.safetensors", vec![piece(0, 5, 10, 3)]),
                ],
                "range 5..10 where 6 was expected",
            ),
            (
                vec![
                    file(
                        "shard-00000.safetensors",
                        vec![piece(0, 0, 10, 3), piece(1, 0, 2, 3)],
                    ),
                    file("shard-00001.safetensors", vec![piece(1, 2, 4, 2)]),
                ],
                "unit 1: its shards disagree",
            ),
            (
                vec![file("shard-00000.safetensors", vec![piece(7, 0, 1, 0)])],
                "holds unit 7, the model has 2",
            ),
            (
                vec![file("../x.safetensors", Vec::new())],
                "a shard file named",
            ),
        ];
        for (files, wanted) in cases {
            let e = plan(at, &map, &files).unwrap_err().to_string();
            assert!(e.contains(wanted), "{wanted}: {e}");
        }
    }
}
