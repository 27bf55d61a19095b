//! The seqlock's tests, over a region in process memory whose data words are atomics (so a racing
//! copy is defined behaviour): whole publications for every range (both readers), never a torn
//! read under a live writer, a dead writer ends in the deadline, `publish_outside`'s failure, and
//! every interleaving of a writer's steps with a reader's loads (C1, exhaustively, on a small
//! region).

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use super::torn::read_while_publishing;
use super::*;

/// A region of `chunks` chunks of `words` data words each, its controls beside it.
struct Region {
    seqs: Vec<AtomicU64>,
    versions: Vec<AtomicU64>,
    data: Vec<AtomicU64>,
    words: usize,
}

impl Controls for Region {
    fn seq(&self, chunk: usize) -> &AtomicU64 {
        &self.seqs[chunk]
    }
    fn version(&self, chunk: usize) -> &AtomicU64 {
        &self.versions[chunk]
    }
}

impl Region {
    fn new(chunks: usize, words: usize) -> Self {
        let atomics = |n: usize| (0..n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        Self {
            seqs: atomics(chunks),
            versions: atomics(chunks),
            data: atomics(chunks * words),
            words,
        }
    }

    fn chunks(&self) -> usize {
        self.seqs.len()
    }

    /// Publication `version`: every data word holds `version`.
    fn publish(&self, version: u64) {
        publish(self, self.chunks(), version, |c| self.write(c, version));
    }

    fn write(&self, c: usize, value: u64) {
        for w in &self.data[c * self.words..(c + 1) * self.words] {
            w.store(value, Ordering::Relaxed);
        }
    }

    /// Copy the data words of `chunks` into `out` (indexed from `chunks.start`).
    fn copy(&self, chunks: Range<usize>, out: &mut [u64]) {
        for c in chunks.clone() {
            self.copy_chunk(c, chunks.start, out);
        }
    }

    fn copy_chunk(&self, c: usize, first: usize, out: &mut [u64]) {
        let at = (c - first) * self.words;
        for (i, w) in self.data[c * self.words..(c + 1) * self.words]
            .iter()
            .enumerate()
        {
            out[at + i] = w.load(Ordering::Relaxed);
        }
    }
}

/// The whole-range reader over a [`Region`]: `out` receives the data words.
struct Whole<'a> {
    region: &'a Region,
    out: Vec<u64>,
}

impl Phases for Whole<'_> {
    type Error = std::convert::Infallible;
    fn seqs(&mut self, chunks: Range<usize>, out: &mut [u64]) -> Result<(), Self::Error> {
        for (c, o) in chunks.zip(out.iter_mut()) {
            *o = load(self.region.seq(c), Ordering::Acquire);
        }
        Ok(())
    }
    fn copy(&mut self, chunks: Range<usize>) -> Result<u64, Self::Error> {
        let version = load(self.region.version(chunks.start), Ordering::Relaxed);
        self.region.copy(chunks, &mut self.out);
        Ok(version)
    }
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

#[test]
fn a_quiet_region_reads_whole_for_every_range_with_both_readers() {
    let region = Region::new(5, 3);
    region.publish(7);
    for start in 0..5 {
        for end in start + 1..=5 {
            let mut whole = Whole {
                region: &region,
                out: vec![0; (end - start) * 3],
            };
            assert_eq!(read(&mut whole, start..end, far()), Ok(7));
            assert!(whole.out.iter().all(|&w| w == 7));
            let mut out = vec![0; (end - start) * 3];
            let v = read_pieces(&region, start..end, far(), |c| {
                region.copy_chunk(c, start, &mut out)
            });
            assert_eq!(v, Ok(7));
            assert!(out.iter().all(|&w| w == 7));
        }
    }
}

/// A writer publishing without pause (`gap` between publications) while readers read random
/// ranges for 300 ms: every read returns a publication whole, and more than one is seen.
fn never_torn(whole_reads: bool, gap: Duration) {
    let region = Arc::new(Region::new(32, 16));
    region.publish(0);
    let writer = Arc::clone(&region);
    let publish = move |version| {
        writer.publish(version);
        if !gap.is_zero() {
            std::thread::sleep(gap);
        }
    };
    let seen = read_while_publishing(publish, |_, rng| {
        let start = rng as usize % 32;
        let end = (start + 1 + (rng >> 32) as usize % 6).min(32);
        let mut out = vec![u64::MAX; (end - start) * 16];
        let version = if whole_reads {
            let mut whole = Whole {
                region: &region,
                out,
            };
            let v = read(&mut whole, start..end, far()).expect("read under a live writer");
            out = whole.out;
            v
        } else {
            read_pieces(&*region, start..end, far(), |c| {
                region.copy_chunk(c, start, &mut out)
            })
            .expect("read under a live writer")
        };
        assert!(
            out.iter().all(|&w| w == version),
            "torn read of chunks {start}..{end} at version {version}"
        );
        version
    });
    seen.assert_several();
}

