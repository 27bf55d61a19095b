//! The `rdma` backend's published memory, without any verbs: the memory an owner registers for
//! one published region ([`RegionMemory`]: a header, a seqlock per chunk, the data) and how a
//! reader gets one whole publication out of it with nothing but one-sided reads ([`read`] over any
//! [`RemoteMemory`]). The verbs layer (`verbs.rs`) only moves bytes; everything that decides
//! whether those bytes are a consistent publication is here and in [`crate::seqlock`], and is
//! tested here against in-process memory with a concurrent writer.
//!
//! # Layout of a region's memory (one allocation, page aligned, registered as one memory region)
//! ```text
//! offset                  size            contents
//! 0                       64              header: 8 little-endian u64 words (below)
//! 64 + 8·c                8 per chunk     seq of chunk c
//! 64 + 8·chunks + 8·c     8 per chunk     version of chunk c
//! data_offset             data (padded)   data, 64-byte aligned; chunk c = bytes [c·chunk, (c+1)·chunk)
//! ```
//! Header words: `0` magic `b"ODCRDMA1"`; `1` the owner transport's instance; `2` the region id;
//! `3` state (0 live, 1 closed: set before the memory is deregistered); `4` element size; `5`
//! element count; `6` chunk size in bytes (a positive multiple of 8; there are
//! `max(1, ⌈data / chunk⌉)` chunks); `7` the owner's endpoint id. The header is written before the memory is registered and only the
//! state word changes afterwards. Header and control words are little-endian `u64`s; the data is
//! the region's encoded elements, as published.
//!
//! The seqs (and the versions) of all chunks are contiguous, so a reader fetches the seqs of every
//! chunk of its range with one read, whatever the range's length.
//!
//! # The seqlock
//! [`RegionMemory::publish`] is [`crate::seqlock`]'s writer over these words, and [`read`] its
//! whole-range reader in three phases of one-sided reads (phase 1 also reads the header and
//! checks that the memory still holds the expected live region); the protocol and its C1
//! argument are there. What the argument needs from the NIC is that each phase's reads have
//! completed before the next phase's are issued, and that an aligned 8-byte word is read whole:
//! both hold for RDMA READ. The version is read in phase 2 like the data, not next to the seq
//! in one transfer (a NIC does not promise an order between the bytes of one read).
//!
//! In-process access ([`RegionMemory::read_at`], used by the owner's own reads and by tests) goes
//! through atomic word loads, and the writer stores the data through atomic word stores, so a read
//! racing a publication is not a data race in Rust's memory model either.

use std::alloc;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

use crate::seqlock;

/// Header word 0.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"ODCRDMA1");
/// Bytes of the header.
pub(crate) const HEADER_BYTES: usize = 64;
/// Alignment of a region's allocation (a page: memory regions are pinned page by page).
const ALLOC_ALIGN: usize = 4096;
/// Alignment of the data area.
const DATA_ALIGN: usize = 64;
/// Word size.
const WORD: usize = 8;

const H_MAGIC: usize = 0;
const H_INSTANCE: usize = 1;
const H_REGION: usize = 2;
const H_STATE: usize = 3;
const H_ELEM_SIZE: usize = 4;
const H_ELEMENTS: usize = 5;
const H_CHUNK_BYTES: usize = 6;
const H_OWNER: usize = 7;

const STATE_LIVE: u64 = 0;
const STATE_CLOSED: u64 = 1;

fn align_up(n: usize, to: usize) -> Option<usize> {
    n.checked_add(to - 1).map(|n| n / to * to)
}

fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

fn to_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Where everything of one region lies in its memory. Both sides compute it from the same
/// numbers (element size and count from the handle, chunk size from its descriptor) and the reader
/// checks them against the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) elem_size: usize,
    pub(crate) elements: usize,
    pub(crate) chunk_bytes: usize,
    pub(crate) chunks: usize,
    pub(crate) data_bytes: usize,
    pub(crate) data_offset: usize,
    /// Bytes of the whole allocation (a multiple of 8).
    pub(crate) total: usize,
}

impl Layout {
    /// The chunk size to use for a requested one: a positive multiple of 8.
    pub(crate) fn chunk_size(requested: usize) -> usize {
        (requested / WORD).max(1) * WORD
    }

