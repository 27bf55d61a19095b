//! The example's settings: every flag, also a key of a `--config FILE.toml` (flags win over the
//! file), and the settings with their defaults filled in, which checkpoints carry.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Parser;
use odc::model::{ComputePrecision, DeviceSpec, LoraConfig, LoraTarget, ModelConfig, Reshard};
use odc::recipe::Fleet;
use odc::{FailurePolicy, SplitPolicy};
use serde::{Deserialize, Serialize};

/// Every setting, from flags or the config file (`None`: not given there).
#[derive(Debug, Clone, Default, Parser, Serialize, Deserialize)]
#[command(about = "Supervised fine-tuning on odc (see the example's docs)")]
#[serde(default, deny_unknown_fields)]
pub(crate) struct Opts {
    /// TOML file with any of these settings (flags override it).
    #[arg(long)]
    #[serde(skip)]
    pub(crate) config: Option<PathBuf>,
    /// Optimizer steps (minibatches) to train in total, counting those of a resumed run.
    #[arg(long)]
    pub(crate) steps: Option<u64>,
    /// Problems per minibatch.
    #[arg(long)]
    pub(crate) batch_size: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    pub(crate) lr: Option<f32>,
    #[arg(long)]
    pub(crate) warmup_steps: Option<u64>,
    /// Floor of the cosine decay, as a fraction of the peak.
    #[arg(long)]
    pub(crate) min_lr_ratio: Option<f64>,
    #[arg(long)]
    pub(crate) weight_decay: Option<f32>,
    /// Clip the global gradient norm to this.
    #[arg(long)]
    pub(crate) clip_grad_norm: Option<f64>,
    /// Trainers and shard servers in one process (default 2 of each on the CPU; on CUDA 1 of
    /// each: the GPU's one trainer, as one rank per GPU; with `odc launch`, one of each per rank
    /// by default).
    #[arg(long)]
    pub(crate) trainers: Option<usize>,
    #[arg(long)]
    pub(crate) servers: Option<usize>,
    /// Most tokens in one packed micro-batch (default 4,096 on the CPU, 16,384 on CUDA, where a
    /// micro-batch is a pass of launch-bound kernels over every unit: fewer, larger ones).
    #[arg(long)]
    pub(crate) token_budget: Option<u64>,
    /// Seed of the generated problems.
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// GSM8K-format JSONL to train on instead of generated problems.
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// GSM8K JSONL (eval loss and accuracy) or chat JSONL (eval loss) to evaluate on (default:
    /// the generated evaluation split, or nothing held out when `--data` is given without it).
    #[arg(long)]
    pub(crate) eval_data: Option<PathBuf>,
    /// Evaluate every this many steps (0: only at the end).
    #[arg(long)]
    pub(crate) eval_every: Option<u64>,
    /// Held-out problems per evaluation.
    #[arg(long)]
    pub(crate) eval_problems: Option<usize>,
    /// Longest greedy answer at evaluation, in tokens (also bounded by the model's `max_seq_len`).
    #[arg(long)]
    pub(crate) max_new_tokens: Option<usize>,
    /// Write a checkpoint every this many steps (0: never) ...
    #[arg(long)]
    pub(crate) checkpoint_every: Option<u64>,
    /// ... into DIR/step-<N>.
    #[arg(long)]
    pub(crate) checkpoint_dir: Option<PathBuf>,
    /// Keep only the newest N complete checkpoints: older ones are deleted once a newer one is
    /// written and complete (0, the default: keep all).
    #[arg(long)]
    pub(crate) keep_last: Option<usize>,
    /// Continue from DIR/step-<N>; `auto`: from the newest complete checkpoint in
    /// --checkpoint-dir, or from scratch when it holds none (`./auto` is a directory named auto).
    #[arg(long)]
    pub(crate) resume: Option<PathBuf>,
    /// Prometheus endpoint (each rank serves on this port + its rank; port 0 picks a free one).
    #[arg(long)]
    pub(crate) metrics_addr: Option<SocketAddr>,
    /// Serve no metrics.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) no_metrics: Option<bool>,
    /// Print one machine-readable `step-stats` line per step (for benchmark scripts).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) step_stats: Option<bool>,
    /// Write the trainers' timelines of every step to this Chrome/Perfetto trace file.
    #[arg(long)]
    pub(crate) trace: Option<PathBuf>,
    /// Append every logged figure (each step's, each evaluation's) to this JSONL file.
    #[arg(long)]
    pub(crate) log_jsonl: Option<PathBuf>,
    /// Write every logged figure to TensorBoard event files in this directory.
    #[arg(long)]
    pub(crate) tensorboard: Option<PathBuf>,
    /// The peak TFLOP/s that MFU is over (default: on CUDA an H100/H200's 989 bf16 dense; on
    /// the CPU the trainers' fp32 matmul rate, measured at the start).
    #[arg(long)]
    pub(crate) peak_tflops: Option<f64>,
    /// A Hugging Face `tokenizer.json` instead of the byte tokenizer; the model's `vocab_size`
    /// becomes its vocabulary size unless the `[model]` table sets one (at least that large).
    #[arg(long)]
    pub(crate) tokenizer: Option<PathBuf>,
    /// The generated problems' largest number (20 to 1000; default 20): fewer arithmetic facts
    /// to learn at smaller bounds.
    #[arg(long, value_parser = max_value_range())]
    pub(crate) max_value: Option<u64>,
    /// A Hugging Face model directory to fine-tune (its weights, tokenizer and chat template).
    #[arg(long)]
    pub(crate) model_dir: Option<PathBuf>,
    /// Write the trained model in Hugging Face layout to this directory at the end.
    #[arg(long)]
    pub(crate) export_hf: Option<PathBuf>,
    /// The export's tensors: bf16 (default) or f32.
    #[arg(long)]
    pub(crate) export_dtype: Option<String>,
    /// Fine-tune LoRA adapters of this rank instead of every weight (the base model frozen).
    #[arg(long)]
    pub(crate) lora_rank: Option<usize>,
    /// LoRA's alpha (the update is scaled by alpha / rank; default 2 · rank).
    #[arg(long)]
    pub(crate) lora_alpha: Option<f64>,
    /// The adapted layers, comma-separated (default all: q_proj,k_proj,v_proj,o_proj,gate_proj,
    /// up_proj,down_proj).
    #[arg(long)]
    pub(crate) lora_targets: Option<String>,
    /// With LoRA, --export-hf writes the merged full model instead of PEFT adapters.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) merge_lora: Option<bool>,
    /// The model (TOML `[model]` table only; default: `ModelConfig::tiny()`).
    #[arg(skip)]
    pub(crate) model: Option<ModelConfig>,
    /// A named model instead of a `[model]` table: tiny, gpu-100m (see `ModelConfig::preset`).
    #[arg(long = "model")]
    pub(crate) model_preset: Option<String>,
    /// Where the trainers compute: cpu, cuda (device ODC_LOCAL_RANK mod count) or cuda:N.
    #[arg(long)]
    pub(crate) device: Option<String>,
    /// The trainers' matmul and activation precision: f32, or bf16 (mixed precision; the default
    /// on CUDA).
    #[arg(long)]
    pub(crate) precision: Option<String>,
    /// On CUDA, move units and gradients through host memory (and keep a one-process job's
    /// servers there) instead of device to device: the path before the device-resident one.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) host_transfers: Option<bool>,
    /// What a trainer keeps of a unit between its forward and backward (FSDP2's
    /// `reshard_after_forward`): true (release it; re-gather and recompute in the backward),
    /// false (keep it), N (keep the last N stages), auto (true above 300M parameters).
    #[arg(long)]
    pub(crate) reshard_after_forward: Option<String>,
    /// Seconds one micro-batch may compute before its trainer counts as hung and is replaced
    /// (default 600, as `JobBuilder::micro_batch_timeout`; a step's deadline is 6 times it, at
    /// least an hour). Long samples on a CPU need more: one 16K-token sample of a 0.5B model
    /// takes over an hour on 2 cores.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=7 * 24 * 3600))]
    pub(crate) micro_batch_timeout: Option<u64>,
    /// Sequence splitting: auto (split a long sample over a gang of trainers where the planner
    /// finds it shortens the step), off (the default), or N (as auto, for samples of at least N
    /// tokens). Across processes too (`odc launch`): the exchange goes over the transport.
    #[arg(long)]
    pub(crate) split: Option<String>,
    /// Multi-process: the rank of each shard server, e.g. `0,1` (default: one on every rank).
    #[arg(long)]
    pub(crate) servers_on: Option<String>,
    /// Multi-process: the rank of each trainer, e.g. `0,1,2` (default: one on every rank).
    #[arg(long)]
    pub(crate) trainers_on: Option<String>,
    /// What becomes of a failed trainer's slot: respawn (the default, up to 3 times) or drop
    /// (the job goes on without it).
    #[arg(long)]
    pub(crate) on_trainer_failure: Option<String>,
    /// Relay gradient pushes through nodes of this many devices (`JobBuilder::relay_pushes`):
    /// under `odc launch` rank r is on node r / N, as torchrun numbers them; each node's pushes
    /// for another node's shards cross once per step. Default: relayed through each host where
    /// the world spans hosts (`LOCAL_WORLD_SIZE` below the world size), else straight.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096), conflicts_with = "direct_pushes")]
    pub(crate) relay_pushes: Option<u32>,
    /// Push every gradient straight to its owner, also where the world spans hosts
    /// (`JobBuilder::direct_pushes`).
    #[arg(long)]
    pub(crate) direct_pushes: bool,
}

