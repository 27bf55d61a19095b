//! Children in other processes: in a multi-process job the supervisor (on rank 0) starts every
//! shard server and trainer through the [`Host`](crate::cluster::Host) of the rank the job's
//! roles place it on, finds it by its `ractor::pg` group (one group per spawn, so a respawned
//! trainer is never confused with the one it replaces) and watches it with `pg::monitor`: an actor
//! that stops, or whose process dies or loses its connection, leaves its group, and the
//! supervisor gets the `Leave` within milliseconds (a closed session) — the same events a linked
//! child gives in one process. A hung process is caught by the deadlines instead (micro-batch
//! deadline, call timeouts; I6).
//!
//! Every call here is bounded by the spawn timeout.

use std::collections::HashMap;
use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{ActorCell, ActorRef, RpcReplyPort};

use crate::cluster::messages::{HostMsg, InboxUpdate, ServerSpawn, TrainerSpawn, TrainerStarted};
use crate::cluster::{supervisor_group, wait_member};
use crate::error::{Error, Result};
use crate::policy::step::StepError;
use crate::server::messages::{ServerMsg, ServerSpec};
use crate::trainer::messages::{TrainerMsg, TrainerSpec};

/// Where a multi-process job's actors live.
#[derive(Debug, Clone)]
pub struct RankPlacement {
    /// The job's name (prefix of its `pg` groups).
    pub job: String,
    /// Every rank's host, by rank.
    pub hosts: Vec<ActorRef<HostMsg>>,
    /// The rank of each shard server (by endpoint).
    pub server_ranks: Vec<u32>,
    /// The rank of each trainer slot.
    pub trainer_ranks: Vec<u32>,
    /// The coordinator's model layout digest (hosts refuse a different model).
    pub layout: u64,
    /// Longest a spawn (the host's answer, the actor appearing) may take.
    pub spawn_timeout: Duration,
}

/// What a watched group holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Child {
    Server(u32),
    Trainer(u32),
}

/// `shard server E` or `trainer T`, as errors name them.
impl std::fmt::Display for Child {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Child::Server(endpoint) => write!(f, "shard server {endpoint}"),
            Child::Trainer(slot) => write!(f, "trainer {slot}"),
        }
    }
}

/// The supervisor's view of its children in other processes.
pub struct Remote {
    placement: RankPlacement,
    spawned: u64,
    watched: HashMap<String, Child>,
}

impl Remote {
    /// Join the supervisor's group (hosts find it there to hand it to trainers).
    pub fn new(placement: RankPlacement, supervisor: &ActorCell) -> Self {
        ractor::pg::join(supervisor_group(&placement.job), vec![supervisor.clone()]);
        Remote {
            placement,
            spawned: 0,
            watched: HashMap::new(),
        }
    }

    pub fn server_rank(&self, endpoint: u32) -> Option<u32> {
        self.placement.server_ranks.get(endpoint as usize).copied()
    }

    pub fn trainer_rank(&self, slot: u32) -> Option<u32> {
        self.placement.trainer_ranks.get(slot as usize).copied()
    }

    fn host(&self, rank: u32, what: &str) -> Result<&ActorRef<HostMsg>> {
        self.placement.hosts.get(rank as usize).ok_or_else(|| {
            Error::Config(format!("{what} is placed on rank {rank}, not in the job"))
        })
    }

    /// The rank `child` is placed on.
    fn rank_of(&self, child: Child) -> Option<u32> {
        match child {
            Child::Server(endpoint) => self.server_rank(endpoint),
            Child::Trainer(slot) => self.trainer_rank(slot),
        }
    }

    /// A fresh `pg` group for one spawn of `child` (a respawn gets another).
    fn group(&mut self, child: Child) -> String {
        let (kind, index) = match child {
            Child::Server(endpoint) => ("server", endpoint),
            Child::Trainer(slot) => ("trainer", slot),
        };
        self.spawned += 1;
        format!("odc.{}.{kind}.{index}.{}", self.placement.job, self.spawned)
    }

    /// Start shard server `spec.endpoint` on its rank and watch it.
    pub async fn spawn_server(
        &mut self,
        supervisor: &ActorCell,
        spec: ServerSpec,
    ) -> Result<ActorRef<ServerMsg>> {
        let child = Child::Server(spec.endpoint);
        let ((), cell, _) = self
            .spawn(supervisor, child, |group, layout, r| {
                HostMsg::SpawnServer(
                    ServerSpawn {
                        spec,
                        group,
                        layout,
                    },
                    r,
                )
            })
            .await?;
        Ok(ActorRef::from(cell))
    }

    /// Start trainer `spec.rank` on its rank, watch it and (collective mode) tell every rank
    /// where its inbox is before anything is assigned to it.
    pub async fn spawn_trainer(
        &mut self,
        supervisor: &ActorCell,
        spec: TrainerSpec,
    ) -> Result<ActorRef<TrainerMsg>> {
        let slot = spec.rank;
        let child = Child::Trainer(slot);
        let (TrainerStarted { inbox }, cell, rank) = self
            .spawn(supervisor, child, |group, layout, r| {
                HostMsg::SpawnTrainer(
                    TrainerSpawn {
                        spec,
                        group,
                        layout,
                    },
                    r,
                )
            })
            .await?;
        let what = child.to_string();
        let timeout = self.placement.spawn_timeout;
        if let Some(inbox) = inbox {
            for (other, host) in self.placement.hosts.iter().enumerate() {
                if other as u32 == rank {
                    continue;
                }
                let update = InboxUpdate {
                    rank: slot,
                    inbox: inbox.clone(),
                };
                let about = format!("the inbox of {what}");
                ask(
                    host,
                    |r| HostMsg::Inbox(update, r),
                    &about,
                    other as u32,
                    timeout,
                )
                .await??;
            }
        }
        Ok(ActorRef::from(cell))
    }

