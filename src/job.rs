//! The [`Job`] builder: model layout, trainers, servers, optimizer, balancing and dispatch, compute
//! and data; [`Job::run`] trains and returns per-step stats.

use std::sync::Arc;
use std::time::Duration;

use odc_actors::batch::{LossWeighting, SampleMeta};
use odc_actors::cluster::ClusterConfig;
use odc_actors::datapath::CollectiveGroup;
use odc_actors::layout::{ModelLayout, UnitId, UnitInit, UnitOptimizerInit, UnitSpec};
use odc_actors::messages::{ShardSnapshot, SnapshotCmd, SupervisorSpec};
use odc_actors::node::{Node, TrainerTransport};
use odc_actors::policy::balancer::CostModel;
use odc_actors::policy::clock::{Clock, SystemClock};
use odc_actors::policy::dispatch::{Communication, DispatchMode};
use odc_actors::policy::membership::HeartbeatConfig;
use odc_actors::policy::recovery::FailurePolicy;
use odc_actors::policy::schedule::LrSchedule;
use odc_actors::policy::stats::StepStats;
use odc_actors::policy::step::{NonFinite, StepConfig};
use odc_actors::server::optimizer::OptimizerConfig;
use odc_actors::supervisor::{Placement, Supervisor, SupervisorArgs, SupervisorMsg};
use odc_actors::trainer::{ComputeFactory, ContextConfig, SharedComputeFactory};
use odc_actors::{Error, Result};
use odc_transport::local::LocalTransport;
use odc_transport::{Dest, Dtype, ReadOp, Transport};
use ractor::rpc::CallResult;
use ractor::{Actor, ActorRef};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::checkpoint::TrainState;
use crate::data::DataSource;
use crate::launch::{Roles, World};
use crate::membership::Membership;

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
    collective_node_size: u32,
    world: Option<World>,
    roles: Option<Roles>,
    join_timeout: Duration,
    heartbeat: HeartbeatConfig,
    resume: Option<TrainState>,
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
            collective_node_size: 1,
            world: None,
            roles: None,
            join_timeout: DEFAULT_JOIN_TIMEOUT,
            heartbeat: HeartbeatConfig::default(),
            resume: None,
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
    /// - [`NonFinite::Error`] (default): the step fails with [`Error::NonFinite`] naming where it
    ///   was found (trainer, micro-batch, sample indices and unit, or the barrier's global norm);
    ///   the job's step counter does not move, so [`Job::step`] next trains the same minibatch
    ///   again ([`Job::step_with`] takes others).
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

    /// Longest a micro-batch may run: past it the step fails with [`Error::Deadline`] naming the
    /// trainer and micro-batch, and the hung trainer is killed (and respawned per the failure
    /// policy), so the next step works. Default 600 s.
    pub fn micro_batch_timeout(mut self, timeout: Duration) -> Self {
        self.policy.micro_batch_timeout = timeout;
        self
    }

    /// Longest [`Job::step`] / [`Job::step_with`] waits for the supervisor's answer; past it the
    /// call fails with [`Error::Deadline`] (`what: "step"`). Default 3600 s.
    pub fn step_timeout(mut self, timeout: Duration) -> Self {
        self.step_timeout = timeout;
        self
    }

    /// Longest [`Job::parameters`] waits; past it [`Error::Deadline`] (`what: "parameters"`).
    /// Default 600 s.
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
        self.resume = Some(state);
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
        if trainers == 0 {
            return Err(Error::Zero {
                what: "trainer".into(),
            });
        }
        if servers == 0 {
            return Err(Error::Zero {
                what: "shard server".into(),
            });
        }
        let max = odc_actors::policy::balancer::MAX_TRAINERS;
        if trainers > max || servers > max {
            return Err(Error::Config(format!(
                "{trainers} trainers and {servers} shard servers: at most {max} of each"
            )));
        }
        if self.context.chunk_elems == 0 {
            return Err(Error::Config(
                "chunk size must be at least one element".into(),
            ));
        }
        for (what, d) in [
            ("micro-batch", self.policy.micro_batch_timeout),
            ("step", self.step_timeout),
            ("parameters", self.parameters_timeout),
            ("transfer", self.context.transfer_timeout),
            ("join", self.join_timeout),
        ] {
            if d.is_zero() {
                return Err(Error::Config(format!(
                    "the {what} timeout must be positive"
                )));
            }
        }
        self.heartbeat.validate().map_err(Error::Config)?;
        if self.policy.token_budget == 0 {
            return Err(Error::Config("token budget must be positive".into()));
        }
        if !(0.0..=1.0).contains(&self.policy.min_fill) {
            return Err(Error::Config(format!(
                "the micro-batch fill floor is a fraction of the token budget in 0..=1, got {}",
                self.policy.min_fill
            )));
        }
        if let Some(max) = self.policy.clip_norm {
            if !(max.is_finite() && max > 0.0) {
                return Err(Error::Config(format!(
                    "clip norm must be positive, got {max}"
                )));
            }
        }
        if self.policy.communication == Communication::Collective
            && self.policy.failure == FailurePolicy::Drop
        {
            return Err(Error::Config(
                "collective mode needs every trainer: use FailurePolicy::Respawn".into(),
            ));
        }
        self.optimizer.validate()?;
        self.policy.cost.validate()?;
        self.policy.schedule.validate().map_err(Error::Config)?;
        let first_step = self.resume.as_ref().map_or(0, |s| s.step);
        self.policy.first_step = first_step;
        let layout = match self.resume.take() {
            None => ModelLayout::new(self.units)?,
            Some(state) => resumed_layout(self.units, state)?,
        };
        let compute = self
            .compute
            .ok_or_else(|| Error::Config("no compute given (JobBuilder::compute)".into()))?;
        if let (Some(w), true) = (
            &world,
            self.transport.is_some() || self.trainer_transport.is_some(),
        ) {
            return Err(Error::Config(format!(
                "rank {}: a multi-process job makes its transport from the world \
                 (ODC_TRANSPORT), not JobBuilder::transport or trainer_transport",
                w.rank
            )));
        }
        // Both counts are at most MAX_TRAINERS (checked above), far below u32::MAX.
        let (trainers, servers) = (trainers as u32, servers as u32);
        Ok(Job {
            setup: Some(Setup {
                spec: SupervisorSpec {
                    trainers,
                    servers,
                    optimizer: self.optimizer,
                    pull_dtype: self.precision.dtype(),
                    context: self.context,
                    step: self.policy,
                },
                layout: Arc::new(layout),
                compute,
                transport: self.transport,
                trainer_transport: self.trainer_transport,
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
        })
    }
}

