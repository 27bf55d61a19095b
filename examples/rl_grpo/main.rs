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
//! cargo run --release --example rl_grpo -- --model-dir Qwen2.5-0.5B-Instruct   # your model
//! ```
//!
//! With `--model-dir DIR` (a Hugging Face instruct model, see the `sft` example), the policy and
//! the reference start from the directory's weights (or `--init`'s), prompts are the model's chat
//! template around the question, responses end at the model's stop ids (Qwen's `<|im_end|>`,
//! Llama 3's `<|eot_id|>`), and the reward is the exact match of the final number.
//!
//! Per step: `--prompts` problems (those whose sample fits the model) × `--group-size` responses
//! sampled from the current policy at `--temperature` and `--top-p` (KV cache; `--decode-batch`
//! prompts and their groups decoded as one batch; at most `--max-new-tokens`) by one thread per
//! trainer while the trainers wait, each response from its own seeded RNG and the batches cut
//! from the step's whole list (so the responses do not depend on the thread count); rewards and
//! group-normalised advantages. A group whose responses all scored alike has zero advantages and
//! is not trained on (DAPO's dynamic sampling, without refilling); the others get the reference's
//! log-probs and go into one odc step. The sampler reads the policy each step from the shard
//! servers' published copies at the step's version (`odc::compute::published_weights`; device to
//! device where the transport reaches the GPU), and the reference the same way once decoding is
//! done: the job serves it as frozen units after the policy's, sharded over the servers like
//! them (`odc::compute::served_reference`, `UnitSpec::served`), so no rank keeps a whole copy
//! of it, and the policy with its cache and the reference are never held together. Printed per
//! step: reward, accuracy (exact match), response length (mean, max), the KL to the reference (k3 per response token, over the trained groups:
//! the term the loss weighs by `--kl-coef`), groups trained, loss. Before and after RL,
//! `--eval-problems` held-out
//! problems are answered greedily and sampled `--group-size` times each with fixed seeds (a paired
//! comparison). The last line is `final step=<n> reward=<f> accuracy=<f>`. `--max-value`
//! defaults to the `--init` checkpoint's (the SFT run's setting).
//!
//! `--reward-command CMD` replaces the built-in reward with the user's: `sh -c CMD` reads one
//! JSON object per response and line (`{"prompt", "completion", "answer"}`) and prints one number
//! per line, once per decoding batch (`odc::recipe::reward_command`); a run that exits non-zero,
//! outlives `--reward-timeout` seconds or prints what is not a finite number stops the run with
//! an error naming it, before anything is trained on that batch. Each update's line adds its
//! tokens/s and the updates' MFU so far (`6 · N · tokens/s` over the update time, over the peak
//! the `updates:` line names; `--peak-tflops` sets it, see `sft`). `--log-jsonl PATH` and
//! `--tensorboard DIR` write every step's figures (`reward`, `accuracy`, `kl`,
//! `response_tokens_mean`, `response_tokens_max`, `groups_trained`, `sampling_s` and the
//! update's `loss`, `grad_norm`, `tokens_per_s`, `step_ms`, `mfu`) and the held-out scores
//! (`held_out_greedy_accuracy`, `held_out_reward`, `held_out_accuracy`; at step 0 before RL and
//! at the last step after).
//!
//! Under `odc launch` every process is one trainer and one shard server, and every rank samples
//! its share of each step's groups (and of the held-out problems) with the current policy: the
//! ranks list the same prompts, rank `r` of `n` takes the `r`-th contiguous share of whole
//! batches (`batch_share_range`: the batches one process would decode), and
//! [`Job::all_gather`](odc::Job::all_gather) gives every rank all the groups (their tokens,
//! rewards and reference log-probs, a few hundred KB a step) before rank 0 steps. A response's
//! RNG depends on its problem only, so the responses, rewards and lines printed are the
//! one-process run's (the update's sums differ in the last bits, I3). Rank 0 prints; each rank
//! serves metrics on the metrics port + its rank. A multi-process run starts from `--init` or
//! `--model-dir` (the warm start is a one-process SFT: run `sft` first).
//!
//! ```text
//! target/release/odc launch --nprocs 2 -- target/release/examples/rl_grpo --init ckpt/step-300
//! ```
//!
//! `--device cuda[:N]` (a build with the root crate's `cuda` feature) runs the trainers' forward
//! and backward (the warm start's and RL's) on a CUDA device, `--precision bf16` in mixed
//! precision (see the `sft` example); sampling and evaluation run there too, in the same precision, in batches
//! (`--decode-batch` prompts with their groups, held-out problems in batches of
//! [`EVAL_BATCH`]).
//!
//! Checkpoints (`checkpoints.rs`): `--checkpoint-every N --checkpoint-dir DIR [--keep-last K]`
//! writes the policy's parameters and AdamW state as `sft` does, with the run's position (RL
//! steps done, next problem and sample); `--resume auto` (or a `step-<N>` directory) continues the
//! same prompts and draws, so a killed run resumed ends as the uninterrupted one. Both need
//! `--init` or `--model-dir`, where the reference is read again (served units stay out of
//! checkpoints).
//!
//! Prometheus metrics at `--metrics-addr` (off with `--no-metrics`): the runtime's `odc_*` and, per
//! RL step, `odc_grpo_reward`, `odc_grpo_accuracy_ratio`, `odc_grpo_response_tokens` (mean) and
//! `odc_grpo_response_tokens_max`, `odc_grpo_kl`, `odc_grpo_sampling_tokens_per_second`
//! (response tokens over the sampling phase's wall time), and the counters
//! `odc_grpo_groups_total` and `odc_grpo_groups_trained_total`, and each stage's wall seconds
//! `odc_grpo_timing_seconds{stage}` (verl's `timing_s/<stage>`: `gen`, `reward`, `ref`, `gather`,
//! `update_actor`; the step line prints the sampling ones after `sampling N s`).

