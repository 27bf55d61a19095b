//! `odc-bench checkpoint-step`: what checkpointing costs a step. One job (trainers and servers in
//! this process, the reference model or a Hugging Face shape with seeded weights, random tokens)
//! trains `--steps` steps under each of three modes: no checkpoint, a synchronous checkpoint after
//! every step (`Job::save_checkpoint`: the step waits for the servers' writes and the publication),
//! and an asynchronous one (`Job::checkpoint_async`: the servers copy their shards and the step
//! goes on while they write). Modes run in ABBA order (never, sync, async, async, sync, never);
//! printed: each mode's median step time (training plus its checkpoint call) and its ratio to no
//! checkpoint, and each mode's peak resident set against the analytical extra of a checkpoint (one
//! copy of the servers' shards). Each checkpointing run ends by loading its last checkpoint and
//! comparing it, bit for bit, with the job's state read through the servers (`Job::train_state`).
//!
//! On a GPU (`--device cuda --transport cuda`, built with feature `gpu`): trainers compute in bf16
//! on the device and the servers keep their shards in device memory (the `cuda` backend), so a
//! checkpoint is a device-to-host copy of each server's shards.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;
use odc::compute::{transformer_job_of, Objective, Placement, SampleStore};
use odc::model::Sample;

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
    /// Checkpoint after every K-th step (a large model's write outlasts a step: every step would
    /// then measure the write, not what it costs the step).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub(crate) every: u64,
    /// Samples per step, each of --len tokens.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub(crate) samples: u64,
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(2..=65_536))]
    pub(crate) len: u64,
    /// Where checkpoints go (a temporary directory by default; removed at the end).
    #[arg(long)]
    pub(crate) dir: Option<PathBuf>,
    /// Where trainers compute: cpu, cuda or cuda:N (cuda needs the `gpu` feature).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// The node transport: local (servers in host memory) or cuda (servers in device memory).
    #[arg(long, default_value = "local")]
    pub(crate) transport: String,
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
        "odc-bench checkpoint-step: {} ({} M parameters, {} MB of fp32 state with AdamW), {} steps of {} × {} tokens, 2 trainers on {}, 2 servers on the {} transport, into {}",
        args.shape.as_deref().unwrap_or("odc's reference model"),
        params / 1_000_000,
        params * 12 / 1_000_000,
        args.steps,
        args.samples,
        args.len,
        args.device,
        args.transport,
        dir.display()
    );
    let mut times: Vec<(Mode, Vec<f64>)> = Vec::new();
    let mut peaks: Vec<(Mode, u64)> = Vec::new();
    for mode in [
        Mode::Never,
        Mode::Sync,
        Mode::Async,
        Mode::Async,
        Mode::Sync,
        Mode::Never,
    ] {
        let run_dir = dir.join(format!("{mode:?}").to_lowercase());
        let measured = reset_peak();
        let (steps, peak) = run(&config, &args, mode, &run_dir).await?;
        std::fs::remove_dir_all(&run_dir).ok();
        times.push((mode, steps));
        if let (true, Some(peak)) = (measured, peak) {
            peaks.push((mode, peak));
        }
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
    // With --every K > 1 most steps take no checkpoint: the mean over all steps is the cost.
    let mean = |mode: Mode| -> f64 {
        let all: Vec<f64> = times
            .iter()
            .filter(|(m, _)| *m == mode)
            .flat_map(|(_, t)| t.iter().copied())
            .collect();
        all.iter().sum::<f64>() / all.len() as f64
    };
    println!(
        "| checkpoint every {} step(s) | median step (ms) | against none | mean step (ms) | against none |",
        args.every
    );
    println!("|---|---|---|---|---|");
    for (mode, name) in [
        (Mode::Never, "none"),
        (Mode::Sync, "synchronous"),
        (Mode::Async, "asynchronous"),
    ] {
        let t = median(mode);
        println!(
            "| {name} | {:.1} | {:.3} | {:.1} | {:.3} |",
            t * 1e3,
            t / median(Mode::Never),
            mean(mode) * 1e3,
            mean(mode) / mean(Mode::Never)
        );
    }
    // Peak memory: each run's peak resident set (the larger of its two runs), against the
    // analytical extra of a checkpoint, one copy of every server's shards (parameters and AdamW's
    // two buffers, fp32).
    let peak = |mode: Mode| {
        peaks
            .iter()
            .filter(|(m, _)| *m == mode)
            .map(|(_, p)| *p)
            .max()
    };
    match peak(Mode::Never) {
        Some(never) => {
            let copy = params * 12;
            println!(
                "peak resident set (MB): none {:.0}; one copy of the shards: {:.0}",
                never as f64 / 1e6,
                copy as f64 / 1e6
            );
            for (mode, name) in [(Mode::Sync, "synchronous"), (Mode::Async, "asynchronous")] {
                if let Some(p) = peak(mode) {
                    let extra = p as f64 - never as f64;
                    println!(
                        "peak resident set (MB): {name} {:.0}, {:+.0} over none = {:.2} copies of \
                         the shards",
                        p as f64 / 1e6,
                        extra / 1e6,
                        extra / copy as f64
                    );
                }
            }
        }
        None => println!("peak resident set: not measured (no /proc/self/clear_refs here)"),
    }
    Ok(())
}

