//! The supervisor actor: a thin shell around [`StepMachine`]. It spawns the shard servers and
//! trainers (linked), translates every message and supervision event into a machine event with
//! `now` from its clock, and executes the [`Decision`]s that come back:
//! - `Assign`: `cast` to the trainer; a failed cast is a lost trainer;
//! - `Reduce` / `Apply` / `Discard`: the calls to every server run in a **spawned task** that sends
//!   the outcome back as a message, so the mailbox keeps serving reports, failures and ticks
//!   during the barrier (`Discard` first aborts the attempt's collectives);
//! - `Respawn`: spawn a trainer in the slot (awaited), `Kill`: kill and forget it;
//! - `Finish` / `Reject`: answer the step's caller; `Stop`: stop (children stop with it).
//!
//! A periodic [`SupervisorMsg::Tick`] (every [`StepMachine::tick_period`]) drives the deadlines.
//! The machine documents the invariants (I1, I2, I4, I6); this actor adds none of its own.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use odc_transport::{Dtype, Transport};
use ractor::concurrency::JoinHandle;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};

use crate::collective::CollectiveGroup;
use crate::compute::{SampleMeta, SharedComputeFactory};
use crate::context::{ContextConfig, TrainerContext};
use crate::directory::Directory;
use crate::error::{Error, Result};
use crate::layout::ModelLayout;
use crate::metrics as m;
use crate::optimizer::OptimizerConfig;
use crate::policy::clock::{Clock, SystemClock};
use crate::policy::dispatch::Communication;
use crate::policy::stats::StepStats;
use crate::policy::step::{Command, Decision, Reason, StepConfig, StepMachine};
use crate::server::{ServerArgs, ServerMsg, ShardServer};
use crate::trainer::{Trainer, TrainerArgs, TrainerMsg, TrainerReport};

/// Timeout of control calls to shard servers.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

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
    /// Periodic: time passed (deadlines).
    Tick,
    /// The outcome of server calls the supervisor started (sent by its own task).
    Servers(ServerOutcome),
}

/// Outcome of a barrier or discard call to every server.
pub enum ServerOutcome {
    /// Sum over servers of their sums of squares.
    Reduced(Result<f64>),
    Applied(Result<()>),
    Discarded(Result<()>),
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
    pub step: StepConfig,
}

/// State of the supervisor.
pub struct SupervisorState {
    layout: Arc<ModelLayout>,
    transport: Arc<dyn Transport>,
    compute: SharedComputeFactory,
    context: ContextConfig,
    directory: Arc<Directory>,
    collective: Option<Arc<CollectiveGroup>>,
    servers: Vec<ActorRef<ServerMsg>>,
    /// The trainer actor of every slot (`None`: lost, killed or not respawned).
    trainers: Vec<Option<ActorRef<TrainerMsg>>>,
    machine: StepMachine,
    clock: SystemClock,
    /// The caller of the running step.
    pending: Option<RpcReplyPort<Result<StepStats>>>,
    ticker: Option<JoinHandle<()>>,
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
        let trainers = u32::try_from(args.trainers)
            .map_err(|_| Error::Config(format!("{} trainers: too many", args.trainers)))?;
        args.optimizer.validate().map_err(Error::from)?;
        args.step.cost.validate().map_err(Error::from)?;
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
        for (endpoint, server) in servers.iter().enumerate() {
            let what = format!("shard server {endpoint} routes");
            let routes = call(server, ServerMsg::Routes, &what).await?;
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
            directory: Arc::new(directory),
            collective: (args.step.communication == Communication::Collective)
                .then(|| Arc::new(CollectiveGroup::new(args.trainers))),
            servers,
            trainers: Vec::new(),
            machine: StepMachine::new(args.step, trainers),
            clock: SystemClock,
            pending: None,
            ticker: None,
        };
        for slot in 0..args.trainers {
            let actor = spawn_trainer(&state, &myself, slot).await?;
            state.trainers.push(Some(actor));
        }
        let period = state.machine.tick_period();
        state.ticker = Some(myself.send_interval(period, || SupervisorMsg::Tick));
        Ok(state)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut SupervisorState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        if let Some(ticker) = state.ticker.take() {
            ticker.abort();
        }
        for actor in state.trainers.iter().flatten() {
            actor.stop(None);
        }
        for server in &state.servers {
            server.stop(None);
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let now = state.clock.now();
        let (decisions, request) = match msg {
            SupervisorMsg::Step { samples, reply } => {
                (state.machine.start(samples, now), Some(reply))
            }
            SupervisorMsg::Done(report) => {
                if report.result.is_ok() {
                    metrics::counter!(m::MICRO_BATCHES, "trainer" => report.trainer.to_string())
                        .increment(1);
                }
                (state.machine.on_report(report, now), None)
            }
            SupervisorMsg::Parameters(reply) => {
                let _ = reply.send(parameters(state).await);
                return Ok(());
            }
            SupervisorMsg::Tick => (state.machine.on_tick(now), None),
            SupervisorMsg::Servers(ServerOutcome::Reduced(r)) => {
                (state.machine.on_reduced(r, now), None)
            }
            SupervisorMsg::Servers(ServerOutcome::Applied(r)) => {
                (state.machine.on_applied(r, now), None)
            }
            SupervisorMsg::Servers(ServerOutcome::Discarded(r)) => {
                (state.machine.on_discarded(r, now), None)
            }
        };
        execute(state, &myself, decisions, request).await;
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
        let decisions = on_child_exit(state, cell, reason);
        execute(state, &myself, decisions, None).await;
        Ok(())
    }
}

