//! `odc-bench generate`: odc's batched sampler (`odc::model::generate_batch`, KV cache, prompts
//! left-padded together) on a Hugging Face model directory: sampled tokens per second over GSM8K
//! questions in the model's chat template, `--samples` responses each, as `rl_grpo` samples.
//! `--prompts-out` writes the prompts' token ids and stop ids, which `benches/gpu/peer.py
//! generate` decodes with `transformers`' batched `generate` (the peer a user would run instead);
//! `--json` writes the rate and, at `--temperature 0`, every greedy response (the parity row of
//! `benches/gpu/sampling.sh`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use odc::model::hf::HfCheckpoint;
use odc::model::{generate_batch_measured, open_device, DecodeStats, Prompt, Sampling, Weights};
use odc::text::{HfTokenizer, TextFormat, Tokenizer};
use rand::rngs::StdRng;
use rand::SeedableRng;

#[derive(Args)]
pub(crate) struct GenerateArgs {
    /// A Hugging Face model directory with its tokenizer and chat template.
    #[arg(long)]
    pub(crate) model_dir: PathBuf,
    /// GSM8K-format JSONL: its first `--prompts` questions are the prompts.
    #[arg(long)]
    pub(crate) data: PathBuf,
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub(crate) prompts: u64,
    /// Responses per prompt (a GRPO group).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub(crate) samples: u64,
    #[arg(long, default_value_t = 256)]
    pub(crate) max_new_tokens: usize,
    /// 0: greedy.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    pub(crate) top_p: f64,
    /// Prompts per batched decode (0: all of them in one).
    #[arg(long, default_value_t = 0)]
    pub(crate) decode_batch: usize,
    /// cpu, cuda or cuda:N (a build with the `gpu` feature).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// f32, or bf16 (the matrices and the cache in bf16, the norms fp32, as a bf16 trainer
    /// computes: `Weights::in_precision`).
    #[arg(long, default_value = "f32")]
    pub(crate) precision: String,
    /// Timed rounds over the same prompts (each response from the same seed every round); 0:
    /// only write `--prompts-out`.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=100))]
    pub(crate) rounds: u64,
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Write `{"prompts": [[ids]], "stop": [ids], "samples", "max_new_tokens", ...}` here.
    #[arg(long)]
    pub(crate) prompts_out: Option<PathBuf>,
    /// Write the rounds' rates (and, when greedy, every response) here.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
}

pub(crate) fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let checkpoint = HfCheckpoint::open(&args.model_dir)
        .with_context(|| format!("--model-dir {}", args.model_dir.display()))?;
    let tokenizer = Arc::new(HfTokenizer::from_dir(&args.model_dir)?);
    let stop = tokenizer.stop_ids();
    let format = TextFormat::Chat(tokenizer);
    let problems = odc::text::gsm8k::load(&args.data)?;
    let count = usize::try_from(args.prompts)?;
    if problems.len() < count {
        bail!(
            "--data {} has {} problems, --prompts asks for {count}",
            args.data.display(),
            problems.len()
        );
    }
    let prompts = problems[..count]
        .iter()
        .map(|p| format.prompt(&p.question))
        .collect::<Result<Vec<_>, _>>()?;
    let samples = usize::try_from(args.samples)?;
    let sampling = Sampling {
        temperature: args.temperature,
        top_p: args.top_p,
        max_new_tokens: args.max_new_tokens,
        stop: stop.clone(),
    };
    if let Some(path) = &args.prompts_out {
        let json = serde_json::json!({
            "prompts": prompts, "stop": stop, "samples": samples,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "top_p": args.top_p,
        });
        std::fs::write(path, serde_json::to_vec(&json)?)
            .with_context(|| format!("--prompts-out {}", path.display()))?;
    }
    if args.rounds == 0 {
        return Ok(());
    }
    let spec: odc::model::DeviceSpec = args.device.parse()?;
    let device = open_device(spec, odc::launch::local_rank())?;
    let units = checkpoint.all_unit_values()?;
    let precision: odc::model::ComputePrecision = args.precision.parse()?;
    let weights =
        Weights::from_units(checkpoint.config(), &units, &device)?.in_precision(precision)?;
    let element = weights.dtype().size_in_bytes();
    let batch = match args.decode_batch {
        0 => prompts.len(),
        n => n,
    };
    let mut rounds = Vec::new();
    let mut responses = Vec::new();
    let mut peak = DecodeStats::default();
    for round in 0..args.rounds {
        let started = Instant::now();
        responses.clear();
        for chunk in prompts.chunks(batch) {
            let batch: Vec<Prompt<'_>> = chunk
                .iter()
                .map(|p| Prompt::new(p).samples(samples))
                .collect();
            // Each response's generator from the seed and its place: the same draws every round.
            let first = responses.len() as u64;
            let mut rngs: Vec<StdRng> = (0..(chunk.len() * samples) as u64)
                .map(|i| StdRng::seed_from_u64(args.seed ^ (first + i).wrapping_mul(0x9E37_79B9)))
                .collect();
            let (out, stats) = generate_batch_measured(&weights, &batch, &sampling, &mut rngs)?;
            responses.extend(out);
            if stats.peak_cache_bytes > peak.peak_cache_bytes {
                peak = stats;
            }
        }
        let secs = started.elapsed().as_secs_f64();
        let tokens: usize = responses.iter().map(Vec::len).sum();
        println!(
            "odc-bench generate: round {}: {} prompts x {samples} samples, {tokens} tokens \
             (mean response {:.0}) in {secs:.2} s: {:.0} tokens/s",
            round + 1,
            prompts.len(),
            tokens as f64 / responses.len().max(1) as f64,
            tokens as f64 / secs
        );
        rounds.push(serde_json::json!({"tokens": tokens, "seconds": secs}));
    }
    // The cache against the analytical bytes of the tokens it held then (keys and values in the
    // cache's dtype).
    let c = checkpoint.config();
    let analytical = 2 * c.n_layers * c.kv_heads() * c.head_dim() * element * peak.tokens_at_peak;
    println!(
        "odc-bench generate: KV cache at its largest {:.1} MB for {} tokens; analytical \
         (2 x {} layers x {} KV heads x {} head_dim x tokens x {element} bytes) {:.1} MB: {:.2}x",
        peak.peak_cache_bytes as f64 / 1e6,
        peak.tokens_at_peak,
        c.n_layers,
        c.kv_heads(),
        c.head_dim(),
        analytical as f64 / 1e6,
        peak.peak_cache_bytes as f64 / analytical.max(1) as f64
    );
    if let Some(path) = &args.json {
        let mut json = serde_json::json!({
            "model_dir": args.model_dir, "device": args.device, "precision": args.precision,
            "prompts": prompts.len(),
            "samples": samples, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "top_p": args.top_p, "decode_batch": batch,
            "rounds": rounds, "peak_cache_bytes": peak.peak_cache_bytes,
            "tokens_at_peak": peak.tokens_at_peak, "analytical_cache_bytes": analytical,
        });
        if args.temperature == 0.0 {
            json["greedy"] = serde_json::json!(responses);
        }
        std::fs::write(path, serde_json::to_vec(&json)?)
            .with_context(|| format!("--json {}", path.display()))?;
    }
    Ok(())
}
