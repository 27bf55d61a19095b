//! The seqlock of every region a reader copies without its owner: `shm`'s mapped segments,
//! `rdma`'s registered memory and the control segment of `cuda`'s device regions. One writer
//! protocol, two ways to read it, and the one argument for contract C1 (a read observes one whole
//! publication, never a mix) that all of them rest on.
//!
//! # The words
//! A region's data is cut into chunks; chunk `c` has a **seq** word and a **version** word
//! ([`Controls`]), 8-aligned `u64`s stored little-endian (the same bytes on every host a NIC may
//! read them from). Where the words and the data live is the backend's: 64-byte control pairs
//! before a mapped file's data (`shm`), all seqs then all versions before an allocation (`rdma`),
//! one pair in a data-less segment beside device memory (`cuda`).
//!
//! # Writer ([`publish`]; one writer at a time, the backend holds a lock)
//! For each chunk in order: `seq += 1` (odd), fence `Release`, store the chunk's bytes, store
//! `version`, `seq += 1` (even, `Release`). Every publication therefore advances every chunk's
//! seq by exactly 2: at rest all chunks carry the same even seq, and "chunk `c` has seq `s`"
//! means "chunk `c` holds publication `s / 2`". [`publish_outside`] is the same for data that
//! lives elsewhere (device memory, one chunk): the seq is made odd, then `SeqCst` fences order it
//! around a copy that another engine performs; a failed copy leaves the seq odd (readers wait
//! and reach their deadline rather than see torn data) until a later publication succeeds.
//!
//! # Reader, whole range ([`read`], [`try_read`]): three phases, each complete before the next
//! 1. the seqs of the chunks the range touches;
//! 2. the version of the first of them and the range's bytes;
//! 3. the same seqs again.
//!
//! The read stands if every seq of phase 1 is even, they are all equal, and phase 3 loaded
//! exactly the same seqs; it returns the version of phase 2. Otherwise it is done again until
//! its deadline.
//!
//! # Reader, chunk by chunk ([`read_pieces`], for in-process memory)
//! For each chunk's piece: load the seq; if odd, or older than the seq the earlier pieces were
//! read at, wait; if newer, restart from the first piece (the earlier pieces belong to an older
//! publication); else load the version, copy the piece, fence `Acquire` and load the seq again:
//! unchanged means the piece is whole. The read returns when every piece was read at one seq.
//! It follows a writer that publishes without pause, which the whole-range read, needing every
//! chunk quiet at once, may never see.
//!
//! # Why a read is one whole publication (C1)
//! A chunk's seq only grows. A piece (or a whole range) is accepted only if the seq loaded
//! before its bytes is even and the seq loaded after them is the same value, so no writer stored
//! to that seq in between: the writer makes the seq odd before it stores any byte of the chunk
//! (or its version), with a `Release` fence between, and the reader's `Acquire` fence after its
//! copy makes any byte of a later publication that the copy saw imply the later seq at the
//! re-check. The even seq loaded first was stored after every byte of its publication
//! (`Release` store, `Acquire` load), so the bytes are that publication's, whole. Equal seqs
//! across chunks mean the same publication, because every publication moves every seq by 2.
//! The version is loaded between the two seq loads like the data, so it is covered by the same
//! argument.
//!
//! What the argument needs from a reader that is not a CPU (a NIC, a copy engine) is only that
//! each phase has completed before the next is issued, and that an aligned 8-byte word is read
//! whole. Both hold for an RDMA READ, whose completion means the data is in the reader's memory,
//! and for a device copy the reader waited for. A writer whose copy is done by a device fences
//! `SeqCst` around it ([`publish_outside`]), and so does its reader.
//!
//! A writer that died in the middle of a publication leaves a seq odd, or the chunks at
//! different seqs, for ever: every read waits in [`Backoff`], which ends at the deadline
//! ([`Failure::Deadline`]), never in a hang. In-process access goes through atomic loads of the
//! words, and racing copies of the data are redone, so a read racing a publication is not a data
//! race in Rust's memory model either (the backends copy data with word loads or from shared
//! memory of another process).

use std::ops::Range;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::Instant;

/// Failed attempts a read spins before it yields the thread and checks its deadline.
const SPINS_BEFORE_YIELD: u32 = 64;

