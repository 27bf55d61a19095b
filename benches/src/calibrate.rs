//! `odc-bench calibrate`: what one unit's forward + backward costs against the tokens of its
//! micro-batch, on this machine's device, written as a **profile** the at-scale simulation loads.
//!
//! # Method
//!
//! - For each model config (`gpu-100m`, `block-1.5b`, `block-7b`, … see `ModelConfig::preset`) and
//!   each unit kind it has (`embed`, `block`, `head`; the block-shaped presets only measure the
//!   block), one micro-batch of **one sample of `s` tokens** per point, `s` on a ladder
//!   (`--tokens`), exactly as a trainer runs the unit: its parameters as fp32 `Var`s, matrices cast
//!   to the compute precision, the unit's forward on a detached input, then the backward of
//!   `sum(output · g)` (the head: of its loss). Timed from the first op to a device
//!   synchronisation; `--warmup` untimed runs first (kernel loading, the allocator), then the
//!   median of `--reps`.
//! - A point whose run fails (e.g. out of device memory: the attention scores grow as `s²`) ends
//!   that unit's ladder; it is recorded in `skipped` with the error.
//! - Fit, least squares over the points, in milliseconds per unit with `ŝ = s / 32000` (ODC's
//!   normalisation): `t(ŝ) = a·ŝ² + b·ŝ + c`; `c` is the per-micro-batch fixed cost of the unit
//!   (launch-bound small micro-batches). A packed micro-batch of samples `s_i` is predicted as
//!   `a·Σŝ_i² + b·Σŝ_i + c` (attention is per sample, the rest per token); one **pack check** per
//!   unit measures four samples of `s/4` packed together against that prediction.
//!
//! # Profile schema (`--json PATH`, [`Profile`]; version [`SCHEMA`])
//!
//! ```json
//! {
//!   "schema": "odc.calibration.v1",
//!   "device": "cuda:0 (NVIDIA H100 80GB HBM3)",   // or "cpu"
//!   "precision": "bf16",                          // "f32" or "bf16" (mixed, see odc::model::device)
//!   "s_hat_tokens": 32000,                        // ŝ = tokens / s_hat_tokens
//!   "warmup": 1, "reps": 3,
//!   "units": [{
//!     "model": "block-7b",                        // ModelConfig::preset name
//!     "unit": "block",                            // "embed" | "block" | "head"
//!     "params": 255073280,                        // parameters of the unit
//!     "d_model": 3584, "n_heads": 28, "d_ff": 18944, "vocab_size": 259,
//!     "points": [{"tokens": 1024, "ms": 3.97, "ms_min": 3.91, "ms_max": 4.02}],
//!     "skipped": [{"tokens": 16384, "error": "…out of memory…"}],
//!     "fit": {"a": 46.9, "b": 76.7, "c": 1.9, "rmse_ms": 0.4},   // ms; null with < 3 points
//!     "pack_check": {"samples": [1024, 1024, 1024, 1024], "ms": 8.1, "predicted_ms": 8.0}
//!   }]
//! }
//! ```
//!
//! A simulator prices a micro-batch on a device as the sum over the model's units (the blocks
//! `n_layers` times) of their fits at the micro-batch's samples.

use std::time::Instant;

use anyhow::Context as _;
use candle_core::{DType, Device, Tensor, Var};
use odc::model::{
    unit_count, unit_forward, unit_init_values, unit_params, unit_vars, ComputePrecision,
    ModelConfig, PackedBatch, Sample, UnitOutput,
};
use serde::{Deserialize, Serialize};

use crate::processes::median;

/// The profile's format version.
pub const SCHEMA: &str = "odc.calibration.v1";

/// ODC's length normalisation: `ŝ = s / 32000`.
pub const S_HAT_TOKENS: f64 = 32_000.0;

/// What to measure.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Preset names.
    pub models: Vec<String>,
    /// Tokens per micro-batch (one sample each), ascending.
    pub tokens: Vec<usize>,
    pub warmup: u32,
    pub reps: u32,
    pub precision: ComputePrecision,
}