    /// The layout of `elements` elements of `elem_size` bytes (1, 2, 4 or 8) in chunks of
    /// `chunk_bytes` (a positive multiple of 8); `Err` names what is wrong or too large.
    pub(crate) fn new(
        elem_size: usize,
        elements: usize,
        chunk_bytes: usize,
    ) -> Result<Self, String> {
        if !matches!(elem_size, 1 | 2 | 4 | 8) {
            return Err(format!("element size {elem_size} is not 1, 2, 4 or 8"));
        }
        if chunk_bytes == 0 || chunk_bytes % WORD != 0 {
            return Err(format!(
                "chunk size {chunk_bytes} is not a positive multiple of 8"
            ));
        }
        let too_large = || format!("{elements} elements of {elem_size} bytes are too many");
        let data_bytes = elements.checked_mul(elem_size).ok_or_else(too_large)?;
        let chunks = data_bytes.div_ceil(chunk_bytes).max(1);
        let controls = chunks
            .checked_mul(2 * WORD)
            .and_then(|c| c.checked_add(HEADER_BYTES))
            .ok_or_else(too_large)?;
        let data_offset = align_up(controls, DATA_ALIGN).ok_or_else(too_large)?;
        let total = align_up(data_bytes, WORD)
            .and_then(|d| d.checked_add(data_offset))
            .filter(|&t| t <= isize::MAX as usize - ALLOC_ALIGN)
            .ok_or_else(too_large)?;
        Ok(Self {
            elem_size,
            elements,
            chunk_bytes,
            chunks,
            data_bytes,
            data_offset,
            total,
        })
    }

    /// Offset of chunk `c`'s seq word.
    pub(crate) fn seq_offset(&self, c: usize) -> usize {
        HEADER_BYTES + WORD * c
    }

    /// Offset of chunk `c`'s version word.
    pub(crate) fn version_offset(&self, c: usize) -> usize {
        HEADER_BYTES + WORD * (self.chunks + c)
    }

    /// The data bytes of chunk `c`.
    fn chunk_range(&self, c: usize) -> Range<usize> {
        let start = c * self.chunk_bytes;
        start.min(self.data_bytes)..(start + self.chunk_bytes).min(self.data_bytes)
    }

    /// The chunks the data bytes `bytes` touch (for an empty range: the chunk holding its start).
    fn chunks_of(&self, bytes: &Range<usize>) -> Range<usize> {
        let first = (bytes.start / self.chunk_bytes).min(self.chunks - 1);
        let last = if bytes.is_empty() {
            first
        } else {
            (bytes.end - 1) / self.chunk_bytes
        };
        first..last + 1
    }

    fn header(&self, who: Identity, state: u64) -> [u64; 8] {
        let mut words = [0u64; 8];
        words[H_MAGIC] = MAGIC;
        words[H_INSTANCE] = who.instance;
        words[H_REGION] = who.region;
        words[H_STATE] = state;
        words[H_ELEM_SIZE] = to_u64(self.elem_size);
        words[H_ELEMENTS] = to_u64(self.elements);
        words[H_CHUNK_BYTES] = to_u64(self.chunk_bytes);
        words[H_OWNER] = u64::from(who.owner);
        words
    }
}

/// Which region a memory holds: the owner transport's instance, the owner endpoint and the region
/// id its handles carry. A reader that finds another identity at an address (the region was dropped and the
/// memory reused) treats the region as gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) owner: u32,
    pub(crate) instance: u64,
    pub(crate) region: u64,
}

/// What a reader expects to find at an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Expect {
    pub(crate) who: Identity,
    pub(crate) layout: Layout,
}

/// The owner's memory of one published region: page-aligned, zeroed, laid out as in the module
/// doc. The owner registers `[base(), base() + layout().total)` as a memory region; readers read
/// it one-sidedly. Freed on drop (deregister it first).
pub(crate) struct RegionMemory {
    base: NonNull<u8>,
    alloc: alloc::Layout,
    layout: Layout,
    who: Identity,
    /// One publication at a time.
    writer: Mutex<()>,
    version: AtomicU64,
}

