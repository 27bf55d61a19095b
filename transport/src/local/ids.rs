//! The write ids a region has seen in its epoch ([`IdSet`]), kept as disjoint runs of consecutive
//! ids.
//!
//! A region must refuse a repeated write id for its whole epoch (C3, C7), so it remembers every
//! one. Most arrive in runs: a collective's ring step ids of one operation are consecutive
//! (`OpKey::message_id`), as are the chunk ids of one write. Kept as runs, the ring messages of a
//! step at a thousand trainers cost a few hundred entries per inbox instead of a hash entry per
//! message (the simulator's memory grew with trainers² through these sets).
//!
//! Invariants: the runs are disjoint and never adjacent (an insert merges a run with its
//! neighbours), so `len` is the number of distinct ids inserted since the last clear, and
//! iteration is ascending.

use std::collections::BTreeMap;

/// A set of `u128` write ids as runs `first ..= last`, keyed by `first`.
#[derive(Debug, Default, Clone)]
pub(super) struct IdSet {
    runs: BTreeMap<u128, u128>,
    len: usize,
}

impl IdSet {
    pub(super) fn contains(&self, id: u128) -> bool {
        self.runs
            .range(..=id)
            .next_back()
            .is_some_and(|(_, &last)| id <= last)
    }

    /// Insert `id`; false (and nothing changed) if it is already there.
    pub(super) fn insert(&mut self, id: u128) -> bool {
        if self.contains(id) {
            return false;
        }
        // The run ending just before `id`, and the one starting just after it.
        let before = id.checked_sub(1).and_then(|prev| {
            self.runs
                .range(..=prev)
                .next_back()
                .filter(|(_, &last)| last == prev)
                .map(|(&first, _)| first)
        });
        let after = id.checked_add(1).and_then(|next| self.runs.remove(&next));
        let first = before.unwrap_or(id);
        let last = after.unwrap_or(id);
        self.runs.insert(first, last);
        self.len += 1;
        true
    }

    /// Distinct ids held.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn clear(&mut self) {
        self.runs.clear();
        self.len = 0;
    }

    /// Every id, ascending.
    pub(super) fn iter(&self) -> impl Iterator<Item = u128> + '_ {
        self.runs.iter().flat_map(|(&first, &last)| first..=last)
    }

    /// Runs held (what the set costs).
    #[cfg(test)]
    fn runs(&self) -> usize {
        self.runs.len()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::IdSet;

    proptest! {
        /// The set answers as a plain ordered set would, whatever the order of inserts, near
        /// both ends of the id space included; its runs never touch.
        #[test]
        fn an_id_set_is_the_set_of_its_inserts(
            ids in proptest::collection::vec(
                prop_oneof![0u128..64, (u128::MAX - 63)..=u128::MAX, any::<u128>()],
                0..200,
            ),
            probes in proptest::collection::vec(0u128..80, 0..40),
        ) {
            let mut set = IdSet::default();
            let mut reference = BTreeSet::new();
            for &id in &ids {
                prop_assert_eq!(set.insert(id), reference.insert(id));
                prop_assert_eq!(set.len(), reference.len());
            }
            for &id in ids.iter().chain(&probes) {
                prop_assert_eq!(set.contains(id), reference.contains(&id));
            }
            prop_assert!(set.iter().eq(reference.iter().copied()));
            let runs: Vec<(u128, u128)> = set.runs.iter().map(|(&a, &b)| (a, b)).collect();
            for pair in runs.windows(2) {
                prop_assert!(pair[0].1 < pair[1].0 && pair[1].0 - pair[0].1 > 1, "{pair:?}");
            }
        }
    }

    #[test]
    fn consecutive_ids_in_any_order_are_one_run() {
        let mut set = IdSet::default();
        for id in (0..1000u128).rev().step_by(2).chain((0..1000).step_by(2)) {
            assert!(set.insert(id + (7 << 96)));
        }
        assert_eq!((set.len(), set.runs()), (1000, 1));
        assert!(!set.insert(7 << 96));
        set.clear();
        assert_eq!(
            (set.len(), set.runs(), set.contains(7 << 96)),
            (0, 0, false)
        );
    }
}
