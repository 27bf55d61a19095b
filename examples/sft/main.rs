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
//! see `ModelConfig::gpu_100m`); evaluation then runs on the same device in the same precision. On CUDA the
//! defaults are one trainer and one shard server per process (the GPU's), 16,384-token
//! micro-batches, and the device-resident data path: the servers keep their state on the GPU and
//! units and gradients move device to device (`--host-transfers`: through host memory, with host
//! servers, as before issue 40). The run ends with `host staging: B bytes in S steps`, the
//! parameter and gradient bytes that crossed host memory.
//!
//! ```text
//! odc launch --nprocs 2 --transport cuda -- sft --device cuda --model gpu-100m --steps 30
//! ```

use std::io::IsTerminal;
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
use odc::model::hf::{export_hf, ExportOptions, HfCheckpoint};
use odc::model::{
    evaluate_prompted, layout_units, open_device, published_weights, tensor_map,
    transformer_job_of, ComputePrecision, DeviceTransfers, Objective, Placement, Sample,
    SampleStore,
};
use odc::text::{ArithTask, Problem, TextFormat};
use odc::trace::{phase_totals, step_spans, write_chrome_trace, TraceSpan};
use odc::Job;
use odc::{LrSchedule, OptimizerConfig, Precision, SplitPolicy, Timestamp, DEFAULT_STEP_TIMEOUT};

mod data;
mod settings;

use data::{load_format, next_minibatch, same_tokenizer, sample_of, DataPosition, Dataset, Saved};
use settings::{export_dtype_of, failure_policy, Opts, Settings};

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

/// Where the lead answers the held-out problems: the trainers' device and precision, and how
/// many threads answer at once.
struct Evaluator {
    device: Device,
    precision: ComputePrecision,
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
            transfers: match settings.host_transfers {
                true => DeviceTransfers::Host,
                false => DeviceTransfers::Device,
            },
        })
    }

    /// Evaluation (on the lead) runs while its trainers wait, on their device in their precision
    /// (bf16's matrices and cache under `--precision bf16`), in batches of `EVAL_BATCH`
    /// problems: one thread per trainer it holds on the CPU, one on a GPU.
    fn evaluator(&self, placement: &Placement) -> anyhow::Result<Evaluator> {
        if placement.device.is_cuda() {
            return Ok(Evaluator {
                device: open_device(placement.device, placement.local_rank)?,
                precision: placement.precision,
                workers: 1,
            });
        }
        Ok(Evaluator {
            device: Device::Cpu,
            precision: placement.precision,
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
        if let Some(node_size) = settings.relay_pushes {
            builder = builder.relay_pushes(node_size);
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
            if settings.step_stats {
                print(format!(
                    "step-stats step={} wall_ms={:.3} tokens={} samples={} micro_batches={} loss={}",
                    step + 1,
                    s.wall.as_secs_f64() * 1e3,
                    s.tokens,
                    s.samples,
                    s.micro_batches,
                    s.loss
                ));
            }
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
        let weights =
            published_weights(job, &self.settings.model, 0, &eval.device, eval.precision).await?;
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
            self.say(format!(
                "phases (all trainers, all steps): {}",
                phase_totals(&trained.spans)
            ));
        }
        let secs = trained.started.elapsed().as_secs_f64();
        self.say(format!(
            "{} steps in {secs:.1} s: {:.0} tokens/s",
            settings.steps - first,
            trained.tokens as f64 / secs
        ));
        if settings.device != "cpu" {
            // This process's parameter and gradient bytes through host memory (0 when they
            // stayed on the device).
            self.say(format!(
                "host staging: {} bytes in {} steps",
                odc::model::host_staging_bytes(),
                settings.steps - first
            ));
        }
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
