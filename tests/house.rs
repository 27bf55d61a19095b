//! The house's floors, checked on the resolved dependency graph (`cargo metadata`: every normal
//! dependency, transitively, with the features the workspace turns on). Each crate below may
//! reach only what its floor allows; a test names the chain of packages that breaks a rule.
//! Dev-dependencies and build scripts do not count: they are not part of what links against a
//! crate.
//!
//! - `odc-policy` is pure: no actor framework, no async runtime (nothing it depends on is
//!   ractor, ractor_cluster, tokio, futures or async-trait, so no file of it can name them).
//! - `odc-model` is a leaf: candle, `odc-kernels`, `odc-text` and `odc-policy`'s layout, never
//!   the runtime (`odc-actors`, `odc-transport`, ractor, tokio) nor the root crate.
//! - `odc-text` knows no model and no runtime.
//! - `odc-checkpoint` (the checkpoint files) sits below the runtime: no actors, transport or
//!   async runtime.
//! - The workspace's default build needs no Python: no crate reaches pyo3 with the features it
//!   turns on (odc-python's `python`, which maturin turns on, is off).

use std::collections::{BTreeMap, VecDeque};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

/// The workspace's resolved graph, read once.
fn metadata() -> &'static Value {
    static METADATA: OnceLock<Value> = OnceLock::new();
    METADATA.get_or_init(|| {
        // This platform's dependencies only: the others' sources need not be here (offline).
        let version = cargo(&["-vV"]);
        let host = String::from_utf8_lossy(&version)
            .lines()
            .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
            .expect("`cargo -vV` names no host");
        let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
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
        serde_json::from_slice(&json).expect("`cargo metadata` printed no JSON")
    })
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

/// Fails, naming every chain, if `root` reaches one of `banned`.
fn assert_reaches_none(root: &str, banned: &[&str], rule: &str) {
    let chains = banned_chains(metadata(), root, banned);
    assert!(
        chains.is_empty(),
        "{root} must {rule}, but it depends on:\n{}",
        chains.join("\n")
    );
}

#[test]
fn dependency_graph_reaches_no_actor_framework_or_async_runtime() {
    assert_reaches_none(
        "odc-policy",
        &[
            "ractor",
            "ractor_cluster",
            "tokio",
            "futures",
            "async-trait",
        ],
        "stay pure",
    );
}

#[test]
fn the_default_build_needs_no_python() {
    for root in ["odc", "odc-python", "odc-bench"] {
        assert_reaches_none(
            root,
            &["pyo3", "pyo3-ffi", "pyo3-build-config"],
            "build without Python",
        );
    }
}

#[test]
fn the_model_is_a_leaf_that_never_reaches_the_runtime() {
    assert_reaches_none(
        "odc-model",
        &[
            "odc",
            "odc-actors",
            "odc-transport",
            "ractor",
            "ractor_cluster",
            "tokio",
        ],
        "be a leaf (the model meets the runtime only in odc::compute)",
    );
}

#[test]
fn text_reaches_no_model_and_no_runtime() {
    assert_reaches_none(
        "odc-text",
        &[
            "odc",
            "odc-model",
            "candle-core",
            "odc-actors",
            "odc-transport",
            "tokio",
        ],
        "know no model and no runtime",
    );
}

#[test]
fn the_checkpoint_files_sit_below_the_runtime() {
    assert_reaches_none(
        "odc-checkpoint",
        &[
            "odc",
            "odc-actors",
            "odc-transport",
            "ractor",
            "tokio",
            "candle-core",
        ],
        "sit below the runtime (its servers write through it)",
    );
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
        banned_chains(&metadata, "odc-policy", &["tokio", "ractor"]),
        ["odc-policy -> odc-transport -> tokio"]
    );
}

/// Every package of `banned` reachable from `root` through normal dependencies, each as the
/// shortest chain of package names that reaches it. Panics, naming what is missing, if the
/// metadata does not have the shape `cargo metadata --format-version 1` documents.
fn banned_chains(metadata: &Value, root: &str, banned: &[&str]) -> Vec<String> {
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
        if id != root_id && banned.contains(&name) {
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
