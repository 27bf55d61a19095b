//! The test of C1 that every seqlock reader shares (the seqlock's own readers, `shm`'s segments,
//! `rdma`'s registered memory): a writer publishes without pause on its own thread while the test
//! reads random ranges for 300 ms; each read checks that what it copied is the one publication it
//! names, and the reads together must have seen more than one.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the reads of [`read_while_publishing`] saw.
#[derive(Debug)]
pub(crate) struct Seen {
    /// Reads done.
    pub(crate) reads: u64,
    /// The versions they returned.
    pub(crate) versions: BTreeSet<u64>,
    /// Publications done meanwhile.
    pub(crate) published: u64,
}

impl Seen {
    /// Some reads were done, and they saw more than one publication.
    pub(crate) fn assert_several(&self) {
        assert!(self.reads > 0);
        assert!(
            self.versions.len() >= 2,
            "{} reads saw only versions {:?} of {} publications",
            self.reads,
            self.versions,
            self.published
        );
    }
}

/// `publish(version)` for versions 1, 2, … without pause on a thread of its own, while
/// `read(reads so far, a random number)` reads (and checks) one range and returns the version it
/// read, for 300 ms.
pub(crate) fn read_while_publishing(
    mut publish: impl FnMut(u64) + Send + 'static,
    mut read: impl FnMut(u64, u64) -> u64,
) -> Seen {
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut version = 0u64;
            while !stop.load(Ordering::Relaxed) {
                version += 1;
                publish(version);
            }
            version
        })
    };
    let started = Instant::now();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let (mut reads, mut versions) = (0u64, BTreeSet::new());
    while started.elapsed() < Duration::from_millis(300) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        versions.insert(read(reads, rng));
        reads += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let published = writer.join().expect("writer");
    Seen {
        reads,
        versions,
        published,
    }
}

/// The byte every data byte of publication `version` holds in the byte-region tests: `0xAA` for
/// odd versions, `0x55` for even ones.
pub(crate) fn byte_of(version: u64) -> u8 {
    if version % 2 == 1 {
        0xAA
    } else {
        0x55
    }
}

/// `read` filled `dest` (the range `what`) with publication `version` whole.
pub(crate) fn assert_whole(dest: &[u8], version: u64, what: impl std::fmt::Display) {
    let expected = byte_of(version);
    assert!(
        dest.iter().all(|&x| x == expected),
        "torn read of {what} at version {version}"
    );
}