/// Machine events for a child that exited: a trainer still in its slot is lost, a server lost.
/// Children the supervisor killed and forgot are ignored.
fn on_child_exit(state: &mut SupervisorState, cell: ActorCell, reason: String) -> Vec<Decision> {
    let id = cell.get_id();
    let now = state.clock.now();
    let slot = state
        .trainers
        .iter()
        .position(|t| t.as_ref().map(|a| a.get_id()) == Some(id));
    if let Some(slot) = slot {
        tracing::warn!("trainer {slot} failed: {reason}");
        state.trainers[slot] = None;
        metrics::counter!(m::TRAINER_FAILURES).increment(1);
        return state.machine.on_trainer_lost(slot as u32, reason, now);
    }
    match state.servers.iter().position(|s| s.get_id() == id) {
        Some(endpoint) => {
            tracing::error!("shard server {endpoint} failed: {reason}");
            state.machine.on_server_lost(endpoint as u32, reason, now)
        }
        None => Vec::new(),
    }
}

/// Execute `decisions` in order; a decision's immediate consequences (a failed cast, a respawn)
/// are executed before the next one. `request` is the caller of a `Step` just started: answered
/// by `Reject` or an immediate `Finish`, else it becomes the running step's caller.
async fn execute(
    state: &mut SupervisorState,
    myself: &ActorRef<SupervisorMsg>,
    decisions: Vec<Decision>,
    mut request: Option<RpcReplyPort<Result<StepStats>>>,
) {
    let mut queue: VecDeque<Decision> = decisions.into();
    while let Some(Decision { command, reason }) = queue.pop_front() {
        tracing::debug!(command = command.name(), %reason, "supervisor decision");
        let follow = match command {
            Command::Assign { slot, assignment } => {
                let sent = match state.trainers.get(slot as usize).and_then(Option::as_ref) {
                    Some(actor) => actor
                        .cast(TrainerMsg::Run(assignment))
                        .map_err(|e| e.to_string()),
                    None => Err("no trainer in the slot".into()),
                };
                match sent {
                    Ok(()) => Vec::new(),
                    Err(e) => {
                        tracing::warn!("trainer {slot} unreachable: {e}");
                        if let Some(t) = state.trainers.get_mut(slot as usize) {
                            *t = None;
                        }
                        metrics::counter!(m::TRAINER_FAILURES).increment(1);
                        let now = state.clock.now();
                        state.machine.on_trainer_lost(slot, e, now)
                    }
                }
            }
            Command::Reduce { scale, next_epoch } => {
                let calls = each_server(state, "reduce", move |reply| ServerMsg::Reduce {
                    scale,
                    next_epoch,
                    reply,
                });
                report_back(myself, async move {
                    let sums = join_all(calls)
                        .await
                        .into_iter()
                        .collect::<Result<Vec<f64>>>();
                    ServerOutcome::Reduced(sums.map(|s| s.iter().sum()))
                });
                Vec::new()
            }
            Command::Apply { clip, version } => {
                let calls = each_server(state, "apply", move |reply| ServerMsg::Apply {
                    clip,
                    version,
                    reply,
                });
                report_back(myself, async move {
                    let mut outcome = Ok(());
                    for r in join_all(calls).await {
                        if let Err(e) = r.and_then(|applied| applied) {
                            outcome = outcome.and(Err(e));
                        }
                    }
                    ServerOutcome::Applied(outcome)
                });
                Vec::new()
            }
            Command::Discard { next_epoch } => {
                if matches!(reason, Reason::TrainerLost { .. }) {
                    metrics::counter!(m::REPLAYS).increment(1);
                }
                if let Some(group) = &state.collective {
                    group.abort_before(next_epoch);
                }
                let calls = each_server(state, "discard", move |reply| ServerMsg::Discard {
                    next_epoch,
                    reply,
                });
                report_back(myself, async move {
                    let done = join_all(calls)
                        .await
                        .into_iter()
                        .collect::<Result<Vec<()>>>();
                    ServerOutcome::Discarded(done.map(|_| ()))
                });
                Vec::new()
            }
            Command::Respawn { slot } => {
                let spawned = spawn_trainer(state, myself, slot as usize).await;
                let now = state.clock.now();
                match spawned {
                    Ok(actor) => {
                        if let Some(t) = state.trainers.get_mut(slot as usize) {
                            *t = Some(actor);
                        }
                        state.machine.on_trainer_started(slot, now)
                    }
                    Err(e) => {
                        let why = format!("respawn failed: {e}");
                        state.machine.on_trainer_lost(slot, why, now)
                    }
                }
            }
            Command::Kill { slot } => {
                if let Some(actor) = state.trainers.get_mut(slot as usize).and_then(Option::take) {
                    tracing::warn!("killing trainer {slot}: {reason}");
                    metrics::counter!(m::TRAINER_FAILURES).increment(1);
                    actor.kill();
                }
                Vec::new()
            }
            Command::Finish(result) => {
                if let Ok(stats) = &result {
                    record_step(stats);
                }
                if let Some(reply) = state.pending.take().or_else(|| request.take()) {
                    let _ = reply.send(result);
                }
                Vec::new()
            }
            Command::Reject(e) => {
                if let Some(reply) = request.take() {
                    let _ = reply.send(Err(e));
                }
                Vec::new()
            }
            Command::Stop(e) => {
                myself.stop(Some(e.to_string()));
                Vec::new()
            }
        };
        for d in follow.into_iter().rev() {
            queue.push_front(d);
        }
    }
    if let Some(reply) = request {
        state.pending = Some(reply);
    }
}

