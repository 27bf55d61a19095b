//! `odc-bench memory`: the bytes a trainer holds while it trains one sample, against sequence
//! length and depth, beside the analytical expectation.
//!
//! - **Measured**: the benchmark binary's global allocator counts every live byte
//!   ([`Counting`]); a wrapper around the model's compute ([`Measured`]) records, per
//!   micro-batch, the allocator's peak during the compute minus its level when the compute
//!   started — what the trainer's forward and backward added on top of the process (the shard
//!   server's masters, optimizer state and published copies exist before the micro-batch
//!   starts; the measured step is the second, after a 16-token one, so the server's
//!   accumulators exist too). RSS
//!   (`VmHWM`, the process's peak) is printed beside it as a cross-check.
//! - **Job**: one trainer and one shard server in one process, AdamW, one sample of `L` random
//!   tokens per step, fp32 on the CPU.
//! - **Expected** ([`expected`]): two gathered units (the one being differentiated and the one
//!   prefetched, as f32 tensors), one `tokens × d_model` checkpoint per stage kept for the
//!   backward, one block's working set (its forward graph, which candle keeps whole until the
//!   block's backward returns, and that backward's widest frontier, plus one attention tile and
//!   one chunk of the MLP),
//!   the head's chunk of logits, the
//!   unit gradient being pushed, and (tied embeddings) unit 0's matrix, which the head reads.
//!   Without resharding, every stage's weights and graph are held instead of one.
//!
//! The two paths of [`Path`]: `old` keeps every stage (no resharding) with the plain attention
//! MLP and head (the `[heads, L, L]` scores, `[L, d_ff]` intermediates and `[L, vocab]` logits in
//! the graph); `new` reshards after forward with the blocked attention, the chunked MLP and the
//! chunked head.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use odc::compute::{transformer_job_of, Objective, Placement, SampleStore, TransformerCompute};
use odc::model::AttentionImpl;
use odc::model::{
    unit_count, unit_params, HeadImpl, Implementations, MlpImpl, ModelConfig, Reshard, Sample,
};
use odc::{
    async_trait, Compute, ComputeOutput, MicroBatch, OptimizerConfig, Precision, SampleMeta,
    TrainerContext, UnitSpec,
};

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static INSTALLED: AtomicU64 = AtomicU64::new(0);

/// A global allocator counting live bytes and their peak (install it in a binary:
/// `#[global_allocator] static A: Counting = Counting;`).
pub struct Counting;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size() as u64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size() as u64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as u64, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            let old = layout.size() as u64;
            let new = new_size as u64;
            if new >= old {
                grew(new - old);
            } else {
                LIVE.fetch_sub(old - new, Ordering::Relaxed);
            }
        }
        p
    }
}

fn grew(bytes: u64) {
    INSTALLED.store(1, Ordering::Relaxed);
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

/// Whether [`Counting`] is this process's allocator (it has counted something).
pub fn counting() -> bool {
    INSTALLED.load(Ordering::Relaxed) == 1
}

/// Live bytes now; the peak is reset to them.
fn reset_peak() -> u64 {
    let live = LIVE.load(Ordering::Relaxed);
    PEAK.store(live, Ordering::Relaxed);
    live
}

fn peak() -> u64 {
    PEAK.load(Ordering::Relaxed)
}

/// The process's peak resident memory (`VmHWM`), bytes.
pub fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM")?.strip_prefix(':'))
        .and_then(|rest| rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// The model's compute, measuring what each micro-batch adds to the allocator's level.
struct Measured {
    inner: TransformerCompute,
    peaks: Arc<Mutex<Vec<u64>>>,
}

#[async_trait]
impl Compute for Measured {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        mb: &MicroBatch,
    ) -> odc::Result<ComputeOutput> {
        let start = reset_peak();
        let out = self.inner.run(ctx, mb).await;
        let held = peak().saturating_sub(start);
        self.peaks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(held);
        out
    }
}

/// Which trainer-side memory path runs (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// No resharding, plain attention, MLP and head.
    Old,
    /// Resharding after forward, blocked attention, chunked MLP and head.
    New,
}

impl std::str::FromStr for Path {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "old" => Ok(Path::Old),
            "new" => Ok(Path::New),
            other => Err(format!("a path is old or new, not {other:?}")),
        }
    }
}

