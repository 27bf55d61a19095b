//! [`JobBuilder`]: what a job is made of, and the checks [`JobBuilder::build`] makes before
//! anything starts (the supervisor's share of them is [`SupervisorSpec::validate`], which it runs
//! again).

use std::sync::Arc;
use std::time::Duration;

use odc_actors::batch::LossWeighting;
use odc_actors::layout::{ModelLayout, UnitSpec};
use odc_actors::messages::SupervisorSpec;
use odc_actors::node::TrainerTransport;
use odc_actors::policy::balancer::CostModel;
use odc_actors::policy::clock::{Clock, SystemClock};
use odc_actors::policy::dispatch::{Communication, DispatchMode};
use odc_actors::policy::membership::HeartbeatConfig;
use odc_actors::policy::recovery::FailurePolicy;
use odc_actors::policy::relay::RelayPlan;
use odc_actors::policy::schedule::LrSchedule;
use odc_actors::policy::split::{ContextParallel, RingPrice, SplitPolicy};
use odc_actors::policy::step::{NonFinite, StepConfig};
use odc_actors::server::optimizer::OptimizerConfig;
use odc_actors::trainer::{ComputeFactory, ContextConfig};
use odc_actors::{Error, Result};
use odc_transport::{Dtype, Transport};

use crate::checkpoint::{Opened, TrainState};
use crate::data::DataSource;
use crate::launch::{Roles, World};

use super::*;

/// Precision of the parameter copy trainers pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Half the bytes of fp32; masters stay fp32 at the servers.
    #[default]
    Bf16,
    F32,
}

impl Precision {
    fn dtype(self) -> Dtype {
        match self {
            Precision::Bf16 => Dtype::Bf16,
            Precision::F32 => Dtype::F32,
        }
    }
}

/// Default [`JobBuilder::step_timeout`].
pub const DEFAULT_STEP_TIMEOUT: Duration = Duration::from_secs(3600);
/// Default [`JobBuilder::parameters_timeout`].
pub const DEFAULT_PARAMETERS_TIMEOUT: Duration = Duration::from_secs(600);
/// Default [`JobBuilder::join_timeout`].
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(120);

/// Builds a [`Job`]. Defaults: 1 trainer, 1 server, AdamW(lr 1e-3), dynamic dispatch, the 7B cost
/// model, 65,536-token micro-batches, token-mean loss, bf16 pulls, prefetch 1, local transport;
/// deadlines: 600 s per micro-batch, 3600 s per step, 600 s for reading the parameters.
///
/// A job spans several processes (and hosts) when given a [`World`] of more than one rank
/// ([`JobBuilder::world`]): every rank runs the same program, rank 0 hosts the supervisor and
/// feeds the data, and by default every rank hosts one shard server and one trainer
/// ([`JobBuilder::roles`] places them otherwise). `Job::step` returns the same outcome on every
/// rank.
pub struct JobBuilder {
    units: Vec<UnitSpec>,
    trainers: Option<usize>,
    servers: Option<usize>,
    optimizer: OptimizerConfig,
    policy: StepConfig,
    step_timeout: Duration,
    parameters_timeout: Duration,
    precision: Precision,
    context: ContextConfig,
    compute: Option<Arc<dyn ComputeFactory>>,
    data: Option<Box<dyn DataSource>>,
    transport: Option<Arc<dyn Transport>>,
    trainer_transport: Option<TrainerTransport>,
    server_transport: Option<TrainerTransport>,
    pushes: Pushes,
    servers_on_device: Option<u32>,
    collective_node_size: u32,
    world: Option<World>,
    roles: Option<Roles>,
    join_timeout: Duration,
    heartbeat: HeartbeatConfig,
    resume: Option<Opened>,
    keep_last: usize,
    clock: Arc<dyn Clock>,
}

