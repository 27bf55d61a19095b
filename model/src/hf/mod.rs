//! Models in Hugging Face layout: read a model directory (`config.json`, `model.safetensors` or
//! shards with `model.safetensors.index.json`, tokenizer files) into odc's units, and write a
//! model back in that layout, for `transformers`' `from_pretrained` and vLLM.
//!
//! - [`config`]: `config.json` (`model_type` `llama`, `qwen2` or `qwen3`) as a
//!   [`ModelConfig`](super::ModelConfig) ([`read_config`]), and the `config.json` of an export.
//! - [`load`]: a memory-mapped checkpoint ([`HfCheckpoint`]) whose tensors are checked against
//!   the config before any training, then converted to f32 unit by unit — eagerly
//!   ([`HfCheckpoint::unit_values`]) or lazily, shard by shard, at the shard server that owns the
//!   range ([`HfCheckpoint::unit_specs`]).
//! - [`export`]: [`export_hf`], bf16 (or f32) safetensors with Hugging Face names.
//! - [`peft`]: LoRA in PEFT's layout: an adapted model's units from its base checkpoint, the
//!   adapters' files, and the base model with the adapters merged in.
//! - [`dtype`]: the element types on disk and their conversions.
//!
//! Hugging Face tensor names are odc's parameter names ([`unit_params`](super::unit_params)), so
//! the mapping between the two layouts is the unit layout itself.
//!
//! Guarantees (each has a test named after it):
//! 1. **Refused, not guessed**: a `config.json` whose model odc does not implement (another
//!    `model_type`, activation, rope type, a sliding window, MoE, o_proj or MLP biases) or with a
//!    field of the wrong type is an [`Error::HfConfig`](super::Error::HfConfig) naming the file,
//!    the field, its value and what was expected.
//! 2. **Checked before training**: [`HfCheckpoint::open`] reads every header and checks that
//!    every tensor the config implies is present exactly once, with its shape and an accepted
//!    dtype (F32, BF16, F16), that no other tensor is (rotary `inv_freq` buffers aside; a tied
//!    checkpoint's `lm_head.weight` only if it equals the embedding bit for bit), that every
//!    file is complete and every shard of the index exists and holds what the index says. Each
//!    defect is an [`Error::Checkpoint`](super::Error::Checkpoint) naming the file, the tensor
//!    and what was expected; nothing panics on a bad file.
//! 3. **Exact conversion**: a unit's values are the tensors' values converted to f32 exactly
//!    (bf16 and f16 are subsets of f32), eagerly or through a lazy slice — the two agree on every
//!    range.
//! 4. **Not read twice**: files are memory-mapped; a lazy unit reads only the range asked for.
//! 5. **Round trip**: load → export in f32 → load gives the same config and the same values bit
//!    for bit; a bf16 export rounds to nearest even.
//! 6. **Loadable export**: safetensors metadata `{"format": "pt"}`, Hugging Face names, no
//!    `lm_head.weight` when tied, shards of at most `max_shard_bytes` with a
//!    `model.safetensors.index.json`, a `config.json` with `torch_dtype` that reads back as the
//!    same model, the source's tokenizer files; written to a temporary directory beside the
//!    target and renamed into place, so no half-written export carries the final name.
//!
//! Test checkpoints: [`testing`] writes small random checkpoints in this layout (every family and
//! variant), for the crate's tests and integration tests.

pub mod config;
pub mod dtype;
pub mod export;
pub mod load;
pub mod peft;
#[doc(hidden)]
pub mod testing;

pub use config::{read_config, HfConfig, HfFamily};
pub use dtype::DiskDtype;
pub use export::{export_hf, ExportDtype, ExportOptions, ExportSummary};
pub use load::HfCheckpoint;

/// The tokenizer and generation files of a model directory, copied by [`export_hf`] and listed by
/// [`HfCheckpoint::tokenizer_files`].
pub const TOKENIZER_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

/// A model directory's `config.json`.
pub const CONFIG_FILE: &str = "config.json";
/// A single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// A sharded checkpoint's index: `{"metadata": {"total_size": N}, "weight_map": {tensor: file}}`.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
