//! Events: a trainer is lost or started again; what a lost slot means for the running step.

use crate::clock::Timestamp;
use crate::recovery::{must_replay, slot_fate, SlotFate};

use super::decision::{decision, Command, Decision, Reason};
use super::error::Failure;
use super::machine::StepMachine;
use super::run::{AfterDiscard, Phase, Presence};

impl<E: Failure> StepMachine<E> {
    /// The trainer in `slot` is gone (failed, stopped, unreachable, or its respawn failed).
    pub fn on_trainer_lost(
        &mut self,
        slot: u32,
        reason: String,
        now: Timestamp,
    ) -> Vec<Decision<E>> {
        let _ = now;
        self.lost(slot as usize, Reason::TrainerLost { slot, reason })
    }

    /// A respawned trainer is up in `slot`.
    pub fn on_trainer_started(&mut self, slot: u32, now: Timestamp) -> Vec<Decision<E>> {
        let Some(s) = self.slots.get_mut(slot as usize) else {
            return Vec::new();
        };
        s.presence = Presence::Live;
        s.busy = None;
        self.dispatch(now)
    }

    /// `slot` is lost: respawn it per policy; if it was live while computing, discard the
    /// attempt and replay (I2: whatever it pushed of this attempt is dropped at the owners, and
    /// its list is planned again for the trainers left).
    pub(super) fn lost(&mut self, slot: usize, why: Reason) -> Vec<Decision<E>> {
        let mut out = Vec::new();
        let Some(s) = self.slots.get_mut(slot) else {
            return out;
        };
        let was_live = match s.presence {
            Presence::Gone => return out,
            Presence::Live => true,
            Presence::Respawning => false,
        };
        s.busy = None;
        self.speeds.reset(slot);
        match slot_fate(self.config.failure, s.respawns) {
            SlotFate::Respawn { respawn } => {
                s.respawns = respawn;
                s.presence = Presence::Respawning;
                out.push(decision(
                    Command::Respawn { slot: slot as u32 },
                    why.clone(),
                ));
            }
            SlotFate::Drop => s.presence = Presence::Gone,
        }
        let computing = self
            .run
            .as_ref()
            .is_some_and(|r| matches!(r.phase, Phase::Computing));
        if must_replay(was_live, computing) && self.stopped.is_none() {
            out.extend(self.discard(AfterDiscard::Replay, why));
        }
        out
    }
}
