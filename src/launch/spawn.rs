//! `odc launch`: start a local multi-process job, like `torchrun --standalone --nproc-per-node N`.
//!
//! Each of the `nprocs` children gets `ODC_RANK`, `ODC_WORLD_SIZE`, `ODC_LOCAL_RANK`,
//! `ODC_LOCAL_WORLD_SIZE`, `ODC_COORDINATOR` (a free loopback port for rank 0), `ODC_SECRET` (fresh
//! and random per launch), `ODC_JOB` (unique per launch; names shared-memory files) and
//! `ODC_TRANSPORT` (and `ODC_INSECURE_FRAMES=1` with `--insecure-frames`), and inherits
//! stdin/stdout/stderr. The launcher then waits:
//! - when every child has exited, it returns the **worst** exit status among them (a child killed
//!   by a signal counts as 128 + the signal, as shells report it);
//! - when one child fails, the others get `grace` to finish on their own (they usually notice the
//!   lost peer and stop with their own error), then SIGTERM, then after another `grace` SIGKILL;
//!   children the launcher had to stop do not count towards the worst status (their status would
//!   hide the one that failed first);
//! - past `timeout` (if given) every child is stopped the same way and the result is 124;
//! - on SIGINT or SIGTERM to the launcher the children are stopped the same way and the result
//!   is 130 (SIGINT) or 143 (SIGTERM).
//!
//! **Elastic restart** (`max_restarts`, torchrun's `--max-restarts`): when a child fails (a
//! non-zero exit or a signal), once every child of that attempt has ended (stopped as above) the
//! launcher starts the whole group again, up to `max_restarts` times, and logs which rank failed
//! with which status. Each attempt gets a fresh coordinator port and `ODC_RESTART_COUNT` = its
//! number (0 for the first); `ODC_JOB` and `ODC_SECRET` stay the same for the whole launch (so
//! the shared-memory files a killed rank left are swept by the next attempt's ranks). The result
//! is the last attempt's. A timeout or a signal to the launcher is not restarted, and `timeout`
//! bounds the whole launch, restarts included. The program resumes from its own checkpoints
//! (`examples/sft --resume auto`); the launcher restores nothing.
//!
//! Each rank runs in its own process group: stopping a rank signals the group, so what the rank
//! started (a shell's children) stops with it.
//!
//! No wait is unbounded but the children's own run time when no timeout is given (like torchrun).

use std::time::Duration;

use tokio::process::Command;
use tokio::sync::mpsc;

/// What to start.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    pub nprocs: u32,
    /// `ODC_TRANSPORT` for the children (`shm`, `tcp`).
    pub transport: String,
    pub program: String,
    pub args: Vec<String>,
    /// How long the others may run on after one child failed, and after SIGTERM.
    pub grace: Duration,
    /// Stop everything after this long (the whole launch, restarts included).
    pub timeout: Option<Duration>,
    /// Start the whole group again after a failed attempt, at most this many times.
    pub max_restarts: u32,
    /// `ODC_INSECURE_FRAMES=1` for every child: data-plane frames unsealed.
    pub insecure_frames: bool,
}

/// The launch could not start.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("--nprocs must be between 1 and {max}, got {got}")]
    Nprocs { got: u32, max: u32 },
    #[error("cannot find a free port for the coordinator: {0}")]
    Port(std::io::Error),
    #[error("cannot start rank {rank} ({program}): {source}")]
    Spawn {
        rank: u32,
        program: String,
        source: std::io::Error,
    },
}

/// Result when the launch timed out.
pub const TIMED_OUT: i32 = 124;

/// A child's end, as a shell reports it.
fn code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => 1,
    }
}

/// Signal the process group of a rank (the rank and everything it started).
fn signal(pid: Option<u32>, sig: i32) {
    if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()).filter(|p| *p > 0) {
        // SAFETY: kill(2) on the process group led by a child this process started (it is its
        // own group leader); a group outlives its leader only while members remain, so the id
        // names this rank's processes.
        unsafe {
            libc::kill(-pid, sig);
        }
    }
}

/// A free loopback port (bound and released; rank 0 binds it next).
fn free_port() -> std::io::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// Start the children, wait for them as described in the module doc (restarting the group after
/// a failure, up to `max_restarts` times), return the exit status.
pub async fn launch(config: &LaunchConfig) -> Result<i32, LaunchError> {
    const MAX: u32 = 4096;
    if config.nprocs == 0 || config.nprocs > MAX {
        return Err(LaunchError::Nprocs {
            got: config.nprocs,
            max: MAX,
        });
    }
    let secret = odc_transport::ClusterSecret::random().expose();
    let job = format!("odc{}x{:08x}", std::process::id(), rand::random::<u32>());
    let deadline = config.timeout.map(|t| tokio::time::Instant::now() + t);
    // Installed once: a signal between two attempts is seen by the next one.
    let mut signals = Signals {
        interrupt: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).ok(),
        terminate: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok(),
    };
    let mut restart = 0;
    loop {
        let mut attempt = start(config, &secret, &job, restart)?;
        let end = supervise(config, &mut attempt, deadline, &mut signals).await;
        match end.failed {
            Some((rank, status))
                if end.stop == Some(Stop::Failed) && restart < config.max_restarts =>
            {
                restart += 1;
                say(format!(
                    "odc launch: rank {rank} failed with status {status}; restarting every rank \
                     (restart {restart} of {})",
                    config.max_restarts
                ));
            }
            _ => return Ok(end.status),
        }
    }
}

