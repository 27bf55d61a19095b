//! A Hugging Face `config.json` as a [`ModelConfig`] ([`read_config`]), and the `config.json` of
//! an export ([`export_json`]).
//!
//! Read: `model_type` `llama`, `qwen2` or `qwen3`; `hidden_size` → `d_model`,
//! `num_hidden_layers` → `n_layers`, `num_attention_heads` → `n_heads`, `num_key_value_heads` →
//! `n_kv_heads` (absent: `n_heads`), `head_dim` (absent or `null`: `hidden_size /
//! num_attention_heads`), `intermediate_size` → `d_ff`, `max_position_embeddings` → `max_seq_len`,
//! `rope_theta` (default 10000), `rope_scaling` (`null`, or Llama 3's), `rms_norm_eps`,
//! `vocab_size`, `tie_word_embeddings` (default `false`, as `transformers`' three config classes),
//! `initializer_range` → `init_std` (default 0.02); Qwen2 has q/k/v biases, Qwen3 q/k norms.
//! transformers 5's `rope_parameters` (`rope_theta` and the rope type in one object) is read too.
//!
//! Refused, naming the field and its value (guarantee 1 of [`super`]): another `model_type`,
//! `hidden_act` other than `silu`, `use_sliding_window: true` or a `layer_types` entry other than
//! `full_attention`, MoE fields (`num_experts`, `num_local_experts`, `n_routed_experts`,
//! `num_experts_per_tok` above 0), a rope type other than `llama3` or `default`,
//! `attention_bias: true` (Llama, Qwen3: it adds an o_proj bias), `mlp_bias: true`,
//! `attention_dropout` above 0, `partial_rotary_factor` other than 1, a `quantization_config`.
//! A field of the wrong type names the file, the field and the expected type.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::super::config::{ModelConfig, RopeScaling};
use super::super::error::{Error, Result};
use super::CONFIG_FILE;

/// The Hugging Face model families odc implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfFamily {
    /// `LlamaForCausalLM` (Llama 2/3, SmolLM2, ...).
    Llama,
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): q/k/v biases.
    Qwen2,
    /// `Qwen3ForCausalLM`: q/k RMSNorm, explicit `head_dim`.
    Qwen3,
}

impl HfFamily {
    /// The `model_type` of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            HfFamily::Llama => "llama",
            HfFamily::Qwen2 => "qwen2",
            HfFamily::Qwen3 => "qwen3",
        }
    }

    /// The `architectures` entry of `config.json`.
    pub fn architecture(self) -> &'static str {
        match self {
            HfFamily::Llama => "LlamaForCausalLM",
            HfFamily::Qwen2 => "Qwen2ForCausalLM",
            HfFamily::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// The family whose layout a model has: Qwen3 with q/k norms, Qwen2 with q/k/v biases, Llama
    /// with neither. Both at once is no Hugging Face family (Qwen3's `attention_bias` adds an
    /// o_proj bias too), an [`Error::Config`].
    pub fn of(config: &ModelConfig) -> Result<Self> {
        match (config.qkv_bias, config.qk_norm) {
            (false, false) => Ok(HfFamily::Llama),
            (true, false) => Ok(HfFamily::Qwen2),
            (false, true) => Ok(HfFamily::Qwen3),
            (true, true) => Err(Error::Config {
                field: "qkv_bias",
                reason: "with qk_norm is no Hugging Face family (Qwen3's attention_bias also \
                         biases o_proj)"
                    .into(),
            }),
        }
    }

    fn from_model_type(model_type: &str) -> Option<Self> {
        [HfFamily::Llama, HfFamily::Qwen2, HfFamily::Qwen3]
            .into_iter()
            .find(|f| f.model_type() == model_type)
    }
}

/// A model directory's `config.json`: the model odc builds from it and the file as read (kept as
/// the base of an export's `config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    /// The file.
    pub path: PathBuf,
    /// Its `model_type`.
    pub family: HfFamily,
    /// The model (validated; `init_std` from `initializer_range`, `seed` 0).
    pub model: ModelConfig,
    /// The file's JSON, every field kept.
    pub json: Value,
}

