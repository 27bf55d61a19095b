//! Failure recovery decisions, pure: what becomes of a lost trainer's slot, whether the running
//! attempt must be replayed, and whether one more replay is allowed. The step machine
//! ([`crate::step`]) applies them.
//!
//! Guarantees (tested):
//! - **R1 bounded respawns**: under [`FailurePolicy::Respawn`] a slot is respawned at most
//!   `max_respawns` times, then dropped; under [`FailurePolicy::Drop`] never.
//! - **R2 replay only what can be wrong**: a trainer lost while the attempt is computing may have
//!   pushed part of a micro-batch, so the attempt is discarded and replayed (I2); lost during the
//!   barrier, every gradient of the step has landed and been acknowledged, so nothing is replayed.
//! - **R3 bounded replays**: a minibatch is replayed at most `max_replays` times.

/// What to do with a trainer that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FailurePolicy {
    /// Spawn a fresh trainer in its slot, at most `max_respawns` times per slot.
    Respawn { max_respawns: u32 },
    /// Continue with the remaining trainers.
    Drop,
}

impl Default for FailurePolicy {
    fn default() -> Self {
        FailurePolicy::Respawn { max_respawns: 3 }
    }
}

/// What becomes of a lost trainer's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotFate {
    /// Spawn a fresh trainer; this is the slot's `respawn`-th respawn (from 1).
    Respawn { respawn: u32 },
    /// The slot stays empty.
    Drop,
}

/// The fate of a slot that lost its trainer after `respawns` earlier respawns (R1).
///
/// ```
/// use odc_policy::recovery::{slot_fate, FailurePolicy, SlotFate};
/// let p = FailurePolicy::Respawn { max_respawns: 1 };
/// assert_eq!(slot_fate(p, 0), SlotFate::Respawn { respawn: 1 });
/// assert_eq!(slot_fate(p, 1), SlotFate::Drop);
/// ```
pub fn slot_fate(policy: FailurePolicy, respawns: u32) -> SlotFate {
    match policy {
        FailurePolicy::Respawn { max_respawns } if respawns < max_respawns => SlotFate::Respawn {
            respawn: respawns + 1,
        },
        _ => SlotFate::Drop,
    }
}

/// Whether losing a trainer forces a replay of the running attempt (R2): only a trainer that was
/// live (not one still being respawned) and only while the attempt computes.
pub fn must_replay(was_live: bool, computing: bool) -> bool {
    was_live && computing
}

/// Whether a minibatch replayed `replays` times may be replayed once more (R3).
pub fn may_replay(replays: u32, max_replays: u32) -> bool {
    replays < max_replays
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r1_respawns_are_bounded_per_slot() {
        let p = FailurePolicy::Respawn { max_respawns: 3 };
        let fates: Vec<SlotFate> = (0..5).map(|n| slot_fate(p, n)).collect();
        assert_eq!(
            fates,
            [
                SlotFate::Respawn { respawn: 1 },
                SlotFate::Respawn { respawn: 2 },
                SlotFate::Respawn { respawn: 3 },
                SlotFate::Drop,
                SlotFate::Drop
            ]
        );
        assert_eq!(slot_fate(FailurePolicy::Drop, 0), SlotFate::Drop);
        let none = FailurePolicy::Respawn { max_respawns: 0 };
        assert_eq!(slot_fate(none, 0), SlotFate::Drop);
        assert_eq!(FailurePolicy::default(), p);
    }

    #[test]
    fn r2_only_a_live_trainer_lost_while_computing_forces_a_replay() {
        assert!(must_replay(true, true));
        assert!(!must_replay(true, false), "barrier: every gradient landed");
        assert!(
            !must_replay(false, true),
            "a respawn that failed held no work"
        );
    }

    #[test]
    fn r3_replays_are_bounded() {
        assert!(may_replay(0, 1));
        assert!(!may_replay(1, 1));
        assert!(!may_replay(0, 0));
    }
}
