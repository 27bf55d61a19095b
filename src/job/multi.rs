//! A process's membership in a multi-process job: its control-plane node, its host actor, and
//! the job-level protocol around them.
//!
//! - **Joining**: every rank starts its node server and host; ranks other than 0 connect to the
//!   coordinator; rank 0 waits until every rank's host is visible, then starts the supervisor
//!   with the job's [`Roles`](crate::launch::Roles).
//! - **Steps**: rank 0 drives; after each step it sends the outcome (stats or error) to every
//!   rank, so `Job::step` returns the same result on every rank, as an SPMD program expects.
//! - **All-gather** (`Job::all_gather`): every rank sends its part of gather `n` (the job's
//!   count of earlier gathers) to rank 0, which answers every rank with all parts in rank order
//!   once it has them, or with why it cannot (a rank left or was lost first, the parts exceed a
//!   control frame, its deadline passed). Rank 0 keeps only parts of the gather it is on (a
//!   rank is at most one gather ahead of it: it sends part `n + 1` only after rank 0 answered
//!   `n`); which parts it keeps and when the gather is complete is
//!   [`policy::gather`](odc_actors::policy::gather), unit-tested there.
//! - **Leaving** (`Job::shutdown`): ranks other than 0 tell rank 0 they are done and wait for its
//!   word; rank 0 waits until every rank is done (or gone) before it stops the job, so no rank
//!   loses a shard another is still reading.
//!
//! Every wait has a deadline (I6); a coordinator that disappears is an error at every other rank,
//! not a hang.

use std::collections::BTreeSet;
use std::time::Duration;

use odc_actors::cluster::CONTROL_FRAME_CAP;
use odc_actors::cluster::{
    supervisor_group, ClusterConfig, ClusterNode, Host, HostArgs, HostEvent, SessionEvent,
};
use odc_actors::messages::{Contribution, Gathered, HostMsg, StepOutcome};
use odc_actors::node::Node;
use odc_actors::policy::gather::GatherRound;
use odc_actors::policy::stats::StepStats;
use odc_actors::policy::step::StepError;
use odc_actors::supervisor::SupervisorMsg;
use odc_actors::{Error, Result};
use ractor::{Actor, ActorRef};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;

/// See the [module docs](self).
pub(crate) struct MultiProcess {
    pub rank: u32,
    pub world_size: u32,
    pub job: String,
    cluster: ClusterNode,
    host: ActorRef<HostMsg>,
    events: UnboundedReceiver<HostEvent>,
    /// Every rank's host (rank 0 only).
    pub hosts: Vec<ActorRef<HostMsg>>,
    /// Step outcomes that arrived before they were asked for.
    outcomes: Vec<StepOutcome>,
    /// Ranks that said they are done, or whose session closed (rank 0).
    done: BTreeSet<u32>,
    join_timeout: Duration,
    /// All-gathers completed (the round of the next one).
    gathers: u64,
    /// Rank 0: the parts of gather `gathers` received so far.
    gather: GatherRound,
    /// Other ranks: rank 0's answer to gather `gathers`, once it arrived.
    gathered: Option<Gathered>,
}

/// Room left in a control frame for a gather's framing beside its parts' bytes.
const GATHER_FRAMING: u64 = 64 << 10;

/// Longest rank 0 waits for a rank to acknowledge a failed step.
const FAILURE_ACK: Duration = Duration::from_secs(2);

fn plane(reason: String) -> Error {
    Error::Step(StepError::Actor {
        actor: "control plane".into(),
        reason,
    })
}

impl MultiProcess {
    pub async fn join(config: ClusterConfig, node: Arc<Node>) -> Result<Self> {
        let (rank, world_size, job) = (config.rank, config.world_size, config.job.clone());
        let join_timeout = config.join_timeout;
        let mut cluster = ClusterNode::start(config).await?;
        let (tx, events) = tokio::sync::mpsc::unbounded_channel();
        let args = HostArgs {
            job: job.clone(),
            rank,
            node,
            events: tx,
            liveness: (rank != 0).then(|| cluster.liveness()),
        };
        let (host, _) = Actor::spawn(None, Host, args)
            .await
            .map_err(|e| plane(format!("rank {rank}: the node host did not start: {e}")))?;
        let hosts = if rank == 0 {
            cluster.hosts().await?
        } else {
            cluster.connect().await?;
            Vec::new()
        };
        tracing::info!("rank {rank} of {world_size} joined job {job}");
        Ok(MultiProcess {
            rank,
            world_size,
            job,
            cluster,
            host,
            events,
            hosts,
            outcomes: Vec::new(),
            done: BTreeSet::new(),
            join_timeout,
            gathers: 0,
            gather: GatherRound::new(0, world_size),
            gathered: None,
        })
    }