// SAFETY: the allocation is owned by this value and lives as long as it does. Every access to it
// after construction is an atomic load or store of an 8-aligned word inside it (`word`), and the
// only multi-word mutation (`publish`, `close`) is serialised by `writer`; sharing or sending the
// value across threads therefore cannot cause a data race.
unsafe impl Send for RegionMemory {}
// SAFETY: as for `Send`.
unsafe impl Sync for RegionMemory {}

impl std::fmt::Debug for RegionMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionMemory")
            .field("base", &self.base)
            .field("layout", &self.layout)
            .field("who", &self.who)
            .finish()
    }
}

impl Drop for RegionMemory {
    fn drop(&mut self) {
        // SAFETY: `base` came from `alloc::alloc_zeroed(self.alloc)` and is freed only here.
        unsafe { alloc::dealloc(self.base.as_ptr(), self.alloc) }
    }
}

impl RegionMemory {
    /// A live region holding `initial` (exactly `layout.data_bytes` bytes) at `version`.
    pub(crate) fn new(
        layout: Layout,
        who: Identity,
        initial: &[u8],
        version: u64,
    ) -> Result<Self, String> {
        if initial.len() != layout.data_bytes {
            return Err(format!(
                "{} initial bytes for a region of {} bytes",
                initial.len(),
                layout.data_bytes
            ));
        }
        let alloc = alloc::Layout::from_size_align(layout.total, ALLOC_ALIGN)
            .map_err(|e| format!("region of {} bytes: {e}", layout.total))?;
        // SAFETY: `alloc` has a non-zero size (`total` covers at least the header).
        let base = NonNull::new(unsafe { alloc::alloc_zeroed(alloc) })
            .ok_or_else(|| format!("cannot allocate {} bytes", layout.total))?;
        let memory = Self {
            base,
            alloc,
            layout,
            who,
            writer: Mutex::new(()),
            version: AtomicU64::new(version),
        };
        for (i, word) in layout.header(who, STATE_LIVE).into_iter().enumerate() {
            memory.word(i * WORD).store(word.to_le(), Ordering::Relaxed);
        }
        for c in 0..layout.chunks {
            memory
                .word(layout.version_offset(c))
                .store(version.to_le(), Ordering::Relaxed);
            memory.store_bytes(layout.chunk_range(c), initial);
        }
        fence(Ordering::Release);
        Ok(memory)
    }

    /// First byte of the memory (what gets registered).
    pub(crate) fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }

    pub(crate) fn identity(&self) -> Identity {
        self.who
    }

    /// The version of the last publication.
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// The word at byte `offset` (8-aligned, inside the allocation).
    fn word(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset % WORD == 0 && offset + WORD <= self.layout.total,
            "word offset {offset} outside a region of {} bytes",
            self.layout.total
        );
        // SAFETY: checked just above: 8-aligned (the allocation is page aligned) and in bounds;
        // `AtomicU64` has the size and alignment of `u64`, the allocation lives as long as
        // `self`, and its words are only ever accessed atomically.
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(offset).cast::<u64>()) }
    }

    /// Store the data bytes `range` (8-aligned start) of `src` (the whole data) into the data
    /// area, word by word; bytes past the data (padding of the last word) are stored as zero.
    fn store_bytes(&self, range: Range<usize>, src: &[u8]) {
        let mut at = range.start;
        while at < range.end {
            let mut bytes = [0u8; WORD];
            let n = (range.end - at).min(WORD);
            bytes[..n].copy_from_slice(&src[at..at + n]);
            self.word(self.layout.data_offset + at)
                .store(u64::from_ne_bytes(bytes), Ordering::Relaxed);
            at += WORD;
        }
    }

    /// Replace the data with `data` (exactly `layout.data_bytes` bytes) published as `version`:
    /// the writer side of the seqlock (module doc).
    pub(crate) fn publish(&self, version: u64, data: &[u8]) -> Result<(), String> {
        if data.len() != self.layout.data_bytes {
            return Err(format!(
                "{} bytes published to a region of {} bytes",
                data.len(),
                self.layout.data_bytes
            ));
        }
        let _writer = self.writer.lock();
        seqlock::publish(self, self.layout.chunks, version, |c| {
            self.store_bytes(self.layout.chunk_range(c), data)
        });
        self.version.store(version, Ordering::Release);
        Ok(())
    }

    /// The data as it is, published as `version` (a frozen region's next publication: no copy).
    pub(crate) fn republish(&self, version: u64) {
        let _writer = self.writer.lock();
        seqlock::publish(self, self.layout.chunks, version, |_| {});
        self.version.store(version, Ordering::Release);
    }

    /// Mark the region closed (readers that still reach the memory see it gone).
    pub(crate) fn close(&self) {
        let _writer = self.writer.lock();
        self.word(H_STATE * WORD)
            .store(STATE_CLOSED.to_le(), Ordering::Release);
    }

    /// Copy the bytes `[offset, offset + into.len())` of the memory into `into` through atomic
    /// word loads (in-process reads: the owner's own, the emulated NIC's, tests'). `Err` if the
    /// range leaves the memory.
    pub(crate) fn read_at(&self, offset: usize, into: &mut [u8]) -> Result<(), String> {
        let end = offset
            .checked_add(into.len())
            .filter(|&end| end <= self.layout.total)
            .ok_or_else(|| {
                format!(
                    "{} bytes at offset {offset} leave a region of {} bytes",
                    into.len(),
                    self.layout.total
                )
            })?;
        let mut at = offset;
        while at < end {
            let word_start = at / WORD * WORD;
            let bytes = self.word(word_start).load(Ordering::Relaxed).to_ne_bytes();
            let from = at - word_start;
            let n = (WORD - from).min(end - at);
            into[at - offset..at - offset + n].copy_from_slice(&bytes[from..from + n]);
            at += n;
        }
        Ok(())
    }

    /// Test hook: set chunk `c`'s seq (e.g. odd, as a writer that stopped mid-publication leaves
    /// it).
    #[cfg(test)]
    fn poke_seq(&self, c: usize, value: u64) {
        self.word(self.layout.seq_offset(c))
            .store(value.to_le(), Ordering::Release);
    }
}

