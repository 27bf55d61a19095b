//! [`open`]: a checkpoint opened to resume from without reading it into memory. Every file is
//! memory-mapped and checked against the manifest (size, CRC32C) once; each unit's values and
//! optimizer buffers become [`UnitInit::Slice`]s over the mapped tensors, so a shard server
//! converts only its own range (`JobBuilder::resume_from`): a process holds its servers' shards,
//! not the whole state (12 bytes a parameter with AdamW, 84 GB for 7B). [`load`](super::load) is
//! the same reading, whole. [`open_newest`] is [`newest`](super::newest) that opens as it
//! verifies, so a restarted run reads the checkpoint's bytes once to check them.
//!
//! Both layouts are read the same way: a unit's values are *pieces* — the model's tensors of the
//! unit, in order, in `model.safetensors` (and `<tensor>.<buffer>` in `optimizer.safetensors`);
//! or the `unit<u>.<start>-<end>.<kind>` ranges of the shard files (see
//! [`sharded`](super::sharded)) — which must tile the unit.
//!
//! Guarantees (tested in this file, `files.rs`, `tests/runtime/sharded_checkpoint.rs`):
//! - **nothing unverified is read**: a file whose size or CRC32C differs from the manifest, a
//!   tensor that is missing, not F32 or of another shape, a stray tensor, pieces that do not tile
//!   a unit: an error naming the file, at [`open`], before any value is handed out;
//! - **a server reads its range only**: a read touches the pieces that overlap it (counted:
//!   [`Opened::bytes_read`]);
//! - **what is read equals what was saved**, bit for bit ([`Opened::read_all`] is `load`).
//!
//! A mapped file must not be rewritten while it is mapped (as for every mmap-based safetensors
//! loader); odc never writes into a published `step-<N>`.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::shard_file::{tensor_name, PARAMS};
use memmap2::Mmap;
use odc_policy::layout::{OptimizerInit, UnitInit, UnitOptimizerInit};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

use super::error::{invalid, io, CheckpointError};
use super::layout::{read_checked, StateFile, FORMAT, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE};
use super::manifest::{self, FileEntry, Manifest};
use super::{TensorMap, TrainState};

/// A checkpoint opened to resume from ([`open`]): its step, the caller's JSON, and every unit's
/// values and optimizer state as sources a shard server reads its range from.
#[derive(Clone)]
pub struct Opened {
    step: u64,
    extra: serde_json::Value,
    params: Vec<UnitInit>,
    optimizer: Vec<OptimizerInit>,
    lens: Vec<usize>,
    read: Arc<AtomicU64>,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("step", &self.step)
            .field("units", &self.lens.len())
            .finish_non_exhaustive()
    }
}

impl Opened {
    /// Global steps the checkpoint's state had taken: the resumed job's next step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The caller's JSON (`state.json`'s `extra`).
    pub fn extra(&self) -> &serde_json::Value {
        &self.extra
    }

    /// Per unit, where its values come from (read range by range).
    pub fn params(&self) -> &[UnitInit] {
        &self.params
    }

    /// Per unit, its optimizer's step count and buffers (read range by range).
    pub fn optimizer(&self) -> &[OptimizerInit] {
        &self.optimizer
    }

    /// Elements of unit `unit` (0 past the last unit).
    pub fn unit_len(&self, unit: usize) -> usize {
        self.lens.get(unit).copied().unwrap_or(0)
    }

    /// Bytes of tensor data read from the mapped files so far, by every reader of this
    /// checkpoint (the shard servers of this process, [`Self::read_all`]).
    pub fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    /// The whole state in memory ([`load`](super::load)).
    pub fn read_all(&self) -> Result<TrainState, CheckpointError> {
        let whole = |init: &UnitInit, len: usize, what: &str| {
            init.slice(0..len)
                .map_err(|e| CheckpointError::Map(format!("{what}: {e}")))
        };
        let params = self
            .params
            .iter()
            .zip(&self.lens)
            .enumerate()
            .map(|(u, (init, &len))| whole(init, len, &format!("unit {u}")))
            .collect::<Result<Vec<_>, _>>()?;
        let optimizer = self
            .optimizer
            .iter()
            .zip(&self.lens)
            .enumerate()
            .map(|(u, (init, &len))| {
                let buffers = init
                    .buffers
                    .iter()
                    .map(|(name, values)| {
                        let what = format!("unit {u}'s {name}");
                        Ok((name.clone(), Arc::from(whole(values, len, &what)?)))
                    })
                    .collect::<Result<Vec<_>, CheckpointError>>()?;
                Ok(UnitOptimizerInit {
                    steps: init.steps,
                    buffers,
                })
            })
            .collect::<Result<Vec<_>, CheckpointError>>()?;
        Ok(TrainState {
            step: self.step,
            params,
            optimizer,
        })
    }
}

