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
use ractor::{ActorCell, ActorRef};

use crate::cluster::{supervisor_group, wait_member};
use crate::error::{Error, Result};
use crate::messages::{
    HostMsg, InboxUpdate, ServerMsg, ServerSpawn, ServerSpec, TrainerMsg, TrainerSpawn,
    TrainerSpec, TrainerStarted,
};

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

    fn group(&mut self, kind: &str, index: u32) -> String {
        self.spawned += 1;
        format!("odc.{}.{kind}.{index}.{}", self.placement.job, self.spawned)
    }

    /// Start shard server `spec.endpoint` on its rank and watch it.
    pub async fn spawn_server(
        &mut self,
        supervisor: &ActorCell,
        spec: ServerSpec,
    ) -> Result<ActorRef<ServerMsg>> {
        let endpoint = spec.endpoint;
        let what = format!("shard server {endpoint}");
        let rank = self
            .server_rank(endpoint)
            .ok_or_else(|| Error::Config(format!("{what} has no rank")))?;
        let group = self.group("server", endpoint);
        let spawn = ServerSpawn {
            spec,
            group: group.clone(),
            layout: self.placement.layout,
        };
        let host = self.host(rank, &what)?.clone();
        let timeout = self.placement.spawn_timeout;
        ask(
            &host,
            |r| HostMsg::SpawnServer(spawn, r),
            &what,
            rank,
            timeout,
        )
        .await??;
        let cell = self
            .watch(supervisor, group, Child::Server(endpoint), &what, rank)
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
        let what = format!("trainer {slot}");
        let rank = self
            .trainer_rank(slot)
            .ok_or_else(|| Error::Config(format!("{what} has no rank")))?;
        let group = self.group("trainer", slot);
        let spawn = TrainerSpawn {
            spec,
            group: group.clone(),
            layout: self.placement.layout,
        };
        let host = self.host(rank, &what)?.clone();
        let timeout = self.placement.spawn_timeout;
        let TrainerStarted { inbox } = ask(
            &host,
            |r| HostMsg::SpawnTrainer(spawn, r),
            &what,
            rank,
            timeout,
        )
        .await??;
        let cell = self
            .watch(supervisor, group, Child::Trainer(slot), &what, rank)
            .await?;
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
        let cell = wait_member(&group, timeout)
            .await
            .ok_or_else(|| Error::Actor {
                actor: format!("{what} on rank {rank}"),
                reason: format!("started, but not visible to the supervisor within {timeout:?}"),
            })?;
        ractor::pg::monitor(group.clone(), supervisor.clone());
        // It may have stopped before the monitor was in place.
        if ractor::pg::get_members(&group).is_empty() {
            ractor::pg::demonitor(group, supervisor.get_id());
            return Err(Error::Actor {
                actor: format!("{what} on rank {rank}"),
                reason: "stopped right after starting".into(),
            });
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
            let rank = match child {
                Child::Server(e) => self.server_rank(e),
                Child::Trainer(t) => self.trainer_rank(t),
            };
            if let Some(host) = rank.and_then(|r| self.placement.hosts.get(r as usize)) {
                let _ = host.cast(HostMsg::Kill(group));
            }
        }
    }
}

/// Call a host, bounded by `timeout`; errors name what was asked for and the rank.
async fn ask<T: Send + 'static>(
    host: &ActorRef<HostMsg>,
    msg: impl FnOnce(ractor::RpcReplyPort<T>) -> HostMsg,
    what: &str,
    rank: u32,
    timeout: Duration,
) -> Result<T> {
    let failed = |reason: String| Error::Actor {
        actor: format!("{what} on rank {rank}"),
        reason,
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
