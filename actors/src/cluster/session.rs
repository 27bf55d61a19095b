//! This process's place on the control plane: a ractor_cluster `NodeServer`, odc's door to it
//! ([`door`](super::door): the handshake before any ractor_cluster frame), the session to the
//! coordinator, which rank each session is ([`Roster`]) and the heartbeat that tells a hung rank
//! from a live one.
//!
//! Topology: a star. Rank 0 (the coordinator) listens on the job's coordinator port, on the
//! address given in [`ClusterConfig::bind`] (the interface that routes to the coordinator:
//! loopback when it is loopback); every other rank dials it and listens nowhere (ranks do not
//! connect to each other, as no control message goes between two non-coordinator ranks; tensors
//! go over the transport). ractor_cluster's own listener cannot be turned off: it binds an
//! ephemeral loopback port, and every session it accepts is closed the moment it opens.
//!
//! What the job hears ([`SessionEvent`]) comes from the [`Roster`] only, so from authenticated
//! sessions only (M1–M4 of `policy/membership.rs`): an unauthenticated peer costs one log line,
//! whatever name it gives.
//!
//! **Heartbeat**: every [`HeartbeatConfig::interval`] the coordinator asks each bound rank's
//! host for a heartbeat; a rank that answers none for [`HeartbeatConfig::timeout`] has its
//! session closed, which ends its actors' remote references and their `pg` memberships exactly as
//! when its process dies: the supervisor then handles it as a killed rank (a trainer's work is
//! replayed; a lost server ends the job, to be restarted from its checkpoint). Other ranks close
//! the coordinator's session when its heartbeats stop for as long, and their job ends with an
//! error naming it.
//!
//! Every wait is bounded (I6): connecting retries until the join deadline; the coordinator waits
//! for every rank's host until the same deadline and then names the ranks that did not come.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use odc_transport::wire::HandshakeError;
use odc_transport::ClusterSecret;
use ractor::{Actor, ActorRef};
use ractor_cluster::node::NodeServerSessionInformation;
use ractor_cluster::{NodeEventSubscription, NodeServer, NodeServerMessage, NodeSessionMessage};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::door::{self, DialError, VERIFIED};
use super::groups::{host_group, wait_member};
use crate::cluster::messages::HostMsg;
use crate::error::{Error, Result};
use crate::policy::clock::{Clock, SystemClock};
use crate::policy::membership::{
    node_name, Action, HeartbeatConfig, LostReason, Origin, Roster, SessionId,
};
use crate::policy::step::StepError;

/// Largest control-plane frame accepted from an authenticated peer: control messages carry
/// specs, routes and step statistics, never tensor bytes. The largest is a trainer's spec, whose
/// directory holds one route per unit and server (~170 bytes each: 100 units × 256 servers ≈ 4.3
/// MB), hence the headroom. (Before authentication frames are capped at 256 bytes by the door.)
pub const CONTROL_FRAME_CAP: u64 = 32 << 20;

/// Where this process is on the control plane.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The job's name (node names and `pg` groups).
    pub job: String,
    pub rank: u32,
    pub world_size: u32,
    /// `host:port` of rank 0's control plane.
    pub coordinator: String,
    /// The cluster secret: odc's handshake and ractor_cluster's cookie.
    pub secret: ClusterSecret,
    /// The address rank 0 listens on (its port is the coordinator's).
    pub bind: IpAddr,
    /// Longest wait for the job to assemble (connecting, every rank's host appearing).
    pub join_timeout: Duration,
    pub heartbeat: HeartbeatConfig,
}

/// What the job hears about a rank (from authenticated sessions only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEvent {
    Ready { rank: u32 },
    Lost { rank: u32, reason: LostReason },
}

/// The roster, the sessions it names and where its events go: shared by the node server's event
/// subscription, the heartbeat task and the host (which hears the coordinator's heartbeats).
struct Keeper {
    roster: Mutex<Roster>,
    sessions: Mutex<HashMap<SessionId, ActorRef<NodeSessionMessage>>>,
    events: UnboundedSender<SessionEvent>,
}

impl Keeper {
    fn with_roster<T>(&self, f: impl FnOnce(&mut Roster) -> T) -> Option<T> {
        self.roster.lock().ok().map(|mut r| f(&mut r))
    }