    /// Start `child` through the host of its rank (`request` makes the host's message from the
    /// child's fresh group, the layout digest and the reply port), then find and watch it: the
    /// host's answer, the actor and the rank.
    async fn spawn<T: Send + 'static>(
        &mut self,
        supervisor: &ActorCell,
        child: Child,
        request: impl FnOnce(String, u64, RpcReplyPort<Result<T>>) -> HostMsg,
    ) -> Result<(T, ActorCell, u32)> {
        let what = child.to_string();
        let rank = self
            .rank_of(child)
            .ok_or_else(|| Error::Config(format!("{what} has no rank")))?;
        let group = self.group(child);
        let layout = self.placement.layout;
        let host = self.host(rank, &what)?.clone();
        let timeout = self.placement.spawn_timeout;
        let reply = {
            let group = group.clone();
            ask(&host, |r| request(group, layout, r), &what, rank, timeout).await??
        };
        let cell = self.watch(supervisor, group, child, &what, rank).await?;
        Ok((reply, cell, rank))
    }

    /// The actor of `group` once visible here, watched from now on.
    async fn watch(
        &mut self,
        supervisor: &ActorCell,
        group: String,
        child: Child,
        what: &str,
        rank: u32,
    ) -> Result<ActorCell> {
        let timeout = self.placement.spawn_timeout;
        let cell = wait_member(&group, timeout).await.ok_or_else(|| {
            Error::Step(StepError::Actor {
                actor: format!("{what} on rank {rank}"),
                reason: format!("started, but not visible to the supervisor within {timeout:?}"),
            })
        })?;
        ractor::pg::monitor(group.clone(), supervisor.clone());
        // It may have stopped before the monitor was in place.
        if ractor::pg::get_members(&group).is_empty() {
            ractor::pg::demonitor(group, supervisor.get_id());
            return Err(Error::Step(StepError::Actor {
                actor: format!("{what} on rank {rank}"),
                reason: "stopped right after starting".into(),
            }));
        }
        self.watched.insert(group, child);
        Ok(cell)
    }

    /// The child of a group that lost its member, forgotten from now on (`None`: not watched,
    /// e.g. killed on purpose).
    pub fn left(&mut self, supervisor: &ActorCell, group: &str) -> Option<Child> {
        let child = self.watched.remove(group)?;
        ractor::pg::demonitor(group.to_string(), supervisor.get_id());
        Some(child)
    }

    /// Kill trainer `slot` (hung) through its host and forget it.
    pub fn kill_trainer(&mut self, supervisor: &ActorCell, slot: u32) {
        let groups: Vec<String> = self
            .watched
            .iter()
            .filter(|(_, c)| **c == Child::Trainer(slot))
            .map(|(g, _)| g.clone())
            .collect();
        let Some(rank) = self.trainer_rank(slot) else {
            return;
        };
        for group in groups {
            self.left(supervisor, &group);
            if let Ok(host) = self.host(rank, "trainer") {
                let _ = host.cast(HostMsg::Kill(group));
            }
        }
    }

    /// Abort the collectives of every epoch below `epoch` on every rank.
    pub fn abort_before(&self, epoch: u64) {
        for host in &self.placement.hosts {
            let _ = host.cast(HostMsg::Abort(epoch));
        }
    }

    /// Stop every child (the supervisor is stopping).
    pub fn stop_all(&mut self, supervisor: &ActorCell) {
        let groups: Vec<(String, Child)> = self.watched.drain().collect();
        for (group, child) in groups {
            ractor::pg::demonitor(group.clone(), supervisor.get_id());
            if let Some(host) = self
                .rank_of(child)
                .and_then(|r| self.placement.hosts.get(r as usize))
            {
                let _ = host.cast(HostMsg::Kill(group));
            }
        }
    }
}

/// Call a host, bounded by `timeout`; errors name what was asked for and the rank.
async fn ask<T: Send + 'static>(
    host: &ActorRef<HostMsg>,
    msg: impl FnOnce(RpcReplyPort<T>) -> HostMsg,
    what: &str,
    rank: u32,
    timeout: Duration,
) -> Result<T> {
    let failed = |reason: String| {
        Error::Step(StepError::Actor {
            actor: format!("{what} on rank {rank}"),
            reason,
        })
    };
    match host.call(msg, Some(timeout)).await {
        Ok(CallResult::Success(v)) => Ok(v),
        Ok(CallResult::Timeout) => Err(failed(format!(
            "rank {rank}'s host did not answer within {timeout:?}"
        ))),
        Ok(CallResult::SenderError) => Err(failed(format!(
            "rank {rank}'s host dropped the request (its process exited or disconnected)"
        ))),
        Err(e) => Err(failed(format!("rank {rank} is unreachable: {e}"))),
    }
}