/// `units` starting from `state`: its values replace the units' initial values, its optimizer
/// state is where the servers start.
fn resumed_layout(mut units: Vec<UnitSpec>, state: TrainState) -> Result<ModelLayout> {
    let TrainState {
        params, optimizer, ..
    } = state;
    if params.len() != units.len() || optimizer.len() != units.len() {
        return Err(Error::Config(format!(
            "the state to resume holds {} units of values and {} of optimizer state, the model \
             has {} units",
            params.len(),
            optimizer.len(),
            units.len()
        )));
    }
    for (id, (unit, values)) in units.iter_mut().zip(params).enumerate() {
        if values.len() != unit.len {
            return Err(Error::Config(format!(
                "unit {id} ({}) has {} elements, the state to resume has {}",
                unit.name,
                unit.len,
                values.len()
            )));
        }
        unit.init = UnitInit::Values(values.into());
    }
    ModelLayout::new(units)?.with_optimizer_state(optimizer)
}

/// What [`Job`] starts on first use.
struct Setup {
    spec: SupervisorSpec,
    layout: Arc<ModelLayout>,
    compute: SharedComputeFactory,
    transport: Option<Arc<dyn Transport>>,
    trainer_transport: Option<TrainerTransport>,
    collective_node_size: u32,
    clock: Arc<dyn Clock>,
    multi: Option<Multi>,
}