#[test]
fn pieces_are_never_torn_under_a_writer_that_never_pauses() {
    never_torn(false, Duration::ZERO);
}

#[test]
fn whole_ranges_are_never_torn_under_a_writer_with_gaps() {
    never_torn(true, Duration::from_micros(20));
}

#[test]
fn a_writer_stopped_mid_publication_ends_in_the_deadline_not_a_hang() {
    let region = Region::new(4, 2);
    region.publish(3);
    // Chunk 2 odd, as a writer that died after `begin_chunk` leaves it.
    let _odd = begin_chunk(&region, 2);
    let soon = Instant::now() + Duration::from_millis(50);
    let mut whole = Whole {
        region: &region,
        out: vec![0; 8],
    };
    assert_eq!(read(&mut whole, 0..4, soon), Err(Failure::Deadline));
    let mut out = vec![0; 8];
    let soon = Instant::now() + Duration::from_millis(50);
    assert_eq!(
        read_pieces(&region, 0..4, soon, |c| region.copy_chunk(c, 0, &mut out)),
        Err(Failure::Deadline)
    );
    // A chunk it never reached is still readable.
    let mut whole = Whole {
        region: &region,
        out: vec![0; 2],
    };
    assert_eq!(read(&mut whole, 3..4, far()), Ok(3));
    // A read that starts past its deadline reads nothing.
    assert_eq!(
        read(&mut whole, 3..4, Instant::now()),
        Err(Failure::Deadline)
    );
}

#[test]
fn a_failed_outside_write_leaves_the_region_unreadable_until_the_next_publication() {
    let region = Region::new(1, 1);
    assert_eq!(publish_outside(&region, 4, || Ok::<(), ()>(())), Ok(()));
    let mut whole = Whole {
        region: &region,
        out: vec![0],
    };
    assert_eq!(read(&mut whole, 0..1, far()), Ok(4));
    assert_eq!(
        publish_outside(&region, 5, || Err("copy failed")),
        Err("copy failed")
    );
    let soon = Instant::now() + Duration::from_millis(30);
    assert_eq!(read(&mut whole, 0..1, soon), Err(Failure::Deadline));
    assert_eq!(publish_outside(&region, 6, || Ok::<(), ()>(())), Ok(()));
    assert_eq!(read(&mut whole, 0..1, far()), Ok(6));
    assert_eq!(load(region.seq(0), Ordering::Relaxed) % 2, 0);
}

/// One step of a writer that publishes versions 1 and 2 over a region of two one-word chunks.
#[derive(Clone, Copy, Debug)]
enum Step {
    Begin(usize),
    Write(usize, u64),
    End(usize, u64),
}

fn writer_script() -> Vec<Step> {
    let mut steps = Vec::new();
    for version in 1..=2 {
        for c in 0..2 {
            steps.extend([
                Step::Begin(c),
                Step::Write(c, version),
                Step::End(c, version),
            ]);
        }
    }
    steps
}

/// The writer, stepped: the real `begin_chunk`/`end_chunk` around a data store.
struct Stepped<'a> {
    region: &'a Region,
    script: Vec<Step>,
    next: usize,
    odd: [u64; 2],
    /// Writer steps to run before each reader load, in order of the loads.
    schedule: Vec<usize>,
    loads: usize,
}

impl<'a> Stepped<'a> {
    /// The writer of `script` on `region`, its steps run as `schedule` says.
    fn new(region: &'a Region, script: Vec<Step>, schedule: Vec<usize>) -> Self {
        Self {
            region,
            script,
            next: 0,
            odd: [0; 2],
            schedule,
            loads: 0,
        }
    }

    /// A reader load is about to happen: run the writer steps scheduled before it (one per load
    /// once the schedule is used up, so that the writer always finishes).
    fn before_load(&mut self) {
        let n = self.schedule.get(self.loads).copied().unwrap_or(1);
        self.loads += 1;
        for _ in 0..n {
            self.step();
        }
    }

    fn step(&mut self) {
        let Some(&step) = self.script.get(self.next) else {
            return;
        };
        self.next += 1;
        match step {
            Step::Begin(c) => self.odd[c] = begin_chunk(self.region, c),
            Step::Write(c, v) => self.region.write(c, v),
            Step::End(c, v) => end_chunk(self.region, c, self.odd[c], v),
        }
    }

