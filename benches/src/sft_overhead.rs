//! `odc-bench sft-overhead`: what one SFT step of the reference transformer costs on odc (trainers
//! and shard servers in one process, local transport, per-unit backward, gradients pushed unit by
//! unit, AdamW at the owners) next to the same step in candle alone.
//!
//! # Method
//!
//! - **A, candle alone** — what a candle user writes without odc: one model of `Var`s, the
//!   minibatch packed greedily into micro-batches of at most `token_budget` tokens, forward and one
//!   backward per micro-batch, gradients summed across micro-batches, divided by the minibatch's
//!   loss tokens, one `candle_nn::AdamW` step. candle runs its matmuls on every core.
//! - **B, odc** — `TransformerCompute` on a [`Job`] with `trainers` trainers and `servers` shard
//!   servers, the same data, optimizer and budget; odc's balancer makes the micro-batches.
//! - Same minibatches (generated arithmetic problems, seed fixed) on both sides; interleaved ABBA
//!   over `rounds`, each block `steps` steps after one warm-up step; the ratio is B / A of the
//!   median seconds per step. Tokens/s of both are reported.
//! - **Control**: A against a second candle-alone model in the same pattern; it must read 1.00
//!   within the machine's noise. When it does not, noise and not odc decides the row.
//! - Nothing is emulated here (real compute, real transfers in memory), so no emulation floor
//!   applies; on a machine with fewer cores than trainers, B's trainers share the cores that A's
//!   matmuls use alone, which the report states.
//!
//! # On a GPU (`--device cuda`, feature `gpu`)
//!
//! - A runs the model on the CUDA device (fp32 `Var`s, matmuls in `--precision`, candle's AdamW
//!   on the device); B's trainers (in this process, each with its own stream on the same GPU)
//!   run `TransformerCompute` there. By default ([`DeviceTransfers::Device`]) B's shard servers
//!   keep master weights, AdamW state and accumulators on the same GPU (the `cuda` transport in
//!   this process, `odc-actors`' `server/device/`), and the trainers gather into and push from
//!   device memory: no byte crosses the host. With `--host-transfers` the servers keep their
//!   state in host memory and B pays a host-to-device upload per unit per micro-batch, a
//!   device-to-host gradient download per unit, and the AdamW step on the host.
//! - The data are synthetic samples of random byte tokens with lengths spread log-uniformly
//!   between `min_len` and `max_len` (the arithmetic problems are too short to occupy a GPU).
//! - Each A block ends with a device synchronisation (candle's kernels are asynchronous); B's
//!   step waits for its gradient downloads and the servers' acknowledgements anyway.
//! - **MFU** is odc's one formula ([`odc::recipe::progress::mfu`]: `6 · N · tokens/s` over the
//!   device's dense bf16 peak, 989 TFLOP/s for an H100 SXM or H200, `N` every parameter once).

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use candle_core::{Device, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use odc::compute::{transformer_job_on, DeviceTransfers, Objective, Placement, SampleStore};
use odc::model::{
    model_forward, open_device, param_count, unit_count, unit_init_values, unit_params, unit_vars,
    ComputePrecision, DeviceSpec, ModelConfig, PackedBatch, Reshard, Sample,
};
use odc::text::{ArithTask, ByteTokenizer};
use odc::{DispatchMode, Job, OptimizerConfig, Precision, SampleMeta};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::processes::median;

/// What to run.
#[derive(Debug, Clone)]
pub struct Settings {
    pub steps: u32,
    pub rounds: u32,
    /// Problems per minibatch.
    pub batch_size: usize,
    pub token_budget: u64,
    pub trainers: usize,
    pub servers: usize,
    /// How odc hands micro-batches to trainers.
    pub dispatch: DispatchMode,
    pub model: ModelConfig,
    /// Both sides' initial units (a Hugging Face checkpoint's); `None`: the seeded
    /// initialisation.
    pub init: Option<Vec<Vec<f32>>>,
    /// Where both sides compute.
    pub device: DeviceSpec,
    pub precision: ComputePrecision,
    /// What odc's trainers keep of a unit between forward and backward.
    pub reshard: Reshard,
    /// On a GPU: device to device with the servers there (the default), or through the host.
    pub transfers: DeviceTransfers,
    /// The samples: generated arithmetic problems, or synthetic ones.
    pub data: Data,
}

/// What the benchmark trains on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Data {
    /// Generated arithmetic problems (byte tokens) that fit the model.
    Arithmetic,
    /// Random byte tokens, lengths log-uniform in `min_len..=max_len` (seeded).
    Synthetic { min_len: usize, max_len: usize },
}

