//! A model written back in Hugging Face layout ([`export_hf`]): what `transformers`'
//! `from_pretrained` and vLLM load as it is (guarantees 5 and 6 of [`super`]).
//!
//! ```text
//! OUT/config.json                        the source's, values odc knows updated, torch_dtype set
//! OUT/model.safetensors                  or, above max_shard_bytes:
//! OUT/model-00001-of-0000N.safetensors   ... with OUT/model.safetensors.index.json
//! OUT/tokenizer.json, ...                copied from the source directory
//! ```
//!
//! Tensors carry their Hugging Face names in the model's order, bf16 (rounded to nearest even) or
//! f32, with metadata `{"format": "pt"}` (which `transformers` requires); `lm_head.weight` is left
//! out when the embeddings are tied. Shards fill in the model's order up to `max_shard_bytes`
//! (a larger tensor gets a shard of its own), as `save_pretrained` splits them. Everything is
//! written to a temporary directory beside the target, which is renamed into place at the end.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use serde_json::{json, Value};

use super::super::config::ModelConfig;
use super::super::error::{Error, Result};
use super::super::params::unit_numel;
use super::super::transformer::{check_unit_count, unit_params};
use super::config::{export_json, read_config};
use super::dtype::DiskDtype;
use super::{CONFIG_FILE, INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES};

/// `save_pretrained`'s default `max_shard_size` ("5GB", in bytes of tensor data per file).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The element type of an export's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExportDtype {
    /// bfloat16, rounded to nearest even: what the released checkpoints hold.
    #[default]
    Bf16,
    /// float32: exact.
    F32,
}

impl std::fmt::Display for ExportDtype {
    /// `bf16` or `f32`, as the examples' `--export-dtype` names them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ExportDtype::Bf16 => "bf16",
            ExportDtype::F32 => "f32",
        })
    }
}

impl ExportDtype {
    fn disk(self) -> DiskDtype {
        match self {
            ExportDtype::Bf16 => DiskDtype::Bf16,
            ExportDtype::F32 => DiskDtype::F32,
        }
    }

    /// `config.json`'s `torch_dtype`.
    pub fn torch_dtype(self) -> &'static str {
        match self {
            ExportDtype::Bf16 => "bfloat16",
            ExportDtype::F32 => "float32",
        }
    }
}

/// How [`export_hf`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportOptions<'a> {
    /// The tensors' element type (default bf16).
    pub dtype: ExportDtype,
    /// Most bytes of tensor data per safetensors file (default [`DEFAULT_MAX_SHARD_BYTES`]).
    pub max_shard_bytes: u64,
    /// The model directory the model was loaded from: its `config.json` is the base of the
    /// export's and its tokenizer files ([`TOKENIZER_FILES`]) are copied.
    pub source: Option<&'a Path>,
}

impl Default for ExportOptions<'_> {
    fn default() -> Self {
        ExportOptions {
            dtype: ExportDtype::default(),
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            source: None,
        }
    }
}

/// What [`export_hf`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSummary {
    /// The safetensors files, in order (`model.safetensors`, or `model-0000i-of-0000N...`).
    pub safetensors_files: Vec<String>,
    /// Bytes of tensor data (the index's `metadata.total_size`).
    pub tensor_bytes: u64,
    /// The tokenizer files copied from the source.
    pub tokenizer_files: Vec<&'static str>,
}

/// One tensor to write: its name, shape and values.
pub(crate) struct NamedValues<'a> {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) values: &'a [f32],
}