mod args;
mod checkpoints;
mod groups;
mod held_out;
mod names;
mod sampling;
mod warm_start;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use odc::checkpoint;
use odc::compute::{served_reference, Objective, Placement};
use odc::model::hf::HfCheckpoint;
use odc::model::{
    batch_share_range, evaluate_prompted, tensor_map, unit_count, unit_name, GrpoConfig,
    ModelConfig, Sampling, Weights, EVAL_BATCH,
};
use odc::recipe::{
    adamw, checkpoint_due, Evaluator, Fleet, JobRecipe, Log, Process, Progress, RewardCommand,
};
use odc::text::{ArithTask, ByteTokenizer, HfTokenizer, Problem, TextFormat, Tokenizer};
use odc::{Job, UnitSpec};

use args::Args;
use checkpoints::Position;
use groups::{Responses, StepSamples};
use held_out::{HeldOut, HeldOutCounts};
use sampling::{sample_groups, Response, Reward, Sampler, Timings};
use warm_start::warm_start;

/// The bound of the generated problems when neither `--max-value` nor the checkpoint gives one:
/// the SFT example's default.
const DEFAULT_MAX_VALUE: u64 = odc::text::arith::MIN_MAX_VALUE;

/// XORed into `--seed` for the held-out samples' RNGs (apart from the training prompts').
const HELD_OUT_SEED: u64 = 0x4E1D0;

/// Longest wait for the slowest rank's share of a step's groups (or of the held-out problems).
pub(crate) const GATHER_TIMEOUT: Duration = Duration::from_secs(3600);

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,ractor_cluster=error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // Before any thread exists: each trainer of this process gets its share of the cores (one
    // trainer per process under `odc launch`).
    let process = Process::start(args.trainers)?;
    process.runtime()?.block_on(run(args, process))
}

