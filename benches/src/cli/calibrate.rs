//! `odc-bench calibrate`: per-unit compute time against tokens, fitted into a simulator profile.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;

use super::*;

#[derive(Args)]
pub(crate) struct CalibrateArgs {
    /// cpu, cuda or cuda:N (a GPU needs a build with the `gpu` feature).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// f32, or bf16 (mixed precision; the default on CUDA).
    #[arg(long)]
    pub(crate) precision: Option<String>,
    /// Model presets (comma-separated): tiny, gpu-100m, block-1.5b, block-7b.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "gpu-100m,block-1.5b,block-7b"
    )]
    pub(crate) models: Vec<String>,
    /// Tokens per micro-batch (one sample each), comma-separated; a size that fails (out of
    /// memory) ends that unit's ladder.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024,2048,4096,8192,16384",
        value_parser = clap::value_parser!(u64).range(2..=1_048_576))]
    pub(crate) tokens: Vec<u64>,
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub(crate) warmup: u32,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub(crate) reps: u32,
    /// Write the profile here (JSON).
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
}

pub(crate) fn calibrate(args: CalibrateArgs) -> anyhow::Result<()> {
    use odc_bench::calibrate as cal;
    let (spec, precision) = device_and_precision(&args.device, args.precision.as_deref())?;
    for name in &args.models {
        odc::model::ModelConfig::preset(name)?;
    }
    let mut tokens: Vec<usize> = args.tokens.iter().map(|&t| t as usize).collect();
    tokens.sort_unstable();
    tokens.dedup();
    let device = odc::model::open_device(spec, 0)?;
    let name = device_name(&device, spec);
    println!(
        "odc-bench calibrate: {} on {name} in {precision}; tokens {tokens:?}; warm-up {}, median \
         of {}",
        args.models.join(", "),
        args.warmup,
        args.reps
    );
    if cfg!(debug_assertions) {
        println!("! a debug build: the numbers are not evidence (use --release)");
    }
    let settings = cal::Settings {
        models: args.models.clone(),
        tokens,
        warmup: args.warmup,
        reps: args.reps,
        precision,
    };
    let profile = cal::run(&settings, &device, &name, |line| println!("{line}"))?;
    for unit in &profile.units {
        let fit = unit.fit.map_or("no fit (fewer than 3 sizes)".into(), |f| {
            format!(
                "a = {:.3}, b = {:.3}, c = {:.3} ms (rmse {:.3} ms)",
                f.a, f.b, f.c, f.rmse_ms
            )
        });
        let pack = unit.pack_check.as_ref().map_or(String::new(), |p| {
            format!(
                "; pack of 4 x {}: {:.3} ms vs predicted {:.3}",
                p.samples[0], p.ms, p.predicted_ms
            )
        });
        println!(
            "result calibrate model={} unit={} params={} points={} largest={} {fit}{pack}",
            unit.model,
            unit.unit,
            unit.params,
            unit.points.len(),
            unit.points.last().map_or(0, |p| p.tokens)
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&profile)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("profile: {}", path.display());
    }
    Ok(())
}

/// `cuda:N (name)` or `cpu`.
pub(crate) fn device_name(device: &candle_core::Device, spec: odc::model::DeviceSpec) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => {
            #[cfg(feature = "gpu")]
            if let Ok(cuda) = device.as_cuda_device() {
                if let Ok(name) = cuda.cuda_stream().context().name() {
                    return format!("cuda:{gpu_id} ({name})");
                }
            }
            format!("cuda:{gpu_id}")
        }
        _ => spec.to_string(),
    }
}