/// Where a region's control words are, for the writer and for in-process readers.
pub(crate) trait Controls {
    /// Chunk `chunk`'s seq word.
    fn seq(&self, chunk: usize) -> &AtomicU64;
    /// Chunk `chunk`'s version word.
    fn version(&self, chunk: usize) -> &AtomicU64;
}

/// A word's value (stored little-endian).
pub(crate) fn load(word: &AtomicU64, order: Ordering) -> u64 {
    u64::from_le(word.load(order))
}

fn store(word: &AtomicU64, value: u64, order: Ordering) {
    word.store(value.to_le(), order);
}

/// Publish `version` over `chunks` chunks: for each, the odd seq, `write(c)` (which stores chunk
/// `c`'s bytes, any way it likes), the version, the even seq. The caller is the only writer.
pub(crate) fn publish<C: Controls + ?Sized>(
    controls: &C,
    chunks: usize,
    version: u64,
    mut write: impl FnMut(usize),
) {
    for c in 0..chunks {
        let odd = begin_chunk(controls, c);
        write(c);
        end_chunk(controls, c, odd, version);
    }
}

/// The first step of publishing chunk `c`: its seq made odd, then a `Release` fence, so that a
/// reader that sees any byte stored after this sees the seq moved. Returns the odd seq.
fn begin_chunk<C: Controls + ?Sized>(controls: &C, c: usize) -> u64 {
    let seq = controls.seq(c);
    // Only the one writer stores to `seq`.
    let odd = load(seq, Ordering::Relaxed).wrapping_add(1);
    store(seq, odd, Ordering::Relaxed);
    fence(Ordering::Release);
    odd
}

/// The last step of publishing chunk `c`: its version, then the even seq (`Release`).
fn end_chunk<C: Controls + ?Sized>(controls: &C, c: usize, odd: u64, version: u64) {
    store(controls.version(c), version, Ordering::Relaxed);
    store(controls.seq(c), odd.wrapping_add(1), Ordering::Release);
}

/// Publish `version` of data that lives elsewhere (one chunk, chunk 0): `write` replaces it and
/// returns once it is in place. If `write` fails the seq stays odd until a later publication
/// succeeds, and its error is returned.
#[cfg_attr(not(feature = "cuda-code"), allow(dead_code))]
pub(crate) fn publish_outside<C: Controls + ?Sized, E>(
    controls: &C,
    version: u64,
    write: impl FnOnce() -> Result<(), E>,
) -> Result<(), E> {
    let seq = controls.seq(0);
    // Odd already only after a failed write.
    let odd = load(seq, Ordering::Relaxed) | 1;
    store(seq, odd, Ordering::Relaxed);
    // The odd seq is visible to every CPU before `write` starts the copy (a device copy is started
    // by a driver call after this fence and observed complete by readers before their re-check).
    fence(Ordering::SeqCst);
    write()?;
    store(controls.version(0), version, Ordering::Relaxed);
    store(seq, odd.wrapping_add(1), Ordering::Release);
    fence(Ordering::SeqCst);
    Ok(())
}

/// What a whole-range reader does in its phases. Each call is complete when it returns.
pub(crate) trait Phases {
    /// Why the memory could not be read (the backend's error).
    type Error;
    /// Phases 1 and 3: the seqs of `chunks` into `out` (one per chunk, in order).
    fn seqs(&mut self, chunks: Range<usize>, out: &mut [u64]) -> Result<(), Self::Error>;
    /// Phase 2: copy the range being read and return the version of chunk `chunks.start`.
    fn copy(&mut self, chunks: Range<usize>) -> Result<u64, Self::Error>;
}

/// Why a read returned no publication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure<E> {
    /// No stable publication by the deadline (or the read started at or after it).
    Deadline,
    /// The memory could not be read.
    #[cfg_attr(not(any(feature = "cuda-code", feature = "rdma")), allow(dead_code))]
    Access(E),
}