    /// Rank 0: tell every other rank how step `step` ended. A failure is acknowledged (each
    /// rank within [`FAILURE_ACK`]), as rank 0 usually stops right after it.
    pub async fn broadcast_step(&self, step: u64, result: &Result<StepStats>) {
        // The per-micro-batch log stays on rank 0: it grows with the step, and control frames
        // are capped (CONTROL_FRAME_CAP).
        let outcome = |result: &Result<StepStats>| StepOutcome {
            step,
            result: result.clone().map(|mut stats| {
                stats.micro_batch_log = Vec::new();
                stats
            }),
        };
        if result.is_ok() {
            for host in self.hosts.iter().skip(1) {
                let _ = host.cast(HostMsg::Step(outcome(result)));
            }
            return;
        }
        let acks = self.hosts.iter().skip(1).map(|host| {
            let outcome = outcome(result);
            async move {
                let _ = host
                    .call(|r| HostMsg::StepFailed(outcome, r), Some(FAILURE_ACK))
                    .await;
            }
        });
        futures::future::join_all(acks).await;
    }

    /// Other ranks: how step `step` ended, as rank 0 said, waiting until `deadline`.
    pub async fn step_outcome(&mut self, step: u64, deadline: Instant) -> Result<StepStats> {
        loop {
            if let Some(i) = self.outcomes.iter().position(|o| o.step == step) {
                return self.outcomes.swap_remove(i).result;
            }
            self.next_event(deadline, &format!("the outcome of step {step}"))
                .await?;
        }
    }

    /// Every rank's `bytes` for the next all-gather, in rank order, waiting until `deadline`
    /// (see the [module docs](self)).
    pub async fn all_gather(&mut self, bytes: Vec<u8>, deadline: Instant) -> Result<Vec<Vec<u8>>> {
        let round = self.gathers;
        let cap = CONTROL_FRAME_CAP - GATHER_FRAMING;
        if bytes.len() as u64 > cap {
            return Err(Error::Config(format!(
                "rank {}: all-gather {round}: this rank's part is {} bytes, over the {cap} bytes \
                 a control frame carries: gather less (tensors go over the data plane)",
                self.rank,
                bytes.len()
            )));
        }
        let result = if self.rank == 0 {
            self.gather_here(round, bytes, deadline, cap).await
        } else {
            self.gather_there(round, bytes, deadline).await
        };
        self.gathers += 1;
        self.gather = GatherRound::new(self.gathers, self.world_size);
        self.gathered = None;
        result
    }

    /// Rank 0: its own part, every other rank's, then the answer to every other rank.
    async fn gather_here(
        &mut self,
        round: u64,
        bytes: Vec<u8>,
        deadline: Instant,
        cap: u64,
    ) -> Result<Vec<Vec<u8>>> {
        self.gather.own(bytes);
        let what = format!("every rank's part of all-gather {round}");
        let parts = loop {
            if let Some(answer) = self.gather.answer(cap) {
                break answer;
            }
            if let Some(r) = self.gather.missing_of(self.done.iter().copied()) {
                break Err(format!(
                    "rank {r} left the job or was lost before its part of all-gather {round}"
                ));
            }
            if let Err(e) = self.next_event(deadline, &what).await {
                break Err(e.to_string());
            }
        };
        for host in self.hosts.iter().skip(1) {
            let _ = host.cast(HostMsg::Gathered(Gathered {
                round,
                parts: parts.clone(),
            }));
        }
        parts.map_err(plane)
    }