pub use odc::recipe::progress::H100_SXM_BF16_DENSE;

/// Model FLOPs of one training step (forward and backward) over samples of these lengths:
/// `6 · N · tokens` (odc's one MFU formula, [`odc::recipe::progress::mfu`]).
pub fn model_flops(config: &ModelConfig, sample_tokens: &[usize]) -> anyhow::Result<f64> {
    let tokens: usize = sample_tokens.iter().sum();
    Ok(odc::recipe::progress::mfu(
        param_count(config)? as u64,
        tokens as f64,
        1.0,
    ))
}

/// What the benchmark measured: seconds per step of each block, per side.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub candle: Vec<f64>,
    pub odc: Vec<f64>,
    pub control_a: Vec<f64>,
    pub control_b: Vec<f64>,
    /// Tokens per minibatch (mean over the measured steps).
    pub tokens_per_step: f64,
    /// The last step's loss on each side (same model, same data; A is further along, as it also
    /// runs the control blocks).
    pub candle_loss: f64,
    pub odc_loss: f64,
    /// Micro-batches per step (mean over the measured steps) of each side.
    pub candle_micro_batches: f64,
    pub odc_micro_batches: f64,
    /// Model FLOPs per step ([`model_flops`], mean over the measured minibatches).
    pub flops_per_step: f64,
}

impl Outcome {
    /// odc / candle, medians of seconds per step.
    pub fn ratio(&self) -> f64 {
        median(&mut self.odc.clone()) / median(&mut self.candle.clone())
    }

    /// Second candle model / first candle model: must read 1.00.
    pub fn control_ratio(&self) -> f64 {
        median(&mut self.control_b.clone()) / median(&mut self.control_a.clone())
    }

    /// Tokens per second of candle alone and of odc.
    pub fn tokens_per_s(&self) -> (f64, f64) {
        (
            self.tokens_per_step / median(&mut self.candle.clone()),
            self.tokens_per_step / median(&mut self.odc.clone()),
        )
    }

    /// MFU of candle alone and of odc against `peak` FLOP/s (medians of seconds per step).
    pub fn mfu(&self, peak: f64) -> (f64, f64) {
        (
            self.flops_per_step / median(&mut self.candle.clone()) / peak,
            self.flops_per_step / median(&mut self.odc.clone()) / peak,
        )
    }
}

/// `n` synthetic samples (see [`Data::Synthetic`]), seeded.
fn synthetic(config: &ModelConfig, n: usize, min_len: usize, max_len: usize) -> Vec<Sample> {
    let mut rng = StdRng::seed_from_u64(7);
    let (lo, hi) = ((min_len.max(2) as f64).ln(), (max_len.max(2) as f64).ln());
    let vocab = config.vocab_size.min(256) as u32;
    (0..n)
        .map(|_| {
            let len = rng.random_range(lo..=hi).exp().round() as usize;
            let tokens = (0..len.clamp(2, max_len.max(2)))
                .map(|_| rng.random_range(0..vocab))
                .collect();
            Sample::all_loss(tokens)
        })
        .collect()
}

