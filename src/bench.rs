//! The on-demand vs collective A/B benchmark (`odc bench ab`): the same simulated devices,
//! workload and seed in both modes, runs interleaved (A B A B …), figures measured in one run.
//!
//! For each run: tokens/s = tokens / wall; utilization = busy device-seconds (modelled compute spans
//! actually executed) / (devices × wall); the perfect-balance bound = tokens / (total modelled compute
//! seconds / joint device capacity), i.e. all work spread evenly at the devices' actual speeds with no
//! communication or waiting.

use std::sync::Arc;

use odc_actors::policy::clock::{Clock, SystemClock, Timestamp};
use odc_actors::policy::stats::{SpanKind, StepStats};

use odc_actors::collective::TRAINER_ENDPOINT_BASE;
use odc_transport::local::LocalTransport;
use odc_transport::throttle::Throttled;
use odc_transport::Transport;

use crate::report::{self, BenchRow};
use crate::sim::{SimDevice, SpeedSchedule};
use crate::trace::TraceSpan;
use crate::workload::Workload;
use crate::{Communication, DispatchMode, Job, Precision, Result, SampleMeta};

/// How one side of the comparison runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Side {
    pub communication: Communication,
    pub dispatch: DispatchMode,
    /// Speed-aware dispatch and plans (runtime straggler rebalancing).
    pub rebalance: bool,
}

impl Side {
    pub const COLLECTIVE: Side = Side {
        communication: Communication::Collective,
        dispatch: DispatchMode::Static,
        rebalance: false,
    };

    pub fn on_demand(dispatch: DispatchMode, rebalance: bool) -> Side {
        Side {
            communication: Communication::OnDemand,
            dispatch,
            rebalance,
        }
    }

    /// Name in the report's `dispatch` column.
    pub fn dispatch_name(&self) -> String {
        let base = match self.dispatch {
            DispatchMode::Static => "static",
            DispatchMode::Dynamic => "dynamic",
        };
        if self.rebalance {
            format!("{base}+rebalance")
        } else {
            base.to_string()
        }
    }
}

/// One benchmark case.
#[derive(Debug, Clone)]
pub struct Case {
    pub workload: Workload,
    /// Name in the report (the workload's, or a scenario's).
    pub name: String,
    pub devices: usize,
    pub minibatch_per_device: usize,
    pub speeds: SpeedSchedule,
}

/// Knobs shared by every run.
#[derive(Debug, Clone)]
pub struct Settings {
    pub device: SimDevice,
    pub steps: u64,
    /// Token budget of a micro-batch; `None`: the smallest power of two of at least 16,384 that
    /// holds every sampled sequence (65,536 for the SFT-like workloads, 16,384 for RL).
    pub token_budget: Option<u64>,
    pub seed: u64,
    pub prefetch: usize,
    pub chunk_elems: usize,
    /// Modelled seconds to move one unit over one device's link (0: no link model). Each device's
    /// shard server and trainer share its link; transfers on one link queue.
    pub unit_transfer_seconds: f64,
}

impl Settings {
    /// Modelled link bandwidth, bytes per second (`None` without a link model).
    pub fn link_bytes_per_sec(&self) -> Option<f64> {
        (self.unit_transfer_seconds > 0.0)
            .then(|| (self.device.unit_elems * 4) as f64 / self.unit_transfer_seconds)
    }

