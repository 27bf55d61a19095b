//! `odc-bench checkpoint-step`: what checkpointing costs a step. One job (trainers and servers in
//! this process, the reference model or a Hugging Face shape with seeded weights, random tokens)
//! trains `--steps` steps under each of three modes: no checkpoint, a synchronous checkpoint after
//! every step (`Job::save_checkpoint`: the step waits for the servers' writes and the publication),
//! and an asynchronous one (`Job::checkpoint_async`: the servers copy their shards and the step
//! goes on while they write). Modes run in ABBA order (never, sync, async, async, sync, never);
//! printed: each mode's median step time (training plus its checkpoint call) and its ratio to no
//! checkpoint.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;
use odc::model::{transformer_job_of, Objective, Placement, Sample, SampleStore};

#[derive(Args)]
pub(crate) struct CheckpointStepArgs {
    /// A Hugging Face shape with seeded weights (smollm2-135m, qwen2.5-0.5b, …; default: odc's
    /// reference model).
    #[arg(long)]
    pub(crate) shape: Option<String>,
    /// Its layers (default: the shape's).
    #[arg(long)]
    pub(crate) layers: Option<usize>,
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(2..=1000))]
    pub(crate) steps: u64,
    /// Samples per step, each of --len tokens.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub(crate) samples: u64,
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(2..=65_536))]
    pub(crate) len: u64,
    /// Where checkpoints go (a temporary directory by default; removed at the end).
    #[arg(long)]
    pub(crate) dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Never,
    Sync,
    Async,
}

pub(crate) async fn checkpoint_step(args: CheckpointStepArgs) -> anyhow::Result<()> {
    let mut config = match &args.shape {
        Some(shape) => odc_bench::hf::shape(shape)?,
        None => odc::model::ModelConfig::tiny(),
    };
    if let Some(layers) = args.layers {
        config.n_layers = layers;
    }
    config.validate()?;
    let dir = args.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("odc-bench-checkpoint-step-{}", std::process::id()))
    });
    let params = odc::model::param_count(&config)?;
    println!(
        "odc-bench checkpoint-step: {} ({} M parameters, {} MB of fp32 state with AdamW), {} steps of {} × {} tokens, 2 trainers, 2 servers, into {}",
        args.shape.as_deref().unwrap_or("odc's reference model"),
        params / 1_000_000,
        params * 12 / 1_000_000,
        args.steps,
        args.samples,
        args.len,
        dir.display()
    );
    let mut times: Vec<(Mode, Vec<f64>)> = Vec::new();
    for mode in [
        Mode::Never,
        Mode::Sync,
        Mode::Async,
        Mode::Async,
        Mode::Sync,
        Mode::Never,
    ] {
        let run_dir = dir.join(format!("{mode:?}").to_lowercase());
        let steps = run(&config, &args, mode, &run_dir).await?;
        std::fs::remove_dir_all(&run_dir).ok();
        times.push((mode, steps));
    }
    std::fs::remove_dir_all(&dir).ok();
    let median = |mode: Mode| -> f64 {
        let mut all: Vec<f64> = times
            .iter()
            .filter(|(m, _)| *m == mode)
            .flat_map(|(_, t)| t.iter().copied())
            .collect();
        all.sort_by(f64::total_cmp);
        all[all.len() / 2]
    };
    let never = median(Mode::Never);
    println!("| checkpoint every step | median step (ms) | against none |");
    println!("|---|---|---|");
    for (mode, name) in [
        (Mode::Never, "none"),
        (Mode::Sync, "synchronous"),
        (Mode::Async, "asynchronous"),
    ] {
        let t = median(mode);
        println!("| {name} | {:.1} | {:.3} |", t * 1e3, t / never);
    }
    Ok(())
}

/// One job of `args.steps` steps under `mode`: each step's seconds (after the first, which starts
/// the actors), its checkpoint call included.
async fn run(
    config: &odc::model::ModelConfig,
    args: &CheckpointStepArgs,
    mode: Mode,
    dir: &std::path::Path,
) -> anyhow::Result<Vec<f64>> {
    let (len, samples) = (args.len, args.samples);
    let vocab = config.vocab_size.min(256) as u32;
    let store: Arc<dyn SampleStore> = Arc::new(move |i: u64| {
        Ok(Sample::all_loss(
            (0..len)
                .map(|t| ((i * 7919 + t * 104_729) % u64::from(vocab)) as u32)
                .collect(),
        ))
    });
    let units = odc::model::layout_units(config)?;
    let tensors = odc::model::tensor_map(config)?;
    let mut job = transformer_job_of(
        config,
        units,
        store,
        Objective::CrossEntropy,
        Placement::default(),
    )?
    .trainers(2)
    .servers(2)
    .token_budget((len * samples.div_ceil(2)).max(len))
    .build()?;
    let extra = serde_json::Value::Null;
    let mut out = Vec::new();
    for step in 0..args.steps {
        let batch = (0..samples)
            .map(|k| odc::SampleMeta {
                index: step * samples + k,
                tokens: len,
                loss_tokens: len - 1,
            })
            .collect();
        let t = Instant::now();
        job.step_with(batch).await?;
        match mode {
            Mode::Never => {}
            Mode::Sync => {
                job.save_checkpoint(dir, &tensors, &extra)
                    .await
                    .context("a synchronous checkpoint")?;
            }
            Mode::Async => {
                job.checkpoint_async(dir, &tensors, &extra)
                    .await
                    .context("an asynchronous checkpoint")?;
            }
        }
        if step > 0 {
            out.push(t.elapsed().as_secs_f64());
        }
    }
    job.wait_checkpoint().await.context("the last checkpoint")?;
    job.shutdown().await;
    Ok(out)
}
