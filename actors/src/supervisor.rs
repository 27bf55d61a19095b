//! The supervisor actor: plans each minibatch, dispatches micro-batches, keeps the ledger, runs the
//! barrier and the optimizer step, and replays a minibatch when a trainer fails.
//!
//! Invariants it upholds:
//! - **I1 consistency**: servers publish version v+1 only in the barrier, which starts when the
//!   ledger holds every micro-batch of step v; no trainer has step-v work then.
//! - **I2 exactly once**: when a trainer fails mid-minibatch, every owner discards the attempt's
//!   accumulated gradient and moves to a new epoch (late or duplicate writes of the failed attempt are
//!   then refused by the transport), and the whole minibatch is replayed from a fresh plan.
//!   Reports from a discarded attempt are ignored.
//! - **I4 no inner barrier**: a trainer gets its next micro-batch as soon as it reports; nothing waits
//!   for another trainer before the barrier.
//!
//! The policies (plan, work queue, ledger) are the pure modules [`crate::policy::balancer`],
//! [`crate::policy::dispatch`] and [`crate::policy::ledger`]; this actor only moves messages between them.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use odc_transport::{Dtype, Transport};
use ractor::rpc::CallResult;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};

use crate::collective::CollectiveGroup;
use crate::compute::{LossWeighting, MicroBatch, SampleMeta, SharedComputeFactory};
use crate::context::{ContextConfig, TrainerContext};
use crate::directory::Directory;
use crate::error::{Error, Result};
use crate::layout::ModelLayout;
use crate::metrics as m;
use crate::optimizer::OptimizerConfig;
use crate::policy::balancer::{
    plan_dynamic, plan_dynamic_weighted, plan_equal_count, plan_static, plan_static_weighted,
    CostModel, Plan,
};
use crate::policy::clock::{Clock, SystemClock};
use crate::policy::dispatch::{Communication, DispatchMode, Outlook, WorkQueue};
use crate::policy::ledger::Ledger;
use crate::policy::stats::{MicroBatchRecord, StepStats, TrainerStepStats};
use crate::policy::straggler::SpeedEstimator;
use crate::server::{ServerArgs, ServerMsg, ShardServer};
use crate::trainer::{Assignment, Trainer, TrainerArgs, TrainerMsg, TrainerReport};

/// Timeout of control calls to shard servers.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// What to do with a trainer that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Spawn a fresh trainer in its slot, at most `max_respawns` times per slot.
    Respawn { max_respawns: u32 },
    /// Continue with the remaining trainers.
    Drop,
}

impl Default for FailurePolicy {
    fn default() -> Self {
        FailurePolicy::Respawn { max_respawns: 3 }
    }
}

/// How each minibatch is planned, weighted, clipped and recovered.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepPolicy {
    pub communication: Communication,
    /// On-demand mode only; collective mode always plans LB-Micro.
    pub dispatch: DispatchMode,
    pub cost: CostModel,
    /// Token budget of one micro-batch.
    pub token_budget: u64,
    pub weighting: LossWeighting,
    /// Clip the global gradient norm to this value.
    pub clip_norm: Option<f64>,
    pub failure: FailurePolicy,
    /// Replays of one minibatch before the step fails.
    pub max_replays: u32,
    /// Runtime straggler rebalancing: estimate each trainer's speed from completed work; dynamic
    /// dispatch and static plans use the estimates.
    pub rebalance: bool,
}

impl Default for StepPolicy {
    fn default() -> Self {
        StepPolicy {
            communication: Communication::OnDemand,
            dispatch: DispatchMode::Dynamic,
            cost: CostModel::default(),
            token_budget: 65_536,
            weighting: LossWeighting::Tokens,
            clip_norm: None,
            failure: FailurePolicy::default(),
            max_replays: 3,
            rebalance: false,
        }
    }
}

/// Messages of the supervisor.
pub enum SupervisorMsg {
    /// Train one minibatch; replies after the optimizer step.
    Step {
        samples: Vec<SampleMeta>,
        reply: RpcReplyPort<Result<StepStats>>,
    },
    /// A trainer finished a micro-batch.
    Done(TrainerReport),
    /// fp32 master parameters of every unit.
    Parameters(RpcReplyPort<Result<Vec<Vec<f32>>>>),
}

