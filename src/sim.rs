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
//! - [`Noise`] (none by default): what the cost model does not see, the same draws as
//!   `odc-bench sim`'s analytic rows. A sample's cost (a piece's too) takes its sample's factor;
//!   each unit of a micro-batch a factor of its device, its slot (the trainer's `n`-th micro-batch
//!   of the step) and the unit; a straggler computes at its speed.
//! - **A gang's members meet at every unit**, forward and backward, as their K/V ring paces them
//!   (`Rings`): a member ends a unit when the last of its gang does. A member that does not come
//!   within [`SimDevice::ring_deadline`] fails the micro-batch, naming the first member missing
//!   (I6).
//! - **A gang's ring costs what the planner prices** ([`SimDevice::ring`], none by default): each
//!   member pays its piece's exposed exchange and ring steps
//!   ([`odc_actors::policy::split::piece_cost_on`], the planner's one formula, on the inter-node
//!   link where the gang's ranks sit on more than one node of [`RingPrice::node_size`]), a third
//!   of it forward and two thirds backward, spread evenly over the units. It waits without
//!   computing: no compute span. The bytes themselves are not moved (in one process the exchange
//!   is nearly free); their time is paid.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The first endpoint id of a trainer's collective inbox (`TRAINER_ENDPOINT_BASE + rank`): a
/// modelled cluster tells trainers' endpoints from shard servers' by it.
pub use odc_actors::datapath::collective::TRAINER_ENDPOINT_BASE;
use odc_actors::policy::balancer::CostModel;
use odc_actors::policy::split::{piece_cost_on, CostModelCosts, RingPrice};
pub use odc_transport::throttle::Pace;

use crate::{
    async_trait, Compute, ComputeOutput, MicroBatch, Piece, SampleMeta, SpanKind, TrainerContext,
    UnitId, UnitSpec,
};

pub mod clock;
pub mod noise;

pub use noise::Noise;

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
    /// Costs the cost model does not see (none by default).
    pub noise: Noise,
    /// How long a gang member waits at a unit for the others (I6).
    pub ring_deadline: Duration,
    /// The price of a gang's ring in cost units, paid by its members (none: free).
    pub ring: Option<RingPrice>,
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
            noise: Noise::none(),
            ring_deadline: Duration::from_secs(60),
            ring: None,
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

    /// Modelled compute seconds of `sample` at speed 1.0 as the run pays it (its noise factor).
    pub fn paid_seconds(&self, sample: &SampleMeta) -> f64 {
        self.seconds(&[sample.tokens]) * self.noise.sample_factor(sample.index)
    }

    /// Modelled seconds at speed 1.0 that `piece`'s ring costs its member beside compute (see
    /// the module docs): 0 without a [`SimDevice::ring`].
    pub fn ring_seconds(&self, piece: &Piece) -> f64 {
        let Some(ring) = self.ring else {
            return 0.0;
        };
        let node = |rank: &u32| match ring.node_size {
            0 => 0,
            n => rank / n,
        };
        let inter_node = piece
            .ranks
            .first()
            .is_some_and(|first| piece.ranks.iter().any(|r| node(r) != node(first)));
        let k = piece.members.max(1);
        let costs = CostModelCosts {
            cost: self.cost,
            devices: k,
            per_node: k,
            ring: Some(ring),
        };
        piece_cost_on(&costs, piece.sample.tokens, k, inter_node).comm_exposed_s
            * self.seconds_per_cost
    }

    /// A compute factory for this device: one job's trainers, whose gangs meet in one place.
    pub fn factory(self: &Arc<Self>) -> impl Fn(u32) -> Box<dyn Compute> + Send + Sync + 'static {
        let device = self.clone();
        let grad: Arc<[f32]> = vec![1e-3f32; self.unit_elems].into();
        let rings = Arc::new(Rings::default());
        move |trainer| {
            Box::new(SimCompute {
                trainer,
                device: device.clone(),
                grad: grad.clone(),
                rings: rings.clone(),
                slot: (u64::MAX, 0),
            }) as Box<dyn Compute>
        }
    }
}

/// One meeting of a gang: its attempt's epoch, its number, the unit, and whether backward.
type RingKey = (u64, u32, UnitId, bool);

/// Where gang members meet, unit by unit (see the module docs).
#[derive(Default)]
struct Rings {
    meetings: Mutex<HashMap<RingKey, Meeting>>,
}