/// The run from top to bottom: the model and its starting weights, the job, the held-out scores
/// before RL, the RL steps, the scores after.
async fn run(args: Args, process: Process) -> anyhow::Result<()> {
    if let Some(threads) = &process.threads {
        process.say(format!("rl_grpo: {threads}"));
    }
    if process.is_distributed() && args.init.is_none() && args.model_dir.is_none() {
        bail!(
            "under odc launch rl_grpo starts from --init (an sft checkpoint) or --model-dir: \
             the warm start is a one-process SFT (run the sft example first)"
        );
    }
    // Before any job starts: the runtime's metric handles are taken when it does.
    if !args.no_metrics {
        process.serve_metrics(args.metrics_addr)?;
        names::describe();
    }
    check_args(&args)?;
    checkpoints::check(&args)?;
    let (format, model, checkpoint) = load_model(&args)?;
    let say = |line: String| process.say(line);
    let (init, max_value) = initial_policy(&args, &model, checkpoint, &format, &say).await?;
    let resumed = checkpoints::resume(&args, &tensor_map(&model)?, max_value, &process)?;
    let (opened, position) = match resumed {
        Some(r) => (Some(r.opened), r.position),
        None => (None, Position::default()),
    };
    let grpo = Grpo::new(args, process, format, model, max_value)?;
    let mut job = grpo.build_job(init, opened)?;
    // Scored on the reference (the starting weights): the same before a resumed run.
    let reference = grpo.reference(&mut job).await?;
    let before = grpo.held_out(&mut job, &reference).await?;
    drop(reference);
    grpo.say_held_out("before", &before, None);

    // The RL steps: sample the step's groups (each rank its share), keep the groups whose
    // rewards differ, train on them, checkpoint.
    let args = &grpo.args;
    let task = ArithTask::train(args.seed.wrapping_add(1)).with_max_value(grpo.max_value);
    let mut at = position;
    let mut trained = Trained {
        started: Instant::now(),
        reward: at.step_rewards.last().copied().unwrap_or(f64::NAN),
        accuracy: at.last_accuracy.unwrap_or(f64::NAN),
        step_rewards: at.step_rewards.clone(),
    };
    // The optimizer step of the newest checkpoint (none written for a step without update).
    let mut checkpointed = job.steps_done();
    // The updates' rate and MFU, and the log (the lead's).
    let (mut progress, mut log) = grpo.progress_and_log(at.steps_done, &before)?;
    for step in at.steps_done..args.steps {
        let t = Instant::now();
        let prompts = grpo.prompts(&task, &mut at)?;
        let (groups, timings, gather) = grpo.sample_step(&mut job, &prompts, step).await?;
        let samples = StepSamples::of(groups, &mut at.next_index);
        let sample_secs = t.elapsed().as_secs_f64();
        let (reward, accuracy, kl) = samples.record(sample_secs);
        trained.reward = reward;
        trained.accuracy = accuracy;
        trained.step_rewards.push(reward);
        let lengths = &samples.lengths;
        let mean_len = lengths.iter().sum::<usize>() as f64 / lengths.len() as f64;
        let max_len = lengths.iter().copied().max().unwrap_or(0);
        let kept = samples.kept;
        let t = Instant::now();
        let stats = grpo.update(&mut job, samples, step).await?;
        let update = match &stats {
            Some(s) => {
                progress.record(s);
                format!(
                    "loss {:+.4}  update {:.1} s ({} micro-batches, {:.0} tok/s{})",
                    s.loss,
                    s.wall.as_secs_f64(),
                    s.micro_batches,
                    s.tokens as f64 / s.wall.as_secs_f64().max(1e-9),
                    progress
                        .mfu()
                        .map(|m| format!(", mfu {:.2}% so far", m * 100.0))
                        .unwrap_or_default()
                )
            }
            None => "no update (every group scored alike)".to_string(),
        };
        let stages = [
            ("gen", timings.gen),
            ("reward", timings.reward),
            ("ref", timings.reference),
            ("gather", gather),
            ("update_actor", t.elapsed().as_secs_f64()),
        ];
        for (stage, secs) in stages {
            metrics::gauge!(names::TIMING, "stage" => stage).set(secs);
        }
        let split = stages[..4]
            .iter()
            .map(|(stage, secs)| format!("{stage} {secs:.1}"))
            .collect::<Vec<_>>()
            .join(", ");
        grpo.say(format!(
            "step {:3}/{}  reward {reward:.3}  accuracy {accuracy:.3}  response mean {mean_len:.0} max {max_len} tokens  kl {kl:.5}  groups trained {kept}/{}  sampling {sample_secs:.1} s ({split})  {update}",
            step + 1,
            args.steps,
            prompts.len(),
        ));
        let figures = [
            ("reward", reward),
            ("accuracy", accuracy),
            ("kl", kl),
            ("response_tokens_mean", mean_len),
            ("response_tokens_max", max_len as f64),
            ("groups_trained", kept as f64),
            ("sampling_s", sample_secs),
        ];
        let figures = match &stats {
            Some(s) => progress.figures(s, &figures),
            None => figures.to_vec(),
        };
        log.record(step + 1, &figures)?;
        at.steps_done = step + 1;
        at.step_rewards.clone_from(&trained.step_rewards);
        at.last_accuracy = Some(accuracy);
        grpo.checkpoint(&mut job, &at, &mut checkpointed).await?;
    }
    if let Some(written) = job.wait_checkpoint().await? {
        grpo.say(format!("checkpoint: {}", written.display()));
    }

    // After RL: the held-out scores again, the report and the last line.
    let policy = grpo.policy(&mut job).await?;
    let after = grpo.held_out(&mut job, &policy).await?;
    job.shutdown().await;
    log.record(args.steps, &after.figures())?;
    if progress.mfu().is_some() {
        grpo.say(format!("updates: {}", progress.summary()));
    }
    grpo.report(&trained, &before, &after);
    Ok(())
}

