//! Shared-memory segments: one file per published region, read one-sidedly by other processes of
//! the same host under a seqlock per chunk.
//!
//! An owner (shard server) creates a segment with [`SegmentWriter::create`] and replaces its data
//! with [`SegmentWriter::publish`]; a reader in any process of the same host maps the file
//! read-only with [`SegmentReader::open`] and copies byte ranges straight out of the mapping with
//! [`SegmentReader::read`], without involving the owner. Files live in a directory passed to every
//! function (`/dev/shm` in production, so the pages are plain shared memory).
//!
//! # File name
//! `odc-{job}-{owner_pid}-{region}` ([`segment_name`], parsed back by [`parse_segment_name`]):
//! `job` matches `[A-Za-z0-9_.-]{1,64}`, `owner_pid` and `region` are canonical decimals. While the
//! owner fills a new segment it lives under the temporary name `.{name}~{n}` and is then hard-linked
//! to its final name, which fails if that name exists (`O_EXCL` semantics: a segment is never
//! silently reused) — a reader never sees a half-written header. Files are created mode `0600`:
//! readers run as the owner's user.
//!
//! # Layout (native byte order and alignment: a segment never leaves its host)
//! ```text
//! offset                      size            contents
//! 0                           4096            header page (below; the rest of the page is zero)
//! 4096 + 64·c                 64 per chunk    control of chunk c: seq: u64 at +0, version: u64 at +8
//! 4096 + 64·chunks            elements·elem   data, 64-byte aligned, chunk c = bytes [c·chunk, (c+1)·chunk)
//! ```
//! Header page: `0` magic `b"ODCSHM01"`; `8` layout version (u32, [`LAYOUT_VERSION`]); `12` element
//! size in bytes (u32, ≥ 1); `16` owner pid (u32); `20` job id length (u32, 1..=64); `24` owner
//! process start time (u64, field 22 of `/proc/<pid>/stat`, clock ticks since boot; 0 = unknown);
//! `32` region id (u64); `40` element count (u64); `48` chunk size in bytes (u64, a positive
//! multiple of 8 and of the element size); `56` chunk count (u64, `max(1, ⌈data / chunk⌉)`: an
//! empty segment still has one control pair, which carries its version); `64` data offset (u64);
//! `72` total file length (u64); `80` job id (64 bytes, zero padded). The header is written before
//! the file gets its final name and never changes afterwards.
//!
//! [`SegmentReader::open`] trusts nothing in the file: magic, layout version, job id (against the
//! name and the expected job), owner pid and region (against the name) and every size are checked
//! with checked arithmetic, and the derived fields and the file's length must all agree, before any
//! slice is made. It opens with `O_NOFOLLOW | O_NONBLOCK` and requires a regular file, so a
//! planted symlink or FIFO is an error, not a hang. A corrupt or hostile file is a
//! [`SegmentError`] naming what is wrong, never a panic. (What cannot be defended against is a
//! process of the owner's user truncating a file while it is mapped: accesses past the new end
//! raise `SIGBUS`. The owner never truncates.)
//!
//! # Seqlock (the transport contract's C1: a read observes one whole publication, never a mix)
//! Each chunk's control pair is [`crate::seqlock`]'s seq and version words (little-endian);
//! [`SegmentWriter::publish`] is its writer, one at a time under a mutex. A read over several
//! chunks first tries the whole range as one attempt of the three-phase reader, handing the
//! *whole* range to `copy` in one call (the C library's `memcpy` switches to non-temporal stores
//! only for a single large copy, which pieces of one chunk each never get); a publication in
//! progress, or one that ran during the copy, falls back to the chunk-by-chunk reader, which
//! follows a writer that never pauses and redoes every piece. Waits end at the deadline: a
//! writer that died in the middle of a publication is [`SegmentError::Deadline`], not a hang.
//!
//! `copy(src, offset_in_range)` receives a slice of the live mapping, so it can see bytes that are
//! being overwritten; such a copy is always redone (same offset) before the read returns, so a
//! caller that writes `src` into its destination at `offset_in_range` ends up consistent. `copy`
//! must not act on the bytes otherwise (e.g. accumulate them) before the read returns.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::ops::Range;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use memmap2::{Mmap, MmapMut};
use parking_lot::Mutex;

use crate::seqlock;

/// First 8 bytes of every segment.
pub(crate) const MAGIC: [u8; 8] = *b"ODCSHM01";
/// Layout version in the header; a reader refuses any other.
pub(crate) const LAYOUT_VERSION: u32 = 1;
/// Size of the header page; the control words start right after it.
pub(crate) const HEADER_BYTES: usize = 4096;
/// Stride of the per-chunk control pairs (one cache line each, so chunks don't false-share).
pub(crate) const CONTROL_STRIDE: usize = 64;
/// Longest job id.
pub(crate) const MAX_JOB_LEN: usize = 64;

const NAME_PREFIX: &str = "odc-";
/// Separates a temporary name from its counter (`.{name}~{n}`); not in the job id alphabet.
const TEMP_SEPARATOR: char = '~';

// Header field offsets.
const OFF_MAGIC: usize = 0;
const OFF_LAYOUT: usize = 8;
const OFF_ELEM_SIZE: usize = 12;
const OFF_PID: usize = 16;
const OFF_JOB_LEN: usize = 20;
const OFF_START_TIME: usize = 24;
const OFF_REGION: usize = 32;
const OFF_ELEMENTS: usize = 40;
const OFF_CHUNK_BYTES: usize = 48;
const OFF_CHUNKS: usize = 56;
const OFF_DATA: usize = 64;
const OFF_TOTAL: usize = 72;
const OFF_JOB: usize = 80;
/// The owner's data-plane endpoint (u32), after the job id.
const OFF_ENDPOINT: usize = OFF_JOB + MAX_JOB_LEN;
/// The owner's transport instance (u64), so a handle of another instance never reads this one.
const OFF_INSTANCE: usize = OFF_ENDPOINT + 8;
/// The region id the owner's handles carry (u64), so a handle naming another region never reads
/// this one through its segment name.
const OFF_HANDLE_ID: usize = OFF_INSTANCE + 8;
/// Bytes of the header page that carry fields.
const HEADER_USED: usize = OFF_HANDLE_ID + 8;
/// The one header word that changes: 0 while the segment is live, 1 once its owner dropped it
/// (set before the file is unlinked, so a reader that mapped it earlier learns the region is
/// gone). On the header page's last cache line.
const OFF_STATE: usize = HEADER_BYTES - CONTROL_STRIDE;

/// Offset of the version word within a control pair.
const CONTROL_VERSION: usize = 8;

/// Everything that can go wrong with a segment. Each variant names the segment (or path).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SegmentError {
    #[error("shared-memory segment I/O on {path}: {error}")]
    Io { path: String, error: String },
    #[error("segment {name} is not usable: {what}")]
    BadHeader { name: String, what: String },
    #[error("segment {name} belongs to job {found:?}, expected job {expected:?}")]
    WrongJob {
        name: String,
        expected: String,
        found: String,
    },
    #[error("segment {name} already exists and its owner (pid {pid}) is alive")]
    Exists { name: String, pid: u32 },
    #[error(
        "byte range {start}..{end} is out of bounds or not element aligned for segment {name} \
         of {len} bytes in {elem_size}-byte elements"
    )]
    OutOfRange {
        name: String,
        start: usize,
        end: usize,
        len: usize,
        elem_size: usize,
    },
    #[error("{found} bytes given for segment {name} of {expected} bytes")]
    LengthMismatch {
        name: String,
        expected: usize,
        found: usize,
    },
    #[error(
        "read of segment {name} missed its deadline (a publication in progress, or an owner \
         that died in the middle of one)"
    )]
    Deadline { name: String },
    #[error("invalid segment parameters: {what}")]
    Invalid { what: String },
}

fn io_error(path: &Path, error: &io::Error) -> SegmentError {
    SegmentError::Io {
        path: path.display().to_string(),
        error: error.to_string(),
    }
}

/// The parts of a segment file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SegmentName {
    pub(crate) job: String,
    pub(crate) pid: u32,
    pub(crate) region: u64,
}

/// `odc-{job}-{pid}-{region}`.
pub(crate) fn segment_name(job: &str, pid: u32, region: u64) -> String {
    format!("{NAME_PREFIX}{job}-{pid}-{region}")
}

