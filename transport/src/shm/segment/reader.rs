//! Reader side of a segment ([`SegmentReader`]): opens and checks another process's file, maps it
//! read-only, and reads byte ranges under the seqlock, one-sidedly.

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use memmap2::Mmap;

use super::error::{io_error, SegmentError};
use super::layout::{
    get_u32, get_u64, Geometry, CONTROL_STRIDE, CONTROL_VERSION, HEADER_BYTES, HEADER_USED,
    LAYOUT_VERSION, MAGIC, MAX_JOB_LEN, OFF_CHUNKS, OFF_CHUNK_BYTES, OFF_DATA, OFF_ELEMENTS,
    OFF_ELEM_SIZE, OFF_ENDPOINT, OFF_HANDLE_ID, OFF_INSTANCE, OFF_JOB, OFF_JOB_LEN, OFF_LAYOUT,
    OFF_MAGIC, OFF_PID, OFF_REGION, OFF_START_TIME, OFF_STATE, OFF_TOTAL,
};
use super::name::parse_segment_name;
use super::owner::{open_regular, owner_gone, Owner};
use crate::seqlock;

/// Reader side of a segment: a read-only mapping of another (or the same) process's segment.
#[derive(Debug)]
pub(crate) struct SegmentReader {
    pub(super) name: String,
    pub(super) map: Mmap,
    pub(super) geometry: Geometry,
    pub(super) owner: Owner,
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

    pub(super) fn header_u64(&self, offset: usize) -> u64 {
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
    pub(super) fn control(&self, c: usize) -> (&AtomicU64, &AtomicU64) {
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

    pub(super) fn deadline(&self) -> SegmentError {
        SegmentError::Deadline {
            name: self.name.clone(),
        }
    }
}

/// The whole-range phases over a mapped segment: seqs loaded from the mapping, the range handed to
/// the caller's `copy` at once.
pub(super) struct WholeRange<'a, 'b> {
    pub(super) reader: &'a SegmentReader,
    pub(super) bytes: &'a Range<usize>,
    pub(super) copy: &'b mut dyn FnMut(&[u8], usize),
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
pub(super) struct MappedControls {
    pub(super) base: *mut u8,
    pub(super) geometry: Geometry,
}

impl MappedControls {
    pub(super) fn word(&self, offset: usize) -> &AtomicU64 {
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
