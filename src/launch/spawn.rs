//! `odc launch`: start a local multi-process job, like `torchrun --standalone --nproc-per-node N`.
//!
//! Each of the `nprocs` children gets `ODC_RANK`, `ODC_WORLD_SIZE`, `ODC_LOCAL_RANK`,
//! `ODC_LOCAL_WORLD_SIZE`, `ODC_COORDINATOR` (a free loopback port for rank 0), `ODC_SECRET` (fresh
//! and random per launch), `ODC_JOB` (unique per launch; names shared-memory files) and
//! `ODC_TRANSPORT`, and inherits stdin/stdout/stderr. The launcher then waits:
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
    /// Stop everything after this long.
    pub timeout: Option<Duration>,
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

/// Start the children, wait for them as described in the module doc, return the exit status.
pub async fn launch(config: &LaunchConfig) -> Result<i32, LaunchError> {
    const MAX: u32 = 4096;
    if config.nprocs == 0 || config.nprocs > MAX {
        return Err(LaunchError::Nprocs {
            got: config.nprocs,
            max: MAX,
        });
    }
    let port = free_port().map_err(LaunchError::Port)?;
    let secret = odc_transport::ClusterSecret::random().expose();
    let job = format!("odc{}x{:08x}", std::process::id(), rand::random::<u32>());
    let (tx, mut exits) = mpsc::unbounded_channel::<(u32, i32)>();
    let mut pids = Vec::new();
    for rank in 0..config.nprocs {
        let mut child = Command::new(&config.program)
            .args(&config.args)
            .env("ODC_RANK", rank.to_string())
            .env("ODC_WORLD_SIZE", config.nprocs.to_string())
            .env("ODC_LOCAL_RANK", rank.to_string())
            .env("ODC_LOCAL_WORLD_SIZE", config.nprocs.to_string())
            .env("ODC_COORDINATOR", format!("127.0.0.1:{port}"))
            .env("ODC_SECRET", &secret)
            .env("ODC_JOB", &job)
            .env("ODC_TRANSPORT", &config.transport)
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
    drop(tx);
    Ok(supervise(config, &pids, &mut exits).await)
}

/// Why the launcher is stopping the children.
#[derive(Clone, Copy)]
enum Stop {
    Failed,
    TimedOut,
    Signalled(i32),
}

async fn supervise(
    config: &LaunchConfig,
    pids: &[u32],
    exits: &mut mpsc::UnboundedReceiver<(u32, i32)>,
) -> i32 {
    let n = pids.len();
    let mut done = vec![false; n];
    let mut worst = 0;
    let mut stop: Option<Stop> = None;
    // When the next escalation happens: SIGTERM once the grace after a failure ends, then SIGKILL.
    let mut escalate_at: Option<tokio::time::Instant> = None;
    let mut terminated = false;
    let deadline = config.timeout.map(|t| tokio::time::Instant::now() + t);
    let far = tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
    let mut interrupt =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).ok();
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    while done.iter().any(|d| !d) {
        tokio::select! {
            exit = exits.recv() => {
                let Some((rank, status)) = exit else { break };
                done[rank as usize] = true;
                if status != 0 {
                    eprintln!("odc launch: rank {rank} exited with status {status}");
                }
                // Children the launcher stopped do not hide the status of the one that failed.
                let stopped_by_us = terminated
                    && (status == 128 + libc::SIGTERM || status == 128 + libc::SIGKILL);
                if !stopped_by_us {
                    worst = worst.max(status);
                }
                if status != 0 && stop.is_none() {
                    stop = Some(Stop::Failed);
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
                eprintln!("odc launch: timed out; stopping every rank");
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
    match stop {
        Some(Stop::TimedOut) => TIMED_OUT,
        Some(Stop::Signalled(code)) => code,
        Some(Stop::Failed) | None => worst,
    }
}