/// Parses a name made by [`segment_name`]; `None` for anything else (including a job id outside
/// `[A-Za-z0-9_.-]{1,64}`, a pid of 0 or above `i32::MAX`, and non-canonical numbers).
pub(crate) fn parse_segment_name(name: &str) -> Option<SegmentName> {
    let rest = name.strip_prefix(NAME_PREFIX)?;
    let (rest, region) = rest.rsplit_once('-')?;
    let (job, pid) = rest.rsplit_once('-')?;
    if !job_is_valid(job) {
        return None;
    }
    let pid: u32 = pid.parse().ok()?;
    let region: u64 = region.parse().ok()?;
    if pid == 0 || libc::pid_t::try_from(pid).is_err() || segment_name(job, pid, region) != name {
        return None;
    }
    Some(SegmentName {
        job: job.to_string(),
        pid,
        region,
    })
}

/// Parses a final name or a temporary one (`.{name}~{n}`); the flag says which.
fn parse_any_name(name: &str) -> Option<(SegmentName, bool)> {
    if let Some(rest) = name.strip_prefix('.') {
        let (base, n) = rest.rsplit_once(TEMP_SEPARATOR)?;
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        return parse_segment_name(base).map(|parsed| (parsed, true));
    }
    parse_segment_name(name).map(|parsed| (parsed, false))
}

pub(crate) fn job_is_valid(job: &str) -> bool {
    (1..=MAX_JOB_LEN).contains(&job.len())
        && job
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// Sizes and offsets derived from the shape, all checked to fit (in `usize`, and below
/// `isize::MAX` so every slice and every `chunk · (index + 1)` is representable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    elem_size: usize,
    elements: usize,
    chunk_bytes: usize,
    chunks: usize,
    data_bytes: usize,
    data_offset: usize,
    total: usize,
}

impl Geometry {
    /// Checks a shape; the error says what is wrong.
    fn new(elem_size: u64, elements: u64, chunk_bytes: u64) -> Result<Self, String> {
        const LIMIT: u64 = isize::MAX as u64;
        if elem_size == 0 || elem_size > u64::from(u32::MAX) {
            return Err(format!("element size {elem_size} is not in 1..=2^32-1"));
        }
        if chunk_bytes == 0 || chunk_bytes % 8 != 0 || chunk_bytes % elem_size != 0 {
            return Err(format!(
                "chunk size {chunk_bytes} is not a positive multiple of 8 and of the element size {elem_size}"
            ));
        }
        if chunk_bytes > LIMIT {
            return Err(format!("chunk size {chunk_bytes} is too large"));
        }
        let too_large = || format!("{elements} elements of {elem_size} bytes are too large");
        let data_bytes = elements.checked_mul(elem_size).ok_or_else(too_large)?;
        let chunks = data_bytes.div_ceil(chunk_bytes).max(1);
        let total = chunks
            .checked_mul(CONTROL_STRIDE as u64)
            .and_then(|control| control.checked_add(HEADER_BYTES as u64))
            .and_then(|data_offset| data_offset.checked_add(data_bytes))
            .filter(|&total| total <= LIMIT)
            .ok_or_else(too_large)?;
        let size = |v: u64| usize::try_from(v).map_err(|_| too_large());
        let chunks = size(chunks)?;
        Ok(Self {
            elem_size: size(elem_size)?,
            elements: size(elements)?,
            chunk_bytes: size(chunk_bytes)?,
            chunks,
            data_bytes: size(data_bytes)?,
            data_offset: HEADER_BYTES + chunks * CONTROL_STRIDE,
            total: size(total)?,
        })
    }

    /// Offset of chunk `c`'s control pair.
    fn control(&self, c: usize) -> usize {
        HEADER_BYTES + c * CONTROL_STRIDE
    }

    /// Data byte range of chunk `c` (`c < chunks`; empty for the one chunk of an empty segment).
    fn chunk_range(&self, c: usize) -> Range<usize> {
        let start = (c * self.chunk_bytes).min(self.data_bytes);
        start..(start + self.chunk_bytes).min(self.data_bytes)
    }
}

/// The owner a segment names: pid and process start time (0 = unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Owner {
    pid: u32,
    start_time: u64,
}

impl Owner {
    fn current() -> Self {
        let pid = std::process::id();
        Self {
            pid,
            start_time: process_start_time(pid).unwrap_or(0),
        }
    }
}

/// Start time of process `pid` (field 22 of `/proc/<pid>/stat`, clock ticks since boot).
fn process_start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 2 (comm) is parenthesized and may contain spaces and ')': fields 3.. follow the last ')'.
    let after = stat.get(stat.rfind(')')? + 1..)?;
    after.split_ascii_whitespace().nth(22 - 3)?.parse().ok()
}

/// Whether a process `pid` exists (also when it belongs to another user).
fn pid_alive(pid: u32) -> bool {
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
fn open_regular(path: &Path) -> io::Result<(File, fs::Metadata)> {
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
fn recorded_start_time(path: &Path, pid: u32) -> Option<(u64, (u64, u64))> {
    let (mut file, meta) = open_regular(path).ok()?;
    let mut header = [0u8; HEADER_USED];
    file.read_exact(&mut header).ok()?;
    (header[OFF_MAGIC..OFF_MAGIC + 8] == MAGIC && get_u32(&header, OFF_PID) == pid)
        .then(|| (get_u64(&header, OFF_START_TIME), (meta.dev(), meta.ino())))
}

fn get_u32(bytes: &[u8], off: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[off..off + 4]);
    u32::from_ne_bytes(word)
}

fn get_u64(bytes: &[u8], off: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[off..off + 8]);
    u64::from_ne_bytes(word)
}

fn put(bytes: &mut [u8], off: usize, value: &[u8]) {
    bytes[off..off + value.len()].copy_from_slice(value);
}

/// Removes the file at `path` when dropped.
struct RemoveOnDrop<'a>(&'a Path);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = fs::remove_file(self.0);
    }
}

/// Owner side of a segment: creates the file, publishes into it, and unlinks it when dropped
/// (readers that mapped it keep reading the last publication).
#[derive(Debug)]
pub(crate) struct SegmentWriter {
    name: String,
    path: PathBuf,
    /// (device, inode) of the file, so `Drop` never unlinks a file that replaced it.
    identity: (u64, u64),
    geometry: Geometry,
    /// The read-write mapping; the mutex makes publications single-writer.
    map: Mutex<MmapMut>,
    version: AtomicU64,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl SegmentWriter {
    /// Creates segment `segment_name(job, <this pid>, region)` in `dir` holding `initial`
    /// (`elements · elem_size` bytes) at `version`. A segment of that name whose owner is gone is
    /// replaced; one whose owner is alive is [`SegmentError::Exists`].
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create(
        dir: &Path,
        job: &str,
        region: u64,
        elem_size: usize,
        elements: usize,
        chunk_bytes: usize,
        initial: &[u8],
        version: u64,
    ) -> Result<Self, SegmentError> {
        Self::create_for(
            dir,
            job,
            0,
            0,
            0,
            region,
            elem_size,
            elements,
            chunk_bytes,
            initial,
            version,
        )
    }

    /// [`SegmentWriter::create`] for the data-plane endpoint `endpoint`, transport instance
    /// `instance` and handle region id `handle_id`, recorded in the header so readers refuse a
    /// handle naming another owner, instance or region.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create_for(
        dir: &Path,
        job: &str,
        endpoint: u32,
        instance: u64,
        handle_id: u64,
        region: u64,
        elem_size: usize,
        elements: usize,
        chunk_bytes: usize,
        initial: &[u8],
        version: u64,
    ) -> Result<Self, SegmentError> {
        let shape = Shape {
            elem_size,
            elements,
            chunk_bytes,
            endpoint,
            instance,
            handle_id,
        };
        Self::create_as(dir, job, region, shape, initial, version, Owner::current())
    }