/// How to build the supervisor (it spawns the servers and trainers, linked).
pub struct SupervisorArgs {
    pub layout: Arc<ModelLayout>,
    pub transport: Arc<dyn Transport>,
    pub trainers: usize,
    pub servers: usize,
    pub compute: SharedComputeFactory,
    pub optimizer: OptimizerConfig,
    pub pull_dtype: Dtype,
    pub context: ContextConfig,
    pub policy: StepPolicy,
}

struct TrainerSlot {
    actor: Option<ActorRef<TrainerMsg>>,
    /// (epoch, micro-batch) it is running.
    busy: Option<(u64, usize)>,
    /// When it got its current micro-batch and that micro-batch's cost.
    busy_since: Option<(crate::policy::clock::Timestamp, f64)>,
    respawns: u32,
}

struct StepRun {
    samples: Vec<SampleMeta>,
    micro_batches: Vec<MicroBatch>,
    queue: WorkQueue,
    ledger: Ledger,
    reply: RpcReplyPort<Result<StepStats>>,
    started: crate::policy::clock::Timestamp,
    replays: u32,
    loss_sum: f64,
    trainers: Vec<TrainerStepStats>,
    log: Vec<MicroBatchRecord>,
}

/// State of the supervisor.
pub struct SupervisorState {
    layout: Arc<ModelLayout>,
    transport: Arc<dyn Transport>,
    compute: SharedComputeFactory,
    context: ContextConfig,
    policy: StepPolicy,
    directory: Arc<Directory>,
    collective: Option<Arc<CollectiveGroup>>,
    servers: Vec<ActorRef<ServerMsg>>,
    slots: Vec<TrainerSlot>,
    /// Measured speed of every trainer slot (cost units per second).
    speeds: SpeedEstimator,
    version: u64,
    epoch: u64,
    run: Option<StepRun>,
}

/// The supervisor actor.
pub struct Supervisor;

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: SupervisorArgs,
    ) -> std::result::Result<SupervisorState, ActorProcessingErr> {
        if args.trainers == 0 {
            return Err(Error::Zero { what: "trainer" }.into());
        }
        if args.servers == 0 {
            return Err(Error::Zero {
                what: "shard server",
            }
            .into());
        }
        args.optimizer.validate().map_err(Error::from)?;
        args.policy.cost.validate().map_err(Error::from)?;
        let mut servers = Vec::new();
        for endpoint in 0..args.servers {
            let server_args = ServerArgs {
                endpoint: endpoint as u32,
                servers: args.servers,
                layout: args.layout.clone(),
                transport: args.transport.clone(),
                optimizer: args.optimizer,
                pull_dtype: args.pull_dtype,
                epoch: 0,
            };
            let (server, _) =
                Actor::spawn_linked(None, ShardServer, server_args, myself.get_cell()).await?;
            servers.push(server);
        }
        let mut directory = Directory {
            units: vec![Vec::new(); args.layout.len()],
        };
        for server in &servers {
            let routes = call(server, ServerMsg::Routes, "shard server routes").await?;
            for (unit, route) in routes.into_iter().enumerate() {
                if let (Some(route), Some(list)) = (route, directory.units.get_mut(unit)) {
                    list.push(route);
                }
            }
        }
        let mut state = SupervisorState {
            layout: args.layout,
            transport: args.transport,
            compute: args.compute,
            context: args.context,
            policy: args.policy,
            directory: Arc::new(directory),
            collective: (args.policy.communication == Communication::Collective)
                .then(|| Arc::new(CollectiveGroup::new(args.trainers))),
            servers,
            slots: Vec::new(),
            speeds: SpeedEstimator::new(args.trainers, 0.5),
            version: 0,
            epoch: 0,
            run: None,
        };
        for index in 0..args.trainers {
            let actor = spawn_trainer(&state, &myself, index).await?;
            state.slots.push(TrainerSlot {
                actor: Some(actor),
                busy: None,
                busy_since: None,
                respawns: 0,
            });
        }
        Ok(state)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut SupervisorState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        for slot in &state.slots {
            if let Some(actor) = &slot.actor {
                actor.stop(None);
            }
        }
        for server in &state.servers {
            server.stop(None);
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::Step { samples, reply } => start_step(state, samples, reply),
            SupervisorMsg::Done(report) => on_done(state, report).await,
            SupervisorMsg::Parameters(reply) => {
                let _ = reply.send(parameters(state).await);
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let (cell, reason) = match event {
            SupervisionEvent::ActorFailed(cell, err) => (cell, err.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, reason.unwrap_or_else(|| "stopped".into()))
            }
            _ => return Ok(()),
        };
        on_child_exit(state, &myself, cell, reason).await
    }
}

