//! `odc-bench sft-overhead`: an SFT step on odc against the same step in candle alone, ABBA with a
//! control.

use std::path::PathBuf;

use anyhow::{bail, Context as _};
use clap::Args;

use super::*;

#[derive(Args)]
pub(crate) struct SftOverheadArgs {
    /// Steps per block (after one warm-up block per side).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1_000))]
    pub(crate) steps: u32,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub(crate) rounds: u32,
    /// Problems per minibatch.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4_096))]
    pub(crate) batch_size: u32,
    /// Most tokens per micro-batch.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(512..=1_048_576))]
    pub(crate) token_budget: u64,
    /// odc's trainers (default 2 on the CPU, 1 on CUDA: one per GPU).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) trainers: Option<u32>,
    /// odc's shard servers (default as --trainers).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) servers: Option<u32>,
    /// odc's dispatch: `dynamic` (micro-batches of decreasing size, stealing) or `static`.
    #[arg(long, value_enum, default_value = "dynamic")]
    pub(crate) dispatch: Dispatch,
    /// Where both sides compute: cpu, cuda or cuda:N (a GPU needs a build with the `gpu`
    /// feature). On a GPU the data are synthetic samples of --min-len..=--max-len tokens.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// f32, or bf16 (mixed precision; the default on CUDA).
    #[arg(long)]
    pub(crate) precision: Option<String>,
    /// The model preset (default: tiny on the CPU, gpu-100m on CUDA).
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Shortest synthetic sample (GPU runs).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(2..=65_536))]
    pub(crate) min_len: u64,
    /// Longest synthetic sample (GPU runs): keep the attention scores within the device's
    /// memory (see ModelConfig::gpu_100m).
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u64).range(2..=65_536))]
    pub(crate) max_len: u64,
    /// The device's dense bf16 peak in TFLOP/s, MFU's denominator (H100 SXM: 989).
    #[arg(long, default_value_t = 989.0)]
    pub(crate) peak_tflops: f64,
    /// A Hugging Face model directory (`hf-make` writes one): its config and weights on both
    /// sides instead of a preset, trained on synthetic samples of --min-len..=--max-len tokens.
    #[arg(long, conflicts_with = "model")]
    pub(crate) model_dir: Option<PathBuf>,
    /// odc's trainers: what they keep of a unit between forward and backward (true, false, N
    /// last stages, auto). Candle alone keeps everything.
    #[arg(long, default_value = "auto")]
    pub(crate) reshard_after_forward: odc::model::Reshard,
    /// On CUDA, odc's trainers move units and gradients through host memory, with the servers
    /// in host memory (the path before the device-resident one), instead of device to device
    /// with the servers on the GPU.
    #[arg(long)]
    pub(crate) host_transfers: bool,
}

pub(crate) async fn sft_overhead(args: SftOverheadArgs) -> anyhow::Result<()> {
    use odc_bench::sft_overhead as so;
    let (device, precision) = device_and_precision(&args.device, args.precision.as_deref())?;
    let (model_name, model, init) = match &args.model_dir {
        Some(dir) => {
            let checkpoint = odc::model::hf::HfCheckpoint::open(dir)
                .with_context(|| format!("--model-dir {}", dir.display()))?;
            let config = checkpoint.config().clone();
            (
                dir.display().to_string(),
                config,
                Some(checkpoint.all_unit_values()?),
            )
        }
        None => {
            let name = args
                .model
                .clone()
                .unwrap_or_else(|| if device.is_cuda() { "gpu-100m" } else { "tiny" }.into());
            let model = odc::model::ModelConfig::preset(&name)?;
            (name, model, None)
        }
    };
    if !(args.peak_tflops.is_finite() && args.peak_tflops > 0.0) {
        bail!("--peak-tflops must be positive, got {}", args.peak_tflops);
    }
    if args.min_len > args.max_len || args.max_len as usize > model.max_seq_len {
        bail!(
            "--min-len {} .. --max-len {} must be ordered and within the model's max_seq_len {}",
            args.min_len,
            args.max_len,
            model.max_seq_len
        );
    }
    let settings = so::Settings {
        steps: args.steps,
        rounds: args.rounds,
        batch_size: args.batch_size as usize,
        token_budget: args.token_budget,
        trainers: args
            .trainers
            .unwrap_or(if device.is_cuda() { 1 } else { 2 }) as usize,
        servers: args.servers.unwrap_or(if device.is_cuda() { 1 } else { 2 }) as usize,
        dispatch: args.dispatch.into(),
        model,
        init,
        device,
        precision,
        reshard: args.reshard_after_forward,
        transfers: if args.host_transfers {
            odc::compute::DeviceTransfers::Host
        } else {
            odc::compute::DeviceTransfers::Device
        },
        data: if device.is_cuda() || args.model_dir.is_some() {
            so::Data::Synthetic {
                min_len: args.min_len as usize,
                max_len: args.max_len as usize,
            }
        } else {
            so::Data::Arithmetic
        },
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "odc-bench sft-overhead: {model_name} transformer ({} parameters) on {device} in \
         {precision}, {} samples per step ({:?}), budget {} tokens; odc: {} trainers + {} \
         servers, transfers {:?}; ABBA x {} rounds of {} steps; {cores} cores",
        odc::model::param_count(&settings.model)?,
        settings.batch_size,
        settings.data,
        settings.token_budget,
        settings.trainers,
        settings.servers,
        settings.transfers,
        settings.rounds,
        settings.steps
    );
    if cfg!(debug_assertions) {
        println!("! a debug build: the numbers are not evidence (use --release)");
    }
    if settings.trainers > cores && !device.is_cuda() {
        println!(
            "! {} trainers share {cores} cores with candle's own threads: contention, not odc, can \
             decide the ratio",
            settings.trainers
        );
    }
    let outcome = so::run(&settings, |line| println!("{line}")).await?;
    let (candle_tps, odc_tps) = outcome.tokens_per_s();
    let ratio = outcome.ratio();
    // On a GPU the target is 1.15 (two trainers sharing one GPU); on the CPU 1.10.
    let target = if device.is_cuda() { 1.15 } else { 1.10 };
    println!(
        "candle alone {candle_tps:.0} tokens/s, odc {odc_tps:.0} tokens/s ({:.0} tokens/step): \
         ratio {ratio:.3} (odc / candle time per step), control {:.3}; micro-batches per step \
         candle {:.1}, odc {:.1}; last losses candle {:.4}, odc {:.4}; target <= {target:.2}: {}",
        outcome.tokens_per_step,
        outcome.control_ratio(),
        outcome.candle_micro_batches,
        outcome.odc_micro_batches,
        outcome.candle_loss,
        outcome.odc_loss,
        if ratio <= target { "met" } else { "MISSED" }
    );
    let (candle_mfu, odc_mfu) = outcome.mfu(args.peak_tflops * 1e12);
    // One line for scripts (benches/gpu/run.sh).
    println!(
        "result sft-overhead device={device} precision={precision} model={model_name} \
         ratio={ratio:.3} control={:.3} candle_tokens_per_s={candle_tps:.0} \
         odc_tokens_per_s={odc_tps:.0} candle_mfu={candle_mfu:.3} odc_mfu={odc_mfu:.3} \
         peak_tflops={} flops_per_step={:.3e} target={target:.2} verdict={}",
        outcome.control_ratio(),
        args.peak_tflops,
        outcome.flops_per_step,
        if ratio <= target { "met" } else { "MISSED" }
    );
    Ok(())
}
