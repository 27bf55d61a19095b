//! The example's flags.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use odc::compute::Placement;

#[derive(Debug, Parser)]
#[command(about = "GRPO on odc (see the example's docs)")]
pub(crate) struct Args {
    /// Start from this SFT checkpoint (DIR/step-<N>); without it, a short SFT runs first.
    #[arg(long)]
    pub(crate) init: Option<PathBuf>,
    /// SFT steps of the warm start when no --init is given.
    #[arg(long, default_value_t = 150)]
    pub(crate) sft_steps: u64,
    /// RL steps.
    #[arg(long, default_value_t = 20)]
    pub(crate) steps: u64,
    /// Problems per step: 32 groups average out enough of the gradient's noise for the measured
    /// gain (see `--lr`); 8 did not.
    #[arg(long, default_value_t = 32)]
    pub(crate) prompts: usize,
    /// Responses per problem (G): with fewer, more groups score alike and teach nothing.
    #[arg(long, default_value_t = 8)]
    pub(crate) group_size: usize,
    #[arg(long, default_value_t = 1.0)]
    pub(crate) temperature: f64,
    /// Top-p (nucleus) sampling: draw among the most likely tokens whose mass reaches it, in
    /// (0, 1]; 1 keeps them all.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) top_p: f64,
    /// Prompts decoded together, each with its group (`--group-size` rows each): one batched
    /// decode on the sampling device. Ranks share the step's prompts in whole batches.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) decode_batch: u64,
    /// Longest response, in tokens (also bounded by the model's `max_seq_len`).
    #[arg(long, default_value_t = 320)]
    pub(crate) max_new_tokens: usize,
    /// Learning rate: with 32 prompts per step, 1e-4 raised the held-out sampled accuracy of the
    /// default SFT checkpoint from 7.0% to 9.5% in 60 steps (greedy: 15.5% to 13.5%); at 2e-4 and
    /// above greedy accuracy fell in every measured run.
    #[arg(long, default_value_t = 1e-4)]
    pub(crate) lr: f32,
    /// PPO clip range.
    #[arg(long, default_value_t = 0.2)]
    pub(crate) clip_eps: f64,
    /// Weight of the `#### <n>` format reward beside 1.0 for the right number (0: correctness
    /// only; see `odc::text::weighted_reward`).
    #[arg(long, default_value_t = odc::text::reward::FORMAT_WEIGHT)]
    pub(crate) format_reward: f64,
    /// A reward of your own instead of the built-in GSM8K one: a shell command that reads one
    /// JSON object per response and line on stdin (`{"prompt", "completion", "answer"}`) and
    /// prints one number per line, run once per decoding batch (see
    /// `odc::recipe::reward_command`). Accuracy stays the exact match of the final number.
    #[arg(long)]
    pub(crate) reward_command: Option<String>,
    /// Seconds one run of `--reward-command` may take before it is killed and the run stops.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) reward_timeout: u64,
    /// Append every logged figure (each RL step's, the held-out scores) to this JSONL file.
    #[arg(long)]
    pub(crate) log_jsonl: Option<PathBuf>,
    /// Write every logged figure to TensorBoard event files in this directory.
    #[arg(long)]
    pub(crate) tensorboard: Option<PathBuf>,
    /// The peak TFLOP/s the update's MFU is over (default: on CUDA an H100/H200's 989 bf16
    /// dense; on the CPU the trainers' fp32 matmul rate, measured at the start).
    #[arg(long)]
    pub(crate) peak_tflops: Option<f64>,
    /// KL coefficient to the reference.
    #[arg(long, default_value_t = 0.01)]
    pub(crate) kl_coef: f64,
    /// Trainers and shard servers in one process (under `odc launch`: one of each per rank).
    #[arg(long, default_value_t = 2)]
    pub(crate) trainers: usize,
    #[arg(long, default_value_t = 2)]
    pub(crate) servers: usize,
    #[arg(long, default_value_t = 4096)]
    pub(crate) token_budget: u64,
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Held-out problems answered greedily, and sampled `--group-size` times at `--temperature`,
    /// before and after RL (0: no evaluation).
    #[arg(long, default_value_t = 100)]
    pub(crate) eval_problems: usize,
    /// The generated problems' largest number (20 to 1000). Default: the `--init` checkpoint's
    /// (its SFT run's `--max-value`), else the SFT example's default.
    #[arg(long, value_parser = clap::value_parser!(u64)
        .range(odc::text::arith::MIN_MAX_VALUE..=odc::text::arith::MAX_VALUE))]
    pub(crate) max_value: Option<u64>,
    /// A Hugging Face `tokenizer.json` instead of the byte tokenizer (the one the `--init`
    /// checkpoint was trained with); the model's `vocab_size` becomes its vocabulary size.
    #[arg(long, conflicts_with = "model_dir")]
    pub(crate) tokenizer: Option<PathBuf>,
    /// A Hugging Face model directory (an instruct model): its weights (or `--init`'s, a
    /// checkpoint of `sft --model-dir` on it) are the policy and the reference, its chat template
    /// formats the prompts and its stop ids end the responses; no warm start.
    #[arg(long)]
    pub(crate) model_dir: Option<PathBuf>,
    /// Write a checkpoint after every N RL steps and after the last (0: none): the policy's
    /// parameters and AdamW state, sharded and verified as `sft` writes them, and the run's
    /// position. Needs `--init` or `--model-dir` (the reference is read from there on resume).
    #[arg(long, default_value_t = 0)]
    pub(crate) checkpoint_every: u64,
    #[arg(long, default_value = "rl-checkpoints")]
    pub(crate) checkpoint_dir: PathBuf,
    /// Keep only the newest N checkpoints (0: all).
    #[arg(long, default_value_t = 0)]
    pub(crate) keep_last: usize,
    /// Continue from a checkpoint: a `step-<N>` directory, or `auto` for the newest complete one
    /// in `--checkpoint-dir` (from scratch when there is none).
    #[arg(long)]
    pub(crate) resume: Option<String>,
    /// Prometheus endpoint (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:9464")]
    pub(crate) metrics_addr: SocketAddr,
    /// Serve no metrics.
    #[arg(long)]
    pub(crate) no_metrics: bool,
    /// Where the trainers compute: cpu, cuda (device ODC_LOCAL_RANK mod count) or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// The trainers' matmul and activation precision: f32 or bf16 (mixed precision).
    #[arg(long, default_value = "f32")]
    pub(crate) precision: String,
    /// What a trainer keeps of a unit between its forward and backward: true, false, N (the
    /// last N stages) or auto (see the sft example).
    #[arg(long, default_value = "auto")]
    pub(crate) reshard_after_forward: String,
}

impl Args {
    /// Where the trainers compute (`--device`, `--precision`, `--reshard-after-forward`).
    pub(crate) fn placement(&self) -> anyhow::Result<Placement> {
        Ok(odc::recipe::placement(
            &self.device,
            &self.precision,
            &self.reshard_after_forward,
            false,
        )?)
    }
}
