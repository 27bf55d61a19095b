//! An accumulator region of the local backend: fp32 values, the current epoch and the write ids
//! applied in it, all behind one lock so that fencing and `take` are atomic (C3); and the owner's
//! admission guard (C8), consulted before that lock is taken. The process-crossing backends
//! (`tcp`, `shm`, `rdma`) serve accumulates from this same region type, so the guard holds for
//! every backend.

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::registry::Registry;
use crate::codec;
use crate::error::wide;
use crate::{
    AccumulatorRegion, Descriptor, Dtype, EndpointId, RegionHandle, RegionId, RegionKind,
    TransportError, WriteGuard, WriteTag, REFUSED_WRITES_METRIC,
};

/// Everything an accumulate or a take reads and writes.
#[derive(Debug)]
struct State {
    epoch: u64,
    values: Vec<f32>,
    applied: HashSet<u128>,
}

/// State of an accumulator region, shared by the registry (writers) and the owner's guard.
#[derive(Debug)]
pub(super) struct Accumulator {
    owner: EndpointId,
    id: RegionId,
    len: usize,
    descriptor: Descriptor,
    state: Mutex<State>,
    admission: Admission,
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
    /// A zeroed accumulator of `len` elements at `epoch`.
    pub(super) fn new(
        owner: EndpointId,
        id: RegionId,
        descriptor: Descriptor,
        len: usize,
        epoch: u64,
    ) -> Self {
        Self {
            owner,
            id,
            len,
            descriptor,
            state: Mutex::new(State {
                epoch,
                values: vec![0.0; len],
                applied: HashSet::new(),
            }),
            admission: Admission::default(),
        }
    }

    pub(super) fn owner(&self) -> EndpointId {
        self.owner
    }

    pub(super) fn handle(&self) -> RegionHandle {
        RegionHandle {
            owner: self.owner,
            id: self.id,
            kind: RegionKind::Accumulator,
            dtype: Dtype::F32,
            len: wide(self.len),
            version: self.epoch(),
            descriptor: self.descriptor.clone(),
        }
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
            codec::element_count(Dtype::F32, data.len()).map_err(|e| e.for_region(self.id))?;
        let end = offset.checked_add(elements).filter(|end| *end <= self.len);
        let Some(end) = end else {
            return Err(TransportError::OutOfRange {
                region: self.id,
                start: wide(offset),
                end: wide(offset.saturating_add(elements)),
                len: wide(self.len),
            });
        };
        if !self.admission.admits(&tag) {
            tracing::warn!(
                owner = self.owner,
                region = self.id,
                epoch = tag.epoch,
                write_id = format_args!("{:#x}", tag.write_id),
                "odc transport: refused a write its owner's guard does not admit"
            );
            metrics::counter!(REFUSED_WRITES_METRIC).increment(1);
            return Err(TransportError::RefusedWrite {
                owner: self.owner,
                region: self.id,
                epoch: tag.epoch,
                write_id: tag.write_id,
            });
        }
        let mut state = self.state.lock();
        if tag.epoch != state.epoch {
            return Err(TransportError::StaleEpoch {
                region: self.id,
                got: tag.epoch,
                current: state.epoch,
            });
        }
        if state.applied.contains(&tag.write_id) {
            return Err(TransportError::DuplicateWrite {
                region: self.id,
                epoch: state.epoch,
                write_id: tag.write_id,
            });
        }
        let target = state
            .values
            .get_mut(offset..end)
            .ok_or(TransportError::OutOfRange {
                region: self.id,
                start: wide(offset),
                end: wide(end),
                len: wide(self.len),
            })?;
        codec::add_f32_into(data, target).map_err(|e| e.for_region(self.id))?;
        state.applied.insert(tag.write_id);
        Ok(())
    }

    fn take(&self, next_epoch: u64) -> Vec<f32> {
        // Allocate the zeros outside the lock; the swap itself is O(1).
        let zeros = vec![0.0; self.len];
        let mut state = self.state.lock();
        state.epoch = next_epoch;
        state.applied.clear();
        std::mem::replace(&mut state.values, zeros)
    }

    fn epoch(&self) -> u64 {
        self.state.lock().epoch
    }

    fn admit_only(&self, guard: WriteGuard) {
        *self.admission.0.write() = Some(guard);
    }
}

/// The owner's guard of an accumulator region; dropping it deregisters the region.
#[derive(Debug)]
pub(super) struct AccumulatorGuard {
    pub(super) registry: Arc<Registry>,
    pub(super) region: Arc<Accumulator>,
}

impl AccumulatorRegion for AccumulatorGuard {
    fn handle(&self) -> RegionHandle {
        self.region.handle()
    }

    fn take(&self, next_epoch: u64) -> Vec<f32> {
        self.region.take(next_epoch)
    }

    fn epoch(&self) -> u64 {
        self.region.epoch()
    }

    fn admit_only(&self, guard: WriteGuard) -> Result<(), TransportError> {
        self.region.admit_only(guard);
        Ok(())
    }
}

impl Drop for AccumulatorGuard {
    fn drop(&mut self) {
        self.registry.remove(self.region.id);
    }
}