impl std::fmt::Display for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Path::Old => "old",
            Path::New => "new",
        })
    }
}

impl Path {
    fn reshard(self) -> Reshard {
        match self {
            Path::Old => Reshard::Never,
            Path::New => Reshard::ALWAYS,
        }
    }

    fn implementations(self) -> Implementations {
        match self {
            Path::Old => Implementations {
                attention: AttentionImpl::Plain,
                mlp: MlpImpl::Full,
                head: HeadImpl::Full,
            },
            Path::New => Implementations::default(),
        }
    }
}

/// One measurement.
#[derive(Debug, Clone)]
pub struct Point {
    pub path: Path,
    pub tokens: usize,
    pub layers: usize,
    /// The allocator's peak during the measured micro-batch minus its level at its start.
    pub measured: u64,
    pub expected: Expected,
    /// The process's peak RSS after the run.
    pub peak_rss: u64,
    /// Seconds of the measured step; tokens per second.
    pub step_s: f64,
}

/// The analytical expectation (see the [module docs](self)): the largest of the phases a
/// micro-batch goes through, each a sum of named parts, bytes.
#[derive(Debug, Clone, Default)]
pub struct Expected {
    /// The phase of the peak, and its parts.
    pub phase: &'static str,
    pub parts: Vec<(&'static str, u64)>,
}

impl Expected {
    pub fn total(&self) -> u64 {
        self.parts.iter().map(|(_, b)| b).sum()
    }