impl From<TrainState> for Opened {
    /// A state already in memory, as sources of explicit values.
    fn from(state: TrainState) -> Self {
        Opened {
            step: state.step,
            extra: serde_json::Value::Null,
            lens: state.params.iter().map(Vec::len).collect(),
            params: state
                .params
                .into_iter()
                .map(|v| UnitInit::Values(v.into()))
                .collect(),
            optimizer: state.optimizer.into_iter().map(Into::into).collect(),
            read: Arc::default(),
        }
    }
}

/// A mapped, verified file and its tensors' byte ranges.
struct MappedFile {
    path: PathBuf,
    map: Arc<Mmap>,
    /// Tensor name → (shape, byte range in `map`), F32 only.
    tensors: std::collections::HashMap<String, (Vec<usize>, Range<usize>)>,
    used: std::collections::HashSet<String>,
}

impl MappedFile {
    /// Maps `name` of `step_dir` and checks it against the manifest before reading its header.
    fn open(step_dir: &Path, manifest: &Manifest, name: &str) -> Result<Self, CheckpointError> {
        Self::open_as(step_dir, manifest.entry(step_dir, name)?)
    }

    /// Maps `entry`'s file of `step_dir` and checks it against `entry` before reading its header.
    fn open_as(step_dir: &Path, entry: &FileEntry) -> Result<Self, CheckpointError> {
        let path = step_dir.join(&entry.name);
        let file = std::fs::File::open(&path).map_err(io(&path))?;
        // SAFETY: read-only; odc never writes into a published checkpoint (module docs).
        let map = unsafe { Mmap::map(&file) }.map_err(io(&path))?;
        entry.check(&path, &map)?;
        let (header, metadata) = SafeTensors::read_metadata(&map).map_err(|e| {
            invalid(
                &path,
                format!(
                    "not a complete safetensors file ({} bytes; truncated or corrupted?): {e}",
                    map.len()
                ),
            )
        })?;
        let data = 8 + header;
        let mut tensors = std::collections::HashMap::new();
        for (tensor, info) in metadata.tensors() {
            if info.dtype != Dtype::F32 {
                return Err(invalid(
                    &path,
                    format!("tensor {tensor} is {:?}, expected F32", info.dtype),
                ));
            }
            let (start, end) = info.data_offsets;
            tensors.insert(tensor, (info.shape.clone(), data + start..data + end));
        }
        Ok(MappedFile {
            path,
            map: Arc::new(map),
            tensors,
            used: Default::default(),
        })
    }

    /// Tensor `name` of `shape` as a piece at element `start` of its unit.
    fn piece(
        &mut self,
        name: &str,
        shape: &[usize],
        start: usize,
    ) -> Result<Piece, CheckpointError> {
        let (found, bytes) = self
            .tensors
            .get(name)
            .ok_or_else(|| invalid(&self.path, format!("tensor {name} is missing")))?;
        if found.as_slice() != shape {
            return Err(invalid(
                &self.path,
                format!("tensor {name} has shape {found:?}, the model's is {shape:?}"),
            ));
        }
        self.used.insert(name.to_string());
        Ok(Piece {
            start,
            end: start + bytes.len() / 4,
            bytes: bytes.clone(),
            map: Ok(Arc::clone(&self.map)),
        })
    }