/// A multi-process job's world and roles.
struct Multi {
    world: World,
    roles: Roles,
    join_timeout: Duration,
    heartbeat: HeartbeatConfig,
}

/// A training job: actors are spawned on first use and live until [`Job::shutdown`].
pub struct Job {
    setup: Option<Setup>,
    /// This process's resources, once started.
    node: Option<Arc<Node>>,
    /// This process's part in a multi-process job.
    membership: Option<Membership>,
    data: Option<Box<dyn DataSource>>,
    /// The supervisor (this process hosts it: a single-process job, or rank 0).
    supervisor: Option<(ActorRef<SupervisorMsg>, tokio::task::JoinHandle<()>)>,
    step: u64,
    step_timeout: Duration,
    parameters_timeout: Duration,
    join_timeout: Duration,
}

impl Job {
    pub fn builder() -> JobBuilder {
        JobBuilder::default()
    }

    /// This process's rank (0 in a single-process job).
    pub fn rank(&self) -> u32 {
        self.membership.as_ref().map_or(0, |m| m.rank)
    }

    /// Whether this process feeds the data and hosts the supervisor (rank 0).
    fn drives(&self) -> bool {
        self.rank() == 0
    }

    /// Start this process's part: its transport and node; in a multi-process job join the
    /// others; on rank 0 (or alone) the supervisor, which starts the servers and trainers.
    async fn start(&mut self) -> Result<()> {
        let Some(setup) = self.setup.take() else {
            return match (&self.node, &self.supervisor, &self.membership) {
                (Some(_), Some(_), _) | (Some(_), _, Some(_)) => Ok(()),
                _ => Err(Error::Actor {
                    actor: "supervisor".into(),
                    reason: "the job's actors stopped".into(),
                }),
            };
        };
        let Setup {
            spec,
            layout,
            compute,
            transport,
            trainer_transport,
            collective_node_size,
            clock,
            multi,
        } = setup;
        let transport = match (transport, &multi) {
            (Some(t), _) => t,
            (None, Some(m)) => crate::launch::transport(&m.world).await?,
            (None, None) => Arc::new(LocalTransport::new()),
        };
        let collective = spec.step.communication == Communication::Collective;
        let node = Arc::new(Node {
            transport,
            layout: layout.clone(),
            compute,
            collective: collective.then(|| {
                Arc::new(CollectiveGroup::new(spec.trainers).with_node_size(collective_node_size))
            }),
            clock,
            trainer_transport,
        });
        self.node = Some(node.clone());
        let mut placement = None;
        if let Some(Multi {
            world,
            roles,
            join_timeout,
            heartbeat,
        }) = multi
        {
            let config = ClusterConfig {
                job: crate::launch::job_name(&world),
                rank: world.rank,
                world_size: world.world_size,
                coordinator: world.coordinator.clone().unwrap_or_default(),
                secret: crate::launch::secret(&world)?,
                bind: world.bind_ip().map_err(|e| Error::Config(e.to_string()))?,
                join_timeout,
                heartbeat,
            };
            // Every peer costs a descriptor: raise the soft limit to the hard one first.
            match crate::launch::raise_fd_limit() {
                Ok(limit) => tracing::debug!("rank {}: up to {limit} descriptors", world.rank),
                Err(e) => tracing::warn!(
                    "rank {}: could not raise the descriptor limit: {e}",
                    world.rank
                ),
            }
            let membership = Membership::join(config, node.clone()).await?;
            if membership.rank == 0 {
                placement = Some(Placement {
                    job: membership.job.clone(),
                    hosts: membership.hosts.clone(),
                    server_ranks: roles.server_ranks,
                    trainer_ranks: roles.trainer_ranks,
                    layout: layout.digest(),
                    spawn_timeout: join_timeout,
                });
            }
            self.membership = Some(membership);
        }
        if !self.drives() {
            return Ok(());
        }
        let args = SupervisorArgs {
            spec,
            node,
            placement,
        };
        let (actor, handle) =
            Actor::spawn(None, Supervisor, args)
                .await
                .map_err(|e| Error::Actor {
                    actor: "supervisor".into(),
                    reason: e.to_string(),
                })?;
        self.supervisor = Some((actor, handle));
        Ok(())
    }

