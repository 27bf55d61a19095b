//! The model on a CUDA device through odc (the root crate's `cuda` feature; built by
//! `benches/gpu/build.sh`, run on a GPU machine by `benches/gpu/run.sh`). Without a CUDA driver
//! each test prints `skipped: <why>` and passes, which run.sh counts as a failure.
//!
//! - **I3 on the GPU** ([`gpu_fp32_training_equals_the_cpu_reference`]): the same job (2
//!   trainers, 2 shard servers, several micro-batches per trainer, per-unit backward) with the
//!   model on CUDA in fp32 and on the CPU: per-step losses within 1e-4 relative and every
//!   parameter within 1e-4 absolute after the steps (SGD, so a last-bit difference of a gradient
//!   stays a last-bit difference of a step; cuBLAS's fp32 GEMMs run without TF32, candle's
//!   default, and sum in another order than the CPU's gemm: ~1e-6 relative per op).
//! - **Mixed precision on the GPU** ([`gpu_bf16_losses_track_the_cpu_fp32_run`]): the same job
//!   in bf16 on CUDA, losses within 3% of the CPU's fp32 ones, parameters finite.
//! - **SFT on CUDA** ([`sft_on_cuda_lowers_the_loss`]): AdamW on the arithmetic task in bf16,
//!   the loss falls below 0.6 of its start within 12 steps, every loss finite.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Instant;

use odc::model::{
    open_device, transformer_job_on, unit_count, unit_init_values, ComputePrecision, DeviceSpec,
    ModelConfig, Objective, Placement, Sample, SampleStore,
};
use odc::text::{ArithTask, ByteTokenizer};
use odc::{Job, LrSchedule, OptimizerConfig, Precision, SampleMeta, StepStats};

/// Small enough to run in seconds, wide enough for real GEMMs; samples span several
/// micro-batches.
fn config() -> ModelConfig {
    ModelConfig {
        d_model: 128,
        n_layers: 2,
        n_heads: 4,
        d_ff: 256,
        max_seq_len: 1280,
        init_std: 0.05,
        seed: 11,
        ..ModelConfig::tiny()
    }
}

const PER_STEP: usize = 8;

/// The CUDA device, or why there is none (printed as `skipped: …`).
fn cuda() -> Option<DeviceSpec> {
    match open_device(DeviceSpec::Cuda(None), 0) {
        Ok(_) => Some(DeviceSpec::Cuda(None)),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

fn samples(n: usize) -> Arc<Vec<Sample>> {
    Arc::new(
        ArithTask::train(5)
            .problems(0..10_000)
            .map(|p| odc::text::Sample::from_problem(&ByteTokenizer, &p).expect("bytes"))
            .filter(|s| s.len() <= 260)
            .take(n)
            .map(|s| Sample::from(&s))
            .collect(),
    )
}

fn metas(data: &[Sample], step: u64) -> Vec<SampleMeta> {
    (0..PER_STEP)
        .map(|k| {
            let i = (step as usize * PER_STEP + k) % data.len();
            SampleMeta {
                index: i as u64,
                tokens: data[i].tokens.len() as u64,
                loss_tokens: data[i].loss_mask.iter().skip(1).filter(|m| **m).count() as u64,
            }
        })
        .collect()
}

fn job(data: Arc<Vec<Sample>>, optimizer: OptimizerConfig, placement: Placement) -> Job {
    let store_data = data.clone();
    let store: Arc<dyn SampleStore> = Arc::new(move |i: u64| {
        store_data
            .get(i as usize)
            .cloned()
            .ok_or_else(|| format!("no sample {i}"))
    });
    transformer_job_on(&config(), None, store, Objective::CrossEntropy, placement)
        .expect("job")
        .trainers(2)
        .servers(2)
        .optimizer(optimizer)
        .lr_schedule(LrSchedule::Constant)
        .pull_precision(Precision::F32)
        .token_budget(600)
        .data(move |step: u64| Ok(metas(&data, step)))
        .build()
        .expect("build")
}

/// `steps` steps of the job on `placement`: the stats and the parameters after them.
fn train(
    data: Arc<Vec<Sample>>,
    optimizer: OptimizerConfig,
    placement: Placement,
    steps: u64,
) -> (Vec<StepStats>, Vec<Vec<f32>>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let run = async {
            let mut job = job(data, optimizer, placement);
            let stats = job.run(steps).await.expect("steps");
            let params = job.parameters().await.expect("parameters");
            job.shutdown().await;
            (stats, params)
        };
        tokio::time::timeout(std::time::Duration::from_secs(300), run)
            .await
            .expect("the run took more than 300 s")
    })
}

/// `max |a − b|` over every parameter; fails on a length mismatch or a non-finite value.
fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "unit counts differ");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "unit lengths differ");
            x.iter().zip(y).map(|(p, q)| {
                assert!(p.is_finite() && q.is_finite(), "non-finite parameter");
                (p - q).abs()
            })
        })
        .fold(0.0, f32::max)
}

fn losses(stats: &[StepStats]) -> Vec<f64> {
    stats.iter().map(|s| s.loss).collect()
}

