//! (c) a trainer rank killed mid-minibatch, (c') one stopped (SIGSTOP) and found by the heartbeat,
//! (d) a server rank killed, (e) a rank with the wrong secret — in real processes started rank by
//! rank, so one can be killed or stopped.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::harness::*;

/// The supervisor must notice a killed rank within this (it is a closed session: ~ms).
const NOTICE_DEADLINE: Duration = Duration::from_secs(2);

/// Seconds into the UTC day of a tracing line's timestamp (`2026-11-23T03:40:34.365105Z ...`).
fn log_seconds_of_day(line: &str) -> Option<f64> {
    let time = line.split('T').nth(1)?.split('Z').next()?;
    let mut parts = time.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

fn seconds_of_day(t: SystemTime) -> f64 {
    let d = t.duration_since(UNIX_EPOCH).expect("after the epoch");
    (d.as_secs() % 86_400) as f64 + f64::from(d.subsec_nanos()) * 1e-9
}

fn flags(extra: &[&str]) -> Vec<String> {
    let mut args = common_args();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// A lost trainer's micro-batches are replayed on the trainers left.
const DROP: [&str; 2] = ["--on-trainer-failure", "drop"];

/// Rank 3 hosts only trainer 3, so losing it loses a trainer, not a shard: the flags of such a
/// job (with [`DROP`]), and the failure-free single-process run's parameters and final loss.
fn lone_trainer_on_rank_3() -> (Vec<String>, Vec<f32>, f64) {
    let mut args = flags(&["--servers-on", "0,1,2", "--trainers-on", "0,1,2,3"]);
    args.extend(DROP.map(String::from));
    let (want, want_loss) = single(4, 3, &DROP);
    (args, want, want_loss)
}

/// Rank 0's output shows at least one replayed step, and its final loss and parameters (saved at
/// `path`) equal the failure-free run's (I2); the number of replays.
fn replayed_to_the_reference(
    stdout0: &str,
    path: &std::path::Path,
    want: &[f32],
    want_loss: f64,
    after: &str,
) -> u32 {
    let replays: u32 = stdout0
        .lines()
        .filter_map(|l| {
            l.split("replays ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse::<u32>()
                .ok()
        })
        .sum();
    assert!(replays >= 1, "a step was replayed after {after}: {stdout0}");
    let finals = finals(stdout0);
    assert_eq!(finals.len(), 1, "{stdout0}");
    assert!(
        ((finals[0].0 - want_loss) / want_loss).abs() <= 1e-6,
        "after {after}: {finals:?} vs {want_loss}"
    );
    assert_same_params(&params(path), want, &format!("after {after}"));
    replays
}

#[test]
fn a_trainer_rank_killed_mid_minibatch_is_replayed_without_it() {
    let (mut args, want, want_loss) = lone_trainer_on_rank_3();
    let path = temp("killed-trainer.params");
    args.extend([
        "--compute-delay-ms".into(),
        "40".into(),
        "--save-params".into(),
    ]);
    args.push(path.display().to_string());
    let secret = "s3cret-trainer-kill-0123456789";
    let ranks = Ranks::start(4, "tcp", &[secret; 4], &args);
    // Step 2 is computing 80 ms after step 1's line (each micro-batch takes 40 ms or more): kill
    // rank 3 inside it.
    let (killed_at, results) = ranks.kill_during(
        "step   1 ",
        Duration::from_millis(80),
        3,
        Duration::from_secs(120),
    );
    let (status0, stdout0, stderr0) = &results[0];
    assert_eq!(*status0, Some(0), "rank 0: {stdout0}\n{stderr0}");
    for (rank, (status, _, stderr)) in results.iter().enumerate().take(3).skip(1) {
        assert_eq!(*status, Some(0), "rank {rank}: {stderr}");
    }
    assert_eq!(results[3].0, None, "rank 3 was killed by a signal");
    // The supervisor noticed, within the deadline, and replayed the step without rank 3.
    let notice = stderr0
        .lines()
        .find(|l| l.contains("trainer 3 failed") && l.contains("rank 3 left the job"))
        .unwrap_or_else(|| panic!("rank 0 logs the lost trainer: {stderr0}"));
    let latency = log_seconds_of_day(notice).expect("a timestamp") - seconds_of_day(killed_at);
    assert!(
        latency < NOTICE_DEADLINE.as_secs_f64(),
        "noticed {latency:.3} s after the kill (deadline {NOTICE_DEADLINE:?}): {notice}"
    );
    // I2: exactly-once accounting; the parameters equal the failure-free run's.
    let replays =
        replayed_to_the_reference(stdout0, &path, &want, want_loss, "a killed trainer rank");
    eprintln!(
        "trainer rank killed: noticed after {:.1} ms, {replays} replay(s)",
        latency * 1e3
    );
}

/// The heartbeat of the stopped-rank test: short, so the test is quick.
const HEARTBEAT_INTERVAL_MS: u64 = 200;
const HEARTBEAT_TIMEOUT_MS: u64 = 2_000;

#[test]
fn a_stopped_trainer_rank_is_lost_by_its_heartbeat_and_replayed_without_it() {
    // SIGSTOP keeps rank 3's sockets open, so only the heartbeat can tell it from a slow rank.
    let (mut args, want, want_loss) = lone_trainer_on_rank_3();
    let path = temp("stopped-trainer.params");
    for (flag, value) in [
        ("--compute-delay-ms", "40".to_string()),
        ("--heartbeat-interval-ms", HEARTBEAT_INTERVAL_MS.to_string()),
        ("--heartbeat-timeout-ms", HEARTBEAT_TIMEOUT_MS.to_string()),
        ("--save-params", path.display().to_string()),
    ] {
        args.extend([flag.to_string(), value]);
    }
    let secret = "s3cret-trainer-stop-0123456789";
    let mut ranks = Ranks::start(4, "tcp", &[secret; 4], &args);
    let stdout = ranks.take_stdout(0);
    let (mut lines, mut reader) = read_until(stdout, "step   1 ");
    // Step 2 is computing now: stop rank 3 inside it.
    std::thread::sleep(Duration::from_millis(80));
    let stopped_at = ranks.signal(3, libc::SIGSTOP);
    // Step 2 completes without it (after the timeout and a replay); then rank 3 wakes up, with
    // its old micro-batch and its old session, while the job goes on.
    read_more(&mut reader, &mut lines, "step   2 ");
    ranks.signal(3, libc::SIGCONT);
    let results = ranks.wait(Duration::from_secs(120));
    let stdout0 = rest(reader, lines);
    let (status0, _, stderr0) = &results[0];
    assert_eq!(*status0, Some(0), "rank 0: {stdout0}\n{stderr0}");
    for (rank, (status, _, stderr)) in results.iter().enumerate().take(3).skip(1) {
        assert_eq!(*status, Some(0), "rank {rank}: {stderr}");
    }
    let (status3, _, stderr3) = &results[3];
    assert_ne!(
        *status3,
        Some(0),
        "rank 3, woken up after it was lost, ends with an error: {stderr3}"
    );
    let notice = stderr0
        .lines()
        .find(|l| l.contains("rank 3 is lost") && l.contains("heartbeat"))
        .unwrap_or_else(|| panic!("rank 0 logs the silent rank: {stderr0}"));
    let latency = log_seconds_of_day(notice).expect("a timestamp") - seconds_of_day(stopped_at);
    // Silence is counted from the last answer, which came up to an interval before the stop;
    // the tick that sees it comes up to an interval after the timeout.
    let timeout = HEARTBEAT_TIMEOUT_MS as f64 / 1e3;
    let interval = HEARTBEAT_INTERVAL_MS as f64 / 1e3;
    assert!(
        latency >= timeout - interval - 0.2 && latency < timeout + interval + 1.5,
        "lost {latency:.3} s after SIGSTOP (timeout {timeout} s, interval {interval} s): {notice}"
    );
    assert!(
        stderr0.contains("trainer 3 failed"),
        "the supervisor handles it as a lost trainer: {stderr0}"
    );
    // I2 across the stop and the late wake-up: the failure-free run's parameters.
    let replays =
        replayed_to_the_reference(&stdout0, &path, &want, want_loss, "a stopped trainer rank");
    eprintln!(
        "trainer rank stopped: lost after {latency:.3} s (timeout {timeout} s), {replays} replay(s)"
    );
}

#[test]
fn a_server_rank_killed_stops_the_job_naming_the_rank_and_the_shard() {
    let args = flags(&["--compute-delay-ms", "40"]);
    let secret = "s3cret-server-kill-0123456789";
    let ranks = Ranks::start(4, "tcp", &[secret; 4], &args);
    let (_, results) = ranks.kill_during(
        "step   1 ",
        Duration::from_millis(80),
        2,
        Duration::from_secs(60),
    );
    let (status0, stdout0, stderr0) = &results[0];
    assert_ne!(*status0, Some(0), "rank 0 fails: {stdout0}");
    let error = stderr0
        .lines()
        .find(|l| l.starts_with("Error:"))
        .unwrap_or_else(|| panic!("rank 0 prints its error: {stderr0}"));
    for needle in [
        "shard server 2",
        "rank 2 left the job",
        "shard 2 of every unit",
    ] {
        assert!(error.contains(needle), "{needle:?} in: {error}");
    }
    // The other ranks stop too, with the same error, instead of waiting forever.
    for rank in [1, 3] {
        let (status, _, stderr) = &results[rank];
        assert_ne!(*status, Some(0), "rank {rank}: {stderr}");
        assert!(stderr.contains("shard server 2"), "rank {rank}: {stderr}");
    }
    assert!(finals(stdout0).is_empty(), "{stdout0}");
}

#[test]
fn a_rank_with_the_wrong_secret_is_refused_before_anything_starts() {
    let args = flags(&["--join-timeout-secs", "5"]);
    let ranks = Ranks::start(
        2,
        "tcp",
        &["the-secret-of-this-job", "not-the-secret-of-this-job"],
        &args,
    );
    let results = ranks.wait(Duration::from_secs(60));
    let (status1, _, stderr1) = &results[1];
    assert_ne!(*status1, Some(0), "rank 1 is refused");
    assert!(
        stderr1.contains("cluster secret"),
        "rank 1 says why: {stderr1}"
    );
    let (status0, stdout0, stderr0) = &results[0];
    assert_ne!(*status0, Some(0), "rank 0 cannot start the job: {stdout0}");
    assert!(
        stderr0.contains("missing: rank 1"),
        "rank 0 names the missing rank: {stderr0}"
    );
    // Nothing trained, so no shard server ever published a region.
    assert!(!stdout0.contains("step "), "{stdout0}");
}