    /// Every tensor was used: a stray one means another model's file.
    fn all_used(&self) -> Result<(), CheckpointError> {
        let mut stray: Vec<&String> = self
            .tensors
            .keys()
            .filter(|n| !self.used.contains(*n))
            .collect();
        stray.sort();
        match stray.first() {
            None => Ok(()),
            Some(first) => Err(invalid(
                &self.path,
                format!(
                    "holds {} tensor(s) the model does not have, first {first}",
                    stray.len()
                ),
            )),
        }
    }
}

/// Elements `start..end` of a unit, at `bytes` of a mapped file, or in a file this host's step
/// directory does not hold (`Err`: its name).
#[derive(Clone)]
struct Piece {
    start: usize,
    end: usize,
    bytes: Range<usize>,
    map: Result<Arc<Mmap>, Arc<str>>,
}

/// A unit's values (or one optimizer buffer's) as pieces that tile `0..len`.
struct Source {
    len: usize,
    pieces: Vec<Piece>,
    read: Arc<AtomicU64>,
}

impl Source {
    /// Sorts `pieces` and checks that they tile `0..len` (else an error naming `at`).
    fn new(
        mut pieces: Vec<Piece>,
        len: usize,
        at: &Path,
        what: &str,
        read: &Arc<AtomicU64>,
    ) -> Result<Self, CheckpointError> {
        pieces.sort_by_key(|p| p.start);
        let mut next = 0;
        for p in &pieces {
            if p.start != next {
                return Err(invalid(
                    at,
                    format!("{what}: a piece at {} where {next} was expected", p.start),
                ));
            }
            next = p.end;
        }
        if next != len {
            return Err(invalid(
                at,
                format!("{what}: the pieces hold {next} of its {len} elements"),
            ));
        }
        Ok(Source {
            len,
            pieces,
            read: Arc::clone(read),
        })
    }

    /// Elements `range`, from the pieces that overlap it only.
    fn read(&self, range: Range<usize>) -> Result<Vec<f32>, String> {
        if range.start > range.end || range.end > self.len {
            return Err(format!("outside the unit's {} elements", self.len));
        }
        let mut out = Vec::with_capacity(range.len());
        let first = self.pieces.partition_point(|p| p.end <= range.start);
        for p in self.pieces[first..]
            .iter()
            .take_while(|p| p.start < range.end)
        {
            let (a, b) = (range.start.max(p.start), range.end.min(p.end));
            let map = p.map.as_ref().map_err(|file| {
                format!(
                    "elements {a}..{b} are in {file}, which a server on another host wrote into \
                     its own checkpoint directory: resume with the servers on the hosts that \
                     wrote them, or copy every host's shard files into one step directory"
                )
            })?;
            let at = p.bytes.start + (a - p.start) * 4;
            let bytes = &map[at..at + (b - a) * 4];
            out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])),
            );
            self.read.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        Ok(out)
    }

    fn into_init(self) -> UnitInit {
        let source = Arc::new(self);
        UnitInit::Slice(Arc::new(move |range| source.read(range)))
    }
}

