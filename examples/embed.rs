//! The smallest complete custom trainer: a two-layer MLP classifier written directly against odc's
//! trainer API (no framework), on sequences the example generates itself, with 4 trainers and 2
//! shard servers in one process. Prints the loss per step and serves Prometheus metrics.
//!
//! ```text
//! cargo run --release --example embed -- --steps 30 --metrics-addr 127.0.0.1:9464
//! curl -s 127.0.0.1:9464/metrics | grep odc_    # while it runs (or with --hold-secs)
//! ```

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use odc::{
    async_trait, Compute, ComputeOutput, DispatchMode, Job, MicroBatch, OptimizerConfig,
    SampleMeta, TrainerContext, UnitSpec,
};

/// Input features per token, hidden width, classes.
const D: usize = 16;
const H: usize = 64;
const C: usize = 4;
/// Units: 0 = hidden layer (W1: H×D, b1: H), 1 = output layer (W2: C×H, b2: C).
const HIDDEN: usize = 0;
const OUTPUT: usize = 1;

#[derive(Parser)]
#[command(about = "odc: a two-layer MLP trained with on-demand sharded parameters")]
struct Args {
    #[arg(long, default_value_t = 30)]
    steps: u64,
    #[arg(long, default_value_t = 4)]
    trainers: usize,
    #[arg(long, default_value_t = 2)]
    servers: usize,
    /// Samples per minibatch.
    #[arg(long, default_value_t = 64)]
    minibatch: usize,
    /// Token budget of one micro-batch.
    #[arg(long, default_value_t = 1024)]
    token_budget: u64,
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_addr: SocketAddr,
    /// Do not serve metrics.
    #[arg(long)]
    no_metrics: bool,
    /// Keep serving metrics this long after training.
    #[arg(long, default_value_t = 0)]
    hold_secs: u64,
    #[arg(long, value_enum, default_value = "dynamic")]
    dispatch: Dispatch,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Dispatch {
    Static,
    Dynamic,
}

/// A deterministic hash to [0, 1): the generated data set needs no storage.
fn unit_hash(key: u64) -> f32 {
    let mut z = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^= z >> 29;
    (z >> 40) as f32 / (1u64 << 24) as f32
}

/// Token `pos` of sample `index`: features and class. The class is which of C fixed directions the
/// features are closest to, so the task is learnable.
fn token(index: u64, pos: u64) -> ([f32; D], usize) {
    let mut x = [0f32; D];
    for (k, v) in x.iter_mut().enumerate() {
        *v = unit_hash(index * 1_000_003 + pos * 131 + k as u64) * 2.0 - 1.0;
    }
    let score = |c: usize| -> f32 {
        (0..D)
            .map(|k| x[k] * ((k * (c + 1)) % 5) as f32 - 2.0 * x[k] * (c == k % C) as u8 as f32)
            .sum()
    };
    let class = (0..C)
        .max_by(|&a, &b| score(a).total_cmp(&score(b)))
        .unwrap_or(0);
    (x, class)
}

/// Sequence lengths vary wildly (8..512 tokens, heavy tail), as in post-training data.
fn minibatch(seed: u64, step: u64, size: usize) -> Vec<SampleMeta> {
    (0..size as u64)
        .map(|i| {
            let index = seed * 1_000_000 + step * size as u64 + i;
            let r = unit_hash(index ^ 0x5EED);
            SampleMeta::new(index, 8 + (r.powi(3) * 504.0) as u64)
        })
        .collect()
}

/// One micro-batch of the MLP: forward through both layers, softmax cross-entropy summed over
/// tokens, backward, pushing each layer's gradient as soon as it is computed.
struct Mlp;

#[async_trait]
impl Compute for Mlp {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        mb: &MicroBatch,
    ) -> odc::Result<ComputeOutput> {
        let tokens: Vec<([f32; D], usize)> = mb
            .samples
            .iter()
            .flat_map(|s| (0..s.tokens).map(move |p| token(s.index, p)))
            .collect();
        // Forward, hidden layer (the output layer is prefetched meanwhile).
        let w1 = ctx.gather(HIDDEN as u32).await?;
        let hidden: Vec<Vec<f32>> = tokens
            .iter()
            .map(|(x, _)| {
                (0..H)
                    .map(|j| {
                        let row = &w1[j * D..(j + 1) * D];
                        (w1[H * D + j] + row.iter().zip(x).map(|(w, x)| w * x).sum::<f32>())
                            .max(0.0)
                    })
                    .collect()
            })
            .collect();
        let w2 = ctx.gather(OUTPUT as u32).await?;
        ctx.backward();
        // Output layer forward + backward.
        let mut loss = 0f64;
        let mut g2 = vec![0f32; C * H + C];
        let mut dhidden = vec![[0f32; H]; tokens.len()];
        for (t, ((_, class), h)) in tokens.iter().zip(&hidden).enumerate() {
            let logits: Vec<f32> = (0..C)
                .map(|c| w2[C * H + c] + (0..H).map(|j| w2[c * H + j] * h[j]).sum::<f32>())
                .collect();
            let max = logits.iter().copied().fold(f32::MIN, f32::max);
            let exp: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
            let z: f32 = exp.iter().sum();
            loss += (z.ln() + max - logits[*class]) as f64;
            for c in 0..C {
                let d = exp[c] / z - (c == *class) as u8 as f32;
                for j in 0..H {
                    g2[c * H + j] += d * h[j];
                    dhidden[t][j] += d * w2[c * H + j];
                }
                g2[C * H + c] += d;
            }
        }
        ctx.push_grad(OUTPUT as u32, &g2)?;
        ctx.release(OUTPUT as u32)?;
        // Hidden layer backward (ReLU).
        let mut g1 = vec![0f32; H * D + H];
        for (((x, _), h), dh) in tokens.iter().zip(&hidden).zip(&dhidden) {
            for j in 0..H {
                if h[j] > 0.0 {
                    for k in 0..D {
                        g1[j * D + k] += dh[j] * x[k];
                    }
                    g1[H * D + j] += dh[j];
                }
            }
        }
        ctx.push_grad(HIDDEN as u32, &g1)?;
        ctx.release(HIDDEN as u32)?;
        Ok(ComputeOutput { loss_sum: loss })
    }
}