/// The settings with defaults filled in.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Settings {
    pub(crate) steps: u64,
    pub(crate) batch_size: usize,
    pub(crate) lr: f32,
    pub(crate) warmup_steps: u64,
    pub(crate) min_lr_ratio: f64,
    pub(crate) weight_decay: f32,
    pub(crate) clip_grad_norm: f64,
    pub(crate) trainers: usize,
    pub(crate) servers: usize,
    pub(crate) token_budget: u64,
    pub(crate) seed: u64,
    pub(crate) data: Option<PathBuf>,
    pub(crate) eval_data: Option<PathBuf>,
    pub(crate) eval_every: u64,
    pub(crate) eval_problems: usize,
    pub(crate) max_new_tokens: usize,
    pub(crate) checkpoint_every: u64,
    pub(crate) checkpoint_dir: PathBuf,
    /// 0 in checkpoints written before this setting existed: keep all.
    #[serde(default)]
    pub(crate) keep_last: usize,
    pub(crate) metrics_addr: SocketAddr,
    pub(crate) no_metrics: bool,
    #[serde(default)]
    pub(crate) step_stats: bool,
    pub(crate) trace: Option<PathBuf>,
    #[serde(default)]
    pub(crate) log_jsonl: Option<PathBuf>,
    #[serde(default)]
    pub(crate) tensorboard: Option<PathBuf>,
    #[serde(default)]
    pub(crate) peak_tflops: Option<f64>,
    /// `None`: the byte tokenizer (also in checkpoints written before this setting existed).
    #[serde(default)]
    pub(crate) tokenizer: Option<PathBuf>,
    /// The generated problems' largest number.
    #[serde(default = "max_value_before_the_setting")]
    pub(crate) max_value: u64,
    pub(crate) model: ModelConfig,
    /// Where the trainers compute (`cpu` in checkpoints written before this setting existed).
    #[serde(default = "cpu")]
    pub(crate) device: String,
    #[serde(default = "fp32")]
    pub(crate) precision: String,
    #[serde(default)]
    pub(crate) host_transfers: bool,
    #[serde(default = "auto")]
    pub(crate) reshard_after_forward: String,
    /// Seconds (600 in checkpoints written before this setting existed).
    #[serde(default = "ten_minutes")]
    pub(crate) micro_batch_timeout: u64,
    /// A Hugging Face model directory (`None`: odc's own model, in checkpoints written before
    /// this setting existed too).
    #[serde(default)]
    pub(crate) model_dir: Option<PathBuf>,
    #[serde(default)]
    pub(crate) export_hf: Option<PathBuf>,
    #[serde(default = "bf16")]
    pub(crate) export_dtype: String,
    #[serde(default)]
    pub(crate) merge_lora: bool,
    /// `off` in checkpoints written before this setting existed.
    #[serde(default = "off")]
    pub(crate) split: String,
    #[serde(default)]
    pub(crate) servers_on: Option<String>,
    #[serde(default)]
    pub(crate) trainers_on: Option<String>,
    /// `respawn` or `drop` (`respawn` in checkpoints written before this setting existed).
    #[serde(default = "respawn")]
    pub(crate) on_trainer_failure: String,
    /// Off in checkpoints written before this setting existed.
    #[serde(default)]
    pub(crate) relay_pushes: Option<u32>,
    /// Off (the default: relayed where the world spans hosts) in checkpoints written before
    /// this setting existed.
    #[serde(default)]
    pub(crate) direct_pushes: bool,
}

