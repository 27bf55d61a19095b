//! Supervised fine-tuning of odc's reference transformer (`odc::model`, candle on the CPU) on
//! grade-school arithmetic word problems, with trainers and shard servers in one process — or
//! across processes with `odc launch`.
//!
//! ```text
//! cargo run --release --example sft                                 # generated data, ~6 min on 2 cores
//! cargo run --release --example sft -- --steps 40 --eval-every 20   # shorter
//! cargo run --release --example sft -- --data gsm8k/train.jsonl   # GSM8K: see the README
//! cargo run --release --example sft -- --checkpoint-every 50 --checkpoint-dir ckpt
//! cargo run --release --example sft -- --resume ckpt/step-50
//! cargo run --release --example sft -- --checkpoint-every 50 --checkpoint-dir ckpt --resume auto
//! cargo run --release --example sft -- --tokenizer tokenizer.json  # a Hugging Face tokenizer
//! cargo run --release --example sft -- --config sft.toml --lr 1e-3  # flags override the file
//! cargo run --release --example sft -- --model-dir Qwen2.5-0.5B-Instruct --data chat.jsonl \
//!     --export-hf out                                   # your model, your chat data, HF out
//! cargo build --release --features cli --example sft --bin odc
//! target/release/odc launch --nprocs 2 -- target/release/examples/sft --steps 20
//! target/release/odc launch --nprocs 2 --max-restarts 1 -- target/release/examples/sft \
//!     --checkpoint-every 50 --checkpoint-dir ckpt --resume auto
//! ```
//!
//! Per step: AdamW at the shard servers with linear warm-up and cosine decay, the global gradient
//! norm clipped, the loss a token mean over the minibatch's answer tokens (prompts are masked).
//! Training and evaluation take the problems whose sample fits the model's `max_seq_len` (the
//! longest quarter of the generated ones do not). Every `--eval-every` steps: exact-match accuracy
//! of greedy answers on held-out problems (the evaluation split never shares a question with
//! training), answered by one thread per trainer while the trainers wait. A progress bar shows
//! loss, tokens/s and the ETA on a terminal; otherwise plain lines. Prometheus metrics at `--metrics-addr`
//! (`odc_*` of the runtime plus `odc_sft_loss`, `odc_sft_tokens_per_second`,
//! `odc_sft_eval_accuracy`); `--trace PATH` writes every step's trainer timelines as a Chrome
//! trace. The last line is `final step=<n> loss=<f> eval_accuracy=<f>`.
//!
//! CPU threads: before anything else, `odc::model::share_cpu_threads` gives each trainer of the
//! process an equal share of the host's cores for candle's pools (unless `RAYON_NUM_THREADS` or
//! `CANDLE_NUM_THREADS` is set); the first line says what it chose.
//!
//! `--resume auto` continues from the newest complete checkpoint in `--checkpoint-dir`
//! (`odc::checkpoint::newest`), or starts from scratch when there is none (said on stderr): the
//! same command line both starts a run and continues it after a crash, as
//! `odc launch --max-restarts N` needs. In a multi-process run every rank looks before the job
//! starts and finds the same checkpoint (rank 0 writes them; the ranks share the directory).
//!
//! **A Hugging Face model** (`--model-dir DIR`: `config.json`, `model.safetensors` or shards with
//! an index, `tokenizer.json`, `tokenizer_config.json` with a `chat_template`): the model
//! (Llama 3, Qwen2/2.5, Qwen3, SmolLM2 layouts) starts from the directory's weights, each shard
//! server converting its own slice from the memory-mapped files; samples are the model's chat
//! template around each conversation, with the loss on the assistant's turns (end-of-turn token
//! included); `--data` is chat JSONL (`{"messages": [{"role", "content"}, …]}`) or GSM8K JSONL
//! (question as the user's turn, answer as the assistant's), and without `--data` the generated
//! problems as chat; evaluation prompts with the template and stops at the model's stop ids.
//! Samples longer than the model's positions are skipped, and without `--split` those longer than
//! the token budget too (with it, such a sample runs as a gang whose pieces fit the budget).
//! `--export-hf OUT` writes the trained model in Hugging Face layout at the end (bf16, or
//! `--export-dtype f32`; the model directory's config and tokenizer files carried over), which
//! `transformers`' `from_pretrained` and vLLM load.
//!
//! **LoRA** (`--lora-rank R`, `--lora-alpha`, `--lora-targets q_proj,v_proj,…`): the base model's
//! units are frozen at the shard servers (pulled, never pushed or optimised) and each block gets a
//! small adapter unit; `--export-hf OUT` then writes PEFT's layout (`adapter_config.json`,
//! `adapter_model.safetensors`), or with `--merge-lora` the merged full model.
//!
//! Memory: `--reshard-after-forward true` (FSDP2's setting; the default above 300M parameters)
//! releases each unit after its forward and re-gathers and recomputes it in the backward, so a
//! trainer holds one block's weights at a time, not the whole model; `false` keeps them (one pull
//! per unit); `N` keeps the last N stages (`odc::model::Reshard`).
//!
//! Config file (`--config PATH`, TOML): the same keys as the flags with `_` for `-`, plus a
//! `[model]` table of `ModelConfig` fields; a flag given on the command line wins.
//!
//! GPU (a build with the root crate's `cuda` feature, see `benches/gpu/build.sh`):
//! `--device cuda` trains each trainer on CUDA device `ODC_LOCAL_RANK mod device_count`
//! (`cuda:N` names one), `--precision bf16` (the default on CUDA) runs matmuls and activations
//! in bf16 with fp32 norms, softmax, loss and gradients (`odc::model::device`), `--model
//! gpu-100m` picks the ~100M-parameter preset (samples up to 2,048 tokens on a shared 80 GB GPU;
//! see `ModelConfig::gpu_100m`); evaluation then runs on the same device in fp32.
//!
//! ```text
//! odc launch --nprocs 2 --transport cuda -- sft --device cuda --model gpu-100m --steps 30
//! ```

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use candle_core::Device;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use odc::checkpoint::{self, TensorMap};
use odc::launch::{parse_ranks, Roles, World};
use odc::model::hf::peft;
use odc::model::hf::{export_hf, ExportDtype, ExportOptions, HfCheckpoint};
use odc::model::{
    evaluate_prompted, layout_units, open_device, tensor_map, transformer_job_of, ComputePrecision,
    DeviceSpec, LoraConfig, LoraTarget, ModelConfig, Objective, Placement, Reshard, Sample,
    SampleStore, Weights,
};
use odc::text::{ArithTask, ByteTokenizer, HfTokenizer, Message, Problem, TextFormat, Tokenizer};
use odc::trace::{step_spans, write_chrome_trace, TraceSpan};
use odc::Job;
use odc::{
    FailurePolicy, LrSchedule, OptimizerConfig, Precision, SampleMeta, SplitPolicy, Timestamp,
    DEFAULT_STEP_TIMEOUT,
};
use serde::{Deserialize, Serialize};

