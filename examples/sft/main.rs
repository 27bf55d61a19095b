//! Supervised fine-tuning of odc's reference transformer (`odc::model`, candle on the CPU) on
//! grade-school arithmetic word problems, with trainers and shard servers in one process — or
//! across processes with `odc launch`.
//!
//! ```text
//! cargo run --release --example sft                                 # generated data, 2–3½ min on 2 cores
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
//! longest quarter of the generated ones do not). Every `--eval-every` steps: the eval loss
//! (the token-mean cross-entropy on the held-out samples' answers, or on the assistant's turns
//! of `--eval-data`'s chat JSONL) and, for problems, the exact-match accuracy of greedy answers
//! (the evaluation split never shares a question with training), answered by one thread per
//! trainer while the trainers wait. A progress bar shows loss, tokens/s, MFU and the ETA on a
//! terminal; otherwise plain lines. MFU is `6 · N · tokens/s` over a peak the last lines name
//! (`--peak-tflops`; by default on CUDA an H100/H200's bf16 dense peak, on the CPU the trainers'
//! matmul rate measured at the start). `--log-jsonl PATH` appends every logged figure (per step:
//! `loss`, `grad_norm`, `tokens_per_s`, `step_ms`, `mfu`, `learning_rate`; per evaluation:
//! `eval_loss`, `eval_accuracy`) as one JSON object per line, `--tensorboard DIR` writes the same
//! to TensorBoard event files. Prometheus metrics at `--metrics-addr` (`odc_*` of the runtime
//! plus `odc_sft_loss`, `odc_sft_tokens_per_second`, `odc_sft_eval_loss`,
//! `odc_sft_eval_accuracy`); `--trace PATH` writes every step's trainer timelines as a Chrome
//! trace. The last line is `final step=<n> loss=<f> eval_accuracy=<f> eval_loss=<f>`.
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
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use odc::checkpoint::Opened;
use odc::compute::{Objective, Placement, SampleStore};
use odc::model::hf::{peft, HfCheckpoint};
use odc::model::{layout_units, tensor_map, Sample};
use odc::recipe::{
    self, adamw, checkpoint_due, Evaluator, Export, Fleet, JobRecipe, Log, Process, Progress,
    Resume,
};
use odc::text::TextFormat;
use odc::trace::{phase_totals, step_spans, write_chrome_trace};
use odc::{Job, LrSchedule, SplitPolicy, DEFAULT_STEP_TIMEOUT};

mod data;
mod settings;

use data::{load_format, next_minibatch, resumed_at, sample_of, Data, DataPosition, Saved};
use settings::{failure_policy, Opts, Settings};

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
    let resume = resume.map(|path| Resume::parse(&path));
    if resume == Some(Resume::Newest) && opts.checkpoint_dir.is_none() {
        bail!(
            "--resume auto continues from the newest checkpoint in --checkpoint-dir, and none was \
             given (flag or config file)"
        );
    }
    let settings = opts.settings()?;
    // Before any thread exists: each trainer of this process gets its share of the cores (one
    // trainer per process under `odc launch`).
    let process = Process::start(settings.trainers)?;
    process
        .runtime()?
        .block_on(run(settings, model_given, resume, process))
}