impl seqlock::Controls for RegionMemory {
    fn seq(&self, chunk: usize) -> &AtomicU64 {
        self.word(self.layout.seq_offset(chunk))
    }
    fn version(&self, chunk: usize) -> &AtomicU64 {
        self.word(self.layout.version_offset(chunk))
    }
}

/// Memory a reader reaches one-sidedly: an RDMA connection to the owner (`verbs.rs`), the emulated
/// NIC, or, in-process, the memory itself ([`Local`]).
pub(crate) trait RemoteMemory {
    type Error;
    /// Fill each `into` with the bytes at its address; every read is complete when this returns
    /// (there is no order among the reads of one call).
    fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<(), Self::Error>;
}

/// A region's own memory read in-process, addressed by offset (base 0).
pub(crate) struct Local<'a>(pub(crate) &'a RegionMemory);

impl RemoteMemory for Local<'_> {
    type Error = String;
    fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<(), String> {
        for (addr, into) in reads.iter_mut() {
            self.0.read_at(to_usize(*addr), into)?;
        }
        Ok(())
    }
}

/// Why a [`read`] or a [`probe`] failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReadError<E> {
    /// The memory does not hold the expected live region (dropped, replaced, another region's).
    Gone(String),
    /// Reading the memory failed.
    Memory(E),
    /// No stable publication by the deadline.
    Deadline,
    /// A request outside the region (the caller checks ranges first).
    Invalid(String),
}

fn word_at(bytes: &[u8], i: usize) -> u64 {
    let mut word = [0u8; WORD];
    if let Some(src) = bytes.get(i * WORD..(i + 1) * WORD) {
        word.copy_from_slice(src);
    }
    u64::from_le_bytes(word)
}

/// Check a header read from memory against what the reader expects.
fn check_header<E>(header: &[u8], expect: &Expect) -> Result<(), ReadError<E>> {
    let wanted = expect.layout.header(expect.who, STATE_LIVE);
    if word_at(header, H_MAGIC) != MAGIC {
        return Err(ReadError::Gone("no region header at the address".into()));
    }
    if word_at(header, H_INSTANCE) != expect.who.instance
        || word_at(header, H_REGION) != expect.who.region
        || word_at(header, H_OWNER) != u64::from(expect.who.owner)
    {
        return Err(ReadError::Gone(format!(
            "the memory holds region {} of endpoint {} (instance {:#x}), not region {} of \
             endpoint {} (instance {:#x})",
            word_at(header, H_REGION),
            word_at(header, H_OWNER),
            word_at(header, H_INSTANCE),
            expect.who.region,
            expect.who.owner,
            expect.who.instance
        )));
    }
    if word_at(header, H_STATE) != STATE_LIVE {
        return Err(ReadError::Gone("the region was dropped".into()));
    }
    if (0..8).any(|i| word_at(header, i) != wanted[i]) {
        return Err(ReadError::Gone(
            "the region's shape differs from the handle's".into(),
        ));
    }
    Ok(())
}