/// Phases 1 to 3 once, over `chunks` (non-empty): `Some(version)` if they read one whole
/// publication, `None` if a publication was in progress or ran meanwhile. `seqs` and `again` are
/// scratch of `chunks.len()` words.
pub(crate) fn try_read<P: Phases + ?Sized>(
    phases: &mut P,
    chunks: Range<usize>,
    seqs: &mut [u64],
    again: &mut [u64],
) -> Result<Option<u64>, P::Error> {
    phases.seqs(chunks.clone(), seqs)?;
    // Makes in-process seq loads acquire loads whatever ordering the backend used.
    fence(Ordering::Acquire);
    let first = seqs.first().copied().unwrap_or(1);
    if first % 2 == 1 || seqs.iter().any(|&s| s != first) {
        return Ok(None);
    }
    let version = phases.copy(chunks.clone())?;
    // Orders the copy (and the version load) before the re-check: if the copy saw any byte a
    // later publication stored, the seq of its chunk has moved on.
    fence(Ordering::Acquire);
    phases.seqs(chunks, again)?;
    Ok((again == seqs).then_some(version))
}

/// One whole publication of `chunks` (non-empty), retried until `deadline`: its version.
#[cfg_attr(not(any(feature = "cuda-code", feature = "rdma")), allow(dead_code))]
pub(crate) fn read<P: Phases + ?Sized>(
    phases: &mut P,
    chunks: Range<usize>,
    deadline: Instant,
) -> Result<u64, Failure<P::Error>> {
    let mut seqs = vec![0u64; chunks.len()];
    let mut again = vec![0u64; chunks.len()];
    let mut backoff = Backoff::new(deadline);
    loop {
        if Instant::now() >= deadline {
            return Err(Failure::Deadline);
        }
        if let Some(version) =
            try_read(phases, chunks.clone(), &mut seqs, &mut again).map_err(Failure::Access)?
        {
            return Ok(version);
        }
        backoff.snooze()?;
    }
}

/// One whole publication of `chunks` (non-empty) read chunk by chunk from in-process memory:
/// `copy(c)` copies the read's piece of chunk `c` (again, to the same place, when a copy was torn
/// or belonged to another publication). Returns the version all final pieces were read at. The
/// caller checks that the read starts before `deadline`; waiting for a writer ends there.
pub(crate) fn read_pieces<C: Controls + ?Sized>(
    controls: &C,
    chunks: Range<usize>,
    deadline: Instant,
    mut copy: impl FnMut(usize),
) -> Result<u64, Failure<std::convert::Infallible>> {
    // The caller checked the deadline before the read; a wait checks it again.
    let mut backoff = Backoff::new(deadline);
    'restart: loop {
        // The (seq, version) every piece so far was read at.
        let mut at: Option<(u64, u64)> = None;
        for c in chunks.clone() {
            loop {
                let before = load(controls.seq(c), Ordering::Acquire);
                let wait = before % 2 == 1 || at.is_some_and(|(s, _)| before < s);
                if !wait {
                    if at.is_some_and(|(s, _)| before > s) {
                        // The earlier pieces belong to an older publication.
                        backoff.snooze()?;
                        continue 'restart;
                    }
                    let v = load(controls.version(c), Ordering::Relaxed);
                    copy(c);
                    // Orders the copy (and the version load) before the re-check.
                    fence(Ordering::Acquire);
                    if load(controls.seq(c), Ordering::Relaxed) == before {
                        at = Some((before, v));
                        break;
                    }
                }
                backoff.snooze()?;
            }
        }
        return at.map(|(_, v)| v).ok_or(Failure::Deadline);
    }
}

/// Bounded spinning, then yielding the thread and checking the deadline.
pub(crate) struct Backoff {
    spins: u32,
    deadline: Instant,
}

impl Backoff {
    pub(crate) fn new(deadline: Instant) -> Self {
        Self { spins: 0, deadline }
    }

    /// Wait a little: [`Failure::Deadline`] once the deadline has passed.
    pub(crate) fn snooze<E>(&mut self) -> Result<(), Failure<E>> {
        self.spins += 1;
        if self.spins < SPINS_BEFORE_YIELD {
            std::hint::spin_loop();
            return Ok(());
        }
        self.spins = 0;
        if Instant::now() >= self.deadline {
            return Err(Failure::Deadline);
        }
        std::thread::yield_now();
        Ok(())
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
pub(crate) mod torn;