/// Every setting, from flags or the config file (`None`: not given there).
#[derive(Debug, Clone, Default, Parser, Serialize, Deserialize)]
#[command(about = "Supervised fine-tuning on odc (see the example's docs)")]
#[serde(default, deny_unknown_fields)]
struct Opts {
    /// TOML file with any of these settings (flags override it).
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// Optimizer steps (minibatches) to train in total, counting those of a resumed run.
    #[arg(long)]
    steps: Option<u64>,
    /// Problems per minibatch.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    lr: Option<f32>,
    #[arg(long)]
    warmup_steps: Option<u64>,
    /// Floor of the cosine decay, as a fraction of the peak.
    #[arg(long)]
    min_lr_ratio: Option<f64>,
    #[arg(long)]
    weight_decay: Option<f32>,
    /// Clip the global gradient norm to this.
    #[arg(long)]
    clip_grad_norm: Option<f64>,
    /// Trainers and shard servers (in one process; with `odc launch`, one of each per rank by
    /// default).
    #[arg(long)]
    trainers: Option<usize>,
    #[arg(long)]
    servers: Option<usize>,
    /// Most tokens in one packed micro-batch.
    #[arg(long)]
    token_budget: Option<u64>,
    /// Seed of the generated problems.
    #[arg(long)]
    seed: Option<u64>,
    /// GSM8K-format JSONL to train on instead of generated problems.
    #[arg(long)]
    data: Option<PathBuf>,
    /// GSM8K-format JSONL to evaluate on (default: the generated evaluation split, or nothing
    /// held out when `--data` is given without it).
    #[arg(long)]
    eval_data: Option<PathBuf>,
    /// Evaluate every this many steps (0: only at the end).
    #[arg(long)]
    eval_every: Option<u64>,
    /// Held-out problems per evaluation.
    #[arg(long)]
    eval_problems: Option<usize>,
    /// Longest greedy answer at evaluation, in tokens (also bounded by the model's `max_seq_len`).
    #[arg(long)]
    max_new_tokens: Option<usize>,
    /// Write a checkpoint every this many steps (0: never) ...
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// ... into DIR/step-<N>.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Keep only the newest N complete checkpoints: older ones are deleted once a newer one is
    /// written and complete (0, the default: keep all).
    #[arg(long)]
    keep_last: Option<usize>,
    /// Continue from DIR/step-<N>; `auto`: from the newest complete checkpoint in
    /// --checkpoint-dir, or from scratch when it holds none (`./auto` is a directory named auto).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Prometheus endpoint (each rank serves on this port + its rank; port 0 picks a free one).
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
    /// Serve no metrics.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    no_metrics: Option<bool>,
    /// Write the trainers' timelines of every step to this Chrome/Perfetto trace file.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json` instead of the byte tokenizer; the model's `vocab_size`
    /// becomes its vocabulary size unless the `[model]` table sets one (at least that large).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The generated problems' largest number (20 to 1000; default 20): fewer arithmetic facts
    /// to learn at smaller bounds.
    #[arg(long, value_parser = max_value_range())]
    max_value: Option<u64>,
    /// A Hugging Face model directory to fine-tune (its weights, tokenizer and chat template).
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// Write the trained model in Hugging Face layout to this directory at the end.
    #[arg(long)]
    export_hf: Option<PathBuf>,
    /// The export's tensors: bf16 (default) or f32.
    #[arg(long)]
    export_dtype: Option<String>,
    /// Fine-tune LoRA adapters of this rank instead of every weight (the base model frozen).
    #[arg(long)]
    lora_rank: Option<usize>,
    /// LoRA's alpha (the update is scaled by alpha / rank; default 2 · rank).
    #[arg(long)]
    lora_alpha: Option<f64>,
    /// The adapted layers, comma-separated (default all: q_proj,k_proj,v_proj,o_proj,gate_proj,
    /// up_proj,down_proj).
    #[arg(long)]
    lora_targets: Option<String>,
    /// With LoRA, --export-hf writes the merged full model instead of PEFT adapters.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    merge_lora: Option<bool>,
    /// The model (TOML `[model]` table only; default: `ModelConfig::tiny()`).
    #[arg(skip)]
    model: Option<ModelConfig>,
    /// A named model instead of a `[model]` table: tiny, gpu-100m (see `ModelConfig::preset`).
    #[arg(long = "model")]
    model_preset: Option<String>,
    /// Where the trainers compute: cpu, cuda (device ODC_LOCAL_RANK mod count) or cuda:N.
    #[arg(long)]
    device: Option<String>,
    /// The trainers' matmul and activation precision: f32, or bf16 (mixed precision; the default
    /// on CUDA).
    #[arg(long)]
    precision: Option<String>,
    /// What a trainer keeps of a unit between its forward and backward (FSDP2's
    /// `reshard_after_forward`): true (release it; re-gather and recompute in the backward),
    /// false (keep it), N (keep the last N stages), auto (true above 300M parameters).
    #[arg(long)]
    reshard_after_forward: Option<String>,
    /// Seconds one micro-batch may compute before its trainer counts as hung and is replaced
    /// (default 600, as `JobBuilder::micro_batch_timeout`; a step's deadline is 6 times it, at
    /// least an hour). Long samples on a CPU need more: one 16K-token sample of a 0.5B model
    /// takes over an hour on 2 cores.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=7 * 24 * 3600))]
    micro_batch_timeout: Option<u64>,
    /// Sequence splitting: auto (split a long sample over a gang of trainers where the planner
    /// finds it shortens the step), off (the default), or N (as auto, for samples of at least N
    /// tokens). Across processes too (`odc launch`): the exchange goes over the transport.
    #[arg(long)]
    split: Option<String>,
    /// Multi-process: the rank of each shard server, e.g. `0,1` (default: one on every rank).
    #[arg(long)]
    servers_on: Option<String>,
    /// Multi-process: the rank of each trainer, e.g. `0,1,2` (default: one on every rank).
    #[arg(long)]
    trainers_on: Option<String>,
    /// What becomes of a failed trainer's slot: respawn (the default, up to 3 times) or drop
    /// (the job goes on without it).
    #[arg(long)]
    on_trainer_failure: Option<String>,
}