    /// The supervisor: this process's, or rank 0's seen from another rank.
    async fn supervisor(&mut self) -> Result<ActorRef<SupervisorMsg>> {
        self.start().await?;
        if let Some((actor, _)) = &self.supervisor {
            return Ok(actor.clone());
        }
        match &self.membership {
            Some(m) => m.supervisor().await,
            None => Err(Error::Internal("a job without a supervisor".into())),
        }
    }

    /// Train one minibatch of explicit samples (rank 0 of a multi-process job, or a
    /// single-process job). Waits at most the step timeout ([`JobBuilder::step_timeout`]); past
    /// it [`Error::Deadline`] (the step may still be running in the supervisor: the next call
    /// then gets [`Error::Busy`] until it ends).
    pub async fn step_with(&mut self, samples: Vec<SampleMeta>) -> Result<StepStats> {
        self.start().await?;
        if !self.drives() {
            return Err(Error::Config(format!(
                "rank {}: only rank 0 feeds samples; other ranks call Job::step",
                self.rank()
            )));
        }
        let supervisor = self.supervisor().await?;
        let timeout = self.step_timeout;
        let reply = supervisor
            .call(|reply| SupervisorMsg::Step(samples, reply), Some(timeout))
            .await;
        let stats = unwrap_call(reply, "step", self.step, timeout).and_then(|r| r);
        if let Some(m) = &self.membership {
            m.broadcast_step(self.step, &stats).await;
        }
        let stats = stats?;
        self.step += 1;
        Ok(stats)
    }

    /// Train one minibatch from the data source. On ranks other than 0 of a multi-process job:
    /// wait for rank 0's step and return its outcome (without the per-micro-batch log, which
    /// only rank 0 keeps).
    pub async fn step(&mut self) -> Result<StepStats> {
        self.start().await?;
        let step = self.step;
        if !self.drives() {
            let deadline = tokio::time::Instant::now() + self.step_timeout;
            let m = self
                .membership
                .as_mut()
                .ok_or_else(|| Error::Internal("a rank without a membership".into()))?;
            let stats = m.step_outcome(step, deadline).await?;
            self.step += 1;
            return Ok(stats);
        }
        let data = self
            .data
            .as_mut()
            .ok_or_else(|| Error::Config("no data source given (JobBuilder::data)".into()))?;
        let samples = data.minibatch(step)?;
        self.step_with(samples).await
    }

    /// Every rank's `value`, in rank order, on every rank: `torch.distributed.all_gather_object`
    /// for the small objects an SPMD program shares (a rank's sampled responses, its share of an
    /// evaluation). Every rank calls it, in the same order among its other gathers; a
    /// single-process job gets `[value]` back (through the same encoding). Values are encoded
    /// with `postcard` and travel on the authenticated control plane, so all ranks' parts
    /// together must fit a control frame (32 MiB): tensors belong on the data plane.
    ///
    /// Waits at most `timeout` for the slowest rank; past it, or when a rank leaves or is lost
    /// first, every rank gets an error naming what happened (rank 0 answers the others with
    /// it). A part that does not decode is an error naming its rank.
    pub async fn all_gather<T: Serialize + DeserializeOwned>(
        &mut self,
        value: &T,
        timeout: Duration,
    ) -> Result<Vec<T>> {
        self.start().await?;
        let what = std::any::type_name::<T>();
        let bytes = postcard::to_stdvec(value)
            .map_err(|e| Error::Config(format!("all-gather: cannot encode a {what}: {e}")))?;
        let parts = match self.membership.as_mut() {
            Some(m) => {
                m.all_gather(bytes, tokio::time::Instant::now() + timeout)
                    .await?
            }
            None => vec![bytes],
        };
        parts
            .iter()
            .enumerate()
            .map(|(rank, bytes)| {
                postcard::from_bytes(bytes).map_err(|e| {
                    Error::Config(format!(
                        "all-gather: rank {rank}'s part ({} bytes) is not a {what}: {e} (every \
                         rank must gather the same type in the same order)",
                        bytes.len()
                    ))
                })
            })
            .collect()
    }