/// Reads `dir/config.json` (see the [module docs](self)).
pub fn read_config(dir: &Path) -> Result<HfConfig> {
    HfConfig::from_file(&dir.join(CONFIG_FILE))
}

impl HfConfig {
    /// Reads a `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Checkpoint {
            path: path.to_path_buf(),
            tensor: None,
            reason: format!("cannot read the model's config: {e}"),
        })?;
        let json: Value = serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
            path: path.to_path_buf(),
            tensor: None,
            reason: format!("not valid JSON: {e}"),
        })?;
        Self::from_json(path, json)
    }

    /// Interprets `json`, the contents of `path` (named in every error).
    pub fn from_json(path: &Path, json: Value) -> Result<Self> {
        let Some(obj) = json.as_object() else {
            return Err(Error::HfConfig {
                path: path.to_path_buf(),
                field: "(top level)".into(),
                reason: format!("is {}, expected a JSON object", describe(&json)),
            });
        };
        let (family, model) = parse(&Fields::new(path, obj, ""))?;
        Ok(HfConfig {
            path: path.to_path_buf(),
            family,
            model,
            json,
        })
    }
}

impl ModelConfig {
    /// The model of a Hugging Face `config.json`: `path` is the file or its model directory (see
    /// [`crate::hf::config`]).
    pub fn from_hf_config(path: &Path) -> Result<ModelConfig> {
        let file = if path.is_dir() {
            path.join(CONFIG_FILE)
        } else {
            path.to_path_buf()
        };
        Ok(HfConfig::from_file(&file)?.model)
    }
}

/// `config` with `n_kv_heads` and `head_dim` as `None` where they equal their defaults, so two
/// spellings of one model compare equal.
pub(crate) fn normalised(config: &ModelConfig) -> ModelConfig {
    let mut c = config.clone();
    if c.n_kv_heads == Some(c.n_heads) {
        c.n_kv_heads = None;
    }
    if c.n_heads > 0 && c.d_model % c.n_heads == 0 && c.head_dim == Some(c.d_model / c.n_heads) {
        c.head_dim = None;
    }
    c
}

