//! The largest single allocation of this thread while tracking: the hostile-input tests check
//! that a length field from a peer never makes odc reserve what the peer only claims. Installs the
//! test binary's global allocator (every call forwarded to `System` unchanged).

#![allow(dead_code)] // each test binary uses part of it

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Tracking;

thread_local! {
    static TRACK: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // `try_with`: the allocator runs during thread teardown too.
    if TRACK.try_with(Cell::get).unwrap_or(false) {
        let _ = LARGEST.try_with(|largest| largest.set(largest.get().max(size)));
    }
}

// SAFETY: every call is forwarded to `System` unchanged; the bookkeeping only reads sizes.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Tracking = Tracking;

/// Start recording this thread's largest allocation (from zero).
pub fn start() {
    LARGEST.with(|largest| largest.set(0));
    TRACK.with(|track| track.set(true));
}

/// The largest allocation on this thread since [`start`] (tracking goes on).
pub fn largest() -> usize {
    LARGEST.with(Cell::get)
}

/// Stop recording; the largest allocation since [`start`].
pub fn stop() -> usize {
    TRACK.with(|track| track.set(false));
    largest()
}

/// `f`'s result and the largest single allocation it made on this thread.
pub fn during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    start();
    let out = f();
    (out, stop())
}
