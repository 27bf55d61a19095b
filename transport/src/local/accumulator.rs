//! An accumulator region of the local backend: fp32 values, the current epoch and the write ids
//! applied in it, all behind one lock so that fencing and `take` are atomic (C3); and the owner's
//! admission guard (C8), consulted before that lock is taken.
//!
//! This is also the owner core of every backend whose accumulates the owner applies (`tcp`, `shm`,
//! `rdma` through their fabric, `cuda` with its sums in device memory): the checks, the admission
//! guard, the fencing (its tag check shared with inboxes, [`Identity::fence`]) and the
//! deduplication live here once, so the guard holds for every backend; where the values live and
//! how a payload is added into them is a [`Sums`] (host memory by default).

use parking_lot::{Mutex, RwLock};

use super::identity::Identity;
use super::ids::IdSet;
use crate::codec;
use crate::error::wide;
use crate::{
    Dtype, EndpointId, RegionHandle, RegionId, RegionKind, TransportError, WriteGuard, WriteTag,
    REFUSED_WRITES_METRIC,
};

/// Where an accumulator's fp32 values live and how a payload is added into them. The
/// [`Accumulator`] around it checks shapes and fences before it calls either method, under its
/// lock, so an implementation sees only whole, in-bounds payloads, one call at a time.
pub(crate) trait Sums: Send + std::fmt::Debug {
    /// Add the little-endian fp32 elements `data` (whole elements) into the values starting at
    /// element `offset` (`offset + data.len() / 4` is within the length). On error nothing was
    /// added, or (a device failure) the region is beyond use and says so.
    fn add(&mut self, offset: usize, data: &[u8]) -> Result<(), TransportError>;
    /// Add `elements` fp32 values at device address `src` (memory of the values' own device,
    /// complete: nothing still writes it) into the values starting at element `offset`. Only
    /// values in device memory take it; host memory refuses with `Unsupported`.
    fn add_device(
        &mut self,
        offset: usize,
        src: u64,
        elements: usize,
    ) -> Result<(), TransportError> {
        let _ = (offset, src);
        Err(TransportError::Unsupported {
            what: format!(
                "an accumulate of {elements} elements from device memory into an accumulator \
                 in host memory"
            ),
        })
    }
    /// Return the values and zero them.
    fn take(&mut self) -> Vec<f32>;
    /// The implementation itself, for an owner-side take that only it offers (the `cuda`
    /// backend's exchange of device buffers, [`Accumulator::take_with`]).
    #[cfg_attr(not(feature = "cuda-code"), allow(dead_code))]
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

/// Host memory: the values themselves.
impl Sums for Vec<f32> {
    fn add(&mut self, offset: usize, data: &[u8]) -> Result<(), TransportError> {
        let end = offset + data.len() / 4;
        let len = self.len();
        let target = self
            .get_mut(offset..end)
            .ok_or(TransportError::OutOfRange {
                region: 0,
                start: wide(offset),
                end: wide(end),
                len: wide(len),
            })?;
        codec::add_f32_into(data, target).map_err(|e| e.for_region(0))
    }

    fn take(&mut self) -> Vec<f32> {
        let zeros = vec![0.0; self.len()];
        std::mem::replace(self, zeros)
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// Everything an accumulate or a take reads and writes.
#[derive(Debug)]
struct State {
    epoch: u64,
    values: Box<dyn Sums>,
    applied: IdSet,
}

/// State of an accumulator region, shared by the registry (writers) and the owner's guard.
#[derive(Debug)]
pub(crate) struct Accumulator {
    name: Identity,
    len: usize,
    state: Mutex<State>,
    admission: Admission,
    /// The epoch and the count of `state.applied`, sent under `state`'s lock at every change
    /// once someone asked for it (most accumulators never are: their writes pay one check).
    progress: std::sync::OnceLock<tokio::sync::watch::Sender<crate::Progress>>,
}

/// The owner's guard, if it installed one (C8).
#[derive(Default)]
struct Admission(RwLock<Option<WriteGuard>>);

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let guarded = self.0.read().is_some();
        f.debug_tuple("Admission").field(&guarded).finish()
    }
}

impl Admission {
    /// Whether `tag` may be applied (always, without a guard). The guard runs outside the lock
    /// (a clone of the `Arc`), so a slow guard delays only its own write.
    fn admits(&self, tag: &WriteTag) -> bool {
        let guard = self.0.read().clone();
        guard.is_none_or(|guard| guard(tag))
    }
}

impl Accumulator {
    /// An accumulator of `len` elements at `epoch` whose values are `values` (zeroed, `len`
    /// long).
    pub(super) fn new(name: Identity, len: usize, epoch: u64, values: Box<dyn Sums>) -> Self {
        Self {
            name,
            len,
            state: Mutex::new(State {
                epoch,
                values,
                applied: IdSet::default(),
            }),
            admission: Admission::default(),
            progress: std::sync::OnceLock::new(),
        }
    }

    pub(super) fn owner(&self) -> EndpointId {
        self.name.owner
    }

    pub(super) fn handle(&self) -> RegionHandle {
        self.name.handle(
            RegionKind::Accumulator,
            Dtype::F32,
            wide(self.len),
            self.epoch(),
        )
    }

