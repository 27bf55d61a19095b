//! A Hugging Face model directory opened for training ([`HfCheckpoint`]): `config.json`, then
//! `model.safetensors` or, without it, `model.safetensors.index.json` and its shards (the order
//! `transformers` looks for them in).
//!
//! Every safetensors file is memory-mapped and only its header parsed at [`HfCheckpoint::open`],
//! which checks every tensor against the model the config describes (guarantee 2 of [`super`]):
//! the files are not read into memory then, and a unit's values are converted to f32 when asked
//! for — eagerly ([`HfCheckpoint::unit_values`]) or by range ([`HfCheckpoint::unit_specs`]: the
//! shard server that owns a range of a unit converts that range only).
//!
//! Accepted beyond the model's tensors: rotary `inv_freq` buffers (names ending in
//! `rotary_emb.inv_freq`, which older `transformers` saved; ignored), and in a tied checkpoint an
//! `lm_head.weight` equal bit for bit (after conversion) to `model.embed_tokens.weight`.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use odc_policy::layout::{UnitInit, UnitSpec};
use safetensors::tensor::TensorInfo;
use safetensors::SafeTensors;
use serde_json::Value;

use super::super::config::ModelConfig;
use super::super::error::{Error, Result};
use super::super::transformer::{unit_count, unit_params};
use super::config::{read_config, HfConfig};
use super::dtype::DiskDtype;
use super::{INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES};

/// An open Hugging Face model directory whose tensors have been checked against its config.
///
/// ```no_run
/// # fn main() -> odc_model::Result<()> {
/// use odc_model::hf::HfCheckpoint;
/// let checkpoint = HfCheckpoint::open("models/Qwen2.5-0.5B")?;
/// let config = checkpoint.config().clone();
/// // One UnitSpec per unit; each shard server converts only its own range from the files.
/// let units = checkpoint.unit_specs();
/// assert_eq!(units.len(), odc_model::unit_count(&config));
/// # Ok(()) }
/// ```
pub struct HfCheckpoint {
    dir: PathBuf,
    config: HfConfig,
    files: Vec<PathBuf>,
    units: Vec<Arc<UnitSource>>,
    tokenizer_files: Vec<&'static str>,
}

impl std::fmt::Debug for HfCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfCheckpoint")
            .field("dir", &self.dir)
            .field("family", &self.config.family)
            .field("files", &self.files)
            .field("units", &self.units.len())
            .finish()
    }
}

/// A memory-mapped safetensors file.
struct Mapped {
    path: PathBuf,
    map: Mmap,
    /// Where the tensor data starts: after the 8-byte header length and the header.
    data_start: usize,
}

/// One tensor of a unit: where its bytes lie in which file.
struct TensorSlice {
    file: Arc<Mapped>,
    name: String,
    dtype: DiskDtype,
    /// Byte range in the file's map (checked against the map at open).
    bytes: Range<usize>,
    numel: usize,
}

impl TensorSlice {
    /// Converts elements `elements` (within the tensor) and appends them to `out`.
    fn decode_into(&self, elements: Range<usize>, out: &mut Vec<f32>) -> Result<()> {
        let size = self.dtype.size();
        let (start, end) = (
            self.bytes.start + elements.start * size,
            self.bytes.start + elements.end * size,
        );
        let bytes = self
            .file
            .map
            .get(start..end)
            .filter(|_| end <= self.bytes.end)
            .ok_or_else(|| Error::Checkpoint {
                path: self.file.path.clone(),
                tensor: Some(self.name.clone()),
                reason: format!(
                    "elements {elements:?} lie outside the tensor's bytes {:?} in a map of {} \
                     bytes",
                    self.bytes,
                    self.file.map.len()
                ),
            })?;
        self.dtype.decode_into(bytes, out);
        Ok(())
    }
}

/// A unit's tensors in its flat order ([`unit_params`]).
struct UnitSource {
    pieces: Vec<TensorSlice>,
    len: usize,
}