impl Default for JobBuilder {
    fn default() -> Self {
        JobBuilder {
            units: Vec::new(),
            trainers: None,
            servers: None,
            optimizer: OptimizerConfig::adamw(1e-3),
            policy: StepConfig::default(),
            step_timeout: DEFAULT_STEP_TIMEOUT,
            parameters_timeout: DEFAULT_PARAMETERS_TIMEOUT,
            precision: Precision::default(),
            context: ContextConfig::default(),
            compute: None,
            data: None,
            transport: None,
            trainer_transport: None,
            server_transport: None,
            pushes: Pushes::Auto,
            servers_on_device: None,
            collective_node_size: 1,
            world: None,
            roles: None,
            join_timeout: DEFAULT_JOIN_TIMEOUT,
            heartbeat: HeartbeatConfig::default(),
            resume: None,
            keep_last: 0,
            clock: Arc::new(SystemClock),
        }
    }
}

impl JobBuilder {
    /// Append a unit to the model layout (units are gathered in the order added).
    pub fn unit(mut self, unit: UnitSpec) -> Self {
        self.units.push(unit);
        self
    }

    /// Replace the model layout.
    pub fn units(mut self, units: impl IntoIterator<Item = UnitSpec>) -> Self {
        self.units = units.into_iter().collect();
        self
    }

    /// Trainers in the job (default 1; in a multi-process job one per rank).
    pub fn trainers(mut self, n: usize) -> Self {
        self.trainers = Some(n);
        self
    }

    /// Shard servers in the job (default 1; in a multi-process job one per rank).
    pub fn servers(mut self, n: usize) -> Self {
        self.servers = Some(n);
        self
    }

    /// Join a multi-process job: this process's rank, the world size, the coordinator, the
    /// secret and the transport (from [`World::from_env`] under `odc launch`, torchrun or Slurm).
    /// A world of one process is a plain single-process job.
    pub fn world(mut self, world: World) -> Self {
        self.world = Some(world);
        self
    }

    /// Which rank hosts which servers and trainers (multi-process jobs; default: servers and
    /// trainers dealt over the ranks in turn, one of each per rank unless counts are given).
    pub fn roles(mut self, roles: Roles) -> Self {
        self.roles = Some(roles);
        self
    }

    /// Longest a multi-process job waits to assemble (every rank connected, every actor
    /// started) and for the other ranks at shutdown. Default 120 s.
    pub fn join_timeout(mut self, timeout: Duration) -> Self {
        self.join_timeout = timeout;
        self
    }

    /// The control plane's heartbeat in a multi-process job: the coordinator asks every rank
    /// every `interval`, and a rank silent for `timeout` is treated as lost, exactly as a killed
    /// one (its trainers' work is replayed; a lost shard server ends the job, for `odc launch
    /// --max-restarts` to restart from the newest checkpoint); other ranks end with an error when
    /// the coordinator is silent as long. Default 1 s / 10 s; the timeout must exceed the
    /// interval. Every rank must use the same values.
    pub fn heartbeat(mut self, interval: Duration, timeout: Duration) -> Self {
        self.heartbeat = HeartbeatConfig { interval, timeout };
        self
    }

    pub fn optimizer(mut self, optimizer: OptimizerConfig) -> Self {
        self.optimizer = optimizer;
        self
    }

    /// On-demand (default) or the collective (FSDP-style) baseline.
    pub fn communication(mut self, communication: Communication) -> Self {
        self.policy.communication = communication;
        self
    }

    /// The collective's trainers per node (default 1: one flat ring over all trainers). With `g`
    /// dividing the trainer count, every collective runs as a ring over the nodes on each rail,
    /// then a ring inside each node, as NCCL does across nodes: `nodes + g − 2` messages per
    /// trainer and collective instead of `trainers − 1`. A `g` that does not divide the trainer
    /// count keeps the flat ring.
    pub fn collective_node_size(mut self, g: u32) -> Self {
        self.collective_node_size = g;
        self
    }

