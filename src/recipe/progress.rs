//! A run's progress: [`Progress`] counts the tokens and the time of steps `first..steps` (the
//! rate is over the steps' own wall time, so evaluations and checkpoints between steps do not
//! lower it, as `transformers`' `train_tokens_per_second` leaves evaluation out), keeps
//! the loss smoothed over steps (an exponential average, 0.9), and words the lines a run prints:
//! a progress bar's message on a terminal, else a line for the first step, every tenth and the
//! last ([`Progress::line_due`]), and the rate at the end.
//!
//! **MFU, one formula for every figure odc prints** ([`mfu`]): `6 · N · tokens/s` over the
//! device's dense peak, `N` every parameter of the model once (a tied head is the embedding
//! matrix, counted once, as the head's matmul). Attention's own FLOPs are not counted, so a run of
//! long sequences reads lower than the hardware's use. `benches/gpu/peer.py` (the PyTorch peer)
//! counts the same way.
//!
//! The peak ([`Peak`]) is named with every MFU printed: the card's datasheet figure on a GPU
//! (H100/H200 by default), the measured matmul rate of the process's trainers on the CPU, or the
//! user's `--peak-tflops`. Without one ([`Progress::new`] alone) no MFU is printed.

use std::time::{Duration, Instant};

use crate::StepStats;

/// The dense bf16 peak of an H100 SXM or H200 (NVIDIA's datasheets, without sparsity), FLOP/s:
/// the MFU denominator on those cards.
pub const H100_SXM_BF16_DENSE: f64 = 989e12;

/// Model FLOPs utilisation of a model of `params` parameters training at `tokens_per_s` on a
/// device of `peak` FLOP/s (see the [module docs](self)).
pub fn mfu(params: u64, tokens_per_s: f64, peak: f64) -> f64 {
    6.0 * params as f64 * tokens_per_s / peak
}

/// The FLOP/s an MFU is over, and where the figure comes from (printed beside it).
#[derive(Debug, Clone, PartialEq)]
pub struct Peak {
    pub flops: f64,
    /// What the figure is, e.g. "the bf16 dense peak of an H100/H200".
    pub source: String,
}

impl Peak {
    /// `tflops` as the user gave it (`--peak-tflops`); refused unless positive and finite.
    pub fn given(tflops: f64) -> std::result::Result<Peak, String> {
        match tflops.is_finite() && tflops > 0.0 {
            true => Ok(Peak {
                flops: tflops * 1e12,
                source: format!("--peak-tflops {tflops}"),
            }),
            false => Err(format!(
                "--peak-tflops must be a positive number of TFLOP/s, got {tflops}"
            )),
        }
    }

    /// An H100 SXM's or H200's dense bf16 peak ([`H100_SXM_BF16_DENSE`]).
    pub fn h100() -> Peak {
        Peak {
            flops: H100_SXM_BF16_DENSE,
            source: "the bf16 dense peak of an H100/H200, 989 TFLOP/s".into(),
        }
    }
}

/// See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Progress {
    started: Instant,
    first: u64,
    steps: u64,
    tokens: u64,
    /// The steps' wall time, summed.
    stepping: Duration,
    loss: f64,
    smoothed: f64,
    /// The model's parameters and the peak, for MFU.
    mfu: Option<(u64, Peak)>,
}

impl Progress {
    /// Steps `first..steps` start now.
    pub fn new(first: u64, steps: u64) -> Progress {
        Progress {
            started: Instant::now(),
            first,
            steps,
            tokens: 0,
            stepping: Duration::ZERO,
            loss: f64::NAN,
            smoothed: f64::NAN,
            mfu: None,
        }
    }

    /// The same, printing the MFU of a model of `params` parameters over `peak`.
    pub fn with_mfu(mut self, params: u64, peak: Peak) -> Progress {
        self.mfu = Some((params, peak));
        self
    }

    /// The MFU so far (at [`Progress::rate`]), when a peak was given.
    pub fn mfu(&self) -> Option<f64> {
        let (params, peak) = self.mfu.as_ref()?;
        Some(mfu(*params, self.rate(), peak.flops))
    }