    /// Wait until every rank has called `barrier` (`torch.distributed.barrier`): an all-gather
    /// of nothing, with its deadline and errors. E.g. every rank has stored the samples rank 0 is
    /// about to step on, which any rank's trainer may be given.
    pub async fn barrier(&mut self, timeout: Duration) -> Result<()> {
        self.all_gather(&(), timeout).await.map(drop)
    }

    /// Train `steps` minibatches from the data source; per-step stats.
    pub async fn run(&mut self, steps: u64) -> Result<Vec<StepStats>> {
        let mut out = Vec::new();
        for _ in 0..steps {
            out.push(self.step().await?);
        }
        Ok(out)
    }

    /// Steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// fp32 master parameters of every unit, in layout order, read over the data plane: the
    /// servers publish fp32 snapshots of their shards and the job reads them with one batch of
    /// reads (no tensor bytes in control messages); any rank of a multi-process job may ask.
    /// Waits at most the parameters timeout ([`JobBuilder::parameters_timeout`]); past it
    /// [`Error::Deadline`].
    pub async fn parameters(&mut self) -> Result<Vec<Vec<f32>>> {
        let (node, snapshots, deadline) = self.snapshots(SnapshotCmd::default()).await?;
        let timeout = self.parameters_timeout;
        read_snapshots(node.as_ref(), &snapshots, deadline, self.step, timeout).await
    }

    /// Everything a checkpoint holds, read like [`Job::parameters`]: the global step, the fp32
    /// master values and the optimizer state of every unit (a frozen unit's: 0 steps, no
    /// buffers). A job built with [`JobBuilder::resume`] from it continues exactly where this one
    /// is.
    pub async fn train_state(&mut self) -> Result<TrainState> {
        let (node, snapshots, deadline) = self.snapshots(SnapshotCmd { optimizer: true }).await?;
        let timeout = self.parameters_timeout;
        let params =
            read_snapshots(node.as_ref(), &snapshots, deadline, self.step, timeout).await?;
        let optimizer =
            read_optimizer_snapshots(node.as_ref(), &snapshots, deadline, self.step, timeout)
                .await?;
        Ok(TrainState {
            step: self.step,
            params,
            optimizer,
        })
    }

    /// Ask the supervisor for every shard's snapshot handles.
    async fn snapshots(
        &mut self,
        cmd: SnapshotCmd,
    ) -> Result<(Arc<Node>, Vec<ShardSnapshot>, odc_transport::Deadline)> {
        let supervisor = self.supervisor().await?;
        let timeout = self.parameters_timeout;
        let deadline = odc_transport::deadline_in(timeout);
        let reply = supervisor
            .call(|reply| SupervisorMsg::Parameters(cmd, reply), Some(timeout))
            .await;
        let snapshots = unwrap_call(reply, "parameters", self.step, timeout)??;
        let node = self
            .node
            .clone()
            .ok_or_else(|| Error::Internal("a started job without a node".into()))?;
        Ok((node, snapshots, deadline))
    }

    /// Stop every actor and wait for them. In a multi-process job rank 0 first waits (at most
    /// the join timeout) until every other rank has called `shutdown` or is gone, so no rank
    /// loses a shard another still reads; other ranks tell rank 0 and wait for its word.
    pub async fn shutdown(mut self) {
        let deadline = tokio::time::Instant::now() + self.join_timeout;
        if self.setup.is_some() && self.membership.is_none() {
            // A rank that never started still has to join for the others to finish.
            let multi = self.setup.as_ref().is_some_and(|s| s.multi.is_some());
            if !multi || self.start().await.is_err() {
                return;
            }
        }
        let membership = self.membership.take();
        if let Some(mut m) = membership {
            if m.rank != 0 {
                m.leave(deadline).await;
                return;
            }
            m.wait_for_ranks(deadline).await;
            self.stop_supervisor().await;
            m.end(None).await;
            return;
        }
        self.stop_supervisor().await;
    }