/// The members arrived so far, and the signal that all have.
struct Meeting {
    arrived: Vec<bool>,
    all: tokio::sync::watch::Sender<bool>,
}

impl Rings {
    /// Waits until every member of `piece`'s gang has reached `unit` (forward or `backward`).
    async fn meet(
        &self,
        piece: &Piece,
        unit: UnitId,
        backward: bool,
        deadline: Duration,
    ) -> crate::Result<()> {
        let key = (piece.epoch, piece.gang, unit, backward);
        let mut all = {
            let mut meetings = self.meetings.lock().unwrap_or_else(|e| e.into_inner());
            let meeting = meetings.entry(key).or_insert_with(|| Meeting {
                arrived: vec![false; piece.members.max(1) as usize],
                all: tokio::sync::watch::channel(false).0,
            });
            if let Some(seat) = meeting.arrived.get_mut(piece.member as usize) {
                *seat = true;
            }
            if meeting.arrived.iter().all(|&a| a) {
                if let Some(done) = meetings.remove(&key) {
                    done.all.send_replace(true);
                }
                return Ok(());
            }
            meeting.all.subscribe()
        };
        let met =
            tokio::time::timeout(deadline, async { all.wait_for(|&done| done).await.is_ok() })
                .await;
        match met {
            Ok(true) => Ok(()),
            _ => Err(self.missing(key, piece)),
        }
    }

    /// The error of a meeting whose members did not all come: the first one missing.
    /// The meeting is closed: the others waiting fail with it, and a member coming late waits
    /// for a new one, and fails by its own deadline.
    fn missing(&self, key: RingKey, piece: &Piece) -> crate::Error {
        let mut meetings = self.meetings.lock().unwrap_or_else(|e| e.into_inner());
        let member = meetings
            .remove(&key)
            .and_then(|m| m.arrived.iter().position(|&a| !a))
            .unwrap_or(0);
        let peer = piece.ranks.get(member).copied().unwrap_or(member as u32);
        crate::Error::Gang {
            peer,
            source: odc_transport::TransportError::DeadlineExceeded {
                owner: TRAINER_ENDPOINT_BASE + peer,
                region: 0,
                op: odc_transport::Op::Recv,
            },
        }
    }
}

/// [`Compute`] of one simulated device.
pub struct SimCompute {
    trainer: u32,
    device: Arc<SimDevice>,
    grad: Arc<[f32]>,
    rings: Arc<Rings>,
    /// The step of the last micro-batch and how many it has run in it.
    slot: (u64, usize),
}

impl SimCompute {
    /// This micro-batch's slot: its number among the trainer's micro-batches of `step`.
    fn next_slot(&mut self, step: u64) -> usize {
        if self.slot.0 != step {
            self.slot = (step, 0);
        }
        self.slot.1 += 1;
        self.slot.1 - 1
    }

    /// Meets every gang of `mb`'s pieces at `unit`, in the pieces' (ascending) order.
    async fn meet(&self, mb: &MicroBatch, unit: UnitId, backward: bool) -> crate::Result<()> {
        for piece in &mb.pieces {
            let deadline = self.device.ring_deadline;
            self.rings.meet(piece, unit, backward, deadline).await?;
        }
        Ok(())
    }
}

/// Wait `seconds` of modelled compute at `pace` and record the span. `debt` carries what earlier
/// waits of the micro-batch overshot (sleeps wake late), so the micro-batch's compute adds up to
/// the model.
async fn work(ctx: &mut TrainerContext, pace: Pace, seconds: f64, debt: &mut f64) {
    if let Some((start, end)) = spend(ctx, pace, seconds, debt).await {
        ctx.record_span(SpanKind::Compute, start, end);
    }
}

/// Wait `seconds` at `pace` (what earlier waits overshot, `debt`, taken off), returning the span
/// waited; `None` for nothing to wait.
async fn spend(
    ctx: &mut TrainerContext,
    pace: Pace,
    seconds: f64,
    debt: &mut f64,
) -> Option<(crate::Timestamp, crate::Timestamp)> {
    if seconds <= 0.0 {
        return None;
    }
    let start = ctx.now();
    let d = Duration::from_secs_f64((seconds - *debt).max(0.0));
    pace.wait_until(odc_transport::now() + d).await;
    let end = ctx.now();
    *debt += end.saturating_duration_since(start).as_secs_f64() - seconds;
    Some((start, end))
}