/// The sampling and learning settings that need no model.
fn check_args(args: &Args) -> anyhow::Result<()> {
    if args.prompts == 0 || args.group_size < 2 {
        bail!("GRPO needs at least one prompt and a group of at least 2 responses");
    }
    if !(args.temperature.is_finite() && args.temperature > 0.0) {
        bail!(
            "--temperature must be positive (sampling), got {}",
            args.temperature
        );
    }
    if !(args.format_reward.is_finite() && args.format_reward >= 0.0) {
        bail!(
            "--format-reward must be a weight of 0 or more, got {}",
            args.format_reward
        );
    }
    Ok(())
}

/// The text format and the model: a model directory's (its checkpoint opened), or odc's
/// reference model over `--tokenizer` (else bytes).
fn load_model(args: &Args) -> anyhow::Result<(TextFormat, ModelConfig, Option<HfCheckpoint>)> {
    if let Some(dir) = &args.model_dir {
        let checkpoint =
            HfCheckpoint::open(dir).with_context(|| format!("--model-dir {}", dir.display()))?;
        let tokenizer = HfTokenizer::from_dir(dir)?;
        return Ok((
            TextFormat::Chat(Arc::new(tokenizer)),
            checkpoint.config().clone(),
            Some(checkpoint),
        ));
    }
    let tokenizer: Arc<dyn Tokenizer> = match &args.tokenizer {
        Some(path) => Arc::new(HfTokenizer::from_file(path)?),
        None => Arc::new(ByteTokenizer),
    };
    let model = ModelConfig {
        vocab_size: tokenizer.vocab_size(),
        ..ModelConfig::tiny()
    };
    Ok((TextFormat::Plain(tokenizer), model, None))
}