/// The JSON odc's config fields come from, by odc's field name: to name a field that
/// [`ModelConfig::validate`] refuses by the name the file spells it.
const HF_FIELD_OF: [(&str, &str); 12] = [
    ("vocab_size", "vocab_size"),
    ("d_model", "hidden_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("n_kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("d_ff", "intermediate_size"),
    ("max_seq_len", "max_position_embeddings"),
    ("rope_theta", "rope_theta"),
    ("rope_scaling", "rope_scaling"),
    ("rms_eps", "rms_norm_eps"),
    ("init_std", "initializer_range"),
];

fn parse(f: &Fields<'_>) -> Result<(HfFamily, ModelConfig)> {
    let model_type = f.required_str("model_type")?;
    let family = HfFamily::from_model_type(model_type).ok_or_else(|| {
        f.err(
            "model_type",
            format!(
                "is {model_type:?}: odc implements \"llama\", \"qwen2\" and \"qwen3\" (dense, \
                 Hugging Face layout)"
            ),
        )
    })?;
    refuse_unimplemented(f, family)?;

    let d_model = f.required_usize("hidden_size")?;
    let n_heads = f.required_usize("num_attention_heads")?;
    let (rope_theta, rope_scaling) = rope(f)?;
    let max_seq_len_default = match family {
        HfFamily::Llama => 2048,
        HfFamily::Qwen2 | HfFamily::Qwen3 => 32_768,
    };
    let model = normalised(&ModelConfig {
        vocab_size: f.required_usize("vocab_size")?,
        d_model,
        n_layers: f.required_usize("num_hidden_layers")?,
        n_heads,
        n_kv_heads: f.usize("num_key_value_heads")?,
        head_dim: f.usize("head_dim")?,
        d_ff: f.required_usize("intermediate_size")?,
        max_seq_len: f
            .usize("max_position_embeddings")?
            .unwrap_or(max_seq_len_default),
        rope_theta,
        rope_scaling,
        rms_eps: f.f64("rms_norm_eps")?.unwrap_or(1e-6),
        qkv_bias: family == HfFamily::Qwen2,
        qk_norm: family == HfFamily::Qwen3,
        tie_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(false),
        lora: None,
        init_std: f.f64("initializer_range")?.unwrap_or(0.02),
        seed: 0,
    });
    model.validate().map_err(|e| match e {
        Error::Config { field, reason } => {
            let hf = HF_FIELD_OF
                .iter()
                .find(|(odc, _)| *odc == field)
                .map_or(field, |(_, hf)| hf);
            f.err(hf, format!("gives an invalid model ({field} {reason})"))
        }
        other => other,
    })?;
    Ok((family, model))
}

/// Refuses what odc does not implement (see the [module docs](self)).
fn refuse_unimplemented(f: &Fields<'_>, family: HfFamily) -> Result<()> {
    if let Some(act) = f.str("hidden_act")? {
        if act != "silu" {
            return Err(f.err(
                "hidden_act",
                format!("is {act:?}: only \"silu\" (SwiGLU) is implemented"),
            ));
        }
    }
    if f.bool("use_sliding_window")? == Some(true) {
        return Err(f.err(
            "use_sliding_window",
            "is true: sliding-window attention is not implemented".into(),
        ));
    }
    if let Some(types) = f.get("layer_types") {
        let Some(types) = types.as_array() else {
            return Err(f.type_err("layer_types", types, "an array of strings"));
        };
        for (i, t) in types.iter().enumerate() {
            if t.as_str() != Some("full_attention") {
                return Err(f.err(
                    &format!("layer_types[{i}]"),
                    format!(
                        "is {}: only \"full_attention\" layers are implemented",
                        describe(t)
                    ),
                ));
            }
        }
    }
    for moe in [
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "num_experts_per_tok",
    ] {
        if let Some(n) = f.usize(moe)? {
            if n > 0 {
                return Err(f.err(
                    moe,
                    format!("is {n}: mixture-of-experts models are not implemented"),
                ));
            }
        }
    }
    if family != HfFamily::Qwen2 && f.bool("attention_bias")? == Some(true) {
        return Err(f.err(
            "attention_bias",
            "is true: biases on the attention projections (o_proj's included) are not \
             implemented for this model_type"
                .into(),
        ));
    }
    if f.bool("mlp_bias")? == Some(true) {
        return Err(f.err(
            "mlp_bias",
            "is true: biases on the MLP projections are not implemented".into(),
        ));
    }
    if let Some(p) = f.f64("attention_dropout")? {
        if p != 0.0 {
            return Err(f.err(
                "attention_dropout",
                format!("is {p}: dropout is not implemented (expected 0)"),
            ));
        }
    }
    if let Some(p) = f.f64("partial_rotary_factor")? {
        if p != 1.0 {
            return Err(f.err(
                "partial_rotary_factor",
                format!("is {p}: only full rotary embeddings are implemented (expected 1)"),
            ));
        }
    }
    if f.get("quantization_config").is_some() {
        return Err(f.err(
            "quantization_config",
            "is set: quantized checkpoints are not implemented (expected none)".into(),
        ));
    }
    Ok(())
}

/// `rope_theta` and the rope scaling: `rope_scaling` (transformers 4) or `rope_parameters`
/// (transformers 5, which carries `rope_theta` too).
fn rope(f: &Fields<'_>) -> Result<(f64, Option<RopeScaling>)> {
    let parameters = f.object("rope_parameters")?;
    let theta = match f.f64("rope_theta")? {
        Some(theta) => theta,
        None => match &parameters {
            Some(p) => p.f64("rope_theta")?.unwrap_or(10_000.0),
            None => 10_000.0,
        },
    };
    let (scaling, type_required) = match (f.object("rope_scaling")?, parameters) {
        (Some(s), _) => (s, true),
        (None, Some(p)) => (p, false),
        (None, None) => return Ok((theta, None)),
    };
    let type_key = ["rope_type", "type"]
        .into_iter()
        .find(|k| scaling.get(k).is_some());
    let rope_type = match type_key {
        Some(k) => scaling.required_str(k)?,
        None if type_required => {
            return Err(scaling.err(
                "rope_type",
                "is missing: expected \"llama3\" or \"default\"".into(),
            ))
        }
        None => "default",
    };
    match rope_type {
        "default" => Ok((theta, None)),
        "llama3" => Ok((
            theta,
            Some(RopeScaling {
                factor: scaling.required_f64("factor")?,
                low_freq_factor: scaling.required_f64("low_freq_factor")?,
                high_freq_factor: scaling.required_f64("high_freq_factor")?,
                original_max_position_embeddings: scaling
                    .required_usize("original_max_position_embeddings")?,
            }),
        )),
        other => Err(scaling.err(
            type_key.unwrap_or("rope_type"),
            format!("is {other:?}: only \"llama3\" scaling (or none, \"default\") is implemented"),
        )),
    }
}

/// The `config.json` of an export of `config` with weights in `torch_dtype`: `base`'s JSON (the
/// model directory it was loaded from) with every value odc knows set from `config`, or without
/// a base one made from `config` alone (`model_type` per [`HfFamily::of`]). The result reads
/// back ([`HfConfig::from_json`]) as `config` (`init_std` and `seed` aside), or this is an error.
pub fn export_json(
    config: &ModelConfig,
    base: Option<&HfConfig>,
    torch_dtype: &str,
) -> Result<Value> {
    config.validate()?;
    let family = HfFamily::of(config)?;
    let head_dim = config.head_dim();
    let derived_head_dim =
        config.d_model % config.n_heads == 0 && head_dim == config.d_model / config.n_heads;
    let mut obj = match base {
        Some(base) => {
            if base.family != family {
                return Err(Error::Checkpoint {
                    path: base.path.clone(),
                    tensor: None,
                    reason: format!(
                        "is a {:?} config but the model exported has the {:?} layout",
                        base.family.model_type(),
                        family.model_type()
                    ),
                });
            }
            base.json.as_object().cloned().unwrap_or_default()
        }
        None => {
            let mut obj = Map::new();
            obj.insert(
                "architectures".into(),
                Value::from(vec![family.architecture()]),
            );
            obj.insert("model_type".into(), family.model_type().into());
            obj.insert("hidden_act".into(), "silu".into());
            obj.insert("initializer_range".into(), config.init_std.into());
            obj.insert("attention_dropout".into(), 0.0.into());
            match family {
                HfFamily::Llama => {
                    obj.insert("attention_bias".into(), false.into());
                    obj.insert("mlp_bias".into(), false.into());
                }
                HfFamily::Qwen2 => {
                    obj.insert("use_sliding_window".into(), false.into());
                }
                HfFamily::Qwen3 => {
                    obj.insert("attention_bias".into(), false.into());
                    obj.insert("use_sliding_window".into(), false.into());
                }
            }
            obj.insert("use_cache".into(), true.into());
            obj
        }
    };
    let mut set = |k: &str, v: Value| {
        obj.insert(k.into(), v);
    };
    set("hidden_size", config.d_model.into());
    set("intermediate_size", config.d_ff.into());
    set("num_attention_heads", config.n_heads.into());
    set("num_key_value_heads", config.kv_heads().into());
    set("num_hidden_layers", config.n_layers.into());
    set("vocab_size", config.vocab_size.into());
    set("max_position_embeddings", config.max_seq_len.into());
    set("rms_norm_eps", config.rms_eps.into());
    set("tie_word_embeddings", config.tie_embeddings.into());
    set("torch_dtype", torch_dtype.into());
    if obj.contains_key("dtype") {
        // transformers 5 spells it `dtype`.
        obj.insert("dtype".into(), torch_dtype.into());
    }
    if base.is_none() || obj.contains_key("head_dim") || !derived_head_dim {
        obj.insert("head_dim".into(), head_dim.into());
    }
    set_rope(&mut obj, config);
    let json = Value::Object(obj);

    let path = base.map_or_else(|| PathBuf::from(CONFIG_FILE), |b| b.path.clone());
    let back = HfConfig::from_json(&path, json.clone())?.model;
    let back = ModelConfig {
        init_std: config.init_std,
        seed: config.seed,
        ..back
    };
    if back != normalised(config) {
        return Err(Error::Checkpoint {
            path,
            tensor: None,
            reason: format!(
                "the exported config.json would describe another model: {back:?}, not {config:?}"
            ),
        });
    }
    Ok(json)
}

/// Sets `rope_theta` and the rope scaling where the JSON keeps them: in `rope_parameters` if it
/// has that object (transformers 5), else at the top level (`rope_theta`, `rope_scaling`).
fn set_rope(obj: &mut Map<String, Value>, config: &ModelConfig) {
    const SCALING_KEYS: [&str; 4] = [
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ];
    let scaling_fields = |s: &RopeScaling, into: &mut Map<String, Value>| {
        into.insert("factor".into(), s.factor.into());
        into.insert("low_freq_factor".into(), s.low_freq_factor.into());
        into.insert("high_freq_factor".into(), s.high_freq_factor.into());
        into.insert(
            "original_max_position_embeddings".into(),
            s.original_max_position_embeddings.into(),
        );
    };
    if let Some(Value::Object(p)) = obj.get_mut("rope_parameters") {
        p.insert("rope_theta".into(), config.rope_theta.into());
        for k in SCALING_KEYS {
            p.remove(k);
        }
        p.remove("type");
        match &config.rope_scaling {
            Some(s) => {
                p.insert("rope_type".into(), "llama3".into());
                scaling_fields(s, p);
            }
            None => {
                p.insert("rope_type".into(), "default".into());
            }
        }
        if obj.contains_key("rope_theta") {
            obj.insert("rope_theta".into(), config.rope_theta.into());
        }
        if obj.contains_key("rope_scaling") {
            obj.insert("rope_scaling".into(), Value::Null);
        }
        return;
    }
    obj.insert("rope_theta".into(), config.rope_theta.into());
    let scaling = config.rope_scaling.as_ref().map(|s| {
        let mut m = Map::new();
        m.insert("rope_type".into(), "llama3".into());
        scaling_fields(s, &mut m);
        Value::Object(m)
    });
    obj.insert("rope_scaling".into(), scaling.unwrap_or(Value::Null));
}

/// A JSON object's fields, read with their types checked; errors name the file and the field
/// (with its parents: `rope_scaling.factor`).
struct Fields<'a> {
    path: &'a Path,
    obj: &'a Map<String, Value>,
    prefix: String,
}