/// The profile file (see the module docs).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Profile {
    pub schema: String,
    pub device: String,
    pub precision: String,
    pub s_hat_tokens: f64,
    pub warmup: u32,
    pub reps: u32,
    pub units: Vec<UnitProfile>,
}

/// One unit kind of one model.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct UnitProfile {
    pub model: String,
    pub unit: String,
    pub params: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub d_ff: usize,
    pub vocab_size: usize,
    pub points: Vec<Point>,
    pub skipped: Vec<Skipped>,
    pub fit: Option<Fit>,
    pub pack_check: Option<PackCheck>,
}

/// One measured micro-batch size.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Point {
    pub tokens: usize,
    /// Median of the timed runs, milliseconds.
    pub ms: f64,
    pub ms_min: f64,
    pub ms_max: f64,
}

/// A size that could not run, and why.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Skipped {
    pub tokens: usize,
    pub error: String,
}

/// `t(ŝ) = a·ŝ² + b·ŝ + c` milliseconds, and its root-mean-square residual over the points.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Fit {
    pub a: f64,
    pub b: f64,
    pub c: f64,
    pub rmse_ms: f64,
}

impl Fit {
    /// Predicted milliseconds of a micro-batch packing samples of these lengths.
    pub fn predict(&self, samples: &[usize]) -> f64 {
        let hats = samples.iter().map(|&s| s as f64 / S_HAT_TOKENS);
        let (sq, lin) = hats.fold((0.0, 0.0), |(q, l), h| (q + h * h, l + h));
        self.a * sq + self.b * lin + self.c
    }
}

/// A packed micro-batch measured against its prediction.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PackCheck {
    pub samples: Vec<usize>,
    pub ms: f64,
    pub predicted_ms: f64,
}

/// Least squares of `t = a·ŝ² + b·ŝ + c` over `(tokens, ms)` points; `None` with fewer than three
/// distinct sizes or a singular system.
pub fn fit(points: &[(usize, f64)]) -> Option<Fit> {
    let mut sizes: Vec<usize> = points.iter().map(|p| p.0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.len() < 3 {
        return None;
    }
    // Normal equations of the 3-column design [ŝ², ŝ, 1].
    let mut m = [[0.0f64; 4]; 3];
    for &(s, t) in points {
        let h = s as f64 / S_HAT_TOKENS;
        let row = [h * h, h, 1.0];
        for i in 0..3 {
            for j in 0..3 {
                m[i][j] += row[i] * row[j];
            }
            m[i][3] += row[i] * t;
        }
    }
    // Gaussian elimination with partial pivoting.
    for col in 0..3 {
        let pivot = (col..3).max_by(|&x, &y| m[x][col].abs().total_cmp(&m[y][col].abs()))?;
        m.swap(col, pivot);
        if m[col][col].abs() < 1e-300 {
            return None;
        }
        for row in 0..3 {
            if row != col {
                let f = m[row][col] / m[col][col];
                let pivot_row = m[col];
                for (x, p) in m[row].iter_mut().zip(pivot_row).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    let (a, b, c) = (m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]);
    if !(a.is_finite() && b.is_finite() && c.is_finite()) {
        return None;
    }
    let mut fit = Fit {
        a,
        b,
        c,
        rmse_ms: 0.0,
    };
    let sse: f64 = points
        .iter()
        .map(|&(s, t)| (fit.predict(&[s]) - t).powi(2))
        .sum();
    fit.rmse_ms = (sse / points.len() as f64).sqrt();
    Some(fit)
}

/// The unit kinds a preset is measured for: `(unit index, name)`.
fn units_of(name: &str, config: &ModelConfig) -> Vec<(usize, &'static str)> {
    if name.starts_with("block-") {
        vec![(1, "block")]
    } else {
        vec![(0, "embed"), (1, "block"), (unit_count(config) - 1, "head")]
    }
}

/// A sample of `len` byte tokens (all carrying loss), seeded by its length.
fn sample(len: usize, vocab: usize) -> Sample {
    let vocab = vocab.clamp(1, 256) as u64;
    let tokens = (0..len as u64)
        .map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) % vocab) as u32)
        .collect();
    Sample::all_loss(tokens)
}

