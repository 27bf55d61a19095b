//! This process's place on the control plane: a ractor_cluster `NodeServer` (cookie = the
//! cluster secret, so a peer without it is disconnected before it is authenticated and sees no
//! actor), the session to the coordinator, and what happens to sessions (a lost peer).
//!
//! Topology: a star. Rank 0 (the coordinator) listens on the job's coordinator address; every
//! other rank connects to it (`NodeConnectionMode::Isolated`: ranks do not connect to each
//! other, as no control message goes between two non-coordinator ranks; tensors go over the
//! transport). No tensor bytes cross the control plane, so its frame cap stays small.
//!
//! Every wait is bounded (I6): connecting retries until the join deadline; the coordinator waits
//! for every rank's host until the same deadline and then names the ranks that did not come.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use ractor::{Actor, ActorRef};
use ractor_cluster::node::NodeServerSessionInformation;
use ractor_cluster::{NodeEventSubscription, NodeServer, NodeServerMessage};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::host::{host_group, wait_member};
use crate::error::{Error, Result};
use crate::messages::HostMsg;

/// Largest control-plane frame accepted from a peer: control messages carry specs, routes and
/// step statistics, never tensor bytes. The largest is a trainer's spec, whose directory holds
/// one route per unit and server (~170 bytes each: 100 units × 256 servers ≈ 4.3 MB), hence the
/// headroom.
pub const CONTROL_FRAME_CAP: u64 = 32 << 20;

/// Where this process is on the control plane.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The job's name (node names and `pg` groups).
    pub job: String,
    pub rank: u32,
    pub world_size: u32,
    /// `host:port` of rank 0's node server.
    pub coordinator: String,
    /// The cluster secret (ractor_cluster's cookie).
    pub cookie: String,
    /// Longest wait for the job to assemble (connecting, every rank's host appearing).
    pub join_timeout: Duration,
}

/// A session event, reduced to what the job needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEvent {
    Ready {
        rank: Option<u32>,
    },
    /// The session closed; `authenticated: false` means the peer was refused (wrong secret) or
    /// refused us.
    Lost {
        rank: Option<u32>,
        authenticated: bool,
        addr: String,
    },
}

/// This process's node on the control plane.
pub struct ClusterNode {
    config: ClusterConfig,
    server: ActorRef<NodeServerMessage>,
    events: UnboundedReceiver<SessionEvent>,
}

/// The node name of `rank` (unique in the job; the rank is read back from it).
fn node_name(job: &str, rank: u32) -> String {
    format!("odc-{job}-rank-{rank}")
}

/// The rank in a peer's node name (`odc-<job>-rank-<r>@<host>`).
fn rank_of(job: &str, name: &str) -> Option<u32> {
    let name = name.split('@').next()?;
    name.strip_prefix(&format!("odc-{job}-rank-"))?.parse().ok()
}

struct Forward {
    job: String,
    tx: UnboundedSender<SessionEvent>,
    authenticated: std::sync::Mutex<std::collections::HashSet<u64>>,
}

impl Forward {
    fn rank(&self, ses: &NodeServerSessionInformation) -> Option<u32> {
        ses.peer_name
            .as_ref()
            .and_then(|p| rank_of(&self.job, &p.name))
    }
}

impl NodeEventSubscription for Forward {
    fn node_session_opened(&self, _ses: NodeServerSessionInformation) {}

    fn node_session_authenticated(&self, ses: NodeServerSessionInformation) {
        if let Ok(mut seen) = self.authenticated.lock() {
            seen.insert(ses.node_id);
        }
    }

    fn node_session_ready(&self, ses: NodeServerSessionInformation) {
        let _ = self.tx.send(SessionEvent::Ready {
            rank: self.rank(&ses),
        });
    }

