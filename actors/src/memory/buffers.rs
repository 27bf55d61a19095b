//! Gathered unit buffers and how many are alive, measured from the buffers themselves (I5).
//!
//! Every buffer a gather fills is allocated here. While its transfer runs it is counted by a
//! [`Lease`]; once the context takes it over, by a weak reference. [`UnitBuffers::live`] counts the
//! leases plus the weak references that still upgrade: the buffers alive anywhere — in the
//! context, in a prefetch task, in a finished prefetch nobody took yet, or in the user's compute —
//! whatever the context's own bookkeeping says.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::device::{DeviceUnit, UnitValues};

/// Counts one buffer whose transfer is in flight; dropped when the context takes the buffer over
/// (or the transfer is cancelled).
#[derive(Debug)]
pub struct Lease(Arc<AtomicUsize>);

impl Drop for Lease {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The unit buffers of one trainer. See the [module docs](self).
#[derive(Debug, Default)]
pub struct UnitBuffers {
    leased: Arc<AtomicUsize>,
    taken: Mutex<Vec<Taken>>,
}

/// A buffer the context took over, by weak reference.
#[derive(Debug)]
enum Taken {
    Host(Weak<[f32]>),
    Device(Weak<dyn DeviceUnit>),
}

impl Taken {
    fn alive(&self) -> bool {
        match self {
            Taken::Host(w) => w.strong_count() > 0,
            Taken::Device(w) => w.strong_count() > 0,
        }
    }
}

impl UnitBuffers {
    /// A zeroed buffer of `len` elements, uniquely owned, and its lease.
    pub fn allocate(&self, len: usize) -> (Arc<[f32]>, Lease) {
        // Collected straight into the `Arc`: one allocation, no copy.
        let buffer: Arc<[f32]> = std::iter::repeat_n(0.0, len).collect();
        (buffer, self.lease())
    }

    /// The lease of a buffer someone else allocates (device memory), counted from now on.
    pub fn lease(&self) -> Lease {
        self.leased.fetch_add(1, Ordering::SeqCst);
        Lease(self.leased.clone())
    }

    /// The context took `buffer` over (its lease is dropped by the caller).
    pub fn track(&self, buffer: &UnitValues) {
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        taken.retain(Taken::alive);
        taken.push(match buffer {
            UnitValues::Host(values) => Taken::Host(Arc::downgrade(values)),
            UnitValues::Device { buffer, .. } => Taken::Device(Arc::downgrade(buffer)),
        });
    }

    /// Buffers alive: in flight, plus taken over and still referenced by anyone.
    pub fn live(&self) -> usize {
        let taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        self.leased.load(Ordering::SeqCst) + taken.iter().filter(|t| t.alive()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_counts_leases_and_referenced_buffers() {
        let buffers = UnitBuffers::default();
        let (a, lease_a) = buffers.allocate(4);
        let (b, lease_b) = buffers.allocate(2);
        assert_eq!(buffers.live(), 2, "two transfers in flight");
        let a = UnitValues::Host(a);
        buffers.track(&a);
        drop(lease_a);
        assert_eq!(buffers.live(), 2, "one taken, one in flight");
        drop(b);
        drop(lease_b);
        assert_eq!(buffers.live(), 1, "a cancelled transfer is not alive");
        let user_copy = a.clone();
        drop(a);
        assert_eq!(buffers.live(), 1, "a buffer the user still holds is alive");
        drop(user_copy);
        assert_eq!(buffers.live(), 0);
        assert_eq!(&*buffers.allocate(3).0, &[0.0; 3]);
    }
}