/// The run from top to bottom: set-up (the model directory, the text format, a checkpoint to
/// resume, the data, the job), the steps with their evaluations and checkpoints, the end.
async fn run(
    mut settings: Settings,
    model_given: bool,
    resume: Option<Resume>,
    process: Process,
) -> anyhow::Result<()> {
    // A model directory's weights, every tensor checked before anything else runs.
    let checkpoint = match &settings.model_dir {
        Some(dir) => Some(
            HfCheckpoint::open(dir).with_context(|| format!("--model-dir {}", dir.display()))?,
        ),
        None => None,
    };
    let format = load_format(&mut settings, model_given)?;
    let tensors = tensor_map(&settings.model)?;
    let resumed = match &resume {
        Some(resume) => resume.open(&settings.checkpoint_dir, &tensors, process.is_lead())?,
        None => None,
    };
    let (position, resumed) = resumed_at(&settings, resumed, &process)?;
    let data = Data::load(&settings, &format)?;
    if !settings.no_metrics {
        process.serve_metrics(settings.metrics_addr)?;
    }
    let feed = Arc::new(Mutex::new(position));
    let placement = recipe::placement(
        &settings.device,
        &settings.precision,
        &settings.reshard_after_forward,
        settings.host_transfers,
    )?;
    // Evaluation (on the lead) runs while its trainers wait, on their device in their precision.
    let evaluator = Evaluator::new(&placement, process.trainers_here())?;
    // The peak MFU is over (on the CPU measured now, before the job's threads start).
    let peak = match process.is_lead() {
        true => Some(recipe::peak(
            &placement,
            settings.peak_tflops,
            process.trainers_here(),
        )?),
        false => None,
    };
    let fleet = settings.fleet();
    let trainers = fleet.trainers(process.ranks());
    let mut job = build_job(
        &settings, &format, checkpoint, &data, placement, &fleet, &feed, &process, resumed,
    )?;

    let first = job.steps_done();
    if first > settings.steps {
        bail!(
            "the run is already at step {first}, past --steps {}: raise --steps",
            settings.steps
        );
    }
    if first == settings.steps {
        // A restarted attempt of a run whose last checkpoint is its last step: done (the
        // attempt that wrote it may have died before its export).
        process.say(format!(
            "sft: the checkpoint is at step {first} of {}: nothing left to train",
            settings.steps
        ));
        export_at_end(&settings, &mut job, &process).await?;
        job.shutdown().await;
        return Ok(());
    }
    say_setup(&settings, &process, trainers)?;

    // The steps: a progress bar on a terminal, else a line now and then; evaluations every
    // `--eval-every` and at the end, asynchronous checkpoints every `--checkpoint-every` and at
    // the end.
    let bar = progress_bar(&process, first, settings.steps)?;
    let print = |line: String| {
        if process.is_lead() {
            bar.suspend(|| println!("{line}"));
        }
    };
    let (mut progress, mut log) = reporting(&settings, first, peak)?;
    let schedule = lr_schedule(&settings);
    let (mut accuracy, mut eval_loss) = (f64::NAN, f64::NAN);
    let mut spans = Vec::new();
    let mut origin = None;
    for step in first..settings.steps {
        let s = job.step().await.with_context(|| format!("step {step}"))?;
        let position = *feed.lock().unwrap_or_else(|e| e.into_inner());
        progress.record(&s);
        metrics::gauge!("odc_sft_loss").set(s.loss);
        metrics::gauge!("odc_sft_tokens_per_second").set(progress.rate());
        if settings.step_stats {
            print(step_stats_line(step + 1, &s));
        }
        if settings.trace.is_some() {
            let origin = *origin.get_or_insert(s.started);
            spans.extend(step_spans(&s, origin, trainers));
        }
        let done = step + 1;
        let lr = f64::from(settings.lr) * schedule.factor(step);
        log.record(done, &progress.figures(&s, &[("learning_rate", lr)]))?;
        bar.set_position(done);
        bar.set_message(progress.message());
        if bar.is_hidden() && progress.line_due(done) {
            print(progress.line(done, &s));
        }
        let last = done == settings.steps;
        let evaluate_now = data.evaluates()
            && (last || (settings.eval_every > 0 && done % settings.eval_every == 0));
        if process.is_lead() && evaluate_now {
            (eval_loss, accuracy) = evaluate(
                &settings, &format, &evaluator, &mut job, &data, done, &print,
            )
            .await?;
            log.record(
                done,
                &[("eval_loss", eval_loss), ("eval_accuracy", accuracy)],
            )?;
        }
        if process.is_lead() && checkpoint_due(settings.checkpoint_every, done, settings.steps) {
            // Sharded and asynchronous: every server copies its shards now and writes them while
            // training goes on; the previous checkpoint is complete when the next starts.
            let saved = serde_json::to_value(Saved {
                settings: settings.clone(),
                data: position,
            })?;
            let dir = &settings.checkpoint_dir;
            if let Some(written) = job.checkpoint_async(dir, &tensors, &saved).await? {
                print(format!("checkpoint: {}", written.display()));
            }
        }
    }
    if let Some(written) = job.wait_checkpoint().await? {
        print(format!("checkpoint: {}", written.display()));
    }
    bar.finish_and_clear();

    // The end: the export, the trace, the rate, and the last line.
    export_at_end(&settings, &mut job, &process).await?;
    say_end(&settings, &process, &spans, &progress, first)?;
    job.shutdown().await;
    println!(
        "final step={} loss={} eval_accuracy={accuracy} eval_loss={eval_loss}",
        settings.steps,
        progress.loss()
    );
    Ok(())
}