    fn node_session_disconnected(&self, ses: NodeServerSessionInformation) {
        let authenticated = self
            .authenticated
            .lock()
            .map(|mut seen| seen.remove(&ses.node_id))
            .unwrap_or(false);
        if !authenticated {
            tracing::warn!(
                "control plane: a peer at {} was disconnected before authenticating (wrong \
                 secret, or not an odc node)",
                ses.peer_addr
            );
        }
        let _ = self.tx.send(SessionEvent::Lost {
            rank: self.rank(&ses),
            authenticated,
            addr: ses.peer_addr,
        });
    }
}

fn plane_error(reason: String) -> Error {
    Error::Actor {
        actor: "control plane".into(),
        reason,
    }
}

impl ClusterNode {
    /// Start this process's node server: rank 0 on the coordinator's port (every interface),
    /// other ranks on a free port.
    pub async fn start(config: ClusterConfig) -> Result<Self> {
        let port = if config.rank == 0 {
            coordinator_port(&config.coordinator)?
        } else {
            free_port()?
        };
        let node = NodeServer::new(
            port,
            config.cookie.clone(),
            node_name(&config.job, config.rank),
            hostname(),
            None,
            None,
        )
        .with_listen_addr(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
        .with_max_inbound_frame_size(CONTROL_FRAME_CAP);
        let (server, _) = Actor::spawn(None, node, ()).await.map_err(|e| {
            plane_error(format!(
                "rank {} cannot listen on port {port}: {e}",
                config.rank
            ))
        })?;
        let (tx, events) = unbounded_channel();
        server
            .cast(NodeServerMessage::SubscribeToEvents {
                id: "odc.sessions".into(),
                subscription: Box::new(Forward {
                    job: config.job.clone(),
                    tx,
                    authenticated: Default::default(),
                }),
            })
            .map_err(|e| plane_error(format!("node server: {e}")))?;
        Ok(ClusterNode {
            config,
            server,
            events,
        })
    }

    /// Connect to the coordinator (retrying while it starts) and wait until the session is
    /// authenticated and ready, within the join timeout.
    pub async fn connect(&mut self) -> Result<()> {
        let addr = self.config.coordinator.clone();
        let within = self.config.join_timeout;
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match ractor_cluster::client_connect(&self.server, addr.as_str()).await {
                Ok(()) => break,
                Err(e) if tokio::time::Instant::now() < deadline => {
                    tracing::debug!("control plane: connecting to {addr}: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    return Err(plane_error(format!(
                        "rank {} could not reach the coordinator at {addr} within {within:?}: {e}",
                        self.config.rank
                    )))
                }
            }
        }
        loop {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(SessionEvent::Ready { .. })) => return Ok(()),
                Ok(Some(SessionEvent::Lost {
                    authenticated: false,
                    ..
                })) => {
                    return Err(plane_error(format!(
                        "the coordinator at {addr} refused rank {}: the cluster secret \
                         (ODC_SECRET) differs",
                        self.config.rank
                    )))
                }
                // A session to someone else (a stray connection) closing is not ours.
                Ok(Some(SessionEvent::Lost { rank, .. })) if rank != Some(0) => continue,
                Ok(Some(SessionEvent::Lost { .. })) | Ok(None) => {
                    return Err(plane_error(format!(
                        "the session to the coordinator at {addr} closed while joining"
                    )))
                }
                Err(_) => {
                    return Err(plane_error(format!(
                        "rank {}: the session to the coordinator at {addr} was not ready within \
                         {within:?}",
                        self.config.rank
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
        self.server.stop(None);
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        self.server.stop(None);
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

/// A port free right now (the node server binds it a moment later).
fn free_port() -> Result<u16> {
    std::net::TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| plane_error(format!("no free port for the node server: {e}")))
}

fn hostname() -> String {
    std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_s_rank_is_read_back_from_its_node_name() {
        let name = format!("{}@somehost", node_name("j1", 3));
        assert_eq!(rank_of("j1", &name), Some(3));
        assert_eq!(rank_of("j1", &node_name("j1", 12)), Some(12));
        assert_eq!(rank_of("j2", &name), None, "another job's node");
        assert_eq!(rank_of("j1", "odc-j1-rank-x@h"), None);
    }
}