    fn create_as(
        dir: &Path,
        job: &str,
        region: u64,
        shape: Shape,
        initial: &[u8],
        version: u64,
        owner: Owner,
    ) -> Result<Self, SegmentError> {
        if !job_is_valid(job) {
            return Err(SegmentError::Invalid {
                what: format!("job id {job:?} is not [A-Za-z0-9_.-]{{1,{MAX_JOB_LEN}}}"),
            });
        }
        let wide = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        let geometry = Geometry::new(
            wide(shape.elem_size),
            wide(shape.elements),
            wide(shape.chunk_bytes),
        )
        .map_err(|what| SegmentError::Invalid { what })?;
        let name = segment_name(job, owner.pid, region);
        if initial.len() != geometry.data_bytes {
            return Err(SegmentError::LengthMismatch {
                name,
                expected: geometry.data_bytes,
                found: initial.len(),
            });
        }
        let path = dir.join(&name);
        // A fresh temporary name; one can be taken by a leftover of an earlier process that had
        // this pid, so move on to the next counter then.
        let (temp, file) = {
            let mut attempts = 0;
            loop {
                let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
                let temp = dir.join(format!(".{name}{TEMP_SEPARATOR}{n}"));
                match OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&temp)
                {
                    Ok(file) => break (temp, file),
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempts < 16 => {
                        attempts += 1;
                    }
                    Err(e) => return Err(io_error(&temp, &e)),
                }
            }
        };
        let remove_temp = RemoveOnDrop(&temp);
        file.set_len(wide(geometry.total))
            .map_err(|e| io_error(&temp, &e))?;
        // SAFETY: the file was just created by us under a fresh name and sized; nothing else
        // writes it (it is mode 0600 and only the owner ever maps it writable), and it is never
        // truncated while mapped.
        let mut map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| io_error(&temp, &e))?;
        if map.len() != geometry.total {
            return Err(SegmentError::Io {
                path: temp.display().to_string(),
                error: format!("mapped {} bytes, expected {}", map.len(), geometry.total),
            });
        }

        put(&mut map, OFF_MAGIC, &MAGIC);
        put(&mut map, OFF_LAYOUT, &LAYOUT_VERSION.to_ne_bytes());
        // `Geometry::new` checked that the element size fits in u32.
        let elem_size = u32::try_from(geometry.elem_size).unwrap_or(u32::MAX);
        put(&mut map, OFF_ELEM_SIZE, &elem_size.to_ne_bytes());
        put(&mut map, OFF_PID, &owner.pid.to_ne_bytes());
        let job_len = u32::try_from(job.len()).unwrap_or(u32::MAX);
        put(&mut map, OFF_JOB_LEN, &job_len.to_ne_bytes());
        put(&mut map, OFF_START_TIME, &owner.start_time.to_ne_bytes());
        put(&mut map, OFF_REGION, &region.to_ne_bytes());
        put(
            &mut map,
            OFF_ELEMENTS,
            &wide(geometry.elements).to_ne_bytes(),
        );
        put(
            &mut map,
            OFF_CHUNK_BYTES,
            &wide(geometry.chunk_bytes).to_ne_bytes(),
        );
        put(&mut map, OFF_CHUNKS, &wide(geometry.chunks).to_ne_bytes());
        put(
            &mut map,
            OFF_DATA,
            &wide(geometry.data_offset).to_ne_bytes(),
        );
        put(&mut map, OFF_TOTAL, &wide(geometry.total).to_ne_bytes());
        put(&mut map, OFF_JOB, job.as_bytes());
        put(&mut map, OFF_ENDPOINT, &shape.endpoint.to_ne_bytes());
        put(&mut map, OFF_INSTANCE, &shape.instance.to_ne_bytes());
        put(&mut map, OFF_HANDLE_ID, &shape.handle_id.to_ne_bytes());
        for c in 0..geometry.chunks {
            // seq stays 0 (the file is zero-filled): even, stable.
            put(
                &mut map,
                geometry.control(c) + CONTROL_VERSION,
                &version.to_ne_bytes(),
            );
        }
        put(&mut map, geometry.data_offset, initial);

        Self::link_exclusive(&temp, &path, &name)?;
        drop(remove_temp);
        // The identity of the inode we filled, which now carries the final name.
        let meta = file.metadata().map_err(|e| io_error(&path, &e))?;
        Ok(Self {
            name,
            path,
            identity: (meta.dev(), meta.ino()),
            geometry,
            map: Mutex::new(map),
            version: AtomicU64::new(version),
        })
    }

    /// Gives the filled temporary file its final name, failing if the name exists with a live
    /// owner; a stale file of that name is removed first.
    fn link_exclusive(temp: &Path, path: &Path, name: &str) -> Result<(), SegmentError> {
        let mut last_pid = 0;
        for _ in 0..3 {
            match fs::hard_link(temp, path) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    let pid = parse_segment_name(name).map_or(0, |parsed| parsed.pid);
                    last_pid = pid;
                    let recorded = recorded_start_time(path, pid);
                    if !owner_gone(pid, recorded.map(|(start, _)| start)) {
                        return Err(SegmentError::Exists {
                            name: name.to_string(),
                            pid,
                        });
                    }
                    match fs::remove_file(path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => return Err(io_error(path, &e)),
                    }
                }
                Err(e) => return Err(io_error(path, &e)),
            }
        }
        Err(SegmentError::Exists {
            name: name.to_string(),
            pid: last_pid,
        })
    }

    /// The segment's file name (what a reader passes to [`SegmentReader::open`]).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Replaces all data with `data` and sets every chunk's version to `version`. Data of the
    /// wrong length is [`SegmentError::LengthMismatch`] and changes nothing.
    pub(crate) fn publish(&self, version: u64, data: &[u8]) -> Result<(), SegmentError> {
        let geometry = self.geometry;
        if data.len() != geometry.data_bytes {
            return Err(SegmentError::LengthMismatch {
                name: self.name.clone(),
                expected: geometry.data_bytes,
                found: data.len(),
            });
        }
        let mut map = self.map.lock();
        let base = map.as_mut_ptr();
        let controls = MappedControls { base, geometry };
        seqlock::publish(&controls, geometry.chunks, version, |c| {
            let range = geometry.chunk_range(c);
            // SAFETY: `range` is inside `0..data_bytes`, so the source lies in `data` (its
            // length was checked) and the destination in the mapping's data area; the two
            // don't overlap (`data` is caller memory, not this mapping, which we hold
            // exclusively through the lock).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr().add(range.start),
                    base.add(geometry.data_offset + range.start),
                    range.len(),
                );
            }
        });
        self.version.store(version, Ordering::Release);
        Ok(())
    }

    /// Sets every chunk's version to `version`, the data as it is (a frozen region's next
    /// publication: no copy), inside each chunk's seqlock as [`SegmentWriter::publish`] does.
    pub(crate) fn republish(&self, version: u64) {
        let geometry = self.geometry;
        let mut map = self.map.lock();
        let controls = MappedControls {
            base: map.as_mut_ptr(),
            geometry,
        };
        seqlock::publish(&controls, geometry.chunks, version, |_| {});
        self.version.store(version, Ordering::Release);
    }

    /// For a segment whose data lives elsewhere (the `cuda` backend keeps it in device memory and
    /// its segments have no data): run `write`, which replaces that data and returns once it is in
    /// place, inside chunk 0's seqlock, as [`SegmentWriter::publish`] does with its copy, and record
    /// `version`. If `write` fails, `seq` stays odd (the data may be torn: readers wait, and miss
    /// their deadline, rather than see it) until a later publication succeeds.
    #[cfg(feature = "cuda-code")]
    pub(crate) fn publish_outside<E>(
        &self,
        version: u64,
        write: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        let mut map = self.map.lock();
        let controls = MappedControls {
            base: map.as_mut_ptr(),
            geometry: self.geometry,
        };
        seqlock::publish_outside(&controls, version, write)?;
        self.version.store(version, Ordering::Release);
        Ok(())
    }

    /// The version of the last publication (or the initial one).
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Test hook: sets chunk `chunk`'s seq word, e.g. odd, as a writer that died mid-publish
    /// leaves it.
    #[cfg(test)]
    fn poke_seq(&self, chunk: usize, value: u64) {
        assert!(chunk < self.geometry.chunks);
        let mut map = self.map.lock();
        let control = self.geometry.control(chunk);
        // SAFETY: as in `publish`: in bounds, aligned, accessed atomically only.
        let seq = unsafe { AtomicU64::from_ptr(map.as_mut_ptr().add(control).cast::<u64>()) };
        seq.store(value, Ordering::Release);
    }
}

impl Drop for SegmentWriter {
    fn drop(&mut self) {
        // Tell readers that mapped the segment earlier that the region is gone.
        {
            let mut map = self.map.lock();
            // SAFETY: OFF_STATE is 8-aligned (the mapping is page aligned) and inside the header
            // page; the word is only ever accessed atomically.
            let state =
                unsafe { AtomicU64::from_ptr(map.as_mut_ptr().add(OFF_STATE).cast::<u64>()) };
            state.store(1, Ordering::Release);
        }
        // Unlink only the file we created (a sweeper could in principle have replaced it).
        if let Ok(meta) = fs::symlink_metadata(&self.path) {
            if (meta.dev(), meta.ino()) == self.identity {
                let _ = fs::remove_file(&self.path);
            }
        }
    }
}

/// A segment's shape as given to [`SegmentWriter::create`].
#[derive(Debug, Clone, Copy)]
struct Shape {
    elem_size: usize,
    elements: usize,
    chunk_bytes: usize,
    /// The owner's data-plane endpoint and transport instance, recorded in the header.
    endpoint: u32,
    instance: u64,
    handle_id: u64,
}

