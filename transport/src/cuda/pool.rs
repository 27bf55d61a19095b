//! Device buffers kept for reuse: what the backend allocates per transfer (push staging, device
//! messages' values, a reduce-scatter's partial sums) comes from here, so that a step allocates
//! device memory once rather than once per unit and micro-batch (`cuMemAlloc` and `cuMemFree`
//! are synchronous, and a free waits for the device).
//!
//! - A new buffer is a power of two of at least [`MIN_BYTES`]; [`Pool::take`] hands out a free
//!   one that holds the request, else makes one.
//! - A buffer comes back only once nothing can still use it: its holder gives it back, or drops
//!   the [`DeviceValues`] that holds it. At most [`KEEP`] buffers and [`KEEP_BYTES`] are kept;
//!   the rest are freed.

use std::sync::Arc;

use parking_lot::Mutex;

use super::driver::{Device, DeviceBuffer};
use crate::{DeviceDest, TransportError};

/// The smallest buffer made (smaller requests share it).
pub(super) const MIN_BYTES: usize = 1 << 20;

/// Free buffers kept at most.
pub(super) const KEEP: usize = 64;

/// Bytes of free buffers kept at most.
pub(super) const KEEP_BYTES: usize = 2 << 30;

/// What a pool holds: something of a size in bytes.
pub(super) trait Capacity {
    fn capacity(&self) -> usize;
}

impl Capacity for DeviceBuffer {
    fn capacity(&self) -> usize {
        self.len()
    }
}

/// Free buffers (see the [module docs](self)).
pub(super) struct Pool<T> {
    free: Mutex<Vec<T>>,
}

impl<T> Default for Pool<T> {
    fn default() -> Self {
        Pool {
            free: Mutex::new(Vec::new()),
        }
    }
}

/// The size of the buffer made for a request of `bytes`.
pub(super) fn size_class(bytes: usize) -> usize {
    bytes.max(MIN_BYTES).next_power_of_two()
}

impl<T: Capacity> Pool<T> {
    /// A free buffer of at least `bytes` (the smallest), else `make(size_class(bytes))`.
    pub(super) fn take(
        &self,
        bytes: usize,
        make: impl FnOnce(usize) -> Result<T, TransportError>,
    ) -> Result<T, TransportError> {
        {
            let mut free = self.free.lock();
            let fits = free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= bytes)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            if let Some(i) = fits {
                return Ok(free.swap_remove(i));
            }
        }
        make(size_class(bytes))
    }

    /// `buffer` back (nothing uses it any more), or freed if the pool is full.
    pub(super) fn give_back(&self, buffer: T) {
        let extra = {
            let mut free = self.free.lock();
            let kept: usize = free.iter().map(Capacity::capacity).sum();
            if free.len() < KEEP && kept + buffer.capacity() <= KEEP_BYTES {
                free.push(buffer);
                None
            } else {
                Some(buffer)
            }
        };
        // Freed outside the lock (a free waits for the device).
        drop(extra);
    }

    /// How many free buffers are kept.
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.free.lock().len()
    }
}

/// Values in a pooled device buffer: its first [`DeviceValues::len`] bytes. The buffer goes back
/// to its pool when this is dropped.
pub struct DeviceValues {
    buffer: Option<DeviceBuffer>,
    len: usize,
    pool: Arc<Pool<DeviceBuffer>>,
}

impl std::fmt::Debug for DeviceValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceValues({} bytes at {:#x})", self.len, self.ptr())
    }
}

impl DeviceValues {
    /// `len` bytes in a buffer of `pool` on `device` (its contents whatever they were).
    pub(super) fn take(
        pool: &Arc<Pool<DeviceBuffer>>,
        device: &Arc<Device>,
        len: usize,
    ) -> Result<Self, TransportError> {
        let buffer = pool.take(len, |size| device.alloc(size))?;
        Ok(DeviceValues {
            buffer: Some(buffer),
            len,
            pool: Arc::clone(pool),
        })
    }

    /// Bytes of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The values' memory.
    pub fn dest(&self) -> DeviceDest {
        let whole = self.buffer().dest();
        DeviceDest {
            bytes: self.len as u64,
            ..whole
        }
    }

    fn buffer(&self) -> &DeviceBuffer {
        // Taken only by `drop`.
        self.buffer.as_ref().expect("a live buffer")
    }

    pub(super) fn ptr(&self) -> u64 {
        self.buffer().ptr()
    }

    /// Whether its memory is `device`'s.
    pub(super) fn is_on(&self, device: &Device) -> bool {
        self.buffer().is_on(device)
    }
}

impl Drop for DeviceValues {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            self.pool.give_back(buffer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(usize);

    impl Capacity for Fake {
        fn capacity(&self) -> usize {
            self.0
        }
    }

    #[test]
    fn the_smallest_free_buffer_that_holds_a_request_is_reused() {
        let pool = Pool::default();
        let made = std::cell::Cell::new(0);
        let make = |size| {
            made.set(made.get() + 1);
            Ok(Fake(size))
        };
        let a = pool.take(10, make).unwrap();
        assert_eq!(a.0, MIN_BYTES, "small requests share the smallest class");
        let b = pool.take(3 * MIN_BYTES, make).unwrap();
        assert_eq!(b.0, 4 * MIN_BYTES, "a power of two");
        pool.give_back(b);
        pool.give_back(a);
        assert_eq!(
            pool.take(5, make).unwrap().0,
            MIN_BYTES,
            "the smallest that fits"
        );
        assert_eq!(pool.take(2 * MIN_BYTES, make).unwrap().0, 4 * MIN_BYTES);
        assert_eq!(made.get(), 2, "both reused");
        assert_eq!(pool.take(MIN_BYTES + 1, make).unwrap().0, 2 * MIN_BYTES);
        assert_eq!(made.get(), 3, "nothing free: a new one");
    }

    #[test]
    fn the_pool_keeps_at_most_its_bounds() {
        let pool = Pool::default();
        for _ in 0..KEEP + 5 {
            pool.give_back(Fake(MIN_BYTES));
        }
        assert_eq!(pool.kept(), KEEP);
        let big = Pool::default();
        big.give_back(Fake(KEEP_BYTES));
        big.give_back(Fake(MIN_BYTES));
        assert_eq!(big.kept(), 1, "over the byte bound: freed");
    }
}
