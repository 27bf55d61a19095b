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
//! - `Ignore` (a refused report): log it once, count it in `odc_refused_reports_total`.
//!
//! A periodic [`SupervisorMsg::Tick`] (every [`StepMachine::tick_period`]) drives the deadlines.
//! The machine documents the invariants (I1, I2, I4, I6); this actor adds none of its own.
//!
//! When it starts, the supervisor draws the job's token key ([`JobKey`], 32 bytes from the
//! thread's cryptographic generator, seeded by the OS): the machine signs assignments with it and
//! every shard server gets it in its [`ServerSpec`] to check gradient writes. Trainers never get
//! it. A trainer's metrics are recorded from its report only once the machine admitted it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use ractor::concurrency::JoinHandle;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};

use odc_transport::RegionHandle;

use crate::directory::Directory;
use crate::error::{Error, Result};
use crate::layout::UnitId;
use crate::metrics::{self as m, TrainerMetrics};
use crate::node::Node;
use crate::policy::clock::Clock;
use crate::policy::dispatch::Communication;
use crate::policy::relay::RelayPlan;
use crate::policy::stats::StepStats;
use crate::policy::step::StepError;
use crate::policy::step::{self, Reason};
use crate::policy::token::JobKey;
use crate::server::messages::{
    ApplyCmd, DiscardCmd, ExpectRelaysCmd, FlushCmd, OpenRelaysCmd, ReduceCmd, ServerMsg,
    ServerSpec,
};
use crate::server::{ServerArgs, ShardServer};
use crate::supervisor::messages::{ServerOutcome, SupervisorMsg, SupervisorSpec};
use crate::trainer::messages::{Assignment, TrainerMsg, TrainerSpec};
use crate::trainer::{Trainer, TrainerArgs};

use super::placement::{Child, RankPlacement, Remote};

/// The step machine, its decisions and their commands, failing steps with the runtime's [`Error`].
type StepMachine = step::StepMachine<Error>;
type Decision = step::Decision<Error>;
type Command = step::Command<Error>;

/// Timeout of control calls to shard servers.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest a server may take to write its shards of a checkpoint (`ShardsWritten`).
const WRITE_TIMEOUT: Duration = Duration::from_secs(3600);

/// How to start the supervisor (it spawns the servers and trainers, linked): the job's
/// serializable spec and this process's resources.
pub struct SupervisorArgs {
    pub spec: SupervisorSpec,
    pub node: Arc<Node>,
    /// Where the children live in a multi-process job (`None`: all in this process, linked).
    pub placement: Option<RankPlacement>,
}

