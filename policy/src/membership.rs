//! Who is which rank on the control plane, and who is gone: a pure state machine fed by the
//! control plane's session events and heartbeats (docs/design.md "Processes and hosts": a peer is nobody
//! until it proved the cluster secret; liveness of a rank is a heartbeat, not a TCP close).
//!
//! The actor side (`cluster/session.rs`) feeds it what the cluster library's node server reports about
//! each session (opened, authenticated with a peer name, ready, disconnected), the heartbeats it
//! hears and a tick; it executes the [`Action`]s that come back (close a session, tell the job a
//! rank is ready or lost, write a log line).
//!
//! ## Invariants (tested below)
//! - **M1 authenticated only**: a session that did not come through odc's handshake is closed at
//!   once and changes nothing else: no rank is read from it, and no `Ready` or `Lost` ever comes of
//!   it — it costs one log line.
//! - **M2 first claim wins**: a rank is bound to the first authenticated session that claims it
//!   (by its node name); a second claim of a live rank, a claim of this process's own rank, of a
//!   rank outside the job, of another job's name, or (star topology) of any rank but the
//!   coordinator on a non-coordinator rank is refused: that session is closed and logged, the
//!   bound one is untouched.
//! - **M3 lost once**: a bound rank is `Lost` exactly once, when its session closes, whether it
//!   closed by itself or was closed here for missing heartbeats; `Ready` comes only for a bound
//!   session and at most once.
//! - **M4 heartbeat**: a bound rank not heard from for the heartbeat timeout has its session
//!   closed, with that reason (then M3). The coordinator hears from each rank when it answers a
//!   heartbeat; every other rank hears from the coordinator when a heartbeat arrives.

use std::collections::HashMap;
use std::time::Duration;

use crate::clock::Timestamp;

/// A session's id (the cluster library's node id, unique within a process).
pub type SessionId = u64;

/// How often the coordinator asks every rank for a heartbeat, and how long a rank may stay
/// silent before it is treated as lost (as a killed one would be).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeartbeatConfig {
    pub interval: Duration,
    pub timeout: Duration,
}

impl Default for HeartbeatConfig {
    /// 1 s / 10 s.
    fn default() -> Self {
        HeartbeatConfig {
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(10),
        }
    }
}

impl HeartbeatConfig {
    /// Both positive and the timeout longer than the interval.
    pub fn validate(&self) -> Result<(), String> {
        if self.interval.is_zero() || self.timeout.is_zero() {
            return Err(format!(
                "the heartbeat interval and timeout must be positive, got {:?} and {:?}",
                self.interval, self.timeout
            ));
        }
        if self.timeout <= self.interval {
            return Err(format!(
                "the heartbeat timeout ({:?}) must be longer than its interval ({:?})",
                self.timeout, self.interval
            ));
        }
        Ok(())
    }
}

/// How a session reached this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Through odc's handshake (the peer proved the cluster secret).
    Handshake,
    /// Any other way (the cluster library's own listener).
    Unverified,
}

/// Why a bound rank is lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LostReason {
    /// Its session closed (the process exited, or the connection broke).
    Disconnected,
    /// It did not answer heartbeats for this long; its session was closed here.
    Silent(Duration),
}

impl std::fmt::Display for LostReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LostReason::Disconnected => f.write_str("its session closed"),
            LostReason::Silent(d) => write!(
                f,
                "it answered no heartbeat for {:.1} s (hung or stopped)",
                d.as_secs_f64()
            ),
        }
    }
}

/// What to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Close this session; `reason` is for the log.
    Close { session: SessionId, reason: String },
    /// Rank `rank`'s session is authenticated and ready.
    Ready { rank: u32 },
    /// Rank `rank` is gone.
    Lost { rank: u32, reason: LostReason },
    /// Nothing changes; one line for the log.
    Note(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Session {
    /// Came through the handshake; its node name is not known yet.
    Verified,
    /// Bound to `rank`; `closing` once closed here (for missing heartbeats).
    Bound {
        rank: u32,
        ready: bool,
        closing: Option<LostReason>,
    },
    /// Closed here and changing nothing (M1, M2).
    Refused,
}

/// The control plane's view of the job's ranks (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct Roster {
    job: String,
    rank: u32,
    world_size: u32,
    heartbeat: HeartbeatConfig,
    sessions: HashMap<SessionId, Session>,
    /// Bound ranks: their session and when they were last heard from.
    ranks: HashMap<u32, (SessionId, Timestamp)>,
}