impl<'a> Fields<'a> {
    fn new(path: &'a Path, obj: &'a Map<String, Value>, prefix: &str) -> Self {
        Fields {
            path,
            obj,
            prefix: prefix.to_string(),
        }
    }

    fn name(&self, field: &str) -> String {
        format!("{}{field}", self.prefix)
    }

    fn err(&self, field: &str, reason: String) -> Error {
        Error::HfConfig {
            path: self.path.to_path_buf(),
            field: self.name(field),
            reason,
        }
    }

    fn type_err(&self, field: &str, value: &Value, expected: &str) -> Error {
        self.err(
            field,
            format!("is {}, expected {expected}", describe(value)),
        )
    }

    fn missing(&self, field: &str, expected: &str) -> Error {
        self.err(field, format!("is missing, expected {expected}"))
    }

    /// The field's value; `None` when absent or `null`.
    fn get(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    /// The field read by `read` (`None` when absent or `null`); a value `read` refuses is an
    /// error saying it is not `expected`.
    fn typed<T>(
        &self,
        field: &str,
        expected: &str,
        read: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Option<T>> {
        self.get(field)
            .map(|v| read(v).ok_or_else(|| self.type_err(field, v, expected)))
            .transpose()
    }

    fn usize(&self, field: &str) -> Result<Option<usize>> {
        self.typed(field, "a non-negative integer", |v| {
            v.as_u64().and_then(|n| usize::try_from(n).ok())
        })
    }

    fn required_usize(&self, field: &str) -> Result<usize> {
        self.usize(field)?
            .ok_or_else(|| self.missing(field, "a non-negative integer"))
    }

    fn f64(&self, field: &str) -> Result<Option<f64>> {
        self.typed(field, "a number", Value::as_f64)
    }

    fn required_f64(&self, field: &str) -> Result<f64> {
        self.f64(field)?
            .ok_or_else(|| self.missing(field, "a number"))
    }

    fn bool(&self, field: &str) -> Result<Option<bool>> {
        self.typed(field, "true or false", Value::as_bool)
    }

    fn str(&self, field: &str) -> Result<Option<&'a str>> {
        self.typed(field, "a string", Value::as_str)
    }

    fn required_str(&self, field: &str) -> Result<&'a str> {
        self.str(field)?
            .ok_or_else(|| self.missing(field, "a string"))
    }