    /// Execute what the roster decided.
    fn apply(&self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Close { session, reason } => {
                    tracing::warn!("{reason}");
                    let actor = self
                        .sessions
                        .lock()
                        .ok()
                        .and_then(|s| s.get(&session).cloned());
                    if let Some(actor) = actor {
                        actor.stop(Some(reason));
                    }
                }
                Action::Ready { rank } => {
                    let _ = self.events.send(SessionEvent::Ready { rank });
                }
                Action::Lost { rank, reason } => {
                    if matches!(reason, LostReason::Silent(_)) {
                        metrics::counter!(crate::metrics::SILENT_RANKS).increment(1);
                    }
                    tracing::warn!("control plane: rank {rank} is gone: {reason}");
                    let _ = self.events.send(SessionEvent::Lost { rank, reason });
                }
                Action::Note(line) => tracing::info!("{line}"),
            }
        }
    }
}

/// Hands what ractor_cluster reports about sessions to the roster.
struct Forward(Arc<Keeper>);

impl NodeEventSubscription for Forward {
    fn node_session_opened(&self, ses: NodeServerSessionInformation) {
        let origin = if ses.peer_addr.starts_with(VERIFIED) {
            Origin::Handshake
        } else {
            Origin::Unverified
        };
        if let Ok(mut sessions) = self.0.sessions.lock() {
            sessions.insert(ses.node_id, ses.actor.clone());
        }
        let actions = self
            .0
            .with_roster(|r| r.opened(ses.node_id, origin, &ses.peer_addr));
        self.0.apply(actions.unwrap_or_default());
    }

    fn node_session_authenticated(&self, ses: NodeServerSessionInformation) {
        let name = ses.peer_name.as_ref().map(|n| n.name.as_str());
        let now = SystemClock.now();
        let actions = self
            .0
            .with_roster(|r| r.authenticated(ses.node_id, name, now));
        self.0.apply(actions.unwrap_or_default());
    }

    fn node_session_ready(&self, ses: NodeServerSessionInformation) {
        let actions = self.0.with_roster(|r| r.ready(ses.node_id));
        self.0.apply(actions.unwrap_or_default());
    }

    fn node_session_disconnected(&self, ses: NodeServerSessionInformation) {
        if let Ok(mut sessions) = self.0.sessions.lock() {
            sessions.remove(&ses.node_id);
        }
        let actions = self
            .0
            .with_roster(|r| r.disconnected(ses.node_id, &ses.peer_addr));
        self.0.apply(actions.unwrap_or_default());
    }
}

/// What the host calls when the coordinator's heartbeat arrives (other ranks).
#[derive(Clone)]
pub struct Liveness(Arc<Keeper>);

impl Liveness {
    /// The coordinator was heard from just now.
    pub fn coordinator_heard(&self) {
        let now = SystemClock.now();
        self.0.with_roster(|r| r.heard_from(0, now));
    }
}

/// This process's node on the control plane.
pub struct ClusterNode {
    config: ClusterConfig,
    server: ActorRef<NodeServerMessage>,
    events: UnboundedReceiver<SessionEvent>,
    keeper: Arc<Keeper>,
    /// The door (rank 0) and the heartbeat, aborted with the node.
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn plane_error(reason: String) -> Error {
    Error::Step(StepError::Actor {
        actor: "control plane".into(),
        reason,
    })
}

/// A number no other process will pick for its node name (the standard library's per-process
/// random hash keys).
fn nonce() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.finish()
}

impl ClusterNode {
    /// Start this process's node server, its heartbeat, and (rank 0) the door on the
    /// coordinator's port.
    pub async fn start(config: ClusterConfig) -> Result<Self> {
        config.heartbeat.validate().map_err(Error::Config)?;
        let door = if config.rank == 0 {
            let port = coordinator_port(&config.coordinator)?;
            let at = SocketAddr::new(config.bind, port);
            Some(tokio::net::TcpListener::bind(at).await.map_err(|e| {
                plane_error(format!(
                    "rank 0 cannot listen on {at} (the coordinator): {e}"
                ))
            })?)
        } else {
            None
        };
        // ractor_cluster always runs a listener of its own: on loopback, on a port nobody is told,
        // and whatever it accepts is closed at once (it did not come through the door).
        let node = NodeServer::new(
            0,
            config.secret.expose(),
            node_name(&config.job, config.rank, nonce()),
            hostname(),
            None,
            None,
        )
        .with_listen_addr(IpAddr::V4(Ipv4Addr::LOCALHOST))
        .with_max_inbound_frame_size(CONTROL_FRAME_CAP);
        let (server, _) = Actor::spawn(None, node, ()).await.map_err(|e| {
            plane_error(format!(
                "rank {}: the node server did not start: {e}",
                config.rank
            ))
        })?;
        let (tx, events) = unbounded_channel();
        let keeper = Arc::new(Keeper {
            roster: Mutex::new(Roster::new(
                &config.job,
                config.rank,
                config.world_size,
                config.heartbeat,
            )),
            sessions: Mutex::new(HashMap::new()),
            events: tx,
        });
        server
            .cast(NodeServerMessage::SubscribeToEvents {
                id: "odc.sessions".into(),
                subscription: Box::new(Forward(keeper.clone())),
            })
            .map_err(|e| plane_error(format!("node server: {e}")))?;
        let mut tasks = vec![tokio::spawn(heartbeat(
            keeper.clone(),
            config.job.clone(),
            config.rank,
        ))];
        if let Some(listener) = door {
            tasks.push(tokio::spawn(door::serve(
                listener,
                server.clone(),
                config.secret.clone(),
            )));
        }
        Ok(ClusterNode {
            config,
            server,
            events,
            keeper,
            tasks,
        })
    }

