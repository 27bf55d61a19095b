//! GRPO on odc: the reference transformer, warm-started by SFT, samples a group of responses per
//! arithmetic problem, is rewarded for the right final number (plus a little for the `#### n`
//! format), and is updated on odc with the clipped policy-gradient loss and a KL term to the
//! reference (its starting weights). The balancer sees the **generated** lengths: the imbalance RL
//! really has.
//!
//! ```text
//! cargo run --release --example sft -- --checkpoint-every 300 --checkpoint-dir ckpt
//! cargo run --release --example rl_grpo -- --init ckpt/step-300
//! cargo run --release --example rl_grpo                 # runs a short SFT first (--sft-steps)
//! cargo run --release --example rl_grpo -- --tokenizer tokenizer.json --init ckpt/step-300
//! ```
//!
//! Per step: `--prompts` problems × `--group-size` responses sampled from the current policy at
//! `--temperature` (KV cache; at most `--max-new-tokens`), rewards and group-normalised advantages,
//! the reference's log-probs of every response, then one odc step over all responses. Printed per
//! step: reward, accuracy (exact match), response length (mean, max), loss. One process (trainers
//! and servers in it); the last line is `final step=<n> reward=<f> accuracy=<f>`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::Device;
use clap::Parser;
use odc::checkpoint;
use odc::model::{
    evaluate, generate, group_advantages, sequence_log_probs, tensor_map, transformer_job,
    GrpoConfig, ModelConfig, Objective, RlSample, Sample, SampleStore, Sampling, Weights,
};
use odc::text::{
    exact_match, prompt_tokens, reward, ArithTask, ByteTokenizer, HfTokenizer, Tokenizer,
};
use odc::{LrSchedule, OptimizerConfig, Precision, SampleMeta};
use rand::rngs::StdRng;
use rand::SeedableRng;

#[derive(Debug, Parser)]
#[command(about = "GRPO on odc (see the example's docs)")]
struct Args {
    /// Start from this SFT checkpoint (DIR/step-<N>); without it, a short SFT runs first.
    #[arg(long)]
    init: Option<PathBuf>,
    /// SFT steps of the warm start when no --init is given.
    #[arg(long, default_value_t = 150)]
    sft_steps: u64,
    /// RL steps.
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Problems per step.
    #[arg(long, default_value_t = 8)]
    prompts: usize,
    /// Responses per problem (G).
    #[arg(long, default_value_t = 4)]
    group_size: usize,
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    #[arg(long, default_value_t = 192)]
    max_new_tokens: usize,
    #[arg(long, default_value_t = 5e-4)]
    lr: f32,
    /// PPO clip range.
    #[arg(long, default_value_t = 0.2)]
    clip_eps: f64,
    /// KL coefficient to the reference.
    #[arg(long, default_value_t = 0.01)]
    kl_coef: f64,
    #[arg(long, default_value_t = 2)]
    trainers: usize,
    #[arg(long, default_value_t = 2)]
    servers: usize,
    #[arg(long, default_value_t = 4096)]
    token_budget: u64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Held-out problems answered greedily before and after RL (0: no evaluation).
    #[arg(long, default_value_t = 40)]
    eval_problems: usize,
    /// The generated problems' largest number (20 to 1000; use the SFT run's `--max-value`).
    #[arg(long, default_value_t = odc::text::arith::MAX_VALUE, value_parser = clap::value_parser!(u64)
        .range(odc::text::arith::MIN_MAX_VALUE..=odc::text::arith::MAX_VALUE))]
    max_value: u64,
    /// A Hugging Face `tokenizer.json` instead of the byte tokenizer (the one the `--init`
    /// checkpoint was trained with); the model's `vocab_size` becomes its vocabulary size.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

/// The responses of the current step, by sample index (what the trainers' compute resolves).
#[derive(Default)]
struct Responses {
    map: RwLock<HashMap<u64, (Sample, RlSample)>>,
}

impl SampleStore for Responses {
    fn sample(&self, index: u64) -> Result<Sample, String> {
        let map = self
            .map
            .read()
            .map_err(|_| "response store poisoned".to_string())?;
        map.get(&index)
            .map(|(s, _)| s.clone())
            .ok_or_else(|| format!("no response {index} in this step"))
    }

    fn rl(&self, index: u64) -> Option<RlSample> {
        self.map.read().ok()?.get(&index).map(|(_, r)| r.clone())
    }
}

/// SFT samples of the generated task, by problem index.
struct Problems(ArithTask, Arc<dyn Tokenizer>);

impl SampleStore for Problems {
    fn sample(&self, index: u64) -> Result<Sample, String> {
        let sample = odc::text::Sample::from_problem(&*self.1, &self.0.problem(index));
        Ok(Sample::from(&sample.map_err(|e| e.to_string())?))
    }
}