/// Whether the memory at `base` holds the expected live region (one read of the header).
pub(crate) fn probe<M: RemoteMemory + ?Sized>(
    memory: &mut M,
    base: u64,
    expect: &Expect,
) -> Result<(), ReadError<M::Error>> {
    let mut header = [0u8; HEADER_BYTES];
    memory
        .read_many(&mut [(base, &mut header[..])])
        .map_err(ReadError::Memory)?;
    check_header(&header, expect)
}

/// Read the data bytes `bytes` of the region at `base` into `out` (exactly `bytes.len()` bytes)
/// as one whole publication, and return its version: the reader side of the seqlock (module doc).
/// An empty range returns the version of the chunk holding its start. Retries until `deadline`;
/// a read that starts at or after it is [`ReadError::Deadline`]. On an error `out` may hold
/// anything.
pub(crate) fn read<M: RemoteMemory + ?Sized>(
    memory: &mut M,
    base: u64,
    expect: &Expect,
    bytes: Range<usize>,
    out: &mut [u8],
    deadline: Instant,
) -> Result<u64, ReadError<M::Error>> {
    let layout = &expect.layout;
    if bytes.start > bytes.end || bytes.end > layout.data_bytes || out.len() != bytes.len() {
        return Err(ReadError::Invalid(format!(
            "bytes {}..{} into {} bytes, of a region of {} bytes",
            bytes.start,
            bytes.end,
            out.len(),
            layout.data_bytes
        )));
    }
    let chunks = layout.chunks_of(&bytes);
    let mut phases = Remote {
        memory,
        base,
        expect,
        bytes,
        out,
        header: [0; HEADER_BYTES],
        words: vec![0; chunks.len() * WORD],
    };
    seqlock::read(&mut phases, chunks, deadline).map_err(|e| match e {
        seqlock::Failure::Deadline => ReadError::Deadline,
        seqlock::Failure::Access(e) => e,
    })
}

/// The seqlock's phases over one-sided reads of a region's memory at `base`.
struct Remote<'a, M: RemoteMemory + ?Sized> {
    memory: &'a mut M,
    base: u64,
    expect: &'a Expect,
    bytes: Range<usize>,
    out: &'a mut [u8],
    header: [u8; HEADER_BYTES],
    /// The seqs as read, little-endian bytes.
    words: Vec<u8>,
}

impl<M: RemoteMemory + ?Sized> Remote<'_, M> {
    fn at(&self, offset: usize) -> u64 {
        self.base.wrapping_add(to_u64(offset))
    }
}

