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
//! - **Ring attention on CUDA** ([`ring_attention_on_cuda_equals_the_blocked_attention`]):
//!   sequence splitting's gang attention against the whole sample's, within 1e-4.
//! - **The device-resident data path** ([`device_transfers_equal_host_transfers_and_stage_nothing`]):
//!   the same fp32 job with its servers on the GPU, gathering into and pushing from device
//!   memory ([`DeviceTransfers::Device`], the default, which the tests above run too), against
//!   the path through host memory with host servers ([`DeviceTransfers::Host`]): losses and
//!   parameters within 1e-5, and 0 bytes through host staging on the device path (the host
//!   path's count is > 0, so the counter counts).
//! - **Replay on the device path** ([`a_trainer_killed_after_its_device_pushes_replays_to_the_same_result`]):
//!   a trainer dies once its compute pushed a micro-batch's gradients from device memory (added
//!   into the GPU servers' accumulators, or still on their way); the attempt is discarded (the
//!   accumulators fenced by epoch, I2) and replayed, and the run equals the clean one within
//!   1e-6.
//! - **Resume on the device path** ([`a_device_job_resumes_from_its_checkpoint_exactly`]): 2
//!   steps, a sharded checkpoint of the GPU servers' state (masters and AdamW's buffers from
//!   device memory), a new job resumed from it for the third step: the same parameters as 3
//!   steps straight, within 1e-6.
//! - **The fused kernels in the model** ([`fused_kernels_train_as_the_cpu_reference`]):
//!   `ODC_FUSED_KERNELS=1` (RMSNorm, rotary embedding, SwiGLU, the packed attention and the
//!   chunked head's log-softmax by `odc-kernels`, forward and backward),
//!   the I3 job in fp32 against the CPU: losses and parameters within 1e-4; then in bf16, where
//!   the attention is FlashAttention-2's tensor-core kernels (heads of 64), losses within 3% of
//!   the CPU's fp32 run.
//! - **The sampler's weights device to device** ([`the_samplers_weights_come_device_to_device`]):
//!   after a step, `published_weights` on the GPU reads the servers' published copies device to
//!   device (0 bytes through host staging) and scores a sequence as weights made from
//!   `Job::parameters` do (within 1e-5); a job whose servers are on the host reads them through
//!   the host (> 0 bytes, counted).
//! - **A gang's K/V device to device** ([`a_gangs_kv_moves_device_to_device`]): a step with
//!   a long sample split over both trainers (`SplitPolicy::MinTokens`) on the GPU trains as the
//!   same step unsplit (SGD, fp32, within 1e-5); on the device path the gang's messages go
//!   device to device (`CudaTransport::send_device`) and the step moves 0 bytes through host
//!   staging; the host path stages more than 0 (its units and the gang's messages, which the
//!   count does not tell apart).
//! - **On demand = collective on the device** ([`collective_equals_on_demand_on_the_device`]):
//!   the collective data path (its ring all-gathers and reduce-scatters as device messages) and
//!   the on-demand one, both in device memory, train alike (SGD), within 1e-5, and the collective
//!   moves 0 bytes through host staging.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Instant;

use odc::compute::{
    host_staging_bytes, published_weights, transformer_job_on, DeviceTransfers, Objective,
    Placement, SampleStore,
};
use odc::model::{
    open_device, sequence_log_probs, unit_count, unit_init_values, ComputePrecision, DeviceSpec,
    ModelConfig, Sample, Weights,
};
use odc::text::{ArithTask, ByteTokenizer};
use odc::{Job, LrSchedule, OptimizerConfig, Precision, SampleMeta, StepStats};

#[path = "common/gang.rs"]
mod gang;
#[path = "common/params.rs"]
mod params;
use params::{max_abs_diff, worst_loss_diff};