/// The policy's (and the reference's) starting units and the problems' bound: an `--init`
/// checkpoint's or a model directory's (each unit read from the mapped files, by each shard
/// server its own range: no process holds a whole copy), or a short SFT warm start's.
async fn initial_policy(
    args: &Args,
    model: &ModelConfig,
    checkpoint: Option<HfCheckpoint>,
    format: &TextFormat,
    say: &dyn Fn(String),
) -> anyhow::Result<(Vec<UnitSpec>, u64)> {
    match (&args.init, checkpoint) {
        (Some(dir), _) => {
            let tensors = tensor_map(model)?;
            let opened = checkpoint::open(dir, &tensors)
                .with_context(|| format!("opening the SFT checkpoint {}", dir.display()))?;
            let extra = opened.extra();
            // The SFT example saves its settings beside the state; its bound is this run's default.
            let trained_on = extra
                .pointer("/settings/max_value")
                .and_then(serde_json::Value::as_u64);
            let max_value = args.max_value.or(trained_on).unwrap_or(DEFAULT_MAX_VALUE);
            say(format!(
                "policy and reference from {} (step {}); problems up to {max_value}",
                dir.display(),
                opened.step()
            ));
            let units = (opened.params().iter().enumerate())
                .map(|(u, init)| {
                    UnitSpec::from_init(unit_name(model, u), tensors.unit_len(u), init.clone())
                })
                .collect();
            Ok((units, max_value))
        }
        (None, Some(checkpoint)) => {
            let max_value = args.max_value.unwrap_or(DEFAULT_MAX_VALUE);
            say(format!(
                "policy and reference from {}; problems up to {max_value}",
                checkpoint.dir().display()
            ));
            Ok((checkpoint.unit_specs(), max_value))
        }
        (None, None) => {
            let max_value = args.max_value.unwrap_or(DEFAULT_MAX_VALUE);
            println!(
                "no --init: a {}-step SFT warm start first; problems up to {max_value}",
                args.sft_steps
            );
            let params = warm_start(args, max_value, model, format.tokenizer()).await?;
            let units = (params.into_iter().enumerate())
                .map(|(u, values)| UnitSpec::with_values(unit_name(model, u), values))
                .collect();
            Ok((units, max_value))
        }
    }
}

/// What every phase of the RL run reads.
struct Grpo {
    args: Args,
    process: Process,
    model: ModelConfig,
    format: TextFormat,
    /// Prompts and responses within a micro-batch and the model's positions.
    max_len: usize,
    max_value: u64,
    sampling: Sampling,
    /// The current step's responses, which the trainers' compute resolves.
    responses: Arc<Responses>,
    /// Held-out problems that fit the model, with their index (the sampled score's per-problem
    /// RNGs), scored before and after (greedy, and sampled with the same seeds): a step's
    /// sampled rewards are too noisy to compare two steps.
    eval_prompts: Vec<(u64, Problem)>,
    /// Where sampling and evaluation run while the trainers wait: the trainers' device in their
    /// precision (bf16's matrices and cache under `--precision bf16`, as the trainers' forward
    /// the log-probs are compared with), with one thread per trainer here on the CPU, one on a
    /// GPU (its batches are the parallelism).
    evaluator: Evaluator,
    placement: Placement,
    /// The built-in reward or the user's command.
    reward: Reward,
}

/// What the RL steps measured.
struct Trained {
    started: Instant,
    /// Each step's mean sampled reward.
    step_rewards: Vec<f64>,
    /// The last step's mean reward and accuracy.
    reward: f64,
    accuracy: f64,
}

impl Grpo {
    fn new(
        args: Args,
        process: Process,
        format: TextFormat,
        model: ModelConfig,
        max_value: u64,
    ) -> anyhow::Result<Self> {
        let max_len = model
            .max_seq_len
            .min(usize::try_from(args.token_budget).unwrap_or(usize::MAX));
        let placement = args.placement()?;
        let evaluator = Evaluator::new(&placement, process.trainers_here())?;
        let sampling = Sampling {
            temperature: args.temperature,
            top_p: args.top_p,
            max_new_tokens: args.max_new_tokens,
            stop: format.tokenizer().stop_ids(),
        };
        let eval_set = format.fitting(
            ArithTask::eval(args.seed)
                .with_max_value(max_value)
                .problems(0..(args.eval_problems as u64).saturating_mul(100)),
            max_len,
            args.eval_problems,
        )?;
        let (args_reward, reward_timeout) = (args.reward_command.clone(), args.reward_timeout);
        let format_weight = args.format_reward;
        Ok(Grpo {
            eval_prompts: (0u64..).zip(eval_set).collect(),
            args,
            process,
            model,
            format,
            max_len,
            max_value,
            sampling,
            responses: Arc::new(Responses::default()),
            evaluator,
            placement,
            reward: match &args_reward {
                Some(command) => Reward::Command(RewardCommand {
                    command: command.clone(),
                    timeout: Duration::from_secs(reward_timeout),
                }),
                None => Reward::Gsm8k { format_weight },
            },
        })
    }