    fn finish(&mut self) {
        while self.next < self.script.len() {
            self.step();
        }
    }
}

/// Every way `total` writer steps can fall before `slots` reader loads (and after the last).
fn schedules(total: usize, slots: usize) -> Vec<Vec<usize>> {
    fn go(left: usize, slots: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if cur.len() == slots {
            out.push(cur.clone());
            return;
        }
        for n in 0..=left {
            cur.push(n);
            go(left - n, slots, cur, out);
            cur.pop();
        }
    }
    let mut out = Vec::new();
    go(total, slots, &mut Vec::new(), &mut out);
    out
}

/// The whole-range reader with the stepped writer run before each of its word loads.
struct Interleaved<'a, 'b> {
    writer: &'b RefCell<Stepped<'a>>,
    out: [u64; 2],
}

impl Phases for Interleaved<'_, '_> {
    type Error = std::convert::Infallible;
    fn seqs(&mut self, chunks: Range<usize>, out: &mut [u64]) -> Result<(), Self::Error> {
        for (c, o) in chunks.zip(out.iter_mut()) {
            self.writer.borrow_mut().before_load();
            *o = load(self.writer.borrow().region.seq(c), Ordering::Acquire);
        }
        Ok(())
    }
    fn copy(&mut self, chunks: Range<usize>) -> Result<u64, Self::Error> {
        self.writer.borrow_mut().before_load();
        let region = self.writer.borrow().region;
        let version = load(region.version(chunks.start), Ordering::Relaxed);
        for c in chunks {
            self.writer.borrow_mut().before_load();
            self.out[c] = region.data[c].load(Ordering::Relaxed);
        }
        Ok(version)
    }
}

/// C1 over every interleaving of a writer's 12 steps (two publications over two chunks) with the
/// 7 loads of one whole-range attempt: whenever the attempt accepts, it returns the version whose
/// data it copied, whole. (Sequentially consistent interleavings of the real code's steps; the
/// fences are argued in the module doc and exercised by the threaded tests.)
#[test]
fn every_interleaving_of_a_whole_range_read_accepts_only_whole_publications() {
    let script = writer_script();
    let (mut accepted, mut refused) = (0, 0);
    for schedule in schedules(script.len(), 7) {
        let region = Region::new(2, 1);
        let writer = RefCell::new(Stepped::new(&region, script.clone(), schedule));
        let mut reader = Interleaved {
            writer: &writer,
            out: [u64::MAX; 2],
        };
        let (mut seqs, mut again) = ([0u64; 2], [0u64; 2]);
        let got = try_read(&mut reader, 0..2, &mut seqs, &mut again).expect("no access errors");
        writer.borrow_mut().finish();
        match got {
            Some(v) => {
                accepted += 1;
                assert_eq!(reader.out, [v, v], "accepted a mix at version {v}");
            }
            None => refused += 1,
        }
    }
    assert_eq!(accepted + refused, 50_388, "C(19, 7) interleavings");
    assert!(
        accepted > 0 && refused > 0,
        "{accepted} accepted, {refused} refused"
    );
}

/// The same for the chunk-by-chunk reader, whose retries run until the writer is done: every
/// interleaving of the writer's steps with the reader's first 9 loads (the rest after them) ends
/// in a whole publication.
#[test]
fn every_interleaving_of_a_piecewise_read_ends_in_a_whole_publication() {
    let script = writer_script();
    for schedule in schedules(script.len(), 9) {
        let region = Region::new(2, 1);
        let writer = RefCell::new(Stepped::new(&region, script.clone(), schedule));
        // Controls whose every word access first runs the scheduled writer steps.
        struct Hooked<'a, 'b>(&'b RefCell<Stepped<'a>>);
        impl Controls for Hooked<'_, '_> {
            fn seq(&self, chunk: usize) -> &AtomicU64 {
                self.0.borrow_mut().before_load();
                self.0.borrow().region.seq(chunk)
            }
            fn version(&self, chunk: usize) -> &AtomicU64 {
                self.0.borrow_mut().before_load();
                self.0.borrow().region.version(chunk)
            }
        }
        let mut out = [u64::MAX; 2];
        let version = read_pieces(&Hooked(&writer), 0..2, far(), |c| {
            writer.borrow_mut().before_load();
            out[c] = region.data[c].load(Ordering::Relaxed);
        })
        .expect("the writer finishes, so the read does");
        assert_eq!(out, [version, version], "a mix at version {version}");
    }
}