/// The node name of `rank` of job `job`; `nonce` makes it unique to one process (a peer cannot
/// take over another rank's name, and the cluster library never elects between two processes).
pub fn node_name(job: &str, rank: u32, nonce: u64) -> String {
    format!("odc-{job}-rank-{rank}-{nonce:016x}")
}

/// The rank in a peer's node name (`odc-<job>-rank-<r>-<nonce>@<host>`), if it is one of job
/// `job`'s.
pub fn rank_of(job: &str, name: &str) -> Option<u32> {
    let name = name.split('@').next()?;
    let rest = name.strip_prefix(&format!("odc-{job}-rank-"))?;
    let (rank, nonce) = rest.split_once('-')?;
    if nonce.len() != 16 || !nonce.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    rank.parse().ok()
}

impl Roster {
    /// The roster of `rank` in a job of `world_size` ranks named `job`.
    pub fn new(job: &str, rank: u32, world_size: u32, heartbeat: HeartbeatConfig) -> Self {
        Roster {
            job: job.to_string(),
            rank,
            world_size,
            heartbeat,
            sessions: HashMap::new(),
            ranks: HashMap::new(),
        }
    }

    pub fn heartbeat(&self) -> HeartbeatConfig {
        self.heartbeat
    }

    /// The session rank `rank` is bound to.
    pub fn session_of(&self, rank: u32) -> Option<SessionId> {
        self.ranks.get(&rank).map(|(s, _)| *s)
    }

    /// Bound ranks, in order.
    pub fn bound(&self) -> Vec<u32> {
        let mut ranks: Vec<u32> = self.ranks.keys().copied().collect();
        ranks.sort_unstable();
        ranks
    }

    /// A session opened (M1).
    pub fn opened(&mut self, session: SessionId, origin: Origin, peer: &str) -> Vec<Action> {
        match origin {
            Origin::Handshake => {
                self.sessions.insert(session, Session::Verified);
                Vec::new()
            }
            Origin::Unverified => {
                self.sessions.insert(session, Session::Refused);
                vec![Action::Close {
                    session,
                    reason: format!(
                        "control plane: closed a connection from {peer} that did not come \
                         through odc's handshake"
                    ),
                }]
            }
        }
    }

    /// A session passed the cluster library's own authentication (its cookie), its peer calling itself
    /// `peer_name` (M2).
    pub fn authenticated(
        &mut self,
        session: SessionId,
        peer_name: Option<&str>,
        now: Timestamp,
    ) -> Vec<Action> {
        let refuse = |this: &mut Self, why: String| {
            this.sessions.insert(session, Session::Refused);
            vec![Action::Close {
                session,
                reason: format!("control plane: refused a session: {why}"),
            }]
        };
        match self.sessions.get(&session) {
            Some(Session::Verified) => {}
            // Unverified sessions are already being closed; a session seen twice changes nothing.
            Some(_) => return Vec::new(),
            None => return refuse(self, "it was never opened through odc's handshake".into()),
        }
        let name = peer_name.unwrap_or("<no name>");
        let Some(rank) = peer_name.and_then(|n| rank_of(&self.job, n)) else {
            return refuse(
                self,
                format!("its node name {name:?} names no rank of job {:?}", self.job),
            );
        };
        if rank >= self.world_size {
            return refuse(
                self,
                format!(
                    "{name:?} claims rank {rank}, the job has {} ranks",
                    self.world_size
                ),
            );
        }
        if rank == self.rank {
            return refuse(
                self,
                format!("{name:?} claims this process's own rank {rank}"),
            );
        }
        if self.rank != 0 && rank != 0 {
            return refuse(
                self,
                format!(
                    "{name:?} claims rank {rank}; rank {} talks only to the coordinator (rank 0)",
                    self.rank
                ),
            );
        }
        if let Some((bound, _)) = self.ranks.get(&rank) {
            let bound = *bound;
            return refuse(
                self,
                format!("{name:?} claims rank {rank}, which is live (session {bound})"),
            );
        }
        self.sessions.insert(
            session,
            Session::Bound {
                rank,
                ready: false,
                closing: None,
            },
        );
        self.ranks.insert(rank, (session, now));
        Vec::new()
    }

    /// A session finished its state exchange (M3: `Ready` once, bound sessions only).
    pub fn ready(&mut self, session: SessionId) -> Vec<Action> {
        match self.sessions.get_mut(&session) {
            Some(Session::Bound {
                rank,
                ready: ready @ false,
                closing: None,
            }) => {
                *ready = true;
                vec![Action::Ready { rank: *rank }]
            }
            _ => Vec::new(),
        }
    }

