//! Sharded checkpoints: every shard server writes its own shards
//! (`crate::shard_file`, one `shard-<server>.safetensors` each, from wherever they
//! live), and the lead adds only `state.json` (with the shard map) and the manifest, whose entries
//! for the shard files are the servers' own reports: no byte of another server's shards passes
//! through the lead ([`Publication`]). [`open`](super::open) reads them back range by range,
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

use crate::shard_file::WrittenShards;
use crate::shard_file::{ShardFile, ShardPiece};
use crate::step_dir::PublishShardsCmd;
/// A shard server's endpoint (odc-transport's `EndpointId`): the servers are `0..servers`.
type EndpointId = u32;

use super::error::{invalid, CheckpointError};
use super::layout::{publish, step_dir, StateFile, FORMAT, STATE_FILE};
use super::manifest::{self, FileEntry};
use super::TensorMap;

/// A sharded checkpoint of `step` whose servers have written their files, ready to publish: the
/// files checked to tile every unit, `state.json` encoded (every server's file and ranges), and
/// the files grouped by the directory they went into ([`WrittenShards::dir_id`]): the lead's,
/// and one group per other host where checkpoint directories are per host.
pub struct Publication {
    dir: PathBuf,
    staging: PathBuf,
    step: u64,
    state_json: Vec<u8>,
    /// The files in the lead's directory.
    local: Vec<FileEntry>,
    /// Per other directory: the server that publishes it and the files in it.
    hosts: Vec<(EndpointId, Vec<FileEntry>)>,
}

impl Publication {
    /// `written` in server order (server `i` reported `written[i]`); `lead_id` is the token the
    /// lead claimed `staging` with.
    pub fn new(
        dir: &Path,
        staging: &Path,
        step: u64,
        tensors: &TensorMap,
        written: Vec<WrittenShards>,
        lead_id: &str,
        extra: &serde_json::Value,
    ) -> Result<Self, CheckpointError> {
        let entry = |f: &ShardFile| FileEntry {
            name: f.file.clone(),
            bytes: f.bytes,
            crc32c: f.crc32c,
        };
        let mut local = Vec::new();
        let mut hosts: Vec<(String, EndpointId, Vec<FileEntry>)> = Vec::new();
        for (server, w) in written.iter().enumerate() {
            if w.dir_id == lead_id {
                local.push(entry(&w.file));
            } else if let Some(host) = hosts.iter_mut().find(|h| h.0 == w.dir_id) {
                host.2.push(entry(&w.file));
            } else {
                let server = EndpointId::try_from(server).unwrap_or(EndpointId::MAX);
                hosts.push((w.dir_id.clone(), server, vec![entry(&w.file)]));
            }
        }
        let files: Vec<ShardFile> = written.into_iter().map(|w| w.file).collect();
        let (steps, buffers) = plan(staging, tensors, &files)?;
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
        let state_json = serde_json::to_vec_pretty(&state)
            .map_err(|e| invalid(&json_path, format!("cannot encode: {e}")))?;
        Ok(Publication {
            dir: dir.to_path_buf(),
            staging: staging.to_path_buf(),
            step,
            state_json,
            local,
            hosts: hosts.into_iter().map(|(_, s, f)| (s, f)).collect(),
        })
    }

    /// What the other hosts' servers publish first (per-host directories; empty when every
    /// server wrote into the lead's directory): per host, one of its servers and the command
    /// that writes `state.json` and that host's manifest, and renames its staging directory.
    /// Each host then keeps its newest `keep_last` step directories and one more (0: all): it
    /// publishes before the lead, so until the lead's step appears the step before is the newest
    /// one every host holds, and it must survive a lead that dies in between.
    pub fn hosts(
        &self,
        keep_last: usize,
    ) -> Result<Vec<(EndpointId, PublishShardsCmd)>, CheckpointError> {
        let state = FileEntry {
            name: STATE_FILE.into(),
            bytes: self.state_json.len() as u64,
            crc32c: crc32c::crc32c(&self.state_json),
        };
        let target = step_dir(&self.dir, self.step);
        self.hosts
            .iter()
            .map(|(server, files)| {
                let mut entries = files.clone();
                entries.push(state.clone());
                let manifest = manifest::encode(&self.staging, self.step, entries)?;
                let cmd = PublishShardsCmd {
                    staging: self.staging.display().to_string(),
                    target: target.display().to_string(),
                    files: vec![
                        (STATE_FILE.to_string(), self.state_json.clone()),
                        (manifest::MANIFEST_FILE.to_string(), manifest),
                    ],
                    keep_last: if keep_last == 0 { 0 } else { keep_last + 1 },
                };
                Ok((*server, cmd))
            })
            .collect()
    }

