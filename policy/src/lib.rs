//! # odc-policy — the runtime's pure cores
//!
//! Every decision the runtime makes about work, and the plain data it decides on, with no actor,
//! no async runtime and no clock behind it. `odc-actors` drives these cores (it re-exports this
//! crate as `odc_actors::policy`, and [`batch`], [`layout`] and [`NonFiniteAt`] at its root).
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
//! - [`relay`]: which server of a node relays its gradient pushes to an owner on another node;
//! - [`step`]: the supervisor's decisions as a state machine (plan, dispatch, ledger, barrier,
//!   replay, deadlines): events in, commands with reasons out;
//! - [`token`]: the assignment tokens that bind reports and gradient writes to assignments;
//! - [`split`]: cutting one causal sample across a gang (zig-zag chunks, balanced causal work);
//! - [`optimizer`]: SGD and AdamW on one shard, elementwise (the shard servers' update rule);
//! - the data they decide on: [`batch`] (samples, micro-batches, the loss convention),
//!   [`layout`] (units and shards), [`assignment`] (an assignment and the report answering it),
//!   [`stats`] (what a micro-batch and a step report), [`clock`] ([`Timestamp`](clock::Timestamp)
//!   and the [`Clock`](clock::Clock) the actors inject);
//! - its errors, one per core that decides: [`step::StepError`], [`layout::LayoutError`],
//!   [`balancer::BalanceError`], [`ledger::LedgerError`], [`optimizer::OptimizerError`], ...,
//!   and [`NonFiniteAt`] ([`error`]). The runtime's one error enum, which also names transports,
//!   endpoints and actors, is `odc_actors::Error`: it converts from each of these, and the step
//!   machine carries it through typed ([`step::Failure`]).
//!
//! Rules every module here follows:
//! - **no actor framework, no async runtime**, by construction: nothing this crate depends on,
//!   directly or through another crate, is ractor, ractor_cluster, tokio, futures or
//!   async-trait, so no file here can name them (the compiler refuses), and a test below walks
//!   the resolved dependency graph to keep it so (it names the chain that brings one in). In
//!   particular the crate does not depend on `odc-transport`. Nothing here spawns, sends or
//!   awaits; the actors translate messages into calls and execute what comes back;
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
pub mod error;
pub mod gather;
pub mod layout;
pub mod ledger;
pub mod membership;
pub mod optimizer;
pub mod recovery;
pub mod relay;
pub mod schedule;
pub mod split;
pub mod stats;
pub mod step;
pub mod straggler;
pub mod token;

pub use error::NonFiniteAt;

