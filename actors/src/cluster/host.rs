//! The node host: one per process of a multi-process job. It starts shard servers and trainers
//! from serializable specs plus this process's [`Node`] when the supervisor (in rank 0's process)
//! asks, puts each in its own `ractor::pg` group (how the supervisor finds and watches it across
//! processes), and relays the job's progress (step outcomes, all-gathers, shutdown) to the
//! process's `Job` through a channel.
//!
//! A host checks that the coordinator's model is this process's model (layout digest) before it
//! starts anything: ranks that build different models fail at the first spawn with an error naming
//! both digests, not with wrong numbers later.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::mpsc::UnboundedSender;

use super::groups::{host_group, supervisor_group, wait_member};
use super::session::Liveness;
use crate::cluster::messages::{
    Contribution, Gathered, HostMsg, ServerSpawn, StepOutcome, TrainerSpawn, TrainerStarted,
};
use crate::error::{Error, Result};
use crate::node::Node;
use crate::policy::step::StepError;
use crate::server::{ServerArgs, ShardServer};
use crate::supervisor::SupervisorMsg;
use crate::trainer::{Trainer, TrainerArgs};

/// How long a host waits for the supervisor to be visible in its process (it is spawned before
/// any trainer is asked for, and its group reaches every node with the session's next update).
const FIND_SUPERVISOR: Duration = Duration::from_secs(30);

/// What a host tells its process's `Job`.
#[derive(Debug, Clone, PartialEq)]
pub enum HostEvent {
    Step(StepOutcome),
    /// Rank `n` is done with the job (seen by the coordinator's host).
    Leaving(u32),
    /// The coordinator ended the job (`Some(reason)`: it failed).
    Shutdown(Option<String>),
    /// A rank's part of an all-gather (seen by the coordinator's host).
    Contribution(Contribution),
    /// The coordinator's answer to an all-gather (seen by every other host).
    Gathered(Gathered),
}

/// How to start a host.
pub struct HostArgs {
    /// The job's name (prefix of its `pg` groups).
    pub job: String,
    pub rank: u32,
    pub node: Arc<Node>,
    pub events: UnboundedSender<HostEvent>,
    /// Told when the coordinator's heartbeat arrives (`None` on the coordinator itself).
    pub liveness: Option<Liveness>,
}

/// State of a host.
pub struct HostState {
    job: String,
    rank: u32,
    node: Arc<Node>,
    digest: u64,
    events: UnboundedSender<HostEvent>,
    liveness: Option<Liveness>,
    /// The actors this host started, by their group.
    children: HashMap<String, ActorCell>,
}

/// The node host actor (see the [module docs](self)).
pub struct Host;