    /// What the host calls when the coordinator's heartbeat arrives.
    pub fn liveness(&self) -> Liveness {
        Liveness(self.keeper.clone())
    }

    /// Connect to the coordinator (retrying while it starts) and wait until the session is
    /// authenticated and ready, within the join timeout. Only the coordinator refusing this
    /// process's proof means the secret differs.
    pub async fn connect(&mut self) -> Result<()> {
        let addr = self.config.coordinator.clone();
        let rank = self.config.rank;
        let within = self.config.join_timeout;
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let attempt = (tokio::time::Instant::now() + door::HANDSHAKE_TIMEOUT).min(deadline);
            match door::dial(&self.server, &addr, &self.config.secret, attempt.into_std()).await {
                Ok(()) => break,
                Err(DialError::Handshake(HandshakeError::Refused(reason))) => {
                    return Err(plane_error(format!(
                        "the coordinator at {addr} refused rank {rank}: {reason} (is ODC_SECRET \
                         the same on every rank?)"
                    )))
                }
                Err(DialError::Handshake(HandshakeError::WrongSecret(why))) => {
                    return Err(plane_error(format!(
                        "the peer at {addr} could not prove the cluster secret ({why}): it is \
                         not this job's coordinator, or ODC_SECRET differs"
                    )))
                }
                Err(e @ DialError::Server(_)) => {
                    return Err(plane_error(format!("rank {rank}: {e}")))
                }
                Err(e) if tokio::time::Instant::now() < deadline => {
                    tracing::debug!("control plane: connecting to {addr}: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    return Err(plane_error(format!(
                        "rank {rank} could not reach the coordinator at {addr} within \
                         {within:?}: {e}"
                    )))
                }
            }
        }
        loop {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(SessionEvent::Ready { rank: 0 })) => return Ok(()),
                Ok(Some(SessionEvent::Lost { rank: 0, reason })) => {
                    return Err(plane_error(format!(
                        "the session to the coordinator at {addr} closed while joining: {reason}"
                    )))
                }
                // The roster binds nothing else on a non-coordinator rank; nothing else is ours.
                Ok(Some(_)) => continue,
                Ok(None) => {
                    return Err(plane_error(format!(
                        "rank {rank}'s control plane stopped while joining"
                    )))
                }
                Err(_) => {
                    return Err(plane_error(format!(
                        "rank {rank}: the session to the coordinator at {addr} was not ready \
                         within {within:?}"
                    )))
                }
            }
        }
    }

    /// Every rank's host, in rank order, once all are visible (coordinator), within the join
    /// timeout; past it the error names the ranks missing.
    pub async fn hosts(&self) -> Result<Vec<ActorRef<HostMsg>>> {
        let within = self.config.join_timeout;
        let deadline = tokio::time::Instant::now() + within;
        let mut hosts = Vec::new();
        for rank in 0..self.config.world_size {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match wait_member(&host_group(&self.config.job, rank), left).await {
                Some(cell) => hosts.push(ActorRef::from(cell)),
                None => {
                    let missing: Vec<String> = (rank..self.config.world_size)
                        .filter(|r| {
                            ractor::pg::get_members(&host_group(&self.config.job, *r)).is_empty()
                        })
                        .map(|r| r.to_string())
                        .collect();
                    return Err(plane_error(format!(
                        "{} of {} ranks joined the job within {within:?}; missing: rank {}",
                        self.config.world_size as usize - missing.len(),
                        self.config.world_size,
                        missing.join(", ")
                    )));
                }
            }
        }
        Ok(hosts)
    }

    /// Wait for the next session event until `deadline`.
    pub async fn event_until(&mut self, deadline: tokio::time::Instant) -> Option<SessionEvent> {
        tokio::time::timeout_at(deadline, self.events.recv())
            .await
            .ok()
            .flatten()
    }

    /// Close every session and stop listening.
    pub fn stop(&self) {
        for task in &self.tasks {
            task.abort();
        }
        self.server.stop(None);
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The heartbeat (see the module docs): the coordinator asks every bound rank's host each
/// interval; every rank closes the sessions of ranks silent past the timeout.
async fn heartbeat(keeper: Arc<Keeper>, job: String, rank: u32) {
    let Some(config) = keeper.with_roster(|r| r.heartbeat()) else {
        return;
    };
    let mut ticks = tokio::time::interval(config.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if rank == 0 {
            for peer in keeper.with_roster(|r| r.bound()).unwrap_or_default() {
                let Some(host) = ractor::pg::get_members(&host_group(&job, peer))
                    .into_iter()
                    .next()
                else {
                    continue;
                };
                let host = ActorRef::<HostMsg>::from(host);
                let keeper = keeper.clone();
                tokio::spawn(async move {
                    let answered = host
                        .call(HostMsg::Heartbeat, Some(config.interval))
                        .await
                        .is_ok_and(|r| r.is_success());
                    if answered {
                        let now = SystemClock.now();
                        keeper.with_roster(|r| r.heard_from(peer, now));
                    }
                });
            }
        }
        let now = SystemClock.now();
        let actions = keeper.with_roster(|r| r.tick(now)).unwrap_or_default();
        keeper.apply(actions);
    }
}

fn coordinator_port(coordinator: &str) -> Result<u16> {
    coordinator
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse::<u16>().ok())
        .ok_or_else(|| {
            Error::Config(format!(
                "coordinator address {coordinator:?} is not host:port"
            ))
        })
}