    pub fn dispatch(mut self, mode: DispatchMode) -> Self {
        self.policy.dispatch = mode;
        self
    }

    /// Runtime straggler rebalancing: plans weighted by each trainer's measured speed (between
    /// minibatches), and dynamic dispatch's steals estimated on those speeds.
    pub fn rebalance(mut self, on: bool) -> Self {
        self.policy.rebalance = on;
        self
    }

    /// Sequence splitting (context parallelism, on-demand mode): with [`SplitPolicy::Auto`] or
    /// [`SplitPolicy::MinTokens`] the planner runs a long sample over a gang of trainers where
    /// that shortens the step ([`odc_actors::policy::split`]), each member computing its chunks
    /// and exchanging keys and values with the others; [`SplitPolicy::Off`] (the default) never
    /// splits. The gang's exchange goes over the job's transport (each trainer's inbox, C7), in
    /// one process or across processes and hosts.
    pub fn sequence_parallel(mut self, policy: SplitPolicy) -> Self {
        self.policy.split = policy;
        self
    }

    /// Context parallelism as collective training runs it (collective mode only, the baselines
    /// of `odc-bench ab` and `sim`): [`ContextParallel::Static`] splits every sample over fixed
    /// groups of trainers (TransformerEngine's and Megatron's CP size),
    /// [`ContextParallel::Dynamic`] picks a group size per sample (Megatron-Core's hybrid CP); each
    /// round's micro-batches hold several pieces, exchanged over the same ring as
    /// `sequence_parallel`'s gangs ([`odc_actors::policy::split::plan_cp`]).
    pub fn context_parallel(mut self, cp: ContextParallel) -> Self {
        self.policy.context_parallel = cp;
        self
    }

    /// The price of a gang's K/V ring: per attention layer, the bytes a token's keys and values
    /// take and the links a hop crosses. With one, an on-demand step with splitting weighs, beside
    /// its gangs, every placement a context-parallel collective could run (static CP of 2 to 64,
    /// dynamic CP), run without lockstep, and takes the shortest
    /// ([`odc_actors::policy::split::plan_on_demand`]); without one (the default) it plans gangs
    /// only, since with an unpriced ring splitting every sample would look free.
    pub fn ring_price(mut self, price: RingPrice) -> Self {
        self.policy.ring_price = Some(price);
        self
    }

    pub fn cost_model(mut self, cost: CostModel) -> Self {
        self.policy.cost = cost;
        self
    }

    /// Token budget of one micro-batch.
    pub fn token_budget(mut self, tokens: u64) -> Self {
        self.policy.token_budget = tokens;
        self
    }

    /// Dynamic dispatch: fill each micro-batch to at least this fraction of the token budget
    /// while enough samples are left (default 0: plain guided packing, sizes halving down to
    /// single samples). Each micro-batch is one pass over the model and one gather of every
    /// unit, so where that fixed cost is not small against a sample's compute (small models, the
    /// CPU), a floor such as 0.5 keeps the passes few; stealing gets coarser. In `0..=1`.
    pub fn micro_batch_min_fill(mut self, fraction: f64) -> Self {
        self.policy.min_fill = fraction;
        self
    }

    pub fn loss_weighting(mut self, weighting: LossWeighting) -> Self {
        self.policy.weighting = weighting;
        self
    }

    /// Clip the global gradient norm (computed with one exchange at the barrier).
    pub fn clip_grad_norm(mut self, max_norm: f64) -> Self {
        self.policy.clip_norm = Some(max_norm);
        self
    }