    /// The transport of a run: local, behind the link model when there is one.
    fn transport(&self) -> Arc<dyn Transport> {
        let local: Arc<dyn Transport> = Arc::new(LocalTransport::new());
        match self.link_bytes_per_sec() {
            // A device's link carries its shard server's regions and its trainer's staging.
            Some(bw) => Arc::new(Throttled::new(
                local,
                bw,
                Arc::new(|e| e % TRAINER_ENDPOINT_BASE),
            )),
            None => local,
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            device: SimDevice::default(),
            steps: 4,
            token_budget: None,
            seed: 0,
            prefetch: 1,
            chunk_elems: 1 << 14,
            unit_transfer_seconds: 0.0,
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, Default)]
pub struct Measure {
    pub tokens: u64,
    pub wall: f64,
    /// Modelled compute seconds executed (all devices).
    pub busy: f64,
    /// Seconds of the perfect-balance bound.
    pub bound: f64,
    /// Seconds trainers waited on pulls and pushes.
    pub comm_wait: f64,
    /// Bytes pulled and pushed by all trainers.
    pub bytes: u64,
    pub spans: Vec<TraceSpan>,
}

impl Measure {
    fn add(&mut self, other: &Measure) {
        self.tokens += other.tokens;
        self.wall += other.wall;
        self.busy += other.busy;
        self.bound += other.bound;
        self.comm_wait += other.comm_wait;
        self.bytes += other.bytes;
    }
}

/// The minibatch of `step`: `devices × minibatch_per_device` samples of the workload.
pub fn minibatch(case: &Case, seed: u64, step: u64) -> Vec<SampleMeta> {
    let n = case.devices * case.minibatch_per_device;
    let lengths = case
        .workload
        .sample(n, seed.wrapping_mul(1_000_003).wrapping_add(step));
    lengths
        .into_iter()
        .enumerate()
        .map(|(i, tokens)| SampleMeta::new(step * n as u64 + i as u64, tokens))
        .collect()
}

/// The token budget of `case`'s runs.
pub fn token_budget(case: &Case, settings: &Settings) -> u64 {
    settings.token_budget.unwrap_or_else(|| {
        let longest = (0..settings.steps)
            .flat_map(|step| minibatch(case, settings.seed, step))
            .map(|s| s.tokens)
            .max()
            .unwrap_or(0);
        longest.max(16_384).next_power_of_two()
    })
}

/// Spans of one step as trace spans relative to `origin`; barrier waits added per trainer.
fn trace_spans(stats: &StepStats, origin: Timestamp, devices: usize) -> Vec<TraceSpan> {
    let rel = |t: Timestamp| t.saturating_duration_since(origin);
    let mut out = Vec::new();
    for r in &stats.micro_batch_log {
        for s in &r.spans {
            out.push(TraceSpan {
                trainer: r.trainer,
                name: s.kind.name().to_string(),
                start: rel(s.start),
                duration: s.end.saturating_duration_since(s.start),
            });
        }
    }
    let end = stats.started + stats.wall;
    for t in 0..devices {
        let last = stats
            .micro_batch_log
            .iter()
            .filter(|r| r.trainer == t)
            .map(|r| r.finished)
            .max()
            .unwrap_or(stats.started);
        out.push(TraceSpan {
            trainer: t,
            name: SpanKind::BarrierWait.name().to_string(),
            start: rel(last),
            duration: end.saturating_duration_since(last),
        });
    }
    out
}

/// Run `settings.steps` minibatches of `case` on one side.
pub async fn run(case: &Case, side: Side, settings: &Settings, trace: bool) -> Result<Measure> {
    let device = Arc::new(SimDevice {
        speeds: case.speeds.clone(),
        ..settings.device.clone()
    });
    let mut job = Job::builder()
        .units(device.layout())
        .trainers(case.devices)
        .servers(case.devices)
        .communication(side.communication)
        .dispatch(side.dispatch)
        .rebalance(side.rebalance)
        .cost_model(device.cost)
        .token_budget(token_budget(case, settings))
        .pull_precision(Precision::F32)
        .prefetch(settings.prefetch)
        .chunk_elems(settings.chunk_elems)
        .transport(settings.transport())
        .optimizer(crate::OptimizerConfig::sgd(0.0))
        .compute(device.factory())
        .build()?;
    let origin = SystemClock.now();
    let mut m = Measure::default();
    for step in 0..settings.steps {
        let samples = minibatch(case, settings.seed, step);
        let tokens: Vec<u64> = samples.iter().map(|s| s.tokens).collect();
        let stats = job.step_with(samples).await?;
        m.tokens += stats.tokens;
        m.bytes += stats
            .trainers
            .iter()
            .map(|t| t.bytes_pulled + t.bytes_pushed)
            .sum::<u64>();
        m.wall += stats.wall.as_secs_f64();
        m.bound += device.seconds(&tokens) / device.speeds.capacity(case.devices, step);
        for r in &stats.micro_batch_log {
            for s in &r.spans {
                let d = s.end.saturating_duration_since(s.start).as_secs_f64();
                match s.kind {
                    SpanKind::Compute => m.busy += d,
                    SpanKind::PullWait | SpanKind::PushWait => m.comm_wait += d,
                    SpanKind::BarrierWait => {}
                }
            }
        }
        if trace {
            m.spans.extend(trace_spans(&stats, origin, case.devices));
        }
    }
    job.shutdown().await;
    Ok(m)
}

/// A/B-compare `case`: collective vs on-demand `side`, interleaved `reps` times.
pub async fn compare(
    case: &Case,
    side: Side,
    settings: &Settings,
    reps: usize,
) -> Result<(BenchRow, Measure, Measure)> {
    let (mut a, mut b) = (Measure::default(), Measure::default());
    for _ in 0..reps.max(1) {
        a.add(&run(case, Side::COLLECTIVE, settings, false).await?);
        b.add(&run(case, side, settings, false).await?);
    }
    let tps = |m: &Measure| {
        if m.wall > 0.0 {
            m.tokens as f64 / m.wall
        } else {
            0.0
        }
    };
    let row = BenchRow {
        workload: case.name.clone(),
        devices: case.devices,
        minibatch_per_device: case.minibatch_per_device,
        dispatch: side.dispatch_name(),
        collective_tokens_per_s: tps(&a),
        ondemand_tokens_per_s: tps(&b),
        speedup: if tps(&a) > 0.0 {
            tps(&b) / tps(&a)
        } else {
            0.0
        },
        collective_utilization: report::utilization(a.busy, case.devices, a.wall),
        ondemand_utilization: report::utilization(b.busy, case.devices, b.wall),
        bound_tokens_per_s: if b.bound > 0.0 {
            b.tokens as f64 / b.bound
        } else {
            0.0
        },
    };
    Ok((row, a, b))
}
