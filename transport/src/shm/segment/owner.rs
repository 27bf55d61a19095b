//! The process a segment names (pid and start time), whether it is gone, and the sweep that
//! removes the segments of owners that are.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use super::layout::{get_u32, get_u64, HEADER_USED, MAGIC, OFF_MAGIC, OFF_PID, OFF_START_TIME};
use super::name::parse_any_name;

/// The owner a segment names: pid and process start time (0 = unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Owner {
    pub(super) pid: u32,
    pub(super) start_time: u64,
}

impl Owner {
    pub(super) fn current() -> Self {
        let pid = std::process::id();
        Self {
            pid,
            start_time: process_start_time(pid).unwrap_or(0),
        }
    }
}

/// Start time of process `pid` (field 22 of `/proc/<pid>/stat`, clock ticks since boot).
pub(super) fn process_start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 2 (comm) is parenthesized and may contain spaces and ')': fields 3.. follow the last ')'.
    let after = stat.get(stat.rfind(')')? + 1..)?;
    after.split_ascii_whitespace().nth(22 - 3)?.parse().ok()
}

/// Whether a process `pid` exists (also when it belongs to another user).
pub(super) fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 sends nothing; `kill` only checks that the process exists and may be
    // signalled. `pid > 0`, so it names one process, never a process group.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Whether the owner recorded for a segment is gone: its pid is dead, or alive but started at
/// another time (a reused pid). Unknown start times count as "same process".
pub(crate) fn owner_gone(pid: u32, recorded_start: Option<u64>) -> bool {
    if !pid_alive(pid) {
        return true;
    }
    match (recorded_start, process_start_time(pid)) {
        (Some(recorded), Some(actual)) if recorded != 0 => recorded != actual,
        _ => false,
    }
}

/// Opens an existing segment file for reading without following a symlink or blocking on a FIFO,
/// and requires a regular file.
pub(super) fn open_regular(path: &Path) -> io::Result<(File, fs::Metadata)> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a regular file",
        ));
    }
    Ok((file, meta))
}

/// The owner's start time recorded in the header of the file at `path`, if the header is
/// readable, has our magic and names `pid`; with the file's (device, inode).
pub(super) fn recorded_start_time(path: &Path, pid: u32) -> Option<(u64, (u64, u64))> {
    let (mut file, meta) = open_regular(path).ok()?;
    let mut header = [0u8; HEADER_USED];
    file.read_exact(&mut header).ok()?;
    (header[OFF_MAGIC..OFF_MAGIC + 8] == MAGIC && get_u32(&header, OFF_PID) == pid)
        .then(|| (get_u64(&header, OFF_START_TIME), (meta.dev(), meta.ino())))
}

/// Removes the segments (and leftover temporary files) in `dir` whose owner process is gone: its
/// pid is dead, or alive with another start time than the header records. `job: Some(j)` limits
/// the sweep to job `j`. Returns the file names removed. A segment whose owner is alive, or whose
/// header cannot be read while its pid is alive, is kept; files that cannot be removed (another
/// user's) are skipped.
pub(crate) fn sweep_stale(dir: &Path, job: Option<&str>) -> io::Result<Vec<String>> {
    let mut removed = Vec::new();
    for entry in fs::read_dir(dir)? {
        let Ok(entry) = entry else { continue };
        let file_name = entry.file_name();
        let Some(file_name) = file_name.to_str() else {
            continue;
        };
        let Some((parsed, _temp)) = parse_any_name(file_name) else {
            continue;
        };
        if job.is_some_and(|j| j != parsed.job) {
            continue;
        }
        let path = entry.path();
        let Ok(before) = fs::symlink_metadata(&path) else {
            continue;
        };
        let identity = (before.dev(), before.ino());
        let recorded = recorded_start_time(&path, parsed.pid);
        if recorded.is_some_and(|(_, opened)| opened != identity) {
            continue; // replaced while we looked
        }
        if !owner_gone(parsed.pid, recorded.map(|(start, _)| start)) {
            continue;
        }
        // Narrow the window in which a new segment of the same name could have replaced the
        // stale one: unlink only the file that was judged.
        match fs::symlink_metadata(&path) {
            Ok(now) if (now.dev(), now.ino()) == identity => {}
            _ => continue,
        }
        if fs::remove_file(&path).is_ok() {
            removed.push(file_name.to_string());
        }
    }
    Ok(removed)
}