/// Reader side of a segment: a read-only mapping of another (or the same) process's segment.
#[derive(Debug)]
pub(crate) struct SegmentReader {
    name: String,
    map: Mmap,
    geometry: Geometry,
    owner: Owner,
}

impl SegmentReader {
    /// Opens segment `name` in `dir` and validates it: a regular file, magic, layout version, job
    /// id equal to `job` (in the name and the header), owner pid and region equal to the name's,
    /// sane sizes, and a file length that matches the header.
    pub(crate) fn open(dir: &Path, name: &str, job: &str) -> Result<Self, SegmentError> {
        let bad = |what: String| SegmentError::BadHeader {
            name: name.to_string(),
            what,
        };
        let parsed = parse_segment_name(name).ok_or_else(|| SegmentError::Invalid {
            what: format!("{name:?} is not a segment name"),
        })?;
        if parsed.job != job {
            return Err(SegmentError::WrongJob {
                name: name.to_string(),
                expected: job.to_string(),
                found: parsed.job,
            });
        }
        let path = dir.join(name);
        let (file, meta) = open_regular(&path).map_err(|e| io_error(&path, &e))?;
        if meta.len() < HEADER_BYTES as u64 {
            return Err(bad(format!(
                "file of {} bytes is shorter than the {HEADER_BYTES}-byte header page",
                meta.len()
            )));
        }
        // SAFETY: the file is mapped read-only. Its header never changes after creation; its
        // control words and data are changed concurrently by the owner, which is what the
        // seqlock in `read` handles (data is only handed out as a copy source whose
        // consistency is checked afterwards). Only a process of the owner's user could
        // truncate it under us (SIGBUS); the owner never does.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| io_error(&path, &e))?;
        let mut header = [0u8; HEADER_USED];
        header.copy_from_slice(map.get(..HEADER_USED).ok_or_else(|| {
            bad(format!(
                "mapping of {} bytes is shorter than the header",
                map.len()
            ))
        })?);

        if header[OFF_MAGIC..OFF_MAGIC + 8] != MAGIC {
            return Err(bad(format!(
                "bad magic {:02x?}",
                &header[OFF_MAGIC..OFF_MAGIC + 8]
            )));
        }
        let layout = get_u32(&header, OFF_LAYOUT);
        if layout != LAYOUT_VERSION {
            return Err(bad(format!(
                "layout version {layout}, this build reads {LAYOUT_VERSION}"
            )));
        }
        let job_len = get_u32(&header, OFF_JOB_LEN) as usize;
        if !(1..=MAX_JOB_LEN).contains(&job_len) {
            return Err(bad(format!("job id length {job_len} is not in 1..=64")));
        }
        let found_job = &header[OFF_JOB..OFF_JOB + job_len];
        if found_job != job.as_bytes() {
            return Err(SegmentError::WrongJob {
                name: name.to_string(),
                expected: job.to_string(),
                found: String::from_utf8_lossy(found_job).into_owned(),
            });
        }
        let pid = get_u32(&header, OFF_PID);
        if pid != parsed.pid {
            return Err(bad(format!(
                "header names owner pid {pid}, the file name {}",
                parsed.pid
            )));
        }
        let region = get_u64(&header, OFF_REGION);
        if region != parsed.region {
            return Err(bad(format!(
                "header names region {region}, the file name {}",
                parsed.region
            )));
        }
        let geometry = Geometry::new(
            u64::from(get_u32(&header, OFF_ELEM_SIZE)),
            get_u64(&header, OFF_ELEMENTS),
            get_u64(&header, OFF_CHUNK_BYTES),
        )
        .map_err(bad)?;
        for (field, off, expected) in [
            ("chunk count", OFF_CHUNKS, geometry.chunks),
            ("data offset", OFF_DATA, geometry.data_offset),
            ("total length", OFF_TOTAL, geometry.total),
        ] {
            let found = get_u64(&header, off);
            if usize::try_from(found) != Ok(expected) {
                return Err(bad(format!(
                    "{field} {found} in the header, the shape implies {expected}"
                )));
            }
        }
        if map.len() != geometry.total {
            return Err(bad(format!(
                "file is {} bytes, the header implies {}",
                map.len(),
                geometry.total
            )));
        }
        if map.as_ptr().align_offset(CONTROL_STRIDE) != 0 {
            return Err(bad("mapping is not 64-byte aligned".to_string()));
        }
        Ok(Self {
            name: name.to_string(),
            map,
            geometry,
            owner: Owner {
                pid,
                start_time: get_u64(&header, OFF_START_TIME),
            },
        })
    }

    /// The segment's file name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Number of elements.
    pub(crate) fn elements(&self) -> usize {
        self.geometry.elements
    }

    /// Size of one element in bytes.
    pub(crate) fn elem_size(&self) -> usize {
        self.geometry.elem_size
    }

    /// The owner's data-plane endpoint from the header.
    pub(crate) fn endpoint(&self) -> u32 {
        let mut word = [0u8; 4];
        if let Some(bytes) = self.map.get(OFF_ENDPOINT..OFF_ENDPOINT + 4) {
            word.copy_from_slice(bytes);
        }
        u32::from_ne_bytes(word)
    }

    /// The owner's transport instance from the header.
    pub(crate) fn instance(&self) -> u64 {
        self.header_u64(OFF_INSTANCE)
    }

    /// The region id of the owner's handles, from the header.
    pub(crate) fn handle_id(&self) -> u64 {
        self.header_u64(OFF_HANDLE_ID)
    }

    fn header_u64(&self, offset: usize) -> u64 {
        let mut word = [0u8; 8];
        if let Some(bytes) = self.map.get(offset..offset + 8) {
            word.copy_from_slice(bytes);
        }
        u64::from_ne_bytes(word)
    }

    /// Whether the owner dropped the segment (its region is gone), even if this mapping lives on.
    pub(crate) fn is_closed(&self) -> bool {
        // SAFETY: `open` checked the mapping is at least the header page and 64-byte aligned, so
        // the word is in bounds and aligned; it is only loaded (allowed on read-only memory).
        let state = unsafe { &*self.map.as_ptr().add(OFF_STATE).cast::<AtomicU64>() };
        state.load(Ordering::Acquire) != 0
    }

    /// Whether the owner process recorded in the header still runs (same pid and start time).
    /// A read that misses its deadline can use this to tell a dead owner from a slow one.
    pub(crate) fn owner_alive(&self) -> bool {
        !owner_gone(self.owner.pid, Some(self.owner.start_time))
    }

    /// Chunk `c`'s (seq, version) words.
    fn control(&self, c: usize) -> (&AtomicU64, &AtomicU64) {
        let off = self.geometry.control(c);
        // SAFETY: `open` checked that the mapping is 64-aligned and exactly `geometry.total`
        // bytes long, so both words of pair `c < chunks` are in bounds and 8-aligned;
        // `AtomicU64` has the layout of `u64`. The mapping is read-only and only ever loaded
        // from through these references (plain `load`s of a lock-free native-width atomic,
        // which std documents as allowed on read-only memory); they borrow `self`, which
        // keeps the mapping alive.
        unsafe {
            let base = self.map.as_ptr();
            (
                &*base.add(off).cast::<AtomicU64>(),
                &*base.add(off + CONTROL_VERSION).cast::<AtomicU64>(),
            )
        }
    }

