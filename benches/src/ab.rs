//! The on-demand vs collective A/B benchmark (`odc-bench ab`): the same simulated devices,
//! workload and seed in both modes, figures measured in one run.
//!
//! # What a row measures
//!
//! - **ABBA.** A row's repetitions alternate which side runs first: rep 0 collective then
//!   on-demand, rep 1 on-demand then collective, … ([`run_order`]), so neither side always runs
//!   on a cold or a warm machine. The row sums its repetitions.
//! - tokens/s = tokens / wall; utilization = busy device-seconds (modelled compute spans actually
//!   executed) / (devices × wall).
//! - **Bounds** ([`step_bounds`]), from the samples and speeds alone, per step: the perfect-balance
//!   bound spreads the total modelled compute over the joint device capacity (as if samples could
//!   be split); the achievable bound takes the larger of that and the costliest single sample on
//!   the fastest device. Both are of the costs paid: under noise, each sample's noisy cost over
//!   the speeds with the noise's stragglers (the planner's estimates would understate them).
//!   Tokens over the summed per-step times give `bound_tokens_per_s ≥
//!   achievable_bound_tokens_per_s`.
//! - **Balanced control** ([`plan`], [`Controls`]): every (devices, minibatch per device,
//!   dispatch) of a matrix also runs the `balanced` workload, first; with nothing to balance its
//!   speedup is 1.00 when the comparison is fair, and every row carries it as `control_speedup`.
//! - **Emulation floor**: each row records its shortest modelled forward span (from the micro-batch
//!   costs the runtime reports), which the binary compares with the measured floor
//!   ([`crate::floor`]). It applies to wall time only.
//! - **Clock** ([`Settings::clock`]): wall time (the emulation on this machine), or virtual time
//!   ([`odc::sim::clock`]): every run on a fresh paused runtime of its own, the model stretched by
//!   the clock's dilation (compute, link, timeouts) and every measured duration shrunk back, so
//!   figures read in modelled seconds under both clocks. Same seed → same figures, bit for bit.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use odc::sim::clock::{self, ClockMode};
use odc::sim::TRAINER_ENDPOINT_BASE;
use odc::sim::{Noise, SimDevice, SpeedSchedule};
use odc::trace::TraceSpan;
use odc::transport::local::LocalTransport;
use odc::transport::throttle::Throttled;
use odc::transport::Transport;
use odc::{
    Communication, ContextParallel, DispatchMode, Error, Job, OptimizerConfig, Precision, Result,
    SampleMeta, SpanKind, SplitPolicy,
};

use crate::floor::EmulationFloor;
use crate::links::{Links, LinksConfig};
use crate::report::{self, BenchRow};
use crate::workload::Workload;

/// How one side of the comparison runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Side {
    pub communication: Communication,
    pub dispatch: DispatchMode,
    /// Speed-aware dispatch and plans (runtime straggler rebalancing).
    pub rebalance: bool,
    /// The collective baseline's context parallelism: the collective run's own, and on an
    /// on-demand side the baseline it is compared against (`Off`: FSDP with LB-Micro).
    pub context_parallel: ContextParallel,
}

impl Side {
    pub const COLLECTIVE: Side = Side {
        communication: Communication::Collective,
        dispatch: DispatchMode::Static,
        rebalance: false,
        context_parallel: ContextParallel::Off,
    };

    pub fn on_demand(dispatch: DispatchMode, rebalance: bool) -> Side {
        Side {
            communication: Communication::OnDemand,
            dispatch,
            rebalance,
            context_parallel: ContextParallel::Off,
        }
    }

    /// This side compared against the collective with context parallelism `cp`.
    pub fn against(self, cp: ContextParallel) -> Side {
        Side {
            context_parallel: cp,
            ..self
        }
    }

    /// The collective run this side is compared with.
    pub fn baseline(&self) -> Side {
        Side {
            context_parallel: self.context_parallel,
            ..Side::COLLECTIVE
        }
    }

