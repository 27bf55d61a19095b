//! The [`Job`] builder: model layout, trainers, servers, optimizer, balancing and dispatch, compute
//! and data; [`Job::run`] trains and returns per-step stats.

use std::sync::Arc;
use std::time::Duration;

use odc_actors::batch::{LossWeighting, SampleMeta};
use odc_actors::cluster::ClusterConfig;
use odc_actors::datapath::CollectiveGroup;
use odc_actors::layout::{ModelLayout, UnitSpec};
use odc_actors::messages::{ShardSnapshot, SupervisorSpec};
use odc_actors::node::Node;
use odc_actors::policy::balancer::CostModel;
use odc_actors::policy::dispatch::{Communication, DispatchMode};
use odc_actors::policy::recovery::FailurePolicy;
use odc_actors::policy::stats::StepStats;
use odc_actors::policy::step::StepConfig;
use odc_actors::server::optimizer::OptimizerConfig;
use odc_actors::supervisor::{Placement, Supervisor, SupervisorArgs, SupervisorMsg};
use odc_actors::trainer::{ComputeFactory, ContextConfig, SharedComputeFactory};
use odc_actors::{Error, Result};
use odc_transport::local::LocalTransport;
use odc_transport::{Dest, Dtype, ReadOp, Transport};
use ractor::rpc::CallResult;
use ractor::{Actor, ActorRef};

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
    world: Option<World>,
    roles: Option<Roles>,
    join_timeout: Duration,
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
            world: None,
            roles: None,
            join_timeout: DEFAULT_JOIN_TIMEOUT,
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

    pub fn optimizer(mut self, optimizer: OptimizerConfig) -> Self {
        self.optimizer = optimizer;
        self
    }

    /// On-demand (default) or the collective (FSDP-style) baseline.
    pub fn communication(mut self, communication: Communication) -> Self {
        self.policy.communication = communication;
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

    pub fn loss_weighting(mut self, weighting: LossWeighting) -> Self {
        self.policy.weighting = weighting;
        self
    }

    /// Clip the global gradient norm (computed with one exchange at the barrier).
    pub fn clip_grad_norm(mut self, max_norm: f64) -> Self {
        self.policy.clip_norm = Some(max_norm);
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

    /// Validate the configuration.
    pub fn build(self) -> Result<Job> {
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
        if self.policy.token_budget == 0 {
            return Err(Error::Config("token budget must be positive".into()));
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
        let layout = ModelLayout::new(self.units)?;
        let compute = self
            .compute
            .ok_or_else(|| Error::Config("no compute given (JobBuilder::compute)".into()))?;
        if let (Some(w), Some(_)) = (&world, &self.transport) {
            return Err(Error::Config(format!(
                "rank {}: a multi-process job makes its transport from the world \
                 (ODC_TRANSPORT), not JobBuilder::transport",
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
                multi: world.zip(roles).map(|(world, roles)| Multi {
                    world,
                    roles,
                    join_timeout: self.join_timeout,
                }),
            }),
            node: None,
            membership: None,
            data: self.data,
            supervisor: None,
            step: 0,
            step_timeout: self.step_timeout,
            parameters_timeout: self.parameters_timeout,
            join_timeout: self.join_timeout,
        })
    }
}

/// What [`Job`] starts on first use.
struct Setup {
    spec: SupervisorSpec,
    layout: Arc<ModelLayout>,
    compute: SharedComputeFactory,
    transport: Option<Arc<dyn Transport>>,
    multi: Option<Multi>,
}

/// A multi-process job's world and roles.
struct Multi {
    world: World,
    roles: Roles,
    join_timeout: Duration,
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
            collective: collective.then(|| Arc::new(CollectiveGroup::new(spec.trainers))),
        });
        self.node = Some(node.clone());
        let mut placement = None;
        if let Some(Multi {
            world,
            roles,
            join_timeout,
        }) = multi
        {
            let config = ClusterConfig {
                job: crate::launch::job_name(&world),
                rank: world.rank,
                world_size: world.world_size,
                coordinator: world.coordinator.clone().unwrap_or_default(),
                cookie: crate::launch::secret(&world)?.expose(),
                join_timeout,
            };
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
        let supervisor = self.supervisor().await?;
        let timeout = self.parameters_timeout;
        let deadline = odc_transport::deadline_in(timeout);
        let reply = supervisor
            .call(SupervisorMsg::Parameters, Some(timeout))
            .await;
        let snapshots = unwrap_call(reply, "parameters", self.step, timeout)??;
        let node = self
            .node
            .clone()
            .ok_or_else(|| Error::Internal("a started job without a node".into()))?;
        read_snapshots(node.as_ref(), &snapshots, deadline, self.step, timeout).await
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

/// Read every shard snapshot into whole units; every element of every unit must be covered once.
async fn read_snapshots(
    node: &Node,
    snapshots: &[ShardSnapshot],
    deadline: odc_transport::Deadline,
    step: u64,
    timeout: Duration,
) -> Result<Vec<Vec<f32>>> {
    let mut units: Vec<Vec<f32>> = node
        .layout
        .units()
        .iter()
        .map(|u| vec![0.0; u.len])
        .collect();
    // Disjoint destinations: each snapshot's range of its unit, found by splitting the unit in
    // range order.
    let mut order: Vec<&ShardSnapshot> = snapshots.iter().collect();
    order.sort_by_key(|s| (s.unit, s.start));
    let mut ops = Vec::with_capacity(order.len());
    let mut rest: Vec<&mut [f32]> = units.iter_mut().map(Vec::as_mut_slice).collect();
    let mut at: Vec<usize> = vec![0; rest.len()];
    for snapshot in &order {
        let unit = snapshot.unit as usize;
        let range = snapshot.range();
        let Some(slice) = rest.get_mut(unit) else {
            return Err(Error::UnknownUnit {
                unit: snapshot.unit,
                units: node.layout.len() as u64,
            });
        };
        if range.start != at[unit] || range.end > range.start + slice.len() {
            return Err(Error::Internal(format!(
                "parameter snapshots of unit {unit} do not tile it (shard {range:?} after {})",
                at[unit]
            )));
        }
        let (head, tail) = std::mem::take(slice).split_at_mut(range.len());
        *slice = tail;
        at[unit] = range.end;
        ops.push(ReadOp {
            handle: &snapshot.region,
            range: 0..range.len(),
            into: Dest::F32(head),
        });
    }
    let results = node.transport.read_batch(ops, deadline).await;
    for (snapshot, result) in order.iter().zip(results) {
        match result {
            Ok(_) => {}
            Err(odc_transport::TransportError::DeadlineExceeded { .. }) => {
                return Err(Error::Deadline {
                    what: "parameters".into(),
                    step,
                    trainer: None,
                    micro_batch: None,
                    after_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                })
            }
            Err(source) => {
                return Err(Error::Pull {
                    unit: snapshot.unit,
                    owner: snapshot.region.owner,
                    source,
                })
            }
        }
    }
    drop(rest);
    // Snapshots tile each unit from 0 without gaps (checked above), so `at` is what they cover.
    for (unit, (values, covered)) in units.iter().zip(&at).enumerate() {
        if *covered != values.len() {
            return Err(Error::Internal(format!(
                "parameter snapshots cover {covered} of the {} elements of unit {unit}",
                values.len()
            )));
        }
    }
    Ok(units)
}