async fn call<M, T>(
    actor: &ActorRef<M>,
    msg: impl FnOnce(RpcReplyPort<T>) -> M,
    what: &str,
) -> Result<T>
where
    M: ractor::Message,
    T: Send + 'static,
{
    match actor.call(msg, Some(CALL_TIMEOUT)).await {
        Ok(CallResult::Success(v)) => Ok(v),
        Ok(CallResult::Timeout) => Err(Error::Actor {
            actor: what.into(),
            reason: format!("no reply within {CALL_TIMEOUT:?}"),
        }),
        Ok(CallResult::SenderError) => Err(Error::Actor {
            actor: what.into(),
            reason: "dropped the reply".into(),
        }),
        Err(e) => Err(Error::Actor {
            actor: what.into(),
            reason: e.to_string(),
        }),
    }
}

async fn spawn_trainer(
    state: &SupervisorState,
    myself: &ActorRef<SupervisorMsg>,
    index: usize,
) -> std::result::Result<ActorRef<TrainerMsg>, ActorProcessingErr> {
    let context = TrainerContext::new(
        index,
        state.transport.clone(),
        state.layout.clone(),
        state.directory.clone(),
        state.context,
        state.collective.clone(),
    );
    let args = TrainerArgs {
        index,
        compute: state.compute.create(index),
        context,
        supervisor: myself.clone(),
    };
    let (actor, _) = Actor::spawn_linked(None, Trainer, args, myself.get_cell()).await?;
    Ok(actor)
}

/// Plan `samples` for the live trainer slots.
fn plan(state: &SupervisorState, samples: &[SampleMeta]) -> Result<(Plan, Vec<usize>)> {
    let live: Vec<usize> = (0..state.slots.len())
        .filter(|&i| state.slots[i].actor.is_some())
        .collect();
    if live.is_empty() {
        return Err(Error::NoTrainers {
            step: state.version,
        });
    }
    let tokens: Vec<u64> = samples.iter().map(|s| s.tokens).collect();
    let p = &state.policy;
    let plan = match (p.communication, p.dispatch) {
        (Communication::Collective, _) => {
            if live.len() != state.slots.len() {
                return Err(Error::Config(format!(
                    "collective mode needs all {} trainers, {} are left",
                    state.slots.len(),
                    live.len()
                )));
            }
            plan_equal_count(&tokens, &p.cost, live.len(), p.token_budget)?
        }
        (Communication::OnDemand, mode) if p.rebalance => {
            // The plan corrected between minibatches by the measured speeds.
            let all = state.speeds.speeds();
            let speeds: Vec<f64> = live
                .iter()
                .map(|&s| all.get(s).copied().unwrap_or(1.0))
                .collect();
            match mode {
                DispatchMode::Static => {
                    plan_static_weighted(&tokens, &p.cost, &speeds, p.token_budget)?
                }
                DispatchMode::Dynamic => {
                    plan_dynamic_weighted(&tokens, &p.cost, &speeds, p.token_budget)?
                }
            }
        }
        (Communication::OnDemand, DispatchMode::Static) => {
            plan_static(&tokens, &p.cost, live.len(), p.token_budget)?
        }
        (Communication::OnDemand, DispatchMode::Dynamic) => {
            plan_dynamic(&tokens, &p.cost, live.len(), p.token_budget)?
        }
    };
    Ok((plan, live))
}

fn start_step(
    state: &mut SupervisorState,
    samples: Vec<SampleMeta>,
    reply: RpcReplyPort<Result<StepStats>>,
) {
    if state.run.is_some() {
        let _ = reply.send(Err(Error::Busy));
        return;
    }
    if samples.is_empty() {
        let _ = reply.send(Err(Error::EmptyMinibatch {
            step: state.version,
        }));
        return;
    }
    let (plan, live) = match plan(state, &samples) {
        Ok(p) => p,
        Err(e) => {
            let _ = reply.send(Err(e));
            return;
        }
    };
    let slots = state.slots.len();
    state.run = Some(new_run(state, samples, &plan, &live, reply, slots));
    dispatch(state);
}