fn respawn() -> String {
    "respawn".into()
}

/// `--on-trainer-failure`.
pub(crate) fn failure_policy(text: &str) -> anyhow::Result<FailurePolicy> {
    match text {
        "respawn" => Ok(FailurePolicy::default()),
        "drop" => Ok(FailurePolicy::Drop),
        other => anyhow::bail!("--on-trainer-failure is respawn or drop, not {other:?}"),
    }
}

fn off() -> String {
    "off".into()
}

fn bf16() -> String {
    "bf16".into()
}

fn cpu() -> String {
    "cpu".into()
}

fn auto() -> String {
    "auto".into()
}

fn fp32() -> String {
    "f32".into()
}

fn ten_minutes() -> u64 {
    600
}

/// The example's bound: the smallest the generator takes, the fewest arithmetic facts to learn,
/// so the default run shows accuracy rising within minutes on 2 CPU cores.
const DEFAULT_MAX_VALUE: u64 = odc::text::arith::MIN_MAX_VALUE;

/// The generator's own bound, which checkpoints written before this setting existed used.
fn max_value_before_the_setting() -> u64 {
    odc::text::arith::MAX_VALUE
}

/// `--max-value`: what `ArithTask::with_max_value` accepts without clamping.
fn max_value_range() -> clap::builder::RangedU64ValueParser<u64> {
    use odc::text::arith::{MAX_VALUE, MIN_MAX_VALUE};
    clap::value_parser!(u64).range(MIN_MAX_VALUE..=MAX_VALUE)
}