    /// A session closed (M1, M3).
    pub fn disconnected(&mut self, session: SessionId, peer: &str) -> Vec<Action> {
        match self.sessions.remove(&session) {
            Some(Session::Bound { rank, closing, .. }) => {
                self.ranks.remove(&rank);
                vec![Action::Lost {
                    rank,
                    reason: closing.unwrap_or(LostReason::Disconnected),
                }]
            }
            Some(Session::Refused) => Vec::new(),
            Some(Session::Verified) | None => vec![Action::Note(format!(
                "control plane: a session with {peer} closed before it was authenticated"
            ))],
        }
    }

    /// Rank `rank` answered a heartbeat (coordinator), or the coordinator's heartbeat arrived
    /// (`rank` 0, other ranks). Unbound ranks are ignored.
    pub fn heard_from(&mut self, rank: u32, now: Timestamp) {
        if let Some((_, seen)) = self.ranks.get_mut(&rank) {
            *seen = (*seen).max(now);
        }
    }

    /// Close the session of every bound rank silent for longer than the heartbeat timeout (M4).
    pub fn tick(&mut self, now: Timestamp) -> Vec<Action> {
        let mut actions = Vec::new();
        let mut silent: Vec<(u32, SessionId, Duration)> = self
            .ranks
            .iter()
            .filter_map(|(rank, (session, seen))| {
                let quiet = now.saturating_duration_since(*seen);
                (quiet > self.heartbeat.timeout).then_some((*rank, *session, quiet))
            })
            .collect();
        silent.sort_unstable_by_key(|(rank, _, _)| *rank);
        for (rank, session, quiet) in silent {
            if let Some(Session::Bound { closing, .. }) = self.sessions.get_mut(&session) {
                if closing.is_some() {
                    continue;
                }
                let reason = LostReason::Silent(quiet);
                actions.push(Action::Close {
                    session,
                    reason: format!("control plane: rank {rank} is lost: {reason}"),
                });
                *closing = Some(reason);
            }
        }
        actions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONCE: u64 = 0x0123_4567_89ab_cdef;

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_nanos(ms * 1_000_000)
    }

    fn name(rank: u32) -> String {
        format!("{}@host", node_name("j", rank, NONCE + rank as u64))
    }

    fn coordinator() -> Roster {
        Roster::new("j", 0, 4, HeartbeatConfig::default())
    }

    /// Open, authenticate and ready session `session` as `rank`.
    fn join(r: &mut Roster, session: SessionId, rank: u32, now: Timestamp) -> Vec<Action> {
        let mut actions = r.opened(session, Origin::Handshake, "peer");
        actions.extend(r.authenticated(session, Some(&name(rank)), now));
        actions.extend(r.ready(session));
        actions
    }

    fn closes(actions: &[Action]) -> Vec<SessionId> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Close { session, .. } => Some(*session),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn node_names_carry_the_rank_and_a_nonce() {
        assert_eq!(rank_of("j", &name(3)), Some(3));
        assert_eq!(rank_of("j", &node_name("j", 12, 7)), Some(12));
        assert_eq!(rank_of("k", &name(3)), None, "another job's node");
        assert_eq!(rank_of("j", "odc-j-rank-3@h"), None, "no nonce");
        assert_eq!(rank_of("j", "odc-j-rank-x-0123456789abcdef@h"), None);
        assert_eq!(rank_of("j", "odc-j-rank-1-0123@h"), None, "short nonce");
    }

    #[test]
    fn m1_an_unverified_session_is_closed_and_changes_nothing() {
        let mut r = coordinator();
        let actions = r.opened(9, Origin::Unverified, "10.0.0.9:5000");
        assert_eq!(closes(&actions), vec![9]);
        // Whatever it claims afterwards (the cluster library may still report it), nothing binds.
        assert!(r.authenticated(9, Some(&name(1)), at(0)).is_empty());
        assert!(r.ready(9).is_empty());
        assert_eq!(r.session_of(1), None);
        assert!(r.disconnected(9, "10.0.0.9:5000").is_empty());
        // The rank is still free for the real peer.
        assert_eq!(join(&mut r, 1, 1, at(1)), vec![Action::Ready { rank: 1 }]);
    }

    #[test]
    fn m1_a_session_closing_before_authentication_is_only_a_note() {
        let mut r = coordinator();
        r.opened(4, Origin::Handshake, "p");
        let actions = r.disconnected(4, "p");
        assert!(
            matches!(actions.as_slice(), [Action::Note(_)]),
            "{actions:?}"
        );
        assert!(r.bound().is_empty());
    }