fn new_run(
    state: &SupervisorState,
    samples: Vec<SampleMeta>,
    plan: &Plan,
    live: &[usize],
    reply: RpcReplyPort<Result<StepStats>>,
    slots: usize,
) -> StepRun {
    let micro_batches: Vec<MicroBatch> = plan
        .micro_batches
        .iter()
        .enumerate()
        .map(|(id, mb)| MicroBatch {
            step: state.version,
            id,
            samples: mb.samples.iter().map(|&i| samples[i]).collect(),
            tokens: mb.tokens,
            cost: mb.cost,
            weighting: state.policy.weighting,
        })
        .collect();
    StepRun {
        queue: WorkQueue::new(plan, live, slots),
        ledger: Ledger::new(micro_batches.len()),
        micro_batches,
        samples,
        reply,
        started: SystemClock.now(),
        replays: 0,
        loss_sum: 0.0,
        trainers: vec![TrainerStepStats::default(); slots],
        log: Vec::new(),
    }
}

/// Which micro-batch idle trainer `slot` takes next, if any: its own list, else a steal
/// (dynamic dispatch) on the measured speeds (`rebalance`) or equal ones.
fn next_micro_batch(state: &mut SupervisorState, slot: usize) -> Option<usize> {
    let run = state.run.as_mut()?;
    if let Some(mb) = run.queue.next_own(slot) {
        return Some(mb);
    }
    if state.policy.dispatch != DispatchMode::Dynamic
        || state.policy.communication != Communication::OnDemand
    {
        return None;
    }
    let measured = state.speeds.speeds();
    let mean = measured.iter().sum::<f64>() / measured.len().max(1) as f64;
    let now = SystemClock.now();
    let outlooks: Vec<Outlook> = state
        .slots
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let speed = if state.policy.rebalance {
                measured.get(i).copied().unwrap_or(mean)
            } else {
                mean
            };
            let busy_for = s.busy_since.map_or(0.0, |(since, cost)| {
                (cost / speed - now.saturating_duration_since(since).as_secs_f64()).max(0.0)
            });
            Outlook {
                live: s.actor.is_some(),
                speed,
                busy_for,
            }
        })
        .collect();
    run.queue.steal(slot, &outlooks).map(|s| s.micro_batch)
}

/// Hand the next micro-batch to every idle live trainer.
fn dispatch(state: &mut SupervisorState) {
    if state.run.is_none() {
        return;
    }
    for slot_index in 0..state.slots.len() {
        if state.slots[slot_index].actor.is_none() || state.slots[slot_index].busy.is_some() {
            continue;
        }
        let Some(mb) = next_micro_batch(state, slot_index) else {
            continue;
        };
        assign(state, slot_index, mb);
    }
}

/// Record and send `mb` to trainer `slot_index`.
fn assign(state: &mut SupervisorState, slot_index: usize, mb: usize) {
    let Some(run) = state.run.as_mut() else {
        return;
    };
    let slot = &mut state.slots[slot_index];
    let Some(actor) = &slot.actor else {
        run.queue.put_back(slot_index, mb);
        return;
    };
    if let Err(e) = run.ledger.assign(mb, slot_index) {
        tracing::error!("ledger refused to assign: {e}");
        return;
    }
    let assignment = Assignment {
        micro_batch: run.micro_batches[mb].clone(),
        epoch: state.epoch,
    };
    match actor.cast(TrainerMsg::Run(assignment)) {
        Ok(()) => {
            slot.busy = Some((state.epoch, mb));
            slot.busy_since = Some((SystemClock.now(), run.micro_batches[mb].cost));
        }
        Err(e) => {
            // The trainer is gone; its supervision event will replan. Keep the work.
            tracing::warn!("trainer {slot_index} unreachable: {e}");
            run.ledger.fail_trainer(slot_index);
            run.queue.put_back(slot_index, mb);
        }
    }
}