/// He-style initial values, generated.
fn init(seed: u64, len: usize, fan_in: usize) -> Vec<f32> {
    let s = (2.0 / fan_in as f32).sqrt();
    (0..len)
        .map(|i| (unit_hash(seed * 7_777_777 + i as u64) * 2.0 - 1.0) * s)
        .collect()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !args.no_metrics {
        odc::metrics::serve(args.metrics_addr)?;
        println!("metrics: http://{}/metrics", args.metrics_addr);
    }
    let seed = args.seed;
    let size = args.minibatch;
    let mut job = Job::builder()
        .unit(UnitSpec::with_values("hidden", init(1, H * D + H, D)))
        .unit(UnitSpec::with_values("output", init(2, C * H + C, H)))
        .trainers(args.trainers)
        .servers(args.servers)
        .optimizer(OptimizerConfig::adamw(3e-3))
        .token_budget(args.token_budget)
        .dispatch(match args.dispatch {
            Dispatch::Static => DispatchMode::Static,
            Dispatch::Dynamic => DispatchMode::Dynamic,
        })
        .compute(|_trainer| Box::new(Mlp) as Box<dyn Compute>)
        .data(move |step| Ok(minibatch(seed, step, size)))
        .build()
        .context("building the job")?;
    let started = Instant::now();
    let mut tokens = 0;
    for _ in 0..args.steps {
        let s = job.step().await?;
        tokens += s.tokens;
        let busy: f64 = s.trainers.iter().map(|t| t.busy.as_secs_f64()).sum();
        let utilization = busy / (s.trainers.len() as f64 * s.wall.as_secs_f64());
        println!(
            "step {:3}  loss {:.4}  tokens {:6}  micro-batches {:3}  wall {:6.1} ms  utilization {:.2}",
            s.step,
            s.loss,
            s.tokens,
            s.micro_batches,
            s.wall.as_secs_f64() * 1e3,
            utilization
        );
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{} steps in {:.2} s: {:.2} steps/s, {:.0} tokens/s",
        args.steps,
        secs,
        args.steps as f64 / secs,
        tokens as f64 / secs
    );
    job.shutdown().await;
    if !args.no_metrics && args.hold_secs > 0 {
        println!("serving metrics for {} s", args.hold_secs);
        tokio::time::sleep(Duration::from_secs(args.hold_secs)).await;
    }
    Ok(())
}
