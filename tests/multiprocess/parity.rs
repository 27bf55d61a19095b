//! (a) Four processes over `tcp` and over `shm` train to the parameters of one process (I3), in
//! on-demand and in collective mode.

use std::time::Duration;

use crate::harness::*;

/// Four processes over `transport` with `extra` flags train to one process's parameters; rank
/// 0's output.
fn four_processes_equal_one(transport: &str, extra: &[&str]) -> String {
    let (want, want_loss) = single(4, 4, extra);
    let path = temp(&format!("{transport}.params"));
    let mut cmd = odc();
    cmd.args([
        "launch",
        "--nprocs",
        "4",
        "--transport",
        transport,
        "--timeout-secs",
        "150",
        "--",
    ])
    .arg(embed())
    .args(common_args())
    .args(extra)
    .arg("--save-params")
    .arg(&path);
    let out = run(cmd, Duration::from_secs(180));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{transport}: {stdout}\n{stderr}");
    // Every rank reports the same final loss and parameter norm.
    let finals = finals(&stdout);
    assert_eq!(finals.len(), 4, "one final line per rank: {stdout}");
    assert!(finals.iter().all(|f| f == &finals[0]), "{finals:?}");
    let (loss, _) = finals[0];
    assert!(
        ((loss - want_loss) / want_loss).abs() <= 1e-6,
        "{transport}: loss {loss} vs one process {want_loss}"
    );
    // The per-step lines come from rank 0 only.
    let steps = stdout.lines().filter(|l| l.starts_with("step ")).count();
    assert_eq!(steps.to_string(), STEPS, "{stdout}");
    assert_same_params(&params(&path), &want, transport);
    stdout.into_owned()
}

#[test]
fn four_processes_over_tcp_train_to_the_single_process_parameters() {
    four_processes_equal_one("tcp", &[]);
}

#[test]
fn four_processes_over_shm_train_to_the_single_process_parameters() {
    four_processes_equal_one("shm", &[]);
}

#[test]
fn four_processes_in_collective_mode_train_to_the_single_process_parameters() {
    four_processes_equal_one("shm", &["--communication", "collective"]);
}

/// Pushes relayed through the node (ranks 0–1 and 2–3 as two nodes) over `shm`, with a static
/// plan, so relays flush as soon as their node's writes are in (the expectation crosses
/// processes; every step reports some; `netns.rs` relays under dynamic dispatch, at the barrier).
#[test]
fn four_processes_relaying_pushes_train_to_the_single_process_parameters() {
    let stdout = four_processes_equal_one("shm", &["--relay-pushes", "2", "--dispatch", "static"]);
    let early: Vec<u32> = stdout
        .lines()
        .filter(|l| l.starts_with("step "))
        .filter_map(|l| l.split("early relay flushes ").nth(1)?.trim().parse().ok())
        .collect();
    assert_eq!(early.len().to_string(), STEPS, "{stdout}");
    assert!(
        early.iter().all(|&e| e > 0),
        "early flushes per step {early:?}"
    );
}