impl Opts {
    /// Flags over the config file: every flag given replaces the file's value.
    pub(crate) fn merged(self) -> anyhow::Result<(Opts, Option<PathBuf>)> {
        let resume = self.resume.clone();
        let Some(path) = self.config.clone() else {
            return Ok((self, resume));
        };
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading the config file {}", path.display()))?;
        let file: Opts =
            toml::from_str(&text).with_context(|| format!("config file {}", path.display()))?;
        let mut merged = serde_json::to_value(file)?;
        let flags = serde_json::to_value(&self)?;
        if let (Some(m), Some(f)) = (merged.as_object_mut(), flags.as_object()) {
            for (k, v) in f {
                if !v.is_null() {
                    m.insert(k.clone(), v.clone());
                }
            }
        }
        let opts: Opts = serde_json::from_value(merged)?;
        // The flag, else the file's `resume`.
        let resume = resume.or_else(|| opts.resume.clone());
        Ok((opts, resume))
    }

    pub(crate) fn settings(self) -> anyhow::Result<Settings> {
        let model = match (self.model, &self.model_preset, &self.model_dir) {
            (Some(_), Some(name), _) => {
                bail!("--model {name} and a [model] table were both given: keep one")
            }
            (Some(_), None, Some(dir)) | (None, Some(_), Some(dir)) => bail!(
                "--model-dir {} brings its own model: drop --model and the [model] table",
                dir.display()
            ),
            // The config only: `run` opens (and checks) the weights once.
            (_, _, Some(dir)) => {
                odc::model::hf::read_config(dir)
                    .with_context(|| format!("--model-dir {}", dir.display()))?
                    .model
            }
            (Some(model), None, None) => model,
            (None, Some(name), None) => ModelConfig::preset(name)?,
            (None, None, None) => ModelConfig::tiny(),
        };
        if self.tokenizer.is_some() && self.model_dir.is_some() {
            bail!("--model-dir brings its own tokenizer: drop --tokenizer");
        }
        let export_dtype = self.export_dtype.unwrap_or_else(bf16);
        odc::recipe::export_dtype(&export_dtype)?;
        let mut model = model;
        if let Some(rank) = self.lora_rank {
            let mut lora = LoraConfig::new(rank);
            if let Some(alpha) = self.lora_alpha {
                lora.alpha = alpha;
            }
            if let Some(targets) = &self.lora_targets {
                lora.targets = targets
                    .split(',')
                    .map(|t| LoraTarget::parse(t.trim()))
                    .collect::<Result<_, _>>()?;
            }
            model.lora = Some(lora);
            model.validate()?;
        } else if self.lora_alpha.is_some() || self.lora_targets.is_some() {
            bail!("--lora-alpha and --lora-targets go with --lora-rank");
        }
        let merge_lora = self.merge_lora.unwrap_or(false);
        if merge_lora && model.lora.is_none() {
            bail!("--merge-lora goes with --lora-rank");
        }
        let device = self.device.unwrap_or_else(cpu);
        let on_cuda = device.parse::<DeviceSpec>()?.is_cuda();
        let precision = self
            .precision
            .unwrap_or_else(|| if on_cuda { "bf16".into() } else { fp32() });
        precision.parse::<ComputePrecision>()?;
        let reshard_after_forward = self.reshard_after_forward.unwrap_or_else(auto);
        reshard_after_forward
            .parse::<Reshard>()
            .map_err(|e| anyhow::anyhow!("--{e}"))?;
        let split = self.split.unwrap_or_else(off);
        split
            .parse::<SplitPolicy>()
            .map_err(|e| anyhow::anyhow!("--split: {e}"))?;
        if let Some(tflops) = self.peak_tflops {
            odc::recipe::Peak::given(tflops).map_err(anyhow::Error::msg)?;
        }
        let on_trainer_failure = self.on_trainer_failure.unwrap_or_else(respawn);
        failure_policy(&on_trainer_failure)?;
        let settings = Settings {
            steps: self.steps.unwrap_or(500),
            batch_size: self.batch_size.unwrap_or(8),
            lr: self.lr.unwrap_or(3e-3),
            warmup_steps: self.warmup_steps.unwrap_or(20),
            min_lr_ratio: self.min_lr_ratio.unwrap_or(0.1),
            weight_decay: self.weight_decay.unwrap_or(0.01),
            clip_grad_norm: self.clip_grad_norm.unwrap_or(1.0),
            trainers: self.trainers.unwrap_or(if on_cuda { 1 } else { 2 }),
            servers: self.servers.unwrap_or(if on_cuda { 1 } else { 2 }),
            token_budget: self
                .token_budget
                .unwrap_or(if on_cuda { 16_384 } else { 4096 }),
            seed: self.seed.unwrap_or(0),
            data: self.data,
            eval_data: self.eval_data,
            eval_every: self.eval_every.unwrap_or(100),
            eval_problems: self.eval_problems.unwrap_or(100),
            max_new_tokens: self.max_new_tokens.unwrap_or(512),
            checkpoint_every: self.checkpoint_every.unwrap_or(0),
            checkpoint_dir: self
                .checkpoint_dir
                .unwrap_or_else(|| PathBuf::from("checkpoints/sft")),
            keep_last: self.keep_last.unwrap_or(0),
            metrics_addr: self
                .metrics_addr
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 9464))),
            no_metrics: self.no_metrics.unwrap_or(false),
            step_stats: self.step_stats.unwrap_or(false),
            trace: self.trace,
            log_jsonl: self.log_jsonl,
            tensorboard: self.tensorboard,
            peak_tflops: self.peak_tflops,
            tokenizer: self.tokenizer,
            max_value: self.max_value.unwrap_or(DEFAULT_MAX_VALUE),
            model,
            device,
            precision,
            host_transfers: self.host_transfers.unwrap_or(false),
            reshard_after_forward,
            micro_batch_timeout: self.micro_batch_timeout.unwrap_or_else(ten_minutes),
            model_dir: self.model_dir,
            export_hf: self.export_hf,
            export_dtype,
            merge_lora,
            split,
            servers_on: self.servers_on,
            trainers_on: self.trainers_on,
            on_trainer_failure,
            relay_pushes: self.relay_pushes,
            direct_pushes: self.direct_pushes,
        };
        settings.fleet().check()?;
        Ok(settings)
    }
}

impl Settings {
    /// The job's trainers and shard servers, and their ranks under `odc launch`.
    pub(crate) fn fleet(&self) -> Fleet {
        Fleet {
            trainers: self.trainers,
            servers: self.servers,
            servers_on: self.servers_on.clone(),
            trainers_on: self.trainers_on.clone(),
        }
    }
}
