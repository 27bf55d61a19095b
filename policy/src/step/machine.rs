//! The machine itself: its state ([`StepMachine`]), how it is made, and what it tells about
//! itself.

use std::time::Duration;

use crate::relay::RelayPlan;
use crate::straggler::SpeedEstimator;
use crate::token::JobKey;

use super::config::{StepConfig, MAX_TICK};
use super::error::Failure;
use super::run::{Presence, Run, Slot};

/// The supervisor's state and decisions (see the [module docs](super)), failing steps with `E`.
#[derive(Debug, Clone)]
pub struct StepMachine<E> {
    pub(super) config: StepConfig,
    /// Signs every assignment's token and checks every report's.
    pub(super) key: JobKey,
    pub(super) slots: Vec<Slot>,
    pub(super) speeds: SpeedEstimator,
    pub(super) version: u64,
    /// Steps skipped for non-finite gradients ([`NonFinite::SkipStep`]).
    pub(super) skipped: u64,
    pub(super) epoch: u64,
    pub(super) run: Option<Run<E>>,
    pub(super) stopped: Option<E>,
    /// Where trainers and servers sit when pushes are relayed through the node: the barrier
    /// flushes the relays and checks their counts first.
    pub(super) relay: Option<RelayPlan>,
}

impl<E: Failure> StepMachine<E> {
    /// A machine for `trainers` slots, all live (the actor spawned them), at version 0, epoch 0,
    /// whose assignment tokens are made with `key` (drawn at random by the caller).
    pub fn new(config: StepConfig, trainers: u32, key: JobKey) -> Self {
        let slots = vec![
            Slot {
                presence: Presence::Live,
                busy: None,
                respawns: 0,
            };
            trainers as usize
        ];
        StepMachine {
            config,
            key,
            speeds: SpeedEstimator::new(slots.len(), 0.5),
            slots,
            version: 0,
            skipped: 0,
            epoch: 0,
            run: None,
            stopped: None,
            relay: None,
        }
    }

    /// Pushes relayed through the node as `plan` places trainers and servers: every barrier
    /// flushes the relays and checks what they combined before it reduces.
    pub fn with_relay(mut self, plan: Option<RelayPlan>) -> Self {
        self.relay = plan;
        self
    }

    pub fn config(&self) -> &StepConfig {
        &self.config
    }

    /// Version of the parameters (optimizer steps applied).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The global step being trained: [`StepConfig::first_step`] plus the steps this machine
    /// finished, applied or skipped (what stats and errors name; the schedule's position).
    pub fn global_step(&self) -> u64 {
        self.config.first_step + self.version + self.skipped
    }

    /// Accumulator epoch of the current attempt.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// A step is in flight.
    pub fn is_running(&self) -> bool {
        self.run.is_some()
    }

    /// How often the actor should call [`on_tick`](Self::on_tick): a tenth of the micro-batch
    /// timeout, at most 100 ms, at least 1 ms.
    pub fn tick_period(&self) -> Duration {
        (self.config.micro_batch_timeout / 10).clamp(Duration::from_millis(1), MAX_TICK)
    }
}