/// One call future per server, each with [`CALL_TIMEOUT`] and naming its server on failure.
fn each_server<T: Send + 'static>(
    state: &SupervisorState,
    what: &'static str,
    msg: impl Fn(RpcReplyPort<T>) -> ServerMsg + Clone + Send + 'static,
) -> Vec<impl std::future::Future<Output = Result<T>> + Send + 'static> {
    state
        .servers
        .iter()
        .enumerate()
        .map(|(endpoint, server)| {
            let (server, msg) = (server.clone(), msg.clone());
            async move { call(&server, msg, &format!("shard server {endpoint} {what}")).await }
        })
        .collect()
}

/// Run `work` in a task and send its outcome to the supervisor (dropped if it stopped).
fn report_back(
    myself: &ActorRef<SupervisorMsg>,
    work: impl std::future::Future<Output = ServerOutcome> + Send + 'static,
) {
    let myself = myself.clone();
    tokio::spawn(async move {
        let outcome = work.await;
        let _ = myself.cast(SupervisorMsg::Servers(outcome));
    });
}

/// Step metrics from a finished step's stats.
fn record_step(stats: &StepStats) {
    for (i, t) in stats.trainers.iter().enumerate() {
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
    metrics::counter!(m::TOKENS).increment(stats.tokens);
    metrics::gauge!(m::STEP).set((stats.step + 1) as f64);
    metrics::gauge!(m::LOSS).set(stats.loss);
    metrics::histogram!(m::STEP_SECONDS).record(stats.wall.as_secs_f64());
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
