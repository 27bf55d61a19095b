//! `odc-bench gang`: what a gang costs. One long sample's forward and backward computed by one
//! trainer, and by a gang of `k` trainers each holding its zig-zag chunks and exchanging keys and
//! values over the in-process ring ([`odc::model::gang`]), on the real model (not an emulation):
//! wall time in ABBA order, with an alone-vs-alone control.
//!
//! Fairness: every model computes on the same number of CPU threads (the process's candle pools,
//! sized once by the caller: one thread per trainer on this 2-core machine), so the gang of `k`
//! uses `k` trainers' threads as it would use `k` GPUs. The ratio is the gang's time over one
//! trainer's: `1/k` is perfect, the rest is the exchange, its waits and the pieces' imbalance.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};
use odc::model::gang::{GangLayout, GangLink, InProcessGang, Tag};
use odc::model::{
    model_forward, unit_count, unit_init_values, unit_params, unit_vars, GangPiece, ModelConfig,
    PackedBatch, Sample,
};

/// One measurement's settings.
#[derive(Debug, Clone)]
pub struct GangOptions {
    pub config: ModelConfig,
    /// Tokens of the one sample.
    pub tokens: usize,
    /// Gang size.
    pub members: usize,
    /// ABBA rounds (each: alone, gang, gang, alone).
    pub rounds: usize,
}

/// What [`measure`] found (seconds per pass: one forward and backward of the sample).
#[derive(Debug, Clone, PartialEq)]
pub struct GangReport {
    pub alone_s: Vec<f64>,
    pub gang_s: Vec<f64>,
    /// Mean gang time over mean alone time.
    pub ratio: f64,
    /// The first alone pass of each round over its last: must read 1.00.
    pub control: f64,
    /// Bytes one member sent over the ring per pass (keys, values and their gradients).
    pub sent_bytes_per_member: u64,
}

/// A sample of `tokens` seeded tokens, every one a target.
fn sample(config: &ModelConfig, tokens: usize) -> Sample {
    let vocab = config.vocab_size as u64;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let tokens = (0..tokens)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab) as u32
        })
        .collect();
    Sample::all_loss(tokens)
}

/// One forward and backward of `batch` from fresh variables of the seeded weights.
fn pass(config: &ModelConfig, batch: &PackedBatch) -> anyhow::Result<()> {
    let vars: Vec<Vec<Var>> = (0..unit_count(config))
        .map(|u| {
            unit_vars(
                &unit_init_values(config, u)?,
                &unit_params(config, u)?,
                &Device::Cpu,
            )
        })
        .collect::<odc::model::Result<_>>()?;
    let units: Vec<Vec<Tensor>> = vars
        .iter()
        .map(|u| u.iter().map(|v| v.as_tensor().clone()).collect())
        .collect();
    let out = model_forward(config, &units, batch)?;
    out.loss_sum.backward()?;
    Ok(())
}

/// A link that counts the bytes its member sends.
#[derive(Debug)]
struct Counted {
    inner: Arc<dyn GangLink>,
    bytes: Arc<AtomicU64>,
}

impl GangLink for Counted {
    fn member(&self) -> usize {
        self.inner.member()
    }
    fn members(&self) -> usize {
        self.inner.members()
    }
    fn send(&self, to: usize, tag: Tag, tensors: Vec<Tensor>) -> odc::model::Result<()> {
        let bytes: usize = tensors
            .iter()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.inner.send(to, tag, tensors)
    }
    fn recv(&self, from: usize, tag: Tag) -> odc::model::Result<Vec<Tensor>> {
        self.inner.recv(from, tag)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

/// One pass of the gang (each member on its own thread); the wall time and member 0's bytes.
fn gang_pass(config: &ModelConfig, whole: &Sample, members: usize) -> anyhow::Result<(f64, u64)> {
    let bytes = Arc::new(AtomicU64::new(0));
    let links = InProcessGang::links(members, Duration::from_secs(3600));
    let started = Instant::now();
    let results: Vec<anyhow::Result<()>> = thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(m, link)| {
                let counted = Counted {
                    inner: link,
                    bytes: if m == 0 {
                        bytes.clone()
                    } else {
                        Arc::new(AtomicU64::new(0))
                    },
                };
                s.spawn(move || -> anyhow::Result<()> {
                    let layout = GangLayout::zigzag(whole.tokens.len(), members, m)?;
                    let piece = GangPiece::new(layout, Arc::new(counted));
                    let batch =
                        PackedBatch::pack_with_piece(config, &[], whole, piece, &Device::Cpu)?;
                    pass(config, &batch)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a gang member panicked")))
            })
            .collect()
    });
    let secs = started.elapsed().as_secs_f64();
    for r in results {
        r?;
    }
    Ok((secs, bytes.load(Ordering::Relaxed)))
}

/// Measures one trainer against a gang on one long sample (see the module docs); `progress`
/// gets a line per pass.
pub fn measure(
    options: &GangOptions,
    mut progress: impl FnMut(String),
) -> anyhow::Result<GangReport> {
    let c = &options.config;
    let whole = sample(c, options.tokens);
    let alone_batch = PackedBatch::pack(c, std::slice::from_ref(&whole), &Device::Cpu)?;
    let alone = || -> anyhow::Result<f64> {
        let started = Instant::now();
        pass(c, &alone_batch)?;
        Ok(started.elapsed().as_secs_f64())
    };
    // Warm-up: one of each.
    alone()?;
    gang_pass(c, &whole, options.members)?;
    let (mut alone_s, mut gang_s) = (Vec::new(), Vec::new());
    let (mut first, mut last) = (0.0, 0.0);
    let mut sent = 0;
    for round in 0..options.rounds {
        let a1 = alone()?;
        let (b1, bytes) = gang_pass(c, &whole, options.members)?;
        let (b2, _) = gang_pass(c, &whole, options.members)?;
        let a2 = alone()?;
        sent = bytes;
        progress(format!(
            "round {round}: alone {:.1} ms, gang {:.1} / {:.1} ms, alone {:.1} ms",
            a1 * 1e3,
            b1 * 1e3,
            b2 * 1e3,
            a2 * 1e3
        ));
        first += a1;
        last += a2;
        alone_s.extend([a1, a2]);
        gang_s.extend([b1, b2]);
    }
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len().max(1) as f64;
    Ok(GangReport {
        ratio: mean(&gang_s) / mean(&alone_s),
        control: first / last,
        alone_s,
        gang_s,
        sent_bytes_per_member: sent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gang_pass_runs_and_sends_what_the_ring_carries() {
        let c = ModelConfig {
            max_seq_len: 256,
            n_layers: 1,
            ..ModelConfig::tiny()
        };
        let report = measure(
            &GangOptions {
                config: c.clone(),
                tokens: 64,
                members: 2,
                rounds: 1,
            },
            |_| {},
        )
        .unwrap();
        assert_eq!(report.alone_s.len(), 2);
        assert_eq!(report.gang_s.len(), 2);
        assert!(report.ratio.is_finite() && report.ratio > 0.0);
        // One layer, a gang of 2: the forward sends K and V of 32 tokens once; the backward
        // sends K, V, dK, dV once and dK, dV home (f32, 4 heads of 32).
        let kv = 32 * c.kv_heads() * c.head_dim() * 4;
        assert_eq!(report.sent_bytes_per_member, (2 + 4 + 2) * kv as u64);
    }
}