    /// The phase with the largest total.
    fn peak(phases: Vec<Expected>) -> Expected {
        phases
            .into_iter()
            .max_by_key(Expected::total)
            .unwrap_or_default()
    }
}

/// Bytes of the chunked head's logits at once (its transient `[rows, vocab]`).
const HEAD_CHUNK_BYTES: u64 = 64 << 20;

/// The expectation for `config` on one sample of `tokens` tokens (fp32), on `path`.
pub fn expected(config: &ModelConfig, tokens: usize, path: Path) -> anyhow::Result<Expected> {
    const F32: u64 = 4;
    let t = tokens as u64;
    let d = config.d_model as u64;
    let hd = config.head_dim() as u64;
    let (h, kv) = (config.n_heads as u64, config.kv_heads() as u64);
    let ff = config.d_ff as u64;
    let v = config.vocab_size as u64;
    let units = unit_count(config);
    let unit_bytes: Vec<u64> = (0..units)
        .map(|u| {
            Ok(unit_params(config, u)?
                .iter()
                .map(|p| p.numel() as u64 * F32)
                .sum::<u64>())
        })
        .collect::<anyhow::Result<_>>()?;
    let block = unit_bytes[1..units - 1].iter().copied().max().unwrap_or(0);
    let embedding = unit_bytes[0];
    let tied = if config.tie_embeddings { embedding } else { 0 };
    // Per token of one block's forward graph, which candle keeps whole until the block's
    // backward returns: each op's output, and nothing else (the lean ops, `ops::{linear,
    // rms_norm, rope}` and the chunked MLP, keep no intermediate). The two norms, o_proj, the
    // MLP and the two residuals (6d); q: its projection (with the bias), head-major copy and
    // rotary embedding (3 of q's width; 4 with a q norm), k the same, v 2 of its width; the
    // attention output and its token-major copy (2 of q's width). Then the backward's frontier:
    // an op's output gradient, its input gradient with candle's zero accumulator and their sum,
    // the residual's pending gradient, the chunked MLP's pieces (about 6d). With candle's MLP
    // (the old path) the graph also holds gate, up, SiLU and their product (4 ff), and the
    // frontier at the MLP is an ff-wide gradient and each product's two partial gradients,
    // each with a zero accumulator and its sum (about 6 ff); the chunked MLP holds about eight
    // `[rows, ff]` tensors of one chunk instead, whatever the length.
    let (q, kv) = (h * hd, kv * hd);
    let per_projection = 3 + u64::from(config.qk_norm);
    let attention_graph = 6 * d + per_projection * (q + kv) + 2 * kv + 2 * q;
    let candle_mlp = 4 * ff + 6 * ff;
    let activations = |mlp_per_token: u64| (attention_graph + 6 * d + mlp_per_token) * F32;
    let mlp_chunk = 8 * (odc::model::mlp::chunk_rows(config.d_ff) as u64).min(t) * ff * F32;
    let checkpoints = (config.n_layers as u64 + 1) * t * d * F32;
    Ok(match path {
        Path::New => {
            // One attention tile per query block ([H, 256, 512] scores, probabilities and
            // their gradient), the chunk of head logits (logits, softmax, gradient).
            let tile = h * 256 * 512.min(t) * F32 * 3;
            let head_rows = (HEAD_CHUNK_BYTES / (v * F32)).max(1).min(t);
            Expected::peak(vec![
                Expected {
                    phase: "a block's backward",
                    parts: vec![
                        ("stage inputs", checkpoints),
                        (
                            "block weights, the context's buffer, the prefetch, the gradient",
                            4 * block,
                        ),
                        (
                            "block's forward graph and its backward's frontier",
                            activations(0) * t + tile,
                        ),
                        ("one chunk of the MLP", mlp_chunk),
                        ("the head's gradient of the tied embedding", tied),
                    ],
                },
                Expected {
                    phase: "the head",
                    parts: vec![
                        ("stage inputs", checkpoints),
                        (
                            "head chunk, normed input and its gradient",
                            3 * head_rows * v * F32 + 2 * t * d * F32,
                        ),
                        if config.tie_embeddings {
                            (
                                "LM head (embedding) matrix and its gradient (the chunked \
                                 head's sink), prefetched block",
                                2 * tied + block,
                            )
                        } else {
                            (
                                "LM head matrix, its gradient, candle's zero accumulator and \
                                 their sum (its backward ends adding them), prefetched block",
                                4 * unit_bytes[units - 1] + block,
                            )
                        },
                    ],
                },
                Expected {
                    phase: "the embedding's backward",
                    parts: vec![
                        (
                            "its gradient (the head's, or zeros, and the rows added: two \
                             matrices; then one and its flat copy for the push)",
                            2 * embedding,
                        ),
                        ("the lowest block's gradient being pushed", block),
                        ("output gradient", t * d * F32),
                    ],
                },
            ])
        }
        Path::Old => {
            // Every block's graph with its scores: scale, mask, softmax and their copies (about
            // six [H, L, L] f32 tensors per block).
            let scores = 6 * h * t * t * F32;
            Expected::peak(vec![Expected {
                phase: "the end of the forward",
                parts: vec![
                    ("every unit's weights", unit_bytes.iter().sum()),
                    ("stage inputs", checkpoints),
                    (
                        "every block's graph",
                        config.n_layers as u64 * (activations(candle_mlp) * t + scores),
                    ),
                    ("logits, log-softmax and their gradient", 4 * t * v * F32),
                    ("a gradient being pushed", block.max(tied)),
                ],
            }])
        }
    })
}

/// A warm-up step, then one step on a `tokens`-token sample of `config` on `path`: its
/// measurement.
pub async fn measure(config: &ModelConfig, tokens: usize, path: Path) -> anyhow::Result<Point> {
    if !counting() {
        anyhow::bail!(
            "the counting allocator is not installed: odc-bench memory runs in the odc-bench binary"
        );
    }
    let peaks = Arc::new(Mutex::new(Vec::new()));
    let mut job = job(
        config,
        tokens,
        path.reshard(),
        path.implementations(),
        Some(peaks.clone()),
    )?;
    job.step().await?;
    let started = Instant::now();
    job.step().await?;
    let step_s = started.elapsed().as_secs_f64();
    job.shutdown().await;
    let measured = peaks
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .last()
        .copied()
        .unwrap_or(0);
    Ok(Point {
        path,
        tokens,
        layers: config.n_layers,
        measured,
        expected: expected(config, tokens, path)?,
        peak_rss: peak_rss(),
        step_s,
    })
}

/// Step times of resharding after forward against keeping every stage, in one run.
#[derive(Debug, Clone)]
pub struct Speed {
    pub tokens: usize,
    /// Median seconds per step: keeping, resharding, and a second keeping job (the control).
    pub keep_s: f64,
    pub reshard_s: f64,
    pub control_s: f64,
}

impl Speed {
    /// Resharding's speed relative to keeping (1.0: as fast).
    pub fn ratio(&self) -> f64 {
        self.keep_s / self.reshard_s
    }