/// Problems of at most `max_len` tokens: the benchmark's dataset, indexed from 0.
fn dataset(max_len: usize, n: usize) -> anyhow::Result<Vec<Sample>> {
    let mut out = Vec::with_capacity(n);
    for p in ArithTask::train(7).problems(0..(n as u64) * 4) {
        let s = odc::text::Sample::from_problem(&ByteTokenizer, &p)?;
        if s.len() <= max_len {
            out.push(Sample::from(&s));
        }
        if out.len() == n {
            break;
        }
    }
    Ok(out)
}

fn loss_tokens(s: &Sample) -> u64 {
    s.loss_mask.iter().skip(1).filter(|m| **m).count() as u64
}

/// Minibatch `step`: `batch` consecutive samples of `data` (cycled).
fn minibatch(data: &[Sample], step: u64, batch: usize) -> Vec<SampleMeta> {
    (0..batch)
        .map(|k| {
            let i = (step as usize * batch + k) % data.len();
            SampleMeta {
                index: i as u64,
                tokens: data[i].tokens.len() as u64,
                loss_tokens: loss_tokens(&data[i]),
            }
        })
        .collect()
}

fn adamw() -> (OptimizerConfig, ParamsAdamW) {
    let (lr, beta1, beta2, eps, weight_decay) = (1e-3, 0.9, 0.95, 1e-8, 0.01);
    (
        OptimizerConfig::AdamW {
            lr: lr as f32,
            beta1: beta1 as f32,
            beta2: beta2 as f32,
            eps: eps as f32,
            weight_decay: weight_decay as f32,
        },
        ParamsAdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        },
    )
}

/// Side A: the model in candle alone.
struct CandleAlone {
    config: ModelConfig,
    vars: Vec<Vec<Var>>,
    optimizer: AdamW,
    budget: usize,
    device: Device,
    precision: ComputePrecision,
}

impl CandleAlone {
    fn new(
        config: &ModelConfig,
        init: Option<&[Vec<f32>]>,
        budget: u64,
        device: &Device,
        precision: ComputePrecision,
    ) -> anyhow::Result<Self> {
        let vars = (0..unit_count(config))
            .map(|u| {
                let specs = unit_params(config, u)?;
                match init {
                    Some(units) => unit_vars(&units[u], &specs, device),
                    None => unit_vars(&unit_init_values(config, u)?, &specs, device),
                }
            })
            .collect::<odc::model::Result<Vec<_>>>()?;
        let optimizer = AdamW::new(vars.iter().flatten().cloned().collect(), adamw().1)?;
        Ok(CandleAlone {
            config: config.clone(),
            vars,
            optimizer,
            budget: budget as usize,
            device: device.clone(),
            precision,
        })
    }

    /// One step on `samples`; returns the token-mean loss and the micro-batches it ran.
    fn step(&mut self, samples: &[&Sample]) -> anyhow::Result<(f64, usize)> {
        // Greedy packing into micro-batches of at most `budget` tokens.
        let mut packs: Vec<Vec<Sample>> = vec![Vec::new()];
        let mut used = 0;
        for s in samples {
            if used + s.tokens.len() > self.budget && used > 0 {
                packs.push(Vec::new());
                used = 0;
            }
            used += s.tokens.len();
            packs.last_mut().expect("one pack").push((*s).clone());
        }
        let params = self
            .vars
            .iter()
            .map(|v| self.precision.unit_inputs(v))
            .collect::<odc::model::Result<Vec<_>>>()?;
        let mut grads: Option<candle_core::backprop::GradStore> = None;
        let (mut loss_sum, mut tokens) = (0.0, 0usize);
        for pack in &packs {
            let batch = PackedBatch::pack(&self.config, pack, &self.device)?;
            let out = model_forward(&self.config, &params, &batch)?;
            loss_sum += out.loss_sum.to_scalar::<f32>()? as f64;
            tokens += batch.loss_tokens;
            let g = out.loss_sum.backward()?;
            match &mut grads {
                None => grads = Some(g),
                Some(acc) => {
                    for var in self.vars.iter().flatten() {
                        if let Some(new) = g.get(var.as_tensor()) {
                            let sum = match acc.get(var.as_tensor()) {
                                Some(old) => (old + new)?,
                                None => new.clone(),
                            };
                            acc.insert(var.as_tensor(), sum);
                        }
                    }
                }
            }
        }
        let mut grads = grads.context("an empty minibatch")?;
        let scale = 1.0 / tokens.max(1) as f64;
        for var in self.vars.iter().flatten() {
            if let Some(g) = grads.get(var.as_tensor()) {
                let scaled = (g * scale)?;
                grads.insert(var.as_tensor(), scaled);
            }
        }
        self.optimizer.step(&grads)?;
        // The step is done when the device is (candle's CUDA kernels are asynchronous).
        self.device.synchronize()?;
        Ok((loss_sum / tokens.max(1) as f64, packs.len()))
    }
}