    /// Other ranks: send this rank's part to rank 0 and wait for its answer.
    async fn gather_there(
        &mut self,
        round: u64,
        bytes: Vec<u8>,
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>> {
        let rank = self.rank;
        let within = deadline.saturating_duration_since(Instant::now());
        let host0 = odc_actors::cluster::wait_member(
            &odc_actors::cluster::host_group(&self.job, 0),
            within.min(self.join_timeout),
        )
        .await
        .ok_or_else(|| plane(format!("rank {rank}: rank 0's host is not visible")))?;
        ActorRef::<HostMsg>::from(host0)
            .cast(HostMsg::Contribute(Contribution { round, rank, bytes }))
            .map_err(|e| plane(format!("rank {rank}: sending all-gather {round}: {e}")))?;
        let what = format!("rank 0's answer to all-gather {round}");
        loop {
            if let Some(gathered) = self.gathered.take() {
                let parts = gathered.parts.map_err(plane)?;
                if parts.len() != self.world_size as usize {
                    return Err(plane(format!(
                        "rank 0 answered all-gather {round} with {} parts for {} ranks",
                        parts.len(),
                        self.world_size
                    )));
                }
                return Ok(parts);
            }
            self.next_event(deadline, &what).await?;
        }
    }

    /// Rank 0: keep `part` when it belongs to the gather it is on (policy::gather).
    fn accept_part(&mut self, part: Contribution) {
        let Contribution { round, rank, bytes } = part;
        let kept = if self.rank == 0 {
            self.gather
                .accept(round, rank, bytes)
                .map_err(|e| e.to_string())
        } else {
            Err("only rank 0 gathers".into())
        };
        if let Err(why) = kept {
            tracing::warn!(
                "rank {}: dropped a part of all-gather {round} from rank {rank} (on gather {}): \
                 {why}",
                self.rank,
                self.gather.round()
            );
        }
    }

    /// The supervisor (in rank 0's process), once visible here.
    pub async fn supervisor(&self) -> Result<ActorRef<SupervisorMsg>> {
        let within = self.join_timeout;
        odc_actors::cluster::wait_member(&supervisor_group(&self.job), within)
            .await
            .map(ActorRef::from)
            .ok_or_else(|| plane(format!("the supervisor was not visible within {within:?}")))
    }

    /// Wait for one host or session event until `deadline`, recording it; an error when the
    /// coordinator is gone (other ranks), when rank 0 ended the job, or at the deadline.
    async fn next_event(&mut self, deadline: Instant, waiting_for: &str) -> Result<()> {
        enum Next {
            Host(Option<HostEvent>),
            Session(Option<SessionEvent>),
        }
        let rank = self.rank;
        // Host events first: an outcome rank 0 delivered (and saw acknowledged) before it went
        // away is read before its session's loss, which would otherwise win half the races when
        // both are ready and hide why the job ended.
        let next = tokio::select! {
            biased;
            event = self.events.recv() => Next::Host(event),
            event = self.cluster.event_until(deadline) => Next::Session(event),
        };
        match next {
            Next::Host(Some(HostEvent::Step(outcome))) => self.outcomes.push(outcome),
            Next::Host(Some(HostEvent::Contribution(part))) => self.accept_part(part),
            Next::Host(Some(HostEvent::Gathered(gathered))) => {
                if rank == 0 || gathered.round != self.gathers {
                    tracing::warn!(
                        "rank {rank}: dropped an answer to all-gather {} (on gather {})",
                        gathered.round,
                        self.gathers
                    );
                } else {
                    self.gathered = Some(gathered);
                }
            }
            Next::Host(Some(HostEvent::Leaving(r))) => {
                self.done.insert(r);
            }
            Next::Host(Some(HostEvent::Shutdown(reason))) => {
                let why = reason.map(|r| format!(": {r}")).unwrap_or_default();
                return Err(plane(format!(
                    "rank 0 ended the job while rank {rank} waited for {waiting_for}{why}"
                )));
            }
            Next::Host(None) => return Err(plane(format!("rank {rank}'s host stopped"))),
            Next::Session(Some(SessionEvent::Lost { rank: 0, reason })) if rank != 0 => {
                return Err(plane(format!(
                    "the coordinator (rank 0) is gone ({reason}: its process exited, hung, or \
                     the connection closed) while rank {rank} waited for {waiting_for}"
                )))
            }
            Next::Session(Some(SessionEvent::Lost { rank: r, .. })) => {
                self.done.insert(r);
            }
            Next::Session(Some(_)) => {}
            Next::Session(None) if Instant::now() >= deadline => {
                return Err(plane(format!(
                    "rank {rank} waited for {waiting_for} past its deadline"
                )))
            }
            Next::Session(None) => {}
        }
        Ok(())
    }

    /// Other ranks: tell rank 0 this rank is done and wait (until `deadline`) for it to end the
    /// job; a coordinator already gone counts as ended.
    pub async fn leave(mut self, deadline: Instant) {
        let host0 = odc_actors::cluster::wait_member(
            &odc_actors::cluster::host_group(&self.job, 0),
            Duration::from_secs(5),
        )
        .await;
        if let Some(cell) = host0 {
            let _ = ActorRef::<HostMsg>::from(cell).cast(HostMsg::Leaving(self.rank));
            loop {
                match self.next_event(deadline, "the end of the job").await {
                    Ok(()) => continue,
                    Err(e) => {
                        tracing::debug!("rank {} leaves: {e}", self.rank);
                        break;
                    }
                }
            }
        }
        self.close();
    }

    /// Rank 0: wait (until `deadline`) for every other rank to be done or gone.
    pub async fn wait_for_ranks(&mut self, deadline: Instant) {
        while (1..self.world_size).any(|r| !self.done.contains(&r)) {
            if let Err(e) = self.next_event(deadline, "every rank to finish").await {
                let missing: Vec<u32> = (1..self.world_size)
                    .filter(|r| !self.done.contains(r))
                    .collect();
                tracing::warn!("rank 0 ends the job without ranks {missing:?}: {e}");
                return;
            }
        }
    }

    /// Rank 0: tell every rank the job is over (`reason` when it failed) and leave.
    pub async fn end(mut self, reason: Option<String>) {
        for host in self.hosts.iter().skip(1) {
            let _ = host.cast(HostMsg::Shutdown(reason.clone()));
        }
        // The casts go out through the sessions' writers; give them a moment before the node
        // server closes the sessions (a rank that misses it sees the session close instead).
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.close();
    }

    fn close(&mut self) {
        self.host.stop(None);
        self.cluster.stop();
    }
}

impl Drop for MultiProcess {
    fn drop(&mut self) {
        self.close();
    }
}
