//! `odc-bench hf-make` and `odc-bench hf-load`: checkpoints in Hugging Face layout shaped like the
//! models people fine-tune, and what loading one costs.
//!
//! - [`shape`]: the public configs of SmolLM2-135M, Qwen2.5-0.5B, Qwen3-0.6B and Llama-3.2-1B
//!   (PAPERS.md's table) as [`ModelConfig`]s; [`make`] writes a seeded random checkpoint of one
//!   with [`export_hf`] (bf16 or f32).
//! - [`load`]: opens a directory ([`HfCheckpoint::open`]: every header checked), then converts
//!   every unit as the shard servers of a job do — each of `servers` servers its own slice of
//!   every unit ([`HfCheckpoint::unit_specs`]), one unit at a time, dropped after — and reports
//!   the seconds of each phase, the bytes on disk, the f32 bytes produced, and the process's
//!   peak resident memory (`VmHWM`) next to its resident anonymous and file-backed memory at the
//!   end (`RssAnon`, `RssFile`, from `/proc/self/status`): the mapped file is page cache, shared
//!   and evictable, and what the conversion itself holds is one slice at a time.

use std::path::Path;
use std::time::Instant;

use anyhow::Context as _;
use odc::layout::shard_range;
use odc::model::hf::{export_hf, ExportDtype, ExportOptions, ExportSummary, HfCheckpoint};
use odc::model::{unit_count, unit_init_values, ModelConfig, RopeScaling};

/// The shapes [`shape`] knows.
pub const SHAPES: [&str; 5] = [
    "smollm2-135m",
    "qwen2.5-0.5b",
    "qwen3-0.6b",
    "llama3.2-1b",
    "qwen2.5-1.5b",
];

/// The config of a public model's shape (random weights; vocabulary and context as published).
pub fn shape(name: &str) -> anyhow::Result<ModelConfig> {
    let base = ModelConfig {
        init_std: 0.02,
        seed: 0,
        ..ModelConfig::tiny()
    };
    Ok(match name {
        "smollm2-135m" => ModelConfig {
            vocab_size: 49_152,
            d_model: 576,
            n_layers: 30,
            n_heads: 9,
            n_kv_heads: Some(3),
            d_ff: 1_536,
            max_seq_len: 8_192,
            rope_theta: 100_000.0,
            rms_eps: 1e-5,
            tie_embeddings: true,
            ..base
        },
        "qwen2.5-0.5b" => ModelConfig {
            vocab_size: 151_936,
            d_model: 896,
            n_layers: 24,
            n_heads: 14,
            n_kv_heads: Some(2),
            d_ff: 4_864,
            max_seq_len: 32_768,
            rope_theta: 1_000_000.0,
            rms_eps: 1e-6,
            qkv_bias: true,
            tie_embeddings: true,
            ..base
        },
        "qwen2.5-1.5b" => ModelConfig {
            vocab_size: 151_936,
            d_model: 1_536,
            n_layers: 28,
            n_heads: 12,
            n_kv_heads: Some(2),
            d_ff: 8_960,
            max_seq_len: 32_768,
            rope_theta: 1_000_000.0,
            rms_eps: 1e-6,
            qkv_bias: true,
            tie_embeddings: true,
            ..base
        },
        "qwen3-0.6b" => ModelConfig {
            vocab_size: 151_936,
            d_model: 1_024,
            n_layers: 28,
            n_heads: 16,
            n_kv_heads: Some(8),
            head_dim: Some(128),
            d_ff: 3_072,
            max_seq_len: 40_960,
            rope_theta: 1_000_000.0,
            rms_eps: 1e-6,
            qk_norm: true,
            tie_embeddings: true,
            ..base
        },
        "llama3.2-1b" => ModelConfig {
            vocab_size: 128_256,
            d_model: 2_048,
            n_layers: 16,
            n_heads: 32,
            n_kv_heads: Some(8),
            d_ff: 8_192,
            max_seq_len: 131_072,
            rope_theta: 500_000.0,
            rope_scaling: Some(RopeScaling {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8_192,
            }),
            rms_eps: 1e-5,
            tie_embeddings: true,
            ..base
        },
        other => anyhow::bail!("shape {other:?} is not one of {}", SHAPES.join(", ")),
    })
}

/// Writes a seeded random checkpoint of `config` to `out` (which must not exist or be empty).
pub fn make(config: &ModelConfig, dtype: ExportDtype, out: &Path) -> anyhow::Result<ExportSummary> {
    let units = (0..unit_count(config))
        .map(|u| unit_init_values(config, u))
        .collect::<odc::model::Result<Vec<_>>>()?;
    let options = ExportOptions {
        dtype,
        ..ExportOptions::default()
    };
    Ok(export_hf(out, config, &units, &options)?)
}