/// The run's progress and its log: with MFU over `peak` and the files of `--log-jsonl` and
/// `--tensorboard` on the lead (which alone has a peak), plain and silent elsewhere.
fn reporting(
    settings: &Settings,
    first: u64,
    peak: Option<odc::recipe::Peak>,
) -> anyhow::Result<(Progress, Log)> {
    let progress = Progress::new(first, settings.steps);
    let Some(peak) = peak else {
        return Ok((progress, Log::default()));
    };
    let params = odc::model::param_count(&settings.model)? as u64;
    let log = Log::open(
        settings.log_jsonl.as_deref(),
        settings.tensorboard.as_deref(),
    )?;
    Ok((progress.with_mfu(params, peak), log))
}

/// The run's first line: the model, the steps, the fleet, the device and the CPU threads.
fn say_setup(settings: &Settings, process: &Process, trainers: usize) -> anyhow::Result<()> {
    let servers = match process.is_distributed() {
        true => process.ranks() as usize,
        false => settings.servers,
    };
    let threads = process.threads.as_ref().map(ToString::to_string);
    process.say(format!(
        "sft: {} parameters, {} steps of {} problems, {trainers} trainers, {servers} servers, \
         device {} ({}), {}",
        odc::model::param_count(&settings.model)?,
        settings.steps,
        settings.batch_size,
        settings.device,
        settings.precision,
        threads.unwrap_or_default()
    ));
    Ok(())
}

/// `--step-stats`' line for the step that made `done` steps.
fn step_stats_line(done: u64, s: &odc::StepStats) -> String {
    format!(
        "step-stats step={done} wall_ms={:.3} tokens={} samples={} micro_batches={} loss={}",
        s.wall.as_secs_f64() * 1e3,
        s.tokens,
        s.samples,
        s.micro_batches,
        s.loss
    )
}

/// The run's closing lines on the lead: the trace, the rate, and on a device the host staging.
fn say_end(
    settings: &Settings,
    process: &Process,
    spans: &[odc::trace::TraceSpan],
    progress: &Progress,
    first: u64,
) -> anyhow::Result<()> {
    if let (Some(path), true) = (&settings.trace, process.is_lead()) {
        write_chrome_trace(path, spans, "odc sft")?;
        process.say(format!("trace: {}", path.display()));
        process.say(format!(
            "phases (all trainers, all steps): {}",
            phase_totals(spans)
        ));
    }
    process.say(progress.summary());
    if settings.device != "cpu" {
        // This process's parameter and gradient bytes through host memory (0 when they stayed
        // on the device).
        process.say(format!(
            "host staging: {} bytes in {} steps",
            odc::compute::host_staging_bytes(),
            settings.steps - first
        ));
    }
    Ok(())
}

/// The job: the model's units (a model directory's, each shard server converting its own slice
/// from the mapped files, or the seeded initialisation), AdamW with warm-up and cosine decay,
/// the data read from `feed`'s position, the fleet on its ranks, a checkpoint to resume.
#[allow(clippy::too_many_arguments)]
fn build_job(
    settings: &Settings,
    format: &TextFormat,
    checkpoint: Option<HfCheckpoint>,
    data: &Data,
    placement: Placement,
    fleet: &Fleet,
    feed: &Arc<Mutex<DataPosition>>,
    process: &Process,
    resumed: Option<Opened>,
) -> anyhow::Result<Job> {
    let model = &settings.model;
    let (store_format, store_data) = (format.clone(), data.dataset.clone());
    let store: Arc<dyn SampleStore> = Arc::new(move |index: u64| {
        Ok(Sample::from(&sample_of(&store_format, &store_data, index)?))
    });
    // Every rank opens the model directory: it must be on a filesystem they share.
    let units = match &checkpoint {
        Some(checkpoint) => peft::adapted_units(model, checkpoint.unit_specs())?,
        None => layout_units(model)?,
    };
    let recipe = JobRecipe {
        model,
        units,
        store,
        objective: Objective::CrossEntropy,
        placement,
        optimizer: adamw(settings.lr, settings.weight_decay),
        clip_grad_norm: settings.clip_grad_norm,
        token_budget: settings.token_budget,
        keep_last: settings.keep_last,
        fleet,
    };
    let (data_format, dataset) = (format.clone(), data.dataset.clone());
    let (batch, max_len, fed) = (settings.batch_size, data.max_len, feed.clone());
    let mut builder = recipe
        .builder(&process.world, resumed)?
        .lr_schedule(lr_schedule(settings))
        .micro_batch_timeout(Duration::from_secs(settings.micro_batch_timeout))
        .step_timeout(DEFAULT_STEP_TIMEOUT.max(Duration::from_secs(
            settings.micro_batch_timeout.saturating_mul(6),
        )))
        .sequence_parallel(
            settings
                .split
                .parse::<SplitPolicy>()
                .map_err(|e| anyhow::anyhow!("--split: {e}"))?,
        )
        .failure_policy(failure_policy(&settings.on_trainer_failure)?)
        .data(move |_step: u64| {
            let mut at = fed.lock().unwrap_or_else(|e| e.into_inner());
            next_minibatch(&data_format, &dataset, &mut at, batch, max_len)
        });
    if let Some(node_size) = settings.relay_pushes {
        builder = builder.relay_pushes(node_size);
    }
    if settings.direct_pushes {
        builder = builder.direct_pushes();
    }
    builder.build().context("building the job")
}