    /// This rank, and the ranks of the job.
    fn ranks(&self) -> (usize, usize) {
        (self.process.rank() as usize, self.process.ranks() as usize)
    }

    /// The policy at the job's current version as the sampler computes with it (its device and
    /// precision): read from the servers' published copies, device to device where the job's
    /// transport reaches the sampler's GPU.
    async fn policy(&self, job: &mut Job) -> anyhow::Result<Weights> {
        Ok(self.evaluator.weights(job, &self.model, 0).await?)
    }

    /// The frozen reference (the starting weights), read as the policy is from the job's
    /// served units after the policy's ([`Grpo::build_job`]).
    async fn reference(&self, job: &mut Job) -> anyhow::Result<Weights> {
        let first = unit_count(&self.model);
        Ok(self.evaluator.weights(job, &self.model, first).await?)
    }

    /// The updates' progress (MFU over the peak, on the lead) and the run's log, its first
    /// record the held-out scores `before` RL at step `first` (a resumed run's log goes on).
    fn progress_and_log(&self, first: u64, before: &HeldOut) -> anyhow::Result<(Progress, Log)> {
        let progress = Progress::new(first, self.args.steps);
        if !self.process.is_lead() {
            return Ok((progress, Log::default()));
        }
        let trainers = self.process.trainers_here();
        let peak = odc::recipe::peak(&self.placement, self.args.peak_tflops, trainers)?;
        let params = odc::model::param_count(&self.model)? as u64;
        let args = &self.args;
        let mut log = Log::open(args.log_jsonl.as_deref(), args.tensorboard.as_deref())?;
        if first == 0 {
            log.record(0, &before.figures())?;
        }
        Ok((progress.with_mfu(params, peak), log))
    }

    /// Prints `line` on the lead.
    fn say(&self, line: String) {
        self.process.say(line);
    }

    /// The job: the policy's units from `init`, GRPO's objective, AdamW, the reference served
    /// after the policy's units (sharded as they are).
    fn build_job(
        &self,
        init: Vec<UnitSpec>,
        resumed: Option<checkpoint::Opened>,
    ) -> anyhow::Result<Job> {
        let args = &self.args;
        let reference = served_reference(&self.model, &init)?;
        let fleet = Fleet::new(args.trainers, args.servers);
        let recipe = JobRecipe {
            model: &self.model,
            units: init,
            store: self.responses.clone(),
            objective: Objective::Grpo(GrpoConfig {
                clip_eps: args.clip_eps,
                kl_coef: args.kl_coef,
            }),
            placement: self.placement,
            optimizer: adamw(args.lr, 0.0),
            clip_grad_norm: 1.0,
            token_budget: args.token_budget,
            keep_last: args.keep_last,
            fleet: &fleet,
        };
        let builder = recipe.builder(&self.process.world, resumed)?;
        Ok(reference
            .into_iter()
            .fold(builder, odc::JobBuilder::unit)
            .build()?)
    }

    /// What sampling `policy` needs.
    fn sampler<'a>(&'a self, policy: &'a Weights, seed: u64) -> Sampler<'a> {
        Sampler {
            policy,
            format: &self.format,
            sampling: &self.sampling,
            group_size: self.args.group_size,
            batch: self.decode_batch(),
            seed,
            reward: &self.reward,
        }
    }

    /// Prompts per batched decode.
    fn decode_batch(&self) -> usize {
        usize::try_from(self.args.decode_batch).unwrap_or(usize::MAX)
    }

