//! How many connections a listener lets run the handshake at once.
//!
//! A peer that has not authenticated costs a descriptor, a task and a small buffer until the
//! handshake deadline; [`UnauthenticatedGate`] bounds how many such peers one listener holds:
//!
//! 1. At most [`MAX_UNAUTHENTICATED`] connections hold a [`Permit`] at once. A listener takes one
//!    before it spawns a connection's handshake and drops it when the handshake ends (either
//!    way), so authenticated connections do not count.
//! 2. A connection accepted while every permit is held is closed at once (no task, nothing read
//!    or sent) and counted: [`UnauthenticatedGate::refused`], and the metric
//!    [`REFUSED_METRIC`] with the label `listener` (`tcp`, `shm`, `rdma`, ...), recorded with
//!    whatever `metrics` recorder is installed when the refusal happens.
//!
//! The price: while 64 peers hold their connections in the handshake, a legitimate peer that
//! dials is refused too (its dial fails and is retried by its caller) until the deadline
//! (`RemoteConfig::handshake_timeout`, at most 10 s) frees their permits. The alternative, an
//! unbounded number of half-open connections, lets one host exhaust the listener's descriptors.
//!
//! ```
//! use odc_transport::wire::gate::{UnauthenticatedGate, MAX_UNAUTHENTICATED};
//!
//! let gate = UnauthenticatedGate::new("control");
//! let held: Vec<_> = (0..MAX_UNAUTHENTICATED).map_while(|_| gate.try_enter()).collect();
//! assert_eq!(held.len(), MAX_UNAUTHENTICATED);
//! assert!(gate.try_enter().is_none(), "the 65th is closed at once");
//! assert_eq!(gate.refused(), 1);
//! drop(held);
//! assert!(gate.try_enter().is_some(), "a finished handshake frees its permit");
//! ```

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Connections one listener lets run the handshake at once.
pub const MAX_UNAUTHENTICATED: usize = 64;
/// Counter of connections closed at once because [`MAX_UNAUTHENTICATED`] were in the handshake;
/// label `listener`.
pub const REFUSED_METRIC: &str = "odc_unauthenticated_connections_refused_total";

/// The admission of one listener's unauthenticated connections (module doc). Clones share it.
#[derive(Clone)]
pub struct UnauthenticatedGate {
    inner: Arc<Inner>,
}

struct Inner {
    listener: &'static str,
    in_handshake: AtomicUsize,
    refused: AtomicU64,
}

/// A connection's place in the handshake; dropping it frees the place.
#[must_use = "the connection holds its place only while the permit lives"]
pub struct Permit {
    inner: Arc<Inner>,
}

impl UnauthenticatedGate {
    /// The gate of a listener named `listener` in the log and in the metric's label.
    pub fn new(listener: &'static str) -> Self {
        Self {
            inner: Arc::new(Inner {
                listener,
                in_handshake: AtomicUsize::new(0),
                refused: AtomicU64::new(0),
            }),
        }
    }

    /// A place for one more connection in the handshake, or `None` (counted, and the caller
    /// closes the connection) when [`MAX_UNAUTHENTICATED`] are taken.
    pub fn try_enter(&self) -> Option<Permit> {
        let entered =
            self.inner
                .in_handshake
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                    (open < MAX_UNAUTHENTICATED).then_some(open + 1)
                });
        match entered {
            Ok(_) => Some(Permit {
                inner: Arc::clone(&self.inner),
            }),
            Err(_) => {
                self.inner.refused.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(REFUSED_METRIC, "listener" => self.inner.listener).increment(1);
                None
            }
        }
    }

    /// Connections in the handshake now.
    pub fn in_handshake(&self) -> usize {
        self.inner.in_handshake.load(Ordering::Acquire)
    }

    /// Connections closed at once so far.
    pub fn refused(&self) -> u64 {
        self.inner.refused.load(Ordering::Relaxed)
    }

    /// The listener's name.
    pub fn listener(&self) -> &'static str {
        self.inner.listener
    }
}

impl fmt::Debug for UnauthenticatedGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnauthenticatedGate")
            .field("listener", &self.inner.listener)
            .field("in_handshake", &self.in_handshake())
            .field("refused", &self.refused())
            .finish()
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.inner.in_handshake.fetch_sub(1, Ordering::AcqRel);
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Permit({})", self.inner.listener)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_64_permits_and_refusals_counted() {
        let gate = UnauthenticatedGate::new("test");
        let mut held: Vec<Permit> = (0..MAX_UNAUTHENTICATED)
            .map(|i| gate.try_enter().unwrap_or_else(|| panic!("permit {i}")))
            .collect();
        assert_eq!(gate.in_handshake(), MAX_UNAUTHENTICATED);
        for _ in 0..3 {
            assert!(gate.try_enter().is_none());
        }
        assert_eq!(
            (gate.refused(), gate.in_handshake()),
            (3, MAX_UNAUTHENTICATED)
        );
        held.pop();
        let again = gate.try_enter();
        assert!(again.is_some(), "a freed place is taken again");
        assert!(gate.try_enter().is_none());
        drop(held);
        drop(again);
        assert_eq!((gate.in_handshake(), gate.refused()), (0, 4));
    }

    #[test]
    fn permits_are_shared_by_clones_across_threads() {
        let gate = UnauthenticatedGate::new("test");
        let taken: Vec<Vec<Permit>> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..4)
                .map(|_| {
                    let gate = gate.clone();
                    s.spawn(move || (0..40).filter_map(|_| gate.try_enter()).collect())
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("worker"))
                .collect()
        });
        let held: usize = taken.iter().map(Vec::len).sum();
        assert_eq!(held, MAX_UNAUTHENTICATED, "never more than the cap at once");
        assert_eq!(gate.refused(), (160 - MAX_UNAUTHENTICATED) as u64);
        drop(taken);
        assert_eq!(gate.in_handshake(), 0);
    }
}