impl UnitSource {
    /// The f32 values of elements `range` of the unit.
    fn read(&self, range: Range<usize>) -> Result<Vec<f32>> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::UnitParams {
                what: "elements (range end)",
                expected: self.len,
                got: range.end,
            });
        }
        let mut out = Vec::with_capacity(range.len());
        let mut at = 0;
        for piece in &self.pieces {
            let (lo, hi) = (range.start.max(at), range.end.min(at + piece.numel));
            if lo < hi {
                piece.decode_into(lo - at..hi - at, &mut out)?;
            }
            at += piece.numel;
        }
        Ok(out)
    }
}

/// Where each tensor of the directory is, by name, and which file a missing tensor is reported
/// against (the single file, or the index).
struct TensorTable {
    tensors: HashMap<String, (Arc<Mapped>, TensorInfo)>,
    listing: PathBuf,
}

impl HfCheckpoint {
    /// Opens `dir`: reads `config.json` ([`read_config`]), maps the safetensors files and checks
    /// every tensor (see the [module docs](self)). The first defect found is the error, naming
    /// the file, the tensor and what was expected.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let config = read_config(&dir)?;
        let table = if dir.join(SINGLE_FILE).is_file() {
            single_file(&dir.join(SINGLE_FILE))?
        } else if dir.join(INDEX_FILE).is_file() {
            sharded(&dir, &dir.join(INDEX_FILE))?
        } else {
            return Err(Error::Checkpoint {
                path: dir,
                tensor: None,
                reason: format!("holds neither {SINGLE_FILE} nor {INDEX_FILE}"),
            });
        };
        let mut files: Vec<PathBuf> = table
            .tensors
            .values()
            .map(|(file, _)| file.path.clone())
            .collect();
        files.sort();
        files.dedup();
        let units = units_of(&config.model, table)?;
        let tokenizer_files = TOKENIZER_FILES
            .into_iter()
            .filter(|f| dir.join(f).is_file())
            .collect();
        Ok(HfCheckpoint {
            dir,
            config,
            files,
            units: units.into_iter().map(Arc::new).collect(),
            tokenizer_files,
        })
    }

    /// The model.
    pub fn config(&self) -> &ModelConfig {
        &self.config.model
    }

    /// The `config.json` as read (its family and JSON, the base of an export's).
    pub fn hf_config(&self) -> &HfConfig {
        &self.config
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The safetensors files, sorted.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The tokenizer and generation files present in the directory, of [`TOKENIZER_FILES`].
    pub fn tokenizer_files(&self) -> &[&'static str] {
        &self.tokenizer_files
    }

    /// Unit `unit`'s flat buffer (its [`unit_params`] concatenated), converted to f32.
    pub fn unit_values(&self, unit: usize) -> Result<Vec<f32>> {
        let source = self.source(unit)?;
        source.read(0..source.len)
    }

    /// Elements `range` of unit `unit`'s flat buffer, converted to f32: what
    /// [`Self::unit_specs`]' initialiser reads.
    pub fn unit_range(&self, unit: usize, range: Range<usize>) -> Result<Vec<f32>> {
        self.source(unit)?.read(range)
    }

    /// Every unit's flat buffer ([`Self::unit_values`] of each).
    pub fn all_unit_values(&self) -> Result<Vec<Vec<f32>>> {
        (0..self.units.len()).map(|u| self.unit_values(u)).collect()
    }

    /// The model's units for a job, named as [`layout_units`](crate::layout_units) names
    /// them, each initialised by a [`UnitInit::Slice`] that converts the range a shard server
    /// asks for from the memory-mapped files (which it keeps mapped).
    pub fn unit_specs(&self) -> Vec<UnitSpec> {
        self.units
            .iter()
            .enumerate()
            .map(|(u, source)| {
                let reader = Arc::clone(source);
                // Every tensor's bytes were checked against its map at open (a map's length does
                // not change): only a range outside the unit fails.
                let init = UnitInit::Slice(Arc::new(move |range| {
                    reader.read(range).map_err(|e| e.to_string())
                }));
                UnitSpec::from_init(crate::unit_name(&self.config.model, u), source.len, init)
            })
            .collect()
    }

    fn source(&self, unit: usize) -> Result<&UnitSource> {
        self.units
            .get(unit)
            .map(|s| s.as_ref())
            .ok_or(Error::NoSuchUnit {
                unit,
                units: self.units.len(),
            })
    }
}