    /// `weights` scored on the held-out problems, every rank its share.
    async fn held_out(&self, job: &mut Job, weights: &Weights) -> anyhow::Result<HeldOut> {
        let mine = self.held_out_share(weights)?;
        held_out::sum(job, mine).await
    }

    /// This rank's share of the held-out scores of `weights`.
    fn held_out_share(&self, weights: &Weights) -> anyhow::Result<HeldOutCounts> {
        // Each rank's share in whole batches of each decoder, so that every batch is the one a
        // single process decodes (the scores do not depend on the number of ranks).
        let ((rank, ranks), len) = (self.ranks(), self.eval_prompts.len());
        let prompt = |p: &Problem| self.format.prompt(&p.question);
        let problems: Vec<Problem> = self.eval_prompts
            [batch_share_range(len, EVAL_BATCH, rank, ranks)]
        .iter()
        .map(|(_, p)| p.clone())
        .collect();
        let greedy = evaluate_prompted(
            weights,
            &*self.format.tokenizer(),
            &problems,
            self.args.max_new_tokens,
            self.evaluator.workers,
            &prompt,
        )?;
        // The same draws before and after (a fixed seed per problem): a paired comparison.
        let sampled = batch_share_range(len, self.decode_batch(), rank, ranks);
        let groups = sample_groups(
            &self.sampler(weights, self.args.seed ^ HELD_OUT_SEED),
            &self.eval_prompts[sampled],
            self.evaluator.workers,
        )?
        .groups();
        let responses: Vec<&Response> = groups.iter().flatten().collect();
        Ok(HeldOutCounts {
            problems: greedy.problems as u64,
            greedy_correct: greedy.correct as u64,
            samples: responses.len() as u64,
            samples_correct: responses.iter().filter(|r| r.correct).count() as u64,
            reward_sum: responses.iter().map(|r| r.reward).sum(),
        })
    }

    /// The step's problems: the next ones of the training task that fit the model, from `at`.
    fn prompts(&self, task: &ArithTask, at: &mut Position) -> anyhow::Result<Vec<(u64, Problem)>> {
        let mut prompts = Vec::with_capacity(self.args.prompts);
        while prompts.len() < self.args.prompts {
            let p = task.problem(at.problem);
            if self.format.problem_sample(&p)?.len() <= self.max_len {
                prompts.push((at.problem, p));
            }
            at.problem += 1;
        }
        Ok(prompts)
    }

    /// A checkpoint after the step that brought the run to `at` (the lead, when one is due and
    /// the step updated the parameters); `checkpointed` is the optimizer step of the newest.
    async fn checkpoint(
        &self,
        job: &mut Job,
        at: &Position,
        checkpointed: &mut u64,
    ) -> anyhow::Result<()> {
        let updated = job.steps_done() != *checkpointed;
        let due = checkpoint_due(self.args.checkpoint_every, at.steps_done, self.args.steps);
        if !(self.process.is_lead() && updated && due) {
            return Ok(());
        }
        let extra = checkpoints::extra(&self.args, self.max_value, at)?;
        let tensors = tensor_map(&self.model)?;
        let dir = &self.args.checkpoint_dir;
        if let Some(written) = job.checkpoint_async(dir, &tensors, &extra).await? {
            self.say(format!("checkpoint: {}", written.display()));
        }
        *checkpointed = job.steps_done();
        Ok(())
    }