/// Writes `line` and its newline to stderr in one `write`: the ranks share the launcher's stderr,
/// and a line the launcher wrote in pieces (`eprintln!` on the unbuffered stderr writes its
/// arguments one by one) could be cut by a rank's line between them.
fn say(mut line: String) {
    use std::io::Write as _;
    line.push('\n');
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// The ranks of one attempt.
struct Attempt {
    /// By rank.
    pids: Vec<u32>,
    /// (rank, exit status) as each rank ends.
    exits: mpsc::UnboundedReceiver<(u32, i32)>,
}

/// Start attempt `restart` of the group.
fn start(
    config: &LaunchConfig,
    secret: &str,
    job: &str,
    restart: u32,
) -> Result<Attempt, LaunchError> {
    let port = free_port().map_err(LaunchError::Port)?;
    let (tx, exits) = mpsc::unbounded_channel::<(u32, i32)>();
    let mut pids = Vec::new();
    for rank in 0..config.nprocs {
        let mut command = Command::new(&config.program);
        if config.insecure_frames {
            command.env("ODC_INSECURE_FRAMES", "1");
        }
        let mut child = command
            .args(&config.args)
            .env("ODC_RANK", rank.to_string())
            .env("ODC_WORLD_SIZE", config.nprocs.to_string())
            .env("ODC_LOCAL_RANK", rank.to_string())
            .env("ODC_LOCAL_WORLD_SIZE", config.nprocs.to_string())
            .env("ODC_COORDINATOR", format!("127.0.0.1:{port}"))
            .env("ODC_SECRET", secret)
            .env("ODC_JOB", job)
            .env("ODC_TRANSPORT", &config.transport)
            .env("ODC_RESTART_COUNT", restart.to_string())
            .kill_on_drop(true)
            // Its own process group, so stopping a rank stops what it started too.
            .process_group(0)
            .spawn()
            .map_err(|source| {
                // Those already started are killed as their handles drop.
                for pid in &pids {
                    signal(Some(*pid), libc::SIGKILL);
                }
                LaunchError::Spawn {
                    rank,
                    program: config.program.clone(),
                    source,
                }
            })?;
        pids.push(child.id().unwrap_or(0));
        let tx = tx.clone();
        tokio::spawn(async move {
            let status = match child.wait().await {
                Ok(status) => code(status),
                Err(_) => 1,
            };
            let _ = tx.send((rank, status));
        });
    }
    Ok(Attempt { pids, exits })
}

/// The launcher's own SIGINT and SIGTERM (None where they could not be installed).
struct Signals {
    interrupt: Option<tokio::signal::unix::Signal>,
    terminate: Option<tokio::signal::unix::Signal>,
}

/// Why the launcher is stopping the children.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stop {
    Failed,
    TimedOut,
    Signalled(i32),
}

/// How one attempt ended.
struct End {
    /// The attempt's exit status (module doc).
    status: i32,
    stop: Option<Stop>,
    /// The first child that failed, and its status.
    failed: Option<(u32, i32)>,
}

async fn supervise(
    config: &LaunchConfig,
    attempt: &mut Attempt,
    deadline: Option<tokio::time::Instant>,
    signals: &mut Signals,
) -> End {
    let Attempt { pids, exits } = attempt;
    let n = pids.len();
    let mut done = vec![false; n];
    let mut worst = 0;
    let mut stop: Option<Stop> = None;
    let mut failed = None;
    // When the next escalation happens: SIGTERM once the grace after a failure ends, then SIGKILL.
    let mut escalate_at: Option<tokio::time::Instant> = None;
    let mut terminated = false;
    let far = tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
    let Signals {
        interrupt,
        terminate,
    } = signals;
    while done.iter().any(|d| !d) {
        tokio::select! {
            exit = exits.recv() => {
                let Some((rank, status)) = exit else { break };
                done[rank as usize] = true;
                if status != 0 {
                    say(format!("odc launch: rank {rank} exited with status {status}"));
                }
                // Children the launcher stopped do not hide the status of the one that failed.
                let stopped_by_us = terminated
                    && (status == 128 + libc::SIGTERM || status == 128 + libc::SIGKILL);
                if !stopped_by_us {
                    worst = worst.max(status);
                }
                if status != 0 && stop.is_none() {
                    stop = Some(Stop::Failed);
                    failed = Some((rank, status));
                    escalate_at = Some(tokio::time::Instant::now() + config.grace);
                }
            }
            _ = tokio::time::sleep_until(escalate_at.unwrap_or(far)), if escalate_at.is_some() => {
                let sig = if terminated { libc::SIGKILL } else { libc::SIGTERM };
                for (rank, pid) in pids.iter().enumerate() {
                    if !done[rank] {
                        signal(Some(*pid), sig);
                    }
                }
                terminated = true;
                escalate_at = Some(tokio::time::Instant::now() + config.grace);
            }
            _ = tokio::time::sleep_until(deadline.unwrap_or(far)), if deadline.is_some() && stop.is_none() => {
                say("odc launch: timed out; stopping every rank".into());
                stop = Some(Stop::TimedOut);
                escalate_at = Some(tokio::time::Instant::now());
            }
            Some(()) = async { match interrupt.as_mut() { Some(s) => s.recv().await, None => std::future::pending().await } }, if stop.is_none() => {
                stop = Some(Stop::Signalled(130));
                escalate_at = Some(tokio::time::Instant::now());
            }
            Some(()) = async { match terminate.as_mut() { Some(s) => s.recv().await, None => std::future::pending().await } }, if stop.is_none() => {
                stop = Some(Stop::Signalled(143));
                escalate_at = Some(tokio::time::Instant::now());
            }
        }
    }
    let status = match stop {
        Some(Stop::TimedOut) => TIMED_OUT,
        Some(Stop::Signalled(code)) => code,
        Some(Stop::Failed) | None => worst,
    };
    End {
        status,
        stop,
        failed,
    }
}