/// A file's tensors as its header lists them.
type TensorList = Vec<(String, TensorInfo)>;

/// Maps `path` and reads its header: the tensors it holds, sorted by name.
fn map_file(path: &Path) -> Result<(Arc<Mapped>, TensorList)> {
    let err = |reason: String| Error::Checkpoint {
        path: path.to_path_buf(),
        tensor: None,
        reason,
    };
    let file = std::fs::File::open(path).map_err(|e| err(format!("cannot open: {e}")))?;
    // SAFETY: the map is read-only and odc never writes to a file it maps. Another process
    // truncating or rewriting the file while it is mapped is outside what a memory map can
    // guard against (as for every mmap-based safetensors loader: `safetensors`' own, candle's).
    let map = unsafe { Mmap::map(&file) }.map_err(|e| err(format!("cannot map: {e}")))?;
    let (header, metadata) = SafeTensors::read_metadata(&map).map_err(|e| {
        err(format!(
            "not a complete safetensors file ({} bytes; truncated or corrupted?): {e}",
            map.len()
        ))
    })?;
    let mut tensors: TensorList = metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, info.clone()))
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mapped = Arc::new(Mapped {
        path: path.to_path_buf(),
        map,
        data_start: header + 8,
    });
    Ok((mapped, tensors))
}

fn single_file(path: &Path) -> Result<TensorTable> {
    let (file, tensors) = map_file(path)?;
    Ok(TensorTable {
        tensors: tensors
            .into_iter()
            .map(|(name, info)| (name, (Arc::clone(&file), info)))
            .collect(),
        listing: path.to_path_buf(),
    })
}

/// A sharded checkpoint: the index's `weight_map` read, every shard it names mapped, and each
/// tensor found in exactly the shard the index names.
fn sharded(dir: &Path, index: &Path) -> Result<TensorTable> {
    let err = |tensor: Option<&str>, reason: String| Error::Checkpoint {
        path: index.to_path_buf(),
        tensor: tensor.map(str::to_string),
        reason,
    };
    let text =
        std::fs::read_to_string(index).map_err(|e| err(None, format!("cannot read: {e}")))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| err(None, format!("not valid JSON: {e}")))?;
    let Some(map) = json.get("weight_map").and_then(Value::as_object) else {
        return Err(err(
            None,
            "has no `weight_map` object (expected {\"metadata\": {...}, \"weight_map\": \
             {tensor: file}})"
                .into(),
        ));
    };
    // Tensor -> shard file name, and the shards in name order.
    let mut weight_map: BTreeMap<&str, &str> = BTreeMap::new();
    for (tensor, file) in map {
        let Some(file) = file.as_str() else {
            return Err(err(
                Some(tensor),
                format!("`weight_map` value is {file}, expected a file name"),
            ));
        };
        if file.is_empty() || file.contains(['/', '\\']) || file == ".." || file == "." {
            return Err(err(
                Some(tensor),
                format!("`weight_map` names {file:?}, expected a file in the model directory"),
            ));
        }
        weight_map.insert(tensor, file);
    }
    let mut shards: BTreeMap<&str, &str> = BTreeMap::new();
    for (tensor, file) in &weight_map {
        shards.entry(file).or_insert(tensor);
    }

    let mut tensors = HashMap::new();
    for (shard, first_tensor) in shards {
        let path = dir.join(shard);
        if !path.is_file() {
            return Err(err(
                Some(first_tensor),
                format!("maps this tensor to shard {shard:?}, which is not in the directory"),
            ));
        }
        let (file, held) = map_file(&path)?;
        let held: HashMap<String, TensorInfo> = held.into_iter().collect();
        for (tensor, _) in weight_map.iter().filter(|(_, f)| **f == shard) {
            if !held.contains_key(*tensor) {
                return Err(Error::Checkpoint {
                    path: path.clone(),
                    tensor: Some(tensor.to_string()),
                    reason: format!(
                        "is missing: {INDEX_FILE} maps it to this shard, which does not hold it"
                    ),
                });
            }
        }
        let mut held: TensorList = held.into_iter().collect();
        held.sort_by(|a, b| a.0.cmp(&b.0));
        for (tensor, info) in held {
            match weight_map.get(tensor.as_str()) {
                Some(f) if *f == shard => {
                    tensors.insert(tensor, (Arc::clone(&file), info));
                }
                _ if is_rotary_buffer(&tensor) => {}
                Some(f) => {
                    return Err(Error::Checkpoint {
                        path: path.clone(),
                        tensor: Some(tensor),
                        reason: format!(
                            "is also stored here, but {INDEX_FILE} maps it to shard {f:?}: \
                             expected each tensor once"
                        ),
                    })
                }
                None => {
                    return Err(Error::Checkpoint {
                        path: path.clone(),
                        tensor: Some(tensor),
                        reason: format!("is not in {INDEX_FILE}'s `weight_map`"),
                    })
                }
            }
        }
    }
    Ok(TensorTable {
        tensors,
        listing: index.to_path_buf(),
    })
}