/// Writes `units` (one flat buffer per unit of `config`) to the new directory `dir_out` in
/// Hugging Face layout (see the [module docs](self)). `dir_out` must not exist or be empty; its
/// parent is created if needed.
///
/// ```no_run
/// # fn main() -> odc_model::Result<()> {
/// use odc_model::hf::{export_hf, ExportOptions, HfCheckpoint};
/// let source = std::path::Path::new("models/Qwen2.5-0.5B");
/// let checkpoint = HfCheckpoint::open(source)?;
/// let units = checkpoint.all_unit_values()?; // ... after training, the trained values
/// let options = ExportOptions { source: Some(source), ..ExportOptions::default() };
/// export_hf("out/qwen-sft".as_ref(), checkpoint.config(), &units, &options)?;
/// # Ok(()) }
/// ```
pub fn export_hf(
    dir_out: &Path,
    config: &ModelConfig,
    units: &[Vec<f32>],
    options: &ExportOptions<'_>,
) -> Result<ExportSummary> {
    if config.lora.is_some() {
        return Err(Error::Config {
            field: "lora",
            reason: "an adapted model exports as its base model with the adapters merged \
                     (`hf::peft::merge`, `--merge-lora`) or as PEFT adapters (`hf::peft::export_peft`)"
                .into(),
        });
    }
    let base = options.source.map(read_config).transpose()?;
    let config_json = export_json(config, base.as_ref(), options.dtype.torch_dtype())?;
    let tensors = tensors_of(config, units)?;
    if options.max_shard_bytes == 0 {
        return Err(Error::Config {
            field: "max_shard_bytes",
            reason: "must be nonzero".into(),
        });
    }
    let shards = plan_shards(
        &tensors,
        options.dtype.disk().size(),
        options.max_shard_bytes,
    );

    let io_err = |path: &Path, what: &str, e: std::io::Error| Error::Checkpoint {
        path: path.to_path_buf(),
        tensor: None,
        reason: format!("cannot {what}: {e}"),
    };
    let target_empty = match std::fs::read_dir(dir_out) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(Error::Checkpoint {
                    path: dir_out.to_path_buf(),
                    tensor: None,
                    reason: "exists and is not empty: export into a new or empty directory".into(),
                });
            }
            true
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(io_err(dir_out, "read the export directory", e)),
    };
    let parent = match dir_out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| io_err(&parent, "create directory", e))?;
    let temp = parent.join(format!(
        ".{}.odc-export-{}-{}",
        dir_out
            .file_name()
            .map_or_else(|| "export".into(), |n| n.to_string_lossy()),
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir(&temp).map_err(|e| io_err(&temp, "create directory", e))?;

    let written = write_into(&temp, &tensors, &shards, options, &config_json);
    let summary = match written {
        Ok(summary) => summary,
        Err(e) => {
            // Our own temporary directory: nothing else is in it.
            let _ = std::fs::remove_dir_all(&temp);
            return Err(e);
        }
    };
    if target_empty {
        std::fs::remove_dir(dir_out)
            .map_err(|e| io_err(dir_out, "replace the empty directory", e))?;
    }
    std::fs::rename(&temp, dir_out).map_err(|e| {
        let _ = std::fs::remove_dir_all(&temp);
        io_err(dir_out, "rename the finished export into place", e)
    })?;
    Ok(summary)
}

/// The model's tensors in order, each a slice of its unit's buffer; the buffers' lengths checked.
fn tensors_of<'a>(config: &ModelConfig, units: &'a [Vec<f32>]) -> Result<Vec<NamedValues<'a>>> {
    config.validate()?;
    check_unit_count(config, units.len())?;
    let mut out = Vec::new();
    for (u, values) in units.iter().enumerate() {
        let specs = unit_params(config, u)?;
        if values.len() != unit_numel(&specs) {
            return Err(Error::UnitParams {
                what: "values",
                expected: unit_numel(&specs),
                got: values.len(),
            });
        }
        let mut rest = values.as_slice();
        for spec in specs {
            let (values, tail) = rest.split_at(spec.numel());
            rest = tail;
            out.push(NamedValues {
                name: spec.name,
                shape: spec.shape,
                values,
            });
        }
    }
    Ok(out)
}