/// A short SFT on the generated task; the trained parameters.
async fn warm_start(
    args: &Args,
    model: &ModelConfig,
    tokenizer: Arc<dyn Tokenizer>,
) -> anyhow::Result<Vec<Vec<f32>>> {
    let task = ArithTask::train(args.seed).with_max_value(args.max_value);
    let max_len = model.max_seq_len;
    let mut next = 0u64;
    let mut job = transformer_job(
        model,
        None,
        Arc::new(Problems(task, tokenizer.clone())),
        Objective::CrossEntropy,
    )?
    .trainers(args.trainers)
    .servers(args.servers)
    .optimizer(OptimizerConfig::AdamW {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
    })
    .lr_schedule(LrSchedule::WarmupCosine {
        warmup_steps: 20.min(args.sft_steps),
        total_steps: args.sft_steps,
        min_ratio: 0.1,
    })
    .clip_grad_norm(1.0)
    .token_budget(args.token_budget)
    .pull_precision(Precision::F32)
    .data(move |_step: u64| {
        let mut metas = Vec::new();
        while metas.len() < 16 {
            let s = odc::text::Sample::from_problem(&*tokenizer, &task.problem(next))
                .map_err(odc::Error::user)?;
            if s.len() <= max_len {
                metas.push(s.meta(next));
            }
            next += 1;
        }
        Ok(metas)
    })
    .build()?;
    for step in 0..args.sft_steps {
        let s = job.step().await?;
        if (step + 1) % 25 == 0 {
            println!(
                "sft step {:4}/{}  loss {:.4}",
                step + 1,
                args.sft_steps,
                s.loss
            );
        }
    }
    let params = job.parameters().await?;
    job.shutdown().await;
    Ok(params)
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // Before any thread exists: each trainer gets its share of the cores.
    let threads = odc::model::share_cpu_threads(args.trainers);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(run(args, threads))
}

