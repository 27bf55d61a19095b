//! The simulated device: a [`Compute`] whose forward/backward time per unit comes from the cost
//! model at a configured device speed, while gathers and gradient pushes move real bytes over the
//! real transport. Only the FLOPs are replaced by waiting, as a GPU's kernels run asynchronously to
//! the host thread.
//!
//! - Time of a micro-batch: `Σ cost(sample) · seconds_per_cost / speed` (a gang's piece: its
//!   sample's cost over the gang's size), one third forward and two
//!   thirds backward, split evenly over the units.
//! - Waiting is at the device's [`Pace`]: in wall time `std::thread::sleep` on a blocking thread
//!   (tens of microseconds of error), not tokio's millisecond timer wheel; in virtual time tokio's
//!   timer on a paused runtime ([`clock`]: the virtual-time runner). What one wait overshoots is
//!   taken off the next one of the micro-batch, so short spans do not inflate the modelled time.
//! - Every compute span is recorded in the micro-batch's timeline ([`SpanKind::Compute`]), read
//!   from the job's clock ([`TrainerContext::now`]); busy time and utilization are measured from
//!   those spans.
//! - [`SpeedSchedule`]: per-device speed factors, including a device that slows down from a step
//!   on.

use std::sync::Arc;
use std::time::{Duration, Instant};

/// The first endpoint id of a trainer's collective inbox (`TRAINER_ENDPOINT_BASE + rank`): a
/// modelled cluster tells trainers' endpoints from shard servers' by it.
pub use odc_actors::datapath::collective::TRAINER_ENDPOINT_BASE;
use odc_actors::policy::balancer::CostModel;
pub use odc_transport::throttle::Pace;

use crate::{
    async_trait, Compute, ComputeOutput, MicroBatch, SpanKind, TrainerContext, UnitId, UnitSpec,
};

pub mod clock;

/// A change of one device's speed from a step on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeedChange {
    pub trainer: usize,
    pub from_step: u64,
    pub factor: f64,
}

/// Speed factor of every device at every step (1.0 = nominal).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SpeedSchedule {
    pub changes: Vec<SpeedChange>,
}

impl SpeedSchedule {
    /// Every device at nominal speed.
    pub fn uniform() -> Self {
        SpeedSchedule::default()
    }

    /// `trainer` runs at `factor` from `from_step` on.
    pub fn with_change(mut self, trainer: usize, from_step: u64, factor: f64) -> Self {
        self.changes.push(SpeedChange {
            trainer,
            from_step,
            factor,
        });
        self
    }

    /// Speed of `trainer` during `step`: the last change that applies, else 1.0.
    pub fn speed(&self, trainer: usize, step: u64) -> f64 {
        self.changes
            .iter()
            .rev()
            .find(|c| c.trainer == trainer && c.from_step <= step)
            .map_or(1.0, |c| c.factor)
    }

    /// Sum of the speeds of `devices` devices at `step` (their joint capacity).
    pub fn capacity(&self, devices: usize, step: u64) -> f64 {
        (0..devices).map(|t| self.speed(t, step)).sum()
    }
}

/// A simulated model and device.
#[derive(Debug, Clone, PartialEq)]
pub struct SimDevice {
    /// Units of the model (transformer blocks), gathered in order.
    pub units: usize,
    /// Elements per unit: the bytes every gather and push moves.
    pub unit_elems: usize,
    pub cost: CostModel,
    /// Wall seconds one cost unit takes at speed 1.0 (the time scale).
    pub seconds_per_cost: f64,
    pub speeds: SpeedSchedule,
    /// How compute waits spend time (wall or virtual).
    pub pace: Pace,
}

impl Default for SimDevice {
    fn default() -> Self {
        SimDevice {
            units: 4,
            unit_elems: 16 * 1024,
            cost: CostModel::odc_7b(),
            seconds_per_cost: 0.004,
            speeds: SpeedSchedule::uniform(),
            pace: Pace::Wall,
        }
    }
}

impl SimDevice {
    /// The model's units (values are irrelevant to the simulation).
    pub fn layout(&self) -> Vec<UnitSpec> {
        (0..self.units)
            .map(|u| UnitSpec::constant(format!("block{u}"), self.unit_elems, 0.0))
            .collect()
    }

    /// Modelled compute seconds of `tokens` at speed 1.0.
    pub fn seconds(&self, tokens: &[u64]) -> f64 {
        tokens.iter().map(|&t| self.cost.cost(t)).sum::<f64>() * self.seconds_per_cost
    }

    /// A compute factory for this device.
    pub fn factory(self: &Arc<Self>) -> impl Fn(u32) -> Box<dyn Compute> + Send + Sync + 'static {
        let device = self.clone();
        let grad: Arc<[f32]> = vec![1e-3f32; self.unit_elems].into();
        move |trainer| {
            Box::new(SimCompute {
                trainer,
                device: device.clone(),
                grad: grad.clone(),
            }) as Box<dyn Compute>
        }
    }
}

/// [`Compute`] of one simulated device.
pub struct SimCompute {
    trainer: u32,
    device: Arc<SimDevice>,
    grad: Arc<[f32]>,
}

/// Wait `seconds` of modelled compute at `pace` and record the span. `debt` carries what earlier
/// waits of the micro-batch overshot (sleeps wake late), so the micro-batch's compute adds up to
/// the model.
async fn work(ctx: &mut TrainerContext, pace: Pace, seconds: f64, debt: &mut f64) {
    if seconds <= 0.0 {
        return;
    }
    let start = ctx.now();
    let d = Duration::from_secs_f64((seconds - *debt).max(0.0));
    pace.wait_until(odc_transport::now() + d).await;
    let end = ctx.now();
    *debt += end.saturating_duration_since(start).as_secs_f64() - seconds;
    ctx.record_span(SpanKind::Compute, start, end);
}

