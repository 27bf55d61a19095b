//! One all-gather at the coordinator (`Job::all_gather`): which parts it keeps, when it is
//! complete, and why it fails.
//!
//! Invariants (each named by a test below):
//! - **one part per rank, of this round**: a part of another round (stale, or a peer running
//!   ahead of where any honest rank can be), from a rank out of range or from the coordinator's
//!   own rank, or a second part from a rank is dropped with its reason, never mixed into the
//!   answer;
//! - **complete once every rank's part is in**: the answer lists the parts in rank order;
//! - **bounded**: an answer whose parts together exceed the control frame is a failure naming
//!   the total and the cap, not a frame the peers would refuse;
//! - **a rank gone before its part fails the round**, naming the rank (its part can never come).

use std::collections::BTreeMap;

/// The parts of gather `round` received so far, among `world_size` ranks (see the
/// [module docs](self)).
#[derive(Debug)]
pub struct GatherRound {
    round: u64,
    world_size: u32,
    parts: BTreeMap<u32, Vec<u8>>,
}

/// Why a part was not kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dropped {
    /// A part of another round than the one this is.
    OtherRound { round: u64 },
    /// A rank that is not one of the job's other ranks.
    NoSuchRank,
    /// A second part from this rank.
    Twice,
}

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dropped::OtherRound { round } => write!(f, "it belongs to gather {round}"),
            Dropped::NoSuchRank => write!(f, "no other rank of the job has that number"),
            Dropped::Twice => write!(f, "that rank's part is already in"),
        }
    }
}

impl GatherRound {
    /// Gather `round` at the coordinator (rank 0), before any part (the others' may arrive
    /// before the coordinator's own).
    pub fn new(round: u64, world_size: u32) -> Self {
        GatherRound {
            round,
            world_size,
            parts: BTreeMap::new(),
        }
    }

    /// The coordinator's own part.
    pub fn own(&mut self, bytes: Vec<u8>) {
        self.parts.insert(0, bytes);
    }

    pub fn round(&self) -> u64 {
        self.round
    }

    /// Keep rank `rank`'s part of gather `round` (from a peer) when it belongs here.
    pub fn accept(&mut self, round: u64, rank: u32, bytes: Vec<u8>) -> Result<(), Dropped> {
        if round != self.round {
            return Err(Dropped::OtherRound { round });
        }
        if rank == 0 || rank >= self.world_size {
            return Err(Dropped::NoSuchRank);
        }
        if self.parts.contains_key(&rank) {
            return Err(Dropped::Twice);
        }
        self.parts.insert(rank, bytes);
        Ok(())
    }

    /// The first rank in `gone` (ranks that left or were lost) whose part is missing.
    pub fn missing_of(&self, gone: impl IntoIterator<Item = u32>) -> Option<u32> {
        gone.into_iter()
            .find(|r| *r < self.world_size && !self.parts.contains_key(r))
    }

    /// The answer once every rank's part is in: the parts in rank order, or why they cannot be
    /// sent (more than `cap` bytes together). `None` while parts are missing.
    pub fn answer(&mut self, cap: u64) -> Option<Result<Vec<Vec<u8>>, String>> {
        if self.parts.len() < self.world_size as usize {
            return None;
        }
        let total: u64 = self.parts.values().map(|p| p.len() as u64).sum();
        if total > cap {
            return Some(Err(format!(
                "all-gather {}: the ranks' parts come to {total} bytes, over the {cap} bytes a \
                 control frame carries: gather less per rank",
                self.round
            )));
        }
        Some(Ok(std::mem::take(&mut self.parts).into_values().collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_part_per_rank_of_this_round() {
        let mut g = GatherRound::new(3, 3);
        g.own(vec![0]);
        assert_eq!(
            g.accept(2, 1, vec![1]),
            Err(Dropped::OtherRound { round: 2 })
        );
        assert_eq!(
            g.accept(4, 1, vec![1]),
            Err(Dropped::OtherRound { round: 4 })
        );
        assert_eq!(g.accept(3, 0, vec![9]), Err(Dropped::NoSuchRank));
        assert_eq!(g.accept(3, 3, vec![9]), Err(Dropped::NoSuchRank));
        assert_eq!(g.accept(3, 2, vec![2]), Ok(()));
        assert_eq!(g.accept(3, 2, vec![7]), Err(Dropped::Twice));
        assert!(g.answer(u64::MAX).is_none(), "rank 1 is missing");
        assert_eq!(g.accept(3, 1, vec![1, 1]), Ok(()));
        assert_eq!(
            g.answer(u64::MAX),
            Some(Ok(vec![vec![0], vec![1, 1], vec![2]])),
            "complete, in rank order, the first part of rank 2 kept"
        );
    }

    #[test]
    fn complete_once_every_rank_is_in_even_alone() {
        let mut g = GatherRound::new(0, 1);
        assert!(g.answer(10).is_none(), "its own part is missing");
        g.own(vec![5]);
        assert_eq!(g.answer(10), Some(Ok(vec![vec![5]])));
    }

    #[test]
    fn bounded_by_the_control_frame() {
        let mut g = GatherRound::new(0, 2);
        g.accept(0, 1, vec![0; 5]).unwrap();
        g.own(vec![0; 6]);
        let err = g.answer(10).unwrap().unwrap_err();
        assert!(
            err.contains("11 bytes") && err.contains("10 bytes"),
            "{err}"
        );
    }

    #[test]
    fn a_rank_gone_before_its_part_fails_the_round() {
        let mut g = GatherRound::new(0, 4);
        g.own(vec![]);
        g.accept(0, 2, vec![]).unwrap();
        assert_eq!(g.missing_of([2]), None, "its part is in");
        assert_eq!(g.missing_of([2, 3]), Some(3));
        assert_eq!(g.missing_of([7]), None, "not a rank of the job");
    }
}