/// One forward + backward of unit `u` on a micro-batch of `samples`, timed to a device
/// synchronisation, in milliseconds.
fn run_once(
    config: &ModelConfig,
    u: usize,
    vars: &[Var],
    precision: ComputePrecision,
    samples: &[Sample],
    device: &Device,
) -> anyhow::Result<f64> {
    let batch = PackedBatch::pack(config, samples, device)?;
    let input = match u {
        0 => None,
        _ => Some(Var::from_tensor(
            &(Tensor::randn(0f32, 1.0, (batch.len(), config.d_model), device)?
                .to_dtype(precision.dtype())?),
        )?),
    };
    let g = Tensor::randn(0f32, 1.0, (batch.len(), config.d_model), device)?
        .to_dtype(precision.dtype())?;
    device.synchronize()?;
    let started = Instant::now();
    let params = precision.unit_inputs(vars)?;
    let out = unit_forward(
        config,
        u,
        &params,
        input.as_ref().map(Var::as_tensor),
        &batch,
    )?;
    let root = match out {
        UnitOutput::Head(head) => head.loss_sum,
        UnitOutput::Hidden(h) => (h * &g)?.to_dtype(DType::F32)?.sum_all()?,
    };
    let grads = root.backward()?;
    // Every parameter's gradient exists (as the trainer pushes it).
    for var in vars {
        grads
            .get(var.as_tensor())
            .context("a parameter without a gradient")?;
    }
    device.synchronize()?;
    Ok(started.elapsed().as_secs_f64() * 1e3)
}

/// `warmup` untimed runs, then `reps` timed: (median, min, max) ms.
fn measure(
    settings: &Settings,
    config: &ModelConfig,
    u: usize,
    vars: &[Var],
    samples: &[Sample],
    device: &Device,
) -> anyhow::Result<(f64, f64, f64)> {
    for _ in 0..settings.warmup {
        run_once(config, u, vars, settings.precision, samples, device)?;
    }
    let mut times = (0..settings.reps.max(1))
        .map(|_| run_once(config, u, vars, settings.precision, samples, device))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (lo, hi) = times
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(l, h), &t| (l.min(t), h.max(t)));
    Ok((median(&mut times), lo, hi))
}