async fn on_done(state: &mut SupervisorState, report: TrainerReport) {
    let Some(slot) = state.slots.get_mut(report.trainer) else {
        tracing::warn!("report from unknown trainer {}", report.trainer);
        return;
    };
    if slot.busy == Some((report.epoch, report.micro_batch)) {
        slot.busy = None;
        slot.busy_since = None;
    }
    if report.epoch != state.epoch || state.run.is_none() {
        // A report of a discarded attempt: its gradients were discarded (or refused) at the owners.
        dispatch(state);
        return;
    }
    let trainer = report.trainer;
    let (output, io) = match report.result {
        Ok(ok) => ok,
        Err(source) => {
            let step = state.version;
            let err = Error::MicroBatch {
                step,
                micro_batch: report.micro_batch,
                trainer,
                source: Box::new(source),
            };
            fail_step(state, err).await;
            return;
        }
    };
    let Some(run) = state.run.as_mut() else {
        return;
    };
    if let Err(e) = run.ledger.complete(report.micro_batch, trainer) {
        tracing::error!("ledger refused a completion: {e}");
        dispatch(state);
        return;
    }
    let mb = &run.micro_batches[report.micro_batch];
    let (tokens, cost) = (mb.tokens, mb.cost);
    run.loss_sum += output.loss_sum;
    let busy = report.finished.saturating_duration_since(report.started);
    state.speeds.observe(trainer, cost, busy.as_secs_f64());
    if let Some(t) = run.trainers.get_mut(trainer) {
        t.busy += busy;
        t.pull_wait += io.pull_wait;
        t.micro_batches += 1;
        t.peak_gathered = t.peak_gathered.max(io.peak_gathered);
        t.bytes_pulled += io.bytes_pulled;
        t.bytes_pushed += io.bytes_pushed;
    }
    run.log.push(MicroBatchRecord {
        micro_batch: report.micro_batch,
        trainer,
        started: report.started,
        finished: report.finished,
        tokens,
        cost,
        spans: io.spans,
    });
    metrics::counter!(m::MICRO_BATCHES, "trainer" => trainer.to_string()).increment(1);
    if run.ledger.is_complete() {
        let result = barrier(state).await;
        if let Some(run) = state.run.take() {
            let _ = run.reply.send(result);
        }
    } else {
        dispatch(state);
    }
}

/// Discard the current attempt at every owner, moving every accumulator to a new epoch.
async fn discard(state: &mut SupervisorState) -> Result<()> {
    let next_epoch = state.epoch + 1;
    let calls = state.servers.iter().map(|s| {
        call(
            s,
            |reply| ServerMsg::Discard { next_epoch, reply },
            "shard server discard",
        )
    });
    if let Some(group) = &state.collective {
        group.abort_before(next_epoch);
    }
    let results = join_all(calls).await;
    state.epoch = next_epoch;
    results.into_iter().collect::<Result<Vec<()>>>().map(|_| ())
}

async fn fail_step(state: &mut SupervisorState, err: Error) {
    let discarded = discard(state).await;
    if let Some(run) = state.run.take() {
        let _ = run.reply.send(Err(match discarded {
            Ok(()) => err,
            Err(d) => d,
        }));
    }
}

/// The one synchronisation of a minibatch: reduce (take accumulators, scale, norm), clip, apply,
/// publish v+1.
async fn barrier(state: &mut SupervisorState) -> Result<StepStats> {
    let Some(run) = state.run.as_ref() else {
        return Err(Error::Busy);
    };
    let weighting = state.policy.weighting;
    let total_weight: f64 = run.samples.iter().map(|s| weighting.weight(s)).sum();
    let scale = if total_weight > 0.0 {
        1.0 / total_weight
    } else {
        0.0
    };
    let next_epoch = state.epoch + 1;
    let reduces = state.servers.iter().map(|s| {
        call(
            s,
            |reply| ServerMsg::Reduce {
                scale,
                next_epoch,
                reply,
            },
            "shard server reduce",
        )
    });
    let sums = join_all(reduces).await;
    state.epoch = next_epoch;
    let sum_sq: f64 = sums.into_iter().collect::<Result<Vec<f64>>>()?.iter().sum();
    let grad_norm = sum_sq.sqrt();
    let clip = match state.policy.clip_norm {
        Some(max) if grad_norm > max => max / (grad_norm + 1e-6),
        _ => 1.0,
    };
    let version = state.version + 1;
    let applies = state.servers.iter().map(|s| {
        call(
            s,
            |reply| ServerMsg::Apply {
                clip,
                version,
                reply,
            },
            "shard server apply",
        )
    });
    for r in join_all(applies).await {
        r??;
    }
    state.version = version;
    let Some(run) = state.run.as_mut() else {
        return Err(Error::Busy);
    };
    let ended = SystemClock.now();
    let wall = ended.saturating_duration_since(run.started);
    for (i, t) in run.trainers.iter_mut().enumerate() {
        t.idle = wall.saturating_sub(t.busy);
        let last = run
            .log
            .iter()
            .filter(|r| r.trainer == i)
            .map(|r| r.finished)
            .max()
            .unwrap_or(run.started);
        t.barrier_wait = ended.saturating_duration_since(last);
        let label = i.to_string();
        metrics::gauge!(m::TRAINER_BUSY, "trainer" => label.clone())
            .increment(t.busy.as_secs_f64());
        metrics::gauge!(m::TRAINER_IDLE, "trainer" => label.clone())
            .increment(t.idle.as_secs_f64());
        metrics::gauge!(m::TRAINER_BARRIER_WAIT, "trainer" => label.clone())
            .increment(t.barrier_wait.as_secs_f64());
        metrics::gauge!(m::TRAINER_PULL_WAIT, "trainer" => label)
            .increment(t.pull_wait.as_secs_f64());
    }
    let tokens: u64 = run.samples.iter().map(|s| s.tokens).sum();
    let loss = if total_weight > 0.0 {
        run.loss_sum / total_weight
    } else {
        0.0
    };
    metrics::counter!(m::TOKENS).increment(tokens);
    metrics::gauge!(m::STEP).set(version as f64);
    metrics::gauge!(m::LOSS).set(loss);
    metrics::histogram!(m::STEP_SECONDS).record(wall.as_secs_f64());
    Ok(StepStats {
        step: version - 1,
        loss,
        tokens,
        samples: run.samples.len(),
        micro_batches: run.micro_batches.len(),
        grad_norm,
        replays: run.replays,
        started: run.started,
        wall,
        trainers: std::mem::take(&mut run.trainers),
        micro_batch_log: std::mem::take(&mut run.log),
    })
}