/// Linear warm-up, then cosine decay to `--min-lr-ratio` of the peak at the last step.
fn lr_schedule(settings: &Settings) -> LrSchedule {
    LrSchedule::WarmupCosine {
        warmup_steps: settings.warmup_steps.min(settings.steps),
        total_steps: settings.steps,
        min_ratio: settings.min_lr_ratio,
    }
}

/// A progress bar on the lead's terminal; hidden elsewhere (the loop then prints lines).
fn progress_bar(process: &Process, first: u64, steps: u64) -> anyhow::Result<ProgressBar> {
    if !(process.is_lead() && std::io::stdout().is_terminal()) {
        return Ok(ProgressBar::hidden());
    }
    let bar = ProgressBar::new(steps);
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
    )?);
    bar.set_position(first);
    Ok(bar)
}

/// The eval loss on the held-out samples and the exact-match accuracy of greedy answers to the
/// held-out problems (NaN where none are held out: chat data), after step `done`.
async fn evaluate(
    settings: &Settings,
    format: &TextFormat,
    evaluator: &Evaluator,
    job: &mut Job,
    data: &Data,
    done: u64,
    print: &dyn Fn(String),
) -> anyhow::Result<(f64, f64)> {
    let t = Instant::now();
    let budget = usize::try_from(settings.token_budget).unwrap_or(usize::MAX);
    let l = evaluator
        .loss(job, &settings.model, &data.eval_samples, budget)
        .await?;
    metrics::gauge!("odc_sft_eval_loss").set(l.loss);
    let mut line = format!(
        "eval step {done}: loss {:.4} ({} tokens of {} samples)",
        l.loss, l.tokens, l.samples
    );
    let mut accuracy = f64::NAN;
    if !data.eval_set.is_empty() {
        let e = evaluator
            .accuracy(
                job,
                &settings.model,
                format,
                &data.eval_set,
                settings.max_new_tokens,
            )
            .await?;
        accuracy = e.accuracy();
        metrics::gauge!("odc_sft_eval_accuracy").set(accuracy);
        line +=
            &format!(
            "  accuracy {accuracy:.3} ({}/{})  mean answer {:.0} tokens  ({:.1} s)\n  e.g. {:?}",
            e.correct,
            e.problems,
            e.mean_answer_tokens,
            t.elapsed().as_secs_f64(),
            e.example.unwrap_or_default().chars().take(120).collect::<String>()
        );
    } else {
        line += &format!("  ({:.1} s)", t.elapsed().as_secs_f64());
    }
    print(line);
    Ok((l.loss, accuracy))
}

/// `--export-hf` once the run's steps are done (the lead only).
async fn export_at_end(
    settings: &Settings,
    job: &mut Job,
    process: &Process,
) -> anyhow::Result<()> {
    let (Some(out), true) = (&settings.export_hf, process.is_lead()) else {
        return Ok(());
    };
    let t = Instant::now();
    let params = job.parameters().await?;
    let how = Export {
        out,
        dtype: recipe::export_dtype(&settings.export_dtype)?,
        model_dir: settings.model_dir.as_deref(),
        merge_lora: settings.merge_lora,
    };
    let what = recipe::export(&settings.model, &params, &how)?;
    process.say(format!(
        "exported: {} ({what}; {:.1} s)",
        out.display(),
        t.elapsed().as_secs_f64()
    ));
    Ok(())
}