impl<M: RemoteMemory + ?Sized> seqlock::Phases for Remote<'_, M> {
    type Error = ReadError<M::Error>;

    /// Phases 1 and 3: the header (checked: still the expected live region) and the seqs.
    fn seqs(&mut self, chunks: Range<usize>, out: &mut [u64]) -> Result<(), Self::Error> {
        let (header_at, seqs_at) = (
            self.at(0),
            self.at(self.expect.layout.seq_offset(chunks.start)),
        );
        self.memory
            .read_many(&mut [
                (header_at, &mut self.header[..]),
                (seqs_at, &mut self.words[..]),
            ])
            .map_err(ReadError::Memory)?;
        check_header(&self.header, self.expect)?;
        for (i, o) in out.iter_mut().enumerate() {
            *o = word_at(&self.words, i);
        }
        Ok(())
    }

    /// Phase 2: the first chunk's version and the range's bytes.
    fn copy(&mut self, chunks: Range<usize>) -> Result<u64, Self::Error> {
        let layout = &self.expect.layout;
        let mut version = [0u8; WORD];
        let (version_at, data_at) = (
            self.at(layout.version_offset(chunks.start)),
            self.at(layout.data_offset + self.bytes.start),
        );
        self.memory
            .read_many(&mut [(version_at, &mut version[..]), (data_at, &mut *self.out)])
            .map_err(ReadError::Memory)?;
        Ok(u64::from_le_bytes(version))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::seqlock::torn::{assert_whole, byte_of, read_while_publishing};

    const WHO: Identity = Identity {
        owner: 3,
        instance: 0x1234_5678_9abc_def0,
        region: 7,
    };

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    fn expect(layout: Layout) -> Expect {
        Expect { who: WHO, layout }
    }

    fn pattern(bytes: usize, seed: u8) -> Vec<u8> {
        (0..bytes)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// A "remote" memory that runs `between` after every `read_many` (to interleave a writer
    /// deterministically) and counts the calls.
    struct Scripted<'a, F: FnMut(usize)> {
        memory: &'a RegionMemory,
        calls: usize,
        between: F,
    }

    impl<F: FnMut(usize)> RemoteMemory for Scripted<'_, F> {
        type Error = String;
        fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<(), String> {
            Local(self.memory).read_many(reads)?;
            self.calls += 1;
            (self.between)(self.calls);
            Ok(())
        }
    }

    /// A memory whose reads fail.
    struct Broken;

    impl RemoteMemory for Broken {
        type Error = &'static str;
        fn read_many(&mut self, _: &mut [(u64, &mut [u8])]) -> Result<(), &'static str> {
            Err("link down")
        }
    }

    #[test]
    fn layout_places_controls_and_data_and_rejects_bad_shapes() {
        let layout = Layout::new(4, 1000, 1024).expect("layout");
        assert_eq!(layout.data_bytes, 4000);
        assert_eq!(layout.chunks, 4);
        assert_eq!(layout.seq_offset(0), 64);
        assert_eq!(layout.version_offset(0), 64 + 32);
        assert_eq!(layout.data_offset, 128);
        assert_eq!(layout.total, 128 + 4000);
        assert_eq!(layout.chunk_range(3), 3072..4000);
        assert_eq!(layout.chunks_of(&(0..4000)), 0..4);
        assert_eq!(layout.chunks_of(&(1024..1024)), 1..2);
        assert_eq!(layout.chunks_of(&(4000..4000)), 3..4);
        // Empty region: one chunk, no data.
        let empty = Layout::new(2, 0, 8).expect("empty");
        assert_eq!((empty.chunks, empty.data_bytes), (1, 0));
        assert_eq!(empty.total, empty.data_offset);
        // Odd sizes: padded to a word.
        assert_eq!(Layout::new(2, 3, 8).expect("odd").total % 8, 0);
        assert!(Layout::new(3, 1, 8).is_err());
        assert!(Layout::new(4, 1, 12).is_err());
        assert!(Layout::new(4, 1, 0).is_err());
        assert!(Layout::new(8, usize::MAX / 4, 8).is_err());
        assert_eq!(Layout::chunk_size(0), 8);
        assert_eq!(Layout::chunk_size(1001), 1000);
    }

    #[test]
    fn reads_return_the_publication_and_its_version_for_any_range() {
        let layout = Layout::new(2, 1500, 256).expect("layout");
        let first = pattern(3000, 1);
        let memory = RegionMemory::new(layout, WHO, &first, 5).expect("memory");
        let e = expect(layout);
        let mut out = vec![0u8; 3000];
        assert_eq!(
            read(&mut Local(&memory), 0, &e, 0..3000, &mut out, soon()),
            Ok(5)
        );
        assert_eq!(out, first);
        let second = pattern(3000, 77);
        memory.publish(6, &second).expect("publish");
        assert_eq!(memory.version(), 6);
        for range in [0..2, 254..258, 256..512, 510..2990, 2998..3000, 1000..1000] {
            let mut out = vec![0u8; range.len()];
            let version = read(&mut Local(&memory), 0, &e, range.clone(), &mut out, soon());
            assert_eq!(version, Ok(6), "{range:?}");
            assert_eq!(out, second[range.clone()], "{range:?}");
        }
        // A base address is added to every offset.
        struct Shifted<'a>(&'a RegionMemory);
        impl RemoteMemory for Shifted<'_> {
            type Error = String;
            fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<(), String> {
                for (addr, into) in reads.iter_mut() {
                    self.0.read_at(to_usize(*addr - 0x10_0000), into)?;
                }
                Ok(())
            }
        }
        let mut out = vec![0u8; 100];
        assert_eq!(
            read(
                &mut Shifted(&memory),
                0x10_0000,
                &e,
                100..200,
                &mut out,
                soon()
            ),
            Ok(6)
        );
        assert_eq!(out, second[100..200]);
        // Wrong lengths are refused, and change nothing.
        assert!(memory.publish(7, &second[1..]).is_err());
        assert_eq!(memory.version(), 6);
        assert!(matches!(
            read(
                &mut Local(&memory),
                0,
                &e,
                0..3002,
                &mut vec![0; 3002],
                soon()
            ),
            Err(ReadError::Invalid(_))
        ));
        assert!(matches!(
            read(&mut Local(&memory), 0, &e, 0..10, &mut [0u8; 9], soon()),
            Err(ReadError::Invalid(_))
        ));
        assert!(RegionMemory::new(layout, WHO, &first[1..], 0).is_err());
    }

    #[test]
    fn another_region_a_closed_one_or_no_header_is_gone() {
        let layout = Layout::new(4, 16, 32).expect("layout");
        let memory = RegionMemory::new(layout, WHO, &pattern(64, 3), 1).expect("memory");
        let mut out = [0u8; 64];
        let other_region = Expect {
            who: Identity { region: 8, ..WHO },
            layout,
        };
        let other_instance = Expect {
            who: Identity { instance: 1, ..WHO },
            layout,
        };
        let other_owner = Expect {
            who: Identity { owner: 4, ..WHO },
            layout,
        };
        let other_shape = expect(Layout::new(4, 15, 32).expect("layout"));
        for wrong in [other_region, other_instance, other_owner] {
            assert!(matches!(
                read(&mut Local(&memory), 0, &wrong, 0..64, &mut out, soon()),
                Err(ReadError::Gone(_))
            ));
            assert!(matches!(
                probe(&mut Local(&memory), 0, &wrong),
                Err(ReadError::Gone(_))
            ));
        }
        assert!(matches!(
            read(
                &mut Local(&memory),
                0,
                &other_shape,
                0..60,
                &mut out[..60],
                soon()
            ),
            Err(ReadError::Gone(_))
        ));
        // Not at the region's start: no magic there.
        assert!(matches!(
            probe(&mut Local(&memory), 8, &expect(layout)),
            Err(ReadError::Gone(_))
        ));
        assert_eq!(probe(&mut Local(&memory), 0, &expect(layout)), Ok(()));
        memory.close();
        assert!(matches!(
            read(
                &mut Local(&memory),
                0,
                &expect(layout),
                0..64,
                &mut out,
                soon()
            ),
            Err(ReadError::Gone(_))
        ));
        assert!(matches!(
            probe(&mut Local(&memory), 0, &expect(layout)),
            Err(ReadError::Gone(_))
        ));
    }

    #[test]
    fn memory_errors_and_reads_past_the_memory_are_reported() {
        let layout = Layout::new(4, 4, 8).expect("layout");
        let e = expect(layout);
        assert_eq!(
            read(&mut Broken, 0, &e, 0..16, &mut [0u8; 16], soon()),
            Err(ReadError::Memory("link down"))
        );
        assert_eq!(
            probe(&mut Broken, 0, &e),
            Err(ReadError::Memory("link down"))
        );
        let memory = RegionMemory::new(layout, WHO, &[0; 16], 0).expect("memory");
        assert!(memory.read_at(layout.total - 4, &mut [0u8; 8]).is_err());
        assert!(memory.read_at(usize::MAX, &mut [0u8; 8]).is_err());
        // Header seen through a base that points elsewhere: a memory error, not a panic.
        assert!(matches!(
            probe(&mut Local(&memory), u64::MAX - 8, &e),
            Err(ReadError::Memory(_))
        ));
    }

    #[test]
    fn a_publication_between_the_phases_makes_the_read_retry_and_see_one_whole_publication() {
        let layout = Layout::new(1, 64, 16).expect("layout"); // 4 chunks
        let a = vec![0xAAu8; 64];
        let b = vec![0xBBu8; 64];
        let c = vec![0xCCu8; 64];
        let memory = RegionMemory::new(layout, WHO, &a, 1).expect("memory");
        // After phase 1 of the first attempt, publish B; after phase 2 of the second, C: both
        // attempts must be refused, the third one stands.
        let mut memory_ref = Scripted {
            memory: &memory,
            calls: 0,
            between: |call| match call {
                1 => memory.publish(2, &b).expect("publish b"),
                5 => memory.publish(3, &c).expect("publish c"),
                _ => {}
            },
        };
        let mut out = vec![0u8; 40];
        let version = read(
            &mut memory_ref,
            0,
            &expect(layout),
            10..50,
            &mut out,
            soon(),
        );
        assert_eq!(version, Ok(3));
        assert_eq!(out, c[10..50]);
        assert_eq!(memory_ref.calls, 9, "three attempts of three phases");
    }

    #[test]
    fn a_writer_stopped_mid_publication_ends_in_the_deadline_not_a_hang() {
        let layout = Layout::new(4, 64, 64).expect("layout"); // 4 chunks
        let memory = RegionMemory::new(layout, WHO, &[1; 256], 1).expect("memory");
        let e = expect(layout);
        // Chunk 2 odd: a writer inside it.
        memory.poke_seq(2, 3);
        let mut out = vec![0u8; 256];
        let started = Instant::now();
        let deadline = started + Duration::from_millis(100);
        assert_eq!(
            read(&mut Local(&memory), 0, &e, 0..256, &mut out, deadline),
            Err(ReadError::Deadline)
        );
        assert!(started.elapsed() < Duration::from_secs(5));
        // A range avoiding chunk 2 is unaffected.
        assert_eq!(
            read(&mut Local(&memory), 0, &e, 0..128, &mut out[..128], soon()),
            Ok(1)
        );
        // Chunks at different even seqs (a writer that died between two chunks).
        memory.poke_seq(2, 2);
        let deadline = Instant::now() + Duration::from_millis(50);
        assert_eq!(
            read(&mut Local(&memory), 0, &e, 0..256, &mut out, deadline),
            Err(ReadError::Deadline)
        );
        // A read that starts after its deadline reads nothing.
        let mut never = Scripted {
            memory: &memory,
            calls: 0,
            between: |_| {},
        };
        assert_eq!(
            read(&mut never, 0, &e, 0..4, &mut out[..4], Instant::now()),
            Err(ReadError::Deadline)
        );
        assert_eq!(never.calls, 0);
    }

    #[test]
    fn torn_reads_are_never_observed_under_a_concurrent_writer() {
        const BYTES: usize = 16 * 1024;
        let layout = Layout::new(4, BYTES / 4, 512).expect("layout"); // 32 chunks
        let (a, b) = (vec![byte_of(1); BYTES], vec![byte_of(0); BYTES]);
        let memory = Arc::new(RegionMemory::new(layout, WHO, &b, 0).expect("memory"));
        let writer = Arc::clone(&memory);
        let publish = move |version| {
            let data = if version % 2 == 1 { &a } else { &b };
            writer.publish(version, data).expect("publish");
            // Leave windows between publications (a reader of a range never overlapped by one
            // must succeed), but many publications per read still.
            std::thread::sleep(Duration::from_micros(20));
        };
        // Readers yield between phases, widening the windows a publication can fall into.
        struct Slow<'a>(&'a RegionMemory);
        impl RemoteMemory for Slow<'_> {
            type Error = String;
            fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<(), String> {
                Local(self.0).read_many(reads)?;
                std::thread::yield_now();
                Ok(())
            }
        }
        let e = expect(layout);
        let mut out = vec![0u8; BYTES];
        let seen = read_while_publishing(publish, |reads, rng| {
            let start = (rng as usize % (BYTES / 4)) * 4;
            let len = ((rng >> 32) as usize % (3 * 512 / 4) + 1) * 4;
            let end = (start + len).min(BYTES);
            let dest = &mut out[..end - start];
            dest.fill(0);
            let version = if reads % 2 == 0 {
                read(&mut Local(&memory), 0, &e, start..end, dest, soon())
            } else {
                read(&mut Slow(&memory), 0, &e, start..end, dest, soon())
            }
            .expect("read under a live writer");
            assert_whole(dest, version, format_args!("{start}..{end}"));
            version
        });
        seen.assert_several();
    }
}