    /// Add the fp32 elements `data` at element `offset`. Checks, in order: whole elements, range in
    /// bounds, admission (C8), epoch, write id; any failure leaves the accumulator unchanged. The
    /// shape and admission checks do not depend on mutable state, so they run before the lock is
    /// taken; the fencing checks and the addition happen under one lock acquisition. A refused
    /// write is logged and counted here, at the owner.
    pub(super) fn accumulate(
        &self,
        offset: usize,
        data: &[u8],
        tag: WriteTag,
    ) -> Result<(), TransportError> {
        let elements =
            codec::element_count(Dtype::F32, data.len()).map_err(|e| e.for_region(self.name.id))?;
        self.admit_and_add(offset, elements, tag, |values| values.add(offset, data))
    }

    /// [`Accumulator::accumulate`] of `elements` fp32 values at device address `src` (see
    /// [`Sums::add_device`]): the same checks in the same order, the same fences.
    pub(super) fn accumulate_device(
        &self,
        offset: usize,
        src: u64,
        elements: usize,
        tag: WriteTag,
    ) -> Result<(), TransportError> {
        self.admit_and_add(offset, elements, tag, |values| {
            values.add_device(offset, src, elements)
        })
    }

    /// The checks of every accumulate (range, admission, then fences under the lock) around
    /// `add`, which runs under the same lock; the write id is recorded only if it succeeded.
    fn admit_and_add(
        &self,
        offset: usize,
        elements: usize,
        tag: WriteTag,
        add: impl FnOnce(&mut dyn Sums) -> Result<(), TransportError>,
    ) -> Result<(), TransportError> {
        let end = offset.checked_add(elements).filter(|end| *end <= self.len);
        let Some(end) = end else {
            return Err(TransportError::OutOfRange {
                region: self.name.id,
                start: wide(offset),
                end: wide(offset.saturating_add(elements)),
                len: wide(self.len),
            });
        };
        if !self.admission.admits(&tag) {
            tracing::warn!(
                owner = self.name.owner,
                region = self.name.id,
                epoch = tag.epoch,
                write_id = format_args!("{:#x}", tag.write_id),
                "odc transport: refused a write its owner's guard does not admit"
            );
            metrics::counter!(REFUSED_WRITES_METRIC).increment(1);
            return Err(TransportError::RefusedWrite {
                owner: self.name.owner,
                region: self.name.id,
                epoch: tag.epoch,
                write_id: tag.write_id,
            });
        }
        let mut state = self.state.lock();
        self.name.fence(&tag, state.epoch, &state.applied)?;
        debug_assert!(end <= self.len);
        add(state.values.as_mut()).map_err(|e| for_region(e, self.name.id))?;
        state.applied.insert(tag.write_id);
        self.report(&state);
        Ok(())
    }

    pub(super) fn take(&self, next_epoch: u64) -> Vec<f32> {
        self.take_with(next_epoch, |values| values.take())
    }

    /// [`take`](Self::take) with the write ids applied in the epoch it ends, ascending.
    pub(super) fn take_applied(&self, next_epoch: u64) -> crate::Applied {
        self.end_epoch(next_epoch, |values, applied| crate::Applied {
            values: values.take(),
            write_ids: applied.iter().collect(),
        })
    }

    /// A take whose values `take` removes (it must leave them zeroed): under the same lock as
    /// every accumulate, moved to `next_epoch` with its write ids forgotten first (C3).
    pub(super) fn take_with<R>(&self, next_epoch: u64, take: impl FnOnce(&mut dyn Sums) -> R) -> R {
        self.end_epoch(next_epoch, |values, _| take(values))
    }

    /// Move to `next_epoch` under the accumulate lock and hand `take` the values and the write
    /// ids the ended epoch applied (the region keeps none).
    fn end_epoch<R>(&self, next_epoch: u64, take: impl FnOnce(&mut dyn Sums, IdSet) -> R) -> R {
        let mut state = self.state.lock();
        state.epoch = next_epoch;
        let applied = std::mem::take(&mut state.applied);
        self.report(&state);
        take(state.values.as_mut(), applied)
    }

    /// A receiver of [`crate::Progress`], current at once (made under the accumulate lock, so
    /// no write falls between its first value and the next report).
    pub(super) fn progress(&self) -> tokio::sync::watch::Receiver<crate::Progress> {
        let state = self.state.lock();
        self.progress
            .get_or_init(|| tokio::sync::watch::Sender::new(progress_of(&state)))
            .subscribe()
    }

    /// Send `state`'s progress to its receivers, if anyone ever asked (`state` locked).
    fn report(&self, state: &State) {
        if let Some(progress) = self.progress.get() {
            progress.send_replace(progress_of(state));
        }
    }

    pub(super) fn epoch(&self) -> u64 {
        self.state.lock().epoch
    }

    pub(super) fn admit_only(&self, guard: WriteGuard) {
        *self.admission.0.write() = Some(guard);
    }
}

/// The epoch and the count of writes applied in it.
fn progress_of(state: &State) -> crate::Progress {
    crate::Progress {
        epoch: state.epoch,
        applied: state.applied.len(),
    }
}

/// `error` from a [`Sums`], which does not know its region's id, with `region` filled in.
fn for_region(error: TransportError, region: RegionId) -> TransportError {
    match error {
        TransportError::OutOfRange {
            start, end, len, ..
        } => TransportError::OutOfRange {
            region,
            start,
            end,
            len,
        },
        TransportError::BadPayload { bytes, dtype, .. } => TransportError::BadPayload {
            region,
            bytes,
            dtype,
        },
        TransportError::LengthMismatch { elements, len, .. } => TransportError::LengthMismatch {
            region,
            elements,
            len,
        },
        other => other,
    }
}
