//! The pure policy cores the actors drive: every decision the runtime makes about work, with no
//! actor, no async runtime and no clock behind it.
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
//! - [`stats`]: what a step reports; [`clock`]: [`Timestamp`](clock::Timestamp) and the
//!   [`Clock`](clock::Clock) the actors inject.
//!
//! Rules every module here follows (the first is checked by a test below):
//! - **no actor framework, no async runtime** (neither is named in any file here): nothing here
//!   spawns, sends or awaits; the actors translate messages into calls and execute what comes back;
//! - **no clock reads**: time comes in as an argument (`now: Timestamp`, or seconds measured by the
//!   caller), so every decision is a function of its inputs and is unit-tested as such. The one
//!   exception is [`clock::SystemClock`], the implementation the actors inject;
//! - **decisions carry reasons**: every [`step::Decision`] names why it was taken
//!   ([`step::Reason`]), printable for logs and comparable in tests.

pub mod balancer;
pub mod clock;
pub mod dispatch;
pub mod gather;
pub mod ledger;
pub mod membership;
pub mod recovery;
pub mod schedule;
pub mod stats;
pub mod step;
pub mod straggler;
pub mod token;

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    /// Every `.rs` file under `dir`, recursively.
    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    /// docs/design.md: nothing under `actors/src/policy/` imports the actor framework or the async
    /// runtime; no file here even names them. Walks the directory at test time, so a file added
    /// later is covered too.
    #[test]
    fn policy_files_name_no_actor_framework_or_async_runtime() {
        let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src/policy"));
        let mut files = Vec::new();
        rust_files(root, &mut files);
        assert!(
            files.iter().any(|f| f.ends_with("policy/mod.rs")),
            "walked {files:?}"
        );
        // Spelled in two halves so this file does not trip its own check.
        let banned = [concat!("rac", "tor"), concat!("tok", "io")];
        let mut offenders = Vec::new();
        for file in &files {
            let text = std::fs::read_to_string(file).expect("readable source");
            for (n, line) in text.lines().enumerate() {
                let lower = line.to_lowercase();
                if banned.iter().any(|word| lower.contains(word)) {
                    offenders.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
                }
            }
        }
        assert!(
            offenders.is_empty(),
            "policy must stay pure:\n{}",
            offenders.join("\n")
        );
    }
}