/// The settings with defaults filled in.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Settings {
    steps: u64,
    batch_size: usize,
    lr: f32,
    warmup_steps: u64,
    min_lr_ratio: f64,
    weight_decay: f32,
    clip_grad_norm: f64,
    trainers: usize,
    servers: usize,
    token_budget: u64,
    seed: u64,
    data: Option<PathBuf>,
    eval_data: Option<PathBuf>,
    eval_every: u64,
    eval_problems: usize,
    max_new_tokens: usize,
    checkpoint_every: u64,
    checkpoint_dir: PathBuf,
    /// 0 in checkpoints written before this setting existed: keep all.
    #[serde(default)]
    keep_last: usize,
    metrics_addr: SocketAddr,
    no_metrics: bool,
    trace: Option<PathBuf>,
    /// `None`: the byte tokenizer (also in checkpoints written before this setting existed).
    #[serde(default)]
    tokenizer: Option<PathBuf>,
    /// The generated problems' largest number.
    #[serde(default = "max_value_before_the_setting")]
    max_value: u64,
    model: ModelConfig,
    /// Where the trainers compute (`cpu` in checkpoints written before this setting existed).
    #[serde(default = "cpu")]
    device: String,
    #[serde(default = "fp32")]
    precision: String,
    #[serde(default = "auto")]
    reshard_after_forward: String,
    /// Seconds (600 in checkpoints written before this setting existed).
    #[serde(default = "ten_minutes")]
    micro_batch_timeout: u64,
    /// A Hugging Face model directory (`None`: odc's own model, in checkpoints written before
    /// this setting existed too).
    #[serde(default)]
    model_dir: Option<PathBuf>,
    #[serde(default)]
    export_hf: Option<PathBuf>,
    #[serde(default = "bf16")]
    export_dtype: String,
    #[serde(default)]
    merge_lora: bool,
    /// `off` in checkpoints written before this setting existed.
    #[serde(default = "off")]
    split: String,
    #[serde(default)]
    servers_on: Option<String>,
    #[serde(default)]
    trainers_on: Option<String>,
    /// `respawn` or `drop` (`respawn` in checkpoints written before this setting existed).
    #[serde(default = "respawn")]
    on_trainer_failure: String,
}

fn respawn() -> String {
    "respawn".into()
}

