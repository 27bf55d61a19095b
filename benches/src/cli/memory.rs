//! `odc-bench memory`: bytes a trainer holds against sequence length and depth, beside the
//! analytical expectation.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use clap::Args;
use odc_bench::memory as mem;

#[derive(Args)]
pub(crate) struct MemoryArgs {
    /// The model's shape: tiny, or a public one (smollm2-135m, qwen2.5-0.5b, qwen3-0.6b,
    /// llama3.2-1b, qwen2.5-1.5b), with seeded random weights.
    #[arg(long, default_value = "qwen2.5-0.5b")]
    pub(crate) shape: String,
    /// Blocks of the model (default: the shape's), comma-separated for a depth sweep.
    #[arg(long, value_delimiter = ',')]
    pub(crate) layers: Vec<usize>,
    /// Tokens of the one sample per step, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096")]
    pub(crate) lengths: Vec<usize>,
    /// The paths to measure: old, new (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "new")]
    pub(crate) paths: Vec<odc_bench::memory::Path>,
    /// Write an SVG plot of measured bytes against length here.
    #[arg(long)]
    pub(crate) svg: Option<PathBuf>,
    /// Instead of memory: step time of resharding against keeping at each length, this many
    /// ABCCBA rounds (keep, reshard, keep again as the control).
    #[arg(long, default_value_t = 0)]
    pub(crate) speed_rounds: usize,
    /// Print the analytical expectation only, with its parts (no training).
    #[arg(long)]
    pub(crate) expected_only: bool,
    /// Plot (`--svg`) the rows of earlier runs' printed tables instead of measuring.
    #[arg(long, value_delimiter = ',')]
    pub(crate) plot_from: Vec<PathBuf>,
}

/// Measures (or, as `args` asks, predicts, times or plots) trainer memory and prints the table.
pub(crate) async fn memory(args: MemoryArgs) -> anyhow::Result<()> {
    let shape = if args.shape == "tiny" {
        odc::model::ModelConfig::tiny()
    } else {
        odc_bench::hf::shape(&args.shape)?
    };
    let depths = if args.layers.is_empty() {
        vec![shape.n_layers]
    } else {
        args.layers.clone()
    };
    if !args.plot_from.is_empty() {
        return plot_from(&args);
    }
    if args.expected_only {
        return print_expected(&args, &shape, &depths);
    }
    if args.speed_rounds > 0 {
        return print_speed(&args, &shape, depths[0]).await;
    }
    print_table_header(&args, &shape);
    let points = measure_points(&args, &shape, &depths).await?;
    print_bytes_per_token(&args, &depths, &points);
    if let Some(path) = &args.svg {
        let title = format!(
            "{} ({} layers): trainer peak memory against sample length",
            args.shape, depths[0]
        );
        let first_depth: Vec<mem::Point> = points
            .iter()
            .filter(|p| p.layers == depths[0])
            .cloned()
            .collect();
        write_svg(path, &first_depth, &title)?;
        println!("plot: {}", path.display());
    }
    Ok(())
}

/// Bytes in GB (10⁹).
fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

/// `shape` with `layers` blocks.
fn with_layers(shape: &odc::model::ModelConfig, layers: usize) -> odc::model::ModelConfig {
    odc::model::ModelConfig {
        n_layers: layers,
        ..shape.clone()
    }
}

/// Writes the plot of `points` to `path`.
fn write_svg(path: &Path, points: &[mem::Point], title: &str) -> anyhow::Result<()> {
    std::fs::write(path, mem::svg(points, title))
        .with_context(|| format!("writing {}", path.display()))
}

/// `--plot-from`: the rows of earlier runs' printed tables, plotted to `--svg`.
fn plot_from(args: &MemoryArgs) -> anyhow::Result<()> {
    let out = args
        .svg
        .as_ref()
        .context("--plot-from writes the plot given with --svg")?;
    let mut points = Vec::new();
    for file in &args.plot_from {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        points.extend(mem::parse_rows(&text));
    }
    if points.is_empty() {
        bail!("no table rows in {:?}", args.plot_from);
    }
    let title = format!(
        "{} shape, {} blocks, fp32 CPU: trainer peak memory against sample length",
        args.shape, points[0].layers
    );
    write_svg(out, &points, &title)?;
    println!("plot of {} rows: {}", points.len(), out.display());
    Ok(())
}

