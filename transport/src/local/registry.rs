//! Fabrics: the regions of one [`LocalTransport`](super::LocalTransport), and the process-global
//! table that lets any local transport of the process find them from a handle alone.
//!
//! Every `LocalTransport::new()` creates a [`Registry`] (a "fabric") with a fabric id that is never
//! reused in the process, and records a weak reference to it in [`FABRICS`]. The registry lives
//! while its transport or any of its regions' guards live; its `Drop` removes it from the table, so
//! a handle to it afterwards names an unknown region.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use dashmap::DashMap;
use parking_lot::RwLock;

use super::accumulator::Accumulator;
use super::inbox::Inbox;
use super::published::Published;
use crate::{Descriptor, EndpointId, RegionHandle, RegionId, RegionKind, TransportError};

/// Every live fabric of this process, by fabric id. Never held while a registry is dropped (a
/// lookup upgrades under the read lock and releases it before using the registry).
static FABRICS: RwLock<BTreeMap<u64, Weak<Registry>>> = RwLock::new(BTreeMap::new());

/// Fabric ids of this process; never reused.
static NEXT_FABRIC: AtomicU64 = AtomicU64::new(0);

/// A registered region.
#[derive(Debug, Clone)]
pub(super) enum Region {
    Published(Arc<Published>),
    Accumulator(Arc<Accumulator>),
    Inbox(Arc<Inbox>),
}

impl Region {
    fn owner(&self) -> EndpointId {
        match self {
            Region::Published(region) => region.owner(),
            Region::Accumulator(region) => region.owner(),
            Region::Inbox(region) => region.owner(),
        }
    }

    pub(super) fn kind(&self) -> RegionKind {
        match self {
            Region::Published(_) => RegionKind::Published,
            Region::Accumulator(_) => RegionKind::Accumulator,
            Region::Inbox(_) => RegionKind::Inbox,
        }
    }
}

/// The regions of one fabric, shared by its transport and the owners' guards.
#[derive(Debug)]
pub(super) struct Registry {
    fabric: u64,
    process: u32,
    regions: DashMap<RegionId, Region>,
    next_id: AtomicU64,
}

impl Registry {
    /// A new, empty fabric, registered in the process-global table.
    pub(super) fn new() -> Arc<Self> {
        let registry = Arc::new(Registry {
            fabric: NEXT_FABRIC.fetch_add(1, Ordering::Relaxed),
            process: std::process::id(),
            regions: DashMap::new(),
            next_id: AtomicU64::new(0),
        });
        FABRICS
            .write()
            .insert(registry.fabric, Arc::downgrade(&registry));
        registry
    }

    /// The live fabric `fabric` of this process, if any.
    pub(super) fn find(fabric: u64) -> Option<Arc<Registry>> {
        FABRICS.read().get(&fabric).and_then(Weak::upgrade)
    }

    pub(super) fn fabric(&self) -> u64 {
        self.fabric
    }

    pub(super) fn process(&self) -> u32 {
        self.process
    }

    /// What handles to this fabric's regions carry.
    pub(super) fn descriptor(&self) -> Descriptor {
        Descriptor::Local {
            process: self.process,
            fabric: self.fabric,
        }
    }

    pub(super) fn next_id(&self) -> RegionId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(super) fn insert(&self, id: RegionId, region: Region) {
        self.regions.insert(id, region);
    }

    /// The region `handle` names (same id, same owner). The map's shard lock is released before
    /// the caller touches the region.
    pub(super) fn lookup(&self, handle: &RegionHandle) -> Result<Region, TransportError> {
        self.get(handle.owner, handle.id)
    }

    /// The region `id` of `owner`.
    pub(super) fn get(&self, owner: EndpointId, id: RegionId) -> Result<Region, TransportError> {
        self.regions
            .get(&id)
            .map(|entry| entry.value().clone())
            .filter(|region| region.owner() == owner)
            .ok_or(TransportError::UnknownRegion { owner, region: id })
    }

    pub(super) fn remove(&self, id: RegionId) {
        self.regions.remove(&id);
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        FABRICS.write().remove(&self.fabric);
    }
}