/// Tensor indices per shard: in order, a new shard when the next tensor would pass `max` bytes.
fn plan_shards(tensors: &[NamedValues<'_>], elem: usize, max: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut size = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let bytes = (t.values.len() * elem) as u64;
        match shards.last_mut() {
            Some(shard) if size + bytes <= max => shard.push(i),
            _ => {
                shards.push(vec![i]);
                size = 0;
            }
        }
        size += bytes;
    }
    shards
}

fn write_into(
    dir: &Path,
    tensors: &[NamedValues<'_>],
    shards: &[Vec<usize>],
    options: &ExportOptions<'_>,
    config_json: &Value,
) -> Result<ExportSummary> {
    let dtype = options.dtype.disk();
    let names: Vec<String> = if shards.len() == 1 {
        vec![SINGLE_FILE.to_string()]
    } else {
        (1..=shards.len())
            .map(|i| format!("model-{i:05}-of-{:05}.safetensors", shards.len()))
            .collect()
    };
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (shard, file) in shards.iter().zip(&names) {
        let path = dir.join(file);
        let members: Vec<&NamedValues<'_>> = shard.iter().filter_map(|&i| tensors.get(i)).collect();
        total += write_safetensors(&path, &members, dtype)?;
        for t in &members {
            weight_map.insert(t.name.clone(), file.clone());
        }
    }
    if names.len() > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        write_json(&dir.join(INDEX_FILE), &index)?;
    }
    write_json(&dir.join(CONFIG_FILE), config_json)?;
    let mut copied = Vec::new();
    if let Some(source) = options.source {
        for name in TOKENIZER_FILES {
            let from = source.join(name);
            if from.is_file() {
                std::fs::copy(&from, dir.join(name)).map_err(|e| Error::Checkpoint {
                    path: from.clone(),
                    tensor: None,
                    reason: format!("cannot copy into the export: {e}"),
                })?;
                copied.push(name);
            }
        }
    }
    Ok(ExportSummary {
        safetensors_files: names,
        tensor_bytes: total,
        tokenizer_files: copied,
    })
}

