//! What every region of a fabric has in common: who it is ([`Identity`]: owner, id, and the
//! descriptor its handles carry), and, for accumulators and inboxes, how a write is fenced by its
//! tag ([`Identity::fence`]: C3, C7).

use crate::{
    Descriptor, Dtype, EndpointId, RegionHandle, RegionId, RegionKind, TransportError, WriteTag,
};

/// A region's owner and id, and the descriptor its handles carry.
#[derive(Debug)]
pub(crate) struct Identity {
    pub(super) owner: EndpointId,
    pub(super) id: RegionId,
    pub(super) descriptor: Descriptor,
}

impl Identity {
    /// A handle to this region as it is now: its kind, dtype, length in elements and version (a
    /// published region's) or epoch.
    pub(super) fn handle(
        &self,
        kind: RegionKind,
        dtype: Dtype,
        len: u64,
        version: u64,
    ) -> RegionHandle {
        RegionHandle {
            owner: self.owner,
            id: self.id,
            kind,
            dtype,
            len,
            version,
            descriptor: self.descriptor.clone(),
        }
    }

    /// Refuse a write tagged `tag` to this region, now at `epoch` with the write ids `seen` in it:
    /// of another epoch ([`TransportError::StaleEpoch`]), or with an id already seen
    /// ([`TransportError::DuplicateWrite`]).
    pub(super) fn fence(
        &self,
        tag: &WriteTag,
        epoch: u64,
        seen: &super::ids::IdSet,
    ) -> Result<(), TransportError> {
        if tag.epoch != epoch {
            return Err(TransportError::StaleEpoch {
                region: self.id,
                got: tag.epoch,
                current: epoch,
            });
        }
        if seen.contains(tag.write_id) {
            return Err(TransportError::DuplicateWrite {
                region: self.id,
                epoch,
                write_id: tag.write_id,
            });
        }
        Ok(())
    }
}