    /// What a step does when a gradient, a loss or the global gradient norm is not finite (NaN
    /// or ±inf). Either way nothing non-finite reaches a parameter: the step's gradients are
    /// discarded at every shard server, and parameters, optimizer moments and the optimizer's
    /// step count stay as they were.
    /// - [`NonFinite::Error`] (default): the step fails with `Error::Step(StepError::NonFinite)`
    ///   naming where it was found (trainer, micro-batch, sample indices and unit, or the barrier's
    ///   global norm); the job's step counter does not move, so [`Job::step`] next trains the same
    ///   minibatch again ([`Job::step_with`] takes others).
    /// - [`NonFinite::SkipStep`]: like PyTorch's GradScaler skipping `optimizer.step()`, the step
    ///   returns [`StepStats`] with `skipped` set, `odc_skipped_steps_total` counts it, and the
    ///   job goes on. A skipped step counts as a step of the job: the step counter, the data
    ///   source's position and the learning-rate schedule's position move on (as when
    ///   `scheduler.step()` runs every iteration); the optimizer's step count (AdamW's bias
    ///   correction) does not.
    pub fn on_non_finite(mut self, policy: NonFinite) -> Self {
        self.policy.non_finite = policy;
        self
    }

    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.policy.failure = policy;
        self
    }

    /// Replays of one minibatch (after trainer failures) before the step fails.
    pub fn max_replays(mut self, n: u32) -> Self {
        self.policy.max_replays = n;
        self
    }

    /// Longest a micro-batch may run: past it the step fails with
    /// `Error::Step(StepError::Deadline)` naming the trainer and micro-batch, and the hung trainer
    /// is killed (and respawned per the failure policy), so the next step works. Default 600 s.
    pub fn micro_batch_timeout(mut self, timeout: Duration) -> Self {
        self.policy.micro_batch_timeout = timeout;
        self
    }

    /// Longest [`Job::step`] / [`Job::step_with`] waits for the supervisor's answer; past it the
    /// call fails with `Error::Step(StepError::Deadline)` (`what: "step"`). Default 3600 s.
    pub fn step_timeout(mut self, timeout: Duration) -> Self {
        self.step_timeout = timeout;
        self
    }

    /// Longest [`Job::parameters`] waits; past it `Error::Step(StepError::Deadline)` (`what:
    /// "parameters"`). Default 600 s.
    pub fn parameters_timeout(mut self, timeout: Duration) -> Self {
        self.parameters_timeout = timeout;
        self
    }

    pub fn pull_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// Units prefetched ahead of the one being gathered.
    pub fn prefetch(mut self, depth: u32) -> Self {
        self.context.prefetch = depth;
        self
    }

    /// Chunk size of pulls and pushes, in elements.
    pub fn chunk_elems(mut self, elems: u64) -> Self {
        self.context.chunk_elems = elems;
        self
    }

    /// Deadline of every gather and gradient push, from when it is issued (a lost peer becomes
    /// a typed error naming it, never a hang; default 120 s).
    pub fn transfer_timeout(mut self, timeout: Duration) -> Self {
        self.context.transfer_timeout = timeout;
        self
    }

    /// The user compute, one instance per trainer.
    pub fn compute(mut self, factory: impl ComputeFactory) -> Self {
        self.compute = Some(Arc::new(factory));
        self
    }

    pub fn data(mut self, source: impl DataSource) -> Self {
        self.data = Some(Box::new(source));
        self
    }

    /// The data-plane backend (default: [`LocalTransport`]).
    pub fn transport(mut self, transport: Arc<dyn Transport>) -> Self {
        self.transport = Some(transport);
        self
    }

    /// A one-process job without a [`JobBuilder::transport`] of its own keeps its shard servers
    /// on CUDA device `ordinal` (`None`: in host memory, the default): its data plane is
    /// odc-transport's `cuda` backend on that device, whose servers hold master weights,
    /// optimizer state and accumulators in device memory and step with its kernels, and whose
    /// trainers on that device gather into and push from device memory. A multi-process job's
    /// transport is the world's (`odc launch --transport cuda` does the same across processes).
    /// Needs the root crate's `cuda` feature: without it starting the job says so.
    pub fn servers_on_device(mut self, ordinal: Option<u32>) -> Self {
        self.servers_on_device = ordinal;
        self
    }

    /// Give trainer `rank` the transport `make(rank)` instead of the job's (a single-process
    /// job only). A simulation's link model uses it to know which device a read, a push or a
    /// ring message leaves from; each view must move its bytes through the job's transport.
    pub fn trainer_transport(
        mut self,
        make: impl Fn(u32) -> Arc<dyn Transport> + Send + Sync + 'static,
    ) -> Self {
        self.trainer_transport = Some(Arc::new(make));
        self
    }

    /// Give shard server `endpoint` the transport `make(endpoint)` for its relays' flushes
    /// instead of the job's (a single-process job only; see [`JobBuilder::trainer_transport`]).
    pub fn server_transport(
        mut self,
        make: impl Fn(u32) -> Arc<dyn Transport> + Send + Sync + 'static,
    ) -> Self {
        self.server_transport = Some(Arc::new(make));
        self
    }

    /// Relay gradient pushes through the node (`odc_actors::policy::relay`): `node_size`
    /// devices a node, trainer slot (or, in a multi-process job, rank) `i` on node
    /// `i / node_size`, and the shard servers spread evenly over the trainers' devices (in a
    /// multi-process job: on their ranks' nodes). A trainer pushes the shards whose owner is on
    /// another node into its node's relay for that owner, and each relay crosses to its owner
    /// once per step, at the barrier. Not built for the `cuda` transport (starting the job says
    /// so). Relays cost memory: each server of a node of `g` holds about `1/g` of the model's
    /// fp32 gradient in relays. Default: relayed through each host where a multi-process world
    /// spans hosts of at least 2 processes each ([`World::hosts`]; not for `ODC_TRANSPORT=cuda`),
    /// straight to the owner otherwise (one host has no off-node owner; one process a host
    /// would pay a whole gradient's copy to sum only its own micro-batches).
    /// [`JobBuilder::direct_pushes`] turns the default off.
    pub fn relay_pushes(mut self, node_size: u32) -> Self {
        self.pushes = Pushes::Relayed(node_size);
        self
    }

    /// Push every gradient straight to its owner, also where the world spans hosts (see
    /// [`JobBuilder::relay_pushes`] for the default).
    pub fn direct_pushes(mut self) -> Self {
        self.pushes = Pushes::Direct;
        self
    }

    /// The learning rate's schedule: the optimizer's rate times `schedule`'s factor of each global
    /// step (default: constant).
    pub fn lr_schedule(mut self, schedule: LrSchedule) -> Self {
        self.policy.schedule = schedule;
        self
    }

    /// Continue from `state` (a checkpoint's, or [`Job::train_state`]): every unit starts from its
    /// saved values and optimizer state, steps count on from `state.step` (the data source's
    /// step, the schedule's position). The units added with [`JobBuilder::unit`] give the names
    /// and lengths, which must match, and which units are frozen: a frozen unit drops whatever
    /// optimizer state `state` holds for it, and a unit frozen in `state` (0 steps, no buffers)
    /// that trains now starts a fresh optimizer state.
    pub fn resume(mut self, state: TrainState) -> Self {
        self.resume = Some(state.into());
        self
    }

    /// Once a checkpoint ([`Job::checkpoint_async`]) is published, keep the newest `n` complete
    /// step directories in its directory and delete the older ones, on every host that holds a
    /// part of it (per-host directories) — Hugging Face's `save_total_limit`. 0 (the default)
    /// keeps all.
    pub fn keep_last_checkpoints(mut self, n: usize) -> Self {
        self.keep_last = n;
        self
    }

    /// Resume from an opened checkpoint ([`checkpoint::open`](crate::checkpoint::open)): as
    /// [`Self::resume`], but each shard server reads only its own ranges from the mapped files, so
    /// no process holds more of the state than its servers' shards.
    pub fn resume_from(mut self, checkpoint: Opened) -> Self {
        self.resume = Some(checkpoint);
        self
    }

    /// The clock the job's stats and timelines are read from (default [`SystemClock`]). A
    /// simulation on tokio's paused runtime passes [`crate::sim::clock::VirtualClock`], so step
    /// times, spans and the supervisor's deadlines follow virtual time; the transport's
    /// deadlines follow tokio's clock either way. A runtime choice: the job's code is the same.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Validate the configuration.
    pub fn build(mut self) -> Result<Job> {
        let world = self.world.clone().filter(|w| w.world_size > 1);
        let roles = match (&world, &self.roles) {
            (None, _) => None,
            (Some(_), Some(roles)) => Some(roles.clone()),
            (Some(w), None) => Some(Roles::round_robin(
                self.trainers.unwrap_or(w.world_size as usize),
                self.servers.unwrap_or(w.world_size as usize),
                w.world_size,
            )),
        };
        let (trainers, servers) = match &roles {
            Some(r) => (r.trainer_ranks.len(), r.server_ranks.len()),
            None => (self.trainers.unwrap_or(1), self.servers.unwrap_or(1)),
        };
        if let (Some(w), Some(r)) = (&world, &roles) {
            r.validate(w.world_size).map_err(Error::Config)?;
            for (what, given, placed) in [
                ("trainers", self.trainers, trainers),
                ("servers", self.servers, servers),
            ] {
                if given.is_some_and(|n| n != placed) {
                    return Err(Error::Config(format!(
                        "{} {what} asked for, but the roles place {placed} ({r})",
                        given.unwrap_or(0)
                    )));
                }
            }
            if w.coordinator.is_none() {
                return Err(Error::Config(format!(
                    "a world of {} processes needs the coordinator's address",
                    w.world_size
                )));
            }
        }
        for (what, d) in [
            ("step", self.step_timeout),
            ("parameters", self.parameters_timeout),
            ("join", self.join_timeout),
        ] {
            if d.is_zero() {
                return Err(Error::Config(format!(
                    "the {what} timeout must be positive"
                )));
            }
        }
        self.heartbeat.validate().map_err(Error::Config)?;
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        self.policy.first_step = self.resume.as_ref().map_or(0, |s| s.step());
        let relay_node_size = self.pushes.node_size(world.as_ref());
        if let (Pushes::Auto, Some(per_host), Some(w)) = (self.pushes, relay_node_size, &world) {
            if w.is_coordinator() {
                tracing::info!(
                    "gradient pushes relayed through each host's shard servers: the world spans \
                     {} hosts of {per_host} processes (JobBuilder::direct_pushes, \
                     --direct-pushes: straight to each owner)",
                    w.hosts()
                );
            }
        }
        // The checks the supervisor makes again when it starts: one validation for both.
        let spec = SupervisorSpec {
            trainers: count(trainers),
            servers: count(servers),
            optimizer: self.optimizer,
            pull_dtype: self.precision.dtype(),
            context: self.context,
            step: self.policy,
            relay: match relay_node_size {
                None => None,
                Some(size) => Some(relay_plan(roles.as_ref(), trainers, servers, size)?),
            },
        };
        spec.validate()?;
        let first_step = spec.step.first_step;
        let layout = match self.resume.take() {
            None => ModelLayout::new(self.units)?,
            Some(state) => resumed_layout(self.units, state)?,
        };
        let compute = self
            .compute
            .ok_or_else(|| Error::Config("no compute given (JobBuilder::compute)".into()))?;
        if let (Some(w), true) = (
            &world,
            self.transport.is_some()
                || self.trainer_transport.is_some()
                || self.server_transport.is_some(),
        ) {
            return Err(Error::Config(format!(
                "rank {}: a multi-process job makes its transport from the world \
                 (ODC_TRANSPORT), not JobBuilder::transport, trainer_transport or \
                 server_transport",
                w.rank
            )));
        }
        Ok(Job {
            setup: Some(Setup {
                spec,
                layout: Arc::new(layout),
                compute,
                transport: self.transport,
                trainer_transport: self.trainer_transport,
                server_transport: self.server_transport,
                servers_on_device: self.servers_on_device,
                collective_node_size: self.collective_node_size,
                clock: self.clock,
                multi: world.zip(roles).map(|(world, roles)| Multi {
                    world,
                    roles,
                    join_timeout: self.join_timeout,
                    heartbeat: self.heartbeat,
                }),
            }),
            node: None,
            membership: None,
            data: self.data,
            supervisor: None,
            step: first_step,
            step_timeout: self.step_timeout,
            parameters_timeout: self.parameters_timeout,
            join_timeout: self.join_timeout,
            checkpoint: None,
            keep_last: self.keep_last,
        })
    }
}