    async fn stop_supervisor(&mut self) {
        if let Some((actor, handle)) = self.supervisor.take() {
            actor.stop(None);
            let _ = handle.await;
        }
    }
}

impl Drop for Job {
    /// A job dropped without [`Job::shutdown`] still stops its actors (without waiting for them).
    fn drop(&mut self) {
        if let Some((actor, _)) = self.supervisor.take() {
            actor.stop(None);
        }
    }
}

/// The answer of a call to the supervisor; a timeout is [`Error::Deadline`] for `what` of `step`.
fn unwrap_call<T>(
    reply: std::result::Result<CallResult<T>, ractor::MessagingErr<SupervisorMsg>>,
    what: &str,
    step: u64,
    timeout: Duration,
) -> Result<T> {
    match reply {
        Ok(CallResult::Success(v)) => Ok(v),
        Ok(CallResult::Timeout) => Err(Error::Deadline {
            what: what.into(),
            step,
            trainer: None,
            micro_batch: None,
            after_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        }),
        Ok(CallResult::SenderError) => Err(Error::Actor {
            actor: "supervisor".into(),
            reason: format!("{what}: dropped the reply"),
        }),
        Err(e) => Err(Error::Actor {
            actor: "supervisor".into(),
            reason: format!("{what}: {e}"),
        }),
    }
}

/// One piece of a unit to read: the unit, the elements of it the region holds, and the region.
struct Piece<'a> {
    unit: UnitId,
    range: std::ops::Range<usize>,
    region: &'a odc_transport::RegionHandle,
}

/// Reads `pieces`, which must tile every unit of `lens` they touch, in one batch of reads over the
/// data plane; units no piece touches stay empty. `what` names the values in errors.
async fn read_tiled(
    node: &Node,
    lens: &[usize],
    mut pieces: Vec<Piece<'_>>,
    what: &str,
    deadline: odc_transport::Deadline,
    step: u64,
    timeout: Duration,
) -> Result<Vec<Vec<f32>>> {
    let touched: std::collections::HashSet<UnitId> = pieces.iter().map(|p| p.unit).collect();
    let mut units: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(u, &len)| {
            if touched.contains(&(u as UnitId)) {
                vec![0.0; len]
            } else {
                Vec::new()
            }
        })
        .collect();
    // Disjoint destinations: each piece's range of its unit, found by splitting the unit in range
    // order.
    pieces.sort_by_key(|p| (p.unit, p.range.start));
    let mut ops = Vec::with_capacity(pieces.len());
    let mut rest: Vec<&mut [f32]> = units.iter_mut().map(Vec::as_mut_slice).collect();
    let mut at: Vec<usize> = vec![0; rest.len()];
    for piece in &pieces {
        let unit = piece.unit as usize;
        let range = piece.range.clone();
        let Some(slice) = rest.get_mut(unit) else {
            return Err(Error::UnknownUnit {
                unit: piece.unit,
                units: lens.len() as u64,
            });
        };
        if range.start != at[unit] || range.end > range.start + slice.len() {
            return Err(Error::Internal(format!(
                "{what} snapshots of unit {unit} do not tile it (shard {range:?} after {})",
                at[unit]
            )));
        }
        let (head, tail) = std::mem::take(slice).split_at_mut(range.len());
        *slice = tail;
        at[unit] = range.end;
        ops.push(ReadOp {
            handle: piece.region,
            range: 0..range.len(),
            into: Dest::F32(head),
        });
    }
    let results = node.transport.read_batch(ops, deadline).await;
    for (piece, result) in pieces.iter().zip(results) {
        match result {
            Ok(_) => {}
            Err(odc_transport::TransportError::DeadlineExceeded { .. }) => {
                return Err(Error::Deadline {
                    what: what.into(),
                    step,
                    trainer: None,
                    micro_batch: None,
                    after_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                })
            }
            Err(source) => {
                return Err(Error::Pull {
                    unit: piece.unit,
                    owner: piece.region.owner,
                    source,
                })
            }
        }
    }
    drop(rest);
    // Pieces tile each unit from 0 without gaps (checked above), so `at` is what they cover.
    for (unit, (values, covered)) in units.iter().zip(&at).enumerate() {
        if *covered != values.len() {
            return Err(Error::Internal(format!(
                "{what} snapshots cover {covered} of the {} elements of unit {unit}",
                values.len()
            )));
        }
    }
    Ok(units)
}