    /// Consistent read of the data bytes `bytes` (element aligned, within the segment): calls
    /// `copy(src, offset_in_range)` once for the whole range if all of its chunks are stable at
    /// one publication, else (and after that call, if a publication ran during it) for each chunk
    /// piece (again, same offset, if a piece was torn or belongs to another publication); returns
    /// the version of the one publication that all of the final pieces come from. An empty range
    /// returns the version of the chunk holding its start. A read that starts at or after
    /// `deadline`, or is still waiting for a stable publication then, is
    /// [`SegmentError::Deadline`].
    pub(crate) fn read(
        &self,
        bytes: Range<usize>,
        deadline: Instant,
        copy: &mut dyn FnMut(&[u8], usize),
    ) -> Result<u64, SegmentError> {
        let g = &self.geometry;
        if bytes.start > bytes.end
            || bytes.end > g.data_bytes
            || bytes.start % g.elem_size != 0
            || bytes.end % g.elem_size != 0
        {
            return Err(SegmentError::OutOfRange {
                name: self.name.clone(),
                start: bytes.start,
                end: bytes.end,
                len: g.data_bytes,
                elem_size: g.elem_size,
            });
        }
        if Instant::now() >= deadline {
            return Err(self.deadline());
        }
        let first = (bytes.start / g.chunk_bytes).min(g.chunks - 1);
        let last = if bytes.is_empty() {
            first
        } else {
            (bytes.end - 1) / g.chunk_bytes
        };
        if last > first {
            // One attempt at the whole range as one copy (the C library's `memcpy` uses
            // non-temporal stores only for a single large copy); a publication in progress or
            // one that ran meanwhile falls back to the piece-by-piece read, which redoes every
            // piece at the same offsets.
            let mut whole = WholeRange {
                reader: self,
                bytes: &bytes,
                copy: &mut *copy,
            };
            // The seqs of both checks: on the stack for ranges of up to 32 chunks (8 MiB of
            // 256 KiB chunks), so that a read allocates nothing.
            let n = last + 1 - first;
            let (mut stack, mut heap) = ([0u64; 64], Vec::new());
            let words = if n <= 32 {
                &mut stack[..2 * n]
            } else {
                heap.resize(2 * n, 0);
                &mut heap[..]
            };
            let (seqs, again) = words.split_at_mut(n);
            let Ok(attempt) = seqlock::try_read(&mut whole, first..last + 1, seqs, again);
            if let Some(version) = attempt {
                return Ok(version);
            }
        }
        seqlock::read_pieces(self, first..last + 1, deadline, |c| {
            let chunk = g.chunk_range(c);
            let piece = bytes.start.max(chunk.start)..bytes.end.min(chunk.end);
            if !piece.is_empty() {
                copy(
                    &self.map[g.data_offset + piece.start..g.data_offset + piece.end],
                    piece.start - bytes.start,
                );
            }
        })
        .map_err(|_| self.deadline())
    }

    fn deadline(&self) -> SegmentError {
        SegmentError::Deadline {
            name: self.name.clone(),
        }
    }
}

/// The whole-range phases over a mapped segment: seqs loaded from the mapping, the range handed to
/// the caller's `copy` at once.
struct WholeRange<'a, 'b> {
    reader: &'a SegmentReader,
    bytes: &'a Range<usize>,
    copy: &'b mut dyn FnMut(&[u8], usize),
}

impl seqlock::Phases for WholeRange<'_, '_> {
    type Error = std::convert::Infallible;

    fn seqs(&mut self, chunks: Range<usize>, out: &mut [u64]) -> Result<(), Self::Error> {
        for (c, o) in chunks.zip(out.iter_mut()) {
            *o = seqlock::load(self.reader.control(c).0, Ordering::Acquire);
        }
        Ok(())
    }

    fn copy(&mut self, chunks: Range<usize>) -> Result<u64, Self::Error> {
        let version = seqlock::load(self.reader.control(chunks.start).1, Ordering::Relaxed);
        let g = &self.reader.geometry;
        (self.copy)(
            &self.reader.map[g.data_offset + self.bytes.start..g.data_offset + self.bytes.end],
            0,
        );
        Ok(version)
    }
}

impl seqlock::Controls for SegmentReader {
    fn seq(&self, chunk: usize) -> &AtomicU64 {
        self.control(chunk).0
    }
    fn version(&self, chunk: usize) -> &AtomicU64 {
        self.control(chunk).1
    }
}

/// A writer's view of the control words in its (locked, mutable) mapping.
struct MappedControls {
    base: *mut u8,
    geometry: Geometry,
}

impl MappedControls {
    fn word(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: callers pass the offset of a control word of a chunk `< chunks`, which
        // `Geometry` placed inside the mapping, 8-aligned (the mapping is page aligned, the pair
        // 64-aligned). The words are only ever accessed atomically, and `self` lives only while
        // the writer holds the mapping's lock.
        unsafe { AtomicU64::from_ptr(self.base.add(offset).cast::<u64>()) }
    }
}

impl seqlock::Controls for MappedControls {
    fn seq(&self, chunk: usize) -> &AtomicU64 {
        self.word(self.geometry.control(chunk))
    }
    fn version(&self, chunk: usize) -> &AtomicU64 {
        self.word(self.geometry.control(chunk) + CONTROL_VERSION)
    }
}