/// A rotary `inv_freq` buffer (`model.layers.N.self_attn.rotary_emb.inv_freq`), not a parameter.
fn is_rotary_buffer(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
}

/// Checks the table against the model's parameters and returns each unit's pieces.
fn units_of(config: &ModelConfig, mut table: TensorTable) -> Result<Vec<UnitSource>> {
    let mut units = Vec::with_capacity(unit_count(config));
    for u in 0..unit_count(config) {
        let mut pieces = Vec::new();
        for spec in unit_params(config, u)? {
            let Some((file, info)) = table.tensors.remove(&spec.name) else {
                return Err(Error::Checkpoint {
                    path: table.listing.clone(),
                    tensor: Some(spec.name),
                    reason: format!(
                        "is missing: expected a tensor of shape {:?} (F32, BF16 or F16)",
                        spec.shape
                    ),
                });
            };
            pieces.push(piece(file, spec.name, &info, &spec.shape)?);
        }
        let len = pieces.iter().map(|p| p.numel).sum();
        units.push(UnitSource { pieces, len });
    }

    let mut rest: Vec<_> = table.tensors.into_iter().collect();
    rest.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, (file, info)) in rest {
        if is_rotary_buffer(&name) {
            continue;
        }
        if name == "lm_head.weight" && config.tie_embeddings {
            let embedding = units
                .first()
                .and_then(|u| u.pieces.first())
                .ok_or(Error::NoSuchUnit { unit: 0, units: 0 })?;
            let head = piece(file, name, &info, &[config.vocab_size, config.d_model])?;
            check_tied(&head, embedding)?;
            continue;
        }
        return Err(Error::Checkpoint {
            path: file.path.clone(),
            tensor: Some(name),
            reason: format!(
                "is not a parameter of this model (expected only the tensors of a {} model \
                 with {} layers{})",
                if config.qk_norm {
                    "qwen3"
                } else if config.qkv_bias {
                    "qwen2"
                } else {
                    "llama"
                },
                config.n_layers,
                if config.tie_embeddings {
                    ", embeddings tied"
                } else {
                    ""
                }
            ),
        });
    }
    Ok(units)
}

/// One tensor's piece, its dtype and shape checked.
fn piece(
    file: Arc<Mapped>,
    name: String,
    info: &TensorInfo,
    shape: &[usize],
) -> Result<TensorSlice> {
    let err = |reason: String| Error::Checkpoint {
        path: file.path.clone(),
        tensor: Some(name.clone()),
        reason,
    };
    let Some(dtype) = DiskDtype::from_safetensors(info.dtype) else {
        return Err(err(format!(
            "has dtype {:?}, expected F32, BF16 or F16",
            info.dtype
        )));
    };
    if info.shape != shape {
        return Err(err(format!(
            "has shape {:?}, expected {shape:?}",
            info.shape
        )));
    }
    let numel: usize = shape.iter().product();
    let start = file.data_start;
    let bytes = start + info.data_offsets.0..start + info.data_offsets.1;
    if bytes.len() != numel * dtype.size() || bytes.end > file.map.len() {
        return Err(err(format!(
            "has data at bytes {bytes:?} of a {}-byte file, expected {} bytes inside it",
            file.map.len(),
            numel * dtype.size()
        )));
    }
    Ok(TensorSlice {
        file,
        name,
        dtype,
        bytes,
        numel,
    })
}