/// State of the supervisor.
pub struct SupervisorState {
    spec: SupervisorSpec,
    node: Arc<Node>,
    directory: Directory,
    /// The directories trainers push by, one per node (relayed pushes; without them, one for
    /// all), shared: [`directory_of`].
    trainer_directories: HashMap<u32, Arc<Directory>>,
    /// Every relay's handle by (relay server, unit, owner) (relayed pushes only).
    relays: HashMap<(u32, UnitId, u32), RegionHandle>,
    servers: Vec<ActorRef<ServerMsg>>,
    /// The trainer actor of every slot (`None`: lost, killed or not respawned).
    trainers: Vec<Option<ActorRef<TrainerMsg>>>,
    /// Cached metric handles of every slot.
    metrics: Vec<TrainerMetrics>,
    machine: StepMachine,
    clock: Arc<dyn Clock>,
    /// The caller of the running step.
    pending: Option<RpcReplyPort<Result<StepStats>>>,
    ticker: Option<JoinHandle<()>>,
    /// Children in other processes (multi-process job).
    remote: Option<Remote>,
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
        let SupervisorArgs {
            spec,
            node,
            placement,
        } = args;
        spec.validate()?;
        if spec.step.communication == Communication::Collective {
            match &node.collective {
                Some(group) if group.size() == spec.trainers => {}
                _ => {
                    return Err(Error::Config(format!(
                        "collective mode needs a collective group of {} trainers",
                        spec.trainers
                    ))
                    .into())
                }
            }
        }
        note_parameters(&node.layout);
        let mut remote = placement.map(|p| Remote::new(p, &myself.get_cell()));
        let key = JobKey::from_bytes(rand::random());
        let mut servers = Vec::new();
        for endpoint in 0..spec.servers {
            let server_spec = ServerSpec {
                endpoint,
                servers: spec.servers,
                optimizer: spec.optimizer,
                pull_dtype: spec.pull_dtype,
                epoch: 0,
                key,
            };
            let server = match remote.as_mut() {
                Some(remote) => remote.spawn_server(&myself.get_cell(), server_spec).await?,
                None => {
                    let server_args = ServerArgs {
                        spec: server_spec,
                        node: node.clone(),
                    };
                    Actor::spawn_linked(None, ShardServer, server_args, myself.get_cell())
                        .await?
                        .0
                }
            };
            servers.push(server);
        }
        let mut routes = Vec::new();
        for (endpoint, server) in servers.iter().enumerate() {
            let what = format!("shard server {endpoint} routes");
            routes.extend(call(server, ServerMsg::Routes, &what).await?);
        }
        let directory = Directory::from_routes(node.layout.len(), routes)?;
        let relays = match &spec.relay {
            Some(plan) => open_relays(plan, &directory, &servers, spec.context.chunk_elems).await?,
            None => HashMap::new(),
        };
        let clock = node.clock.clone();
        let mut state = SupervisorState {
            machine: StepMachine::new(spec.step, spec.trainers, key).with_relay(spec.relay.clone()),
            metrics: (0..spec.trainers).map(TrainerMetrics::new).collect(),
            spec,
            node,
            directory,
            trainer_directories: HashMap::new(),
            relays,
            servers,
            trainers: Vec::new(),
            clock,
            pending: None,
            ticker: None,
            remote,
        };
        for slot in 0..state.spec.trainers {
            let actor = spawn_trainer(&mut state, &myself, slot).await?;
            state.trainers.push(Some(actor));
        }
        let period = state.machine.tick_period();
        state.ticker = Some(myself.send_interval(period, || SupervisorMsg::Tick));
        Ok(state)
    }

    async fn post_stop(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut SupervisorState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        if let Some(ticker) = state.ticker.take() {
            ticker.abort();
        }
        if let Some(remote) = state.remote.as_mut() {
            remote.stop_all(&myself.get_cell());
            return Ok(());
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
            SupervisorMsg::Step(samples, reply) => (state.machine.start(samples, now), Some(reply)),
            SupervisorMsg::Done(report) => {
                let slot = report.trainer as usize;
                let busy = report.finished.saturating_duration_since(report.started);
                let pull_wait = report.result.as_ref().ok().map(|d| d.stats.pull_wait);
                let decisions = state.machine.on_report(report, now);
                let admitted = !decisions
                    .iter()
                    .any(|d| matches!(d.command, Command::Ignore));
                if let (true, Some(pull_wait), Some(metrics)) =
                    (admitted, pull_wait, state.metrics.get(slot))
                {
                    metrics.micro_batches.increment(1);
                    metrics.busy.record(busy.as_secs_f64());
                    metrics.pull_wait.record(pull_wait.as_secs_f64());
                }
                (decisions, None)
            }
            SupervisorMsg::Parameters(cmd, reply) => {
                snapshots(state, cmd, reply);
                return Ok(());
            }
            SupervisorMsg::Published(reply) => {
                let published = match state.machine.is_running() {
                    true => Err(Error::Step(StepError::Busy)),
                    false => Ok(crate::datapath::Published {
                        version: state.machine.version(),
                        directory: published_directory(state),
                    }),
                };
                let _ = reply.send(published);
                return Ok(());
            }
            SupervisorMsg::WriteShards(cmd, reply) => {
                let calls = each_server(state, "write shards", move |reply| {
                    ServerMsg::WriteShards(cmd.clone(), reply)
                });
                tokio::spawn(async move {
                    let _ = reply.send(all_servers(calls).await.map(drop));
                });
                return Ok(());
            }
            SupervisorMsg::ShardsWritten(reply) => {
                let calls = each_server_within(
                    state,
                    "shards written",
                    WRITE_TIMEOUT,
                    ServerMsg::ShardsWritten,
                );
                tokio::spawn(async move {
                    let _ = reply.send(all_servers(calls).await);
                });
                return Ok(());
            }
            SupervisorMsg::PublishShards(cmds, reply) => {
                let calls = cmds
                    .into_iter()
                    .map(|(endpoint, cmd)| {
                        let server = state.servers.get(endpoint as usize).cloned();
                        async move {
                            let server = server.ok_or_else(|| {
                                Error::Config(format!("publish shards: no shard server {endpoint}"))
                            })?;
                            call_within(
                                &server,
                                move |reply| ServerMsg::PublishShards(cmd, reply),
                                &format!("shard server {endpoint} publish shards"),
                                CALL_TIMEOUT,
                            )
                            .await
                        }
                    })
                    .collect();
                tokio::spawn(async move {
                    let _ = reply.send(all_servers(calls).await.map(drop));
                });
                return Ok(());
            }
            SupervisorMsg::Tick => (state.machine.on_tick(now), None),
            SupervisorMsg::Servers(ServerOutcome::Flushed(r)) => {
                (state.machine.on_flushed(r, now), None)
            }
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
        let (child, reason) = match event {
            SupervisionEvent::ActorFailed(cell, err) => {
                (local_child(state, &cell), err.to_string())
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => (
                local_child(state, &cell),
                reason.unwrap_or_else(|| "stopped".into()),
            ),
            SupervisionEvent::ProcessGroupChanged(ractor::pg::GroupChangeMessage::Leave(
                _,
                group,
                _,
            )) => {
                let child = state
                    .remote
                    .as_mut()
                    .and_then(|r| r.left(&myself.get_cell(), &group));
                (child, left_reason(state, child))
            }
            _ => return Ok(()),
        };
        let decisions = match child {
            Some(child) => on_child_exit(state, child, reason),
            None => Vec::new(),
        };
        execute(state, &myself, decisions, None).await;
        Ok(())
    }
}

/// Which child (in this process) `cell` is; `None` for children killed and forgotten.
fn local_child(state: &SupervisorState, cell: &ActorCell) -> Option<Child> {
    let id = cell.get_id();
    if let Some(slot) = state
        .trainers
        .iter()
        .position(|t| t.as_ref().map(|a| a.get_id()) == Some(id))
    {
        return Some(Child::Trainer(slot as u32));
    }
    state
        .servers
        .iter()
        .position(|s| s.get_id() == id)
        .map(|e| Child::Server(e as u32))
}

/// The model's trainable and frozen parameters: a gauge each, and one log line when some are
/// frozen.
fn note_parameters(layout: &crate::layout::ModelLayout) {
    let (trainable, frozen) = (layout.trainable_elements(), layout.frozen_elements());
    metrics::gauge!(m::PARAMETERS, "kind" => "trainable").set(trainable as f64);
    metrics::gauge!(m::PARAMETERS, "kind" => "frozen").set(frozen as f64);
    if frozen > 0 {
        let units = layout.units().iter().filter(|u| !u.trainable).count();
        tracing::info!(
            "{trainable} trainable parameters; {frozen} frozen in {units} units (pulled, never \
             pushed or optimised)"
        );
    }
}

/// Why a child in another process is gone: its rank, and for a server the shard lost with it.
fn left_reason(state: &SupervisorState, child: Option<Child>) -> String {
    let Some(remote) = state.remote.as_ref() else {
        return String::new();
    };
    match child {
        Some(Child::Trainer(slot)) => format!(
            "rank {} left the job (its process exited, stopped answering heartbeats or its \
             connection closed)",
            remote.trainer_rank(slot).unwrap_or(u32::MAX)
        ),
        Some(Child::Server(endpoint)) => {
            let servers = state.spec.servers as usize;
            let units = state.node.layout.units();
            let lost: usize = units
                .iter()
                .map(|u| crate::layout::shard_range(u.len, servers, endpoint as usize).len())
                .sum();
            format!(
                "rank {} left the job (its process exited, stopped answering heartbeats or its \
                 connection closed), and with it shard {endpoint} of every unit: {lost} of the \
                 model's {} parameters, in {} units, are lost (restart the job from its newest \
                 checkpoint: odc launch --max-restarts)",
                remote.server_rank(endpoint).unwrap_or(u32::MAX),
                state.node.layout.total_elements(),
                units.len()
            )
        }
        None => String::new(),
    }
}

/// Machine events for a child that exited: a trainer still in its slot is lost, a server lost.
fn on_child_exit(state: &mut SupervisorState, child: Child, reason: String) -> Vec<Decision> {
    let now = state.clock.now();
    match child {
        Child::Trainer(slot) => {
            if state
                .trainers
                .get(slot as usize)
                .is_none_or(Option::is_none)
            {
                return Vec::new();
            }
            tracing::warn!("trainer {slot} failed: {reason}");
            state.trainers[slot as usize] = None;
            metrics::counter!(m::TRAINER_FAILURES).increment(1);
            state.machine.on_trainer_lost(slot, reason, now)
        }
        Child::Server(endpoint) => {
            tracing::error!("shard server {endpoint} failed: {reason}");
            state.machine.on_server_lost(endpoint, reason, now)
        }
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
            Command::Assign { slot, assignment } => assign(state, slot, assignment),
            Command::ExpectRelays { epoch, per_node } => {
                expect_relays(state, epoch, &per_node);
                Vec::new()
            }
            Command::Flush { epoch, next_epoch } => flush(state, myself, epoch, next_epoch),
            Command::Reduce { scale, next_epoch } => {
                let cmd = ReduceCmd { scale, next_epoch };
                let calls =
                    each_server(state, "reduce", move |reply| ServerMsg::Reduce(cmd, reply));
                report_back(myself, async move {
                    let acks = all_servers(calls).await;
                    ServerOutcome::Reduced(acks.map(|acks| acks.iter().map(|a| a.sum_sq).sum()))
                });
                Vec::new()
            }
            Command::Apply {
                clip,
                lr_scale,
                version,
            } => {
                let cmd = ApplyCmd {
                    clip,
                    lr_scale,
                    version,
                };
                let calls = each_server(state, "apply", move |reply| ServerMsg::Apply(cmd, reply));
                report_back(myself, async move {
                    ServerOutcome::Applied(all_servers(calls).await.map(|_| ()))
                });
                Vec::new()
            }
            Command::Discard { next_epoch } => discard(state, myself, next_epoch, &reason),
            Command::Respawn { slot } => respawn(state, myself, slot).await,
            Command::Kill { slot } => {
                kill(state, myself, slot, &reason);
                Vec::new()
            }
            Command::Finish(result) => {
                finish(state, result, &mut request);
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
            Command::Ignore => {
                tracing::warn!("supervisor: {reason}");
                if let Reason::ReportRefused { why, .. } = &reason {
                    metrics::counter!(m::REFUSED_REPORTS, "reason" => why.label()).increment(1);
                }
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

/// Sends `assignment` to the trainer in `slot`; one that cannot be reached is lost.
fn assign(state: &mut SupervisorState, slot: u32, assignment: Assignment) -> Vec<Decision> {
    let sent = match state.trainers.get(slot as usize).and_then(Option::as_ref) {
        Some(actor) => actor
            .cast(TrainerMsg::Run(assignment))
            .map_err(|e| e.to_string()),
        None => Err("no trainer in the slot".into()),
    };
    let Err(e) = sent else {
        return Vec::new();
    };
    tracing::warn!("trainer {slot} unreachable: {e}");
    if let Some(t) = state.trainers.get_mut(slot as usize) {
        *t = None;
    }
    metrics::counter!(m::TRAINER_FAILURES).increment(1);
    let now = state.clock.now();
    state.machine.on_trainer_lost(slot, e, now)
}

/// Every server flushes its relays into their owners; what they combined comes back as
/// [`ServerOutcome::Flushed`]. A flush moves what a push does: it has the trainers' transfer
/// timeout.
fn flush(
    state: &SupervisorState,
    myself: &ActorRef<SupervisorMsg>,
    epoch: u64,
    next_epoch: u64,
) -> Vec<Decision> {
    let timeout = state.spec.context.transfer_timeout;
    let flush = FlushCmd {
        epoch,
        next_epoch,
        timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
    };
    let within = timeout.saturating_add(CALL_TIMEOUT);
    let calls = each_server_within(state, "relay flush", within, move |reply| {
        ServerMsg::Flush(flush, reply)
    });
    report_back(myself, async move {
        let acks = all_servers(calls).await;
        ServerOutcome::Flushed(acks.map(|acks| acks.into_iter().flat_map(|a| a.combined).collect()))
    });
    Vec::new()
}

/// The attempt's collectives are aborted and every server drops what it accumulated, moving to
/// `next_epoch` (a replay after a lost trainer counts in `odc_replays_total`).
fn discard(
    state: &SupervisorState,
    myself: &ActorRef<SupervisorMsg>,
    next_epoch: u64,
    reason: &Reason,
) -> Vec<Decision> {
    if matches!(reason, Reason::TrainerLost { .. }) {
        metrics::counter!(m::REPLAYS).increment(1);
    }
    if let Some(group) = &state.node.collective {
        group.abort_before(next_epoch);
    }
    if let Some(remote) = &state.remote {
        remote.abort_before(next_epoch);
    }
    let cmd = DiscardCmd { next_epoch };
    let calls = each_server(state, "discard", move |reply| {
        ServerMsg::Discard(cmd, reply)
    });
    report_back(myself, async move {
        ServerOutcome::Discarded(all_servers(calls).await.map(|_| ()))
    });
    Vec::new()
}

/// A new trainer in `slot`; one that cannot be started leaves the slot lost.
async fn respawn(
    state: &mut SupervisorState,
    myself: &ActorRef<SupervisorMsg>,
    slot: u32,
) -> Vec<Decision> {
    let spawned = spawn_trainer(&mut *state, myself, slot).await;
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
            tracing::warn!("trainer {slot}: {why}");
            state.machine.on_trainer_lost(slot, why, now)
        }
    }
}

/// Kills the trainer in `slot` (a hung one), in this process or through its node's host.
fn kill(state: &mut SupervisorState, myself: &ActorRef<SupervisorMsg>, slot: u32, reason: &Reason) {
    let Some(actor) = state.trainers.get_mut(slot as usize).and_then(Option::take) else {
        return;
    };
    tracing::warn!("killing trainer {slot}: {reason}");
    metrics::counter!(m::TRAINER_FAILURES).increment(1);
    match state.remote.as_mut() {
        Some(remote) => remote.kill_trainer(&myself.get_cell(), slot),
        None => actor.kill(),
    }
}

/// The step ended: its metrics, and the answer to its caller (the running step's, else the
/// request just started).
fn finish(
    state: &mut SupervisorState,
    result: Result<StepStats>,
    request: &mut Option<RpcReplyPort<Result<StepStats>>>,
) {
    if let Ok(stats) = &result {
        if let Some(why) = &stats.skipped {
            tracing::warn!("step {} skipped: {why}", stats.step);
        }
        record_step(&state.metrics, stats);
    }
    if let Some(reply) = state.pending.take().or_else(|| request.take()) {
        let _ = reply.send(result);
    }
}

/// One call future per server, each with [`CALL_TIMEOUT`] and naming its server on failure.
fn each_server<T: Send + 'static>(
    state: &SupervisorState,
    what: &'static str,
    msg: impl Fn(RpcReplyPort<T>) -> ServerMsg + Clone + Send + 'static,
) -> Vec<impl std::future::Future<Output = Result<T>> + Send + 'static> {
    each_server_within(state, what, CALL_TIMEOUT, msg)
}

/// [`each_server`] with its own deadline per call.
fn each_server_within<T: Send + 'static>(
    state: &SupervisorState,
    what: &'static str,
    timeout: Duration,
    msg: impl Fn(RpcReplyPort<T>) -> ServerMsg + Clone + Send + 'static,
) -> Vec<impl std::future::Future<Output = Result<T>> + Send + 'static> {
    state
        .servers
        .iter()
        .enumerate()
        .map(|(endpoint, server)| {
            let (server, msg) = (server.clone(), msg.clone());
            async move {
                call_within(
                    &server,
                    msg,
                    &format!("shard server {endpoint} {what}"),
                    timeout,
                )
                .await
            }
        })
        .collect()
}