/// `--expected-only`: the analytical expectation at every depth, path and length, with its parts.
fn print_expected(
    args: &MemoryArgs,
    shape: &odc::model::ModelConfig,
    depths: &[usize],
) -> anyhow::Result<()> {
    for &layers in depths {
        let config = with_layers(shape, layers);
        for &path in &args.paths {
            for &tokens in &args.lengths {
                let e = mem::expected(&config, tokens, path)?;
                let parts: Vec<String> = e
                    .parts
                    .iter()
                    .map(|(what, b)| format!("{what} {:.3}", gb(*b)))
                    .collect();
                println!(
                    "expected path={path} layers={layers} tokens={tokens} {:.3} GB at {}: {}",
                    gb(e.total()),
                    e.phase,
                    parts.join("; ")
                );
            }
        }
    }
    Ok(())
}

/// `--speed-rounds`: step time of resharding against keeping at each length, `layers` deep.
async fn print_speed(
    args: &MemoryArgs,
    shape: &odc::model::ModelConfig,
    layers: usize,
) -> anyhow::Result<()> {
    let config = with_layers(shape, layers);
    println!(
        "odc-bench memory --speed-rounds {}: {} with {} layers, one trainer and one server, \
         fp32 on the CPU; median step seconds, ABCCBA (keep, reshard, keep again)",
        args.speed_rounds, args.shape, layers
    );
    for &tokens in &args.lengths {
        let s = mem::speed(&config, tokens, args.speed_rounds).await?;
        println!(
            "result memory-speed tokens={tokens} keep_s={:.3} reshard_s={:.3} \
             reshard_vs_keep={:.3} control={:.3} tokens_per_s_keep={:.0} \
             tokens_per_s_reshard={:.0}",
            s.keep_s,
            s.reshard_s,
            s.ratio(),
            s.control(),
            tokens as f64 / s.keep_s,
            tokens as f64 / s.reshard_s
        );
    }
    Ok(())
}

/// What is measured, and the table's column titles.
fn print_table_header(args: &MemoryArgs, shape: &odc::model::ModelConfig) {
    println!(
        "odc-bench memory: {} ({} heads over {} KV, hidden {}, vocab {}), fp32 on the CPU, one \
         trainer and one server in this process, one sample per step; measured = the allocator's \
         peak during a step's micro-batch minus its level at its start (after a 16-token warm-up step)",
        args.shape,
        shape.n_heads,
        shape.kv_heads(),
        shape.d_model,
        shape.vocab_size
    );
    println!(
        "{:<4} {:>6} {:>7} {:>12} {:>12} {:>6}  {:>12} {:>8} {:>9}  expected peak phase",
        "path",
        "layers",
        "tokens",
        "measured GB",
        "expected GB",
        "ratio",
        "peak RSS GB",
        "step s",
        "tokens/s"
    );
}

/// Measures every depth, path and length, printing a table line for each.
async fn measure_points(
    args: &MemoryArgs,
    shape: &odc::model::ModelConfig,
    depths: &[usize],
) -> anyhow::Result<Vec<mem::Point>> {
    let mut points = Vec::new();
    for &layers in depths {
        let config = odc::model::ModelConfig {
            max_seq_len: shape
                .max_seq_len
                .max(*args.lengths.iter().max().unwrap_or(&0)),
            ..with_layers(shape, layers)
        };
        for &path in &args.paths {
            for &tokens in &args.lengths {
                let p = mem::measure(&config, tokens, path).await?;
                println!(
                    "{:<4} {:>6} {:>7} {:>12.3} {:>12.3} {:>6.2}  {:>12.2} {:>8.1} {:>9.0}  {}",
                    p.path.to_string(),
                    p.layers,
                    p.tokens,
                    gb(p.measured),
                    gb(p.expected.total()),
                    p.measured as f64 / p.expected.total().max(1) as f64,
                    gb(p.peak_rss),
                    p.step_s,
                    p.tokens as f64 / p.step_s,
                    p.expected.phase
                );
                points.push(p);
            }
        }
    }
    Ok(points)
}

/// Bytes per added token between consecutive lengths (linear growth: equal).
fn print_bytes_per_token(args: &MemoryArgs, depths: &[usize], points: &[mem::Point]) {
    for &path in &args.paths {
        for &layers in depths {
            let line: Vec<&mem::Point> = points
                .iter()
                .filter(|p| p.path == path && p.layers == layers)
                .collect();
            for pair in line.windows(2) {
                let (a, b) = (pair[0], pair[1]);
                println!(
                    "result memory path={path} layers={layers} bytes_per_token {}->{} = {:.0}",
                    a.tokens,
                    b.tokens,
                    (b.measured as f64 - a.measured as f64) / (b.tokens - a.tokens) as f64
                );
            }
        }
    }
}
