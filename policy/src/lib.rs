//! # odc-policy — the runtime's pure cores
//!
//! Every decision the runtime makes about work, and the plain data it decides on, with no actor,
//! no async runtime and no clock behind it. `odc-actors` drives these cores (it re-exports this
//! crate as `odc_actors::policy`, and [`batch`], [`layout`] and [`Error`] at its root).
//!
//! - [`balancer`]: cost model, packing, partitioning, minibatch plans (LB-Mini, LB-Micro, dynamic);
//! - [`dispatch`]: the work queue of one minibatch attempt (own lists, earliest-finish stealing);
//! - [`ledger`]: exactly-once accounting of micro-batches (I2);
//! - [`membership`]: which authenticated session is which rank, and which rank is lost
//!   (closed, or silent past the heartbeat timeout);
//! - [`gather`]: one all-gather at the coordinator (which parts it keeps, when it is complete);
//! - [`straggler`]: per-trainer speed estimates;
//! - [`schedule`]: the learning rate's factor per global step (warm-up, cosine decay);
//! - [`recovery`]: what a trainer failure means (respawn or drop, replay or not, how often);
//! - [`step`]: the supervisor's decisions as a state machine (plan, dispatch, ledger, barrier,
//!   replay, deadlines): events in, commands with reasons out;
//! - [`token`]: the assignment tokens that bind reports and gradient writes to assignments;
//! - [`split`]: cutting one causal sample across a gang (zig-zag chunks, balanced causal work);
//! - [`optimizer`]: SGD and AdamW on one shard, elementwise (the shard servers' update rule);
//! - the data they decide on: [`batch`] (samples, micro-batches, the loss convention),
//!   [`layout`] (units and shards), [`assignment`] (an assignment and the report answering it),
//!   [`stats`] (what a micro-batch and a step report), [`clock`] ([`Timestamp`](clock::Timestamp)
//!   and the [`Clock`](clock::Clock) the actors inject), and the runtime's one [`Error`].
//!
//! Rules every module here follows:
//! - **no actor framework, no async runtime**, by construction: this crate's manifest does not
//!   depend on ractor or tokio, so no file here can name them (the compiler refuses), and a test
//!   below keeps them out of the manifest. Nothing here spawns, sends or awaits; the actors
//!   translate messages into calls and execute what comes back;
//! - **no clock reads**: time comes in as an argument (`now: Timestamp`, or seconds measured by the
//!   caller), so every decision is a function of its inputs and is unit-tested as such. The one
//!   exception is [`clock::SystemClock`], the implementation the actors inject;
//! - **decisions carry reasons**: every [`step::Decision`] names why it was taken
//!   ([`step::Reason`]), printable for logs and comparable in tests.

pub mod assignment;
pub mod balancer;
pub mod batch;
pub mod clock;
pub mod dispatch;
mod error;
pub mod gather;
pub mod layout;
pub mod ledger;
pub mod membership;
pub mod optimizer;
pub mod recovery;
pub mod schedule;
pub mod split;
pub mod stats;
pub mod step;
pub mod straggler;
pub mod token;

pub use error::{Error, NonFiniteAt, Result};

/// Index of a unit in its [`ModelLayout`](layout::ModelLayout).
pub type UnitId = u32;

#[cfg(test)]
mod tests {
    /// The crate's purity holds by construction: its manifest names no actor framework, no async
    /// runtime and nothing that brings one in, so no source file here can import them. This
    /// keeps them out of the manifest (a dependency added later fails here, naming it).
    #[test]
    fn manifest_depends_on_no_actor_framework_or_async_runtime() {
        let manifest = include_str!("../Cargo.toml");
        let banned = [
            "ractor",
            "ractor_cluster",
            "tokio",
            "futures",
            "async-trait",
        ];
        let mut section = "";
        let mut offenders = Vec::new();
        for line in manifest.lines().map(str::trim) {
            if line.starts_with('[') {
                section = line;
                // A `[dependencies.NAME]` table names its dependency in the header.
                let table = section
                    .strip_prefix("[dependencies.")
                    .and_then(|s| s.strip_suffix(']'));
                if table.is_some_and(|name| banned.contains(&name)) {
                    offenders.push(section.to_string());
                }
                continue;
            }
            let dependencies = section == "[dependencies]"
                || (section.starts_with("[target") && section.ends_with("dependencies]"));
            if !dependencies {
                continue;
            }
            let name = line.split(['=', '.', ' ']).next().unwrap_or("");
            if banned.contains(&name) {
                offenders.push(line.to_string());
            }
        }
        assert!(
            offenders.is_empty(),
            "odc-policy must stay pure: {offenders:?}"
        );
    }
}
