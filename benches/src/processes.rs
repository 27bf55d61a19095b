//! `odc-bench processes`: the wall time per step of one job run as several processes (`odc launch
//! --nprocs N` over `shm` or `tcp`) next to the same job in one process, with the same trainers and
//! servers, model, data and seed — the cost of crossing processes.
//!
//! # Method
//!
//! - Both sides run the `embed` example (`target/<profile>/examples/embed`), A as one process with
//!   `--trainers N --servers N`, B under `odc launch` (one trainer and one server per rank). The
//!   time per step is what rank 0 reports for its training loop (`<n> steps in <s> s`), so process
//!   start, joining and reading the parameters do not count.
//! - Interleaved ABBA over `rounds`; the ratio is B / A of the medians. A **control** runs A against
//!   itself in the same pattern and must read 1.00 (within its noise); when it does not, the
//!   machine's noise, not the system, decides the row.
//! - Both runs must end with the same final loss (I3, within [`LOSS_TOLERANCE`]: dynamic dispatch
//!   sums micro-batches in a different order each run, so even two one-process runs differ in the
//!   last bits): a mismatch fails the benchmark.
//! - With more processes than cores the processes share cores; the benchmark says so, since that
//!   oversubscription (not communication) can then decide the ratio. `embed`'s compute runs on
//!   the CPU, so on a small machine the trainers' compute competes with every process's transport
//!   and control tasks; `--compute-delay-ms` adds compute time that does not occupy a core (what
//!   GPU kernels look like to the CPU), the setting odc is built for.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};

/// Largest relative difference of final losses that still counts as the same training (I3).
pub const LOSS_TOLERANCE: f64 = 1e-5;

/// What to run.
#[derive(Debug, Clone)]
pub struct Settings {
    pub embed: PathBuf,
    pub odc: PathBuf,
    pub nprocs: u32,
    pub transport: String,
    pub steps: u32,
    pub rounds: u32,
    /// `embed --compute-delay-ms`: compute time per micro-batch that does not occupy a core (a
    /// GPU's kernels, as the CPU sees them); 0 = the example as is.
    pub compute_delay_ms: u32,
}

/// One run's time per step and final loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Run {
    pub secs_per_step: f64,
    pub loss: f64,
}

/// `path`'s sibling `examples/<name>` or `<name>` of the directory holding this executable.
pub fn sibling(name: &str, example: bool) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("this executable's path")?;
    let dir = exe.parent().context("this executable's directory")?;
    let path = if example {
        dir.join("examples").join(name)
    } else {
        dir.join(name)
    };
    if !path.exists() {
        bail!(
            "{} is missing: build it first (cargo build --release --features cli --example embed --bin odc)",
            path.display()
        );
    }
    Ok(path)
}

/// The time per step and final loss in `embed`'s output (rank 0's loop line and a final line).
pub fn parse(stdout: &str) -> anyhow::Result<Run> {
    let mut per_step = None;
    let mut loss = None;
    for line in stdout.lines() {
        if let Some((steps, rest)) = line.split_once(" steps in ") {
            let steps: f64 = steps.trim().parse().context("the step count")?;
            let secs: f64 = rest
                .split_once(" s")
                .map(|(s, _)| s)
                .context("the loop time")?
                .parse()
                .context("the loop time")?;
            if steps > 0.0 && secs.is_finite() && secs > 0.0 {
                per_step = Some(secs / steps);
            }
        }
        if let Some(rest) = line.strip_prefix("final loss=") {
            let value = rest.split_whitespace().next().context("the final loss")?;
            loss = Some(value.parse::<f64>().context("the final loss")?);
        }
    }
    match (per_step, loss) {
        (Some(secs_per_step), Some(loss)) if loss.is_finite() => Ok(Run {
            secs_per_step,
            loss,
        }),
        _ => bail!("no loop time or final loss in the output:\n{stdout}"),
    }
}

fn common(settings: &Settings) -> Vec<String> {
    vec![
        "--steps".into(),
        settings.steps.to_string(),
        "--no-metrics".into(),
        "--seed".into(),
        "3".into(),
        "--compute-delay-ms".into(),
        settings.compute_delay_ms.to_string(),
    ]
}