    /// Publishes the lead's directory: `state.json`, the manifest of the files in it, synced and
    /// renamed into `dir/step-<step>`.
    pub fn finish(self) -> Result<PathBuf, CheckpointError> {
        manifest::write_synced(&self.staging.join(STATE_FILE), &self.state_json)?;
        publish(
            &self.dir,
            &self.staging,
            self.step,
            self.local,
            &[STATE_FILE],
        )
    }
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

    /// Per-host directories: two hosts, one server each, the same path on each. Each host's
    /// step directory is a complete, verifiable checkpoint of what it holds (its shard file,
    /// state.json with every server's ranges, its manifest); on host A server 0's ranges read
    /// back exactly, server 1's are an error naming the file and the other host; with host B's
    /// file copied over (checked against its server's report), the whole state reads back.
    #[test]
    fn per_host_directories_publish_each_hosts_part() {
        use crate::shard_file::{self, ShardValues};
        use crate::step_dir as host;

        let root = std::env::temp_dir().join(format!("odc-per-host-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (a, b) = (root.join("host-a"), root.join("host-b"));
        let map = TensorMap::flat(&[("u".into(), 6)]).unwrap();
        let values = |start: u64, end: u64| ShardValues {
            unit: 0,
            start,
            end,
            params: (start..end).map(|i| i as f32 + 0.5).collect(),
            steps: 2,
            buffers: vec![(
                "exp_avg".into(),
                (start..end).map(|i| -(i as f32)).collect(),
            )],
        };
        let staging_a = a.join(".step-2.tmp-1");
        let staging_b = b.join(".step-2.tmp-1");
        let lead = host::claim(&staging_a, "lead-1").unwrap();
        let mut written = Vec::new();
        for (server, staging) in [(0u64, &staging_a), (1, &staging_b)] {
            let dir_id = host::claim(staging, &format!("server-{server}")).unwrap();
            let name = format!("shard-{server:05}.safetensors");
            let file =
                shard_file::write(staging, &name, &[values(server * 3, server * 3 + 3)]).unwrap();
            written.push(WrittenShards { file, dir_id });
        }
        assert_eq!(
            written[0].dir_id, lead,
            "server 0 shares the lead's directory"
        );
        assert_eq!(
            written[1].dir_id, "server-1",
            "server 1 claimed its host's own"
        );
        let publication = Publication::new(
            &a,
            &staging_a,
            2,
            &map,
            written,
            &lead,
            &serde_json::Value::Null,
        )
        .unwrap();
        let hosts = publication.hosts(0).unwrap();
        assert_eq!(hosts.len(), 1);
        assert_eq!(hosts[0].0, 1, "server 1 publishes host B's part");
        // What server 1 does on host B (the same path there; another root here).
        host::publish_with(&staging_b, &b.join("step-2"), &hosts[0].1.files, 0).unwrap();
        let step_a = publication.finish().unwrap();
        let step_b = b.join("step-2");
        for (step, own) in [(&step_a, "shard-00000"), (&step_b, "shard-00001")] {
            let manifest = crate::verify(step).unwrap();
            let mut names: Vec<&str> = manifest.files.iter().map(|f| f.name.as_str()).collect();
            names.sort();
            assert_eq!(names, [format!("{own}.safetensors").as_str(), "state.json"]);
            assert!(!step.join(host::DIR_ID).exists());
        }
        let opened = crate::open(&step_a, &map).unwrap();
        assert_eq!(opened.params()[0].slice(0..3).unwrap(), vec![0.5, 1.5, 2.5]);
        let e = opened.params()[0].slice(2..5).unwrap_err().to_string();
        assert!(
            e.contains("shard-00001.safetensors") && e.contains("another host"),
            "{e}"
        );
        std::fs::copy(
            step_b.join("shard-00001.safetensors"),
            step_a.join("shard-00001.safetensors"),
        )
        .unwrap();
        let state = crate::open(&step_a, &map).unwrap().read_all().unwrap();
        assert_eq!(state.params[0], vec![0.5, 1.5, 2.5, 3.5, 4.5, 5.5]);
        assert_eq!(state.optimizer[0].buffers[0].1[4], -4.0);
        // A copied file that is not what its server wrote is refused, naming it.
        let copied = step_a.join("shard-00001.safetensors");
        let mut bytes = std::fs::read(&copied).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&copied, bytes).unwrap();
        let e = crate::open(&step_a, &map).unwrap_err().to_string();
        assert!(e.contains("shard-00001.safetensors"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