/// Runs the calibration on `device` (named `device_name` in the profile); `progress` gets one
/// line per point.
pub fn run(
    settings: &Settings,
    device: &Device,
    device_name: &str,
    mut progress: impl FnMut(&str),
) -> anyhow::Result<Profile> {
    let mut units = Vec::new();
    for name in &settings.models {
        let base = ModelConfig::preset(name)?;
        let longest = settings.tokens.iter().copied().max().unwrap_or(1);
        let config = ModelConfig {
            max_seq_len: base.max_seq_len.max(longest),
            ..base
        };
        for (u, kind) in units_of(name, &config) {
            let specs = unit_params(&config, u)?;
            let vars = unit_vars(&unit_init_values(&config, u)?, &specs, device)?;
            let mut profile = UnitProfile {
                model: name.clone(),
                unit: kind.into(),
                params: specs.iter().map(|p| p.numel()).sum(),
                d_model: config.d_model,
                n_heads: config.n_heads,
                d_ff: config.d_ff,
                vocab_size: config.vocab_size,
                points: Vec::new(),
                skipped: Vec::new(),
                fit: None,
                pack_check: None,
            };
            for &tokens in &settings.tokens {
                let one = [sample(tokens, config.vocab_size)];
                match measure(settings, &config, u, &vars, &one, device) {
                    Ok((ms, ms_min, ms_max)) => {
                        progress(&format!(
                            "{name} {kind} {tokens} tokens: {ms:.3} ms ({ms_min:.3}..{ms_max:.3})"
                        ));
                        profile.points.push(Point {
                            tokens,
                            ms,
                            ms_min,
                            ms_max,
                        });
                    }
                    Err(e) => {
                        let error = crate::error_chain(e.as_ref());
                        progress(&format!("{name} {kind} {tokens} tokens: skipped: {error}"));
                        profile.skipped.push(Skipped { tokens, error });
                        break;
                    }
                }
            }
            let points: Vec<(usize, f64)> =
                profile.points.iter().map(|p| (p.tokens, p.ms)).collect();
            profile.fit = fit(&points);
            if let (Some(f), Some(largest)) = (profile.fit, profile.points.last()) {
                let quarter = (largest.tokens / 4).max(2);
                let pack: Vec<Sample> =
                    (0..4).map(|_| sample(quarter, config.vocab_size)).collect();
                if let Ok((ms, _, _)) = measure(settings, &config, u, &vars, &pack, device) {
                    let samples = vec![quarter; 4];
                    let predicted_ms = f.predict(&samples);
                    progress(&format!(
                        "{name} {kind} pack of 4 x {quarter}: {ms:.3} ms, predicted {predicted_ms:.3}"
                    ));
                    profile.pack_check = Some(PackCheck {
                        samples,
                        ms,
                        predicted_ms,
                    });
                }
            }
            units.push(profile);
        }
    }
    Ok(Profile {
        schema: SCHEMA.into(),
        device: device_name.into(),
        precision: settings.precision.to_string(),
        s_hat_tokens: S_HAT_TOKENS,
        warmup: settings.warmup,
        reps: settings.reps,
        units,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_a_quadratic_and_predicts_packs() {
        let truth = Fit {
            a: 46.95,
            b: 76.70,
            c: 1.9,
            rmse_ms: 0.0,
        };
        let points: Vec<(usize, f64)> = [1024, 2048, 4096, 8192, 16384]
            .iter()
            .map(|&s| (s, truth.predict(&[s])))
            .collect();
        let got = fit(&points).expect("five sizes");
        for (x, y) in [(got.a, truth.a), (got.b, truth.b), (got.c, truth.c)] {
            assert!((x - y).abs() < 1e-6, "{got:?}");
        }
        assert!(got.rmse_ms < 1e-9);
        // A pack: attention per sample, the rest per token, one fixed cost.
        let h = 4096.0 / S_HAT_TOKENS;
        let want = truth.a * 4.0 * h * h + truth.b * 4.0 * h + truth.c;
        assert!((got.predict(&[4096; 4]) - want).abs() < 1e-6);
        assert!(
            fit(&points[..2]).is_none(),
            "two sizes do not fit three terms"
        );
        assert!(fit(&[(1024, 1.0), (1024, 2.0), (2048, 3.0)]).is_none());
    }

    #[test]
    fn calibration_on_the_cpu_writes_a_profile_that_round_trips() {
        let settings = Settings {
            models: vec!["tiny".into()],
            tokens: vec![16, 32, 64],
            warmup: 0,
            reps: 1,
            precision: ComputePrecision::F32,
        };
        let profile = run(&settings, &Device::Cpu, "cpu", |_| {}).unwrap();
        assert_eq!(profile.schema, SCHEMA);
        let kinds: Vec<&str> = profile.units.iter().map(|u| u.unit.as_str()).collect();
        assert_eq!(kinds, ["embed", "block", "head"]);
        for unit in &profile.units {
            assert_eq!(unit.points.len(), 3, "{unit:?}");
            assert!(unit.points.iter().all(|p| p.ms.is_finite() && p.ms > 0.0));
            assert!(unit.skipped.is_empty());
        }
        let json = serde_json::to_string(&profile).unwrap();
        let back: Profile = serde_json::from_str(&json).unwrap();
        assert_eq!(back, profile);
    }
}