/// The master values of every unit from the servers' snapshots.
async fn read_snapshots(
    node: &Node,
    snapshots: &[ShardSnapshot],
    deadline: odc_transport::Deadline,
    step: u64,
    timeout: Duration,
) -> Result<Vec<Vec<f32>>> {
    let lens: Vec<usize> = node.layout.units().iter().map(|u| u.len).collect();
    let pieces = snapshots
        .iter()
        .map(|s| Piece {
            unit: s.unit,
            range: s.range(),
            region: &s.region,
        })
        .collect();
    let units = read_tiled(node, &lens, pieces, "parameters", deadline, step, timeout).await?;
    if let Some(unit) = units.iter().position(Vec::is_empty) {
        return Err(Error::Internal(format!(
            "no parameter snapshot of unit {unit}"
        )));
    }
    Ok(units)
}

/// The optimizer state of every unit from the servers' snapshots: per unit its step count and
/// buffers, which every shard of the unit must agree on.
async fn read_optimizer_snapshots(
    node: &Node,
    snapshots: &[ShardSnapshot],
    deadline: odc_transport::Deadline,
    step: u64,
    timeout: Duration,
) -> Result<Vec<UnitOptimizerInit>> {
    let lens: Vec<usize> = node.layout.units().iter().map(|u| u.len).collect();
    // Per unit: steps and buffer names, equal across its shards.
    let mut meta: Vec<Option<(u64, Vec<String>)>> = vec![None; lens.len()];
    for s in snapshots {
        let opt = s.optimizer.as_ref().ok_or_else(|| {
            Error::Internal(format!(
                "unit {}: a snapshot without optimizer state",
                s.unit
            ))
        })?;
        let names: Vec<String> = opt.buffers.iter().map(|(n, _)| n.clone()).collect();
        let slot = meta.get_mut(s.unit as usize).ok_or(Error::UnknownUnit {
            unit: s.unit,
            units: lens.len() as u64,
        })?;
        match slot {
            None => *slot = Some((opt.steps, names)),
            Some((steps, seen)) if *steps == opt.steps && *seen == names => {}
            Some((steps, seen)) => {
                return Err(Error::Internal(format!(
                    "unit {}: its shards disagree on the optimizer state ({steps} steps, \
                     {seen:?} vs {} steps, {names:?})",
                    s.unit, opt.steps
                )))
            }
        }
    }
    let mut out: Vec<UnitOptimizerInit> = Vec::with_capacity(lens.len());
    for (unit, m) in meta.iter().enumerate() {
        let (steps, _) = m
            .as_ref()
            .ok_or_else(|| Error::Internal(format!("no optimizer snapshot of unit {unit}")))?;
        out.push(UnitOptimizerInit {
            steps: *steps,
            buffers: Vec::new(),
        });
    }
    let mut names: Vec<&String> = meta.iter().flatten().flat_map(|(_, n)| n).collect();
    names.sort();
    names.dedup();
    for name in names {
        let pieces = snapshots
            .iter()
            .filter_map(|s| {
                let (_, region) = s
                    .optimizer
                    .as_ref()?
                    .buffers
                    .iter()
                    .find(|(n, _)| n == name)?;
                Some(Piece {
                    unit: s.unit,
                    range: s.range(),
                    region,
                })
            })
            .collect();
        let what = format!("optimizer `{name}`");
        let values = read_tiled(node, &lens, pieces, &what, deadline, step, timeout).await?;
        for (unit, values) in values.into_iter().enumerate() {
            if !values.is_empty() {
                out[unit].buffers.push((name.clone(), values.into()));
            }
        }
    }
    Ok(out)
}