    /// This rank's share of the step's groups, then every rank's (in prompt order); this rank's
    /// stage times, and the wait for the others' groups. The policy is read at the step's version
    /// first (counted in `gen`, as a rollout engine's weight sync is), and dropped with its cache
    /// once decoding is done, before the reference is read for its stage.
    async fn sample_step(
        &self,
        job: &mut Job,
        prompts: &[(u64, Problem)],
        step: u64,
    ) -> anyhow::Result<(Vec<Vec<Response>>, Timings, f64)> {
        let t = Instant::now();
        let policy = self.policy(job).await?;
        let read = t.elapsed().as_secs_f64();
        let (rank, ranks) = self.ranks();
        let share = batch_share_range(prompts.len(), self.decode_batch(), rank, ranks);
        let mut sampled = sample_groups(
            &self.sampler(&policy, self.args.seed),
            &prompts[share],
            self.evaluator.workers,
        )?;
        drop(policy);
        sampled.timings.gen += read;
        let t = Instant::now();
        if sampled.trains_any() {
            let reference = self.reference(job).await?;
            sampled.against_reference(&reference, self.evaluator.workers)?;
        }
        sampled.timings.reference = t.elapsed().as_secs_f64();
        let timings = sampled.timings;
        let mine = sampled.groups();
        if ranks == 1 {
            return Ok((mine, timings, 0.0));
        }
        let t = Instant::now();
        let all = job
            .all_gather(&mine, GATHER_TIMEOUT)
            .await
            .with_context(|| format!("gathering the groups of RL step {}", step + 1))?
            .into_iter()
            .flatten()
            .collect();
        Ok((all, timings, t.elapsed().as_secs_f64()))
    }

    /// One optimizer step on the kept groups' responses (none when every group scored alike).
    async fn update(
        &self,
        job: &mut Job,
        samples: StepSamples,
        step: u64,
    ) -> anyhow::Result<Option<odc::StepStats>> {
        if samples.metas.is_empty() {
            return Ok(None);
        }
        // Every rank holds every response (any trainer may be given any of them) before rank 0
        // steps.
        *self
            .responses
            .map
            .write()
            .map_err(|_| anyhow::anyhow!("response store poisoned"))? = samples.store;
        if self.process.is_distributed() {
            job.barrier(GATHER_TIMEOUT)
                .await
                .context("waiting for every rank to store the responses")?;
        }
        let s = if self.process.is_lead() {
            job.step_with(samples.metas).await
        } else {
            job.step().await
        }
        .with_context(|| format!("RL step {}", step + 1))?;
        Ok(Some(s))
    }

    /// The held-out scores `when` ("before" or "after" RL), with those before for comparison.
    fn say_held_out(&self, when: &str, scores: &HeldOut, before: Option<&HeldOut>) {
        if self.eval_prompts.is_empty() {
            return;
        }
        let (n, g) = (self.eval_prompts.len(), self.args.group_size);
        self.say(match before {
            None => format!(
                "held-out {when} RL ({n} problems): greedy accuracy {:.3}; {g} samples each: reward {:.3}, accuracy {:.3}",
                scores.greedy, scores.reward, scores.accuracy
            ),
            Some(b) => format!(
                "held-out {when} RL ({n} problems): greedy accuracy {:.3} (before {:.3}); {g} samples each: reward {:.3} (before {:.3}), accuracy {:.3} (before {:.3})",
                scores.greedy, b.greedy, scores.reward, b.reward, scores.accuracy, b.accuracy
            ),
        });
    }

    /// The rewards' trend, the held-out scores before and after, and the last line.
    fn report(&self, trained: &Trained, before: &HeldOut, after: &HeldOut) {
        // Mean sampled reward of the first and the last quarter of the steps.
        let rewards = &trained.step_rewards;
        let quarter = rewards.len().div_ceil(4).max(1);
        let mean = |r: &[f64]| r.iter().sum::<f64>() / r.len().max(1) as f64;
        self.say(format!(
            "{} RL steps in {:.1} s; mean reward {:.3} over the first {quarter} steps, {:.3} over the last {quarter}",
            self.args.steps,
            trained.started.elapsed().as_secs_f64(),
            mean(&rewards[..quarter.min(rewards.len())]),
            mean(&rewards[rewards.len().saturating_sub(quarter)..]),
        ));
        self.say_held_out("after", after, Some(before));
        self.say(format!(
            "final step={} reward={} accuracy={}",
            self.args.steps, trained.reward, trained.accuracy
        ));
    }
}