async fn run(args: Args, threads: odc::model::CpuThreads) -> anyhow::Result<()> {
    println!("rl_grpo: {threads}");
    if args.prompts == 0 || args.group_size < 2 {
        bail!("GRPO needs at least one prompt and a group of at least 2 responses");
    }
    if !(args.temperature.is_finite() && args.temperature > 0.0) {
        bail!(
            "--temperature must be positive (sampling), got {}",
            args.temperature
        );
    }
    let tokenizer: Arc<dyn Tokenizer> = match &args.tokenizer {
        Some(path) => Arc::new(HfTokenizer::from_file(path)?),
        None => Arc::new(ByteTokenizer),
    };
    let model = ModelConfig {
        vocab_size: tokenizer.vocab_size(),
        ..ModelConfig::tiny()
    };
    let init = match &args.init {
        Some(dir) => {
            let (state, _) = checkpoint::load(dir, &tensor_map(&model)?)
                .with_context(|| format!("loading the SFT checkpoint {}", dir.display()))?;
            println!(
                "policy and reference from {} (step {})",
                dir.display(),
                state.step
            );
            state.params
        }
        None => {
            println!("no --init: a {}-step SFT warm start first", args.sft_steps);
            warm_start(&args, &model, tokenizer.clone()).await?
        }
    };
    let reference = Weights::from_units(&model, &init, &Device::Cpu)?;
    let responses = Arc::new(Responses::default());
    let mut job = transformer_job(
        &model,
        Some(init),
        responses.clone(),
        Objective::Grpo(GrpoConfig {
            clip_eps: args.clip_eps,
            kl_coef: args.kl_coef,
        }),
    )?
    .trainers(args.trainers)
    .servers(args.servers)
    .optimizer(OptimizerConfig::AdamW {
        lr: args.lr,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.0,
    })
    .clip_grad_norm(1.0)
    .token_budget(args.token_budget)
    .pull_precision(Precision::F32)
    .build()?;

    let task = ArithTask::train(args.seed.wrapping_add(1)).with_max_value(args.max_value);
    let mut rng = StdRng::seed_from_u64(args.seed);
    let sampling = Sampling {
        temperature: args.temperature,
        max_new_tokens: args.max_new_tokens,
        stop: tokenizer.eos(),
    };
    // Greedy exact match on held-out problems, before and after: the sampled rewards of a step
    // (a few dozen responses at temperature) are too noisy to compare two steps.
    let eval_set: Vec<_> = ArithTask::eval(args.seed)
        .with_max_value(args.max_value)
        .problems(0..args.eval_problems as u64)
        .collect();
    let evaluate_now = |params: &[Vec<f32>]| -> anyhow::Result<f64> {
        let weights = Weights::from_units(&model, params, &Device::Cpu)?;
        Ok(evaluate(&weights, &*tokenizer, &eval_set, args.max_new_tokens)?.accuracy())
    };
    let eval_before = evaluate_now(&job.parameters().await?)?;
    if !eval_set.is_empty() {
        println!(
            "greedy accuracy on {} held-out problems before RL: {eval_before:.3}",
            eval_set.len()
        );
    }
    let mut problem = 0u64;
    let mut next_index = 0u64;
    let (mut reward_now, mut accuracy_now) = (f64::NAN, f64::NAN);
    let mut step_rewards = Vec::new();
    let started = Instant::now();
    for step in 0..args.steps {
        let policy = Weights::from_units(&model, &job.parameters().await?, &Device::Cpu)?;
        let t = Instant::now();
        let mut store = HashMap::new();
        let mut metas: Vec<SampleMeta> = Vec::new();
        let (mut rewards_all, mut correct, mut lengths) = (Vec::new(), 0usize, Vec::new());
        for _ in 0..args.prompts {
            let p = task.problem(problem);
            problem += 1;
            let prompt = prompt_tokens(&*tokenizer, &p.question)?;
            if prompt.len() + 8 > model.max_seq_len {
                continue;
            }
            let mut group = Vec::with_capacity(args.group_size);
            for _ in 0..args.group_size {
                let response = generate(&policy, &prompt, sampling, &mut rng)?;
                let text = tokenizer.decode(&response)?;
                let r = reward(&text, &p.answer);
                correct += usize::from(exact_match(&text, &p.answer));
                group.push((response, r));
            }
            let rewards: Vec<f64> = group.iter().map(|(_, r)| *r).collect();
            let advantages = group_advantages(&rewards);
            for ((response, r), advantage) in group.into_iter().zip(advantages) {
                lengths.push(response.len());
                rewards_all.push(r);
                let tokens: Vec<u32> = prompt.iter().chain(&response).copied().collect();
                let mut loss_mask = vec![false; tokens.len()];
                loss_mask[prompt.len()..].fill(true);
                let ref_log_probs = sequence_log_probs(&reference, &tokens)?;
                let index = next_index;
                next_index += 1;
                metas.push(SampleMeta {
                    index,
                    tokens: tokens.len() as u64,
                    loss_tokens: response.len() as u64,
                });
                store.insert(
                    index,
                    (
                        Sample { tokens, loss_mask },
                        RlSample {
                            advantage: advantage as f32,
                            ref_log_probs,
                        },
                    ),
                );
            }
        }
        if metas.is_empty() {
            bail!(
                "step {step}: no prompt fit the model's {} positions",
                model.max_seq_len
            );
        }
        let sample_secs = t.elapsed().as_secs_f64();
        *responses
            .map
            .write()
            .map_err(|_| anyhow::anyhow!("response store poisoned"))? = store;
        let s = job
            .step_with(metas)
            .await
            .with_context(|| format!("RL step {step}"))?;
        reward_now = rewards_all.iter().sum::<f64>() / rewards_all.len() as f64;
        accuracy_now = correct as f64 / rewards_all.len() as f64;
        step_rewards.push(reward_now);
        let mean_len = lengths.iter().sum::<usize>() as f64 / lengths.len() as f64;
        let max_len = lengths.iter().copied().max().unwrap_or(0);
        println!(
            "step {:3}/{}  reward {reward_now:.3}  accuracy {accuracy_now:.3}  response mean {mean_len:.0} max {max_len} tokens  loss {:+.4}  sampling {sample_secs:.1} s  update {:.1} s ({} micro-batches)",
            step + 1,
            args.steps,
            s.loss,
            s.wall.as_secs_f64(),
            s.micro_batches
        );
    }
    let eval_after = evaluate_now(&job.parameters().await?)?;
    job.shutdown().await;
    // Mean sampled reward of the first and the last quarter of the steps.
    let quarter = step_rewards.len().div_ceil(4).max(1);
    let mean = |r: &[f64]| r.iter().sum::<f64>() / r.len().max(1) as f64;
    println!(
        "{} RL steps in {:.1} s; mean reward {:.3} over the first {quarter} steps, {:.3} over the last {quarter}",
        args.steps,
        started.elapsed().as_secs_f64(),
        mean(&step_rewards[..quarter.min(step_rewards.len())]),
        mean(&step_rewards[step_rewards.len().saturating_sub(quarter)..]),
    );
    if !eval_set.is_empty() {
        println!(
            "greedy accuracy on {} held-out problems: {eval_before:.3} before RL, {eval_after:.3} after",
            eval_set.len()
        );
    }
    println!(
        "final step={} reward={reward_now} accuracy={accuracy_now}",
        args.steps
    );
    Ok(())
}
