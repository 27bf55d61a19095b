//! What a job configures of its steps: deadlines, dispatch, replays, the non-finite policy.

use std::time::Duration;

use crate::balancer::CostModel;
use crate::batch::LossWeighting;
use crate::dispatch::{Communication, DispatchMode};
use crate::recovery::FailurePolicy;
use crate::schedule::LrSchedule;
use crate::split::{ContextParallel, RingPrice, SplitPolicy};

use super::error::StepError;

/// Default [`StepConfig::micro_batch_timeout`].
pub const DEFAULT_MICRO_BATCH_TIMEOUT: Duration = Duration::from_secs(600);

/// Longest period between two ticks ([`StepMachine::tick_period`]).
pub(super) const MAX_TICK: Duration = Duration::from_millis(100);

/// What a step does when a gradient, a loss or the global gradient norm is not finite (NaN or
/// ±inf). Either way the step's gradients are discarded at every owner: parameters, optimizer
/// moments and the optimizer's step count are unchanged (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum NonFinite {
    /// The step fails with [`StepError::NonFinite`]; the job can go on with the next step.
    #[default]
    Error,
    /// The step is skipped (GradScaler's behaviour): it returns stats with
    /// [`StepStats::skipped`](crate::stats::StepStats::skipped) set, and the job goes on.
    SkipStep,
}

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NonFinite::Error => write!(f, "the step fails"),
            NonFinite::SkipStep => write!(f, "the step is skipped"),
        }
    }
}

/// How each minibatch is planned, dispatched, weighted, clipped, recovered and timed out.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepConfig {
    pub communication: Communication,
    /// On-demand mode only; collective mode always plans LB-Micro and never steals.
    pub dispatch: DispatchMode,
    pub cost: CostModel,
    /// Token budget of one micro-batch.
    pub token_budget: u64,
    /// Dynamic dispatch: a micro-batch takes samples until it holds at least this fraction of
    /// `token_budget` (while enough are left), past guided packing's cost target
    /// ([`plan_dynamic_filled`](crate::balancer::plan_dynamic_filled)). In `0..=1`; 0
    /// is plain guided packing.
    pub min_fill: f64,
    pub weighting: LossWeighting,
    /// Clip the global gradient norm to this value.
    pub clip_norm: Option<f64>,
    pub failure: FailurePolicy,
    /// Replays of one minibatch before the step fails.
    pub max_replays: u32,
    /// Runtime straggler rebalancing: estimate each trainer's speed from completed work; plans
    /// are speed-weighted and steals use the estimates (otherwise all speeds count as equal).
    pub rebalance: bool,
    /// Longest a micro-batch may run before its step fails with [`StepError::Deadline`] and its
    /// trainer is killed (I6).
    pub micro_batch_timeout: Duration,
    /// The learning rate's factor per global step.
    pub schedule: LrSchedule,
    /// Global step of this job's first step (a job resumed from a checkpoint of step `n`
    /// starts at `n`): the schedule's position.
    pub first_step: u64,
    /// A non-finite gradient, loss or global norm fails the step or skips it.
    pub non_finite: NonFinite,
    /// Sequence splitting: whether the planner may run a long sample over a gang of trainers
    /// ([`crate::split`]; in collective mode a gang's pieces run in one lockstep round).
    pub split: SplitPolicy,
    /// The most trainers one gang may have (0: no limit).
    pub max_gang: u32,
    /// Collective mode only: context parallelism as TransformerEngine, Megatron-Core (static)
    /// or its hybrid CP (dynamic) run it ([`crate::split::plan_cp`]); the baselines on-demand
    /// splitting is measured against. Excludes `split`.
    #[serde(default)]
    pub context_parallel: ContextParallel,
    /// The price of a gang's K/V ring ([`crate::split::RingPrice`]). With one, an on-demand step
    /// weighs the context-parallel placements as well as its gangs
    /// ([`crate::split::plan_on_demand`]); without, it plans gangs only.
    #[serde(default)]
    pub ring_price: Option<RingPrice>,
}

impl Default for StepConfig {
    fn default() -> Self {
        StepConfig {
            communication: Communication::OnDemand,
            dispatch: DispatchMode::Dynamic,
            cost: CostModel::default(),
            token_budget: 65_536,
            min_fill: 0.0,
            weighting: LossWeighting::Tokens,
            clip_norm: None,
            failure: FailurePolicy::default(),
            max_replays: 3,
            rebalance: false,
            micro_batch_timeout: DEFAULT_MICRO_BATCH_TIMEOUT,
            schedule: LrSchedule::Constant,
            first_step: 0,
            non_finite: NonFinite::Error,
            split: SplitPolicy::Off,
            max_gang: 0,
            context_parallel: ContextParallel::Off,
            ring_price: None,
        }
    }
}

impl StepConfig {
    /// Checks every field a step needs in range, naming the first that is not: the cost model
    /// and the schedule, a positive token budget and micro-batch deadline, a fill floor in
    /// `0..=1`, a positive finite clip norm, and a failure policy collective mode can run
    /// (it needs every trainer). The job builder and the supervisor both run it.
    pub fn validate(&self) -> Result<(), StepError> {
        self.cost.validate()?;
        self.schedule.validate().map_err(StepError::Config)?;
        if self.token_budget == 0 {
            return Err(StepError::Config("token budget must be positive".into()));
        }
        if !(0.0..=1.0).contains(&self.min_fill) {
            return Err(StepError::Config(format!(
                "the micro-batch fill floor is a fraction of the token budget in 0..=1, got {}",
                self.min_fill
            )));
        }
        if let Some(max) = self.clip_norm {
            if !(max.is_finite() && max > 0.0) {
                return Err(StepError::Config(format!(
                    "clip norm must be positive, got {max}"
                )));
            }
        }
        if self.micro_batch_timeout.is_zero() {
            return Err(StepError::Config(
                "the micro-batch timeout must be positive".into(),
            ));
        }
        if self.context_parallel != ContextParallel::Off {
            if self.communication != Communication::Collective {
                return Err(StepError::Config(format!(
                    "context parallelism ({}) is a collective-mode baseline; on demand, long \
                     samples are split by sequence_parallel",
                    self.context_parallel
                )));
            }
            if self.split != SplitPolicy::Off {
                return Err(StepError::Config(format!(
                    "context parallelism ({}) and sequence splitting ({:?}) exclude each other: \
                     choose one",
                    self.context_parallel, self.split
                )));
            }
        }
        if self.communication == Communication::Collective && self.failure == FailurePolicy::Drop {
            return Err(StepError::Config(
                "collective mode needs every trainer: use FailurePolicy::Respawn".into(),
            ));
        }
        Ok(())
    }
}