impl Actor for Host {
    type Msg = HostMsg;
    type State = HostState;
    type Arguments = HostArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<HostMsg>,
        args: HostArgs,
    ) -> std::result::Result<HostState, ActorProcessingErr> {
        ractor::pg::join(host_group(&args.job, args.rank), vec![myself.get_cell()]);
        Ok(HostState {
            job: args.job,
            rank: args.rank,
            digest: args.node.layout.digest(),
            node: args.node,
            events: args.events,
            liveness: args.liveness,
            children: HashMap::new(),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<HostMsg>,
        state: &mut HostState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        stop_children(state);
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<HostMsg>,
        msg: HostMsg,
        state: &mut HostState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        match msg {
            HostMsg::SpawnServer(spawn, reply) => {
                let _ = reply.send(spawn_server(state, &myself, spawn).await);
            }
            HostMsg::SpawnTrainer(spawn, reply) => {
                let _ = reply.send(spawn_trainer(state, &myself, spawn).await);
            }
            HostMsg::Inbox(update, reply) => {
                let registered = match &state.node.collective {
                    Some(group) => group.register(update.rank, update.inbox),
                    None => Err(Error::Config(
                        "a collective inbox was sent to a node without a collective group".into(),
                    )),
                };
                let _ = reply.send(registered);
            }
            HostMsg::Kill(group) => {
                if let Some(child) = state.children.remove(&group) {
                    tracing::debug!("rank {}: killing {group}", state.rank);
                    child.kill();
                }
            }
            HostMsg::Abort(epoch) => {
                if let Some(group) = &state.node.collective {
                    group.abort_before(epoch);
                }
            }
            HostMsg::Step(outcome) => {
                let _ = state.events.send(HostEvent::Step(outcome));
            }
            HostMsg::StepFailed(outcome, reply) => {
                let _ = state.events.send(HostEvent::Step(outcome));
                let _ = reply.send(());
            }
            HostMsg::Leaving(rank) => {
                let _ = state.events.send(HostEvent::Leaving(rank));
            }
            HostMsg::Shutdown(reason) => {
                stop_children(state);
                let _ = state.events.send(HostEvent::Shutdown(reason));
            }
            HostMsg::Contribute(part) => {
                let _ = state.events.send(HostEvent::Contribution(part));
            }
            HostMsg::Gathered(parts) => {
                let _ = state.events.send(HostEvent::Gathered(parts));
            }
            HostMsg::Heartbeat(reply) => {
                if let Some(liveness) = &state.liveness {
                    liveness.coordinator_heard();
                }
                let _ = reply.send(());
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<HostMsg>,
        event: SupervisionEvent,
        state: &mut HostState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let (cell, reason) = match event {
            SupervisionEvent::ActorFailed(cell, err) => (cell, err.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, reason.unwrap_or_else(|| "stopped".into()))
            }
            _ => return Ok(()),
        };
        let id = cell.get_id();
        if let Some(group) = state
            .children
            .iter()
            .find(|(_, c)| c.get_id() == id)
            .map(|(g, _)| g.clone())
        {
            tracing::warn!("rank {}: {group} exited: {reason}", state.rank);
            state.children.remove(&group);
        }
        Ok(())
    }
}

fn stop_children(state: &mut HostState) {
    for (_, child) in state.children.drain() {
        child.stop(None);
    }
}

fn check_layout(state: &HostState, coordinator: u64) -> Result<()> {
    if coordinator == state.digest {
        return Ok(());
    }
    Err(Error::Config(format!(
        "rank {} built a different model than rank 0 (layout digest {:016x}, rank 0 has \
         {coordinator:016x}): every process must build the same units with the same initial values \
         and resume from the same checkpoint step (with per-host checkpoint directories, a host \
         can hold a newer step the lead never published: delete it there)",
        state.rank, state.digest
    )))
}

async fn spawn_server(
    state: &mut HostState,
    myself: &ActorRef<HostMsg>,
    spawn: ServerSpawn,
) -> Result<()> {
    check_layout(state, spawn.layout)?;
    let args = ServerArgs {
        spec: spawn.spec,
        node: state.node.clone(),
    };
    let (server, _) = Actor::spawn_linked(None, ShardServer, args, myself.get_cell())
        .await
        .map_err(|e| {
            Error::Step(StepError::Actor {
                actor: format!(
                    "shard server {} on rank {}",
                    spawn.spec.endpoint, state.rank
                ),
                reason: e.to_string(),
            })
        })?;
    ractor::pg::join(spawn.group.clone(), vec![server.get_cell()]);
    state.children.insert(spawn.group, server.get_cell());
    Ok(())
}

async fn spawn_trainer(
    state: &mut HostState,
    myself: &ActorRef<HostMsg>,
    spawn: TrainerSpawn,
) -> Result<TrainerStarted> {
    check_layout(state, spawn.layout)?;
    let rank = spawn.spec.rank;
    let supervisor = find_supervisor(&state.job, state.rank).await?;
    let args = TrainerArgs {
        spec: spawn.spec,
        node: state.node.clone(),
        supervisor,
    };
    let (trainer, _) = Actor::spawn_linked(None, Trainer, args, myself.get_cell())
        .await
        .map_err(|e| {
            Error::Step(StepError::Actor {
                actor: format!("trainer {rank} on rank {}", state.rank),
                reason: e.to_string(),
            })
        })?;
    ractor::pg::join(spawn.group.clone(), vec![trainer.get_cell()]);
    state.children.insert(spawn.group, trainer.get_cell());
    let inbox = state
        .node
        .collective
        .as_ref()
        .and_then(|group| group.inbox(rank).ok());
    Ok(TrainerStarted { inbox })
}

/// The supervisor, once its group is visible here (bounded by [`FIND_SUPERVISOR`]).
async fn find_supervisor(job: &str, rank: u32) -> Result<ActorRef<SupervisorMsg>> {
    let cell = wait_member(&supervisor_group(job), FIND_SUPERVISOR)
        .await
        .ok_or_else(|| {
            Error::Step(StepError::Actor {
                actor: format!("node host of rank {rank}"),
                reason: format!("the supervisor was not visible within {FIND_SUPERVISOR:?}"),
            })
        })?;
    Ok(ActorRef::from(cell))
}
