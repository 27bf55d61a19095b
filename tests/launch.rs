//! `odc launch` as a user runs it: real child processes, their environment, the worst exit
//! status, the grace period after a failure, the timeout, and bad input.

use std::process::Command;
use std::time::{Duration, Instant};

fn odc() -> Command {
    Command::new(env!("CARGO_BIN_EXE_odc"))
}

#[test]
fn every_rank_gets_its_environment_and_the_worst_status_is_returned() {
    let out = odc()
        .args(["launch", "--nprocs", "3", "--transport", "tcp", "--", "sh", "-c"])
        .arg("echo rank=$ODC_RANK world=$ODC_WORLD_SIZE coord=$ODC_COORDINATOR t=$ODC_TRANSPORT job=$ODC_JOB secret=${#ODC_SECRET}; exit $ODC_RANK")
        .output()
        .expect("odc launch runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(2),
        "worst of 0, 1, 2; stdout: {stdout}"
    );
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort_unstable();
    assert_eq!(lines.len(), 3, "{stdout}");
    for (rank, line) in lines.iter().enumerate() {
        assert!(
            line.starts_with(&format!("rank={rank} world=3 coord=127.0.0.1:")),
            "{line}"
        );
        assert!(line.contains(" t=tcp job=odc"), "{line}");
        assert!(
            line.ends_with("secret=64"),
            "a 32-byte random secret in hex: {line}"
        );
    }
    // One job id and one coordinator for all ranks.
    let field = |line: &str, key: &str| {
        line.split(' ')
            .find(|f| f.starts_with(key))
            .map(str::to_owned)
    };
    assert!(lines
        .iter()
        .all(|l| field(l, "job=") == field(lines[0], "job=")));
    assert!(lines
        .iter()
        .all(|l| field(l, "coord=") == field(lines[0], "coord=")));
}

#[test]
fn a_failed_rank_stops_the_others_after_the_grace_period() {
    let started = Instant::now();
    let out = odc()
        .args([
            "launch",
            "--nprocs",
            "2",
            "--grace-secs",
            "0.3",
            "--",
            "sh",
            "-c",
        ])
        .arg("if [ $ODC_RANK = 0 ]; then exit 7; else sleep 60; fi")
        .output()
        .expect("odc launch runs");
    assert_eq!(
        out.status.code(),
        Some(7),
        "the failed rank's status, not the SIGTERM of the one stopped: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "did not wait for the sleeper"
    );
}

#[test]
fn timeout_stops_every_rank_with_124() {
    let out = odc()
        .args([
            "launch",
            "--nprocs",
            "2",
            "--timeout-secs",
            "0.3",
            "--grace-secs",
            "0.3",
            "--",
            "sleep",
            "60",
        ])
        .output()
        .expect("odc launch runs");
    assert_eq!(out.status.code(), Some(124));
}

#[test]
fn bad_input_is_one_clear_error() {
    let missing = odc()
        .args(["launch", "--nprocs", "1", "--", "/nonexistent/program"])
        .output()
        .expect("odc launch runs");
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        stderr.contains("cannot start rank 0 (/nonexistent/program)"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "said once: {stderr}");

    let zero = odc()
        .args(["launch", "--nprocs", "0", "--", "true"])
        .output()
        .expect("odc launch runs");
    assert_eq!(zero.status.code(), Some(2), "clap refuses --nprocs 0");
    let no_program = odc()
        .args(["launch", "--nprocs", "2"])
        .output()
        .expect("odc launch runs");
    assert_eq!(no_program.status.code(), Some(2));
}