    /// The figures a run logs after step `done`'s statistics `s` (see [`super::Log`]): loss,
    /// gradient norm, tokens/s and MFU so far, the step's milliseconds, and `extra`.
    pub fn figures<'a>(&self, s: &StepStats, extra: &[(&'a str, f64)]) -> Vec<(&'a str, f64)> {
        let mut figures = vec![
            ("loss", s.loss),
            ("grad_norm", s.grad_norm),
            ("tokens_per_s", self.rate()),
            ("step_ms", s.wall.as_secs_f64() * 1e3),
        ];
        if let Some(mfu) = self.mfu() {
            figures.push(("mfu", mfu));
        }
        figures.extend_from_slice(extra);
        figures
    }

    /// A step is done.
    pub fn record(&mut self, s: &StepStats) {
        self.tokens += s.tokens;
        self.stepping += s.wall;
        self.loss = s.loss;
        self.smoothed = match self.smoothed.is_nan() {
            true => s.loss,
            false => 0.9 * self.smoothed + 0.1 * s.loss,
        };
    }

    /// Tokens trained so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The last step's loss (NaN before the first).
    pub fn loss(&self) -> f64 {
        self.loss
    }

    /// Time since the first step started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Tokens per second of the steps so far (0 before the first).
    pub fn rate(&self) -> f64 {
        match self.stepping.is_zero() {
            true => 0.0,
            false => self.tokens as f64 / self.stepping.as_secs_f64(),
        }
    }

    /// A progress bar's message: the smoothed loss, the rate and the MFU.
    pub fn message(&self) -> String {
        format!(
            "loss {:.4}  {:.0} tok/s{}",
            self.smoothed,
            self.rate(),
            self.mfu_words()
        )
    }

    /// `  mfu 1.23%` when a peak was given, else nothing.
    fn mfu_words(&self) -> String {
        self.mfu()
            .map(|m| format!("  mfu {:.2}%", m * 100.0))
            .unwrap_or_default()
    }

    /// Whether a run without a terminal prints a line after step `done` (1-based): the first,
    /// every tenth and the last.
    pub fn line_due(&self, done: u64) -> bool {
        done % 10 == 0 || done == self.first + 1 || done == self.steps
    }

    /// The line after step `done` whose statistics are `s`: loss, gradient norm, rate, the
    /// step's time, and the gangs of split samples if any.
    pub fn line(&self, done: u64, s: &StepStats) -> String {
        let split = match s.gangs.is_empty() {
            true => String::new(),
            false => format!("  split {:?}", s.gangs),
        };
        format!(
            "step {done:4}/{}  loss {:.4}  grad-norm {:.3}  {:.0} tok/s{}  {:.0} ms/step{split}",
            self.steps,
            s.loss,
            s.grad_norm,
            self.rate(),
            self.mfu_words(),
            s.wall.as_secs_f64() * 1e3
        )
    }

    /// The run's time, its rate at the end, and its MFU with the peak it is over.
    pub fn summary(&self) -> String {
        let secs = self.elapsed().as_secs_f64();
        let mfu = match (&self.mfu, self.mfu()) {
            (Some((params, peak)), Some(m)) => format!(
                "; MFU {:.2}% (6 x {params} parameters x tokens/s over {})",
                m * 100.0,
                peak.source
            ),
            _ => String::new(),
        };
        format!(
            "{} steps in {secs:.1} s ({:.1} s in the steps): {:.0} tokens/s{mfu}",
            self.steps - self.first,
            self.stepping.as_secs_f64(),
            self.rate()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loss_is_smoothed_and_lines_come_first_every_tenth_and_last() {
        let mut p = Progress::new(4, 25);
        let stats = |loss: f64| StepStats {
            loss,
            tokens: 100,
            ..StepStats::default()
        };
        p.record(&stats(2.0));
        p.record(&stats(1.0));
        assert_eq!(p.tokens(), 200);
        assert_eq!(p.loss(), 1.0);
        assert!((p.smoothed - 1.9).abs() < 1e-12, "{}", p.smoothed);
        let due: Vec<u64> = (5..=25).filter(|&d| p.line_due(d)).collect();
        assert_eq!(due, [5, 10, 20, 25]);
        assert!(p
            .line(10, &stats(1.0))
            .starts_with("step   10/25  loss 1.0000"));
        assert!(p.mfu().is_none() && !p.line(10, &stats(1.0)).contains("mfu"));
    }

    #[test]
    fn mfu_is_six_n_tokens_per_second_over_the_named_peak() {
        let peak = Peak::given(2.0).unwrap();
        let mut p = Progress::new(0, 10).with_mfu(1_000_000, peak);
        assert_eq!(p.rate(), 0.0);
        p.record(&StepStats {
            loss: 1.0,
            tokens: 5000,
            wall: Duration::from_millis(250),
            ..StepStats::default()
        });
        // Over the step's time, not the wall clock since the start.
        std::thread::sleep(Duration::from_millis(20));
        let (rate, m) = (p.rate(), p.mfu().unwrap());
        assert_eq!(rate, 20_000.0);
        let want = 6.0 * 1e6 * rate / 2e12;
        assert!((m - want).abs() <= 1e-6 * want, "{m} vs {want}");
        assert!(p.line(1, &StepStats::default()).contains("  mfu "));
        let summary = p.summary();
        assert!(
            summary.contains("MFU") && summary.contains("--peak-tflops 2"),
            "{summary}"
        );
        let names: Vec<&str> = p
            .figures(&StepStats::default(), &[("learning_rate", 1e-3)])
            .iter()
            .map(|f| f.0)
            .collect();
        assert_eq!(
            names,
            [
                "loss",
                "grad_norm",
                "tokens_per_s",
                "step_ms",
                "mfu",
                "learning_rate"
            ]
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(Peak::given(bad).unwrap_err().contains("--peak-tflops"));
        }
    }
}
