//! The trained model out, as its users load it: [`export`] writes Hugging Face's layout
//! (`transformers`' `from_pretrained` and vLLM load it: HF names, `format: pt`, bf16 by default,
//! the model directory's config and tokenizer files carried over), or under LoRA PEFT's adapters
//! (`adapter_config.json`, `adapter_model.safetensors`), or with `merge_lora` the merged full
//! model. It returns what it wrote, in words; an error names `--export-hf` and the directory.

use std::path::Path;

use super::{RecipeError, Result};
use crate::model::hf::{export_hf, peft, ExportDtype, ExportOptions};
use crate::model::ModelConfig;

/// Where and how [`export`] writes.
#[derive(Debug, Clone, Copy)]
pub struct Export<'a> {
    /// The directory written.
    pub out: &'a Path,
    pub dtype: ExportDtype,
    /// The Hugging Face directory the model came from (its config and tokenizer files are
    /// carried over), if any.
    pub model_dir: Option<&'a Path>,
    /// Under LoRA: the merged full model instead of PEFT's adapters.
    pub merge_lora: bool,
}

/// `--export-dtype`: `bf16` or `f32`.
pub fn export_dtype(name: &str) -> Result<ExportDtype> {
    match name {
        "bf16" => Ok(ExportDtype::Bf16),
        "f32" => Ok(ExportDtype::F32),
        other => Err(RecipeError::Invalid(format!(
            "--export-dtype {other:?}: expected bf16 or f32"
        ))),
    }
}

/// Writes `model`'s trained `params` (one flat buffer per unit) as `how` says; what was
/// written, in words.
pub fn export(model: &ModelConfig, params: &[Vec<f32>], how: &Export<'_>) -> Result<String> {
    let context = || format!("--export-hf {}", how.out.display());
    if model.lora.is_some() && !how.merge_lora {
        let base = how
            .model_dir
            .map_or_else(|| "odc".to_string(), |d| d.display().to_string());
        peft::export_peft(how.out, model, params, &base).map_err(RecipeError::files(context()))?;
        return Ok("PEFT adapters: adapter_config.json, adapter_model.safetensors".into());
    }
    let (config, units) = match &model.lora {
        Some(_) => (peft::base_config(model), peft::merge(model, params)?),
        None => (model.clone(), params.to_vec()),
    };
    let options = ExportOptions {
        dtype: how.dtype,
        source: how.model_dir,
        ..ExportOptions::default()
    };
    let summary =
        export_hf(how.out, &config, &units, &options).map_err(RecipeError::files(context()))?;
    Ok(format!(
        "{}{} safetensors file(s), {:.1} MB of {} tensors, tokenizer files: {}",
        if model.lora.is_some() {
            "adapters merged: "
        } else {
            ""
        },
        summary.safetensors_files.len(),
        summary.tensor_bytes as f64 / 1e6,
        how.dtype,
        if summary.tokenizer_files.is_empty() {
            "none".to_string()
        } else {
            summary.tokenizer_files.join(", ")
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_dtypes_are_bf16_and_f32_and_another_names_the_flag() {
        assert_eq!(export_dtype("bf16").unwrap(), ExportDtype::Bf16);
        assert_eq!(export_dtype("f32").unwrap(), ExportDtype::F32);
        assert_eq!(ExportDtype::Bf16.to_string(), "bf16");
        let e = export_dtype("f16").unwrap_err().to_string();
        assert_eq!(e, "--export-dtype \"f16\": expected bf16 or f32");
    }
}