/// How trainers push gradients whose owner sits on another node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pushes {
    /// Relayed through each host where the world spans hosts, else straight (see
    /// [`JobBuilder::relay_pushes`]).
    Auto,
    Direct,
    /// Relayed through nodes of this many devices.
    Relayed(u32),
}

impl Pushes {
    /// The node size pushes are relayed through, `None`: straight to the owners. `world` is a
    /// multi-process job's.
    pub(super) fn node_size(self, world: Option<&World>) -> Option<u32> {
        match self {
            Pushes::Direct => None,
            Pushes::Relayed(size) => Some(size),
            Pushes::Auto => {
                let w = world?;
                let spans_hosts = w.hosts() > 1 && w.transport.as_deref() != Some("cuda");
                // One process a host: a relay would gain only its own micro-batches' sum, for
                // a second fp32 copy of the gradient on every server.
                w.local_world_size.filter(|&n| spans_hosts && n >= 2)
            }
        }
    }
}

/// Where relayed pushes place each trainer and server: slots on devices in nodes of
/// `node_size` in one process; in a multi-process job, ranks in nodes of `node_size` (as
/// torchrun numbers them, host by host).
pub(super) fn relay_plan(
    roles: Option<&Roles>,
    trainers: usize,
    servers: usize,
    node_size: u32,
) -> Result<RelayPlan> {
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    let plan = match roles {
        None => RelayPlan::even(count(trainers), count(servers), node_size),
        Some(_) if node_size == 0 => RelayPlan::even(0, 0, 0),
        Some(r) => Ok(RelayPlan {
            server_nodes: r.server_ranks.iter().map(|rank| rank / node_size).collect(),
            trainer_nodes: r
                .trainer_ranks
                .iter()
                .map(|rank| rank / node_size)
                .collect(),
        }),
    };
    plan.map_err(|e| Error::Config(e.to_string()))
}

/// `units` starting from `state`: its values replace the model's units' initial values, its
/// optimizer state is where the servers start. Served units ([`UnitSpec::served`]) are not in
/// a checkpoint: they keep their initial values.
fn resumed_layout(mut units: Vec<UnitSpec>, state: Opened) -> Result<ModelLayout> {
    let (params, optimizer) = (state.params(), state.optimizer());
    let model_units = odc_actors::layout::model_units(&units);
    if params.len() != model_units || optimizer.len() != model_units {
        return Err(Error::Config(format!(
            "the state to resume holds {} units of values and {} of optimizer state, the model \
             has {model_units} units",
            params.len(),
            optimizer.len(),
        )));
    }
    for (id, (unit, init)) in units.iter_mut().zip(params).enumerate() {
        let len = state.unit_len(id);
        if len != unit.len {
            return Err(Error::Config(format!(
                "unit {id} ({}) has {} elements, the state to resume has {len}",
                unit.name, unit.len,
            )));
        }
        unit.init = init.clone();
    }
    let mut optimizer = optimizer.to_vec();
    optimizer.resize_with(units.len(), Default::default);
    Ok(ModelLayout::new(units)?.with_optimizer_init(optimizer)?)
}