/// Side B: the same model on odc.
fn odc_job(settings: &Settings, data: Arc<Vec<Sample>>) -> anyhow::Result<Job> {
    let config = settings.model.clone();
    let store_data = data.clone();
    let store: Arc<dyn SampleStore> = Arc::new(move |i: u64| {
        store_data
            .get(i as usize)
            .cloned()
            .ok_or_else(|| format!("no sample {i}"))
    });
    let batch = settings.batch_size;
    let steps = u64::from(settings.steps.max(1));
    let placement = Placement {
        device: settings.device,
        precision: settings.precision,
        local_rank: 0,
        reshard: settings.reshard,
        implementations: Default::default(),
        transfers: settings.transfers,
    };
    Ok(transformer_job_on(
        &config,
        settings.init.clone(),
        store,
        Objective::CrossEntropy,
        placement,
    )?
    .trainers(settings.trainers)
    .servers(settings.servers)
    .optimizer(adamw().0)
    .pull_precision(Precision::F32)
    .token_budget(settings.token_budget)
    .dispatch(settings.dispatch)
    // Every block trains the same `steps` minibatches, on both sides.
    .data(move |step: u64| Ok(minibatch(&data, step % steps, batch)))
    .build()?)
}

/// Runs the benchmark; `progress` gets one line per block.
pub async fn run(settings: &Settings, mut progress: impl FnMut(&str)) -> anyhow::Result<Outcome> {
    let data = Arc::new(match settings.data {
        Data::Arithmetic => dataset(settings.model.max_seq_len, 512)?,
        Data::Synthetic { min_len, max_len } => synthetic(&settings.model, 512, min_len, max_len),
    });
    let device = open_device(settings.device, 0)?;
    let (budget, precision) = (settings.token_budget, settings.precision);
    let init = settings.init.as_deref();
    let mut a = CandleAlone::new(&settings.model, init, budget, &device, precision)?;
    let mut control = CandleAlone::new(&settings.model, init, budget, &device, precision)?;
    let steps = u64::from(settings.steps.max(1));
    let mut flops = 0.0;
    for step in 0..steps {
        let lens: Vec<usize> = minibatch(&data, step, settings.batch_size)
            .iter()
            .map(|m| m.tokens as usize)
            .collect();
        flops += model_flops(&settings.model, &lens)?;
    }
    let mut job = odc_job(settings, data.clone())?;
    let (mut a_step, mut c_step) = (0u64, 0u64);
    let batch = settings.batch_size;
    let mut out = Outcome {
        candle: Vec::new(),
        odc: Vec::new(),
        control_a: Vec::new(),
        control_b: Vec::new(),
        tokens_per_step: 0.0,
        candle_loss: f64::NAN,
        odc_loss: f64::NAN,
        candle_micro_batches: 0.0,
        odc_micro_batches: 0.0,
        flops_per_step: flops / steps as f64,
    };
    let (mut tokens, mut counted) = (0u64, 0u64);
    let (mut odc_mbs, mut candle_mbs, mut candle_steps) = (0u64, 0u64, 0u64);

    // One block of `steps` steps of a candle model; seconds per step, the last loss and the
    // micro-batches run.
    let candle_block =
        |model: &mut CandleAlone, next: &mut u64, n: u32| -> anyhow::Result<(f64, f64, usize)> {
            let t = Instant::now();
            let (mut loss, mut mbs) = (f64::NAN, 0);
            for _ in 0..n {
                let metas = minibatch(&data, *next % u64::from(n), batch);
                let samples: Vec<&Sample> = metas.iter().map(|m| &data[m.index as usize]).collect();
                let (l, m) = model.step(&samples)?;
                (loss, mbs) = (l, mbs + m);
                *next += 1;
            }
            Ok((t.elapsed().as_secs_f64() / n as f64, loss, mbs))
        };
    // Warm-up: one block of each (allocations, caches, the odc job's actors).
    candle_block(&mut a, &mut a_step, settings.steps)?;
    candle_block(&mut control, &mut c_step, settings.steps)?;
    for _ in 0..settings.steps {
        job.step().await?;
    }

    for round in 0..settings.rounds {
        for side in ["A", "B", "B", "A"] {
            match side {
                "A" => {
                    let (secs, loss, mbs) = candle_block(&mut a, &mut a_step, settings.steps)?;
                    out.candle.push(secs);
                    out.candle_loss = loss;
                    candle_mbs += mbs as u64;
                    candle_steps += u64::from(settings.steps);
                }
                _ => {
                    let t = Instant::now();
                    for _ in 0..settings.steps {
                        let s = job.step().await?;
                        out.odc_loss = s.loss;
                        tokens += s.tokens;
                        odc_mbs += u64::from(s.micro_batches);
                        counted += 1;
                    }
                    out.odc
                        .push(t.elapsed().as_secs_f64() / settings.steps as f64);
                }
            }
            progress(&format!(
                "round {round} {side}: {:.1} ms/step",
                1e3 * if side == "A" {
                    out.candle[out.candle.len() - 1]
                } else {
                    out.odc[out.odc.len() - 1]
                }
            ));
        }
        for side in ["A", "C", "C", "A"] {
            let (secs, _, _) = if side == "A" {
                candle_block(&mut a, &mut a_step, settings.steps)?
            } else {
                candle_block(&mut control, &mut c_step, settings.steps)?
            };
            if side == "A" {
                out.control_a.push(secs);
            } else {
                out.control_b.push(secs);
            }
        }
        progress(&format!("round {round}: control done"));
    }
    out.tokens_per_step = tokens as f64 / counted.max(1) as f64;
    out.odc_micro_batches = odc_mbs as f64 / counted.max(1) as f64;
    out.candle_micro_batches = candle_mbs as f64 / candle_steps.max(1) as f64;
    job.shutdown().await;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_flops_are_six_flops_per_parameter_and_token() {
        let c = ModelConfig::tiny();
        let one = model_flops(&c, &[100]).unwrap();
        assert_eq!(one, 6.0 * 919_424.0 * 100.0); // the tiny model's 919,424 parameters
        let two = model_flops(&c, &[100, 300]).unwrap();
        assert_eq!(two, one + model_flops(&c, &[300]).unwrap());
        assert_eq!(model_flops(&c, &[]).unwrap(), 0.0);
    }

    #[test]
    fn synthetic_samples_are_seeded_and_within_their_lengths() {
        let c = ModelConfig::gpu_100m();
        let a = synthetic(&c, 64, 128, 2048);
        assert_eq!(a, synthetic(&c, 64, 128, 2048));
        assert_eq!(a.len(), 64);
        assert!(a
            .iter()
            .all(|s| (128..=2048).contains(&s.tokens.len()) && s.tokens.iter().all(|t| *t < 256)));
        let lens: Vec<usize> = a.iter().map(|s| s.tokens.len()).collect();
        assert!(
            lens.iter().max() > lens.iter().min(),
            "lengths vary: {lens:?}"
        );
    }
}
