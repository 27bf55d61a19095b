//! The control plane across processes and hosts (docs/design.md "Processes and hosts"), over
//! ractor_cluster: [`session`] (this process's node server, the session to the coordinator, lost
//! peers), [`host`] (the per-process actor that starts servers and trainers for the supervisor),
//! [`groups`] (the `ractor::pg` groups by which they find each other), [`wire`] (every actor
//! message encodable), [`codec`] (how payloads and replies are encoded) and `door` (odc's
//! handshake in front of ractor_cluster). The host hears the coordinator's heartbeats through the
//! session's [`Liveness`]; the session finds hosts through [`groups`], never through `host`.
//!
//! No tensor bytes go over it: parameters and gradients move over the transport. A peer must
//! prove the cluster secret through odc's handshake before ractor_cluster reads a frame of it; one
//! that does not never sees an actor, a route or a region handle, and changes no membership (the
//! transport refuses it separately).

pub mod codec;
mod door;
pub mod groups;
pub mod host;
pub mod messages;
pub mod session;
mod wire;

pub use door::HANDSHAKE_TIMEOUT;
pub use groups::{host_group, supervisor_group, wait_member};
pub use host::{Host, HostArgs, HostEvent};
pub use session::{ClusterConfig, ClusterNode, Liveness, SessionEvent, CONTROL_FRAME_CAP};