/// Resets this process's peak resident set (Linux's `/proc/self/clear_refs`); whether it could.
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// This process's peak resident set since the last [`reset_peak`], in bytes (`VmHWM`).
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// One job of `args.steps` steps under `mode`: each step's seconds (after the first, which starts
/// the actors), its checkpoint call included, and the process's peak resident set until the last
/// checkpoint was written (before the check that reads it back).
async fn run(
    config: &odc::model::ModelConfig,
    args: &CheckpointStepArgs,
    mode: Mode,
    dir: &std::path::Path,
) -> anyhow::Result<(Vec<f64>, Option<u64>)> {
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
    let (device, precision) = super::device_and_precision(&args.device, None)?;
    let placement = Placement {
        device,
        precision,
        ..Placement::default()
    };
    let world = odc::launch::World {
        transport: Some(args.transport.clone()),
        ..odc::launch::World::from_env()?
    };
    let transport = odc::launch::transport(&world).await?;
    let mut job = transformer_job_of(config, units, store, Objective::CrossEntropy, placement)?
        .transport(transport)
        .trainers(2)
        .servers(2)
        .token_budget((len * samples.div_ceil(2)).max(len))
        .build()?;
    let extra = serde_json::Value::Null;
    let mut out = Vec::new();
    // A directory left by an earlier, interrupted run would hold checkpoints of another job.
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let mut last = None;
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
            _ if (step + 1) % args.every != 0 => {}
            Mode::Never => {}
            Mode::Sync => {
                last = Some(
                    job.save_checkpoint(dir, &tensors, &extra)
                        .await
                        .context("a synchronous checkpoint")?,
                );
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
    let waited = job.wait_checkpoint().await.context("the last checkpoint")?;
    let peak = peak_rss();
    if let Some(mut last) = waited.or(last) {
        if args.steps % args.every != 0 {
            // The last steps took no checkpoint: one more (untimed) at the final state.
            last = job.save_checkpoint(dir, &tensors, &extra).await?;
        }
        let (loaded, _) = odc::checkpoint::load(&last, &tensors)?;
        let state = job.train_state().await?;
        anyhow::ensure!(
            loaded == state,
            "{mode:?}: the checkpoint {} differs from the job's state read through the servers",
            last.display()
        );
        println!(
            "{mode:?}: {} loads equal, bit for bit, to the servers' state at step {}",
            last.display(),
            state.step
        );
    }
    job.shutdown().await;
    Ok((out, peak))
}