/// I3 on the GPU: CUDA fp32 training equals the CPU reference within the stated tolerance.
#[test]
fn gpu_fp32_training_equals_the_cpu_reference() {
    let Some(device) = cuda() else { return };
    const STEPS: u64 = 4;
    let data = samples(32);
    let sgd = OptimizerConfig::sgd(0.5);
    let cpu_started = Instant::now();
    let (cpu, cpu_params) = train(data.clone(), sgd, Placement::default(), STEPS);
    let cpu_secs = cpu_started.elapsed().as_secs_f64();
    let gpu_started = Instant::now();
    let placement = Placement {
        device,
        precision: ComputePrecision::F32,
        local_rank: 0,
        ..Placement::default()
    };
    let (gpu, gpu_params) = train(data, sgd, placement, STEPS);
    let gpu_secs = gpu_started.elapsed().as_secs_f64();
    let (cpu_losses, gpu_losses) = (losses(&cpu), losses(&gpu));
    assert_eq!(cpu_losses.len(), STEPS as usize, "CPU steps");
    assert_eq!(gpu_losses.len(), cpu_losses.len(), "GPU steps");
    let mut worst_loss = 0.0f64;
    for (s, (c, g)) in cpu_losses.iter().zip(&gpu_losses).enumerate() {
        assert!(c.is_finite() && g.is_finite(), "step {s}: {c} vs {g}");
        assert!(
            gpu[s].micro_batches > 2,
            "step {s}: {} micro-batches",
            gpu[s].micro_batches
        );
        worst_loss = worst_loss.max(((g - c) / c).abs());
    }
    let initial: Vec<Vec<f32>> = (0..unit_count(&config()))
        .map(|u| unit_init_values(&config(), u).expect("init"))
        .collect();
    let moved = max_abs_diff(&cpu_params, &initial);
    let diff = max_abs_diff(&gpu_params, &cpu_params);
    println!(
        "I3 GPU vs CPU (fp32, {STEPS} SGD steps): max loss rel diff {worst_loss:.3e}, max |Δparam| \
         {diff:.3e} (training moved parameters by up to {moved:.3e}); losses CPU {cpu_losses:?} \
         GPU {gpu_losses:?}; {cpu_secs:.1} s on the CPU, {gpu_secs:.1} s on the GPU"
    );
    assert!(moved > 1e-3, "training moved nothing: {moved}");
    assert!(
        worst_loss < 1e-4,
        "losses differ by {worst_loss:e} (relative)"
    );
    assert!(diff < 1e-4, "parameters differ by {diff:e}");
}

/// bf16 mixed precision on the GPU: losses within 3% of the CPU's fp32 run, finite parameters.
#[test]
fn gpu_bf16_losses_track_the_cpu_fp32_run() {
    let Some(device) = cuda() else { return };
    const STEPS: u64 = 4;
    let data = samples(32);
    let adamw = OptimizerConfig::adamw(3e-3);
    let (cpu, _) = train(data.clone(), adamw, Placement::default(), STEPS);
    let placement = Placement {
        device,
        precision: ComputePrecision::Bf16,
        local_rank: 0,
        ..Placement::default()
    };
    let (gpu, params) = train(data, adamw, placement, STEPS);
    let (cpu_losses, gpu_losses) = (losses(&cpu), losses(&gpu));
    assert_eq!(gpu_losses.len(), cpu_losses.len(), "steps");
    let worst = cpu_losses
        .iter()
        .zip(&gpu_losses)
        .map(|(c, g)| {
            assert!(c.is_finite() && g.is_finite(), "{c} vs {g}");
            ((g - c) / c).abs()
        })
        .fold(0.0f64, f64::max);
    assert!(
        params.iter().flatten().all(|p| p.is_finite()),
        "a non-finite parameter"
    );
    println!(
        "bf16 on the GPU vs fp32 on the CPU ({STEPS} AdamW steps): max loss rel diff \
         {worst:.3e}; CPU {cpu_losses:?} GPU {gpu_losses:?}"
    );
    assert!(worst < 3e-2, "bf16 losses differ by {worst:e} (relative)");
}

/// SFT on CUDA in bf16: the loss falls, and stays finite.
#[test]
fn sft_on_cuda_lowers_the_loss() {
    let Some(device) = cuda() else { return };
    let placement = Placement {
        device,
        precision: ComputePrecision::Bf16,
        local_rank: 0,
        ..Placement::default()
    };
    let started = Instant::now();
    let (stats, params) = train(samples(96), OptimizerConfig::adamw(1e-2), placement, 12);
    let losses = losses(&stats);
    assert_eq!(losses.len(), 12, "steps");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(
        params.iter().flatten().all(|p| p.is_finite()),
        "a non-finite parameter"
    );
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    println!(
        "SFT on CUDA (bf16, 12 AdamW steps, {:.1} s): loss {first:.4} -> {last:.4}: {losses:?}",
        started.elapsed().as_secs_f64()
    );
    assert!(
        last < 0.6 * first,
        "loss went from {first} to {last}: {losses:?}"
    );
}