/// Small enough to run in seconds, wide enough for real GEMMs; samples span several
/// micro-batches. Heads of 64 (SmolLM2's width), one FlashAttention-2's tiles take in bf16.
fn config() -> ModelConfig {
    ModelConfig {
        d_model: 128,
        n_layers: 2,
        n_heads: 2,
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

/// The test job (2 trainers, 2 servers, fp32 pulls, 600-token micro-batches) on `placement`,
/// with `more` applied to its builder last (another compute, another data path).
fn job_with(
    data: Arc<Vec<Sample>>,
    optimizer: OptimizerConfig,
    placement: Placement,
    more: impl FnOnce(odc::JobBuilder) -> odc::JobBuilder,
) -> Job {
    let store_data = data.clone();
    let store: Arc<dyn SampleStore> = Arc::new(move |i: u64| {
        store_data
            .get(i as usize)
            .cloned()
            .ok_or_else(|| format!("no sample {i}"))
    });
    let builder = transformer_job_on(&config(), None, store, Objective::CrossEntropy, placement)
        .expect("job")
        .trainers(2)
        .servers(2)
        .optimizer(optimizer)
        .lr_schedule(LrSchedule::Constant)
        .pull_precision(Precision::F32)
        .token_budget(600)
        .data(move |step: u64| Ok(metas(&data, step)));
    more(builder).build().expect("build")
}

/// `steps` steps of the job on `placement`: the stats and the parameters after them.
fn train(
    data: Arc<Vec<Sample>>,
    optimizer: OptimizerConfig,
    placement: Placement,
    steps: u64,
) -> (Vec<StepStats>, Vec<Vec<f32>>) {
    train_with(data, optimizer, placement, steps, |b| b)
}

/// [`train`] with `more` applied to the job's builder.
fn train_with(
    data: Arc<Vec<Sample>>,
    optimizer: OptimizerConfig,
    placement: Placement,
    steps: u64,
    more: impl FnOnce(odc::JobBuilder) -> odc::JobBuilder,
) -> (Vec<StepStats>, Vec<Vec<f32>>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let run = async {
            let mut job = job_with(data, optimizer, placement, more);
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

fn losses(stats: &[StepStats]) -> Vec<f64> {
    stats.iter().map(|s| s.loss).collect()
}

/// `device` in fp32 (the equivalence tests' mode).
fn fp32_on(device: DeviceSpec) -> Placement {
    Placement {
        device,
        precision: ComputePrecision::F32,
        local_rank: 0,
        ..Placement::default()
    }
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
    let placement = fp32_on(device);
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

/// The device-resident data path against the one through host memory (see the module docs).
#[test]
fn device_transfers_equal_host_transfers_and_stage_nothing() {
    let Some(device) = cuda() else { return };
    const STEPS: u64 = 3;
    let data = samples(32);
    let adamw = OptimizerConfig::adamw(3e-3);
    let on = |transfers| Placement {
        transfers,
        ..fp32_on(device)
    };
    let before = host_staging_bytes();
    let (host, host_params) = train(data.clone(), adamw, on(DeviceTransfers::Host), STEPS);
    let host_staged = host_staging_bytes() - before;
    let before = host_staging_bytes();
    let (dev, dev_params) = train(data, adamw, on(DeviceTransfers::Device), STEPS);
    let dev_staged = host_staging_bytes() - before;
    let (host_losses, dev_losses) = (losses(&host), losses(&dev));
    assert_eq!(dev_losses.len(), STEPS as usize, "steps");
    let worst = worst_loss_diff(&host, &dev);
    let diff = max_abs_diff(&dev_params, &host_params);
    println!(
        "device transfers vs host transfers (fp32, {STEPS} AdamW steps): max loss rel diff \
         {worst:.3e}, max |Δparam| {diff:.3e}; host staging {dev_staged} bytes on the device \
         path, {host_staged} on the host path; losses host {host_losses:?} device {dev_losses:?}"
    );
    assert!(
        host_staged > 0,
        "the host path staged nothing: the counter does not count"
    );
    assert_eq!(
        dev_staged, 0,
        "the device path staged {dev_staged} bytes through the host"
    );
    assert!(worst < 1e-5, "losses differ by {worst:e} (relative)");
    assert!(diff < 1e-5, "parameters differ by {diff:e}");
}

/// The transformer's compute whose trainer dies once, right after its second micro-batch's
/// compute pushed its gradients (before the context waited for their acknowledgements).
struct DiesAfterPushing {
    inner: odc::compute::TransformerCompute,
    runs: Arc<std::sync::atomic::AtomicU32>,
}

#[odc::async_trait]
impl odc::Compute for DiesAfterPushing {
    async fn run(
        &mut self,
        ctx: &mut odc::TrainerContext,
        mb: &odc::MicroBatch,
    ) -> odc::Result<odc::ComputeOutput> {
        let out = self.inner.run(ctx, mb).await?;
        if self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            panic!("injected: the trainer dies after its device pushes");
        }
        Ok(out)
    }
}

/// I2 on the device path (see the module docs).
#[test]
fn a_trainer_killed_after_its_device_pushes_replays_to_the_same_result() {
    let Some(device) = cuda() else { return };
    const STEPS: u64 = 3;
    let data = samples(32);
    let adamw = OptimizerConfig::adamw(3e-3);
    let placement = fp32_on(device);
    let (clean, clean_params) = train(data.clone(), adamw, placement, STEPS);
    let store_data = data.clone();
    let store: Arc<dyn SampleStore> = Arc::new(move |i: u64| {
        store_data
            .get(i as usize)
            .cloned()
            .ok_or_else(|| format!("no sample {i}"))
    });
    let prototype =
        odc::compute::TransformerCompute::on(config(), placement, store).expect("compute");
    let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (killed, killed_params) = train_with(data, adamw, placement, STEPS, move |b| {
        b.compute(move |_trainer| {
            Box::new(DiesAfterPushing {
                inner: prototype.clone(),
                runs: runs.clone(),
            }) as Box<dyn odc::Compute>
        })
    });
    let replays: u32 = killed.iter().map(|s| s.replays).sum();
    let diff = max_abs_diff(&killed_params, &clean_params);
    let worst = worst_loss_diff(&clean, &killed);
    println!(
        "device transfers, a trainer killed after its pushes: {replays} replay(s); max loss rel \
         diff {worst:.3e}, max |Δparam| {diff:.3e} against the clean run"
    );
    assert!(replays >= 1, "nothing was replayed");
    assert!(worst < 1e-6, "losses differ by {worst:e}");
    assert!(diff < 1e-6, "parameters differ by {diff:e}");
}

/// The fused kernels in the model (see the module docs). The switch is read once per process:
/// run this test alone (`--exact`, as `benches/gpu/run.sh` does).
#[test]
fn fused_kernels_train_as_the_cpu_reference() {
    std::env::set_var("ODC_FUSED_KERNELS", "1");
    let Some(device) = cuda() else { return };
    assert!(
        odc::model::ops::fused::enabled(),
        "the switch was read before it was set"
    );
    const STEPS: u64 = 4;
    let data = samples(32);
    let sgd = OptimizerConfig::sgd(0.5);
    let (cpu, cpu_params) = train(data.clone(), sgd, Placement::default(), STEPS);
    let data_bf16 = data.clone();
    let (gpu, gpu_params) = train(data, sgd, fp32_on(device), STEPS);
    let worst = worst_loss_diff(&cpu, &gpu);
    let diff = max_abs_diff(&gpu_params, &cpu_params);
    println!(
        "fused kernels on the GPU vs CPU (fp32, {STEPS} SGD steps): max loss rel diff \
         {worst:.3e}, max |Δparam| {diff:.3e}"
    );
    assert!(worst < 1e-4, "losses differ by {worst:e}");
    assert!(diff < 1e-4, "parameters differ by {diff:e}");
    // bf16: FlashAttention-2's tensor-core forward and backward (heads of 64) with the other
    // fused kernels, against the CPU's fp32 run, as `gpu_bf16_losses_track_the_cpu_fp32_run`.
    let placement = Placement {
        device,
        precision: ComputePrecision::Bf16,
        local_rank: 0,
        ..Placement::default()
    };
    let (bf16, params) = train(data_bf16, sgd, placement, STEPS);
    let worst = worst_loss_diff(&cpu, &bf16);
    println!(
        "fused kernels in bf16 vs CPU fp32 ({STEPS} SGD steps): max loss rel diff {worst:.3e}"
    );
    assert!(
        params.iter().flatten().all(|p| p.is_finite()),
        "a non-finite parameter"
    );
    assert!(worst < 3e-2, "bf16 losses differ by {worst:e} (relative)");
}

/// Resume on the device path (see the module docs).
#[test]
fn a_device_job_resumes_from_its_checkpoint_exactly() {
    let Some(device) = cuda() else { return };
    let data = samples(32);
    let adamw = OptimizerConfig::adamw(3e-3);
    let placement = fp32_on(device);
    let (_, straight) = train(data.clone(), adamw, placement, 3);
    let dir = std::env::temp_dir().join(format!("odc-gpu-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let map = odc::model::tensor_map(&config()).expect("tensor map");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    let resumed = rt.block_on(async {
        let mut first = job_with(data.clone(), adamw, placement, |b| b);
        first.run(2).await.expect("2 steps");
        let step = first
            .save_checkpoint(&dir, &map, &serde_json::json!({}))
            .await
            .expect("checkpoint");
        first.shutdown().await;
        let opened = odc::checkpoint::open(&step, &map).expect("open");
        let mut second = job_with(data, adamw, placement, |b| b.resume_from(opened));
        let stats = second.run(1).await.expect("the third step");
        assert_eq!(stats.len(), 1);
        let params = second.parameters().await.expect("parameters");
        second.shutdown().await;
        params
    });
    let _ = std::fs::remove_dir_all(&dir);
    let diff = max_abs_diff(&resumed, &straight);
    println!(
        "device path resumed after 2 of 3 AdamW steps: max |Δparam| {diff:.3e} against 3 straight"
    );
    assert!(diff < 1e-6, "parameters differ by {diff:e}");
}

/// On demand (device path) against the collective data path, on the GPU (see the module docs).
/// SGD, as I3's test: AdamW's normalisation turns the reassociation differences of near-zero
/// gradient elements into update differences of up to its step size (measured with AdamW on an
/// H200, 2026-11-28: losses within 1.8e-8, parameters within 2.0e-5).
#[test]
fn collective_equals_on_demand_on_the_device() {
    let Some(device) = cuda() else { return };
    const STEPS: u64 = 3;
    let data = samples(32);
    let sgd = OptimizerConfig::sgd(0.5);
    let placement = fp32_on(device);
    let (on_demand, od_params) = train(data.clone(), sgd, placement, STEPS);
    let before = host_staging_bytes();
    let (collective, co_params) = train_with(data, sgd, placement, STEPS, |b| {
        b.communication(odc::Communication::Collective)
    });
    let staged = host_staging_bytes() - before;
    let worst = worst_loss_diff(&on_demand, &collective);
    let diff = max_abs_diff(&co_params, &od_params);
    println!(
        "collective vs on demand on the device (fp32, {STEPS} SGD steps): max loss rel diff \
         {worst:.3e}, max |Δparam| {diff:.3e}; the collective staged {staged} bytes"
    );
    assert!(worst < 1e-5, "losses differ by {worst:e}");
    assert!(diff < 1e-5, "parameters differ by {diff:e}");
    assert_eq!(
        staged, 0,
        "the collective staged {staged} bytes through the host"
    );
}

/// A gang's K/V on the device path (see the module docs).
#[test]
fn a_gangs_kv_moves_device_to_device() {
    let Some(device) = cuda() else { return };
    // One sample of six problems (over the split threshold) among samples cut to 40 tokens, so
    // that the step is shorter with it split.
    let problems = samples(PER_STEP);
    let mut long = problems[0].clone();
    for s in problems.iter().skip(1).take(5) {
        long.tokens.extend_from_slice(&s.tokens);
        long.loss_mask.extend_from_slice(&s.loss_mask);
    }
    assert!(
        long.tokens.len() > 1000 && long.tokens.len() <= 1280,
        "{}",
        long.tokens.len()
    );
    let mut data: Vec<Sample> = problems
        .iter()
        .map(|s| Sample {
            tokens: s.tokens[..40].to_vec(),
            loss_mask: s.loss_mask[..40].to_vec(),
        })
        .collect();
    data[0] = long;
    let data = Arc::new(data);
    let sgd = OptimizerConfig::sgd(0.5);
    for transfers in [DeviceTransfers::Device, DeviceTransfers::Host] {
        let placement = Placement {
            transfers,
            ..fp32_on(device)
        };
        // A budget that takes the long sample whole.
        let (whole, whole_params) =
            train_with(data.clone(), sgd, placement, 1, |b| b.token_budget(1280));
        let before = host_staging_bytes();
        let (split, split_params) = train_with(data.clone(), sgd, placement, 1, |b| {
            b.token_budget(1280)
                .sequence_parallel(odc::SplitPolicy::MinTokens(500))
        });
        let staged = host_staging_bytes() - before;
        let worst = worst_loss_diff(&whole, &split);
        let diff = max_abs_diff(&split_params, &whole_params);
        println!(
            "a gang on the GPU, {transfers:?} transfers: gangs {:?}, {staged} bytes through host \
             staging; split vs whole: max loss rel diff {worst:.3e}, max |Δparam| {diff:.3e}",
            split[0].gangs
        );
        assert_eq!(
            split[0].gangs,
            vec![2],
            "the long sample split over both trainers"
        );
        assert!(worst < 1e-5, "{transfers:?}: losses differ by {worst:e}");
        assert!(diff < 1e-5, "{transfers:?}: parameters differ by {diff:e}");
        match transfers {
            DeviceTransfers::Device => {
                assert_eq!(staged, 0, "the device path staged {staged} bytes")
            }
            DeviceTransfers::Host => assert!(staged > 0, "the host path staged nothing"),
        }
    }
}

/// `max |a − b| / max(1, max |b|)`.
fn rel_err(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f32 {
    let flat = |x: &candle_core::Tensor| -> Vec<f32> {
        x.to_dtype(candle_core::DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let (a, b) = (flat(a), flat(b));
    assert_eq!(a.len(), b.len());
    assert!(
        a.iter().chain(&b).all(|x| x.is_finite()),
        "a non-finite element"
    );
    let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
    a.iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Sequence splitting's ring attention on the GPU: each member of a gang of 2 and of 3 (threads
/// of this process, the in-process ring) holds its zig-zag chunks of a 3,000-token sample on the
/// device; their outputs and the gradients of q, k and v, put back in the sample's order, equal
/// the blocked attention of the whole sample on the device (fp32, GQA 8/2, the CUDA tiles, which
/// the chunks do not divide) within 1e-4.
#[test]
fn ring_attention_on_cuda_equals_the_blocked_attention() {
    use candle_core::Tensor;
    use odc::model::Blocks;
    let Some(spec) = cuda() else {
        return;
    };
    let device = open_device(spec, 0).unwrap();
    let (heads, kv, hd, t) = (8, 2, 64, 3000);
    let randn =
        |shape: (usize, usize, usize, usize)| Tensor::randn(0f32, 1f32, shape, &device).unwrap();
    let qkv = [
        randn((1, heads, t, hd)),
        randn((1, kv, t, hd)),
        randn((1, kv, t, hd)),
    ];
    let r = randn((1, heads, t, hd));
    let blocks = Blocks::for_device(&device);
    let reference = gang::whole(&qkv, &r, blocks);
    for members in [2usize, 3] {
        let started = Instant::now();
        let got = gang::split(&qkv, &r, members, candle_core::DType::F32, blocks);
        let errs: Vec<f32> = got
            .iter()
            .zip(&reference)
            .map(|(g, w)| rel_err(g, w))
            .collect();
        eprintln!(
            "ring attention on CUDA (gang of {members}, {t} tokens): out, dq, dk, dv errors \
             {errs:?} against the blocked attention; {:.1} s",
            started.elapsed().as_secs_f64()
        );
        assert!(
            errs.iter().all(|e| *e < 1e-4),
            "gang of {members}: {errs:?}"
        );
    }
}

/// The sampler's weights on the device path (see the module docs).
#[test]
fn the_samplers_weights_come_device_to_device() {
    let Some(spec) = cuda() else { return };
    let device = open_device(spec, 0).expect("device");
    let data = samples(16);
    let tokens = data[0].tokens.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    for transfers in [DeviceTransfers::Device, DeviceTransfers::Host] {
        let placement = Placement {
            transfers,
            ..fp32_on(spec)
        };
        let (staged, got, want) = rt.block_on(async {
            let mut job = job_with(data.clone(), OptimizerConfig::adamw(3e-3), placement, |b| b);
            job.run(1).await.expect("a step");
            let before = host_staging_bytes();
            let published =
                published_weights(&mut job, &config(), 0, &device, ComputePrecision::F32)
                    .await
                    .expect("published weights");
            let staged = host_staging_bytes() - before;
            let params = job.parameters().await.expect("parameters");
            job.shutdown().await;
            let host = Weights::from_units(&config(), &params, &device).expect("weights");
            let got = sequence_log_probs(&published, &tokens).expect("scored");
            let want = sequence_log_probs(&host, &tokens).expect("scored");
            (staged, got, want)
        });
        let diff = max_abs_diff(&[got], &[want]);
        println!(
            "sampler's weights, {transfers:?} transfers: {staged} bytes through host staging, \
             log-probs within {diff:.3e} of Job::parameters'"
        );
        assert!(diff < 1e-5, "{transfers:?}: log-probs differ by {diff:e}");
        match transfers {
            DeviceTransfers::Device => {
                assert_eq!(staged, 0, "the device path staged {staged} bytes")
            }
            DeviceTransfers::Host => assert!(staged > 0, "the host path staged nothing"),
        }
    }
}