impl SegmentReader {
    /// The counterpart of [`SegmentWriter::publish_outside`]: run `read` (which copies the data
    /// from where it lives) between two checks of chunk 0's seqlock, again until no publication
    /// ran during it; the version of the publication read. A `read` that fails ends the read with
    /// its error (`Ok(Err(_))`); no stable publication by `deadline` is
    /// [`SegmentError::Deadline`].
    #[cfg(feature = "cuda-code")]
    pub(crate) fn read_outside<E>(
        &self,
        deadline: Instant,
        read: &mut dyn FnMut() -> Result<(), E>,
    ) -> Result<Result<u64, E>, SegmentError> {
        struct Outside<'a, E> {
            reader: &'a SegmentReader,
            read: &'a mut dyn FnMut() -> Result<(), E>,
        }
        impl<E> seqlock::Phases for Outside<'_, E> {
            type Error = E;
            fn seqs(&mut self, _: Range<usize>, out: &mut [u64]) -> Result<(), E> {
                out[0] = seqlock::load(self.reader.control(0).0, Ordering::Acquire);
                Ok(())
            }
            fn copy(&mut self, _: Range<usize>) -> Result<u64, E> {
                let version = seqlock::load(self.reader.control(0).1, Ordering::Relaxed);
                (self.read)()?;
                // The copy was observed complete before this point; a publication that overlapped
                // it made the seq odd (`SeqCst`) before its data moved.
                std::sync::atomic::fence(Ordering::SeqCst);
                Ok(version)
            }
        }
        match seqlock::read(&mut Outside { reader: self, read }, 0..1, deadline) {
            Ok(version) => Ok(Ok(version)),
            Err(seqlock::Failure::Access(e)) => Ok(Err(e)),
            Err(seqlock::Failure::Deadline) => Err(self.deadline()),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seqlock::torn::{assert_whole, byte_of, read_while_publishing};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Duration;

    /// A deadline no test here reaches.
    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    /// A private directory for one test (under /dev/shm where it exists), removed at the end.
    struct TestDir(PathBuf);

    impl TestDir {
        fn new(test: &str) -> Self {
            let root = Path::new("/dev/shm");
            let root = if root.is_dir() {
                root.to_path_buf()
            } else {
                std::env::temp_dir()
            };
            let dir = root.join(format!("odc-segtest-{}-{test}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).expect("create test dir");
            Self(dir)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TestDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    fn read_vec(
        reader: &SegmentReader,
        bytes: Range<usize>,
    ) -> Result<(Vec<u8>, u64), SegmentError> {
        let mut out = vec![0u8; bytes.len()];
        let version = reader.read(bytes, far(), &mut |src, off| {
            out[off..off + src.len()].copy_from_slice(src)
        })?;
        Ok((out, version))
    }

    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let pid = child.id();
        child.wait().expect("wait for true");
        assert!(!pid_alive(pid));
        pid
    }

    fn shape(elem_size: usize, elements: usize, chunk_bytes: usize) -> Shape {
        Shape {
            elem_size,
            elements,
            chunk_bytes,
            endpoint: 0,
            instance: 0,
            handle_id: 0,
        }
    }

    #[test]
    fn segment_names_round_trip_and_reject_non_canonical_names() {
        let name = segment_name("job-1.a_b", 1234, 56);
        assert_eq!(name, "odc-job-1.a_b-1234-56");
        assert_eq!(
            parse_segment_name(&name),
            Some(SegmentName {
                job: "job-1.a_b".into(),
                pid: 1234,
                region: 56
            })
        );
        for bad in [
            "odc--1-2",
            "odc-j-0-1",
            "odc-j-01-1",
            "odc-j-+1-1",
            "odc-j-1-",
            "odc-j/x-1-2",
            "odc-j-4294967295-1",
            "xodc-j-1-2",
            "odc-j-1",
        ] {
            assert_eq!(parse_segment_name(bad), None, "{bad}");
        }
        let long = "a".repeat(65);
        assert_eq!(parse_segment_name(&segment_name(&long, 1, 1)), None);
        assert_eq!(
            parse_any_name(".odc-j-1-2~7"),
            Some((
                SegmentName {
                    job: "j".into(),
                    pid: 1,
                    region: 2
                },
                true
            ))
        );
        assert_eq!(parse_any_name(".odc-j-1-2~"), None);
    }

    #[test]
    fn round_trip_full_and_sub_ranges_across_chunks_with_versions() {
        let dir = TestDir::new("round_trip");
        let job = "round_trip";
        // 1000 u16 = 2000 bytes in 256-byte chunks: 8 chunks, the last one partial.
        let initial: Vec<u8> = (0..2000u32).map(|i| (i % 251) as u8).collect();
        let writer =
            SegmentWriter::create(dir.path(), job, 7, 2, 1000, 256, &initial, 3).expect("create");
        assert_eq!(writer.name(), segment_name(job, std::process::id(), 7));
        assert_eq!(writer.version(), 3);
        let reader = SegmentReader::open(dir.path(), writer.name(), job).expect("open");
        assert_eq!((reader.elements(), reader.elem_size()), (1000, 2));
        assert!(reader.owner_alive());

        assert_eq!(
            read_vec(&reader, 0..2000).expect("full"),
            (initial.clone(), 3)
        );
        for range in [0..2, 250..770, 254..258, 512..1024, 1790..2000, 1998..2000] {
            let (bytes, version) = read_vec(&reader, range.clone()).expect("sub range");
            assert_eq!(bytes, initial[range.clone()], "{range:?}");
            assert_eq!(version, 3);
        }
        // At rest a range over several chunks arrives as one copy (pieces per chunk only when a
        // publication interferes: `a_publication_during_the_one_copy_is_never_returned_mixed`).
        let mut pieces = Vec::new();
        reader
            .read(250..770, far(), &mut |src, off| {
                pieces.push((off, src.len()))
            })
            .expect("pieces");
        assert_eq!(pieces, vec![(0, 520)]);
        // Empty ranges still report the version.
        assert_eq!(read_vec(&reader, 600..600).expect("empty"), (vec![], 3));
        assert_eq!(
            read_vec(&reader, 2000..2000).expect("empty end"),
            (vec![], 3)
        );

        let next: Vec<u8> = initial.iter().map(|b| b.wrapping_add(1)).collect();
        writer.publish(9, &next).expect("publish");
        assert_eq!(writer.version(), 9);
        assert_eq!(read_vec(&reader, 0..2000).expect("full"), (next.clone(), 9));
        assert_eq!(read_vec(&reader, 250..770).expect("sub").0, next[250..770]);

        // Wrong length: typed error, nothing changed.
        assert!(matches!(
            writer.publish(10, &next[..1998]),
            Err(SegmentError::LengthMismatch {
                expected: 2000,
                found: 1998,
                ..
            })
        ));
        assert_eq!(writer.version(), 9);
        assert_eq!(read_vec(&reader, 0..2000).expect("full"), (next, 9));

        // Out-of-range and misaligned ranges are typed errors.
        for range in [1..4, 0..3, 0..2002, 2002..2004] {
            assert!(
                matches!(
                    read_vec(&reader, range.clone()),
                    Err(SegmentError::OutOfRange { .. })
                ),
                "{range:?}"
            );
        }
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 4..2;
        assert!(matches!(
            read_vec(&reader, reversed),
            Err(SegmentError::OutOfRange { .. })
        ));
    }

    #[test]
    fn create_rejects_bad_parameters() {
        let dir = TestDir::new("bad_parameters");
        let d = dir.path();
        let job = "bad_parameters";
        let invalid =
            |r: Result<SegmentWriter, SegmentError>| matches!(r, Err(SegmentError::Invalid { .. }));
        assert!(invalid(SegmentWriter::create(
            d, "a/b", 1, 4, 4, 64, &[0; 16], 0
        )));
        assert!(invalid(SegmentWriter::create(
            d, "", 1, 4, 4, 64, &[0; 16], 0
        )));
        assert!(invalid(SegmentWriter::create(
            d, job, 1, 4, 4, 12, &[0; 16], 0
        )));
        assert!(invalid(SegmentWriter::create(
            d, job, 1, 3, 4, 64, &[0; 12], 0
        )));
        assert!(invalid(SegmentWriter::create(d, job, 1, 0, 4, 64, &[], 0)));
        assert!(invalid(SegmentWriter::create(d, job, 1, 4, 0, 0, &[], 0)));
        assert!(invalid(SegmentWriter::create(
            d,
            job,
            1,
            8,
            usize::MAX / 4,
            64,
            &[],
            0
        )));
        assert!(matches!(
            SegmentWriter::create(d, job, 1, 4, 4, 64, &[0; 15], 0),
            Err(SegmentError::LengthMismatch {
                expected: 16,
                found: 15,
                ..
            })
        ));
        // Nothing was left behind.
        assert_eq!(fs::read_dir(d).expect("read dir").count(), 0);
        // An empty segment works and carries its version.
        let empty = SegmentWriter::create(d, job, 2, 4, 0, 64, &[], 5).expect("empty segment");
        let reader = SegmentReader::open(d, empty.name(), job).expect("open empty");
        assert_eq!(read_vec(&reader, 0..0).expect("read empty"), (vec![], 5));
        empty.publish(6, &[]).expect("publish empty");
        assert_eq!(read_vec(&reader, 0..0).expect("read empty"), (vec![], 6));
    }

    #[test]
    fn torn_read_never_observed_under_a_publishing_writer() {
        const BYTES: usize = 32 * 1024; // 8192 u32 in 32 chunks of 1 KiB
        const CHUNK: usize = 1024;
        let (dir, job) = (TestDir::new("torn_read"), "torn_read");
        let (writer, publish) = alternating(&dir, job, BYTES, CHUNK);
        let reader = SegmentReader::open(dir.path(), writer.name(), job).expect("open");
        let mut out = vec![0u8; BYTES];
        let seen = read_while_publishing(publish, |_, rng| {
            // Ranges of 1..=6 chunks' worth of elements starting anywhere (mostly unaligned to
            // chunks), so they span several chunks.
            let start = (rng as usize % (BYTES / 4)) * 4;
            let len = ((rng >> 32) as usize % (6 * CHUNK / 4) + 1) * 4;
            let end = (start + len).min(BYTES);
            let dest = &mut out[..end - start];
            dest.fill(0);
            let version = reader
                .read(start..end, soon(), &mut |src, off| {
                    dest[off..off + src.len()].copy_from_slice(src)
                })
                .expect("read under a live writer");
            assert_whole(dest, version, format_args!("{start}..{end}"));
            version
        });
        seen.assert_several();
    }

    /// A segment of `bytes` data bytes in chunks of `chunk` in `dir` for `job`, at version 0, and
    /// the publication of version `v` into it: its data all [`byte_of`]`(v)`.
    fn alternating(
        dir: &TestDir,
        job: &str,
        bytes: usize,
        chunk: usize,
    ) -> (Arc<SegmentWriter>, impl FnMut(u64) + Send + 'static) {
        let (a, b) = (vec![byte_of(1); bytes], vec![byte_of(0); bytes]);
        let writer = Arc::new(
            SegmentWriter::create(dir.path(), job, 1, 4, bytes / 4, chunk, &b, 0).expect("create"),
        );
        let publishing = Arc::clone(&writer);
        let publish = move |version| {
            let data = if version % 2 == 1 { &a } else { &b };
            publishing.publish(version, data).expect("publish");
        };
        (writer, publish)
    }

    /// The copies a read made: (offset in range, length) per `copy` call, and the bytes.
    fn read_logged(
        reader: &SegmentReader,
        bytes: Range<usize>,
        during: &mut dyn FnMut(usize),
    ) -> (Vec<u8>, u64, Vec<(usize, usize)>) {
        let mut out = vec![0u8; bytes.len()];
        let mut calls = Vec::new();
        let version = reader
            .read(bytes, far(), &mut |src, off| {
                calls.push((off, src.len()));
                // Copy in two halves with `during(call)` between them, so a test can publish
                // in the middle of one copy.
                let half = src.len() / 2;
                out[off..off + half].copy_from_slice(&src[..half]);
                during(calls.len());
                out[off + half..off + src.len()].copy_from_slice(&src[half..]);
            })
            .expect("read");
        (out, version, calls)
    }

    #[test]
    fn a_stable_multi_chunk_range_is_read_with_one_copy() {
        let dir = TestDir::new("one_copy");
        let job = "one_copy";
        // 8 chunks of 64 bytes, 2-byte elements.
        let data: Vec<u8> = (0..512u32).map(|i| (i * 7 % 251) as u8).collect();
        let writer =
            SegmentWriter::create(dir.path(), job, 1, 2, 256, 64, &data, 3).expect("create");
        let reader = SegmentReader::open(dir.path(), writer.name(), job).expect("open");
        for range in [0..512, 10..500, 62..66, 64..192, 130..512] {
            let (out, version, calls) = read_logged(&reader, range.clone(), &mut |_| {});
            assert_eq!((&out[..], version), (&data[range.clone()], 3), "{range:?}");
            assert_eq!(calls, vec![(0, range.len())], "one copy for {range:?}");
        }
        // Within one chunk there is one piece anyway.
        let (out, _, calls) = read_logged(&reader, 66..100, &mut |_| {});
        assert_eq!((&out[..], calls), (&data[66..100], vec![(0, 34)]));
    }

    #[test]
    fn a_publication_during_the_one_copy_is_never_returned_mixed() {
        let dir = TestDir::new("one_copy_torn");
        let job = "one_copy_torn";
        // 8 chunks of 64 bytes; version 1 is all 0x11, version 2 all 0x22.
        let (old, new) = (vec![0x11u8; 512], vec![0x22u8; 512]);
        let writer =
            SegmentWriter::create(dir.path(), job, 1, 4, 128, 64, &old, 1).expect("create");
        let reader = SegmentReader::open(dir.path(), writer.name(), job).expect("open");
        for range in [0..512, 4..508, 60..72] {
            writer.publish(1, &old).expect("publish old");
            // The first (whole-range) copy takes its first half of version 1, then version 2 is
            // published, then it takes its second half: that copy is mixed and must be redone.
            let (out, version, calls) = read_logged(&reader, range.clone(), &mut |call| {
                if call == 1 {
                    writer.publish(2, &new).expect("publish new");
                }
            });
            assert_eq!(
                calls[0],
                (0, range.len()),
                "{range:?}: tried as one copy first"
            );
            assert!(
                calls.len() > 1,
                "{range:?}: the mixed copy was redone: {calls:?}"
            );
            if range == (60..72) {
                // Redone piece by piece, each at its offset in the range.
                assert_eq!(calls, vec![(0, 12), (0, 4), (4, 8)]);
            }
            assert_eq!(version, 2, "{range:?}");
            assert!(
                out.iter().all(|&b| b == 0x22),
                "{range:?}: mixed result {out:?}"
            );
        }
        // A range whose chunks are at different publications (a writer that died between
        // chunks) is never taken by the one-copy path either: it waits, then misses its deadline.
        writer.poke_seq(0, 100);
        let mut lengths = Vec::new();
        let result = reader.read(
            0..512,
            Instant::now() + Duration::from_millis(50),
            &mut |src, _| lengths.push(src.len()),
        );
        assert!(matches!(result, Err(SegmentError::Deadline { .. })));
        assert!(
            !lengths.contains(&512),
            "no one copy across two publications: {lengths:?}"
        );
    }

    #[test]
    fn whole_segment_reads_under_a_publishing_writer_are_never_mixed() {
        const BYTES: usize = 256 * 1024; // 64 chunks of 4 KiB
        const CHUNK: usize = 4096;
        let (dir, job) = (TestDir::new("whole_torn"), "whole_torn");
        let (writer, publish) = alternating(&dir, job, BYTES, CHUNK);
        let reader = SegmentReader::open(dir.path(), writer.name(), job).expect("open");
        let mut one_copy = 0u64;
        let mut out = vec![0u8; BYTES];
        let seen = read_while_publishing(publish, |reads, _| {
            // The whole segment, or all of it but the first and last element.
            let range = if reads % 2 == 0 {
                0..BYTES
            } else {
                4..BYTES - 4
            };
            let dest = &mut out[..range.len()];
            dest.fill(0);
            let mut calls = 0;
            let version = reader
                .read(range.clone(), soon(), &mut |src, off| {
                    calls += 1;
                    dest[off..off + src.len()].copy_from_slice(src)
                })
                .expect("read under a live writer");
            assert_whole(dest, version, format_args!("{range:?} ({calls} copies)"));
            one_copy += u64::from(calls == 1);
            version
        });
        assert!(seen.reads > 0);
        println!(
            "{} reads, {one_copy} as one copy, {} versions of {} publications",
            seen.reads,
            seen.versions.len(),
            seen.published
        );
    }

    #[test]
    fn stale_segments_are_swept_and_replaced_live_ones_kept() {
        let dir = TestDir::new("stale");
        let d = dir.path();
        let job = "stale_detection";
        let other_job = "stale_detection_other";
        let data = [1u8; 64];
        let dead = Owner {
            pid: dead_pid(),
            start_time: 12345,
        };
        let me = Owner::current();
        assert_ne!(me.start_time, 0, "/proc/self/stat gives a start time");
        let reused = Owner {
            pid: me.pid,
            start_time: me.start_time + 1,
        };
        // Leaked writers stand for owners that died without unlinking.
        let plant = |job: &str, region: u64, owner: Owner| {
            let w = SegmentWriter::create_as(d, job, region, shape(4, 16, 64), &data, 1, owner)
                .expect("plant segment");
            let name = w.name().to_string();
            std::mem::forget(w);
            name
        };
        let dead_name = plant(job, 1, dead);
        let reused_name = plant(job, 3, reused);
        let other_dead = plant(other_job, 1, dead);
        let live = SegmentWriter::create(d, job, 2, 4, 16, 64, &data, 1).expect("live");
        // A temporary file of a dead owner (it died while filling it).
        let dead_temp = format!(".{}~0", segment_name(job, dead.pid, 4));
        fs::write(d.join(&dead_temp), b"partial").expect("write temp");
        // A live pid's unreadable file is kept.
        let live_garbage = segment_name(job, me.pid, 99);
        fs::write(d.join(&live_garbage), b"garbage").expect("write garbage");

        let mut removed = sweep_stale(d, Some(job)).expect("sweep");
        removed.sort();
        let mut expected = vec![dead_name, reused_name, dead_temp];
        expected.sort();
        assert_eq!(removed, expected);
        assert!(d.join(live.name()).exists());
        assert!(d.join(&live_garbage).exists());
        assert!(d.join(&other_dead).exists());
        assert_eq!(sweep_stale(d, None).expect("sweep all"), vec![other_dead]);
        assert!(d.join(live.name()).exists());

        // `create` over a stale name (this pid, another start time: a reused pid) succeeds...
        let stale_mine = plant(job, 5, reused);
        let fresh =
            SegmentWriter::create(d, job, 5, 4, 16, 64, &[2u8; 64], 8).expect("create over stale");
        assert_eq!(fresh.name(), stale_mine);
        let reader = SegmentReader::open(d, fresh.name(), job).expect("open replaced");
        assert_eq!(read_vec(&reader, 0..64).expect("read"), (vec![2u8; 64], 8));
        assert!(reader.owner_alive());
        // ... over a live one it is `Exists`, and the live segment is untouched.
        assert_eq!(
            SegmentWriter::create(d, job, 2, 4, 16, 64, &data, 1).expect_err("exists"),
            SegmentError::Exists {
                name: live.name().to_string(),
                pid: me.pid
            }
        );
        let reader = SegmentReader::open(d, live.name(), job).expect("open live");
        assert_eq!(read_vec(&reader, 0..64).expect("read"), (data.to_vec(), 1));
        // A reader of a dead owner's segment can tell.
        let gone = plant(job, 6, dead);
        assert!(!SegmentReader::open(d, &gone, job)
            .expect("open dead")
            .owner_alive());
    }

    #[test]
    fn corrupt_and_hostile_files_are_typed_errors() {
        let dir = TestDir::new("hostile");
        let d = dir.path();
        let job = "hostile_files";
        let writer = SegmentWriter::create(d, job, 1, 4, 100, 64, &[7u8; 400], 1).expect("create");
        let name = writer.name().to_string();
        let good = fs::read(d.join(&name)).expect("read file");
        drop(writer);
        let open_with = |bytes: &[u8]| {
            fs::write(d.join(&name), bytes).expect("write file");
            SegmentReader::open(d, &name, job)
        };
        let bad_header = |r: Result<SegmentReader, SegmentError>, what: &str| match r {
            Err(SegmentError::BadHeader { what: w, .. }) => {
                assert!(w.contains(what), "{w:?} does not mention {what:?}")
            }
            other => panic!("expected a bad header about {what}, got {other:?}"),
        };
        assert!(open_with(&good).is_ok());
        bad_header(open_with(&[]), "shorter than");
        bad_header(open_with(&good[..100]), "shorter than");
        bad_header(open_with(&good[..good.len() - 1]), "file is");
        let mut longer = good.clone();
        longer.push(0);
        bad_header(open_with(&longer), "file is");

        let patched = |off: usize, value: &[u8]| {
            let mut bytes = good.clone();
            bytes[off..off + value.len()].copy_from_slice(value);
            bytes
        };
        // A header field patched to a value no writer writes, and what the error names.
        let fields: [(usize, Vec<u8>, &str); 14] = [
            (OFF_MAGIC, b"ODCSHM99".to_vec(), "magic"),
            (OFF_LAYOUT, 2u32.to_ne_bytes().to_vec(), "layout"),
            (
                OFF_ELEMENTS,
                (u64::MAX / 2).to_ne_bytes().to_vec(),
                "too large",
            ),
            (OFF_ELEMENTS, (1u64 << 40).to_ne_bytes().to_vec(), ""),
            (OFF_ELEMENTS, 101u64.to_ne_bytes().to_vec(), ""),
            (OFF_ELEM_SIZE, 0u32.to_ne_bytes().to_vec(), "element size"),
            (OFF_CHUNK_BYTES, 12u64.to_ne_bytes().to_vec(), "chunk size"),
            (OFF_CHUNK_BYTES, 0u64.to_ne_bytes().to_vec(), "chunk size"),
            (OFF_CHUNKS, 1u64.to_ne_bytes().to_vec(), "chunk count"),
            (OFF_TOTAL, u64::MAX.to_ne_bytes().to_vec(), "total length"),
            (OFF_JOB_LEN, 0u32.to_ne_bytes().to_vec(), "job id length"),
            (
                OFF_JOB_LEN,
                u32::MAX.to_ne_bytes().to_vec(),
                "job id length",
            ),
            (OFF_PID, 1u32.to_ne_bytes().to_vec(), "pid"),
            (OFF_REGION, 2u64.to_ne_bytes().to_vec(), "region"),
        ];
        for (off, value, what) in &fields {
            bad_header(open_with(&patched(*off, value)), what);
        }
        assert!(matches!(
            open_with(&patched(OFF_JOB, b"X")),
            Err(SegmentError::WrongJob { .. })
        ));

        // Wrong job asked for (name and header say another).
        fs::write(d.join(&name), &good).expect("restore");
        assert_eq!(
            SegmentReader::open(d, &name, "someone_else").expect_err("wrong job"),
            SegmentError::WrongJob {
                name: name.clone(),
                expected: "someone_else".into(),
                found: job.into()
            }
        );
        // Not a segment name (no path tricks either).
        for bad in ["../etc/passwd", "odc-x/../y-1-2", "plain"] {
            assert!(matches!(
                SegmentReader::open(d, bad, job),
                Err(SegmentError::Invalid { .. })
            ));
        }
        // Missing file.
        let missing = segment_name(job, 1, 999);
        assert!(matches!(
            SegmentReader::open(d, &missing, job),
            Err(SegmentError::Io { .. })
        ));
        // A symlink is not followed, a FIFO does not block.
        let link = segment_name(job, 1, 1000);
        std::os::unix::fs::symlink(d.join(&name), d.join(&link)).expect("symlink");
        assert!(matches!(
            SegmentReader::open(d, &link, job),
            Err(SegmentError::Io { .. })
        ));
        let fifo = segment_name(job, 1, 1001);
        let c_path = std::ffi::CString::new(d.join(&fifo).into_os_string().into_encoded_bytes())
            .expect("c path");
        // SAFETY: `c_path` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        assert!(matches!(
            SegmentReader::open(d, &fifo, job),
            Err(SegmentError::Io { .. })
        ));
    }

    #[test]
    fn writer_dead_mid_publish_ends_in_deadline_not_a_hang() {
        let dir = TestDir::new("odd_seq");
        let job = "odd_seq";
        // 4 chunks of 64 bytes.
        let writer =
            SegmentWriter::create(dir.path(), job, 1, 8, 32, 64, &[3u8; 256], 1).expect("create");
        let reader = SegmentReader::open(dir.path(), writer.name(), job).expect("open");
        writer.poke_seq(1, 1); // died while writing chunk 1
        let budget = Duration::from_millis(100);
        let started = Instant::now();
        assert_eq!(
            read_vec_until(&reader, 0..256, started + budget),
            Err(SegmentError::Deadline {
                name: writer.name().to_string()
            })
        );
        let took = started.elapsed();
        assert!(
            took >= budget && took < budget + Duration::from_secs(2),
            "{took:?}"
        );
        // Chunks not being written still read.
        assert_eq!(
            read_vec(&reader, 0..64).expect("chunk 0"),
            (vec![3u8; 64], 1)
        );
        assert_eq!(
            read_vec(&reader, 128..256).expect("chunks 2, 3"),
            (vec![3u8; 128], 1)
        );
        // Died between chunks: chunk 0..=1 published (seq 2), 2..=3 not (seq 0): a read across
        // both can never see one publication.
        writer.poke_seq(1, 2);
        writer.poke_seq(0, 2);
        assert!(matches!(
            read_vec_until(&reader, 0..256, Instant::now() + budget),
            Err(SegmentError::Deadline { .. })
        ));
        // A deadline already passed is refused at once.
        assert!(matches!(
            read_vec_until(&reader, 0..64, Instant::now() - Duration::from_millis(1)),
            Err(SegmentError::Deadline { .. })
        ));
    }

    fn read_vec_until(
        reader: &SegmentReader,
        bytes: Range<usize>,
        deadline: Instant,
    ) -> Result<Vec<u8>, SegmentError> {
        let mut out = vec![0u8; bytes.len()];
        reader.read(bytes, deadline, &mut |src, off| {
            out[off..off + src.len()].copy_from_slice(src)
        })?;
        Ok(out)
    }

    /// Reads `ODC_SEGMENT_TEST_{DIR,NAME}` of job `cross_process` for 200 ms, checking that
    /// every read is one whole publication (all 0xAA at an odd version or all 0x55 at an even
    /// one). Run in a child process by the test below; does nothing on its own.
    #[test]
    #[ignore = "helper run in a child process by reader_in_another_process_sees_only_whole_publications"]
    fn cross_process_reader_child() {
        let (Ok(dir), Ok(name)) = (
            std::env::var("ODC_SEGMENT_TEST_DIR"),
            std::env::var("ODC_SEGMENT_TEST_NAME"),
        ) else {
            return;
        };
        let reader = SegmentReader::open(Path::new(&dir), &name, "cross_process").expect("open");
        assert!(reader.owner_alive(), "the parent owns the segment");
        let bytes = reader.elements() * reader.elem_size();
        let started = Instant::now();
        let mut versions = std::collections::BTreeSet::new();
        // At least 200 ms, and on a loaded machine (the publisher descheduled) until a second
        // publication was seen or 10 s passed.
        while started.elapsed() < Duration::from_millis(200)
            || (versions.len() < 2 && started.elapsed() < Duration::from_secs(10))
        {
            let (data, version) = read_vec(&reader, 0..bytes).expect("read");
            let expected = if version % 2 == 1 { 0xAA } else { 0x55 };
            assert!(
                data.iter().all(|&x| x == expected),
                "torn read at {version}"
            );
            versions.insert(version);
        }
        println!("child saw {} versions", versions.len());
        assert!(versions.len() >= 2, "saw only {versions:?}");
    }

    #[test]
    fn reader_in_another_process_sees_only_whole_publications() {
        let dir = TestDir::new("cross_process");
        let job = "cross_process";
        let (a, b) = (vec![0xAAu8; 16 * 1024], vec![0x55u8; 16 * 1024]);
        let writer = Arc::new(
            SegmentWriter::create(dir.path(), job, 1, 4, 4096, 1024, &b, 0).expect("create"),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let publisher = {
            let (writer, stop) = (Arc::clone(&writer), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut version = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    version += 1;
                    let data = if version % 2 == 1 { &a } else { &b };
                    writer.publish(version, data).expect("publish");
                }
            })
        };
        let output = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--exact",
                "shm::segment::tests::cross_process_reader_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("ODC_SEGMENT_TEST_DIR", dir.path())
            .env("ODC_SEGMENT_TEST_NAME", writer.name())
            .output()
            .expect("run the child reader");
        stop.store(true, Ordering::Relaxed);
        publisher.join().expect("publisher");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && stdout.contains("child saw"),
            "child reader failed: {stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    #[test]
    fn dropping_the_writer_unlinks_the_file_and_open_readers_keep_reading() {
        let dir = TestDir::new("drop_unlinks");
        let job = "drop_unlinks";
        let writer =
            SegmentWriter::create(dir.path(), job, 1, 4, 16, 64, &[9u8; 64], 4).expect("create");
        let path = dir.path().join(writer.name());
        assert!(path.exists());
        let reader = SegmentReader::open(dir.path(), writer.name(), job).expect("open");
        drop(writer);
        assert!(!path.exists());
        assert_eq!(fs::read_dir(dir.path()).expect("read dir").count(), 0);
        assert_eq!(read_vec(&reader, 0..64).expect("read"), (vec![9u8; 64], 4));
    }
}