/// `--on-trainer-failure`.
fn failure_policy(text: &str) -> anyhow::Result<FailurePolicy> {
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
    fn merged(self) -> anyhow::Result<(Opts, Option<PathBuf>)> {
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

    fn settings(self) -> anyhow::Result<Settings> {
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
        export_dtype_of(&export_dtype)?;
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
        let on_trainer_failure = self.on_trainer_failure.unwrap_or_else(respawn);
        failure_policy(&on_trainer_failure)?;
        for (flag, ranks) in [
            ("servers-on", &self.servers_on),
            ("trainers-on", &self.trainers_on),
        ] {
            if let Some(text) = ranks {
                parse_ranks(text).map_err(|e| anyhow::anyhow!("--{flag}: {e}"))?;
            }
        }
        Ok(Settings {
            steps: self.steps.unwrap_or(500),
            batch_size: self.batch_size.unwrap_or(8),
            lr: self.lr.unwrap_or(3e-3),
            warmup_steps: self.warmup_steps.unwrap_or(20),
            min_lr_ratio: self.min_lr_ratio.unwrap_or(0.1),
            weight_decay: self.weight_decay.unwrap_or(0.01),
            clip_grad_norm: self.clip_grad_norm.unwrap_or(1.0),
            trainers: self.trainers.unwrap_or(2),
            servers: self.servers.unwrap_or(2),
            token_budget: self.token_budget.unwrap_or(4096),
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
            trace: self.trace,
            tokenizer: self.tokenizer,
            max_value: self.max_value.unwrap_or(DEFAULT_MAX_VALUE),
            model,
            device,
            precision,
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
        })
    }
}

/// `--export-hf`: the model in Hugging Face layout, or under LoRA its adapters in PEFT's layout
/// (the merged model with `--merge-lora`); what was written, in words.
fn export(settings: &Settings, out: &Path, params: &[Vec<f32>]) -> anyhow::Result<String> {
    let model = &settings.model;
    if model.lora.is_some() && !settings.merge_lora {
        let base = settings
            .model_dir
            .as_ref()
            .map_or_else(|| "odc".to_string(), |d| d.display().to_string());
        peft::export_peft(out, model, params, &base)
            .with_context(|| format!("--export-hf {}", out.display()))?;
        return Ok("PEFT adapters: adapter_config.json, adapter_model.safetensors".into());
    }
    let (config, units) = match &model.lora {
        Some(_) => (peft::base_config(model), peft::merge(model, params)?),
        None => (model.clone(), params.to_vec()),
    };
    let summary = export_hf(
        out,
        &config,
        &units,
        &ExportOptions {
            dtype: export_dtype_of(&settings.export_dtype)?,
            source: settings.model_dir.as_deref(),
            ..ExportOptions::default()
        },
    )
    .with_context(|| format!("--export-hf {}", out.display()))?;
    Ok(format!(
        "{}{} safetensors file(s), {:.1} MB of {} tensors, tokenizer files: {}",
        if model.lora.is_some() {
            "adapters merged: "
        } else {
            ""
        },
        summary.safetensors_files.len(),
        summary.tensor_bytes as f64 / 1e6,
        settings.export_dtype,
        if summary.tokenizer_files.is_empty() {
            "none".to_string()
        } else {
            summary.tokenizer_files.join(", ")
        }
    ))
}

/// `--export-dtype`.
fn export_dtype_of(name: &str) -> anyhow::Result<ExportDtype> {
    match name {
        "bf16" => Ok(ExportDtype::Bf16),
        "f32" => Ok(ExportDtype::F32),
        other => bail!("--export-dtype {other:?}: expected bf16 or f32"),
    }
}

/// The training data: generated problems, a file's problems or conversations in order (cycled).
#[derive(Clone)]
enum Dataset {
    Generated(ArithTask),
    File(Arc<Vec<Problem>>),
    Chat(Arc<Vec<Vec<Message>>>),
}

impl Dataset {
    /// `--data PATH`: chat JSONL when its first record has `messages`, else GSM8K JSONL.
    fn load(path: &Path) -> anyhow::Result<Dataset> {
        // The first non-empty line says which; the loader then reads the file once.
        use std::io::BufRead;
        let file = std::fs::File::open(path)
            .with_context(|| format!("reading the training data {}", path.display()))?;
        let first = std::io::BufReader::new(file)
            .lines()
            .map_while(Result::ok)
            .find(|l| !l.trim().is_empty())
            .unwrap_or_default();
        let chat = serde_json::from_str::<serde_json::Value>(&first)
            .map(|v| v.get("messages").is_some())
            .unwrap_or(false);
        let dataset = if chat {
            Dataset::Chat(Arc::new(odc::text::conversation::load(path)?))
        } else {
            Dataset::File(Arc::new(
                odc::text::gsm8k::load(path).context("loading the training data")?,
            ))
        };
        let empty = match &dataset {
            Dataset::File(records) => records.is_empty(),
            Dataset::Chat(records) => records.is_empty(),
            Dataset::Generated(_) => false,
        };
        if empty {
            bail!("{}: no training records", path.display());
        }
        Ok(dataset)
    }

    /// Record `index` as a conversation (a problem as the user's question and the assistant's
    /// answer).
    fn messages(&self, index: u64) -> Vec<Message> {
        match self {
            Dataset::Chat(records) => records[(index % records.len() as u64) as usize].clone(),
            other => other
                .problem(index)
                .map(|p| p.messages())
                .unwrap_or_default(),
        }
    }

    /// Record `index` as a problem (`None` for a conversation).
    fn problem(&self, index: u64) -> Option<Problem> {
        match self {
            Dataset::Generated(task) => Some(task.problem(index)),
            Dataset::File(records) => {
                Some(records[(index % records.len() as u64) as usize].clone())
            }
            Dataset::Chat(_) => None,
        }
    }
}

/// Record `index` of `dataset` as a training sample (loss on the answer / the assistant).
fn sample_of(
    format: &TextFormat,
    dataset: &Dataset,
    index: u64,
) -> Result<odc::text::Sample, String> {
    let sample = match dataset.problem(index) {
        Some(problem) => format.problem_sample(&problem),
        None => format.chat_sample(&dataset.messages(index)),
    };
    sample.map_err(|e| format!("record {index}: {e}"))
}

/// Where the data stands (saved in checkpoints): the next problem index to read.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
struct DataPosition {
    next: u64,
}

/// What `state.json` holds besides the step.
#[derive(Debug, Serialize, Deserialize)]
struct Saved {
    settings: Settings,
    data: DataPosition,
}

/// The run's text format: a model directory's tokenizer and chat template, or plain text with
/// `--tokenizer` (else bytes). Without a model directory, the model's `vocab_size` becomes the
/// tokenizer's size unless the `[model]` table set one, which must then hold every id.
fn load_format(settings: &mut Settings, model_given: bool) -> anyhow::Result<TextFormat> {
    if let Some(dir) = &settings.model_dir {
        let tokenizer = HfTokenizer::from_dir(dir)?;
        if tokenizer.chat_template().is_none() {
            bail!(
                "{}: its tokenizer_config.json has no chat_template (a base model): \
                 fine-tune an instruct model, or add a template",
                dir.display()
            );
        }
        if settings.model.vocab_size < tokenizer.vocab_size() {
            bail!(
                "{}: config.json's vocab_size = {} is smaller than the tokenizer's {} ids",
                dir.display(),
                settings.model.vocab_size,
                tokenizer.vocab_size()
            );
        }
        return Ok(TextFormat::Chat(Arc::new(tokenizer)));
    }
    let (tokenizer, name): (Arc<dyn Tokenizer>, String) = match &settings.tokenizer {
        Some(path) => (
            Arc::new(HfTokenizer::from_file(path)?),
            format!("the tokenizer {}", path.display()),
        ),
        None => (Arc::new(ByteTokenizer), "the byte tokenizer".into()),
    };
    let ids = tokenizer.vocab_size();
    if !model_given {
        settings.model.vocab_size = ids;
    } else if settings.model.vocab_size < ids {
        bail!(
            "the [model] table's vocab_size = {} is smaller than the {ids} ids of {name}: \
             raise it to at least {ids}",
            settings.model.vocab_size
        );
    }
    Ok(TextFormat::Plain(tokenizer))
}

/// Whether two `tokenizer` settings are the same file (or both the byte tokenizer).
fn same_tokenizer(a: &Option<PathBuf>, b: &Option<PathBuf>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => {
            a == b || matches!((a.canonicalize(), b.canonicalize()), (Ok(a), Ok(b)) if a == b)
        }
        _ => false,
    }
}