async fn on_child_exit(
    state: &mut SupervisorState,
    myself: &ActorRef<SupervisorMsg>,
    cell: ActorCell,
    reason: String,
) -> std::result::Result<(), ActorProcessingErr> {
    let id = cell.get_id();
    let Some(slot_index) = state
        .slots
        .iter()
        .position(|s| s.actor.as_ref().map(|a| a.get_id()) == Some(id))
    else {
        if state.servers.iter().any(|s| s.get_id() == id) {
            let err = Error::Actor {
                actor: "shard server".into(),
                reason,
            };
            if let Some(run) = state.run.take() {
                let _ = run.reply.send(Err(err));
            }
            myself.stop(Some("a shard server failed".into()));
        }
        return Ok(());
    };
    tracing::warn!("trainer {slot_index} failed: {reason}");
    metrics::counter!(m::TRAINER_FAILURES).increment(1);
    let slot = &mut state.slots[slot_index];
    slot.actor = None;
    slot.busy = None;
    slot.busy_since = None;
    state.speeds.reset(slot_index);
    if let FailurePolicy::Respawn { max_respawns } = state.policy.failure {
        if slot.respawns < max_respawns {
            slot.respawns += 1;
            let actor = spawn_trainer(state, myself, slot_index).await?;
            state.slots[slot_index].actor = Some(actor);
        }
    }
    if state.run.is_none() {
        return Ok(());
    }
    // Replay: discard the attempt at every owner, then plan the minibatch again.
    if let Err(e) = discard(state).await {
        fail_step(state, e).await;
        return Ok(());
    }
    metrics::counter!(m::REPLAYS).increment(1);
    let Some(run) = state.run.take() else {
        return Ok(());
    };
    let replays = run.replays + 1;
    if replays > state.policy.max_replays {
        let _ = run.reply.send(Err(Error::TooManyReplays {
            step: state.version,
            replays: run.replays,
        }));
        return Ok(());
    }
    match plan(state, &run.samples) {
        Ok((plan, live)) => {
            let slots = state.slots.len();
            let started = run.started;
            let mut fresh = new_run(state, run.samples, &plan, &live, run.reply, slots);
            fresh.replays = replays;
            fresh.started = started;
            state.run = Some(fresh);
            dispatch(state);
        }
        Err(e) => {
            let _ = run.reply.send(Err(e));
        }
    }
    Ok(())
}

async fn parameters(state: &SupervisorState) -> Result<Vec<Vec<f32>>> {
    let mut units: Vec<Vec<f32>> = state
        .layout
        .units()
        .iter()
        .map(|u| vec![0.0; u.len])
        .collect();
    for server in &state.servers {
        for (unit, range, values) in call(server, ServerMsg::Parameters, "shard server").await? {
            if let Some(dst) = units.get_mut(unit).and_then(|u| u.get_mut(range)) {
                dst.copy_from_slice(&values);
            }
        }
    }
    Ok(units)
}