#[async_trait]
impl Compute for SimCompute {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        mb: &MicroBatch,
    ) -> crate::Result<ComputeOutput> {
        let dev = &self.device;
        let tokens: Vec<u64> = mb.samples.iter().map(|s| s.tokens).collect();
        // A gang's piece: its member's share of the sample, a `k`-th of its linear work and of
        // its causal attention (the zig-zag cut). The members are not synchronised here: the
        // ring's waits are not emulated (in one process the exchange itself is nearly free).
        let piece: f64 = mb
            .pieces
            .iter()
            .map(|p| dev.seconds(&[p.sample.tokens]) / f64::from(p.members.max(1)))
            .sum();
        let total =
            (dev.seconds(&tokens) + piece) / dev.speeds.speed(self.trainer as usize, mb.step);
        let units = dev.units.max(1) as UnitId;
        let forward = total / 3.0 / f64::from(units);
        let mut debt = 0.0;
        // Forward in order; the last unit stays gathered for the backward pass, which starts with
        // it (as autograd keeps it), then walks back down, pushing each unit's gradient.
        for u in 0..units {
            ctx.gather(u).await?;
            work(ctx, dev.pace, forward, &mut debt).await;
            if u + 1 < units {
                ctx.release(u)?;
            }
        }
        ctx.backward();
        for u in (0..units).rev() {
            ctx.gather(u).await?;
            work(ctx, dev.pace, 2.0 * forward, &mut debt).await;
            ctx.push_grad(u, &self.grad)?;
            ctx.release(u)?;
        }
        Ok(ComputeOutput {
            loss_sum: mb.tokens as f64,
        })
    }
}

/// What one step of a collective ring costs in this process (the emulation's own ring latency):
/// `ranks` tasks run `rounds` ring all-gathers of a small unit through the real collective data
/// path over the local transport, and the wall time per all-gather is divided by its `ranks − 1`
/// steps. On GPUs a ring step costs a few microseconds over NVLink; here it costs a task wake-up
/// on the host, which a benchmark compares with its modelled compute. Zero for one rank.
pub async fn ring_step_latency(ranks: u32, rounds: u32) -> crate::Result<Duration> {
    use odc_actors::datapath::{Collective, CollectiveGroup, DataPath, Op, OpKey, OpKind};
    use odc_actors::directory::{Directory, ShardRoute};
    use odc_actors::memory::buffers::UnitBuffers;
    use odc_transport::local::LocalTransport;
    use odc_transport::{codec, Dtype, Transport};

    if ranks < 2 || rounds == 0 {
        return Ok(Duration::ZERO);
    }
    let len = ranks as usize * 256;
    let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
    let published = transport.register_published(
        0,
        Dtype::Bf16,
        codec::encode(Dtype::Bf16, &vec![1.0; len]),
        0,
    )?;
    let accumulator = transport.register_accumulator(0, len, 0)?;
    let directory = Arc::new(Directory::from_routes(
        1,
        [ShardRoute {
            unit: 0,
            owner: 0,
            start: 0,
            end: len as u64,
            published: published.handle(),
            accumulator: Some(accumulator.handle()),
        }],
    )?);
    let group = Arc::new(CollectiveGroup::new(ranks));
    let mut paths = Vec::new();
    for rank in 0..ranks {
        let path = Collective::new(
            rank,
            transport.clone(),
            group.clone(),
            directory.clone(),
            len,
        )?;
        path.begin(0);
        paths.push(Arc::new(path));
    }
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for path in paths {
        tasks.spawn(async move {
            let buffers = UnitBuffers::default();
            for round in 0..rounds {
                let (buffer, lease) = buffers.allocate(len);
                let op = Op {
                    key: OpKey {
                        epoch: 0,
                        seq: round,
                        unit: 0,
                        kind: OpKind::Gather,
                        occurrence: 0,
                    },
                    version: 0,
                    micro_batch: 0,
                    token: 0,
                    deadline: odc_transport::deadline_in(Duration::from_secs(60)),
                };
                path.gather(op, buffer, lease).await?;
            }
            Ok::<(), crate::Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.map_err(|e| crate::Error::Internal(format!("ring measurement task: {e}")))??;
    }
    let per_step = started.elapsed().as_secs_f64() / f64::from(rounds) / f64::from(ranks - 1);
    Ok(Duration::from_secs_f64(per_step))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speed_schedule_applies_the_last_change() {
        let s = SpeedSchedule::uniform()
            .with_change(7, 3, 0.5)
            .with_change(7, 6, 0.25);
        assert_eq!(s.speed(7, 2), 1.0);
        assert_eq!(s.speed(7, 3), 0.5);
        assert_eq!(s.speed(7, 9), 0.25);
        assert_eq!(s.speed(0, 9), 1.0);
        assert_eq!(s.capacity(8, 4), 7.5);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ring_step_latency_is_measured_through_the_real_ring() {
        let step = tokio::time::timeout(Duration::from_secs(60), ring_step_latency(4, 20))
            .await
            .expect("the measurement finishes")
            .expect("the ring runs");
        assert!(
            step > Duration::ZERO && step < Duration::from_secs(1),
            "{step:?}"
        );
        let alone = ring_step_latency(1, 20).await.expect("one rank");
        assert_eq!(alone, Duration::ZERO);
    }

    #[test]
    fn modelled_seconds_follow_the_cost_model() {
        let d = SimDevice::default();
        let one = d.seconds(&[32_000]);
        assert!((one - (4.348357 + 8.768377) * 0.004).abs() < 1e-12);
        assert!((d.seconds(&[32_000, 32_000]) - 2.0 * one).abs() < 1e-12);
    }
}