/// What [`load`] measured.
#[derive(Debug, Clone)]
pub struct LoadReport {
    pub parameters: usize,
    /// Bytes of the safetensors files.
    pub file_bytes: u64,
    /// Opening: config, headers, every tensor checked.
    pub open_s: f64,
    /// Converting every unit to f32 masters, shard by shard.
    pub convert_s: f64,
    /// f32 bytes the conversion produced (4 per parameter).
    pub f32_bytes: u64,
    /// The largest slice one server converted at once.
    pub largest_slice_bytes: u64,
    /// The process's peak resident memory (`VmHWM`) before opening and at the end.
    pub peak_rss_before: u64,
    pub peak_rss: u64,
    /// Resident anonymous and file-backed memory at the end (the map still open).
    pub rss_anon: u64,
    pub rss_file: u64,
}

/// A `/proc/self/status` field in bytes (0 where there is none: not Linux).
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Opens `dir` and converts it as `servers` shard servers would (see the module docs).
pub fn load(dir: &Path, servers: usize) -> anyhow::Result<LoadReport> {
    let servers = servers.max(1);
    let peak_rss_before = status_bytes("VmHWM");
    let started = Instant::now();
    let checkpoint = HfCheckpoint::open(dir).with_context(|| format!("{}", dir.display()))?;
    let open_s = started.elapsed().as_secs_f64();
    let file_bytes = checkpoint
        .files()
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
        .sum();
    let started = Instant::now();
    let (mut f32_bytes, mut largest, mut parameters) = (0u64, 0u64, 0usize);
    for unit in checkpoint.unit_specs() {
        parameters += unit.len;
        for server in 0..servers {
            let range = shard_range(unit.len, servers, server);
            let slice = unit.init.slice(range)?;
            let bytes = (slice.len() * 4) as u64;
            f32_bytes += bytes;
            largest = largest.max(bytes);
            // What a server keeps; here it is dropped, as the next server is not this process.
            std::hint::black_box(&slice);
        }
    }
    let convert_s = started.elapsed().as_secs_f64();
    let report = LoadReport {
        parameters,
        file_bytes,
        open_s,
        convert_s,
        f32_bytes,
        largest_slice_bytes: largest,
        peak_rss_before,
        peak_rss: status_bytes("VmHWM"),
        rss_anon: status_bytes("RssAnon"),
        rss_file: status_bytes("RssFile"),
    };
    drop(checkpoint);
    Ok(report)
}

/// Bytes a step moves, from the trainers' own counts ([`odc::StepStats`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Traffic {
    /// Parameters that train (all, or the adapters under LoRA) and that are frozen.
    pub trainable: usize,
    pub frozen: usize,
    /// Per step, summed over trainers (mean over the steps run).
    pub pulled: f64,
    pub pushed: f64,
    /// Micro-batches per step (mean).
    pub micro_batches: f64,
}