fn hostname() -> String {
    std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into())
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use tokio::io::AsyncReadExt;

    use super::*;
    use crate::cluster::door::HANDSHAKE_TIMEOUT;
    use odc_transport::wire::gate::MAX_UNAUTHENTICATED;

    /// A coordinator's node on a free loopback port.
    async fn coordinator() -> (ClusterNode, SocketAddr) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let config = ClusterConfig {
            job: "door-test".into(),
            rank: 0,
            world_size: 2,
            coordinator: format!("127.0.0.1:{port}"),
            secret: ClusterSecret::new("door-test-secret-0123456789").expect("secret"),
            bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            join_timeout: Duration::from_secs(5),
            heartbeat: HeartbeatConfig::default(),
        };
        let node = ClusterNode::start(config).await.expect("the node starts");
        (node, SocketAddr::from(([127, 0, 0, 1], port)))
    }

    /// Seconds until the peer closes `stream` (reads return 0), at most `limit`.
    async fn closed_after(stream: &mut tokio::net::TcpStream, limit: Duration) -> Option<f64> {
        let started = Instant::now();
        let mut buf = [0u8; 64];
        loop {
            match tokio::time::timeout(limit, stream.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return Some(started.elapsed().as_secs_f64()),
                Ok(Ok(_)) => continue,
                Err(_) => return None,
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_never_completes_the_handshake_is_closed_at_the_deadline() {
        let (_node, door) = coordinator().await;
        let mut silent = tokio::net::TcpStream::connect(door)
            .await
            .expect("connects");
        let limit = HANDSHAKE_TIMEOUT + Duration::from_secs(5);
        let after = closed_after(&mut silent, limit)
            .await
            .unwrap_or_else(|| panic!("still open after {limit:?}"));
        let deadline = HANDSHAKE_TIMEOUT.as_secs_f64();
        assert!(
            after >= deadline - 0.5 && after <= deadline + 3.0,
            "closed after {after:.2} s, the deadline is {deadline} s"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_past_the_unauthenticated_cap_are_closed_at_once() {
        let (_node, door) = coordinator().await;
        let mut held = Vec::new();
        for _ in 0..MAX_UNAUTHENTICATED {
            held.push(
                tokio::net::TcpStream::connect(door)
                    .await
                    .expect("connects"),
            );
        }
        // Let the door take all of them into the handshake.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut extra = tokio::net::TcpStream::connect(door)
            .await
            .expect("connects");
        let after = closed_after(&mut extra, Duration::from_secs(3)).await;
        assert!(
            after.is_some_and(|s| s < 2.0),
            "connection {} is closed at once: {after:?}",
            MAX_UNAUTHENTICATED + 1
        );
        // The held ones are still in their handshake (open).
        let mut first = held.swap_remove(0);
        assert_eq!(
            closed_after(&mut first, Duration::from_millis(200)).await,
            None,
            "a connection within the cap waits for its handshake"
        );
    }
}
