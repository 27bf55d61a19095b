//! The control plane across processes and hosts (DESIGN "Processes and hosts"), over
//! ractor_cluster: [`session`] (this process's node server, the session to the coordinator, lost
//! peers), [`host`] (the per-process actor that starts servers and trainers for the supervisor),
//! [`wire`] (every actor message encodable) and [`codec`] (how payloads and replies are encoded).
//!
//! No tensor bytes go over it: parameters and gradients move over the transport. A peer without
//! the cluster secret is disconnected before it is authenticated, so it never sees an actor, a
//! route or a region handle (and the transport refuses it separately).

pub mod codec;
pub mod host;
pub mod session;
mod wire;

pub use host::{host_group, supervisor_group, Host, HostArgs, HostEvent};
pub use session::{ClusterConfig, ClusterNode, SessionEvent};