    #[test]
    fn m2_the_first_claim_of_a_rank_wins() {
        let mut r = coordinator();
        assert_eq!(join(&mut r, 1, 2, at(0)), vec![Action::Ready { rank: 2 }]);
        let second = join(&mut r, 5, 2, at(1));
        assert_eq!(closes(&second), vec![5], "{second:?}");
        assert!(!second.iter().any(|a| matches!(a, Action::Ready { .. })));
        assert_eq!(r.session_of(2), Some(1), "the bound session is untouched");
        // The refused session closing loses nothing.
        assert!(r.disconnected(5, "p").is_empty());
        assert_eq!(r.session_of(2), Some(1));
    }

    #[test]
    fn m2_claims_outside_the_job_are_refused() {
        let mut r = coordinator();
        for (session, claim) in [
            (1, name(0)),                                   // the coordinator's own rank
            (2, name(4)),                                   // past the world
            (3, format!("{}@h", node_name("other", 1, 5))), // another job
            (4, "garbage".to_string()),
        ] {
            r.opened(session, Origin::Handshake, "p");
            let actions = r.authenticated(session, Some(&claim), at(0));
            assert_eq!(closes(&actions), vec![session], "{claim}: {actions:?}");
        }
        r.opened(6, Origin::Handshake, "p");
        assert_eq!(closes(&r.authenticated(6, None, at(0))), vec![6]);
        // Not opened at all.
        assert_eq!(closes(&r.authenticated(7, Some(&name(1)), at(0))), vec![7]);
        assert!(r.bound().is_empty());
    }

    #[test]
    fn m2_a_non_coordinator_binds_only_the_coordinator() {
        let mut r = Roster::new("j", 2, 4, HeartbeatConfig::default());
        r.opened(1, Origin::Handshake, "p");
        assert_eq!(closes(&r.authenticated(1, Some(&name(3)), at(0))), vec![1]);
        assert_eq!(join(&mut r, 2, 0, at(0)), vec![Action::Ready { rank: 0 }]);
    }

    #[test]
    fn m3_a_bound_rank_is_lost_once_and_can_rejoin_after() {
        let mut r = coordinator();
        join(&mut r, 1, 3, at(0));
        assert!(r.ready(1).is_empty(), "ready once");
        assert_eq!(
            r.disconnected(1, "p"),
            vec![Action::Lost {
                rank: 3,
                reason: LostReason::Disconnected
            }]
        );
        assert!(r
            .disconnected(1, "p")
            .iter()
            .all(|a| matches!(a, Action::Note(_))));
        assert_eq!(join(&mut r, 2, 3, at(5)), vec![Action::Ready { rank: 3 }]);
    }

    #[test]
    fn m4_a_silent_rank_is_closed_then_lost_with_the_reason() {
        let config = HeartbeatConfig {
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(1000),
        };
        let mut r = Roster::new("j", 0, 4, config);
        join(&mut r, 1, 1, at(0));
        join(&mut r, 2, 2, at(0));
        r.heard_from(1, at(900));
        r.heard_from(2, at(900));
        assert!(r.tick(at(1500)).is_empty(), "both heard within the timeout");
        r.heard_from(1, at(1800));
        let actions = r.tick(at(2000));
        assert_eq!(
            closes(&actions),
            vec![2],
            "rank 2 silent for 1.1 s: {actions:?}"
        );
        assert!(r.tick(at(2100)).is_empty(), "closed once");
        // Until the close lands, rank 2 stays bound: a late heartbeat does not revive it.
        r.heard_from(2, at(2150));
        assert_eq!(
            r.disconnected(2, "p"),
            vec![Action::Lost {
                rank: 2,
                reason: LostReason::Silent(Duration::from_millis(1100))
            }]
        );
        assert_eq!(r.bound(), vec![1]);
        // Unbound ranks' heartbeats are ignored.
        r.heard_from(3, at(2200));
        assert_eq!(r.bound(), vec![1]);
    }

    #[test]
    fn m4_a_non_coordinator_loses_a_silent_coordinator() {
        let config = HeartbeatConfig {
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(500),
        };
        let mut r = Roster::new("j", 1, 2, config);
        join(&mut r, 7, 0, at(0));
        r.heard_from(0, at(400));
        assert!(r.tick(at(800)).is_empty());
        assert_eq!(closes(&r.tick(at(1000))), vec![7]);
    }

    #[test]
    fn heartbeat_config_is_checked() {
        assert!(HeartbeatConfig::default().validate().is_ok());
        let zero = HeartbeatConfig {
            interval: Duration::ZERO,
            timeout: Duration::from_secs(1),
        };
        assert!(zero.validate().is_err());
        let inverted = HeartbeatConfig {
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
        };
        assert!(inverted.validate().unwrap_err().contains("longer"));
    }
}