/// One run in one process.
pub fn single(settings: &Settings) -> anyhow::Result<Run> {
    let n = settings.nprocs.to_string();
    let out = Command::new(&settings.embed)
        .args(common(settings))
        .args(["--trainers", &n, "--servers", &n])
        .output()
        .with_context(|| format!("running {}", settings.embed.display()))?;
    check(&out, "one process")
}

/// One run as `nprocs` processes.
pub fn multi(settings: &Settings) -> anyhow::Result<Run> {
    let out = Command::new(&settings.odc)
        .args(["launch", "--nprocs", &settings.nprocs.to_string()])
        .args([
            "--transport",
            &settings.transport,
            "--timeout-secs",
            "600",
            "--",
        ])
        .arg(&settings.embed)
        .args(common(settings))
        .output()
        .with_context(|| format!("running {}", settings.odc.display()))?;
    check(&out, "processes")
}

fn check(out: &std::process::Output, what: &str) -> anyhow::Result<Run> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "{what}: exit {:?}\n{stdout}\n{}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse(&stdout)
}

/// The median of `values` (not empty).
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// A/B and control, ABBA; (A medians, B median, ratio, control ratio, the per-round ratios).
pub struct Outcome {
    pub single: f64,
    pub multi: f64,
    pub ratio: f64,
    pub control: f64,
    pub round_ratios: Vec<f64>,
    pub control_ratios: Vec<f64>,
}

pub fn run(settings: &Settings, mut progress: impl FnMut(&str)) -> anyhow::Result<Outcome> {
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    let (mut round_ratios, mut control_ratios) = (Vec::new(), Vec::new());
    for round in 0..settings.rounds {
        // A B B A, then the control A' A.
        let a1 = single(settings)?;
        let b1 = multi(settings)?;
        let b2 = multi(settings)?;
        let a2 = single(settings)?;
        let c1 = single(settings)?;
        let a3 = single(settings)?;
        for r in [&b1, &b2, &c1, &a3] {
            if ((r.loss - a1.loss) / a1.loss).abs() > LOSS_TOLERANCE {
                bail!(
                    "the runs disagree (I3): final loss {} vs {} in one process",
                    r.loss,
                    a1.loss
                );
            }
        }
        let round_a = (a1.secs_per_step + a2.secs_per_step) / 2.0;
        let round_b = (b1.secs_per_step + b2.secs_per_step) / 2.0;
        round_ratios.push(round_b / round_a);
        control_ratios.push(c1.secs_per_step / a3.secs_per_step);
        a.extend([a1.secs_per_step, a2.secs_per_step]);
        b.extend([b1.secs_per_step, b2.secs_per_step]);
        c.extend([c1.secs_per_step, a3.secs_per_step]);
        progress(&format!(
            "round {round}: one process {:.2} ms/step, {} processes {:.2} ms/step, ratio {:.3}, control {:.3}",
            round_a * 1e3,
            settings.nprocs,
            round_b * 1e3,
            round_b / round_a,
            c1.secs_per_step / a3.secs_per_step
        ));
    }
    let single = median(&mut a);
    let multi = median(&mut b);
    let control = median(&mut control_ratios.clone());
    Ok(Outcome {
        single,
        multi,
        ratio: multi / single,
        control,
        round_ratios,
        control_ratios,
    })
}

/// Whether `path` looks like a release build (the numbers of a debug build are not evidence).
pub fn is_release(path: &Path) -> bool {
    path.components().any(|c| c.as_os_str() == "release")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_loop_line_and_the_final_line() {
        let out = "step 0 ...\n20 steps in 0.50 s: 40.00 steps/s, 1 tokens/s\nfinal loss=1.25 params_l2=3\n";
        let run = parse(out).expect("parses");
        assert!((run.secs_per_step - 0.025).abs() < 1e-12);
        assert_eq!(run.loss, 1.25);
        assert!(
            parse("final loss=1.0 params_l2=1\n").is_err(),
            "no loop line"
        );
        assert!(parse("3 steps in 1.0 s\nfinal loss=NaN params_l2=1\n").is_err());
        assert!(parse("").is_err());
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