/// Opens the checkpoint in `step_dir` (either layout) for a model whose tensors are `tensors`:
/// every file checked against the manifest, every tensor against the model, nothing read into
/// memory (see the [module docs](self)). An error names the file and what is wrong.
pub fn open(step_dir: &Path, tensors: &TensorMap) -> Result<Opened, CheckpointError> {
    let manifest = manifest::read(step_dir)?;
    let json_path = step_dir.join(STATE_FILE);
    let json = read_checked(step_dir, &manifest, STATE_FILE)?;
    let state: StateFile = serde_json::from_slice(&json)
        .map_err(|e| invalid(&json_path, format!("not a checkpoint state: {e}")))?;
    check_state(&json_path, &state, tensors)?;
    let units = tensors.units().len();
    let lens: Vec<usize> = (0..units).map(|u| tensors.unit_len(u)).collect();
    // Per unit: its params' pieces, and per buffer (state.json's order) its pieces.
    let mut params: Vec<Vec<Piece>> = vec![Vec::new(); units];
    let mut buffers: Vec<Vec<Vec<Piece>>> = state
        .optimizer_buffers
        .iter()
        .map(|names| vec![Vec::new(); names.len()])
        .collect();
    if state.shards.is_empty() {
        let mut model = MappedFile::open(step_dir, &manifest, MODEL_FILE)?;
        let mut opt = MappedFile::open(step_dir, &manifest, OPTIMIZER_FILE)?;
        for (u, named) in tensors.units().iter().enumerate() {
            let mut at = 0;
            for t in named {
                params[u].push(model.piece(&t.name, &t.shape, at)?);
                for (b, buffer) in state.optimizer_buffers[u].iter().enumerate() {
                    let name = format!("{}.{buffer}", t.name);
                    buffers[u][b].push(opt.piece(&name, &t.shape, at)?);
                }
                at += t.numel();
            }
        }
        model.all_used()?;
        opt.all_used()?;
    } else {
        // The pieces tile every unit and agree on the optimizer's steps and buffers, which must
        // be those state.json names.
        let (steps, names) = super::sharded::plan(step_dir, tensors, &state.shards)?;
        if steps != state.optimizer_steps || names != state.optimizer_buffers {
            return Err(invalid(
                &json_path,
                "the optimizer state it names is not the shard files'",
            ));
        }
        for f in &state.shards {
            // A shard file this host's manifest does not name was written on another host (per-
            // host directories): checked against its server's report in state.json where it was
            // copied here, else its pieces are read nowhere on this host.
            let named = manifest.files.iter().find(|e| e.name == f.file).cloned();
            let here = std::fs::symlink_metadata(step_dir.join(&f.file)).is_ok();
            if named.is_none() && !here {
                let file: Arc<str> = Arc::from(f.file.as_str());
                for p in &f.pieces {
                    let (u, start, end) = (p.unit as usize, p.start as usize, p.end as usize);
                    let remote = Piece {
                        start,
                        end,
                        bytes: 0..0,
                        map: Err(Arc::clone(&file)),
                    };
                    params[u].push(remote.clone());
                    for b in 0..p.buffers.len() {
                        buffers[u][b].push(remote.clone());
                    }
                }
                continue;
            }
            let entry = named.unwrap_or_else(|| FileEntry {
                name: f.file.clone(),
                bytes: f.bytes,
                crc32c: f.crc32c,
            });
            let mut file = MappedFile::open_as(step_dir, &entry)?;
            for p in &f.pieces {
                let (u, start) = (p.unit as usize, p.start as usize);
                let shape = [(p.end - p.start) as usize];
                let name = tensor_name(p.unit, p.start, p.end, PARAMS);
                params[u].push(file.piece(&name, &shape, start)?);
                for (b, buffer) in p.buffers.iter().enumerate() {
                    let name = tensor_name(p.unit, p.start, p.end, buffer);
                    buffers[u][b].push(file.piece(&name, &shape, start)?);
                }
            }
            file.all_used()?;
        }
    }
    let read = Arc::new(AtomicU64::new(0));
    let params = params
        .into_iter()
        .enumerate()
        .map(|(u, pieces)| {
            let source = Source::new(pieces, lens[u], step_dir, &format!("unit {u}"), &read)?;
            Ok(source.into_init())
        })
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    let optimizer = buffers
        .into_iter()
        .enumerate()
        .map(|(u, per_buffer)| {
            let buffers = per_buffer
                .into_iter()
                .zip(&state.optimizer_buffers[u])
                .map(|(pieces, name)| {
                    let what = format!("unit {u}'s {name}");
                    let source = Source::new(pieces, lens[u], step_dir, &what, &read)?;
                    Ok((name.clone(), source.into_init()))
                })
                .collect::<Result<Vec<_>, CheckpointError>>()?;
            Ok(OptimizerInit {
                steps: state.optimizer_steps[u],
                buffers,
            })
        })
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    Ok(Opened {
        step: state.step,
        extra: state.extra,
        params,
        optimizer,
        lens,
        read,
    })
}

/// `state.json` is of this format and this model.
fn check_state(
    json_path: &Path,
    state: &StateFile,
    tensors: &TensorMap,
) -> Result<(), CheckpointError> {
    if state.format != FORMAT {
        return Err(invalid(
            json_path,
            format!("format {} (this build reads {FORMAT})", state.format),
        ));
    }
    let names: Vec<Vec<String>> = tensors
        .units()
        .iter()
        .map(|u| u.iter().map(|t| t.name.clone()).collect())
        .collect();
    if state.units != names {
        return Err(invalid(
            json_path,
            "the checkpoint's units and tensor names are not this model's",
        ));
    }
    if state.optimizer_steps.len() != names.len() || state.optimizer_buffers.len() != names.len() {
        return Err(invalid(
            json_path,
            format!(
                "optimizer state for {} units, the model has {}",
                state.optimizer_steps.len(),
                names.len()
            ),
        ));
    }
    Ok(())
}