/// Writes `tensors` in `dtype` to the safetensors file `path` with `{"format": "pt"}` (what
/// `transformers` requires); the bytes of tensor data written.
pub(crate) fn write_safetensors(
    path: &Path,
    tensors: &[&NamedValues<'_>],
    dtype: DiskDtype,
) -> Result<u64> {
    let data: Vec<Vec<u8>> = tensors.iter().map(|t| dtype.encode(t.values)).collect();
    let mut views = Vec::with_capacity(tensors.len());
    for (t, data) in tensors.iter().zip(&data) {
        let view = TensorView::new(dtype.safetensors(), t.shape.clone(), data).map_err(|e| {
            Error::Checkpoint {
                path: path.to_path_buf(),
                tensor: Some(t.name.clone()),
                reason: format!("cannot make a tensor view: {e}"),
            }
        })?;
        views.push((t.name.clone(), view));
    }
    let err = |reason: String| Error::Checkpoint {
        path: path.to_path_buf(),
        tensor: None,
        reason,
    };
    // safetensors writes through an owner-only temporary file renamed into place: the file
    // gets the mode a file created here gets (the umask's), as the export's JSON files have.
    let mode = std::fs::File::create(path)
        .and_then(|f| f.metadata())
        .map(|m| m.permissions())
        .map_err(|e| err(format!("cannot create: {e}")))?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path)
        .map_err(|e| err(format!("cannot write: {e}")))?;
    std::fs::set_permissions(path, mode).map_err(|e| err(format!("cannot set its mode: {e}")))?;
    Ok(data.iter().map(|d| d.len() as u64).sum())
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let err = |reason: String| Error::Checkpoint {
        path: path.to_path_buf(),
        tensor: None,
        reason,
    };
    let mut text = serde_json::to_string_pretty(value).map_err(|e| err(format!("{e}")))?;
    text.push('\n');
    std::fs::write(path, text).map_err(|e| err(format!("cannot write: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::testing::{TempDir, TestCheckpoint};
    use crate::hf::HfCheckpoint;
    use safetensors::{Dtype, SafeTensors};

    fn bits(units: &[Vec<f32>]) -> Vec<Vec<u32>> {
        units
            .iter()
            .map(|u| u.iter().map(|x| x.to_bits()).collect())
            .collect()
    }

    /// A preset written to `root/src` and opened.
    fn loaded(root: &TempDir, model: &TestCheckpoint, shards: usize) -> HfCheckpoint {
        let src = root.path().join("src");
        model.write(&src, shards).unwrap();
        HfCheckpoint::open(&src).unwrap()
    }

    fn f32_options(source: Option<&Path>) -> ExportOptions<'_> {
        ExportOptions {
            dtype: ExportDtype::F32,
            source,
            ..ExportOptions::default()
        }
    }

    /// A safetensors file's name, metadata, and tensor names with their dtype.
    type Header = (String, HashMap<String, String>, BTreeMap<String, Dtype>);

    /// Every safetensors file of `dir`, by name.
    fn headers(dir: &Path) -> Vec<Header> {
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".safetensors"))
            .collect();
        files.sort();
        files
            .into_iter()
            .map(|f| {
                let bytes = std::fs::read(dir.join(&f)).unwrap();
                let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
                let names = meta
                    .tensors()
                    .into_iter()
                    .map(|(n, info)| (n, info.dtype))
                    .collect();
                (f, meta.metadata().clone().unwrap_or_default(), names)
            })
            .collect()
    }

    #[test]
    fn round_trip_f32_export_is_exact() {
        for (name, model, shards) in TestCheckpoint::presets() {
            let root = TempDir::new(name);
            let source = loaded(&root, &model, shards);
            let units = source.all_unit_values().unwrap();
            for (out, from) in [("with-source", Some(source.dir())), ("alone", None)] {
                let out = root.path().join(out);
                export_hf(&out, source.config(), &units, &f32_options(from)).unwrap();
                let back = HfCheckpoint::open(&out).unwrap();
                assert_eq!(back.config(), source.config(), "{name}");
                assert_eq!(
                    bits(&back.all_unit_values().unwrap()),
                    bits(&units),
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn round_trip_bf16_export_rounds_to_nearest_even() {
        let root = TempDir::new("bf16");
        let source = loaded(&root, &TestCheckpoint::llama_gqa(), 1);
        let units = source.all_unit_values().unwrap();
        let out = root.path().join("out");
        export_hf(&out, source.config(), &units, &ExportOptions::default()).unwrap();
        let back = HfCheckpoint::open(&out).unwrap().all_unit_values().unwrap();
        let rounded: Vec<Vec<f32>> = units.iter().map(|u| DiskDtype::Bf16.round(u)).collect();
        assert_eq!(bits(&back), bits(&rounded));
        assert_ne!(
            bits(&back),
            bits(&units),
            "f32 values are not all bf16 values"
        );
        // Values that are bf16 already (a bf16 checkpoint) come back exactly.
        let root = TempDir::new("bf16-exact");
        let source = loaded(&root, &TestCheckpoint::llama3_scaled(), 1);
        let units = source.all_unit_values().unwrap();
        let out = root.path().join("out");
        export_hf(&out, source.config(), &units, &ExportOptions::default()).unwrap();
        let back = HfCheckpoint::open(&out).unwrap().all_unit_values().unwrap();
        assert_eq!(bits(&back), bits(&units));
    }

    #[test]
    fn loadable_export_header_has_hf_names_format_pt_bf16_and_no_lm_head_when_tied() {
        for (name, model, shards) in TestCheckpoint::presets() {
            let root = TempDir::new(name);
            let source = loaded(&root, &model, shards);
            let out = root.path().join("out");
            let options = ExportOptions {
                source: Some(source.dir()),
                ..ExportOptions::default()
            };
            let units = source.all_unit_values().unwrap();
            let summary = export_hf(&out, source.config(), &units, &options).unwrap();
            assert_eq!(summary.safetensors_files, vec![SINGLE_FILE.to_string()]);
            // Readable as the other files of the export are (not owner-only).
            let mode = |f: &str| std::fs::metadata(out.join(f)).unwrap().permissions();
            assert_eq!(mode(SINGLE_FILE), mode("config.json"), "{name}");
            let files = headers(&out);
            let [(file, meta, tensors)] = files.as_slice() else {
                panic!("{name}: one file expected, got {files:?}");
            };
            assert_eq!(file, SINGLE_FILE);
            assert_eq!(meta.get("format").map(String::as_str), Some("pt"), "{name}");
            let expected: Vec<String> = model.tensors.iter().map(|t| t.name.clone()).collect();
            let mut got: Vec<String> = tensors.keys().cloned().collect();
            let mut want = expected.clone();
            got.sort();
            want.sort();
            assert_eq!(got, want, "{name}");
            assert!(tensors.values().all(|d| *d == Dtype::BF16), "{name}");
            assert_eq!(
                tensors.contains_key("lm_head.weight"),
                !model.config.tie_embeddings,
                "{name}"
            );
            let bytes: u64 = units.iter().map(|u| u.len() as u64 * 2).sum();
            assert_eq!(summary.tensor_bytes, bytes);
            assert!(!out.join(INDEX_FILE).exists());
        }
    }

    #[test]
    fn loadable_export_sharded_with_a_correct_index() {
        let root = TempDir::new("sharded");
        let source = loaded(&root, &TestCheckpoint::qwen2_tied(), 3);
        let units = source.all_unit_values().unwrap();
        let out = root.path().join("out");
        let max = 2_000;
        let options = ExportOptions {
            max_shard_bytes: max,
            source: Some(source.dir()),
            ..ExportOptions::default()
        };
        let summary = export_hf(&out, source.config(), &units, &options).unwrap();
        let n = summary.safetensors_files.len();
        assert!(n > 2, "{n} shards");
        let index: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join(INDEX_FILE)).unwrap()).unwrap();
        let weight_map = index["weight_map"].as_object().unwrap();
        let files = headers(&out);
        let mut total = 0;
        for (i, (file, meta, tensors)) in files.iter().enumerate() {
            assert_eq!(file, &format!("model-{:05}-of-{n:05}.safetensors", i + 1));
            assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
            let bytes = std::fs::read(out.join(file)).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let data: u64 = st
                .tensors()
                .iter()
                .map(|(_, v)| v.data().len() as u64)
                .sum();
            assert!(data <= max || tensors.len() == 1, "{file}: {data} bytes");
            for name in tensors.keys() {
                assert_eq!(weight_map[name], file.as_str(), "{name}");
            }
            total += data;
        }
        let listed: usize = files.iter().map(|(_, _, t)| t.len()).sum();
        assert_eq!(weight_map.len(), listed);
        assert_eq!(index["metadata"]["total_size"], total);
        assert_eq!(summary.tensor_bytes, total);
        // Model order: the embedding first, the final norm last.
        assert_eq!(
            weight_map["model.embed_tokens.weight"],
            summary.safetensors_files[0].as_str()
        );
        assert_eq!(
            weight_map["model.norm.weight"],
            summary.safetensors_files[n - 1].as_str()
        );
        let back = HfCheckpoint::open(&out).unwrap();
        assert_eq!(bits(&back.all_unit_values().unwrap()), bits(&units));
    }

    #[test]
    fn loadable_export_config_json_and_tokenizer_files() {
        let root = TempDir::new("files");
        let model = TestCheckpoint::qwen3_tied();
        let source = loaded(&root, &model, 1);
        let units = source.all_unit_values().unwrap();
        let out = root.path().join("out");
        let options = ExportOptions {
            source: Some(source.dir()),
            ..ExportOptions::default()
        };
        let summary = export_hf(&out, source.config(), &units, &options).unwrap();
        assert_eq!(summary.tokenizer_files, source.tokenizer_files());
        for f in source.tokenizer_files() {
            let (a, b) = (
                std::fs::read(source.dir().join(f)),
                std::fs::read(out.join(f)),
            );
            assert_eq!(a.unwrap(), b.unwrap(), "{f}");
        }
        let json: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join(CONFIG_FILE)).unwrap()).unwrap();
        assert_eq!(json["torch_dtype"], "bfloat16");
        assert_eq!(json["head_dim"], 16);
        assert_eq!(json["tie_word_embeddings"], true);
        // The source's own fields are kept.
        assert_eq!(
            json["transformers_version"],
            model.json["transformers_version"]
        );
        assert_eq!(json["eos_token_id"], model.json["eos_token_id"]);

        // Without a source: a config made from the model alone, every field transformers reads.
        let alone = root.path().join("alone");
        export_hf(&alone, source.config(), &units, &f32_options(None)).unwrap();
        let json: Value =
            serde_json::from_str(&std::fs::read_to_string(alone.join(CONFIG_FILE)).unwrap())
                .unwrap();
        assert_eq!(json["model_type"], "qwen3");
        assert_eq!(json["architectures"][0], "Qwen3ForCausalLM");
        assert_eq!(json["torch_dtype"], "float32");
        for field in [
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_hidden_layers",
            "vocab_size",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "tie_word_embeddings",
            "hidden_act",
            "attention_bias",
        ] {
            assert!(json.get(field).is_some(), "{field} missing: {json}");
        }
        assert!(!alone.join("tokenizer.json").exists());
    }

    /// No entry of `parent` is a leftover temporary directory of an export.
    fn no_leftovers(parent: &Path) {
        for entry in std::fs::read_dir(parent).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            assert!(!name.contains(".odc-export-"), "left behind: {name}");
        }
    }

    #[test]
    fn loadable_export_never_half_written_under_the_final_name() {
        let root = TempDir::new("atomic");
        let source = loaded(&root, &TestCheckpoint::llama_gqa(), 1);
        let units = source.all_unit_values().unwrap();
        let config = source.config();

        // A bad buffer fails before anything carries the final name, and leaves nothing behind.
        let out = root.path().join("out");
        let mut short = units.clone();
        short[1].pop();
        let e = export_hf(&out, config, &short, &f32_options(None)).unwrap_err();
        assert!(matches!(e, Error::UnitParams { .. }), "{e}");
        assert!(!out.exists());
        assert!(export_hf(&out, config, &units[..2], &f32_options(None)).is_err());
        // A source directory without config.json names it.
        let e = export_hf(
            &out,
            config,
            &units,
            &f32_options(Some(&root.path().join("nowhere"))),
        )
        .unwrap_err();
        assert!(e.to_string().contains("config.json"), "{e}");
        assert!(!out.exists());
        no_leftovers(root.path());

        // A non-empty target is refused and left as it was.
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join("notes.txt"), "mine").unwrap();
        let e = export_hf(&out, config, &units, &f32_options(None)).unwrap_err();
        assert!(e.to_string().contains("not empty"), "{e}");
        assert_eq!(
            std::fs::read_to_string(out.join("notes.txt")).unwrap(),
            "mine"
        );
        no_leftovers(root.path());

        // An empty target, and a missing parent, are fine.
        std::fs::remove_file(out.join("notes.txt")).unwrap();
        export_hf(&out, config, &units, &f32_options(None)).unwrap();
        let nested = root.path().join("a/b/out");
        export_hf(&nested, config, &units, &f32_options(None)).unwrap();
        assert!(HfCheckpoint::open(&nested).is_ok());
        no_leftovers(root.path());
    }
}