/// Runs `steps` SFT steps of `config` (from `init`, the base model's units, when given; with
/// LoRA when `config.lora` is set) on `samples` synthetic samples of `len` random tokens per step,
/// with `trainers` trainers and `servers` servers in this process and bf16 pulls, and reports
/// what the trainers pulled and pushed.
pub async fn traffic(
    config: &ModelConfig,
    init: Option<&[Vec<f32>]>,
    steps: u64,
    samples: usize,
    len: usize,
    (trainers, servers): (usize, usize),
) -> anyhow::Result<Traffic> {
    use odc::compute::{transformer_job_of, Objective, Placement, SampleStore};
    use odc::model::hf::peft;
    use odc::model::Sample;
    use std::sync::Arc;
    let base = peft::base_config(config);
    let base_units = match init {
        Some(units) => units
            .iter()
            .enumerate()
            .map(|(u, v)| odc::UnitSpec::with_values(odc::model::unit_name(&base, u), v.clone()))
            .collect(),
        None => odc::model::layout_units(&base)?,
    };
    let units = peft::adapted_units(config, base_units)?;
    let (trainable, frozen) = units.iter().fold((0, 0), |(t, f), u| {
        if u.trainable {
            (t + u.len, f)
        } else {
            (t, f + u.len)
        }
    });
    let vocab = config.vocab_size.min(256) as u32;
    let store: Arc<dyn SampleStore> = Arc::new(move |i: u64| {
        Ok(Sample::all_loss(
            (0..len as u64)
                .map(|t| ((i * 7919 + t * 104_729) % u64::from(vocab)) as u32)
                .collect(),
        ))
    });
    let mut job = transformer_job_of(
        config,
        units,
        store,
        Objective::CrossEntropy,
        Placement::default(),
    )?
    .trainers(trainers)
    .servers(servers)
    .pull_precision(odc::Precision::Bf16)
    .token_budget((len * samples.div_ceil(trainers)).max(len) as u64)
    .data(move |step: u64| {
        Ok((0..samples as u64)
            .map(|k| odc::SampleMeta {
                index: step * samples as u64 + k,
                tokens: len as u64,
                loss_tokens: len as u64 - 1,
            })
            .collect())
    })
    .build()?;
    let stats = job.run(steps).await?;
    job.shutdown().await;
    let n = stats.len().max(1) as f64;
    let sum = |f: &dyn Fn(&odc::TrainerStepStats) -> u64| -> f64 {
        stats
            .iter()
            .flat_map(|s| s.trainers.iter())
            .map(|t| f(t) as f64)
            .sum::<f64>()
            / n
    };
    Ok(Traffic {
        trainable,
        frozen,
        pulled: sum(&|t| t.bytes_pulled),
        pushed: sum(&|t| t.bytes_pushed),
        micro_batches: stats
            .iter()
            .map(|s| f64::from(s.micro_batches))
            .sum::<f64>()
            / n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_have_the_published_parameter_counts() {
        // Published sizes: SmolLM2-135M 134.5 M, Qwen2.5-0.5B 494.0 M, Qwen3-0.6B 596.0 M,
        // Llama-3.2-1B 1,235.8 M (tied embeddings counted once).
        let millions =
            |name: &str| odc::model::param_count(&shape(name).unwrap()).unwrap() as f64 / 1e6;
        assert!((millions("smollm2-135m") - 134.5).abs() < 0.1);
        assert!((millions("qwen2.5-0.5b") - 494.0).abs() < 0.1);
        assert!((millions("qwen3-0.6b") - 596.0).abs() < 0.1);
        assert!((millions("llama3.2-1b") - 1235.8).abs() < 0.1);
        assert!((millions("qwen2.5-1.5b") - 1543.7).abs() < 0.1);
        for name in SHAPES {
            shape(name).unwrap().validate().unwrap();
        }
        assert!(shape("gpt-5").is_err());
    }

    #[test]
    fn load_converts_every_parameter_once_per_server_split() {
        let dir = std::env::temp_dir().join(format!("odc-bench-hf-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = ModelConfig {
            vocab_size: 64,
            d_model: 16,
            n_layers: 2,
            n_heads: 2,
            d_ff: 24,
            tie_embeddings: true,
            ..ModelConfig::tiny()
        };
        make(&config, ExportDtype::Bf16, &dir).unwrap();
        let report = load(&dir, 3).unwrap();
        let params = odc::model::param_count(&config).unwrap();
        assert_eq!(report.parameters, params);
        assert_eq!(report.f32_bytes, 4 * params as u64);
        // bf16 on disk: 2 bytes per parameter plus the header.
        assert!(
            report.file_bytes > 2 * params as u64 && report.file_bytes < 2 * params as u64 + 8192
        );
        // The largest slice a server converted: 4 bytes per element of the longest shard.
        let longest = (0..odc::model::unit_count(&config))
            .map(|u| {
                let len = odc::model::unit_params(&config, u)
                    .unwrap()
                    .iter()
                    .map(|p| p.numel())
                    .sum::<usize>();
                (0..3).map(|s| shard_range(len, 3, s).len()).max().unwrap()
            })
            .max()
            .unwrap();
        assert_eq!(report.largest_slice_bytes, 4 * longest as u64);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// LoRA pushes only the adapters: on a small model, its pushed bytes per step are the
    /// adapters' share of full fine-tuning's, while both pull the whole model.
    #[test]
    fn lora_pushes_only_the_adapters() {
        let config = ModelConfig {
            vocab_size: 64,
            d_model: 32,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: Some(2),
            d_ff: 64,
            tie_embeddings: true,
            ..ModelConfig::tiny()
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let full = rt
            .block_on(traffic(&config, None, 2, 4, 16, (2, 2)))
            .unwrap();
        let adapted = ModelConfig {
            lora: Some(odc::model::LoraConfig::new(2)),
            ..config.clone()
        };
        let lora = rt
            .block_on(traffic(&adapted, None, 2, 4, 16, (2, 2)))
            .unwrap();
        assert_eq!(full.frozen, 0);
        assert_eq!(lora.frozen, full.trainable);
        // Every micro-batch pushes each trainable unit once, in f32.
        let per_mb = |t: &Traffic| t.pushed / t.micro_batches;
        assert!(
            (per_mb(&full) - 4.0 * full.trainable as f64).abs() < 1.0,
            "{full:?}"
        );
        assert!(
            (per_mb(&lora) - 4.0 * lora.trainable as f64).abs() < 1.0,
            "{lora:?}"
        );
        assert!(lora.pushed < 0.2 * full.pushed, "{lora:?} vs {full:?}");
        assert!(
            lora.pulled >= full.pulled * 0.9,
            "both pull the whole model"
        );
    }
}
