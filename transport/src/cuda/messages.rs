//! Inbox messages whose values stay in device memory (`CudaTransport::send_device`,
//! `CudaTransport::recv_device`): a gang's K/V blocks and a collective's pieces between the GPUs
//! of a host, with no host copy.
//!
//! A device message is two things delivered in order: its **values**, copied device to device
//! into the receiving owner's memory and held here under (inbox, epoch, write id), and then its
//! **header** (host bytes saying what the values are), delivered into the inbox as an ordinary
//! message under C7's fences. The receiver waits for the header as for any message and then takes
//! the values held under the same tag. So:
//! - **What a receiver sees is whole.** The values are held before the header can be received.
//! - **C7's fences decide.** A header the inbox refuses (a stale epoch, a write id already
//!   delivered, a full inbox) drops its values ([`DeviceMessages::forget`]); values already held
//!   under the same epoch and write id refuse a second copy before any byte moves
//!   ([`TransportError::DuplicateWrite`]).
//! - **Nothing of a discarded attempt is kept for long.** Holding or taking values of an epoch
//!   drops every value of the same inbox held under an older one: their headers were dropped by
//!   the inbox's move to the newer epoch (C7), so nobody can take them any more.

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::{RegionId, TransportError, WriteTag};

/// Held values, by inbox and write id (see the [module docs](self)).
#[derive(Debug)]
pub(crate) struct DeviceMessages<P> {
    held: Mutex<HashMap<(RegionId, u128), (u64, P)>>,
}

impl<P> Default for DeviceMessages<P> {
    fn default() -> Self {
        DeviceMessages {
            held: Mutex::new(HashMap::new()),
        }
    }
}

impl<P> DeviceMessages<P> {
    /// Refuse values for `tag` of inbox `region` if values of the same epoch are held under its
    /// write id (nothing is copied yet; call before copying).
    pub(crate) fn check_free(
        &self,
        region: RegionId,
        tag: &WriteTag,
    ) -> Result<(), TransportError> {
        match self.held.lock().get(&(region, tag.write_id)) {
            Some((epoch, _)) if *epoch >= tag.epoch => Err(TransportError::DuplicateWrite {
                region,
                epoch: tag.epoch,
                write_id: tag.write_id,
            }),
            _ => Ok(()),
        }
    }

    /// Hold `values` for `tag` of inbox `region`, dropping the inbox's values of older epochs.
    /// Values of the same or a newer epoch already held under the write id: `DuplicateWrite`, and
    /// `values` is dropped.
    pub(crate) fn hold(
        &self,
        region: RegionId,
        tag: &WriteTag,
        values: P,
    ) -> Result<(), TransportError> {
        let mut held = self.held.lock();
        held.retain(|&(r, _), (epoch, _)| r != region || *epoch >= tag.epoch);
        if held.contains_key(&(region, tag.write_id)) {
            return Err(TransportError::DuplicateWrite {
                region,
                epoch: tag.epoch,
                write_id: tag.write_id,
            });
        }
        held.insert((region, tag.write_id), (tag.epoch, values));
        Ok(())
    }

    /// The values held for exactly `tag` of inbox `region`, removed; the inbox's values of older
    /// epochs are dropped.
    pub(crate) fn take(&self, region: RegionId, tag: &WriteTag) -> Option<P> {
        let mut held = self.held.lock();
        held.retain(|&(r, _), (epoch, _)| r != region || *epoch >= tag.epoch);
        match held.get(&(region, tag.write_id)) {
            Some((epoch, _)) if *epoch == tag.epoch => held
                .remove(&(region, tag.write_id))
                .map(|(_, values)| values),
            _ => None,
        }
    }

    /// Drop the values held for exactly `tag` of inbox `region` (its header was refused).
    pub(crate) fn forget(&self, region: RegionId, tag: &WriteTag) {
        let mut held = self.held.lock();
        if held
            .get(&(region, tag.write_id))
            .is_some_and(|(epoch, _)| *epoch == tag.epoch)
        {
            held.remove(&(region, tag.write_id));
        }
    }

    /// How many values are held (all inboxes).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.held.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(epoch: u64, write_id: u128) -> WriteTag {
        WriteTag {
            epoch,
            write_id,
            token: 0,
        }
    }

    #[test]
    fn values_are_taken_once_by_exact_tag() {
        let messages = DeviceMessages::default();
        messages.hold(1, &tag(0, 7), "seven").unwrap();
        messages.hold(2, &tag(0, 7), "other inbox").unwrap();
        assert_eq!(messages.take(1, &tag(0, 8)), None, "another write id");
        assert_eq!(messages.take(1, &tag(1, 7)), None, "another epoch");
        // The take of epoch 1 dropped inbox 1's epoch-0 values: a discarded attempt's.
        assert_eq!(messages.take(1, &tag(0, 7)), None);
        assert_eq!(messages.take(2, &tag(0, 7)), Some("other inbox"));
        assert_eq!(messages.take(2, &tag(0, 7)), None, "taken once");
        assert_eq!(messages.len(), 0);
    }

    #[test]
    fn a_second_copy_of_held_values_is_refused_before_it_is_made() {
        let messages = DeviceMessages::default();
        messages.hold(1, &tag(3, 9), 1).unwrap();
        for attempt in [tag(3, 9), tag(2, 9)] {
            assert!(matches!(
                messages.check_free(1, &attempt),
                Err(TransportError::DuplicateWrite { write_id: 9, .. })
            ));
        }
        assert!(matches!(
            messages.hold(1, &tag(3, 9), 2),
            Err(TransportError::DuplicateWrite { .. })
        ));
        assert_eq!(
            messages.take(1, &tag(3, 9)),
            Some(1),
            "the first copy stays"
        );
        messages.check_free(1, &tag(3, 9)).unwrap();
        messages.check_free(1, &tag(4, 9)).unwrap();
    }

    #[test]
    fn a_newer_epoch_drops_the_inboxs_older_values_and_forget_drops_one() {
        let messages = DeviceMessages::default();
        for id in 0..4 {
            messages.hold(5, &tag(0, id), id).unwrap();
        }
        messages.hold(6, &tag(0, 0), 100).unwrap();
        messages.hold(5, &tag(1, 0), 10).unwrap();
        assert_eq!(
            messages.len(),
            2,
            "inbox 5's epoch-0 values dropped, inbox 6's kept"
        );
        messages.forget(5, &tag(0, 0));
        assert_eq!(messages.len(), 2, "forget names the epoch too");
        messages.forget(5, &tag(1, 0));
        assert_eq!(messages.take(5, &tag(1, 0)), None);
        assert_eq!(messages.take(6, &tag(0, 0)), Some(100));
    }
}
