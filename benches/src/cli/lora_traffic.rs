//! `odc-bench lora-traffic`: bytes pulled and pushed per step with LoRA against full fine-tuning.

use std::path::PathBuf;

use anyhow::{bail, Context as _};
use clap::Args;

#[derive(Args)]
pub(crate) struct LoraTrafficArgs {
    /// A model directory (its config and weights) ...
    #[arg(long, conflicts_with = "shape")]
    pub(crate) model_dir: Option<PathBuf>,
    /// ... or a shape with seeded weights: smollm2-135m, qwen2.5-0.5b, qwen3-0.6b, llama3.2-1b,
    /// qwen2.5-1.5b.
    #[arg(long)]
    pub(crate) shape: Option<String>,
    /// LoRA's rank (all linear layers, alpha = 2 · rank).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub(crate) rank: u64,
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub(crate) steps: u64,
    /// Samples per step, each of --len random tokens.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub(crate) samples: u64,
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(2..=65_536))]
    pub(crate) len: u64,
}

pub(crate) async fn lora_traffic(args: LoraTrafficArgs) -> anyhow::Result<()> {
    let (name, config, init) = match (&args.model_dir, &args.shape) {
        (Some(dir), _) => {
            let checkpoint = odc::model::hf::HfCheckpoint::open(dir)
                .with_context(|| format!("--model-dir {}", dir.display()))?;
            (
                dir.display().to_string(),
                checkpoint.config().clone(),
                Some(checkpoint.all_unit_values()?),
            )
        }
        (None, Some(shape)) => (shape.clone(), odc_bench::hf::shape(shape)?, None),
        (None, None) => bail!("give --model-dir or --shape"),
    };
    let adapted = odc::model::ModelConfig {
        lora: Some(odc::model::LoraConfig::new(args.rank as usize)),
        ..config.clone()
    };
    let run = |c: odc::model::ModelConfig| {
        let init = init.clone();
        async move {
            odc_bench::hf::traffic(
                &c,
                init.as_deref(),
                args.steps,
                args.samples as usize,
                args.len as usize,
                (2, 2),
            )
            .await
        }
    };
    let full = run(config.clone()).await?;
    let lora = run(adapted).await?;
    let mb = |b: f64| b / 1e6;
    println!(
        "odc-bench lora-traffic: {name}, {} steps of {} samples x {} tokens, 2 trainers + 2 servers, bf16 pulls",
        args.steps, args.samples, args.len
    );
    for (what, t) in [("full", &full), ("lora", &lora)] {
        println!(
            "{what:>4}: {} trainable, {} frozen parameters; per step pulled {:.1} MB, pushed {:.1} MB ({:.1} micro-batches)",
            t.trainable,
            t.frozen,
            mb(t.pulled),
            mb(t.pushed),
            t.micro_batches
        );
    }
    println!(
        "result lora-traffic rank={} pushed_ratio={:.4} pulled_ratio={:.3} trainable_ratio={:.4}",
        args.rank,
        lora.pushed / full.pushed.max(1.0),
        lora.pulled / full.pulled.max(1.0),
        lora.trainable as f64 / full.trainable.max(1) as f64
    );
    Ok(())
}