/// The next `batch` records from `position` whose sample fits `max_len`; advances `position`.
fn next_minibatch(
    format: &TextFormat,
    dataset: &Dataset,
    position: &mut DataPosition,
    batch: usize,
    max_len: usize,
) -> odc::Result<Vec<SampleMeta>> {
    let mut out = Vec::with_capacity(batch);
    let mut skipped = 0;
    while out.len() < batch {
        let index = position.next;
        position.next += 1;
        let sample = sample_of(format, dataset, index).map_err(odc::Error::user)?;
        if sample.len() > max_len {
            skipped += 1;
            if skipped > 100 * batch {
                return Err(odc::Error::Config(format!(
                    "no record near index {index} fits {max_len} tokens"
                )));
            }
            continue;
        }
        out.push(sample.meta(index));
    }
    Ok(out)
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,ractor_cluster=error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let (opts, resume) = Opts::parse().merged()?;
    let model_given = opts.model.is_some() || opts.model_preset.is_some();
    let resume = match resume {
        Some(path) if path.as_os_str() == "auto" => {
            if opts.checkpoint_dir.is_none() {
                bail!(
                    "--resume auto continues from the newest checkpoint in --checkpoint-dir, \
                     and none was given (flag or config file)"
                );
            }
            Some(Resume::Newest)
        }
        Some(path) => Some(Resume::From(path)),
        None => None,
    };
    let settings = opts.settings()?;
    let world = World::from_env().context("reading the launcher's environment")?;
    // Before any thread exists: each trainer of this process gets its share of the cores (one
    // trainer per process under `odc launch`).
    let trainers_here = if world.world_size > 1 {
        1
    } else {
        settings.trainers
    };
    let threads = odc::model::share_cpu_threads(trainers_here);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(run(settings, model_given, resume, world, threads))
}

/// `--resume`: a checkpoint, or the newest in `--checkpoint-dir` (`auto`).
enum Resume {
    From(PathBuf),
    Newest,
}

/// The run, phase by phase: set-up (the model directory, the text format, a checkpoint to resume,
/// the data), the job, the training loop with its evaluations and checkpoints, the export.
async fn run(
    mut settings: Settings,
    model_given: bool,
    resume: Option<Resume>,
    world: World,
    threads: odc::model::CpuThreads,
) -> anyhow::Result<()> {
    // A model directory's weights, every tensor checked before anything else runs.
    let checkpoint = match &settings.model_dir {
        Some(dir) => Some(
            HfCheckpoint::open(dir).with_context(|| format!("--model-dir {}", dir.display()))?,
        ),
        None => None,
    };
    let format = load_format(&mut settings, model_given)?;
    let run = Run {
        tensors: tensor_map(&settings.model)?,
        settings,
        format,
        lead: world.rank == 0,
        rank: world.rank,
        world_size: world.world_size,
    };
    let (position, resumed) = run.resume(resume)?;
    let data = run.data()?;
    run.serve_metrics()?;
    let feed = Arc::new(Mutex::new(position));
    let placement = run.placement()?;
    let eval = run.evaluator(&placement)?;
    let trainers = run.trainers();
    let mut job = run.build_job(checkpoint.as_ref(), &data, placement, &feed, world, resumed)?;
    let settings = &run.settings;
    let first = job.steps_done();
    if first > settings.steps {
        bail!(
            "the run is already at step {first}, past --steps {}: raise --steps",
            settings.steps
        );
    }
    if first == settings.steps {
        // A restarted attempt of a run whose last checkpoint is its last step: done.
        run.say(format!(
            "sft: the checkpoint is at step {first} of {}: nothing left to train",
            settings.steps
        ));
        // The attempt that wrote it may have died before its export.
        export_at_end(settings, &mut job, run.lead, &|l| run.say(l)).await?;
        job.shutdown().await;
        return Ok(());
    }
    run.say(format!(
        "sft: {} parameters, {} steps of {} problems, {} trainers, {} servers, device {} ({}), {threads}",
        odc::model::param_count(&settings.model)?,
        settings.steps,
        settings.batch_size,
        trainers,
        if run.world_size > 1 {
            run.world_size as usize
        } else {
            settings.servers
        },
        settings.device,
        settings.precision
    ));
    let trained = run
        .train(&mut job, &data, &eval, &feed, first, trainers)
        .await?;
    run.finish(job, trained, first).await
}

/// What every phase of the run reads.
struct Run {
    settings: Settings,
    format: TextFormat,
    /// The model's tensor names and shapes per unit (the checkpoints').
    tensors: TensorMap,
    /// Rank 0 prints, evaluates, checkpoints and exports.
    lead: bool,
    rank: u32,
    world_size: u32,
}