    /// A nested object's fields (named `field.*`).
    fn object(&self, field: &str) -> Result<Option<Fields<'a>>> {
        self.get(field)
            .map(|v| {
                v.as_object()
                    .map(|obj| Fields::new(self.path, obj, &format!("{}.", self.name(field))))
                    .ok_or_else(|| self.type_err(field, v, "an object or null"))
            })
            .transpose()
    }
}

/// A JSON value as an error message shows it: its type and, if short, the value.
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("{b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) if s.len() <= 64 => format!("the string {s:?}"),
        Value::String(_) => "a string".into(),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn path() -> PathBuf {
        PathBuf::from("/models/m/config.json")
    }

    fn qwen25_05b() -> Value {
        json!({
            "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
            "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
            "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
            "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
            "tie_word_embeddings": true, "torch_dtype": "bfloat16",
            "transformers_version": "4.40.1", "use_cache": true, "use_sliding_window": false,
            "vocab_size": 151936
        })
    }

    fn llama32_1b() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "attention_bias": false,
            "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001,
            "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
            "initializer_range": 0.02, "intermediate_size": 8192,
            "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
            "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
            "use_cache": true, "vocab_size": 128256
        })
    }

    fn qwen3_06b() -> Value {
        json!({
            "architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
            "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu",
            "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
            "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
            "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
            "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
            "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
        })
    }

    fn read(json: Value) -> Result<HfConfig> {
        HfConfig::from_json(&path(), json)
    }

    fn with(mut json: Value, field: &str, value: Value) -> Value {
        json[field] = value;
        json
    }

    /// The error's message, asserting it names the file and `field`.
    fn refused(json: Value, field: &str) -> String {
        let e = read(json).expect_err("refused").to_string();
        assert!(e.contains("/models/m/config.json"), "{e}");
        assert!(e.contains(&format!("`{field}`")), "{e}");
        e
    }

    #[test]
    fn public_configs_read_as_their_layouts() {
        let q = read(qwen25_05b()).unwrap();
        assert_eq!(q.family, HfFamily::Qwen2);
        let m = &q.model;
        assert_eq!(
            (m.d_model, m.n_layers, m.n_heads, m.kv_heads()),
            (896, 24, 14, 2)
        );
        assert_eq!((m.head_dim(), m.d_ff, m.vocab_size), (64, 4864, 151_936));
        assert!(m.qkv_bias && !m.qk_norm && m.tie_embeddings);
        assert_eq!((m.rope_theta, m.rms_eps, m.head_dim), (1e6, 1e-6, None));

        let l = read(llama32_1b()).unwrap();
        assert_eq!(l.family, HfFamily::Llama);
        let s = l.model.rope_scaling.unwrap();
        assert_eq!(
            (s.factor, s.low_freq_factor, s.high_freq_factor),
            (32.0, 1.0, 4.0)
        );
        assert_eq!(s.original_max_position_embeddings, 8192);
        // head_dim 64 = 2048 / 32: kept as the default.
        assert_eq!((l.model.head_dim, l.model.max_seq_len), (None, 131_072));

        let q3 = read(qwen3_06b()).unwrap();
        assert_eq!(q3.family, HfFamily::Qwen3);
        assert_eq!((q3.model.head_dim, q3.model.head_dim()), (Some(128), 128));
        assert!(q3.model.qk_norm && !q3.model.qkv_bias);
        assert_eq!(q3.model.rope_theta, 1e6);
    }

    #[test]
    fn defaults_follow_transformers() {
        let mut json = qwen25_05b();
        for k in [
            "num_key_value_heads",
            "tie_word_embeddings",
            "rope_theta",
            "hidden_act",
            "initializer_range",
            "max_position_embeddings",
        ] {
            json.as_object_mut().unwrap().remove(k);
        }
        let m = read(json).unwrap().model;
        assert_eq!(
            (m.kv_heads(), m.tie_embeddings, m.rope_theta),
            (14, false, 1e4)
        );
        assert_eq!((m.init_std, m.max_seq_len, m.seed), (0.02, 32_768, 0));
        // `head_dim: null` is the derived one.
        let m = read(with(qwen3_06b(), "head_dim", Value::Null))
            .unwrap()
            .model;
        assert_eq!(m.head_dim(), 64);
    }

    #[test]
    fn refused_not_guessed_config_values() {
        let e = refused(
            with(qwen25_05b(), "model_type", json!("mistral")),
            "model_type",
        );
        assert!(e.contains("mistral"), "{e}");
        let e = refused(
            with(qwen25_05b(), "hidden_act", json!("gelu")),
            "hidden_act",
        );
        assert!(e.contains("gelu"), "{e}");
        let e = refused(
            with(qwen25_05b(), "use_sliding_window", json!(true)),
            "use_sliding_window",
        );
        assert!(e.contains("true"), "{e}");
        let e = refused(with(qwen25_05b(), "num_experts", json!(8)), "num_experts");
        assert!(e.contains('8'), "{e}");
        refused(
            with(llama32_1b(), "num_local_experts", json!(8)),
            "num_local_experts",
        );
        refused(
            with(llama32_1b(), "num_experts_per_tok", json!(2)),
            "num_experts_per_tok",
        );
        let yarn = json!({"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768});
        let e = refused(
            with(qwen25_05b(), "rope_scaling", yarn),
            "rope_scaling.rope_type",
        );
        assert!(e.contains("yarn"), "{e}");
        let linear = json!({"type": "linear", "factor": 2.0});
        let e = refused(
            with(llama32_1b(), "rope_scaling", linear),
            "rope_scaling.type",
        );
        assert!(e.contains("linear"), "{e}");
        refused(
            with(llama32_1b(), "attention_bias", json!(true)),
            "attention_bias",
        );
        refused(
            with(qwen3_06b(), "attention_bias", json!(true)),
            "attention_bias",
        );
        refused(with(llama32_1b(), "mlp_bias", json!(true)), "mlp_bias");
        refused(
            with(llama32_1b(), "attention_dropout", json!(0.1)),
            "attention_dropout",
        );
        refused(
            with(
                qwen3_06b(),
                "layer_types",
                json!(["full_attention", "sliding_attention"]),
            ),
            "layer_types[1]",
        );
        refused(
            with(
                llama32_1b(),
                "quantization_config",
                json!({"quant_method": "awq"}),
            ),
            "quantization_config",
        );
        // Zero experts and no sliding window are dense models.
        read(with(qwen25_05b(), "num_experts", json!(0))).unwrap();
        read(with(qwen3_06b(), "layer_types", json!(["full_attention"]))).unwrap();
    }

    #[test]
    fn refused_not_guessed_wrong_types() {
        let e = refused(
            with(qwen25_05b(), "hidden_size", json!("896")),
            "hidden_size",
        );
        assert!(
            e.contains("the string \"896\"") && e.contains("integer"),
            "{e}"
        );
        let e = refused(with(qwen25_05b(), "rope_theta", json!("1e6")), "rope_theta");
        assert!(e.contains("a number"), "{e}");
        refused(
            with(qwen25_05b(), "num_hidden_layers", json!(2.5)),
            "num_hidden_layers",
        );
        refused(
            with(qwen25_05b(), "num_hidden_layers", json!(-1)),
            "num_hidden_layers",
        );
        refused(
            with(qwen25_05b(), "tie_word_embeddings", json!(1)),
            "tie_word_embeddings",
        );
        refused(with(qwen25_05b(), "model_type", json!(2)), "model_type");
        refused(
            with(qwen25_05b(), "rope_scaling", json!("llama3")),
            "rope_scaling",
        );
        let mut bad_factor = llama32_1b();
        bad_factor["rope_scaling"]["factor"] = json!("32");
        refused(bad_factor, "rope_scaling.factor");
        let mut missing = qwen25_05b();
        missing.as_object_mut().unwrap().remove("hidden_size");
        let e = refused(missing, "hidden_size");
        assert!(e.contains("missing"), "{e}");
        let e = read(json!([1, 2])).unwrap_err().to_string();
        assert!(
            e.contains("/models/m/config.json") && e.contains("object"),
            "{e}"
        );
    }

    #[test]
    fn refused_not_guessed_invalid_shapes_by_their_hf_names() {
        refused(
            with(qwen25_05b(), "num_key_value_heads", json!(3)),
            "num_key_value_heads",
        );
        refused(with(qwen25_05b(), "vocab_size", json!(0)), "vocab_size");
        refused(with(qwen3_06b(), "head_dim", json!(7)), "head_dim");
    }

    #[test]
    fn transformers_5_rope_parameters() {
        let mut json = llama32_1b();
        let obj = json.as_object_mut().unwrap();
        obj.remove("rope_theta");
        let scaling = obj.remove("rope_scaling").unwrap();
        let mut params = scaling.as_object().unwrap().clone();
        params.insert("rope_theta".into(), json!(500000.0));
        obj.insert("rope_parameters".into(), Value::Object(params));
        let m = read(json.clone()).unwrap().model;
        assert_eq!(m, read(llama32_1b()).unwrap().model);
        let default = json!({"rope_type": "default", "rope_theta": 1e6});
        let m = read(with(qwen3_06b(), "rope_parameters", default))
            .unwrap()
            .model;
        assert_eq!((m.rope_theta, m.rope_scaling), (1e6, None));
        refused(
            with(
                json,
                "rope_parameters",
                json!({"rope_type": "yarn", "rope_theta": 1e6}),
            ),
            "rope_parameters.rope_type",
        );
    }

    #[test]
    fn export_json_reads_back_as_the_model() {
        for source in [qwen25_05b(), llama32_1b(), qwen3_06b()] {
            let base = read(source).unwrap();
            for b in [Some(&base), None] {
                let json = export_json(&base.model, b, "bfloat16").unwrap();
                assert_eq!(json["torch_dtype"], "bfloat16");
                let back = read(json.clone()).unwrap();
                assert_eq!(back.model, base.model);
                assert_eq!(back.family, base.family);
                assert_eq!(json["architectures"][0], base.family.architecture());
            }
        }
        // The base's other fields are kept; odc's values replace the base's.
        let base = read(qwen25_05b()).unwrap();
        let wider = ModelConfig {
            vocab_size: 151_940,
            ..base.model.clone()
        };
        let json = export_json(&wider, Some(&base), "float32").unwrap();
        assert_eq!(json["vocab_size"], 151_940);
        assert_eq!(json["bos_token_id"], 151_643);
        assert_eq!(json["torch_dtype"], "float32");
        // A layout the base's family cannot hold.
        let no_bias = ModelConfig {
            qkv_bias: false,
            ..base.model.clone()
        };
        let e = export_json(&no_bias, Some(&base), "float32").unwrap_err();
        assert!(e.to_string().contains("/models/m/config.json"), "{e}");
        let both = ModelConfig {
            qk_norm: true,
            ..base.model
        };
        assert!(matches!(
            export_json(&both, None, "float32"),
            Err(Error::Config {
                field: "qkv_bias",
                ..
            })
        ));
    }
}