#[async_trait]
impl Compute for SimCompute {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        mb: &MicroBatch,
    ) -> crate::Result<ComputeOutput> {
        let dev = self.device.clone();
        let whole: f64 = mb.samples.iter().map(|s| dev.paid_seconds(s)).sum();
        // A gang's piece: its member's share of the sample, a `k`-th of its linear work and of
        // its causal attention (the zig-zag cut).
        let piece: f64 = mb
            .pieces
            .iter()
            .map(|p| dev.paid_seconds(&p.sample) / f64::from(p.members.max(1)))
            .sum();
        let speed =
            dev.speeds.speed(self.trainer as usize, mb.step) * dev.noise.speed(self.trainer);
        let total = (whole + piece) / speed;
        let units = dev.units.max(1) as UnitId;
        let slot = self.next_slot(mb.step);
        let forward = |u: UnitId| {
            total / 3.0 / f64::from(units) * dev.noise.layer_factor(self.trainer, slot, u)
        };
        // The ring's share of one unit forward (backward pays twice it).
        let ring =
            mb.pieces.iter().map(|p| dev.ring_seconds(p)).sum::<f64>() / 3.0 / f64::from(units);
        let mut debt = 0.0;
        // Forward in order; the last unit stays gathered for the backward pass, which starts with
        // it (as autograd keeps it), then walks back down, pushing each unit's gradient.
        for u in 0..units {
            ctx.gather(u).await?;
            work(ctx, dev.pace, forward(u), &mut debt).await;
            spend(ctx, dev.pace, ring, &mut debt).await;
            self.meet(mb, u, false).await?;
            if u + 1 < units {
                ctx.release(u)?;
            }
        }
        ctx.backward();
        for u in (0..units).rev() {
            ctx.gather(u).await?;
            work(ctx, dev.pace, 2.0 * forward(u), &mut debt).await;
            spend(ctx, dev.pace, 2.0 * ring, &mut debt).await;
            self.meet(mb, u, true).await?;
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

    /// The members of a gang end a unit when the last of them reaches it; a member that never
    /// comes fails the others by the deadline, naming its trainer, and leaves no meeting behind.
    #[cfg(feature = "virtual-time")]
    #[test]
    fn gang_members_meet_at_each_unit_and_a_missing_one_fails_by_the_deadline() {
        let runtime = clock::virtual_runtime().unwrap();
        runtime.block_on(async {
            let rings = Arc::new(Rings::default());
            let piece = |member| Piece {
                sample: SampleMeta::new(0, 100),
                epoch: 1,
                gang: 0,
                member,
                members: 2,
                ranks: vec![4, 7],
            };
            let deadline = Duration::from_secs(60);
            let started = tokio::time::Instant::now();
            let early = {
                let rings = rings.clone();
                tokio::spawn(async move {
                    rings.meet(&piece(0), 3, false, deadline).await?;
                    Ok::<_, crate::Error>(started.elapsed())
                })
            };
            tokio::time::sleep(Duration::from_secs(5)).await;
            rings.meet(&piece(1), 3, false, deadline).await.unwrap();
            assert_eq!(early.await.unwrap().unwrap(), Duration::from_secs(5));
            assert!(rings.meetings.lock().unwrap().is_empty());
            let err = rings.meet(&piece(0), 4, true, deadline).await.unwrap_err();
            assert_eq!(started.elapsed(), Duration::from_secs(65));
            assert!(matches!(err, crate::Error::Gang { peer: 7, .. }), "{err}");
            assert!(rings.meetings.lock().unwrap().is_empty());
        });
    }

    #[test]
    fn a_sample_costs_its_noise_factor_and_nothing_without_noise() {
        let quiet = SimDevice::default();
        let noisy = SimDevice {
            noise: Noise::calibrated(1),
            ..SimDevice::default()
        };
        let sample = SampleMeta::new(42, 8192);
        assert_eq!(quiet.paid_seconds(&sample), quiet.seconds(&[8192]));
        let factor = Noise::calibrated(1).sample_factor(42);
        assert_ne!(factor, 1.0);
        assert_eq!(noisy.paid_seconds(&sample), quiet.seconds(&[8192]) * factor);
    }

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
