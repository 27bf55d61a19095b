//! A run's progress: [`Progress`] counts the tokens and the time of steps `first..steps`, keeps
//! the loss smoothed over steps (an exponential average, 0.9), and words the lines a run prints:
//! a progress bar's message on a terminal, else a line for the first step, every tenth and the
//! last ([`Progress::line_due`]), and the rate at the end.
//!
//! **MFU, one formula for every figure odc prints** ([`mfu`]): `6 · N · tokens/s` over the
//! device's dense peak, `N` every parameter of the model once (a tied head is the embedding
//! matrix, counted once, as the head's matmul). Attention's own FLOPs are not counted, so a run of
//! long sequences reads lower than the hardware's use. `benches/gpu/peer.py` (the PyTorch peer)
//! counts the same way.

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

/// See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Progress {
    started: Instant,
    first: u64,
    steps: u64,
    tokens: u64,
    loss: f64,
    smoothed: f64,
}

impl Progress {
    /// Steps `first..steps` start now.
    pub fn new(first: u64, steps: u64) -> Progress {
        Progress {
            started: Instant::now(),
            first,
            steps,
            tokens: 0,
            loss: f64::NAN,
            smoothed: f64::NAN,
        }
    }

    /// A step is done.
    pub fn record(&mut self, s: &StepStats) {
        self.tokens += s.tokens;
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

    /// Tokens per second so far.
    pub fn rate(&self) -> f64 {
        self.tokens as f64 / self.elapsed().as_secs_f64()
    }

    /// A progress bar's message: the smoothed loss and the rate.
    pub fn message(&self) -> String {
        format!("loss {:.4}  {:.0} tok/s", self.smoothed, self.rate())
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
            "step {done:4}/{}  loss {:.4}  grad-norm {:.3}  {:.0} tok/s  {:.0} ms/step{split}",
            self.steps,
            s.loss,
            s.grad_norm,
            self.rate(),
            s.wall.as_secs_f64() * 1e3
        )
    }

    /// The run's rate at the end.
    pub fn summary(&self) -> String {
        let secs = self.elapsed().as_secs_f64();
        format!(
            "{} steps in {secs:.1} s: {:.0} tokens/s",
            self.steps - self.first,
            self.tokens as f64 / secs
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
    }
}