/// A tied checkpoint's `lm_head.weight` must be the embedding, bit for bit after conversion.
fn check_tied(head: &TensorSlice, embedding: &TensorSlice) -> Result<()> {
    const CHUNK: usize = 1 << 20;
    let (mut a, mut b) = (Vec::with_capacity(CHUNK), Vec::with_capacity(CHUNK));
    let mut at = 0;
    while at < head.numel {
        let end = (at + CHUNK).min(head.numel);
        a.clear();
        b.clear();
        head.decode_into(at..end, &mut a)?;
        embedding.decode_into(at..end, &mut b)?;
        if let Some(i) = a
            .iter()
            .zip(&b)
            .position(|(x, y)| x.to_bits() != y.to_bits())
        {
            return Err(Error::Checkpoint {
                path: head.file.path.clone(),
                tensor: Some(head.name.clone()),
                reason: format!(
                    "differs from model.embed_tokens.weight (element {}: {} vs {}): the \
                     config ties the head to the embedding (tie_word_embeddings: true), but \
                     this head is not tied",
                    at + i,
                    a.get(i).copied().unwrap_or(f32::NAN),
                    b.get(i).copied().unwrap_or(f32::NAN)
                ),
            });
        }
        at = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::testing::{write_safetensors, TempDir, TestCheckpoint, TestTensor};
    use crate::unit_name;
    use odc_policy::layout::shard_range;

    fn written(model: &TestCheckpoint, shards: usize, name: &str) -> TempDir {
        let dir = TempDir::new(name);
        model.write(dir.path(), shards).unwrap();
        dir
    }

    fn bits(units: &[Vec<f32>]) -> Vec<Vec<u32>> {
        units
            .iter()
            .map(|u| u.iter().map(|x| x.to_bits()).collect())
            .collect()
    }

    /// `open`'s error, asserting that it names `file` (within `dir`) and `what` (a tensor, or
    /// `None` for a defect of the whole file), and did not panic.
    fn refused(dir: &TempDir, file: &str, tensor: Option<&str>) -> String {
        let e = HfCheckpoint::open(dir.path()).expect_err("a bad checkpoint is refused");
        let msg = e.to_string();
        assert!(
            msg.contains(&dir.path().join(file).display().to_string()),
            "names {file}: {msg}"
        );
        if let Some(tensor) = tensor {
            assert!(
                msg.contains(&format!("tensor `{tensor}`")),
                "names {tensor}: {msg}"
            );
        }
        msg
    }

    const Q_PROJ: &str = "model.layers.1.self_attn.q_proj.weight";

    #[test]
    fn exact_conversion_load_gives_the_written_values() {
        for (name, model, shards) in TestCheckpoint::presets() {
            let dir = written(&model, shards, name);
            let checkpoint = HfCheckpoint::open(dir.path()).unwrap();
            assert_eq!(checkpoint.config(), &model.config, "{name}");
            assert_eq!(checkpoint.hf_config().family, model.family, "{name}");
            let values = checkpoint.all_unit_values().unwrap();
            assert_eq!(bits(&values), bits(&model.units), "{name}");
            assert_eq!(checkpoint.files().len(), shards, "{name}");
            assert_eq!(checkpoint.dir(), dir.path());
            assert_eq!(
                checkpoint.tokenizer_files(),
                [
                    "tokenizer.json",
                    "tokenizer_config.json",
                    "generation_config.json"
                ]
            );
        }
    }

    #[test]
    fn exact_conversion_lazy_slices_equal_eager_values() {
        for (name, model, shards) in TestCheckpoint::presets() {
            let dir = written(&model, shards, name);
            let checkpoint = HfCheckpoint::open(dir.path()).unwrap();
            let specs = checkpoint.unit_specs();
            assert_eq!(specs.len(), unit_count(&model.config));
            for (u, spec) in specs.iter().enumerate() {
                let eager = checkpoint.unit_values(u).unwrap();
                assert_eq!(
                    (spec.name.clone(), spec.len),
                    (unit_name(&model.config, u), eager.len())
                );
                let len = eager.len();
                let mut ranges = vec![0..len, 0..1, len - 1..len, 3..len / 2, 5..5];
                ranges.extend((1..=5).flat_map(|s| (0..s).map(move |i| shard_range(len, s, i))));
                for r in ranges {
                    let lazy = spec.init.slice(r.clone()).unwrap();
                    assert_eq!(
                        bits(&[lazy]),
                        bits(&[eager[r.clone()].to_vec()]),
                        "{name} {u} {r:?}"
                    );
                }
            }
            let len = checkpoint.unit_values(0).unwrap().len();
            assert!(checkpoint.unit_range(0, 0..len + 1).is_err());
            assert!(matches!(
                checkpoint.unit_values(99),
                Err(Error::NoSuchUnit { unit: 99, .. })
            ));
        }
    }

    #[test]
    fn not_read_twice_values_come_from_the_map_not_a_copy() {
        use std::io::{Seek, SeekFrom, Write};
        let dir = written(&TestCheckpoint::llama_gqa(), 1, "mapped");
        let checkpoint = HfCheckpoint::open(dir.path()).unwrap();
        let specs = checkpoint.unit_specs();
        // Rewrite q_proj's first element in place after open: the values read afterwards, eager
        // and lazy, are the file's new ones, so open copied nothing.
        let path = dir.path().join(SINGLE_FILE);
        let bytes = std::fs::read(&path).unwrap();
        let (header, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let at = 8 + header + meta.info(Q_PROJ).unwrap().data_offsets.0;
        let mut file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.seek(SeekFrom::Start(at as u64)).unwrap();
        file.write_all(&7.0f32.to_le_bytes()).unwrap();
        file.sync_all().unwrap();
        // Unit 2 is block 1: its input norm (32 values), then q_proj.
        assert_eq!(checkpoint.unit_values(2).unwrap()[32], 7.0);
        assert_eq!(specs[2].init.slice(32..33).unwrap(), vec![7.0]);
    }

    #[test]
    fn checked_before_training_accepts_rotary_buffers_and_an_equal_tied_head() {
        let mut model = TestCheckpoint::qwen2_tied();
        let embedding = model.tensors[0].clone();
        model.tensors.push(TestTensor {
            name: "lm_head.weight".into(),
            ..embedding
        });
        model.tensors.push(TestTensor::new(
            "model.layers.0.self_attn.rotary_emb.inv_freq",
            crate::hf::DiskDtype::F32,
            &[3],
            &[1.0, 0.1, 0.01],
        ));
        let dir = written(&model, 2, "tied-equal");
        let checkpoint = HfCheckpoint::open(dir.path()).unwrap();
        assert_eq!(
            bits(&checkpoint.all_unit_values().unwrap()),
            bits(&model.units)
        );
    }

    #[test]
    fn checked_before_training_missing_tensor() {
        let mut model = TestCheckpoint::llama_gqa();
        model.remove(Q_PROJ).unwrap();
        let e = refused(&written(&model, 1, "missing"), SINGLE_FILE, Some(Q_PROJ));
        assert!(e.contains("missing") && e.contains("[32, 32]"), "{e}");
        // Sharded: reported against the index, which does not list it.
        let mut model = TestCheckpoint::qwen2_tied();
        model.remove("model.norm.weight").unwrap();
        refused(
            &written(&model, 3, "missing-sharded"),
            INDEX_FILE,
            Some("model.norm.weight"),
        );
    }

    #[test]
    fn checked_before_training_extra_tensor() {
        let mut model = TestCheckpoint::llama_gqa();
        let extra = "model.layers.0.mlp.extra_proj.weight";
        model.tensors.push(TestTensor::new(
            extra,
            crate::hf::DiskDtype::F32,
            &[2],
            &[1.0, 2.0],
        ));
        let e = refused(&written(&model, 1, "extra"), SINGLE_FILE, Some(extra));
        assert!(e.contains("not a parameter"), "{e}");
        // A third block's tensors in a two-block checkpoint.
        let mut model = TestCheckpoint::llama_gqa();
        let block = "model.layers.2.input_layernorm.weight";
        model.tensors.push(TestTensor::new(
            block,
            crate::hf::DiskDtype::F32,
            &[32],
            &[1.0; 32],
        ));
        refused(&written(&model, 1, "extra-block"), SINGLE_FILE, Some(block));
    }

    #[test]
    fn checked_before_training_wrong_shape() {
        let mut model = TestCheckpoint::qwen3_tied();
        let name = "model.layers.0.self_attn.k_proj.weight";
        let t = model.tensor_mut(name).unwrap();
        // [32, 32] (2 KV heads of 16 over width 32) stored as [16, 64]: same size, wrong shape.
        assert_eq!(t.shape, vec![32, 32]);
        t.shape = vec![16, 64];
        let e = refused(&written(&model, 1, "shape"), SINGLE_FILE, Some(name));
        assert!(
            e.contains("[16, 64]") && e.contains("expected [32, 32]"),
            "{e}"
        );
    }

    #[test]
    fn checked_before_training_wrong_dtype() {
        let mut model = TestCheckpoint::llama_gqa();
        let t = model.tensor_mut(Q_PROJ).unwrap();
        t.dtype = safetensors::Dtype::I32;
        let e = refused(&written(&model, 1, "dtype"), SINGLE_FILE, Some(Q_PROJ));
        assert!(e.contains("I32") && e.contains("F32, BF16 or F16"), "{e}");
        let mut model = TestCheckpoint::llama_gqa();
        let t = model.tensor_mut(Q_PROJ).unwrap();
        t.dtype = safetensors::Dtype::F64;
        t.bytes.extend(t.bytes.clone());
        refused(&written(&model, 1, "dtype-f64"), SINGLE_FILE, Some(Q_PROJ));
    }

    #[test]
    fn checked_before_training_truncated_file() {
        let model = TestCheckpoint::llama_gqa();
        for (case, keep) in [
            ("tail", 3usize),
            ("header", 20),
            ("empty", 0),
            ("length", 5),
        ] {
            let dir = written(&model, 1, "truncated");
            let path = dir.path().join(SINGLE_FILE);
            let bytes = std::fs::read(&path).unwrap();
            let kept = if case == "tail" {
                bytes.len() - keep
            } else {
                keep
            };
            std::fs::write(&path, &bytes[..kept]).unwrap();
            let e = refused(&dir, SINGLE_FILE, None);
            assert!(e.contains("not a complete safetensors file"), "{case}: {e}");
        }
        // A truncated shard of a sharded checkpoint names that shard.
        let dir = written(&TestCheckpoint::qwen2_tied(), 3, "truncated-shard");
        let shard = dir.path().join("model-00002-of-00003.safetensors");
        let bytes = std::fs::read(&shard).unwrap();
        std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
        refused(&dir, "model-00002-of-00003.safetensors", None);
    }

    #[test]
    fn checked_before_training_index_names_a_missing_shard() {
        let dir = written(&TestCheckpoint::qwen2_tied(), 3, "missing-shard");
        std::fs::remove_file(dir.path().join("model-00003-of-00003.safetensors")).unwrap();
        let e = refused(&dir, INDEX_FILE, None);
        assert!(e.contains("model-00003-of-00003.safetensors"), "{e}");
        // The tensor named is one the index maps to that shard (block 1's, the last third).
        assert!(e.contains("tensor `model.layers.1."), "{e}");
    }

    #[test]
    fn checked_before_training_index_names_a_tensor_its_shard_lacks() {
        let model = TestCheckpoint::qwen2_tied();
        let dir = written(&model, 3, "shard-lacks");
        // Rewrite shard 2 without one of its tensors; the index still maps it there.
        let per = model.tensors.len().div_ceil(3);
        let mut second: Vec<TestTensor> = model.tensors[per..2 * per].to_vec();
        let dropped = second.remove(1);
        let shard = "model-00002-of-00003.safetensors";
        write_safetensors(&dir.path().join(shard), &second).unwrap();
        let e = refused(&dir, shard, Some(&dropped.name));
        assert!(e.contains(INDEX_FILE), "{e}");
    }

    #[test]
    fn checked_before_training_tensor_stored_twice() {
        let model = TestCheckpoint::qwen2_tied();
        let dir = written(&model, 3, "twice");
        let per = model.tensors.len().div_ceil(3);
        let mut second: Vec<TestTensor> = model.tensors[per..2 * per].to_vec();
        let twice = model.tensors[0].clone();
        second.push(twice.clone());
        let shard = "model-00002-of-00003.safetensors";
        write_safetensors(&dir.path().join(shard), &second).unwrap();
        let e = refused(&dir, shard, Some(&twice.name));
        assert!(e.contains("model-00001-of-00003.safetensors"), "{e}");
    }

    #[test]
    fn checked_before_training_bad_index() {
        let dir = written(&TestCheckpoint::qwen2_tied(), 3, "bad-index");
        let index = dir.path().join(INDEX_FILE);
        for (text, says) in [
            ("{\"weight_map\": ", "not valid JSON"),
            ("{\"metadata\": {}}", "weight_map"),
            ("{\"weight_map\": {\"model.norm.weight\": 3}}", "file name"),
            (
                "{\"weight_map\": {\"model.norm.weight\": \"../x.safetensors\"}}",
                "model directory",
            ),
        ] {
            std::fs::write(&index, text).unwrap();
            let e = refused(&dir, INDEX_FILE, None);
            assert!(e.contains(says), "{text}: {e}");
        }
    }

    #[test]
    fn checked_before_training_untied_head_in_tied_checkpoint() {
        let mut model = TestCheckpoint::qwen3_tied();
        let mut head = TestTensor {
            name: "lm_head.weight".into(),
            ..model.tensors[0].clone()
        };
        // One element differs in its lowest bit.
        head.bytes[6] ^= 1;
        model.tensors.push(head);
        let e = refused(
            &written(&model, 1, "untied-head"),
            SINGLE_FILE,
            Some("lm_head.weight"),
        );
        assert!(e.contains("not tied") && e.contains("element 3"), "{e}");
        // An untied checkpoint without its head is missing it.
        let mut model = TestCheckpoint::llama_gqa();
        model.remove("lm_head.weight").unwrap();
        refused(
            &written(&model, 1, "no-head"),
            SINGLE_FILE,
            Some("lm_head.weight"),
        );
    }

    #[test]
    fn checked_before_training_bad_config_names_the_file_and_field() {
        let cases: [(&str, Value); 7] = [
            ("hidden_size", Value::from("24")),
            ("hidden_act", Value::from("gelu_pytorch_tanh")),
            ("use_sliding_window", Value::from(true)),
            ("num_experts", Value::from(4)),
            ("model_type", Value::from("mixtral")),
            (
                "rope_scaling",
                serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
            ),
            ("num_attention_heads", Value::from(5)),
        ];
        for (field, value) in cases {
            let mut model = TestCheckpoint::qwen2_tied();
            model.json[field] = value;
            let dir = written(&model, 1, "bad-config");
            let e = refused(&dir, "config.json", None);
            let named = if field == "rope_scaling" {
                "rope_scaling.rope_type"
            } else {
                field
            };
            assert!(e.contains(&format!("`{named}`")), "{field}: {e}");
        }
        let dir = written(&TestCheckpoint::llama_gqa(), 1, "no-config");
        std::fs::remove_file(dir.path().join("config.json")).unwrap();
        refused(&dir, "config.json", None);
        std::fs::write(dir.path().join("config.json"), "{not json").unwrap();
        refused(&dir, "config.json", None);
    }

    #[test]
    fn checked_before_training_no_weights() {
        let dir = written(&TestCheckpoint::llama_gqa(), 1, "no-weights");
        std::fs::remove_file(dir.path().join(SINGLE_FILE)).unwrap();
        let e = HfCheckpoint::open(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains(&dir.path().display().to_string()) && e.contains(INDEX_FILE),
            "{e}"
        );
    }
}