/// The data of a run: the training set, the longest sample it takes, the held-out problems.
struct Data {
    dataset: Dataset,
    max_len: usize,
    eval_set: Vec<Problem>,
}

/// Where the lead answers the held-out problems: the trainers' device (in fp32), and how many
/// threads answer at once.
struct Evaluator {
    device: Device,
    workers: usize,
}

/// What the training loop measured.
struct Trained {
    started: Instant,
    tokens: u64,
    loss: f64,
    accuracy: f64,
    spans: Vec<TraceSpan>,
}

impl Run {
    /// Prints `line` on the lead.
    fn say(&self, line: String) {
        if self.lead {
            println!("{line}");
        }
    }

    /// Resume: the checkpoint's state and data position; its model must be this run's. The
    /// checkpoint is opened (mapped and verified), not read: each shard server reads its ranges.
    fn resume(
        &self,
        resume: Option<Resume>,
    ) -> anyhow::Result<(DataPosition, Option<checkpoint::Opened>)> {
        let settings = &self.settings;
        let resume = match resume {
            Some(Resume::From(dir)) => {
                let opened = checkpoint::open(&dir, &self.tensors)
                    .with_context(|| format!("resuming from {}", dir.display()))?;
                Some((dir, opened))
            }
            Some(Resume::Newest) => {
                let newest = checkpoint::open_newest(&settings.checkpoint_dir, &self.tensors)
                    .context("--resume auto: looking for the newest checkpoint")?;
                if newest.is_none() && self.lead {
                    eprintln!(
                        "--resume auto: no checkpoint in {}: starting from scratch",
                        settings.checkpoint_dir.display()
                    );
                }
                newest
            }
            None => None,
        };
        let Some((dir, state)) = resume else {
            return Ok((DataPosition { next: 0 }, None));
        };
        let saved: Saved = serde_json::from_value(state.extra().clone())
            .with_context(|| format!("{}: state.json has no sft settings", dir.display()))?;
        if !same_tokenizer(&saved.settings.tokenizer, &settings.tokenizer) {
            let name = |t: &Option<PathBuf>| match t {
                Some(path) => path.display().to_string(),
                None => "the byte tokenizer".into(),
            };
            bail!(
                "{}: the checkpoint's tokenizer is {}, this run's {}",
                dir.display(),
                name(&saved.settings.tokenizer),
                name(&settings.tokenizer)
            );
        }
        if saved.settings.model != settings.model {
            bail!(
                "{}: the checkpoint's model is {:?}, this run's {:?}",
                dir.display(),
                saved.settings.model,
                settings.model
            );
        }
        self.say(format!(
            "resuming from {} at step {} (problem {})",
            dir.display(),
            state.step(),
            saved.data.next
        ));
        Ok((saved.data, Some(state)))
    }

    /// The training data, the longest sample it takes, and the held-out problems that fit.
    fn data(&self) -> anyhow::Result<Data> {
        let settings = &self.settings;
        let dataset = match &settings.data {
            Some(path) => Dataset::load(path)?,
            None => Dataset::Generated(
                ArithTask::train(settings.seed).with_max_value(settings.max_value),
            ),
        };
        if matches!(dataset, Dataset::Chat(_)) && !self.format.is_chat() {
            bail!(
                "{}: chat data needs the model's chat template: give --model-dir",
                settings
                    .data
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            );
        }
        // Samples longer than the model's positions are skipped, and without splitting those
        // longer than a micro-batch too (with it, the planner cuts them into pieces within the
        // budget).
        let splits = settings
            .split
            .parse::<odc::SplitPolicy>()
            .is_ok_and(|p| p != odc::SplitPolicy::Off);
        let max_len = if splits {
            settings.model.max_seq_len
        } else {
            settings
                .model
                .max_seq_len
                .min(usize::try_from(settings.token_budget).unwrap_or(usize::MAX))
        };
        // Held-out problems that fit, as training skips the others.
        let wanted = settings.eval_problems;
        let eval_set: Vec<Problem> = match (&settings.eval_data, &settings.data) {
            (Some(path), _) => self.format.fitting(
                odc::text::gsm8k::load(path).context("loading the evaluation data")?,
                max_len,
                wanted,
            )?,
            (None, Some(_)) => Vec::new(),
            (None, None) => self.format.fitting(
                ArithTask::eval(settings.seed)
                    .with_max_value(settings.max_value)
                    .problems(0..(wanted as u64).saturating_mul(100)),
                max_len,
                wanted,
            )?,
        };
        Ok(Data {
            dataset,
            max_len,
            eval_set,
        })
    }

    /// Prometheus metrics at `--metrics-addr` (its port plus the rank), unless `--no-metrics`.
    fn serve_metrics(&self) -> anyhow::Result<()> {
        if self.settings.no_metrics {
            return Ok(());
        }
        let mut addr = self.settings.metrics_addr;
        if addr.port() != 0 {
            addr.set_port(addr.port().saturating_add(self.rank as u16));
        }
        odc::metrics::serve(addr)?;
        self.say(format!("metrics: http://{addr}/metrics"));
        Ok(())
    }

    /// The trainers' device, precision and resharding.
    fn placement(&self) -> anyhow::Result<Placement> {
        let settings = &self.settings;
        Ok(Placement {
            device: settings.device.parse()?,
            precision: settings.precision.parse()?,
            reshard: settings
                .reshard_after_forward
                .parse()
                .map_err(|e| anyhow::anyhow!("--{e}"))?,
            local_rank: odc::launch::local_rank(),
            kernels: Default::default(),
        })
    }

