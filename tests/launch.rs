//! `odc launch` as a user runs it: real child processes, their environment, the worst exit
//! status, the grace period after a failure, the timeout, restarts (`--max-restarts`,
//! `ODC_RESTART_COUNT`), and bad input.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The multi-process tests' helpers: finding the `odc` binary, waiting under a deadline.
#[allow(dead_code)]
#[path = "multiprocess/harness.rs"]
mod harness;

/// `odc launch`, for its flags to be added.
fn launch() -> Command {
    let mut command = harness::odc();
    command.arg("launch");
    command
}

/// `command` run to its end: its output. Killed (failing the test) past a minute (I6).
fn finished(command: &mut Command) -> Output {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("odc launch runs");
    harness::wait(child, Duration::from_secs(60))
}

#[test]
fn every_rank_gets_its_environment_and_the_worst_status_is_returned() {
    let out = finished(
        launch()
            .args(["--nprocs", "3", "--transport", "tcp", "--", "sh", "-c"])
            .arg("echo rank=$ODC_RANK world=$ODC_WORLD_SIZE coord=$ODC_COORDINATOR t=$ODC_TRANSPORT job=$ODC_JOB secret=${#ODC_SECRET}; exit $ODC_RANK"),
    );
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

/// `--insecure-frames` gives every rank `ODC_INSECURE_FRAMES=1`; without it the launcher sets
/// nothing (a rank's own environment decides, sealed by default).
#[test]
fn insecure_frames_are_asked_for_every_rank_only_with_the_flag() {
    let ranks = |insecure: bool| {
        let mut command = launch();
        command.args(["--nprocs", "2", "--transport", "tcp"]);
        if insecure {
            command.arg("--insecure-frames");
        }
        command
            .args([
                "--",
                "sh",
                "-c",
                "echo frames=${ODC_INSECURE_FRAMES:-unset}",
            ])
            .env_remove("ODC_INSECURE_FRAMES");
        let out = finished(&mut command);
        assert_eq!(out.status.code(), Some(0));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(ranks(true).matches("frames=1").count(), 2);
    assert_eq!(ranks(false).matches("frames=unset").count(), 2);
}

#[test]
fn a_failed_rank_stops_the_others_after_the_grace_period() {
    let started = Instant::now();
    let out = finished(
        launch()
            .args(["--nprocs", "2", "--grace-secs", "0.3", "--", "sh", "-c"])
            .arg("if [ $ODC_RANK = 0 ]; then exit 7; else sleep 60; fi"),
    );
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
    let out = finished(launch().args([
        "--nprocs",
        "2",
        "--timeout-secs",
        "0.3",
        "--grace-secs",
        "0.3",
        "--",
        "sleep",
        "60",
    ]));
    assert_eq!(out.status.code(), Some(124));
}

#[test]
fn bad_input_is_one_clear_error() {
    let missing = finished(launch().args(["--nprocs", "1", "--", "/nonexistent/program"]));
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        stderr.contains("cannot start rank 0 (/nonexistent/program)"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "said once: {stderr}");

    let zero = finished(launch().args(["--nprocs", "0", "--", "true"]));
    assert_eq!(zero.status.code(), Some(2), "clap refuses --nprocs 0");
    let no_program = finished(launch().args(["--nprocs", "2"]));
    assert_eq!(no_program.status.code(), Some(2));
}

/// `field=value` of a `key=value ...` line.
fn value<'a>(line: &'a str, key: &str) -> &'a str {
    line.split(' ')
        .find_map(|f| f.strip_prefix(key).and_then(|f| f.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

/// Runs `script` under `odc launch --nprocs 3 --max-restarts <restarts>`; the status, the
/// stdout lines sorted, and stderr.
fn launch_restarting(restarts: u32, script: &str) -> (Option<i32>, Vec<String>, String) {
    let out = finished(
        launch()
            .args(["--nprocs", "3", "--transport", "tcp"])
            .args(["--grace-secs", "0.3", "--max-restarts"])
            .arg(restarts.to_string())
            .args(["--", "sh", "-c", script]),
    );
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    lines.sort_unstable();
    (
        out.status.code(),
        lines,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Rank 1 fails on the first attempt only; the others wait to be stopped on it.
const FAILS_ONCE: &str = "echo attempt=$ODC_RESTART_COUNT rank=$ODC_RANK coord=$ODC_COORDINATOR job=$ODC_JOB secret=$ODC_SECRET; \
     if [ $ODC_RESTART_COUNT = 0 ]; then if [ $ODC_RANK = 1 ]; then exit 3; else sleep 30; fi; fi";

#[test]
fn max_restarts_starts_every_rank_again_after_a_failure() {
    let (status, lines, stderr) = launch_restarting(1, FAILS_ONCE);
    assert_eq!(status, Some(0), "the second attempt succeeded: {stderr}");
    assert_eq!(lines.len(), 6, "two attempts of 3 ranks: {lines:?}");
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(value(line, "attempt"), (i / 3).to_string(), "{line}");
        assert_eq!(value(line, "rank"), (i % 3).to_string(), "{line}");
    }
    // A fresh coordinator per attempt; one job id and secret for the whole launch.
    assert_ne!(value(&lines[0], "coord"), value(&lines[3], "coord"));
    for (i, line) in lines.iter().enumerate() {
        let first_of_attempt = &lines[i / 3 * 3];
        assert_eq!(value(line, "coord"), value(first_of_attempt, "coord"));
        assert_eq!(value(line, "job"), value(&lines[0], "job"));
        assert_eq!(value(line, "secret"), value(&lines[0], "secret"));
    }
    assert!(
        stderr.contains("rank 1 failed with status 3; restarting every rank (restart 1 of 1)"),
        "the restart is logged with the failed rank and its status: {stderr}"
    );

    // Without restarts: the failure is the result.
    let (status, lines, stderr) = launch_restarting(0, FAILS_ONCE);
    assert_eq!(status, Some(3), "{stderr}");
    assert_eq!(lines.len(), 3, "one attempt: {lines:?}");
    assert!(
        lines.iter().all(|l| l.starts_with("attempt=0 ")),
        "{lines:?}"
    );
    assert!(!stderr.contains("restarting"), "{stderr}");
}

#[test]
fn the_last_attempts_status_is_the_result_and_the_timeout_bounds_every_restart() {
    // Rank 0 fails every time, with 10 + the attempt number.
    let (status, lines, stderr) = launch_restarting(
        2,
        "echo attempt=$ODC_RESTART_COUNT; if [ $ODC_RANK = 0 ]; then exit $((10 + ODC_RESTART_COUNT)); fi",
    );
    assert_eq!(status, Some(12), "the third attempt's status: {stderr}");
    assert_eq!(lines.len(), 9, "three attempts of 3 ranks: {lines:?}");
    assert!(stderr.contains("(restart 2 of 2)"), "{stderr}");
    assert!(!stderr.contains("(restart 3 of"), "{stderr}");

    // Failing forever with restarts to spare: the timeout ends the whole launch.
    let started = Instant::now();
    let out = finished(
        launch()
            .args(["--nprocs", "2", "--grace-secs", "0.3"])
            .args(["--timeout-secs", "1.5", "--max-restarts", "1000"])
            .args(["--", "sh", "-c", "sleep 0.2; exit 1"]),
    );
    assert_eq!(
        out.status.code(),
        Some(124),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the timeout bounds the restarts"
    );
}