    /// `collective` or `on-demand`.
    pub fn communication_name(&self) -> &'static str {
        match self.communication {
            Communication::Collective => "collective",
            Communication::OnDemand => "on-demand",
        }
    }

    /// The dispatch and, against a context-parallel baseline, ` vs <baseline>` (as
    /// [`BenchRow::sides`] shows a row).
    pub fn names(&self) -> String {
        match self.context_parallel {
            ContextParallel::Off => self.dispatch_name(),
            cp => format!("{} vs {}", self.dispatch_name(), cp.name()),
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

impl Case {
    /// A balanced control: the `balanced` workload of `tokens` per sample at nominal speeds.
    pub fn control(devices: usize, minibatch_per_device: usize, tokens: u64) -> Case {
        let workload = Workload::Balanced { tokens };
        Case {
            name: workload.name(),
            workload,
            devices,
            minibatch_per_device,
            speeds: SpeedSchedule::uniform(),
        }
    }

    /// Whether this case is a balanced control: the `balanced` workload at nominal speeds.
    pub fn is_control(&self) -> bool {
        matches!(self.workload, Workload::Balanced { .. })
            && self.speeds == SpeedSchedule::uniform()
    }

    /// The slowest speed factor any device has in `steps` steps (1.0 without stragglers).
    pub fn slowest_speed(&self, steps: u64) -> f64 {
        self.speeds
            .changes
            .iter()
            .filter(|c| c.trainer < self.devices && c.from_step < steps)
            .map(|c| c.factor)
            .fold(1.0, f64::min)
    }
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
    /// Wall or virtual time.
    pub clock: ClockMode,
    /// Devices per shard server (1: a server on every device). More cut the simulation's cost
    /// (every gather and push of a trainer touches every server) without changing what is
    /// modelled when there is no link model; with one, each server's link then carries the
    /// shards of this many devices.
    pub devices_per_server: usize,
    /// A modelled cluster of nodes, NVLink and NICs under the job ([`crate::links`]) instead of
    /// `unit_transfer_seconds`' one link per device.
    pub links: Option<LinksConfig>,
    /// What trainers pull (and the collective all-gathers) parameters as.
    pub pull_precision: Precision,
    /// Sequence splitting on the on-demand side (the collective side splits as its
    /// [`Side::context_parallel`] says).
    pub split: SplitPolicy,
    /// With `links`, give the job's cost model each micro-batch's transfers
    /// ([`LinksConfig::transfer_s`], [`odc::CostModel::transfer`]).
    pub price_transfers: bool,
}

impl Settings {
    /// Modelled link bandwidth, bytes per second (`None` without a link model).
    pub fn link_bytes_per_sec(&self) -> Option<f64> {
        (self.unit_transfer_seconds > 0.0)
            .then(|| (self.device.unit_elems * 4) as f64 / self.unit_transfer_seconds)
    }

    /// The transport of a run: local, behind the link model when there is one (its bandwidth
    /// divided by the clock's dilation).
    fn transport(&self) -> Arc<dyn Transport> {
        let local: Arc<dyn Transport> = Arc::new(LocalTransport::new());
        match self.link_bytes_per_sec() {
            // A device's link carries its shard server's regions and its trainer's staging.
            Some(bw) => Arc::new(
                Throttled::new(
                    local,
                    bw / f64::from(self.clock.dilation()),
                    Arc::new(|e| e % TRAINER_ENDPOINT_BASE),
                )
                .with_pace(self.clock.pace()),
            ),
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
            clock: ClockMode::Wall,
            devices_per_server: 1,
            links: None,
            pull_precision: Precision::F32,
            split: SplitPolicy::Off,
            price_transfers: true,
        }
    }
}

/// The cost model of a run of `devices` in `communication` mode: the device's, with each
/// micro-batch's transfers on the modelled cluster when there is one and `price_transfers` (in
/// cost units; relayed pushes priced as such on the on-demand side only).
pub fn job_cost_model(
    settings: &Settings,
    devices: usize,
    communication: Communication,
) -> Result<odc::CostModel> {
    let device = &settings.device;
    let Some(links) = settings.links.as_ref().filter(|_| settings.price_transfers) else {
        return Ok(device.cost);
    };
    // Only on-demand pushes are relayed (`relayed`): the collective's price stays its own.
    let relayed = LinksConfig {
        relay: links.relay && communication == Communication::OnDemand,
        ..links.clone()
    };
    let links = &relayed;
    let pull_bytes = match settings.pull_precision {
        Precision::Bf16 => 2,
        Precision::F32 => 4,
    };
    let elems = (device.units * device.unit_elems) as u64;
    let seconds = links
        .transfer_s(devices as u32, elems, pull_bytes, 4)
        .map_err(|e| Error::Config(format!("links: {e}")))?;
    Ok(device
        .cost
        .with_transfer(seconds / device.seconds_per_cost.max(f64::MIN_POSITIVE)))
}

/// What one run measured.
#[derive(Debug, Clone, Default)]
pub struct Measure {
    pub tokens: u64,
    pub wall: f64,
    /// Modelled compute seconds executed (all devices).
    pub busy: f64,
    /// Seconds of the perfect-balance bound (summed over steps).
    pub bound: f64,
    /// Seconds of the achievable bound (summed over steps).
    pub achievable: f64,
    /// The shortest modelled forward span of a compute unit of any micro-batch run (seconds).
    pub shortest_forward_span: Option<f64>,
    /// Seconds trainers waited on pulls and pushes.
    pub comm_wait: f64,
    /// Bytes pulled and pushed by all trainers.
    pub bytes: u64,
    /// Micro-batches run (all devices, all steps).
    pub micro_batches: u64,
    pub spans: Vec<TraceSpan>,
}

impl Measure {
    fn add(&mut self, other: &Measure) {
        self.tokens += other.tokens;
        self.wall += other.wall;
        self.busy += other.busy;
        self.bound += other.bound;
        self.achievable += other.achievable;
        self.shortest_forward_span =
            min_span(self.shortest_forward_span, other.shortest_forward_span);
        self.comm_wait += other.comm_wait;
        self.bytes += other.bytes;
        self.micro_batches += other.micro_batches;
    }
}

/// The smaller of two optional spans.
fn min_span(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The two bounds of one step, in seconds: (perfect balance, achievable).
///
/// Perfect balance = total modelled compute / joint device capacity. Achievable = the larger of
/// that and the costliest single sample's modelled time on the fastest device: no schedule can
/// finish the step sooner, since a sample runs on one device.
///
/// The costs are those `device` pays: each sample's [`SimDevice::paid_seconds`], each device at
/// its scheduled speed times its noise's ([`odc::sim::Noise::speed`]).
///
/// ```
/// use odc::sim::{SimDevice, SpeedSchedule};
/// use odc::SampleMeta;
/// use odc_bench::ab::step_bounds;
/// let d = SimDevice::default();
/// let one = d.seconds(&[32_000]);
/// let samples = |n: u64| (0..n).map(|i| SampleMeta::new(i, 32_000)).collect::<Vec<_>>();
/// // Two equal samples on two devices: both bounds are one sample's time.
/// let (even, achievable) = step_bounds(&d, &samples(2), 2, 0);
/// assert!((even - one).abs() < 1e-12 && (achievable - one).abs() < 1e-12);
/// // One sample on two devices cannot be split.
/// let (even, achievable) = step_bounds(&d, &samples(1), 2, 0);
/// assert!((even - one / 2.0).abs() < 1e-12 && (achievable - one).abs() < 1e-12);
/// ```
pub fn step_bounds(
    device: &SimDevice,
    samples: &[SampleMeta],
    devices: usize,
    step: u64,
) -> (f64, f64) {
    let seconds: Vec<f64> = samples.iter().map(|s| device.paid_seconds(s)).collect();
    let total: f64 = seconds.iter().sum();
    // Device counts are at most odc's limit on trainers, far below u32::MAX.
    let speed = |t: usize| device.speeds.speed(t, step) * device.noise.speed(t as u32);
    let capacity: f64 = (0..devices).map(speed).sum();
    let fastest = (0..devices).map(speed).fold(0.0, f64::max);
    let costliest = seconds.iter().copied().fold(0.0, f64::max);
    let even = if capacity > 0.0 {
        total / capacity
    } else {
        0.0
    };
    let single = if fastest > 0.0 {
        costliest / fastest
    } else {
        0.0
    };
    (even, even.max(single))
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

/// The token budget of `case`'s runs: `settings.token_budget`, or the smallest power of two of at
/// least 16,384 that holds the workload's longest possible sequence.
pub fn token_budget(case: &Case, settings: &Settings) -> u64 {
    settings
        .token_budget
        .unwrap_or_else(|| default_token_budget(&case.workload))
}

/// The smallest power of two of at least 16,384 that holds `workload`'s longest sequence
/// (65,536 for the SFT-like built-ins, 16,384 for RL and balanced). Saturates instead of
/// overflowing for lengths beyond 2^63 (which [`crate::workload::parse_lengths`] refuses).
pub fn default_token_budget(workload: &Workload) -> u64 {
    workload
        .max_tokens()
        .max(16_384)
        .checked_next_power_of_two()
        .unwrap_or(u64::MAX)
}

/// The job's timeouts in modelled time (the runtime's defaults), stretched by the clock's dilation.
const MICRO_BATCH_TIMEOUT: Duration = Duration::from_secs(600);
const STEP_TIMEOUT: Duration = Duration::from_secs(3600);
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(120);

/// Run `settings.steps` minibatches of `case` on one side, on `settings.clock`: in virtual time on
/// a fresh paused runtime of its own ([`clock::on_virtual_runtime`]). Figures are modelled
/// seconds under both clocks.
pub async fn run(case: &Case, side: Side, settings: &Settings, trace: bool) -> Result<Measure> {
    match settings.clock {
        ClockMode::Wall => run_here(case, side, settings, trace).await,
        ClockMode::Virtual => {
            let (case, settings) = (case.clone(), settings.clone());
            clock::on_virtual_runtime(move || async move {
                run_here(&case, side, &settings, trace).await
            })
            .await?
        }
    }
}

impl Settings {
    /// Relayed pushes (if asked for) fit the servers' placement: see [`check_relay`].
    pub fn check_relay(&self) -> Result<()> {
        match &self.links {
            Some(config) if config.relay => check_relay(config, self.devices_per_server),
            _ => Ok(()),
        }
    }
}

/// Relayed pushes need every shard server inside a node: its devices divide the node's.
fn check_relay(config: &LinksConfig, devices_per_server: usize) -> Result<()> {
    let g = config.gpus_per_node.max(1);
    if devices_per_server == 0 || g as usize % devices_per_server != 0 {
        return Err(Error::Config(format!(
            "relayed pushes need every shard server inside a node: {devices_per_server} devices \
             per server do not divide nodes of {g} (--devices-per-server)"
        )));
    }
    Ok(())
}

/// `builder` with its on-demand pushes relayed through the node, each server's flushes priced
/// from its devices. The servers must sit inside nodes (`devices_per_server` divides the node).
fn relayed(
    builder: odc::JobBuilder,
    links: &Arc<Links>,
    config: &LinksConfig,
    devices_per_server: usize,
) -> Result<odc::JobBuilder> {
    check_relay(config, devices_per_server)?;
    let g = config.gpus_per_node.max(1);
    let servers = links.clone();
    Ok(builder
        .relay_pushes(g)
        .server_transport(move |server| servers.server_view(server)))
}

/// [`run`] on the caller's runtime, which must be a paused one for [`ClockMode::Virtual`].
async fn run_here(case: &Case, side: Side, settings: &Settings, trace: bool) -> Result<Measure> {
    let mode = settings.clock;
    let k = f64::from(mode.dilation());
    let device = Arc::new(SimDevice {
        speeds: case.speeds.clone(),
        // A balanced control checks the harness (equal work, equal time), so it pays no noise
        // and its ring is free (a static CP baseline splits even its short samples).
        noise: if case.is_control() {
            Noise::none()
        } else {
            settings.device.noise
        },
        ring: settings.device.ring.filter(|_| !case.is_control()),
        ring_deadline: mode.stretch(MICRO_BATCH_TIMEOUT),
        ..settings.device.clone()
    });
    // What runs: the device stretched by the dilation, at the clock's pace.
    let running = Arc::new(SimDevice {
        seconds_per_cost: device.seconds_per_cost * k,
        pace: mode.pace(),
        ..(*device).clone()
    });
    let job_clock = mode.clock();
    let servers = case.devices.div_ceil(settings.devices_per_server.max(1));
    let builder = match &settings.links {
        None => Job::builder().transport(settings.transport()),
        Some(config) => {
            if settings.unit_transfer_seconds > 0.0 {
                return Err(Error::Config(
                    "a modelled cluster (links) and a per-device link (unit transfer time) \
                     exclude each other"
                        .into(),
                ));
            }
            // Both counts are at most odc's limit on trainers, far below u32::MAX.
            let links = Links::new(
                Arc::new(LocalTransport::new()),
                config,
                case.devices as u32,
                settings.devices_per_server.max(1) as u32,
                mode,
            )
            .map_err(|e| Error::Config(format!("links: {e}")))?;
            let trainers = links.clone();
            let builder = Job::builder()
                .transport(links.view(None))
                .trainer_transport(move |rank| trainers.view(Some(rank)));
            if config.relay && side.communication == Communication::OnDemand {
                relayed(builder, &links, config, settings.devices_per_server)?
            } else {
                builder
            }
        }
    };
    // On a modelled cluster the collective runs as NCCL does across nodes: a ring over the nodes
    // on each rail, then one inside each node.
    let node_size = settings.links.as_ref().map_or(1, |f| f.gpus_per_node);
    let mut job = builder
        .collective_node_size(node_size)
        .units(device.layout())
        .trainers(case.devices)
        .servers(servers)
        .communication(side.communication)
        .dispatch(side.dispatch)
        .rebalance(side.rebalance)
        .cost_model(job_cost_model(settings, case.devices, side.communication)?)
        .sequence_parallel(match side.communication {
            Communication::OnDemand => settings.split,
            Communication::Collective => SplitPolicy::Off,
        })
        .context_parallel(match side.communication {
            Communication::OnDemand => ContextParallel::Off,
            Communication::Collective => side.context_parallel,
        })
        .token_budget(token_budget(case, settings))
        // The planner prices a gang's ring as the simulated device pays it (free where the
        // device has no ring price).
        .ring_price(device.ring.unwrap_or_else(odc::RingPrice::free))
        .pull_precision(settings.pull_precision)
        .prefetch(settings.prefetch as u32)
        .chunk_elems(settings.chunk_elems as u64)
        .optimizer(OptimizerConfig::sgd(0.0))
        .compute(running.factory())
        .clock(job_clock.clone())
        .micro_batch_timeout(mode.stretch(MICRO_BATCH_TIMEOUT))
        .step_timeout(mode.stretch(STEP_TIMEOUT))
        .transfer_timeout(mode.stretch(TRANSFER_TIMEOUT))
        .build()?;
    let origin = job_clock.now();
    let seconds = |d: Duration| mode.shrink(d).as_secs_f64();
    let mut m = Measure::default();
    for step in 0..settings.steps {
        let samples = minibatch(case, settings.seed, step);
        let (even, achievable) = step_bounds(&device, &samples, case.devices, step);
        let step_began = std::time::Instant::now();
        let stats = job.step_with(samples).await?;
        // The wall cost of a step (the first one starts the actors): how far a clock scales.
        tracing::info!(
            "{} {} devices, {}, {} clock, step {step}: {:.3} s wall{}",
            case.name,
            case.devices,
            side.communication_name(),
            mode.name(),
            step_began.elapsed().as_secs_f64(),
            if step == 0 {
                " (with the actors' start)"
            } else {
                ""
            }
        );
        m.tokens += stats.tokens;
        m.bytes += stats
            .trainers
            .iter()
            .map(|t| t.bytes_pulled + t.bytes_pushed)
            .sum::<u64>();
        m.wall += seconds(stats.wall);
        m.micro_batches += u64::from(stats.micro_batches);
        m.bound += even;
        m.achievable += achievable;
        // The simulated device splits a micro-batch into 3 × units spans; forward per unit is a
        // third of its time over the units (backward twice that).
        let units = device.units.max(1) as f64;
        for r in stats.micro_batch_log.iter().filter(|r| r.cost > 0.0) {
            let speed = device.speeds.speed(r.trainer as usize, step);
            let forward = r.cost * device.seconds_per_cost / speed / (3.0 * units);
            m.shortest_forward_span = min_span(m.shortest_forward_span, Some(forward));
        }
        for r in &stats.micro_batch_log {
            for s in &r.spans {
                let d = seconds(s.end.saturating_duration_since(s.start));
                match s.kind {
                    SpanKind::Compute => m.busy += d,
                    SpanKind::PullWait | SpanKind::PushWait => m.comm_wait += d,
                    SpanKind::BarrierWait => {}
                }
            }
        }
        if trace {
            m.spans.extend(
                odc::trace::step_spans(&stats, origin, case.devices)
                    .into_iter()
                    .map(|s| TraceSpan {
                        start: mode.shrink(s.start),
                        duration: mode.shrink(s.duration),
                        ..s
                    }),
            );
        }
    }
    let stopping = std::time::Instant::now();
    job.shutdown().await;
    tracing::info!(
        "{} {} devices, {}: shutdown {:.3} s wall",
        case.name,
        case.devices,
        side.communication_name(),
        stopping.elapsed().as_secs_f64()
    );
    Ok(m)
}

/// Which side runs first in repetition `rep`: ABBA order, collective first in even repetitions.
///
/// ```
/// use odc_bench::ab::run_order;
/// assert_eq!(run_order(0), [true, false]); // collective, then on-demand
/// assert_eq!(run_order(1), [false, true]);
/// assert_eq!(run_order(2), [true, false]);
/// ```
pub fn run_order(rep: usize) -> [bool; 2] {
    if rep % 2 == 0 {
        [true, false]
    } else {
        [false, true]
    }
}

/// A/B-compare `case`: collective vs on-demand `side`, `reps` repetitions in ABBA order
/// ([`run_order`]). The row's `control_speedup` is its own speedup for a control case and `None`
/// otherwise ([`Controls::attach`] fills it); `emulation_warning` comes from `floor` (if given)
/// and the row's shortest modelled span.
pub async fn compare(
    case: &Case,
    side: Side,
    settings: &Settings,
    reps: usize,
    floor: Option<&EmulationFloor>,
) -> Result<(BenchRow, Measure, Measure)> {
    if reps == 0 {
        return Err(Error::Config(
            "an A/B comparison needs at least one repetition".into(),
        ));
    }
    let (mut a, mut b) = (Measure::default(), Measure::default());
    let order: Vec<bool> = (0..reps).flat_map(run_order).collect();
    let one = |collective: bool| {
        let side = if collective { side.baseline() } else { side };
        run(case, side, settings, false)
    };
    if settings.clock == ClockMode::Virtual {
        // Each virtual run has a runtime and a thread of its own and its figures do not depend
        // on what else runs, so the runs go side by side (on as many cores as there are).
        let measures = futures::future::try_join_all(order.iter().map(|&c| one(c))).await?;
        for (collective, m) in order.iter().zip(&measures) {
            if *collective {
                a.add(m)
            } else {
                b.add(m)
            }
        }
    } else {
        for &collective in &order {
            let m = one(collective).await?;
            if collective {
                a.add(&m)
            } else {
                b.add(&m)
            }
        }
    }
    let (coll, od) = (
        report::rate(a.tokens, a.wall),
        report::rate(b.tokens, b.wall),
    );
    let speedup = report::ratio(od, coll);
    let achievable = report::rate(b.tokens, b.achievable);
    let shortest = min_span(a.shortest_forward_span, b.shortest_forward_span);
    let time_scale_ms = settings.device.seconds_per_cost * 1e3;
    let row = BenchRow {
        workload: case.name.clone(),
        devices: case.devices,
        minibatch_per_device: case.minibatch_per_device,
        dispatch: side.dispatch_name(),
        baseline: side.context_parallel.name(),
        collective_tokens_per_s: coll,
        ondemand_tokens_per_s: od,
        speedup,
        collective_utilization: report::utilization(a.busy, case.devices, a.wall),
        ondemand_utilization: report::utilization(b.busy, case.devices, b.wall),
        bound_tokens_per_s: report::rate(b.tokens, b.bound),
        achievable_bound_tokens_per_s: achievable,
        ondemand_over_achievable: report::ratio(od, achievable),
        control_speedup: case.is_control().then_some(speedup),
        emulation_warning: floor.and_then(|f| {
            let span = shortest.and_then(|span| {
                f.warning(
                    span,
                    "shortest modelled compute span (forward, one unit, smallest micro-batch)",
                    time_scale_ms,
                )
            });
            // The collective side's mean micro-batch of modelled compute, and its exposed rings:
            // every micro-batch's last reduce-scatter, every step's first all-gather.
            let mean = a.busy / a.micro_batches.max(1) as f64;
            let runs = (case.devices * reps) as f64 * settings.steps as f64;
            let per_trainer_step = (a.micro_batches as f64 / runs).max(1.0);
            let exposed = 1.0 + 1.0 / per_trainer_step;
            let ring = f.ring_warning(case.devices, exposed, mean, time_scale_ms);
            match (span, ring) {
                (Some(s), Some(r)) => Some(format!("{s}; {r}")),
                (s, r) => s.or(r),
            }
        }),
    };
    Ok((row, a, b))
}

/// One row to run: a case, the on-demand side compared with collective, and whether it is a
/// balanced control.
#[derive(Debug, Clone)]
pub struct Entry {
    pub case: Case,
    pub side: Side,
    pub control: bool,
}

/// The control key of a row: devices, minibatch per device, dispatch name, baseline.
type ControlKey = (usize, usize, String, String);

fn key(devices: usize, minibatch_per_device: usize, side: Side) -> ControlKey {
    (
        devices,
        minibatch_per_device,
        side.dispatch_name(),
        side.context_parallel.name(),
    )
}

/// The rows of a matrix in the order to run them: balanced controls first (the matrix's own
/// balanced cases, then, if `with_controls`, a [`Case::control`] of `control_tokens` per sample for
/// every (devices, minibatch per device, dispatch) the matrix measures that has none), then the
/// other cases in their given order.
pub fn plan(cases: &[(Case, Vec<Side>)], with_controls: bool, control_tokens: u64) -> Vec<Entry> {
    let mut controls = Vec::new();
    let mut others = Vec::new();
    let mut covered: Vec<ControlKey> = Vec::new();
    for (case, sides) in cases {
        for &side in sides {
            let entry = Entry {
                case: case.clone(),
                side,
                control: case.is_control(),
            };
            if entry.control {
                covered.push(key(case.devices, case.minibatch_per_device, side));
                controls.push(entry);
            } else {
                others.push(entry);
            }
        }
    }
    if with_controls {
        for e in &others {
            let k = key(e.case.devices, e.case.minibatch_per_device, e.side);
            if !covered.contains(&k) {
                covered.push(k);
                controls.push(Entry {
                    case: Case::control(
                        e.case.devices,
                        e.case.minibatch_per_device,
                        control_tokens,
                    ),
                    side: e.side,
                    control: true,
                });
            }
        }
    }
    controls.extend(others);
    controls
}

/// The balanced controls' speedups measured so far, by (devices, minibatch per device, dispatch).
#[derive(Debug, Clone, Default)]
pub struct Controls {
    speedups: HashMap<ControlKey, f64>,
}

impl Controls {
    /// Records `row` if `entry` is a control, and sets the row's `control_speedup` to its
    /// control's (its own for a control; `None` if that control has not run).
    pub fn attach(&mut self, entry: &Entry, row: &mut BenchRow) {
        let k = key(
            entry.case.devices,
            entry.case.minibatch_per_device,
            entry.side,
        );
        if entry.control {
            self.speedups.insert(k, row.speedup);
            row.control_speedup = Some(row.speedup);
        } else {
            row.control_speedup = self.speedups.get(&k).copied();
        }
    }

    /// Lowest and highest control speedup measured (`None` without controls).
    pub fn range(&self) -> Option<(f64, f64)> {
        let mut values = self.speedups.values().copied().filter(|v| v.is_finite());
        let first = values.next()?;
        Some(values.fold((first, first), |(lo, hi), v| (lo.min(v), hi.max(v))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sides() -> Vec<Side> {
        vec![
            Side::on_demand(DispatchMode::Static, false),
            Side::on_demand(DispatchMode::Dynamic, false),
        ]
    }

    fn case(workload: Workload, devices: usize, per_device: usize) -> Case {
        Case {
            name: workload.name(),
            workload,
            devices,
            minibatch_per_device: per_device,
            speeds: SpeedSchedule::uniform(),
        }
    }

    #[test]
    fn abba_alternates_which_side_runs_first() {
        let firsts: Vec<bool> = (0..4).map(|r| run_order(r)[0]).collect();
        assert_eq!(firsts, [true, false, true, false]);
        for r in 0..4 {
            let order = run_order(r);
            assert_ne!(order[0], order[1], "each side runs once per repetition");
        }
    }

    #[test]
    fn plan_adds_one_control_per_devices_minibatch_and_dispatch_first() {
        let cases = vec![
            (case(Workload::LongAlign, 8, 4), sides()),
            (case(Workload::Rl, 8, 4), sides()),
            (case(Workload::LongAlign, 16, 4), sides()),
        ];
        let entries = plan(&cases, true, 16_384);
        assert_eq!(entries.len(), 6 + 4);
        assert!(entries[..4]
            .iter()
            .all(|e| e.control && e.case.is_control()));
        assert!(entries[4..].iter().all(|e| !e.control));
        let keys: Vec<_> = entries[..4]
            .iter()
            .map(|e| (e.case.devices, e.side.dispatch_name()))
            .collect();
        assert_eq!(
            keys,
            [
                (8, "static".to_string()),
                (8, "dynamic".to_string()),
                (16, "static".to_string()),
                (16, "dynamic".to_string())
            ]
        );
        assert!(plan(&cases, false, 16_384).iter().all(|e| !e.control));
    }

    #[test]
    fn plan_uses_the_matrix_own_balanced_rows_as_controls() {
        let balanced = Workload::from_name("balanced").unwrap();
        let cases = vec![
            (case(Workload::LongAlign, 8, 4), sides()),
            (case(balanced, 8, 4), sides()),
        ];
        let entries = plan(&cases, true, 16_384);
        assert_eq!(entries.len(), 4, "no extra control");
        assert!(entries[0].control && entries[1].control);
        // A straggler scenario on balanced data is not a control.
        let mut slow = case(Workload::Balanced { tokens: 16_384 }, 8, 4);
        slow.speeds = SpeedSchedule::uniform().with_change(7, 1, 0.5);
        assert!(!slow.is_control());
        assert_eq!(slow.slowest_speed(4), 0.5);
        assert_eq!(slow.slowest_speed(1), 1.0);
    }

    #[test]
    fn controls_attach_their_speedup_to_matching_rows() {
        let cases = vec![(case(Workload::LongAlign, 8, 4), sides())];
        let entries = plan(&cases, true, 16_384);
        let mut controls = Controls::default();
        let row = |speedup: f64| BenchRow {
            workload: String::new(),
            devices: 8,
            minibatch_per_device: 4,
            dispatch: String::new(),
            baseline: "fsdp".into(),
            collective_tokens_per_s: 1.0,
            ondemand_tokens_per_s: speedup,
            speedup,
            collective_utilization: 0.5,
            ondemand_utilization: 0.5,
            bound_tokens_per_s: 2.0,
            achievable_bound_tokens_per_s: 2.0,
            ondemand_over_achievable: speedup / 2.0,
            control_speedup: None,
            emulation_warning: None,
        };
        let speedups = [1.01, 0.98, 1.30, 1.25];
        let mut rows = Vec::new();
        for (e, s) in entries.iter().zip(speedups) {
            let mut r = row(s);
            controls.attach(e, &mut r);
            rows.push(r);
        }
        let got: Vec<Option<f64>> = rows.iter().map(|r| r.control_speedup).collect();
        assert_eq!(got, [Some(1.01), Some(0.98), Some(1.01), Some(0.98)]);
        assert_eq!(controls.range(), Some((0.98, 1.01)));
    }

    #[test]
    fn achievable_bound_lies_between_perfect_balance_and_serial() {
        let d = SimDevice {
            speeds: SpeedSchedule::uniform().with_change(3, 0, 0.5),
            ..SimDevice::default()
        };
        let tokens = [65_536, 1_000, 2_000, 3_000, 30_000];
        let samples: Vec<SampleMeta> = (0..5)
            .map(|i| SampleMeta::new(i, tokens[i as usize]))
            .collect();
        let (even, achievable) = step_bounds(&d, &samples, 4, 0);
        assert!(achievable >= even);
        assert!(
            (achievable - d.seconds(&[65_536])).abs() < 1e-12,
            "the longest sample on a full-speed device"
        );
        assert!((even - d.seconds(&tokens) / 3.5).abs() < 1e-12);
        assert_eq!(step_bounds(&d, &[], 4, 0), (0.0, 0.0));
        assert_eq!(step_bounds(&d, &samples, 0, 0), (0.0, 0.0));
    }

    /// Under noise the bounds are of what the device pays: the samples' noisy costs over the
    /// speeds with the noise's straggler.
    #[test]
    fn bounds_under_noise_are_of_the_costs_paid() {
        let noise = odc::sim::Noise {
            straggler_every: 4,
            ..odc::sim::Noise::calibrated(3)
        };
        let d = SimDevice {
            noise,
            ..SimDevice::default()
        };
        let samples: Vec<SampleMeta> = (0..8).map(|i| SampleMeta::new(i, 8_192)).collect();
        let paid: f64 = samples.iter().map(|s| d.paid_seconds(s)).sum();
        assert_ne!(paid, d.seconds(&[8_192; 8]));
        let (even, _) = step_bounds(&d, &samples, 8, 0);
        assert!((even - paid / (6.0 + 2.0 * 0.8)).abs() < 1e-12, "{even}");
    }

    #[test]
    fn default_budget_holds_the_longest_sequence() {
        assert_eq!(default_token_budget(&Workload::LongAlign), 65_536);
        assert_eq!(default_token_budget(&Workload::Rl), 16_384);
        let w = Workload::Lengths {
            name: "f".into(),
            lengths: vec![100, 70_000],
        };
        assert_eq!(default_token_budget(&w), 131_072);
        let huge = Workload::Lengths {
            name: "h".into(),
            lengths: vec![u64::MAX],
        };
        assert_eq!(default_token_budget(&huge), u64::MAX);
    }

    /// Virtual time gives the modelled expectation and is deterministic: a balanced case (every
    /// sample alike, one per micro-batch, no link model, so communication is free in virtual
    /// time) takes per step exactly one device's modelled compute, every device busy all along;
    /// two runs give identical figures.
    #[tokio::test]
    async fn virtual_time_matches_the_model_and_repeats_exactly() {
        let settings = Settings {
            steps: 2,
            clock: ClockMode::Virtual,
            ..Settings::default()
        };
        let c = Case::control(3, 2, 16_384);
        let side = Side::on_demand(DispatchMode::Static, false);
        let run_twice = async {
            let a = run(&c, side, &settings, false).await.expect("runs");
            let b = run(&c, side, &settings, false).await.expect("runs");
            (a, b)
        };
        let (a, b) = tokio::time::timeout(Duration::from_secs(120), run_twice)
            .await
            .expect("virtual runs finish in seconds");
        let per_device_step = settings.device.seconds(&[16_384, 16_384]);
        let expected = per_device_step * settings.steps as f64;
        assert!(expected > 0.0 && a.wall.is_finite() && a.busy.is_finite());
        let off = (a.wall / expected - 1.0).abs();
        assert!(off < 1e-3, "step time {} vs modelled {expected}", a.wall);
        let busy = a.busy / (3.0 * expected);
        assert!((busy - 1.0).abs() < 1e-3, "utilization {busy}");
        assert_eq!(a.tokens, 3 * 2 * 16_384 * settings.steps);
        let key = |m: &Measure| {
            (
                m.tokens,
                m.wall.to_bits(),
                m.busy.to_bits(),
                m.comm_wait.to_bits(),
                m.bytes,
                m.micro_batches,
            )
        };
        assert_eq!(key(&a), key(&b), "two runs, identical figures");
    }

    /// Costs the planner cannot see are paid by a row's device, the same draws every run, and
    /// never by a balanced control; gangs whose members' costs differ still meet and finish.
    #[tokio::test]
    async fn noise_is_paid_by_rows_not_by_controls_and_repeats_exactly() {
        let quiet = Settings {
            steps: 2,
            clock: ClockMode::Virtual,
            split: SplitPolicy::Auto,
            ..Settings::default()
        };
        let mut noisy = quiet.clone();
        noisy.device.noise = Noise {
            straggler_every: 2,
            ..Noise::calibrated(3)
        };
        let row = case(Workload::LongAlign, 4, 1);
        let control = Case::control(4, 2, 16_384);
        let side = Side::on_demand(DispatchMode::Static, false);
        let runs = async {
            let mut out = Vec::new();
            for (case, settings) in [
                (&row, &quiet),
                (&row, &noisy),
                (&row, &noisy),
                (&control, &quiet),
                (&control, &noisy),
            ] {
                out.push(run(case, side, settings, false).await.expect("runs"));
            }
            out
        };
        let m = tokio::time::timeout(Duration::from_secs(120), runs)
            .await
            .expect("virtual runs finish in seconds");
        assert_ne!(
            m[0].wall.to_bits(),
            m[1].wall.to_bits(),
            "the row pays the noise"
        );
        assert_eq!(m[1].wall.to_bits(), m[2].wall.to_bits(), "the same draws");
        assert_eq!(
            m[3].wall.to_bits(),
            m[4].wall.to_bits(),
            "a control pays none"
        );
        assert_eq!(m[0].tokens, m[1].tokens);
    }

    /// Fewer shard servers change nothing modelled without a link model (communication is free
    /// in virtual time), so `devices_per_server` only cuts a large simulation's cost.
    #[tokio::test]
    async fn fewer_servers_give_the_same_virtual_figures_without_a_link_model() {
        let base = Settings {
            steps: 2,
            clock: ClockMode::Virtual,
            ..Settings::default()
        };
        let c = Case {
            name: "rl".into(),
            workload: Workload::Rl,
            devices: 4,
            minibatch_per_device: 2,
            speeds: SpeedSchedule::uniform(),
        };
        let side = Side::on_demand(DispatchMode::Dynamic, false);
        let shared = Settings {
            devices_per_server: 3,
            ..base.clone()
        };
        let both = async {
            let one = run(&c, side, &base, false).await.expect("runs");
            let fewer = run(&c, side, &shared, false).await.expect("runs");
            (one, fewer)
        };
        let (one, fewer) = tokio::time::timeout(Duration::from_secs(120), both)
            .await
            .expect("virtual runs finish in seconds");
        assert!(one.wall > 0.0 && one.wall.is_finite());
        assert_eq!(one.wall.to_bits(), fewer.wall.to_bits());
        assert_eq!(one.busy.to_bits(), fewer.busy.to_bits());
        assert_eq!(
            (one.tokens, one.micro_batches),
            (fewer.tokens, fewer.micro_batches)
        );
    }

    /// On a modelled cluster (two nodes of eight) communication costs virtual time, both sides
    /// pay it, and the placement is one shard per device whatever the number of servers: one
    /// server for all sixteen devices gives the figures of a server per device.
    #[tokio::test]
    async fn a_modelled_cluster_prices_communication_and_keeps_one_shard_per_device() {
        let free = Settings {
            steps: 1,
            clock: ClockMode::Virtual,
            pull_precision: Precision::Bf16,
            ..Settings::default()
        };
        let linked = Settings {
            links: Some(LinksConfig {
                gpus_per_node: 8,
                routing: crate::sim::topology::Routing::Striped,
                hpz: true,
                // 64 KiB units stand for ~3 GB of parameters.
                bytes_scale: 50_000.0,
                relay: false,
            }),
            ..free.clone()
        };
        let one_server = Settings {
            devices_per_server: 16,
            ..linked.clone()
        };
        let c = Case::control(16, 1, 16_384);
        let od = Side::on_demand(DispatchMode::Static, false);
        let runs = async {
            let mut out = Vec::new();
            for (settings, side) in [
                (&free, od),
                (&linked, od),
                (&one_server, od),
                (&free, Side::COLLECTIVE),
                (&linked, Side::COLLECTIVE),
            ] {
                out.push(run(&c, side, settings, false).await.expect("runs"));
            }
            out
        };
        let m = tokio::time::timeout(Duration::from_secs(120), runs)
            .await
            .expect("virtual runs finish in seconds");
        assert_eq!(m.len(), 5);
        for x in &m {
            assert!(x.wall > 0.0 && x.wall.is_finite(), "{x:?}");
        }
        let (od_free, od_linked, od_one, coll_free, coll_linked) =
            (&m[0], &m[1], &m[2], &m[3], &m[4]);
        assert!(
            od_linked.wall > od_free.wall,
            "on-demand pays its pulls and pushes"
        );
        assert!(
            coll_linked.wall > coll_free.wall,
            "the collective pays its ring"
        );
        assert!(od_linked.comm_wait > 0.0);
        let off = (od_one.wall / od_linked.wall - 1.0).abs();
        assert!(
            off < 0.01,
            "one server {} vs one per device {}",
            od_one.wall,
            od_linked.wall
        );
        assert_eq!(od_one.tokens, od_linked.tokens);
    }
}