    /// Evaluation (on the lead) runs while its trainers wait, on their device in fp32: one
    /// thread per trainer it holds on the CPU, one answer at a time on a GPU.
    fn evaluator(&self, placement: &Placement) -> anyhow::Result<Evaluator> {
        if placement.device.is_cuda() {
            return Ok(Evaluator {
                device: open_device(placement.device, placement.local_rank)?,
                workers: 1,
            });
        }
        Ok(Evaluator {
            device: Device::Cpu,
            workers: if self.world_size > 1 {
                1
            } else {
                self.settings.trainers
            },
        })
    }

    /// Trainers of the job (of every rank).
    fn trainers(&self) -> usize {
        match (&self.settings.trainers_on, self.world_size > 1) {
            (Some(ranks), true) => parse_ranks(ranks).map(|r| r.len()).unwrap_or(1),
            (None, true) => self.world_size as usize,
            (_, false) => self.settings.trainers,
        }
    }

    /// The job: the model's units (a model directory's, each shard server converting its own
    /// slice from the mapped files, or the seeded initialisation), AdamW with warm-up and cosine
    /// decay, the data read from `feed`'s position, and the processes' roles.
    fn build_job(
        &self,
        checkpoint: Option<&HfCheckpoint>,
        data: &Data,
        placement: Placement,
        feed: &Arc<Mutex<DataPosition>>,
        world: World,
        resumed: Option<checkpoint::Opened>,
    ) -> anyhow::Result<Job> {
        let settings = &self.settings;
        let model = settings.model.clone();
        let store_data = data.dataset.clone();
        let store_format = self.format.clone();
        let store: Arc<dyn SampleStore> = Arc::new(move |index: u64| {
            Ok(Sample::from(&sample_of(&store_format, &store_data, index)?))
        });
        // Every rank opens the model directory: it must be on a filesystem they share.
        let units = match checkpoint {
            Some(checkpoint) => peft::adapted_units(&model, checkpoint.unit_specs())?,
            None => layout_units(&model)?,
        };
        let mut builder =
            transformer_job_of(&model, units, store, Objective::CrossEntropy, placement)?
                .optimizer(OptimizerConfig::AdamW {
                    lr: settings.lr,
                    beta1: 0.9,
                    beta2: 0.95,
                    eps: 1e-8,
                    weight_decay: settings.weight_decay,
                })
                .lr_schedule(LrSchedule::WarmupCosine {
                    warmup_steps: settings.warmup_steps.min(settings.steps),
                    total_steps: settings.steps,
                    min_ratio: settings.min_lr_ratio,
                })
                .clip_grad_norm(settings.clip_grad_norm)
                .micro_batch_timeout(Duration::from_secs(settings.micro_batch_timeout))
                .step_timeout(DEFAULT_STEP_TIMEOUT.max(Duration::from_secs(
                    settings.micro_batch_timeout.saturating_mul(6),
                )))
                .token_budget(settings.token_budget)
                .sequence_parallel(
                    settings
                        .split
                        .parse::<SplitPolicy>()
                        .map_err(|e| anyhow::anyhow!("--split: {e}"))?,
                )
                .pull_precision(Precision::F32);
        let data_source = data.dataset.clone();
        let (batch, max_len) = (settings.batch_size, data.max_len);
        let fed = feed.clone();
        let data_format = self.format.clone();
        builder = builder.data(move |_step: u64| {
            let mut at = fed.lock().unwrap_or_else(|e| e.into_inner());
            next_minibatch(&data_format, &data_source, &mut at, batch, max_len)
        });
        builder = builder
            .failure_policy(failure_policy(&settings.on_trainer_failure)?)
            .keep_last_checkpoints(settings.keep_last);
        if self.world_size > 1 {
            builder = builder.world(world);
            if settings.servers_on.is_some() || settings.trainers_on.is_some() {
                let ranks = |flag: &str, text: &Option<String>| match text {
                    Some(text) => parse_ranks(text).map_err(|e| anyhow::anyhow!("--{flag}: {e}")),
                    None => Ok((0..self.world_size).collect()),
                };
                builder = builder.roles(Roles::explicit(
                    ranks("servers-on", &settings.servers_on)?,
                    ranks("trainers-on", &settings.trainers_on)?,
                ));
            }
        } else {
            builder = builder
                .trainers(settings.trainers)
                .servers(settings.servers);
        }
        if let Some(state) = resumed {
            builder = builder.resume_from(state);
        }
        builder.build().context("building the job")
    }

