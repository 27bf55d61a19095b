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

mod error;
mod layout;
mod name;
mod owner;
mod reader;
#[cfg(test)]
mod tests;
mod writer;

pub(crate) use error::SegmentError;
pub(crate) use name::job_is_valid;
pub(crate) use owner::{owner_gone, sweep_stale};
pub(crate) use reader::SegmentReader;
pub(crate) use writer::SegmentWriter;