    /// The control: keeping against keeping (must read 1.00).
    pub fn control(&self) -> f64 {
        self.keep_s / self.control_s
    }
}

/// Tokens of the first step's sample, which warms a job up.
const WARM_UP_TOKENS: usize = 16;

/// A one-trainer, one-server job of `config` on one `tokens`-token sample per step (the first
/// step's is [`WARM_UP_TOKENS`] long).
/// With `peaks`, each micro-batch's measurement is pushed there ([`Measured`]).
fn job(
    config: &ModelConfig,
    tokens: usize,
    reshard: Reshard,
    implementations: Implementations,
    peaks: Option<Arc<Mutex<Vec<u64>>>>,
) -> anyhow::Result<odc::Job> {
    // Sample 0 is `tokens` long; sample 1, of 16 tokens, warms the server up (its accumulators
    // are made at a unit's first push, which would count in a first micro-batch).
    let vocab = config.vocab_size as u64;
    let sample_of = move |n: usize| {
        Sample::all_loss(
            (0..n as u64)
                .map(|i| ((i * 2_654_435_761) % (vocab - 3) + 3) as u32)
                .collect(),
        )
    };
    let (long, short) = (sample_of(tokens), sample_of(WARM_UP_TOKENS.min(tokens)));
    let store: Arc<dyn SampleStore> = Arc::new(move |index: u64| {
        Ok(if index == 0 {
            long.clone()
        } else {
            short.clone()
        })
    });
    let placement = Placement {
        reshard,
        implementations,
        ..Placement::default()
    };
    let units: Vec<UnitSpec> = odc::model::layout_units(config)?;
    let mut builder = transformer_job_of(
        config,
        units,
        store.clone(),
        Objective::CrossEntropy,
        placement,
    )?;
    if let Some(peaks) = peaks {
        let compute = TransformerCompute::on(config.clone(), placement, store)?;
        builder = builder.compute(move |_| {
            Box::new(Measured {
                inner: compute.clone(),
                peaks: peaks.clone(),
            }) as Box<dyn Compute>
        });
    }
    Ok(builder
        .trainers(1)
        .servers(1)
        .optimizer(OptimizerConfig::adamw(1e-4))
        .pull_precision(Precision::F32)
        .token_budget(tokens as u64)
        // A 32K-token step of a real shape takes over ten minutes on a small CPU.
        .micro_batch_timeout(std::time::Duration::from_secs(3 * 3600))
        .step_timeout(std::time::Duration::from_secs(3 * 3600))
        .data(move |step: u64| {
            Ok(vec![if step == 0 {
                SampleMeta::new(1, WARM_UP_TOKENS.min(tokens) as u64)
            } else {
                SampleMeta::new(0, tokens as u64)
            }])
        })
        .build()?)
}

/// Resharding against keeping on `tokens`-token samples: three jobs (keep, reshard, keep again
/// as the control) stepped in ABCCBA order for `rounds` rounds after a warm-up step each; the
/// medians of their step times.
pub async fn speed(config: &ModelConfig, tokens: usize, rounds: usize) -> anyhow::Result<Speed> {
    let mut jobs = [
        job(
            config,
            tokens,
            Reshard::Never,
            Implementations::default(),
            None,
        )?,
        job(
            config,
            tokens,
            Reshard::ALWAYS,
            Implementations::default(),
            None,
        )?,
        job(
            config,
            tokens,
            Reshard::Never,
            Implementations::default(),
            None,
        )?,
    ];
    for j in jobs.iter_mut() {
        j.step().await?;
    }
    let mut times: [Vec<f64>; 3] = Default::default();
    for _ in 0..rounds.max(1) {
        for i in [0, 1, 2, 2, 1, 0] {
            let started = Instant::now();
            jobs[i].step().await?;
            times[i].push(started.elapsed().as_secs_f64());
        }
    }
    for j in jobs {
        j.shutdown().await;
    }
    let median = |t: &mut Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let [mut k, mut r, mut c] = times;
    Ok(Speed {
        tokens,
        keep_s: median(&mut k),
        reshard_s: median(&mut r),
        control_s: median(&mut c),
    })
}

/// The rows of a printed `odc-bench memory` table (`path layers tokens measured_GB …`), as
/// points with their measured bytes (the expectation is not read back).
pub fn parse_rows(text: &str) -> Vec<Point> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let path = f.first()?.parse::<Path>().ok()?;
            let layers = f.get(1)?.parse().ok()?;
            let tokens = f.get(2)?.parse().ok()?;
            let measured_gb: f64 = f.get(3)?.parse().ok()?;
            Some(Point {
                path,
                tokens,
                layers,
                measured: (measured_gb * 1e9) as u64,
                expected: Expected::default(),
                peak_rss: 0,
                step_s: f64::NAN,
            })
        })
        .collect()
}