    /// Steps `first..--steps`: the loss and rate (a progress bar on a terminal, else a line
    /// every 10 steps), evaluations every `--eval-every` and at the end, asynchronous
    /// checkpoints every `--checkpoint-every` and at the end.
    async fn train(
        &self,
        job: &mut Job,
        data: &Data,
        eval: &Evaluator,
        feed: &Arc<Mutex<DataPosition>>,
        first: u64,
        trainers: usize,
    ) -> anyhow::Result<Trained> {
        let settings = &self.settings;
        let bar = if self.lead && std::io::stdout().is_terminal() {
            let bar = ProgressBar::new(settings.steps);
            bar.set_style(ProgressStyle::with_template(
                "{bar:30} {pos}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
            )?);
            bar.set_position(first);
            bar
        } else {
            ProgressBar::hidden()
        };
        let print = |line: String| {
            if self.lead {
                bar.suspend(|| println!("{line}"));
            }
        };
        let mut trained = Trained {
            started: Instant::now(),
            tokens: 0,
            loss: f64::NAN,
            accuracy: f64::NAN,
            spans: Vec::new(),
        };
        let mut origin: Option<Timestamp> = None;
        let mut smoothed = f64::NAN;
        for step in first..settings.steps {
            let s = job.step().await.with_context(|| format!("step {step}"))?;
            let position = *feed.lock().unwrap_or_else(|e| e.into_inner());
            trained.tokens += s.tokens;
            trained.loss = s.loss;
            let loss = s.loss;
            smoothed = if smoothed.is_nan() {
                loss
            } else {
                0.9 * smoothed + 0.1 * loss
            };
            let rate = trained.tokens as f64 / trained.started.elapsed().as_secs_f64();
            metrics::gauge!("odc_sft_loss").set(loss);
            metrics::gauge!("odc_sft_tokens_per_second").set(rate);
            if settings.trace.is_some() {
                let origin = *origin.get_or_insert(s.started);
                trained.spans.extend(step_spans(&s, origin, trainers));
            }
            let done = step + 1;
            bar.set_position(done);
            bar.set_message(format!("loss {smoothed:.4}  {rate:.0} tok/s"));
            // A terminal has the bar; a pipe or a log gets a line every 10 steps.
            if bar.is_hidden() && (done % 10 == 0 || done == first + 1 || done == settings.steps) {
                let split = if s.gangs.is_empty() {
                    String::new()
                } else {
                    format!("  split {:?}", s.gangs)
                };
                print(format!(
                    "step {done:4}/{}  loss {loss:.4}  grad-norm {:.3}  {rate:.0} tok/s  {:.0} ms/step{split}",
                    settings.steps,
                    s.grad_norm,
                    s.wall.as_secs_f64() * 1e3
                ));
            }
            let last = done == settings.steps;
            let evaluate_now = !data.eval_set.is_empty()
                && (last || (settings.eval_every > 0 && done % settings.eval_every == 0));
            if self.lead && evaluate_now {
                trained.accuracy = self.evaluate(job, data, eval, done, &print).await?;
            }
            if self.lead
                && settings.checkpoint_every > 0
                && (done % settings.checkpoint_every == 0 || last)
            {
                self.checkpoint(job, position, &print).await?;
            }
        }
        if let Some(dir) = job.wait_checkpoint().await? {
            checkpoint_written(&dir, &print);
        }
        bar.finish_and_clear();
        Ok(trained)
    }

    /// Exact-match accuracy of greedy answers to the held-out problems, after step `done`.
    async fn evaluate(
        &self,
        job: &mut Job,
        data: &Data,
        eval: &Evaluator,
        done: u64,
        print: &dyn Fn(String),
    ) -> anyhow::Result<f64> {
        let params = job.parameters().await?;
        let weights = Weights::from_units(&self.settings.model, &params, &eval.device)?;
        let t = Instant::now();
        let prompt = |p: &Problem| self.format.prompt(&p.question);
        let tokenizer = self.format.tokenizer();
        let e = evaluate_prompted(
            &weights,
            &*tokenizer,
            &data.eval_set,
            self.settings.max_new_tokens,
            eval.workers,
            &prompt,
        )?;
        let accuracy = e.accuracy();
        metrics::gauge!("odc_sft_eval_accuracy").set(accuracy);
        print(format!(
            "eval step {done}: accuracy {:.3} ({}/{})  mean answer {:.0} tokens  ({:.1} s)\n  e.g. {:?}",
            accuracy,
            e.correct,
            e.problems,
            e.mean_answer_tokens,
            t.elapsed().as_secs_f64(),
            e.example.unwrap_or_default().chars().take(120).collect::<String>()
        ));
        Ok(accuracy)
    }

    /// A checkpoint of the job at the data's `position`: sharded and asynchronous, every
    /// server copies its shards now and writes them while training goes on; this rank
    /// publishes the directory. The previous one is complete when the next starts (and at the
    /// end).
    async fn checkpoint(
        &self,
        job: &mut Job,
        position: DataPosition,
        print: &dyn Fn(String),
    ) -> anyhow::Result<()> {
        let saved = Saved {
            settings: self.settings.clone(),
            data: position,
        };
        let done = job
            .checkpoint_async(
                &self.settings.checkpoint_dir,
                &self.tensors,
                &serde_json::to_value(&saved)?,
            )
            .await?;
        if let Some(dir) = done {
            checkpoint_written(&dir, print);
        }
        Ok(())
    }

    /// The export, the trace, the rate, and the last line.
    async fn finish(&self, mut job: Job, trained: Trained, first: u64) -> anyhow::Result<()> {
        let settings = &self.settings;
        export_at_end(settings, &mut job, self.lead, &|l| self.say(l)).await?;
        if let (Some(path), true) = (&settings.trace, self.lead) {
            write_chrome_trace(path, &trained.spans, "odc sft")?;
            self.say(format!("trace: {}", path.display()));
        }
        let secs = trained.started.elapsed().as_secs_f64();
        self.say(format!(
            "{} steps in {secs:.1} s: {:.0} tokens/s",
            settings.steps - first,
            trained.tokens as f64 / secs
        ));
        job.shutdown().await;
        println!(
            "final step={} loss={} eval_accuracy={}",
            settings.steps, trained.loss, trained.accuracy
        );
        Ok(())
    }
}

/// `--export-hf` once the run's steps are done (the lead only).
async fn export_at_end(
    settings: &Settings,
    job: &mut Job,
    lead: bool,
    say: &dyn Fn(String),
) -> anyhow::Result<()> {
    if let (Some(out), true) = (&settings.export_hf, lead) {
        let t = Instant::now();
        let params = job.parameters().await?;
        let what = export(settings, out, &params)?;
        say(format!(
            "exported: {} ({what}; {:.1} s)",
            out.display(),
            t.elapsed().as_secs_f64()
        ));
    }
    Ok(())
}

/// A checkpoint is complete (and `--keep-last` applied by the job, on every host): say so.
fn checkpoint_written(dir: &std::path::Path, print: &dyn Fn(String)) {
    print(format!("checkpoint: {}", dir.display()));
}
