//! (c) a trainer rank killed mid-minibatch, (d) a server rank killed, (e) a rank with the wrong
//! secret — in real processes started rank by rank, so one can be killed.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::harness::*;

/// The supervisor must notice a killed rank within this (it is a closed session: ~ms).
const NOTICE_DEADLINE: Duration = Duration::from_secs(2);

struct Ranks {
    children: Vec<Option<Child>>,
}

impl Ranks {
    /// Start `world` ranks of `embed` with `args`; rank `r` gets `secrets[r]`.
    fn start(world: u32, transport: &str, secrets: &[&str], args: &[String]) -> Self {
        let coordinator = format!("127.0.0.1:{}", free_port());
        let job = format!("t{}x{}", std::process::id(), free_port());
        let children = (0..world)
            .map(|rank| {
                let mut cmd = Command::new(embed());
                rank_env(
                    &mut cmd,
                    rank,
                    world,
                    &coordinator,
                    secrets[rank as usize],
                    &job,
                    transport,
                );
                cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
                Some(cmd.spawn().expect("a rank starts"))
            })
            .collect();
        Ranks { children }
    }

    /// Rank 0's stdout, line by line, as it comes (the rest is collected at the end).
    fn take_stdout(&mut self, rank: usize) -> std::process::ChildStdout {
        self.children[rank]
            .as_mut()
            .and_then(|c| c.stdout.take())
            .expect("piped stdout")
    }

    fn kill(&mut self, rank: usize) -> SystemTime {
        let child = self.children[rank].as_mut().expect("running");
        // SAFETY: plain FFI call on a pid we own.
        let rc = unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        assert_eq!(rc, 0, "SIGKILL rank {rank}");
        SystemTime::now()
    }

    /// Wait for every rank; (status, stdout, stderr) per rank.
    fn wait(mut self, limit: Duration) -> Vec<(Option<i32>, String, String)> {
        self.children
            .iter_mut()
            .map(|c| {
                let out = wait(c.take().expect("a child"), limit);
                (
                    out.status.code(),
                    String::from_utf8_lossy(&out.stdout).into_owned(),
                    String::from_utf8_lossy(&out.stderr).into_owned(),
                )
            })
            .collect()
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for child in self.children.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Read `stdout` until a line starting with `prefix`; every line read.
fn read_until(
    stdout: std::process::ChildStdout,
    prefix: &str,
) -> (Vec<String>, BufReader<std::process::ChildStdout>) {
    let mut reader = BufReader::new(stdout);
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        let n = reader
            .read_line(&mut line)
            .expect("reading rank 0's stdout");
        assert!(n > 0, "rank 0 ended before printing {prefix:?}: {lines:?}");
        let done = line.starts_with(prefix);
        lines.push(line);
        if done {
            return (lines, reader);
        }
    }
}

fn rest(mut reader: BufReader<std::process::ChildStdout>, mut lines: Vec<String>) -> String {
    let mut tail = String::new();
    std::io::Read::read_to_string(&mut reader, &mut tail).expect("rank 0's stdout");
    lines.push(tail);
    lines.concat()
}

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

#[test]
fn a_trainer_rank_killed_mid_minibatch_is_replayed_without_it() {
    // Rank 3 hosts only trainer 3: killing it loses a trainer, not a shard.
    let roles = [
        "--servers-on",
        "0,1,2",
        "--trainers-on",
        "0,1,2,3",
        "--on-trainer-failure",
        "drop",
    ];
    let (want, want_loss) = single(4, 3, &["--on-trainer-failure", "drop"]);
    let path = temp("killed-trainer.params");
    let mut args = flags(&roles);
    args.extend([
        "--compute-delay-ms".into(),
        "40".into(),
        "--save-params".into(),
    ]);
    args.push(path.display().to_string());
    let secret = "s3cret-trainer-kill";
    let mut ranks = Ranks::start(4, "tcp", &[secret; 4], &args);
    let stdout = ranks.take_stdout(0);
    let (lines, reader) = read_until(stdout, "step   1 ");
    // Step 2 is computing now (each micro-batch takes 40 ms or more): kill rank 3 inside it.
    std::thread::sleep(Duration::from_millis(80));
    let killed_at = ranks.kill(3);
    let results = ranks.wait(Duration::from_secs(120));
    let stdout0 = rest(reader, lines);
    let (status0, _, stderr0) = &results[0];
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
    assert!(replays >= 1, "a step was replayed: {stdout0}");
    // I2: exactly-once accounting; the parameters equal the failure-free run's.
    let finals = finals(&stdout0);
    assert_eq!(finals.len(), 1, "{stdout0}");
    assert!(
        ((finals[0].0 - want_loss) / want_loss).abs() <= 1e-6,
        "{finals:?} vs {want_loss}"
    );
    assert_same_params(&params(&path), &want, "after a killed trainer rank");
    eprintln!(
        "trainer rank killed: noticed after {:.1} ms, {replays} replay(s)",
        latency * 1e3
    );
}

#[test]
fn a_server_rank_killed_stops_the_job_naming_the_rank_and_the_shard() {
    let args = flags(&["--compute-delay-ms", "40"]);
    let secret = "s3cret-server-kill";
    let mut ranks = Ranks::start(4, "tcp", &[secret; 4], &args);
    let stdout = ranks.take_stdout(0);
    let (lines, reader) = read_until(stdout, "step   1 ");
    std::thread::sleep(Duration::from_millis(80));
    ranks.kill(2);
    let results = ranks.wait(Duration::from_secs(60));
    let stdout0 = rest(reader, lines);
    let (status0, _, stderr0) = &results[0];
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
    assert!(finals(&stdout0).is_empty(), "{stdout0}");
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