/// An SVG plot of measured bytes against tokens, one line per path (log–log axes).
pub fn svg(points: &[Point], title: &str) -> String {
    // The right margin leaves room for the last point's label.
    let (w, h, m, right) = (760.0, 400.0, 60.0, 140.0);
    let xs: Vec<f64> = points.iter().map(|p| p.tokens as f64).collect();
    let ys: Vec<f64> = points.iter().map(|p| p.measured.max(1) as f64).collect();
    let (x0, x1) = (
        xs.iter().copied().fold(f64::INFINITY, f64::min).log2(),
        xs.iter().copied().fold(1.0, f64::max).log2(),
    );
    let (y0, y1) = (
        ys.iter().copied().fold(f64::INFINITY, f64::min).log2(),
        ys.iter().copied().fold(1.0, f64::max).log2(),
    );
    let sx = |x: f64| m + (x.log2() - x0) / (x1 - x0).max(1e-9) * (w - m - right);
    let sy = |y: f64| h - m - (y.log2() - y0) / (y1 - y0).max(1e-9) * (h - 2.0 * m);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" \
         fill=\"white\"/>\n<text x=\"{m}\" y=\"24\" font-size=\"14\">{title}</text>\n\
         <line x1=\"{m}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
         <line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{}\" stroke=\"black\"/>\n\
         <text x=\"{}\" y=\"{}\">tokens per sample (log)</text>\n\
         <text x=\"12\" y=\"{}\" transform=\"rotate(-90 12 {})\">trainer peak bytes (log)</text>\n",
        h - m,
        w - right,
        h - m,
        h - m,
        w / 2.0 - 60.0,
        h - 16.0,
        h / 2.0,
        h / 2.0
    );
    for (path, colour) in [(Path::Old, "#c0392b"), (Path::New, "#2471a3")] {
        let mut line: Vec<&Point> = points.iter().filter(|p| p.path == path).collect();
        line.sort_by_key(|p| p.tokens);
        if line.is_empty() {
            continue;
        }
        let coords: Vec<String> = line
            .iter()
            .map(|p| {
                format!(
                    "{:.1},{:.1}",
                    sx(p.tokens as f64),
                    sy(p.measured.max(1) as f64)
                )
            })
            .collect();
        out += &format!(
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" points=\"{}\"/>\n",
            coords.join(" ")
        );
        for p in &line {
            out += &format!(
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{colour}\"/>\n\
                 <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\">{} · {:.2} GB</text>\n",
                sx(p.tokens as f64),
                sy(p.measured.max(1) as f64),
                sx(p.tokens as f64) + 5.0,
                sy(p.measured.max(1) as f64) - 5.0,
                p.tokens,
                p.measured as f64 / 1e9
            );
        }
        let last = line[line.len() - 1];
        out += &format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"{colour}\">{path}</text>\n",
            sx(last.tokens as f64) - 30.0,
            sy(last.measured.max(1) as f64) + 18.0
        );
    }
    out + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_new_path_is_linear_in_length_and_flat_in_depth_on_paper() {
        let config = crate::hf::shape("qwen2.5-0.5b").unwrap();
        let at = |t: usize| expected(&config, t, Path::New).unwrap().total() as f64;
        let (a, b, c) = (at(8_192), at(16_384), at(32_768));
        let (per_1, per_2) = ((b - a) / 8_192.0, (c - b) / 16_384.0);
        assert!((per_1 / per_2 - 1.0).abs() < 0.1, "{per_1} vs {per_2}");
        // The old path's scores grow with the square of the length.
        let old = |t: usize| expected(&config, t, Path::Old).unwrap().total() as f64;
        assert!(old(4_096) / old(2_048) > 3.0);
        // Depth adds one checkpoint per stage on the new path.
        let deeper = ModelConfig {
            n_layers: 48,
            ..config.clone()
        };
        let added = expected(&deeper, 4_096, Path::New).unwrap().total()
            - expected(&config, 4_096, Path::New).unwrap().total();
        assert!(added <= 24 * 4_096 * 896 * 4, "{added}");
    }
}
