//! The smallest complete custom trainer: a two-layer MLP classifier written directly against odc's
//! trainer API (no framework), on sequences the example generates itself, with 4 trainers and 2
//! shard servers in one process. Prints the loss per step and serves Prometheus metrics.
//!
//! ```text
//! cargo run --release --example embed -- --steps 30 --metrics-addr 127.0.0.1:9464
//! curl -s 127.0.0.1:9464/metrics | grep odc_    # while it runs (or with --hold-secs)
//! ```
//!
//! Under `odc launch` (or torchrun, or Slurm) every process joins one job from the environment:
//! rank 0 hosts the supervisor and feeds the data, every rank hosts one shard server and one
//! trainer unless `--servers-on` / `--trainers-on` place them. Each rank serves metrics on the
//! metrics port + its rank.
//!
//! ```text
//! cargo build --release --features cli --example embed --bin odc
//! target/release/odc launch --nprocs 4 --transport shm -- target/release/examples/embed --steps 30
//! ```
//!
//! Every rank prints, as its last line, `final loss=<f64> params_l2=<f64>`.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use odc::launch::{parse_ranks, Roles, World};
use odc::{
    async_trait, Communication, Compute, ComputeOutput, DispatchMode, FailurePolicy, Job,
    MicroBatch, OptimizerConfig, SampleMeta, TrainerContext, UnitSpec,
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
    /// Trainers (default: 4 in one process, one per rank in a multi-process job).
    #[arg(long)]
    trainers: Option<usize>,
    /// Shard servers (default: 2 in one process, one per rank in a multi-process job).
    #[arg(long)]
    servers: Option<usize>,
    /// Multi-process: the rank of each shard server, e.g. `0,1,2`.
    #[arg(long)]
    servers_on: Option<String>,
    /// Multi-process: the rank of each trainer, e.g. `0,1,2,3`.
    #[arg(long)]
    trainers_on: Option<String>,
    /// Gather/push mode: on-demand (odc) or the collective (FSDP-style) baseline.
    #[arg(long, value_enum, default_value = "on-demand")]
    communication: Comm,
    /// What becomes of a failed trainer's slot.
    #[arg(long, value_enum, default_value = "respawn")]
    on_trainer_failure: OnFailure,
    /// Extra compute time per micro-batch (emulates a bigger model; failure tests use it to
    /// land a kill inside a step).
    #[arg(long, default_value_t = 0)]
    compute_delay_ms: u64,
    /// Multi-process: longest wait for every rank to join (and for the others at the end).
    #[arg(long, default_value_t = 120)]
    join_timeout_secs: u64,
    /// Multi-process: the control plane's heartbeat interval (ms).
    #[arg(long, default_value_t = 1000)]
    heartbeat_interval_ms: u64,
    /// Multi-process: a rank silent this long (ms) is treated as lost.
    #[arg(long, default_value_t = 10_000)]
    heartbeat_timeout_ms: u64,
    /// Write the final fp32 parameters (every unit in order, little-endian) to this file
    /// (rank 0 only in a multi-process job).
    #[arg(long)]
    save_params: Option<std::path::PathBuf>,
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
    /// Relay gradient pushes through the node: ranks (in one process: trainer slots) in nodes
    /// of this many (`JobBuilder::relay_pushes`). Default: relayed through each host where the
    /// world spans hosts (`LOCAL_WORLD_SIZE` below the world size), else straight.
    #[arg(long, conflicts_with = "direct_pushes")]
    relay_pushes: Option<u32>,
    /// Push every gradient straight to its owner, also where the world spans hosts
    /// (`JobBuilder::direct_pushes`).
    #[arg(long)]
    direct_pushes: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Dispatch {
    Static,
    Dynamic,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Comm {
    OnDemand,
    Collective,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum OnFailure {
    Respawn,
    Drop,
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
struct Mlp {
    delay: Duration,
}

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
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,ractor_cluster=error".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let args = Args::parse();
    let world = World::from_env().context("reading the launcher's environment")?;
    let rank = world.rank;
    let multi = world.world_size > 1;
    if !args.no_metrics {
        let mut addr = args.metrics_addr;
        addr.set_port(addr.port().saturating_add(world.rank as u16));
        odc::metrics::serve(addr)?;
        println!("metrics: http://{addr}/metrics");
    }
    let seed = args.seed;
    let size = args.minibatch;
    let delay = Duration::from_millis(args.compute_delay_ms);
    let mut builder = Job::builder()
        .unit(UnitSpec::with_values("hidden", init(1, H * D + H, D)))
        .unit(UnitSpec::with_values("output", init(2, C * H + C, H)))
        .optimizer(OptimizerConfig::adamw(3e-3))
        .token_budget(args.token_budget)
        .dispatch(match args.dispatch {
            Dispatch::Static => DispatchMode::Static,
            Dispatch::Dynamic => DispatchMode::Dynamic,
        })
        .communication(match args.communication {
            Comm::OnDemand => Communication::OnDemand,
            Comm::Collective => Communication::Collective,
        })
        .failure_policy(match args.on_trainer_failure {
            OnFailure::Respawn => FailurePolicy::default(),
            OnFailure::Drop => FailurePolicy::Drop,
        })
        .compute(move |_trainer| Box::new(Mlp { delay }) as Box<dyn Compute>)
        .data(move |step| Ok(minibatch(seed, step, size)));
    if multi {
        let world_size = world.world_size;
        builder = builder
            .world(world)
            .join_timeout(Duration::from_secs(args.join_timeout_secs))
            .heartbeat(
                Duration::from_millis(args.heartbeat_interval_ms),
                Duration::from_millis(args.heartbeat_timeout_ms),
            );
        if args.servers_on.is_some() || args.trainers_on.is_some() {
            let ranks = |flag: &str, text: &Option<String>| match text {
                Some(text) => parse_ranks(text).map_err(|e| anyhow::anyhow!("--{flag}: {e}")),
                None => Ok((0..world_size).collect()),
            };
            builder = builder.roles(Roles::explicit(
                ranks("servers-on", &args.servers_on)?,
                ranks("trainers-on", &args.trainers_on)?,
            ));
        }
        if let Some(n) = args.trainers {
            builder = builder.trainers(n);
        }
        if let Some(n) = args.servers {
            builder = builder.servers(n);
        }
    } else {
        builder = builder
            .trainers(args.trainers.unwrap_or(4))
            .servers(args.servers.unwrap_or(2));
    }
    if let Some(node_size) = args.relay_pushes {
        builder = builder.relay_pushes(node_size);
    }
    if args.direct_pushes {
        builder = builder.direct_pushes();
    }
    let mut job = builder.build().context("building the job")?;
    let started = Instant::now();
    let mut tokens = 0;
    let mut loss = f64::NAN;
    for _ in 0..args.steps {
        let s = job.step().await?;
        tokens += s.tokens;
        loss = s.loss;
        if rank != 0 {
            continue;
        }
        let busy: f64 = s.trainers.iter().map(|t| t.busy.as_secs_f64()).sum();
        let utilization = busy / (s.trainers.len() as f64 * s.wall.as_secs_f64());
        // Relayed pushes: how many relays flushed before the barrier (static plans).
        let early = match args.direct_pushes {
            false => format!("  early relay flushes {}", s.early_relay_flushes),
            true => String::new(),
        };
        println!(
            "step {:3}  loss {:.4}  tokens {:6}  micro-batches {:3}  replays {}  wall {:6.1} ms  utilization {:.2}{early}",
            s.step,
            s.loss,
            s.tokens,
            s.micro_batches,
            s.replays,
            s.wall.as_secs_f64() * 1e3,
            utilization
        );
    }
    let secs = started.elapsed().as_secs_f64();
    if rank == 0 {
        println!(
            "{} steps in {:.2} s: {:.2} steps/s, {:.0} tokens/s",
            args.steps,
            secs,
            args.steps as f64 / secs,
            tokens as f64 / secs
        );
    }
    let params = job.parameters().await.context("reading the parameters")?;
    let l2 = params
        .iter()
        .flatten()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    if let (Some(path), 0) = (&args.save_params, rank) {
        let bytes: Vec<u8> = params
            .iter()
            .flatten()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    job.shutdown().await;
    if !args.no_metrics && args.hold_secs > 0 {
        println!("serving metrics for {} s", args.hold_secs);
        tokio::time::sleep(Duration::from_secs(args.hold_secs)).await;
    }
    println!("final loss={loss} params_l2={l2}");
    Ok(())
}