/// The newest checkpoint of `dir` that opens ([`open`]), walking back as
/// [`newest`](super::newest) does (each newer one that does not open is passed over with a
/// warning naming why): its directory and the opened checkpoint, read once to verify it.
/// `Ok(None)` when `dir` holds no `step-<N>`; an error when some exist and none opens.
pub fn open_newest(
    dir: &Path,
    tensors: &TensorMap,
) -> Result<Option<(PathBuf, Opened)>, CheckpointError> {
    super::newest::newest_by(dir, |step_dir| open(step_dir, tensors))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{save, NamedTensor};

    fn model() -> (TensorMap, TrainState) {
        let tensors = TensorMap::new(vec![
            vec![NamedTensor::new("a", &[2, 3]), NamedTensor::new("b", &[4])],
            vec![NamedTensor::new("c", &[5])],
        ])
        .unwrap();
        let values = |n: usize, k: f32| (0..n).map(|i| i as f32 * k + 0.25).collect::<Vec<_>>();
        let state = TrainState {
            step: 7,
            params: vec![values(10, 1.5), values(5, -2.0)],
            optimizer: vec![
                UnitOptimizerInit {
                    steps: 7,
                    buffers: vec![
                        ("exp_avg".into(), values(10, 0.5).into()),
                        ("exp_avg_sq".into(), values(10, 0.125).into()),
                    ],
                },
                UnitOptimizerInit::default(),
            ],
        };
        (tensors, state)
    }

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("odc-open-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// A range read touches only the pieces that overlap it, across tensor boundaries, and
    /// equals the saved values bit for bit.
    #[test]
    fn a_range_reads_only_its_pieces_and_equals_the_saved_values() {
        let (tensors, state) = model();
        let dir = temp("range");
        let step = save(&dir, &tensors, &state, &serde_json::json!({"k": 1})).unwrap();
        let opened = open(&step, &tensors).unwrap();
        assert_eq!(opened.step(), 7);
        assert_eq!(opened.extra(), &serde_json::json!({"k": 1}));
        assert_eq!(opened.bytes_read(), 0, "opening reads no values");
        // Elements 4..8 of unit 0 straddle tensor a (0..6) and b (6..10).
        let got = opened.params()[0].slice(4..8).unwrap();
        assert_eq!(got, state.params[0][4..8]);
        assert_eq!(opened.bytes_read(), 16);
        let sq = &opened.optimizer()[0].buffers[1];
        assert_eq!(sq.0, "exp_avg_sq");
        assert_eq!(
            sq.1.slice(9..10).unwrap(),
            state.optimizer[0].buffers[1].1[9..]
        );
        assert_eq!(opened.read_all().unwrap(), state);
        let err = opened.params()[1].slice(3..6).unwrap_err().to_string();
        assert!(err.contains("outside"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `open_newest` passes over a damaged newer checkpoint and opens the older one.
    #[test]
    fn open_newest_passes_over_a_damaged_checkpoint() {
        let (tensors, mut state) = model();
        let dir = temp("newest");
        save(&dir, &tensors, &state, &serde_json::Value::Null).unwrap();
        state.step = 9;
        let newer = save(&dir, &tensors, &state, &serde_json::Value::Null).unwrap();
        let model = newer.join(MODEL_FILE);
        let mut bytes = std::fs::read(&model).unwrap();
        let at = bytes.len() - 3;
        bytes[at] ^= 0x10;
        std::fs::write(&model, bytes).unwrap();
        let (path, opened) = open_newest(&dir, &tensors).unwrap().unwrap();
        assert_eq!((path, opened.step()), (super::super::step_dir(&dir, 7), 7));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(open_newest(&dir, &tensors).unwrap().is_none());
    }
}