/// Tell every server how many micro-batches its node runs in `epoch` (`per_node`, by node), so
/// its relays can flush as soon as their writes are in; nothing waits for the answers (a server
/// that cannot flushes at the barrier, as without them).
fn expect_relays(state: &SupervisorState, epoch: u64, per_node: &[u32]) {
    let Some(plan) = &state.spec.relay else {
        return;
    };
    let timeout_ms =
        u64::try_from(state.spec.context.transfer_timeout.as_millis()).unwrap_or(u64::MAX);
    for (endpoint, server) in state.servers.iter().enumerate() {
        let node = plan.server_nodes.get(endpoint).copied().unwrap_or(u32::MAX);
        let cmd = ExpectRelaysCmd {
            epoch,
            micro_batches: per_node.get(node as usize).copied().unwrap_or(0),
            timeout_ms,
        };
        let server = server.clone();
        tokio::spawn(async move {
            let what = format!("shard server {endpoint} expect relays");
            let msg = move |reply| ServerMsg::ExpectRelays(cmd, reply);
            if let Err(e) = call_within(&server, msg, &what, CALL_TIMEOUT)
                .await
                .and_then(|r| r)
            {
                tracing::warn!("{what}: {e} (its relays flush at the barrier)");
            }
        });
    }
}

/// Every server's answer, in server order, or the first error (of the call or of the answer).
async fn all_servers<T>(
    calls: Vec<impl std::future::Future<Output = Result<Result<T>>>>,
) -> Result<Vec<T>> {
    join_all(calls)
        .await
        .into_iter()
        .map(|answer| answer.and_then(|inner| inner))
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

/// Step metrics from a finished step's stats, through the cached per-trainer handles.
fn record_step(metrics: &[TrainerMetrics], stats: &StepStats) {
    let wall = stats.wall.as_secs_f64();
    for (t, handles) in stats.trainers.iter().zip(metrics) {
        handles.idle.record(t.idle.as_secs_f64());
        handles.barrier_wait.record(t.barrier_wait.as_secs_f64());
        if wall > 0.0 {
            handles.tokens_per_second.set(t.tokens as f64 / wall);
            handles.utilization.set(t.busy.as_secs_f64() / wall);
        }
    }
    if stats.skipped.is_some() {
        // Its tokens were not trained on.
        metrics::counter!(m::SKIPPED_STEPS).increment(1);
    } else {
        metrics::counter!(m::TOKENS).increment(stats.tokens);
    }
    if wall > 0.0 {
        metrics::gauge!(m::TOKENS_PER_SECOND).set(stats.tokens as f64 / wall);
    }
    metrics::gauge!(m::STEP).set((stats.step + 1) as f64);
    metrics::gauge!(m::LOSS).set(stats.loss);
    metrics::histogram!(m::STEP_SECONDS).record(wall);
    metrics::counter!(m::SPLIT_SAMPLES).increment(stats.gangs.len() as u64);
    for &members in &stats.gangs {
        metrics::histogram!(m::GANG_SIZE).record(f64::from(members));
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
    call_within(actor, msg, what, CALL_TIMEOUT).await
}

/// [`call`] with its own deadline.
async fn call_within<M, T>(
    actor: &ActorRef<M>,
    msg: impl FnOnce(RpcReplyPort<T>) -> M,
    what: &str,
    timeout: Duration,
) -> Result<T>
where
    M: ractor::Message,
    T: Send + 'static,
{
    match actor.call(msg, Some(timeout)).await {
        Ok(CallResult::Success(v)) => Ok(v),
        Ok(CallResult::Timeout) => Err(Error::Step(StepError::Actor {
            actor: what.into(),
            reason: format!("no reply within {timeout:?}"),
        })),
        Ok(CallResult::SenderError) => Err(Error::Step(StepError::Actor {
            actor: what.into(),
            reason: "dropped the reply".into(),
        })),
        Err(e) => Err(Error::Step(StepError::Actor {
            actor: what.into(),
            reason: e.to_string(),
        })),
    }
}

async fn spawn_trainer(
    state: &mut SupervisorState,
    myself: &ActorRef<SupervisorMsg>,
    rank: u32,
) -> std::result::Result<ActorRef<TrainerMsg>, ActorProcessingErr> {
    let spec = TrainerSpec {
        rank,
        communication: state.spec.step.communication,
        context: state.spec.context,
        directory: directory_of(state, rank),
    };
    if let Some(remote) = state.remote.as_mut() {
        return Ok(remote.spawn_trainer(&myself.get_cell(), spec).await?);
    }
    let args = TrainerArgs {
        spec,
        node: state.node.clone(),
        supervisor: myself.clone(),
    };
    let (actor, _) = Actor::spawn_linked(None, Trainer, args, myself.get_cell()).await?;
    Ok(actor)
}

/// Open every server's relays (`plan.relays_of`, each for every unit's shard of its owners) and
/// key their handles by (relay server, unit, owner).
async fn open_relays(
    plan: &RelayPlan,
    directory: &Directory,
    servers: &[ActorRef<ServerMsg>],
    chunk_elems: u64,
) -> Result<HashMap<(u32, UnitId, u32), RegionHandle>> {
    let mut relays = HashMap::new();
    for (endpoint, server) in (0u32..).zip(servers) {
        let owners = plan.relays_of(endpoint);
        let targets: Vec<_> = directory
            .units
            .iter()
            .flatten()
            .filter(|route| owners.contains(&route.owner))
            .cloned()
            .collect();
        if targets.is_empty() {
            continue;
        }
        let cmd = OpenRelaysCmd {
            targets,
            chunk_elems,
        };
        let what = format!("shard server {endpoint} relays");
        let routes = call(server, |reply| ServerMsg::OpenRelays(cmd, reply), &what).await??;
        for route in routes {
            relays.insert((route.relay, route.unit, route.owner), route.accumulator);
        }
    }
    Ok(relays)
}

/// The directory of the published copies (the shards' own routes, relays aside): the entry
/// [`directory_of`] keeps for trainers without relays, shared.
fn published_directory(state: &mut SupervisorState) -> Arc<Directory> {
    state
        .trainer_directories
        .entry(u32::MAX)
        .or_insert_with(|| Arc::new(state.directory.clone()))
        .clone()
}

/// The directory trainer `slot` pushes by: the owners' accumulators, with every shard whose
/// owner is on another node replaced by its node's relay (relayed pushes), else the job's. Made
/// once per node and shared by its trainers (every trainer's own copy made memory grow with
/// trainers × servers × units: 40% of a 128-device simulation's peak).
fn directory_of(state: &mut SupervisorState, slot: u32) -> Arc<Directory> {
    let node = state
        .spec
        .relay
        .as_ref()
        .and_then(|plan| plan.trainer_node(slot))
        .unwrap_or(u32::MAX);
    if let Some(shared) = state.trainer_directories.get(&node) {
        return shared.clone();
    }
    let mut directory = state.directory.clone();
    if let Some(plan) = state.spec.relay.as_ref().filter(|_| node != u32::MAX) {
        for route in directory.units.iter_mut().flatten() {
            let Some(relay) = plan.relay(node, route.owner) else {
                continue;
            };
            if let Some(handle) = state.relays.get(&(relay, route.unit, route.owner)) {
                route.accumulator = Some(handle.clone());
            }
        }
    }
    let shared = Arc::new(directory);
    state.trainer_directories.insert(node, shared.clone());
    shared
}

/// Ask every server for its fp32 snapshot handles, in a task that answers `reply` directly (the
/// caller reads the values over the data plane).
fn snapshots(
    state: &SupervisorState,
    cmd: crate::server::messages::SnapshotCmd,
    reply: RpcReplyPort<Result<Vec<crate::server::messages::ShardSnapshot>>>,
) {
    let calls = each_server(state, "snapshot", move |reply| {
        ServerMsg::Snapshot(cmd, reply)
    });
    tokio::spawn(async move {
        let all = all_servers(calls).await.map(|lists| lists.concat());
        let _ = reply.send(all);
    });
}