/// Index of a unit in its [`ModelLayout`](layout::ModelLayout).
pub type UnitId = u32;

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, VecDeque};
    use std::process::Command;

    use serde_json::Value;

    /// What must not reach this crate: actor frameworks, async runtimes, and what they stand on.
    const BANNED: [&str; 5] = [
        "ractor",
        "ractor_cluster",
        "tokio",
        "futures",
        "async-trait",
    ];

    /// The crate's purity holds by construction: nothing it depends on, directly or through
    /// another crate, is an actor framework or an async runtime, so no source file here can
    /// import them. This walks the resolved graph (`cargo metadata`: every normal dependency,
    /// transitively, with the features the workspace turns on) and names the chain of packages
    /// that reaches a banned one. Dev-dependencies and build scripts do not count: they are not
    /// part of what links against this crate.
    #[test]
    fn dependency_graph_reaches_no_actor_framework_or_async_runtime() {
        // This platform's dependencies only: the others' sources need not be here (offline).
        let version = cargo(&["-vV"]);
        let host = String::from_utf8_lossy(&version)
            .lines()
            .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
            .expect("`cargo -vV` names no host");
        let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
        let json = cargo(&[
            "metadata",
            "--format-version",
            "1",
            "--offline",
            "--filter-platform",
            &host,
            "--manifest-path",
            manifest,
        ]);
        let metadata: Value =
            serde_json::from_slice(&json).expect("`cargo metadata` printed no JSON");
        let chains = banned_chains(&metadata, "odc-policy");
        assert!(
            chains.is_empty(),
            "odc-policy must stay pure, but it depends on:\n{}",
            chains.join("\n")
        );
    }

    /// What the cargo running these tests prints for `args`; fails naming why it could not run.
    fn cargo(args: &[&str]) -> Vec<u8> {
        let out = Command::new(env!("CARGO"))
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run `{} {args:?}`: {e}", env!("CARGO")));
        assert!(
            out.status.success(),
            "`cargo {args:?}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }

    /// The walk finds what the old manifest (`odc-transport` as a dependency) brought in.
    #[test]
    fn the_walk_names_the_chain_to_a_banned_crate() {
        let node = |id: &str, deps: &[(&str, Value)]| {
            let deps: Vec<Value> = deps
                .iter()
                .map(|(pkg, kind)| {
                    serde_json::json!({"pkg": pkg, "dep_kinds": [{"kind": kind, "target": null}]})
                })
                .collect();
            serde_json::json!({"id": id, "deps": deps})
        };
        let metadata = serde_json::json!({
            "packages": [
                {"id": "p", "name": "odc-policy"},
                {"id": "t", "name": "odc-transport"},
                {"id": "k", "name": "tokio"},
                {"id": "r", "name": "ractor"},
                {"id": "s", "name": "serde"},
            ],
            "resolve": {"nodes": [
                node("p", &[("t", Value::Null), ("s", Value::Null), ("r", "dev".into())]),
                node("t", &[("k", Value::Null)]),
                node("k", &[]),
                node("r", &[]),
                node("s", &[]),
            ]},
        });
        assert_eq!(
            banned_chains(&metadata, "odc-policy"),
            ["odc-policy -> odc-transport -> tokio"]
        );
    }

    /// Every banned package reachable from `root` through normal dependencies, each as the
    /// shortest chain of package names that reaches it. Panics, naming what is missing, if the
    /// metadata does not have the shape `cargo metadata --format-version 1` documents.
    fn banned_chains(metadata: &Value, root: &str) -> Vec<String> {
        let packages = metadata["packages"]
            .as_array()
            .expect("metadata: no packages");
        let name_of: BTreeMap<&str, &str> = packages
            .iter()
            .filter_map(|p| Some((p["id"].as_str()?, p["name"].as_str()?)))
            .collect();
        let root_id = name_of
            .iter()
            .find(|(_, name)| **name == root)
            .map(|(id, _)| *id)
            .unwrap_or_else(|| panic!("metadata: no package {root}"));
        let nodes = metadata["resolve"]["nodes"]
            .as_array()
            .expect("metadata: no resolve.nodes (was it run with --no-deps?)");
        // Per package, its normal dependencies (a `dep_kinds` entry of kind null).
        let normal: BTreeMap<&str, Vec<&str>> = nodes
            .iter()
            .filter_map(|n| {
                let deps = n["deps"].as_array()?;
                let normal = deps
                    .iter()
                    .filter(|d| {
                        d["dep_kinds"]
                            .as_array()
                            .is_some_and(|kinds| kinds.iter().any(|k| k["kind"].is_null()))
                    })
                    .filter_map(|d| d["pkg"].as_str())
                    .collect();
                Some((n["id"].as_str()?, normal))
            })
            .collect();
        // Breadth first from the root, remembering who reached whom: the shortest chains.
        let mut reached_from: BTreeMap<&str, Option<&str>> = BTreeMap::from([(root_id, None)]);
        let mut queue = VecDeque::from([root_id]);
        let mut chains = Vec::new();
        while let Some(id) = queue.pop_front() {
            let name = name_of.get(id).copied().unwrap_or(id);
            if BANNED.contains(&name) {
                let mut chain = vec![name];
                let mut at = id;
                while let Some(Some(from)) = reached_from.get(at) {
                    chain.push(name_of.get(from).copied().unwrap_or(from));
                    at = from;
                }
                chain.reverse();
                chains.push(chain.join(" -> "));
                continue;
            }
            for &dep in normal.get(id).into_iter().flatten() {
                if !reached_from.contains_key(dep) {
                    reached_from.insert(dep, Some(id));
                    queue.push_back(dep);
                }
            }
        }
        chains
    }
}
