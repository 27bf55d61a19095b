//! The supervisor's decisions as a pure state machine (torchft's `quorum_compute`, Psyche's
//! coordinator): events in, each with an injected `now`; [`Decision`]s out, each a [`Command`]
//! with the [`Reason`] it was taken for. The supervisor actor only translates: it feeds messages
//! in as events, executes the commands and feeds their outcomes back (`Reduce` → every server
//! reduces → [`StepMachine::on_reduced`]).
//!
//! ## One step
//! `start` plans the minibatch for the live trainers and assigns every idle trainer its first
//! micro-batch. Phases: **Computing** → (ledger complete) **Reducing** → **Applying** → `Finish`.
//! - *Computing*: each admitted report (see below) goes into the ledger and the reporting trainer
//!   gets its next micro-batch: the front of its own list, or (dynamic dispatch) a steal
//!   ([`WorkQueue::steal`]).
//! - *Reducing*: `Reduce { scale = 1 / total weight, next_epoch }`; the servers reply the sum of
//!   squares of the scaled gradient; the norm gives the clip factor.
//! - *Applying*: `Apply { clip, version }`; when every server applied, `Finish(Ok(stats))`.
//!
//! ## Non-finite gradients and losses
//! A non-finite gradient never reaches a parameter. Two places find one: a trainer (every
//! gradient is checked while it is encoded for its push, every loss when the compute returns;
//! the report is [`Error::NonFinite`] naming trainer, micro-batch, samples and unit), and the
//! barrier (the servers' sum of squares is NaN or inf, e.g. finite gradients whose sum overflowed
//! in an fp32 accumulator). Either way the attempt is `Discard`ed at every owner (no `Apply`:
//! parameters, optimizer moments and the optimizer's step count stay as they were), then per
//! [`StepConfig::non_finite`]:
//! - [`NonFinite::Error`]: `Finish(Err(Error::NonFinite))`; the job's step counter does not move,
//!   the next step trains at the same global step.
//! - [`NonFinite::SkipStep`] (PyTorch's GradScaler skipping `optimizer.step()`):
//!   `Finish(Ok(stats))` with [`StepStats::skipped`] set. A skipped step counts as a step of the
//!   job: the global step ([`StepMachine::global_step`]), hence the learning-rate schedule's
//!   position and the job's data position, move on, as with `scheduler.step()` called every
//!   iteration; the parameter version and the optimizer's step count do not.
//!
//! ## Failures (the recovery rules are [`crate::policy::recovery`]'s)
//! - A trainer lost while *Computing*: `Discard` (every owner drops the attempt and moves to a new
//!   epoch), then re-plan for the live trainers and replay the whole minibatch; after
//!   `max_replays` replays, `TooManyReplays`. The trainer is respawned (`FailurePolicy::Respawn`,
//!   at most `max_respawns` per slot) or dropped. Lost while *Reducing* / *Applying*: only
//!   respawned, every gradient of the step already landed.
//! - A micro-batch returning an error: `Discard`, then `Finish(Err(Error::MicroBatch))` (an
//!   [`Error::NonFinite`]: see above).
//! - A micro-batch running past `micro_batch_timeout` (seen on a tick): `Discard`, the hung
//!   trainer `Kill`ed (and respawned per policy), then `Finish(Err(Error::Deadline))`.
//! - A shard server lost: `Finish(Err)` naming it and `Stop`.
//! - A server call failing: `Finish(Err)` with its error.
//! - The ledger refusing a hand-out or a completion: the micro-batch is put back (never dropped),
//!   `Discard`, then `Finish(Err(Error::Ledger))`. Only the machine's own inconsistency can cause
//!   this (a micro-batch queued twice, a ledger out of step with the slots): a peer's report never
//!   reaches the ledger unless it was admitted.
//!
//! ## Reports are bound to assignments
//! Every [`Assignment`] carries the token of its (epoch, micro-batch) under the job key
//! ([`crate::policy::token`]). A report is **admitted** only if its token is that one and its
//! trainer is the slot running exactly that micro-batch of that epoch. Anything else is dropped
//! with `Ignore` and a [`Reason::ReportRefused`] naming why ([`ReportRefusal`]): an unknown
//! trainer, a wrong token (a forgery, an unknown micro-batch, another epoch), a right token in
//! another trainer's name or from a slot no longer running it, or a duplicate of a report already
//! counted. A dropped report changes nothing: no slot becomes idle, nothing reaches the ledger,
//! no step fails, nothing is dispatched. These are the only refusals a peer can cause; they never
//! fail a step.
//!
//! ## Invariants (tested below and in `tests/runtime`)
//! - **I1 consistency**: `Apply` (publishing version v+1) is issued only after the ledger holds
//!   every micro-batch of step v and the reduce finished; no trainer has step-v work then.
//! - **I2 exactly once**: a micro-batch is handed out once per attempt; only admitted reports
//!   reach the ledger, which counts each micro-batch once; forged, duplicated and reordered reports
//!   change nothing (`reports_bound_to_assignments` property test); admitted reports of a
//!   discarded epoch are ignored (the trainer becomes idle); a replay hands every micro-batch out
//!   again in a fresh epoch, under new tokens.
//! - **I4 no inner barrier**: a trainer gets its next micro-batch in the decisions answering its
//!   own report; nothing waits for another trainer before the barrier.
//! - **I6 liveness**: every step ends (`Finish`) — through the barrier, a typed error, or a
//!   deadline; no refusal drops work. At most one server command is outstanding at a time: the
//!   machine waits for its outcome in the `Discarding`, `Reducing` or `Applying` phase.
//!
//! ```
//! use odc_actors::batch::SampleMeta;
//! use odc_actors::policy::clock::Timestamp;
//! use odc_actors::policy::step::{Command, StepConfig, StepMachine};
//! use odc_actors::policy::token::JobKey;
//! // The supervisor draws the key at random; the machine draws nothing.
//! let key = JobKey::from_bytes([9; 32]);
//! let mut m = StepMachine::new(StepConfig::default(), 2, key);
//! let now = Timestamp::from_nanos(0);
//! let samples = vec![SampleMeta::new(0, 100), SampleMeta::new(1, 300)];
//! let decisions = m.start(samples, now);
//! let slots: Vec<u32> = decisions
//!     .iter()
//!     .filter_map(|d| match &d.command {
//!         Command::Assign { slot, .. } => Some(*slot),
//!         _ => None,
//!     })
//!     .collect();
//! assert_eq!(slots, vec![0, 1]);
//! println!("{}", decisions[0].reason);
//! ```

use std::time::Duration;

use crate::batch::{LossWeighting, MicroBatch, SampleMeta};
use crate::error::{Error, NonFiniteAt};
use crate::messages::{Assignment, TrainerReport};
use crate::policy::balancer::{
    plan_dynamic_filled, plan_dynamic_weighted_filled, plan_equal_count, plan_static,
    plan_static_weighted, CostModel,
};
use crate::policy::clock::Timestamp;
use crate::policy::dispatch::{Communication, DispatchMode, Outlook, WorkQueue};
use crate::policy::ledger::{Ledger, LedgerError};
use crate::policy::recovery::{may_replay, must_replay, slot_fate, FailurePolicy, SlotFate};
use crate::policy::schedule::LrSchedule;
use crate::policy::stats::{MicroBatchRecord, StepStats, TrainerStepStats};
use crate::policy::straggler::SpeedEstimator;
use crate::policy::token::JobKey;

/// Default [`StepConfig::micro_batch_timeout`].
pub const DEFAULT_MICRO_BATCH_TIMEOUT: Duration = Duration::from_secs(600);

/// Longest period between two ticks ([`StepMachine::tick_period`]).
const MAX_TICK: Duration = Duration::from_millis(100);

/// What a step does when a gradient, a loss or the global gradient norm is not finite (NaN or
/// ±inf). Either way the step's gradients are discarded at every owner: parameters, optimizer
/// moments and the optimizer's step count are unchanged (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum NonFinite {
    /// The step fails with [`Error::NonFinite`]; the job can go on with the next step.
    #[default]
    Error,
    /// The step is skipped (GradScaler's behaviour): it returns stats with
    /// [`StepStats::skipped`] set, and the job goes on.
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
    /// ([`plan_dynamic_filled`](crate::policy::balancer::plan_dynamic_filled)). In `0..=1`; 0
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
    /// Longest a micro-batch may run before its step fails with [`Error::Deadline`] and its
    /// trainer is killed (I6).
    pub micro_batch_timeout: Duration,
    /// The learning rate's factor per global step.
    pub schedule: LrSchedule,
    /// Global step of this job's first step (a job resumed from a checkpoint of step `n`
    /// starts at `n`): the schedule's position.
    pub first_step: u64,
    /// A non-finite gradient, loss or global norm fails the step or skips it.
    pub non_finite: NonFinite,
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
        }
    }
}

/// One decision: what to do and why.
#[derive(Debug, Clone)]
pub struct Decision {
    pub command: Command,
    pub reason: Reason,
}

/// What the actor executes. Outcomes come back as events (named on each variant).
#[derive(Debug, Clone)]
pub enum Command {
    /// Send `assignment` to the trainer in `slot` (a failed send →
    /// [`StepMachine::on_trainer_lost`]).
    Assign { slot: u32, assignment: Assignment },
    /// Every server: take the accumulators (moving to `next_epoch`), scale, reply the sum of
    /// squares → [`StepMachine::on_reduced`] with the sum over all servers.
    Reduce { scale: f64, next_epoch: u64 },
    /// Every server: clip, optimizer step at `lr_scale` times the base learning rate, publish
    /// `version` → [`StepMachine::on_applied`].
    Apply {
        clip: f64,
        lr_scale: f64,
        version: u64,
    },
    /// Every server: drop the attempt, move to `next_epoch`; the actor also aborts collectives
    /// below `next_epoch` → [`StepMachine::on_discarded`].
    Discard { next_epoch: u64 },
    /// Spawn a fresh trainer in `slot` → [`StepMachine::on_trainer_started`], or
    /// [`StepMachine::on_trainer_lost`] if that fails.
    Respawn { slot: u32 },
    /// Kill the trainer in `slot` and forget it: the machine already counts it as lost (no
    /// `on_trainer_lost` follows for it).
    Kill { slot: u32 },
    /// Answer the running step's caller.
    Finish(Result<StepStats, Error>),
    /// Answer the caller of [`StepMachine::start`] that its request was refused; a running step
    /// (if any) goes on.
    Reject(Error),
    /// Stop the supervisor (after answering the running step, if any).
    Stop(Error),
    /// Nothing to execute: the event was dropped (a refused report); the actor logs the reason
    /// once and counts it.
    Ignore,
}

impl Command {
    /// Short name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Assign { .. } => "assign",
            Command::Reduce { .. } => "reduce",
            Command::Apply { .. } => "apply",
            Command::Discard { .. } => "discard",
            Command::Respawn { .. } => "respawn",
            Command::Kill { .. } => "kill",
            Command::Finish(_) => "finish",
            Command::Reject(_) => "reject",
            Command::Stop(_) => "stop",
            Command::Ignore => "ignore",
        }
    }
}

/// Why a decision was taken: plain data, printable.
#[derive(Debug, Clone, PartialEq)]
pub enum Reason {
    /// The front of the trainer's own list.
    OwnList,
    /// Stolen from the back of `from`'s list: estimated time from now until the thief finishes it,
    /// and until its owner would have (`None`: never, the owner is not live).
    Stolen {
        from: u32,
        thief_finish: Duration,
        victim_finish: Option<Duration>,
    },
    /// Every micro-batch of the step is in the ledger.
    LedgerComplete { micro_batches: u32 },
    /// The servers reduced; global norm of the scaled gradient and the clip factor it gave.
    GradientsReduced { grad_norm: f64, clip: f64 },
    /// Every server applied and published `version`.
    Applied { version: u64 },
    /// A trainer was lost (failed, stopped, unreachable, or failed to respawn).
    TrainerLost { slot: u32, reason: String },
    /// The minibatch failed again after `replays` replays.
    TooManyReplays { replays: u32 },
    /// A micro-batch returned an error.
    MicroBatchFailed { slot: u32, micro_batch: u32 },
    /// A trainer found a non-finite gradient or loss in a micro-batch; `policy` decides.
    NonFiniteMicroBatch {
        slot: u32,
        micro_batch: u32,
        policy: NonFinite,
    },
    /// The servers' sum of squares of the scaled gradient is not finite (`value`, as printed);
    /// `policy` decides.
    NonFiniteGradNorm { value: String, policy: NonFinite },
    /// A micro-batch ran past the deadline.
    MicroBatchDeadline {
        slot: u32,
        micro_batch: u32,
        after: Duration,
    },
    /// The ledger refused a hand-out or a completion.
    LedgerRefused { refusal: LedgerError },
    /// A shard server was lost.
    ServerLost { endpoint: u32, reason: String },
    /// A server command failed.
    ServerCallFailed { call: &'static str },
    /// The minibatch could not be planned (empty, bad sample, no trainer left...).
    Unplannable,
    /// A step is already running (or the supervisor stopped).
    NotAccepted,
    /// A report naming `trainer`, `micro_batch` and `epoch` was dropped before the ledger.
    ReportRefused {
        trainer: u32,
        micro_batch: u32,
        epoch: u64,
        why: ReportRefusal,
    },
}

/// Why a report was dropped (module docs, "Reports are bound to assignments"). Each comes from a
/// forged, replayed or misdirected report, or a late one of a trainer that was lost meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportRefusal {
    /// No trainer slot has that number.
    UnknownTrainer,
    /// The token is not the assignment's for (epoch, micro-batch): a forgery, a micro-batch that
    /// was never handed out, or a token of another epoch.
    WrongToken,
    /// The right token, but the named trainer is not running that micro-batch of that epoch:
    /// sent in another trainer's name, or its slot was lost (killed, respawned) meanwhile.
    NotRunning,
    /// The right token and trainer again, for a micro-batch the ledger already counted.
    Duplicate,
}

impl ReportRefusal {
    /// The metric label (`odc_refused_reports_total{reason=...}`).
    pub fn label(self) -> &'static str {
        match self {
            ReportRefusal::UnknownTrainer => "unknown_trainer",
            ReportRefusal::WrongToken => "wrong_token",
            ReportRefusal::NotRunning => "not_running",
            ReportRefusal::Duplicate => "duplicate",
        }
    }
}

impl std::fmt::Display for ReportRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReportRefusal::UnknownTrainer => "no such trainer",
            ReportRefusal::WrongToken => "its token is not the assignment's",
            ReportRefusal::NotRunning => "that trainer is not running that micro-batch",
            ReportRefusal::Duplicate => "the micro-batch was already counted",
        })
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::OwnList => write!(f, "next of its own list"),
            Reason::Stolen {
                from,
                thief_finish,
                victim_finish: Some(v),
            } => write!(
                f,
                "stolen from trainer {from}: done in {thief_finish:?} instead of {v:?}"
            ),
            Reason::Stolen {
                from,
                thief_finish,
                victim_finish: None,
            } => write!(
                f,
                "stolen from trainer {from} (not live): done in {thief_finish:?}"
            ),
            Reason::LedgerComplete { micro_batches } => {
                write!(f, "all {micro_batches} micro-batches in the ledger")
            }
            Reason::GradientsReduced { grad_norm, clip } => {
                write!(f, "gradients reduced: norm {grad_norm}, clip factor {clip}")
            }
            Reason::Applied { version } => write!(f, "every server published version {version}"),
            Reason::TrainerLost { slot, reason } => write!(f, "trainer {slot} lost: {reason}"),
            Reason::TooManyReplays { replays } => {
                write!(f, "failed again after {replays} replays")
            }
            Reason::MicroBatchFailed { slot, micro_batch } => {
                write!(f, "micro-batch {micro_batch} failed on trainer {slot}")
            }
            Reason::NonFiniteMicroBatch {
                slot,
                micro_batch,
                policy,
            } => write!(
                f,
                "non-finite gradient or loss in micro-batch {micro_batch} on trainer {slot}: \
                 {policy}"
            ),
            Reason::NonFiniteGradNorm { value, policy } => write!(
                f,
                "the gradient's global sum of squares is {value}: {policy}"
            ),
            Reason::MicroBatchDeadline {
                slot,
                micro_batch,
                after,
            } => write!(
                f,
                "micro-batch {micro_batch} on trainer {slot} ran past its deadline ({after:?})"
            ),
            Reason::LedgerRefused { refusal } => write!(f, "ledger refused: {refusal}"),
            Reason::ServerLost { endpoint, reason } => {
                write!(f, "shard server {endpoint} lost: {reason}")
            }
            Reason::ServerCallFailed { call } => write!(f, "server {call} failed"),
            Reason::Unplannable => write!(f, "the minibatch cannot be planned"),
            Reason::NotAccepted => write!(f, "a step is running or the supervisor stopped"),
            Reason::ReportRefused {
                trainer,
                micro_batch,
                epoch,
                why,
            } => write!(
                f,
                "report of micro-batch {micro_batch} (epoch {epoch}) in trainer {trainer}'s name \
                 dropped: {why}"
            ),
        }
    }
}

/// Where a trainer slot stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Presence {
    Live,
    /// A respawn was commanded and has not started yet.
    Respawning,
    /// Lost for good.
    Gone,
}

/// The micro-batch a trainer is running.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Busy {
    epoch: u64,
    micro_batch: usize,
    since: Timestamp,
    cost: f64,
}

#[derive(Debug, Clone)]
struct Slot {
    presence: Presence,
    busy: Option<Busy>,
    respawns: u32,
}

/// What follows a discard.
#[derive(Debug, Clone)]
enum AfterDiscard {
    /// Re-plan and run the minibatch again.
    Replay,
    /// Fail the step.
    Fail { error: Error, reason: Reason },
    /// Skip the step (non-finite gradients, [`NonFinite::SkipStep`]): `why` goes into the stats.
    Skip {
        why: Error,
        reason: Reason,
        grad_norm: f64,
    },
}

#[derive(Debug, Clone)]
enum Phase {
    Computing,
    Discarding(AfterDiscard),
    Reducing,
    Applying { grad_norm: f64, version: u64 },
}

/// One planned attempt at a minibatch.
#[derive(Debug, Clone)]
struct Attempt {
    /// The accumulator epoch its micro-batches are handed out in.
    epoch: u64,
    micro_batches: Vec<MicroBatch>,
    queue: WorkQueue,
    ledger: Ledger,
    loss_sum: f64,
    /// Indexed by slot.
    trainers: Vec<TrainerStepStats>,
    log: Vec<MicroBatchRecord>,
}

/// One minibatch in flight.
#[derive(Debug, Clone)]
struct Run {
    samples: Vec<SampleMeta>,
    total_weight: f64,
    attempt: Attempt,
    phase: Phase,
    replays: u32,
    started: Timestamp,
}

impl Run {
    /// What the finished step did: `step` trained, ended at `ended`.
    fn stats(self, step: u64, grad_norm: f64, ended: Timestamp) -> StepStats {
        let Run {
            samples,
            total_weight,
            attempt,
            replays,
            started,
            ..
        } = self;
        let wall = ended.saturating_duration_since(started);
        let mut trainers = attempt.trainers;
        for (i, t) in trainers.iter_mut().enumerate() {
            t.idle = wall.saturating_sub(t.busy);
            let last = attempt
                .log
                .iter()
                .filter(|r| r.trainer == i as u32)
                .map(|r| r.finished)
                .max()
                .unwrap_or(started);
            t.barrier_wait = ended.saturating_duration_since(last);
        }
        let loss = if total_weight > 0.0 {
            attempt.loss_sum / total_weight
        } else {
            0.0
        };
        StepStats {
            step,
            loss,
            tokens: samples.iter().map(|s| s.tokens).sum(),
            samples: samples.len() as u64,
            micro_batches: attempt.micro_batches.len() as u32,
            grad_norm,
            replays,
            started,
            wall,
            trainers,
            micro_batch_log: attempt.log,
            skipped: None,
        }
    }
}

/// The supervisor's state and decisions (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct StepMachine {
    config: StepConfig,
    /// Signs every assignment's token and checks every report's.
    key: JobKey,
    slots: Vec<Slot>,
    speeds: SpeedEstimator,
    version: u64,
    /// Steps skipped for non-finite gradients ([`NonFinite::SkipStep`]).
    skipped: u64,
    epoch: u64,
    run: Option<Run>,
    stopped: Option<Error>,
}

fn decision(command: Command, reason: Reason) -> Decision {
    Decision { command, reason }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl StepMachine {
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
        }
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

    /// A new minibatch. `Reject` if a step is running (it goes on) or the machine stopped;
    /// `Finish(Err)` if it cannot be planned; otherwise the first assignments.
    pub fn start(&mut self, samples: Vec<SampleMeta>, now: Timestamp) -> Vec<Decision> {
        if let Some(e) = &self.stopped {
            return vec![decision(Command::Reject(e.clone()), Reason::NotAccepted)];
        }
        if self.run.is_some() {
            return vec![decision(Command::Reject(Error::Busy), Reason::NotAccepted)];
        }
        if samples.is_empty() {
            let e = Error::EmptyMinibatch {
                step: self.global_step(),
            };
            return vec![decision(Command::Finish(Err(e)), Reason::Unplannable)];
        }
        let attempt = match self.plan(&samples) {
            Ok(a) => a,
            Err(e) => return vec![decision(Command::Finish(Err(e)), Reason::Unplannable)],
        };
        let total_weight = samples
            .iter()
            .map(|s| self.config.weighting.weight(s))
            .sum();
        self.run = Some(Run {
            samples,
            total_weight,
            attempt,
            phase: Phase::Computing,
            replays: 0,
            started: now,
        });
        self.dispatch(now)
    }

    /// A trainer's report of a micro-batch, success or error. A report that is not admitted
    /// (module docs, "Reports are bound to assignments") is answered with one `Ignore` and
    /// changes nothing.
    pub fn on_report(&mut self, report: TrainerReport, now: Timestamp) -> Vec<Decision> {
        if let Err(why) = self.admit(&report) {
            let reason = Reason::ReportRefused {
                trainer: report.trainer,
                micro_batch: report.micro_batch,
                epoch: report.epoch,
                why,
            };
            return vec![decision(Command::Ignore, reason)];
        }
        // Admitted: the slot was running exactly this micro-batch; it is idle now.
        let slot = report.trainer as usize;
        if let Some(s) = self.slots.get_mut(slot) {
            s.busy = None;
        }
        let current = self.stopped.is_none()
            && report.epoch == self.epoch
            && self
                .run
                .as_ref()
                .is_some_and(|r| matches!(r.phase, Phase::Computing));
        if !current {
            // A report of a discarded attempt (its gradients were discarded or refused at the
            // owners), or of no step: ignored, the trainer is idle.
            return self.dispatch(now);
        }
        let step = self.global_step();
        let mb = report.micro_batch as usize;
        let (output, io) = match report.result {
            Ok(done) => (done.output, done.stats),
            Err(Error::NonFinite(mut at)) => {
                // Named by the report (the trainer and micro-batch the ledger knows) and the
                // global step.
                at.step = step;
                at.trainer = Some(report.trainer);
                at.micro_batch = Some(report.micro_batch);
                let error = Error::NonFinite(at);
                let reason = Reason::NonFiniteMicroBatch {
                    slot: slot as u32,
                    micro_batch: report.micro_batch,
                    policy: self.config.non_finite,
                };
                return self
                    .non_finite(error, reason, f64::NAN)
                    .into_iter()
                    .collect();
            }
            Err(source) => {
                let reason = Reason::MicroBatchFailed {
                    slot: slot as u32,
                    micro_batch: mb as u32,
                };
                let error = Error::MicroBatch {
                    step,
                    micro_batch: report.micro_batch,
                    trainer: report.trainer,
                    source: Box::new(source),
                };
                return self.fail(error, reason).into_iter().collect();
            }
        };
        let Some(run) = self.run.as_mut() else {
            return Vec::new();
        };
        let a = &mut run.attempt;
        if let Err(refusal) = a.ledger.complete(mb, slot) {
            return self.refused(refusal);
        }
        let (tokens, cost) = a
            .micro_batches
            .get(mb)
            .map_or((0, 0.0), |m| (m.tokens, m.cost));
        a.loss_sum += output.loss_sum;
        let busy = report.finished.saturating_duration_since(report.started);
        self.speeds.observe(slot, cost, busy.as_secs_f64());
        if let Some(t) = a.trainers.get_mut(slot) {
            t.busy += busy;
            t.pull_wait += io.pull_wait;
            t.micro_batches += 1;
            t.tokens += tokens;
            t.peak_gathered = t.peak_gathered.max(io.peak_gathered);
            t.bytes_pulled += io.bytes_pulled;
            t.bytes_pushed += io.bytes_pushed;
        }
        a.log.push(MicroBatchRecord {
            micro_batch: report.micro_batch,
            trainer: report.trainer,
            started: report.started,
            finished: report.finished,
            tokens,
            cost,
            spans: io.spans,
        });
        if !a.ledger.is_complete() {
            return self.dispatch(now);
        }
        let micro_batches = a.ledger.len() as u32;
        // The barrier: I1, every micro-batch of step v is in; nobody has step-v work.
        run.phase = Phase::Reducing;
        let scale = if run.total_weight > 0.0 {
            1.0 / run.total_weight
        } else {
            0.0
        };
        self.epoch += 1;
        vec![decision(
            Command::Reduce {
                scale,
                next_epoch: self.epoch,
            },
            Reason::LedgerComplete { micro_batches },
        )]
    }

    /// Whether `report` answers an assignment of this machine: its token is the one of its
    /// (epoch, micro-batch) and its trainer is running that micro-batch of that epoch.
    fn admit(&self, report: &TrainerReport) -> Result<(), ReportRefusal> {
        let Some(s) = self.slots.get(report.trainer as usize) else {
            return Err(ReportRefusal::UnknownTrainer);
        };
        if !self
            .key
            .admits(report.epoch, report.micro_batch, report.token)
        {
            return Err(ReportRefusal::WrongToken);
        }
        let mb = report.micro_batch as usize;
        if s.busy
            .is_some_and(|b| b.epoch == report.epoch && b.micro_batch == mb)
        {
            return Ok(());
        }
        let counted = self.run.as_ref().is_some_and(|r| {
            r.attempt.epoch == report.epoch
                && r.attempt.ledger.done_by(mb) == Some(report.trainer as usize)
        });
        if counted {
            Err(ReportRefusal::Duplicate)
        } else {
            Err(ReportRefusal::NotRunning)
        }
    }

    /// The trainer in `slot` is gone (failed, stopped, unreachable, or its respawn failed).
    pub fn on_trainer_lost(&mut self, slot: u32, reason: String, now: Timestamp) -> Vec<Decision> {
        let _ = now;
        self.lost(slot as usize, Reason::TrainerLost { slot, reason })
    }

    /// A respawned trainer is up in `slot`.
    pub fn on_trainer_started(&mut self, slot: u32, now: Timestamp) -> Vec<Decision> {
        let Some(s) = self.slots.get_mut(slot as usize) else {
            return Vec::new();
        };
        s.presence = Presence::Live;
        s.busy = None;
        self.dispatch(now)
    }

    /// Every server reduced (`Ok`: the sum over servers of their sums of squares) or one failed.
    pub fn on_reduced(&mut self, result: Result<f64, Error>, now: Timestamp) -> Vec<Decision> {
        let _ = now;
        let lr_scale = self.config.schedule.factor(self.global_step());
        let Some(run) = self.run.as_mut() else {
            return Vec::new();
        };
        if !matches!(run.phase, Phase::Reducing) {
            return Vec::new();
        }
        let sum_sq = match result {
            Ok(v) => v,
            Err(e) => return vec![self.finish(Err(e), Reason::ServerCallFailed { call: "reduce" })],
        };
        if !sum_sq.is_finite() {
            // Checked before anything compares it: `max(0.0)` would turn NaN into 0 (clip
            // factor 1), and an infinite norm gives a clip factor of 0 and NaN through inf × 0.
            let value = sum_sq.to_string();
            let error = Error::NonFinite(Box::new(NonFiniteAt {
                what: "global gradient norm".into(),
                step: self.global_step(),
                trainer: None,
                micro_batch: None,
                samples: Vec::new(),
                unit: None,
                element: None,
                value: value.clone(),
            }));
            let reason = Reason::NonFiniteGradNorm {
                value,
                policy: self.config.non_finite,
            };
            return self
                .non_finite(error, reason, sum_sq.sqrt())
                .into_iter()
                .collect();
        }
        // Finite, and a sum of squares: never negative but for a misbehaving server.
        let grad_norm = sum_sq.max(0.0).sqrt();
        let clip = match self.config.clip_norm {
            Some(max) if grad_norm > max => max / (grad_norm + 1e-6),
            _ => 1.0,
        };
        let version = self.version + 1;
        run.phase = Phase::Applying { grad_norm, version };
        vec![decision(
            Command::Apply {
                clip,
                lr_scale,
                version,
            },
            Reason::GradientsReduced { grad_norm, clip },
        )]
    }

    /// Every server applied and published, or one failed.
    pub fn on_applied(&mut self, result: Result<(), Error>, now: Timestamp) -> Vec<Decision> {
        let Some(run) = self.run.as_ref() else {
            return Vec::new();
        };
        let Phase::Applying { grad_norm, version } = run.phase else {
            return Vec::new();
        };
        if let Err(e) = result {
            return vec![self.finish(Err(e), Reason::ServerCallFailed { call: "apply" })];
        }
        let step = self.global_step();
        self.version = version;
        let Some(run) = self.run.take() else {
            return Vec::new();
        };
        let stats = run.stats(step, grad_norm, now);
        vec![decision(
            Command::Finish(Ok(stats)),
            Reason::Applied { version },
        )]
    }

    /// Every server discarded the attempt, or one failed.
    pub fn on_discarded(&mut self, result: Result<(), Error>, now: Timestamp) -> Vec<Decision> {
        let Some(run) = self.run.as_mut() else {
            return Vec::new();
        };
        let Phase::Discarding(then) = std::mem::replace(&mut run.phase, Phase::Computing) else {
            return Vec::new();
        };
        match (result, then) {
            (Err(e), _) => vec![self.finish(Err(e), Reason::ServerCallFailed { call: "discard" })],
            (Ok(()), AfterDiscard::Fail { error, reason }) => vec![self.finish(Err(error), reason)],
            (Ok(()), AfterDiscard::Replay) => self.replay(now),
            (
                Ok(()),
                AfterDiscard::Skip {
                    why,
                    reason,
                    grad_norm,
                },
            ) => {
                let step = self.global_step();
                self.skipped += 1;
                let Some(run) = self.run.take() else {
                    return Vec::new();
                };
                let stats = StepStats {
                    skipped: Some(why),
                    ..run.stats(step, grad_norm, now)
                };
                vec![decision(Command::Finish(Ok(stats)), reason)]
            }
        }
    }

    /// A shard server is gone: its shard is lost; the step fails and the supervisor stops.
    pub fn on_server_lost(
        &mut self,
        endpoint: u32,
        reason: String,
        now: Timestamp,
    ) -> Vec<Decision> {
        let _ = now;
        if self.stopped.is_some() {
            return Vec::new();
        }
        let error = Error::Actor {
            actor: format!("shard server {endpoint}"),
            reason: reason.clone(),
        };
        let why = Reason::ServerLost { endpoint, reason };
        let mut out = Vec::new();
        if self.run.is_some() {
            out.push(self.finish(Err(error.clone()), why.clone()));
        }
        self.stopped = Some(error.clone());
        out.push(decision(Command::Stop(error), why));
        out
    }

    /// Time passed: enforce the micro-batch deadline (I6). A micro-batch of the running attempt
    /// past `micro_batch_timeout` fails the step (`Discard`, then `Finish(Err(Deadline))`); every
    /// trainer past it (also one still running a discarded attempt) is killed and respawned per
    /// policy, so the next step has it back.
    pub fn on_tick(&mut self, now: Timestamp) -> Vec<Decision> {
        let mut out = Vec::new();
        if self.stopped.is_some() {
            return out;
        }
        let timeout = self.config.micro_batch_timeout;
        for slot in 0..self.slots.len() {
            let s = &self.slots[slot];
            let Some(busy) = s.busy.filter(|_| s.presence == Presence::Live) else {
                continue;
            };
            let ran = now.saturating_duration_since(busy.since);
            if ran <= timeout {
                continue;
            }
            let reason = Reason::MicroBatchDeadline {
                slot: slot as u32,
                micro_batch: busy.micro_batch as u32,
                after: ran,
            };
            let current = busy.epoch == self.epoch
                && self
                    .run
                    .as_ref()
                    .is_some_and(|r| matches!(r.phase, Phase::Computing));
            if current {
                let error = Error::Deadline {
                    what: "micro-batch".into(),
                    step: self.global_step(),
                    trainer: Some(slot as u32),
                    micro_batch: Some(busy.micro_batch as u32),
                    after_ms: millis(ran),
                };
                out.extend(self.fail(error, reason.clone()));
            }
            out.push(decision(
                Command::Kill { slot: slot as u32 },
                reason.clone(),
            ));
            out.extend(self.lost(slot, reason));
        }
        out
    }

    /// `slot` is lost: respawn it per policy; if it was live while computing, discard the
    /// attempt and replay (I2: whatever it pushed of this attempt is dropped at the owners, and
    /// its list is planned again for the trainers left).
    fn lost(&mut self, slot: usize, why: Reason) -> Vec<Decision> {
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

    /// Fail the step: discard the attempt, then `Finish(Err(error))`.
    fn fail(&mut self, error: Error, reason: Reason) -> Option<Decision> {
        let then = AfterDiscard::Fail {
            error,
            reason: reason.clone(),
        };
        self.discard(then, reason)
    }

    /// Non-finite gradients (`error` says where, `grad_norm` is the barrier's or NaN): discard
    /// the attempt, then fail or skip the step per [`StepConfig::non_finite`].
    fn non_finite(&mut self, error: Error, reason: Reason, grad_norm: f64) -> Option<Decision> {
        let then = match self.config.non_finite {
            NonFinite::Error => AfterDiscard::Fail {
                error,
                reason: reason.clone(),
            },
            NonFinite::SkipStep => AfterDiscard::Skip {
                why: error,
                reason: reason.clone(),
                grad_norm,
            },
        };
        self.discard(then, reason)
    }

    /// Discard the attempt: new epoch, phase `Discarding(then)`. `None` without a run or while
    /// already discarding (the first outcome decides).
    fn discard(&mut self, then: AfterDiscard, reason: Reason) -> Option<Decision> {
        let run = self.run.as_mut()?;
        if matches!(run.phase, Phase::Discarding(_)) {
            return None;
        }
        run.phase = Phase::Discarding(then);
        self.epoch += 1;
        Some(decision(
            Command::Discard {
                next_epoch: self.epoch,
            },
            reason,
        ))
    }

    /// The ledger refused: the machine's state is inconsistent (reports reach the ledger only once
    /// admitted, so no peer causes this). Fail the step (nothing is dropped).
    fn refused(&mut self, refusal: LedgerError) -> Vec<Decision> {
        let reason = Reason::LedgerRefused {
            refusal: refusal.clone(),
        };
        let error = Error::Ledger {
            step: self.global_step(),
            source: refusal,
        };
        self.fail(error, reason).into_iter().collect()
    }

    /// End the step with `result`.
    fn finish(&mut self, result: Result<StepStats, Error>, reason: Reason) -> Decision {
        self.run = None;
        decision(Command::Finish(result), reason)
    }

    /// After a discard for a lost trainer: re-plan and hand everything out again.
    fn replay(&mut self, now: Timestamp) -> Vec<Decision> {
        let Some(mut run) = self.run.take() else {
            return Vec::new();
        };
        if !may_replay(run.replays, self.config.max_replays) {
            let replays = run.replays;
            let e = Error::TooManyReplays {
                step: self.global_step(),
                replays,
            };
            return vec![self.finish(Err(e), Reason::TooManyReplays { replays })];
        }
        run.replays += 1;
        run.attempt = match self.plan(&run.samples) {
            Ok(a) => a,
            Err(e) => return vec![self.finish(Err(e), Reason::Unplannable)],
        };
        run.phase = Phase::Computing;
        self.run = Some(run);
        self.dispatch(now)
    }

    /// Plan `samples` for the live slots: a fresh attempt.
    fn plan(&self, samples: &[SampleMeta]) -> Result<Attempt, Error> {
        let live: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].presence == Presence::Live)
            .collect();
        if live.is_empty() {
            return Err(Error::NoTrainers {
                step: self.global_step(),
            });
        }
        let tokens: Vec<u64> = samples.iter().map(|s| s.tokens).collect();
        let c = &self.config;
        let measured = || -> Vec<f64> {
            let all = self.speeds.speeds();
            live.iter()
                .map(|&s| all.get(s).copied().unwrap_or(1.0))
                .collect()
        };
        // The fill floor in tokens (`min_fill` in 0..=1, so at most the budget).
        let fill = (c.min_fill.clamp(0.0, 1.0) * c.token_budget as f64) as u64;
        let plan = match (c.communication, c.dispatch, c.rebalance) {
            (Communication::Collective, _, _) => {
                if live.len() != self.slots.len() {
                    return Err(Error::Config(format!(
                        "collective mode needs all {} trainers, {} are left",
                        self.slots.len(),
                        live.len()
                    )));
                }
                plan_equal_count(&tokens, &c.cost, live.len(), c.token_budget)?
            }
            (Communication::OnDemand, DispatchMode::Static, true) => {
                plan_static_weighted(&tokens, &c.cost, &measured(), c.token_budget)?
            }
            (Communication::OnDemand, DispatchMode::Dynamic, true) => {
                plan_dynamic_weighted_filled(&tokens, &c.cost, &measured(), c.token_budget, fill)?
            }
            (Communication::OnDemand, DispatchMode::Static, false) => {
                plan_static(&tokens, &c.cost, live.len(), c.token_budget)?
            }
            (Communication::OnDemand, DispatchMode::Dynamic, false) => {
                plan_dynamic_filled(&tokens, &c.cost, live.len(), c.token_budget, fill)?
            }
        };
        let micro_batches: Vec<MicroBatch> = plan
            .micro_batches
            .iter()
            .enumerate()
            .map(|(id, mb)| MicroBatch {
                // The parameter version every read of it must return (I1).
                step: self.version,
                id: id as u32,
                samples: mb
                    .samples
                    .iter()
                    .filter_map(|&i| samples.get(i).copied())
                    .collect(),
                tokens: mb.tokens,
                cost: mb.cost,
                weighting: c.weighting,
            })
            .collect();
        Ok(Attempt {
            epoch: self.epoch,
            queue: WorkQueue::new(&plan, &live, self.slots.len()),
            ledger: Ledger::new(micro_batches.len()),
            micro_batches,
            loss_sum: 0.0,
            trainers: vec![TrainerStepStats::default(); self.slots.len()],
            log: Vec::new(),
        })
    }

    /// Whether idle trainers steal (dynamic dispatch, on-demand mode).
    fn steals(&self) -> bool {
        self.config.dispatch == DispatchMode::Dynamic
            && self.config.communication == Communication::OnDemand
    }

    /// Every slot as dispatch sees it now: measured speeds (`rebalance`) or all equal, and the
    /// estimated rest of its current micro-batch ([`Outlook::busy`]).
    fn outlooks(&self, now: Timestamp) -> Vec<Outlook> {
        let measured = self.speeds.speeds();
        let mean = measured.iter().sum::<f64>() / measured.len().max(1) as f64;
        self.slots
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let speed = if self.config.rebalance {
                    measured.get(i).copied().unwrap_or(mean)
                } else {
                    mean
                };
                let outlook = match s.busy {
                    Some(b) => {
                        let ran = now.saturating_duration_since(b.since).as_secs_f64();
                        Outlook::busy(speed, b.cost, ran)
                    }
                    None => Outlook::idle(speed),
                };
                Outlook {
                    live: s.presence == Presence::Live,
                    ..outlook
                }
            })
            .collect()
    }

    /// Hand the next micro-batch to every idle live trainer (Computing only).
    fn dispatch(&mut self, now: Timestamp) -> Vec<Decision> {
        let mut out = Vec::new();
        let steals = self.steals();
        for slot in 0..self.slots.len() {
            let computing = self
                .run
                .as_ref()
                .is_some_and(|r| matches!(r.phase, Phase::Computing));
            if !computing || self.stopped.is_some() {
                break;
            }
            let s = &self.slots[slot];
            if s.presence != Presence::Live || s.busy.is_some() {
                continue;
            }
            let own = self
                .run
                .as_ref()
                .is_some_and(|r| r.attempt.queue.own(slot).next().is_some());
            // Estimates only when they are needed (a steal).
            let outlooks = if steals && !own {
                self.outlooks(now)
            } else {
                Vec::new()
            };
            let Some(run) = self.run.as_mut() else {
                break;
            };
            let a = &mut run.attempt;
            let (mb, origin, reason) = match a.queue.next_own(slot) {
                Some(mb) => (mb, slot, Reason::OwnList),
                None if steals => match a.queue.steal(slot, &outlooks) {
                    Some(st) => (
                        st.micro_batch,
                        st.from,
                        Reason::Stolen {
                            from: st.from as u32,
                            thief_finish: Duration::try_from_secs_f64(st.thief_finish)
                                .unwrap_or(Duration::MAX),
                            victim_finish: Duration::try_from_secs_f64(st.victim_finish).ok(),
                        },
                    ),
                    None => continue,
                },
                None => continue,
            };
            if let Err(refusal) = a.ledger.assign(mb, slot) {
                // Never drop work: put it back where it came from, then fail the step.
                a.queue.put_back(origin, mb);
                out.extend(self.refused(refusal));
                break;
            }
            let Some(micro_batch) = a.micro_batches.get(mb).cloned() else {
                // The queue named a micro-batch the plan does not have; the ledger refused
                // already (Unknown), so this is unreachable; never hand out nothing.
                break;
            };
            self.slots[slot].busy = Some(Busy {
                epoch: self.epoch,
                micro_batch: mb,
                since: now,
                cost: micro_batch.cost,
            });
            out.push(decision(
                Command::Assign {
                    slot: slot as u32,
                    assignment: Assignment {
                        token: self.key.token(self.epoch, micro_batch.id),
                        micro_batch,
                        epoch: self.epoch,
                    },
                },
                reason,
            ));
        }
        out
    }

    /// Test-only: queue `micro_batch` a second time, at the front of `slot`'s list.
    #[cfg(test)]
    fn double_queue(&mut self, slot: usize, micro_batch: usize) {
        if let Some(run) = self.run.as_mut() {
            run.attempt.queue.put_back(slot, micro_batch);
        }
    }

    /// Test-only: make the ledger believe `micro_batch` is held by `trainer` (which is not
    /// running it), while it is still in the queue.
    #[cfg(test)]
    fn corrupt_ledger(&mut self, micro_batch: usize, trainer: usize) {
        if let Some(run) = self.run.as_mut() {
            run.attempt
                .ledger
                .assign(micro_batch, trainer)
                .expect("pending micro-batch");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;
    use crate::batch::ComputeOutput;
    use crate::messages::MicroBatchDone;
    use crate::trainer::MicroBatchStats;

    /// The key of every machine under test.
    fn key() -> JobKey {
        JobKey::from_bytes([0x42; JobKey::LEN])
    }

    fn ms(n: u64) -> Timestamp {
        Timestamp::from_nanos(n * 1_000_000)
    }

    /// `n` samples of `tokens` tokens each.
    fn samples(n: u64, tokens: u64) -> Vec<SampleMeta> {
        (0..n).map(|i| SampleMeta::new(i, tokens)).collect()
    }

    /// Linear cost, one sample of 100 tokens per micro-batch, static dispatch.
    fn config() -> StepConfig {
        StepConfig {
            dispatch: DispatchMode::Static,
            cost: CostModel::linear(),
            token_budget: 100,
            ..StepConfig::default()
        }
    }

    fn ok_report(
        slot: u32,
        a: &Assignment,
        started: Timestamp,
        finished: Timestamp,
    ) -> TrainerReport {
        TrainerReport {
            trainer: slot,
            epoch: a.epoch,
            micro_batch: a.micro_batch.id,
            token: a.token,
            started,
            finished,
            result: Ok(MicroBatchDone {
                output: ComputeOutput {
                    loss_sum: a.micro_batch.tokens as f64,
                },
                stats: MicroBatchStats::default(),
            }),
        }
    }

    fn names(ds: &[Decision]) -> Vec<&'static str> {
        ds.iter().map(|d| d.command.name()).collect()
    }

    fn assigned(ds: &[Decision]) -> Vec<(u32, Assignment)> {
        ds.iter()
            .filter_map(|d| match &d.command {
                Command::Assign { slot, assignment } => Some((*slot, assignment.clone())),
                _ => None,
            })
            .collect()
    }

    enum Pending {
        Reduced,
        Applied,
        Discarded,
        Started(u32),
    }

    /// A simulated world around a machine: trainers run at `speeds` (cost units per second) in
    /// simulated time, `hung` ones never finish; server calls and respawns succeed at once.
    struct World {
        m: StepMachine,
        now: Timestamp,
        speeds: Vec<f64>,
        hung: Vec<bool>,
        /// Per slot: the assignment it runs, since, until.
        running: Vec<Option<(Assignment, Timestamp, Timestamp)>>,
        pending: VecDeque<Pending>,
        log: Vec<Decision>,
        finished: Option<Result<StepStats, Error>>,
        stopped: bool,
    }

    impl World {
        fn new(config: StepConfig, speeds: &[f64]) -> Self {
            World {
                m: StepMachine::new(config, speeds.len() as u32, key()),
                now: ms(0),
                speeds: speeds.to_vec(),
                hung: vec![false; speeds.len()],
                running: vec![None; speeds.len()],
                pending: VecDeque::new(),
                log: Vec::new(),
                finished: None,
                stopped: false,
            }
        }

        fn apply(&mut self, ds: Vec<Decision>) {
            for d in ds {
                match &d.command {
                    Command::Assign { slot, assignment } => {
                        let s = *slot as usize;
                        assert!(self.running[s].is_none(), "slot {s} got two assignments");
                        let secs = assignment.micro_batch.cost / self.speeds[s];
                        let end = if self.hung[s] {
                            Timestamp::from_nanos(u64::MAX)
                        } else {
                            self.now + Duration::from_secs_f64(secs)
                        };
                        self.running[s] = Some((assignment.clone(), self.now, end));
                    }
                    Command::Reduce { .. } => self.pending.push_back(Pending::Reduced),
                    Command::Apply { .. } => self.pending.push_back(Pending::Applied),
                    Command::Discard { .. } => self.pending.push_back(Pending::Discarded),
                    Command::Respawn { slot } => self.pending.push_back(Pending::Started(*slot)),
                    Command::Kill { slot } => self.running[*slot as usize] = None,
                    Command::Finish(r) => self.finished = Some(r.clone()),
                    Command::Reject(_) | Command::Ignore => {}
                    Command::Stop(_) => self.stopped = true,
                }
                self.log.push(d);
            }
        }

        /// One event: a server outcome, else the next trainer report. False when nothing can
        /// happen any more (a step that is not finished then has stalled).
        fn event(&mut self) -> bool {
            let now = self.now;
            if let Some(p) = self.pending.pop_front() {
                let ds = match p {
                    Pending::Reduced => self.m.on_reduced(Ok(4.0), now),
                    Pending::Applied => self.m.on_applied(Ok(()), now),
                    Pending::Discarded => self.m.on_discarded(Ok(()), now),
                    Pending::Started(slot) => {
                        self.running[slot as usize] = None;
                        self.m.on_trainer_started(slot, now)
                    }
                };
                self.apply(ds);
                return true;
            }
            let next = (0..self.running.len())
                .filter_map(|s| self.running[s].as_ref().map(|r| (s, r.2)))
                .filter(|&(s, _)| !self.hung[s])
                .min_by_key(|&(s, end)| (end, s));
            let Some((slot, end)) = next else {
                return false;
            };
            self.now = end;
            let Some((a, since, end)) = self.running[slot].take() else {
                return false;
            };
            let ds = self
                .m
                .on_report(ok_report(slot as u32, &a, since, end), end);
            self.apply(ds);
            true
        }

        /// Run until the step finishes: its result, or `None` if it stalled.
        fn finish(&mut self) -> Option<Result<StepStats, Error>> {
            while self.finished.is_none() && !self.stopped {
                if !self.event() {
                    break;
                }
            }
            self.finished.take()
        }

        fn step(&mut self, samples: Vec<SampleMeta>) -> Option<Result<StepStats, Error>> {
            self.log.clear();
            let ds = self.m.start(samples, self.now);
            self.apply(ds);
            self.finish()
        }
    }

    /// A resumed job (`first_step` 10) applies the schedule's factor of global steps 10, 11, names
    /// them in its stats, and still reads parameter version 0, 1 (I1 is about versions).
    #[test]
    fn apply_carries_the_schedule_factor_of_the_global_step() {
        let schedule = LrSchedule::WarmupCosine {
            warmup_steps: 20,
            total_steps: 40,
            min_ratio: 0.0,
        };
        let mut w = World::new(
            StepConfig {
                schedule,
                first_step: 10,
                ..config()
            },
            &[1.0],
        );
        for k in 0..2u64 {
            let stats = w.step(samples(2, 100)).expect("finishes").expect("ok");
            assert_eq!(stats.step, 10 + k);
            let scale = w.log.iter().find_map(|d| match d.command {
                Command::Apply { lr_scale, .. } => Some(lr_scale),
                _ => None,
            });
            assert_eq!(scale, Some(schedule.factor(10 + k)));
            let versions: Vec<u64> = w
                .log
                .iter()
                .filter_map(|d| match &d.command {
                    Command::Assign { assignment, .. } => Some(assignment.micro_batch.step),
                    _ => None,
                })
                .collect();
            assert!(
                !versions.is_empty() && versions.iter().all(|v| *v == k),
                "{versions:?}"
            );
        }
    }

    #[test]
    fn normal_step_command_sequence() {
        let mut w = World::new(config(), &[1.0, 1.0]);
        let stats = w.step(samples(4, 100)).expect("finishes").expect("ok");
        assert_eq!(
            names(&w.log),
            ["assign", "assign", "assign", "assign", "reduce", "apply", "finish"]
        );
        assert!(w.log[..4].iter().all(|d| d.reason == Reason::OwnList));
        match &w.log[4] {
            Decision {
                command: Command::Reduce { scale, next_epoch },
                reason: Reason::LedgerComplete { micro_batches: 4 },
            } => assert_eq!((*scale, *next_epoch), (1.0 / 400.0, 1)),
            other => panic!("{other:?}"),
        }
        match &w.log[5] {
            Decision {
                command: Command::Apply { clip, version, .. },
                reason: Reason::GradientsReduced { grad_norm, .. },
            } => assert_eq!((*clip, *version, *grad_norm), (1.0, 1, 2.0)),
            other => panic!("{other:?}"),
        }
        assert_eq!(w.log[6].reason, Reason::Applied { version: 1 });
        assert_eq!((stats.step, stats.replays, stats.micro_batches), (0, 0, 4));
        assert_eq!((stats.tokens, stats.samples, stats.loss), (400, 4, 1.0));
        assert_eq!(stats.micro_batch_log.len(), 4);
        assert_eq!(
            stats.trainers.iter().map(|t| t.micro_batches).sum::<u32>(),
            4
        );
        assert_eq!(
            stats.wall, stats.trainers[0].busy,
            "trainer 0 was busy all along"
        );
        assert_eq!((w.m.version(), w.m.epoch()), (1, 1));
        // I1: assignments of the next step carry the new version.
        let ds = w.m.start(samples(2, 100), w.now);
        assert!(assigned(&ds)
            .iter()
            .all(|(_, a)| a.micro_batch.step == 1 && a.epoch == 1));
    }

    #[test]
    fn clipping_uses_the_global_norm() {
        let mut w = World::new(
            StepConfig {
                clip_norm: Some(1.0),
                ..config()
            },
            &[1.0],
        );
        w.step(samples(2, 100)).expect("finishes").expect("ok");
        let clip = w.log.iter().find_map(|d| match d.command {
            Command::Apply { clip, .. } => Some(clip),
            _ => None,
        });
        // Sum of squares 4 → norm 2 → clip 1 / (2 + 1e-6).
        assert_eq!(clip, Some(1.0 / (2.0 + 1e-6)));
    }

    #[test]
    fn start_rejects_a_second_step_and_refuses_bad_minibatches() {
        let mut m = StepMachine::new(config(), 2, key());
        let ds = m.start(Vec::new(), ms(0));
        assert!(matches!(
            &ds[..],
            [Decision {
                command: Command::Finish(Err(Error::EmptyMinibatch { step: 0 })),
                reason: Reason::Unplannable
            }]
        ));
        let ds = m.start(samples(1, 101), ms(0));
        assert!(matches!(
            ds[0].command,
            Command::Finish(Err(Error::Balance(_)))
        ));
        assert!(!m.is_running());
        assert_eq!(
            names(&m.start(samples(3, 100), ms(0))),
            ["assign", "assign"]
        );
        let ds = m.start(samples(3, 100), ms(1));
        assert!(matches!(
            ds[..],
            [Decision {
                command: Command::Reject(Error::Busy),
                ..
            }]
        ));
        assert!(m.is_running());
    }

    #[test]
    fn replay_after_a_trainer_failure_hands_everything_out_again() {
        let mut w = World::new(config(), &[1.0, 1.0]);
        let first = w.m.start(samples(6, 100), w.now);
        w.apply(first);
        assert!(w.event(), "one report");
        // Trainer 1 fails while computing: respawn, discard.
        w.running[1] = None;
        let ds = w.m.on_trainer_lost(1, "panicked".into(), w.now);
        let lost = Reason::TrainerLost {
            slot: 1,
            reason: "panicked".into(),
        };
        assert_eq!(names(&ds), ["respawn", "discard"]);
        assert!(ds.iter().all(|d| d.reason == lost));
        assert!(matches!(ds[1].command, Command::Discard { next_epoch: 1 }));
        let from = w.log.len();
        w.apply(ds);
        let stats = w.finish().expect("finishes").expect("replayed");
        assert_eq!(stats.replays, 1);
        // Every micro-batch handed out exactly once in the replay's epoch.
        let mut replayed: Vec<u32> = assigned(&w.log[from..])
            .iter()
            .filter(|(_, a)| a.epoch == 1)
            .map(|(_, a)| a.micro_batch.id)
            .collect();
        replayed.sort_unstable();
        assert_eq!(replayed, (0..6).collect::<Vec<_>>());
        assert_eq!(stats.micro_batch_log.len(), 6);
        assert_eq!(
            stats.loss, 1.0,
            "the discarded attempt's loss does not count"
        );
    }

    #[test]
    fn too_many_replays_fail_the_step() {
        let mut w = World::new(
            StepConfig {
                max_replays: 1,
                ..config()
            },
            &[1.0, 1.0],
        );
        let ds = w.m.start(samples(4, 100), w.now);
        w.apply(ds);
        for attempt in 0..2 {
            w.running[0] = None;
            let ds = w.m.on_trainer_lost(0, format!("failure {attempt}"), w.now);
            assert_eq!(names(&ds), ["respawn", "discard"]);
            w.apply(ds);
            while !w.pending.is_empty() {
                w.event();
            }
        }
        let ds = w.log.last().expect("a decision");
        assert!(
            matches!(
                ds,
                Decision {
                    command: Command::Finish(Err(Error::TooManyReplays {
                        step: 0,
                        replays: 1
                    })),
                    reason: Reason::TooManyReplays { replays: 1 },
                }
            ),
            "{ds:?}"
        );
        assert!(!w.m.is_running());
    }

    #[test]
    fn reports_of_discarded_epochs_are_ignored() {
        let mut m = StepMachine::new(config(), 2, key());
        let first = assigned(&m.start(samples(4, 100), ms(0)));
        let (slot0, a0) = first[0].clone();
        assert_eq!(slot0, 0);
        let ds = m.on_trainer_lost(1, "gone".into(), ms(10));
        assert_eq!(names(&ds), ["respawn", "discard"]);
        // While discarding: trainer 0's report of epoch 0 is ignored, nothing is decided.
        let late = ok_report(0, &a0, ms(0), ms(20));
        assert!(m.on_report(late, ms(20)).is_empty());
        assert!(
            m.on_trainer_started(1, ms(21)).is_empty(),
            "no work while discarding"
        );
        let replay = assigned(&m.on_discarded(Ok(()), ms(30)));
        assert_eq!(replay.len(), 2);
        assert!(replay.iter().all(|(_, a)| a.epoch == 1));
        // A duplicate of the old report after the replay started: ignored again; the ledger of
        // the replay is untouched (no barrier after the replay's own reports only when all in).
        let again = ok_report(0, &a0, ms(0), ms(20));
        assert!(
            assigned(&m.on_report(again, ms(31))).is_empty(),
            "slot 0 is busy"
        );
        let mut now = 40;
        let mut queue: Vec<(u32, Assignment)> = replay;
        let mut reduce = None;
        while let Some((slot, a)) = queue.pop() {
            now += 1;
            let ds = m.on_report(ok_report(slot, &a, ms(now - 1), ms(now)), ms(now));
            reduce = reduce.or(ds.iter().find(|d| d.command.name() == "reduce").cloned());
            queue.extend(assigned(&ds));
        }
        assert!(matches!(
            reduce,
            Some(Decision {
                command: Command::Reduce { next_epoch: 2, .. },
                reason: Reason::LedgerComplete { micro_batches: 4 }
            })
        ));
    }

    #[test]
    fn a_failure_during_the_barrier_only_respawns() {
        for phase in ["reduce", "apply"] {
            let mut w = World::new(config(), &[1.0, 1.0]);
            let ds = w.m.start(samples(2, 100), w.now);
            w.apply(ds);
            while !w.log.iter().any(|d| d.command.name() == "reduce") {
                assert!(w.event());
            }
            if phase == "apply" {
                assert!(w.event());
                assert_eq!(w.log.last().map(|d| d.command.name()), Some("apply"));
            }
            let ds = w.m.on_trainer_lost(0, "late panic".into(), w.now);
            assert_eq!(names(&ds), ["respawn"], "{phase}: every gradient landed");
            w.apply(ds);
            let stats = w.finish().expect("finishes").expect("ok");
            assert_eq!(stats.replays, 0);
            assert_eq!(w.m.version(), 1);
        }
    }

    #[test]
    fn drop_policy_continues_without_the_trainer() {
        let mut w = World::new(
            StepConfig {
                failure: FailurePolicy::Drop,
                ..config()
            },
            &[1.0, 1.0, 1.0],
        );
        let ds = w.m.start(samples(6, 100), w.now);
        w.apply(ds);
        w.running[2] = None;
        let ds = w.m.on_trainer_lost(2, "gone".into(), w.now);
        assert_eq!(names(&ds), ["discard"]);
        w.apply(ds);
        let stats = w.finish().expect("finishes").expect("ok");
        assert!(stats.micro_batch_log.iter().all(|r| r.trainer != 2));
        // Losing the last ones: the replay cannot be planned.
        let ds = w.m.start(samples(2, 100), w.now);
        w.apply(ds);
        w.running = vec![None; 3];
        for slot in [0, 1] {
            let ds = w.m.on_trainer_lost(slot, "gone".into(), w.now);
            w.apply(ds);
        }
        let r = w.finish().expect("finishes");
        assert!(matches!(r, Err(Error::NoTrainers { step: 1 })), "{r:?}");
    }

    #[test]
    fn micro_batch_error_discards_then_fails_and_the_next_step_works() {
        let mut m = StepMachine::new(config(), 1, key());
        let (_, a) = assigned(&m.start(samples(2, 100), ms(0)))[0].clone();
        let mut report = ok_report(0, &a, ms(0), ms(5));
        report.result = Err(Error::user("nan loss"));
        let ds = m.on_report(report, ms(5));
        assert_eq!(names(&ds), ["discard"]);
        assert_eq!(
            ds[0].reason,
            Reason::MicroBatchFailed {
                slot: 0,
                micro_batch: a.micro_batch.id
            }
        );
        let ds = m.on_discarded(Ok(()), ms(6));
        assert!(matches!(
            &ds[..],
            [Decision {
                command: Command::Finish(Err(Error::MicroBatch {
                    step: 0,
                    trainer: 0,
                    ..
                })),
                ..
            }]
        ));
        let mut w = World {
            m,
            ..World::new(config(), &[1.0])
        };
        assert!(w.step(samples(2, 100)).expect("finishes").is_ok());
    }

    /// Start a step of `w` on `samples`, run it to its barrier and answer the reduce with
    /// `sum_sq`: the decisions that answer gave.
    fn reduce_with(w: &mut World, samples: Vec<SampleMeta>, sum_sq: f64) -> Vec<Decision> {
        w.log.clear();
        let ds = w.m.start(samples, w.now);
        w.apply(ds);
        while !w.log.iter().any(|d| d.command.name() == "reduce") {
            assert!(w.event(), "the step reaches its barrier");
        }
        assert!(matches!(w.pending.pop_front(), Some(Pending::Reduced)));
        let ds = w.m.on_reduced(Ok(sum_sq), w.now);
        w.apply(ds.clone());
        ds
    }

    /// After a failed or skipped step at global step `global` (version 0): the next step reads
    /// version 0, applies the schedule's factor of `global` and is named `global`.
    fn next_step_trains_at(w: &mut World, global: u64) {
        let stats = w.step(samples(4, 100)).expect("finishes").expect("ok");
        assert_eq!(stats.step, global);
        assert_eq!(stats.skipped, None);
        let scale = w.log.iter().find_map(|d| match d.command {
            Command::Apply { lr_scale, .. } => Some(lr_scale),
            _ => None,
        });
        assert_eq!(scale, Some(w.m.config().schedule.factor(global)));
        assert!(assigned(&w.log)
            .iter()
            .all(|(_, a)| a.micro_batch.step == 0));
        assert_eq!(w.m.version(), 1);
    }

    fn warmup() -> LrSchedule {
        LrSchedule::WarmupCosine {
            warmup_steps: 4,
            total_steps: 8,
            min_ratio: 0.0,
        }
    }

    /// A NaN or infinite sum of squares at the barrier (NaN used to become clip factor 1 through
    /// `max(0.0)`, inf a clip factor of 0 and NaN through inf × 0): never an `Apply`; the attempt
    /// is discarded at every owner, then the step fails (`Error`) or is skipped (`SkipStep`,
    /// counting as a step of the job but not as an optimizer step).
    #[test]
    fn a_non_finite_global_norm_discards_the_step_then_fails_or_skips_it() {
        for policy in [NonFinite::Error, NonFinite::SkipStep] {
            for (sum_sq, shown) in [(f64::NAN, "NaN"), (f64::INFINITY, "inf")] {
                let cfg = StepConfig {
                    non_finite: policy,
                    schedule: warmup(),
                    ..config()
                };
                let mut w = World::new(cfg, &[1.0, 1.0]);
                let ds = reduce_with(&mut w, samples(4, 100), sum_sq);
                let reason = Reason::NonFiniteGradNorm {
                    value: shown.into(),
                    policy,
                };
                assert_eq!(names(&ds), ["discard"], "{policy:?} {shown}");
                assert_eq!(ds[0].reason, reason);
                assert!(matches!(ds[0].command, Command::Discard { next_epoch: 2 }));
                let result = w.finish().expect("finishes");
                assert!(!w.log.iter().any(|d| d.command.name() == "apply"));
                assert_eq!(w.log.last().map(|d| &d.reason), Some(&reason));
                assert_eq!(w.m.version(), 0, "nothing published");
                let named = |e: &Error| {
                    matches!(e, Error::NonFinite(at) if at.what == "global gradient norm"
                        && at.value == shown
                        && (at.step, at.trainer, at.micro_batch, at.unit) == (0, None, None, None))
                };
                match (policy, result) {
                    (NonFinite::Error, Err(e)) => {
                        assert!(named(&e), "{e:?}");
                        assert_eq!(w.m.global_step(), 0, "a failed step is not a step");
                        next_step_trains_at(&mut w, 0);
                    }
                    (NonFinite::SkipStep, Ok(stats)) => {
                        assert!(stats.skipped.as_ref().is_some_and(named), "{stats:?}");
                        assert_eq!((stats.step, stats.micro_batches), (0, 4));
                        assert!(sum_sq.is_nan() == stats.grad_norm.is_nan());
                        assert!(sum_sq.is_infinite() == stats.grad_norm.is_infinite());
                        assert_eq!(w.m.global_step(), 1, "a skipped step is a step of the job");
                        next_step_trains_at(&mut w, 1);
                    }
                    (p, r) => panic!("{p:?}: {r:?}"),
                }
            }
        }
    }

    /// A trainer's report of a non-finite gradient (or loss): the attempt is discarded at every
    /// owner (what other trainers pushed of it too), then the step fails or is skipped with the
    /// error named by the report's trainer and micro-batch and the global step.
    #[test]
    fn a_non_finite_micro_batch_discards_the_step_then_fails_or_skips_it() {
        for policy in [NonFinite::Error, NonFinite::SkipStep] {
            let cfg = StepConfig {
                non_finite: policy,
                schedule: warmup(),
                ..config()
            };
            let mut w = World::new(cfg, &[1.0, 1.0]);
            let ds = w.m.start(samples(4, 100), w.now);
            w.apply(ds);
            let Some((a, since, end)) = w.running[1].take() else {
                panic!("trainer 1 runs a micro-batch");
            };
            let indices: Vec<u64> = a.micro_batch.samples.iter().map(|s| s.index).collect();
            let mut report = ok_report(1, &a, since, end);
            report.result = Err(Error::NonFinite(Box::new(NonFiniteAt {
                what: "gradient".into(),
                step: 0,
                // The report's own trainer and micro-batch are what count.
                trainer: Some(7),
                micro_batch: None,
                samples: indices.clone(),
                unit: Some(2),
                element: Some(5),
                value: "NaN".into(),
            })));
            w.now = end;
            let ds = w.m.on_report(report, end);
            let reason = Reason::NonFiniteMicroBatch {
                slot: 1,
                micro_batch: a.micro_batch.id,
                policy,
            };
            assert_eq!(names(&ds), ["discard"], "{policy:?}");
            assert_eq!(ds[0].reason, reason);
            w.apply(ds);
            let result = w.finish().expect("finishes");
            assert!(!w.log.iter().any(|d| d.command.name() == "apply"));
            assert_eq!(w.log.last().map(|d| &d.reason), Some(&reason));
            let want = Error::NonFinite(Box::new(NonFiniteAt {
                what: "gradient".into(),
                step: 0,
                trainer: Some(1),
                micro_batch: Some(a.micro_batch.id),
                samples: indices,
                unit: Some(2),
                element: Some(5),
                value: "NaN".into(),
            }));
            match (policy, result) {
                (NonFinite::Error, Err(e)) => {
                    assert_eq!(e, want);
                    next_step_trains_at(&mut w, 0);
                }
                (NonFinite::SkipStep, Ok(stats)) => {
                    assert_eq!(stats.skipped, Some(want));
                    assert!(stats.grad_norm.is_nan(), "no norm: no barrier");
                    next_step_trains_at(&mut w, 1);
                }
                (p, r) => panic!("{p:?}: {r:?}"),
            }
        }
    }

    #[test]
    fn deadline_on_tick_fails_the_step_kills_the_hung_trainer_and_the_next_step_works() {
        let cfg = StepConfig {
            micro_batch_timeout: Duration::from_millis(500),
            ..config()
        };
        let mut w = World::new(cfg, &[1000.0, 1000.0]);
        assert_eq!(w.m.tick_period(), Duration::from_millis(50));
        w.hung[0] = true;
        let ds = w.m.start(samples(4, 100), w.now);
        w.apply(ds);
        let hung_mb = w.running[0].as_ref().map(|r| r.0.micro_batch.id).unwrap();
        while w.event() {}
        assert!(w.finished.is_none(), "the step waits for the hung trainer");
        assert!(w.m.on_tick(ms(400)).is_empty(), "not yet past the deadline");
        w.now = ms(501);
        let ds = w.m.on_tick(w.now);
        assert_eq!(names(&ds), ["discard", "kill", "respawn"]);
        let reason = Reason::MicroBatchDeadline {
            slot: 0,
            micro_batch: hung_mb,
            after: Duration::from_millis(501),
        };
        assert!(ds.iter().all(|d| d.reason == reason), "{ds:?}");
        w.hung[0] = false;
        w.apply(ds);
        let err = w.finish().expect("finishes").expect_err("deadline");
        match err {
            Error::Deadline {
                what,
                step: 0,
                trainer: Some(0),
                micro_batch: Some(mb),
                after_ms: 501,
            } if what == "micro-batch" && mb == hung_mb => {}
            other => panic!("{other:?}"),
        }
        assert!(w.event(), "the respawned trainer starts");
        let stats = w
            .step(samples(4, 100))
            .expect("finishes")
            .expect("next step works");
        assert_eq!(stats.step, 0, "the failed step did not advance the version");
        assert!(stats.micro_batch_log.iter().any(|r| r.trainer == 0));
    }

    #[test]
    fn a_trainer_hung_in_a_discarded_attempt_is_killed_too() {
        let cfg = StepConfig {
            micro_batch_timeout: Duration::from_millis(500),
            failure: FailurePolicy::Drop,
            ..config()
        };
        let mut m = StepMachine::new(cfg, 2, key());
        m.start(samples(2, 100), ms(0));
        // Trainer 1 fails; trainer 0 never reports its epoch-0 micro-batch.
        assert_eq!(
            names(&m.on_trainer_lost(1, "gone".into(), ms(1))),
            ["discard"]
        );
        assert!(
            m.on_discarded(Ok(()), ms(2)).is_empty(),
            "slot 0 is still busy"
        );
        let ds = m.on_tick(ms(600));
        // Not the current attempt: no deadline error, but the trainer is killed and, being
        // the last one, the replay is re-planned without it.
        assert_eq!(names(&ds), ["kill", "discard"]);
        let ds = m.on_discarded(Ok(()), ms(601));
        assert!(matches!(
            ds[0].command,
            Command::Finish(Err(Error::NoTrainers { .. }))
        ));
    }

    #[test]
    fn server_lost_stops_naming_the_server() {
        let mut m = StepMachine::new(config(), 2, key());
        m.start(samples(2, 100), ms(0));
        let ds = m.on_server_lost(2, "panicked".into(), ms(1));
        assert_eq!(names(&ds), ["finish", "stop"]);
        let named =
            |e: &Error| matches!(e, Error::Actor { actor, .. } if actor == "shard server 2");
        assert!(matches!(&ds[0].command, Command::Finish(Err(e)) if named(e)));
        assert!(matches!(&ds[1].command, Command::Stop(e) if named(e)));
        assert_eq!(
            ds[1].reason,
            Reason::ServerLost {
                endpoint: 2,
                reason: "panicked".into()
            }
        );
        assert!(matches!(
            &m.start(samples(2, 100), ms(2))[..],
            [Decision {
                command: Command::Reject(_),
                ..
            }]
        ));
        assert!(m.on_tick(ms(10_000_000)).is_empty());
        // Without a step: only the stop.
        let mut idle = StepMachine::new(config(), 1, key());
        assert_eq!(names(&idle.on_server_lost(0, "x".into(), ms(0))), ["stop"]);
    }

    #[test]
    fn server_call_failures_fail_the_step() {
        let mut w = World::new(config(), &[1.0]);
        let ds = w.m.start(samples(1, 100), w.now);
        w.apply(ds);
        assert!(w.event());
        let e = Error::Actor {
            actor: "shard server 0 reduce".into(),
            reason: "timeout".into(),
        };
        let ds = w.m.on_reduced(Err(e), w.now);
        assert_eq!(ds[0].reason, Reason::ServerCallFailed { call: "reduce" });
        assert!(!w.m.is_running());
        // Stale outcomes change nothing.
        assert!(w.m.on_applied(Ok(()), w.now).is_empty());
        assert!(w.m.on_discarded(Ok(()), w.now).is_empty());
    }

    #[test]
    fn ledger_refusal_of_a_double_queued_micro_batch_fails_the_step_instead_of_dropping_it() {
        let mut w = World::new(config(), &[1.0, 1.0]);
        let ds = w.m.start(samples(4, 100), w.now);
        let first = assigned(&ds);
        w.apply(ds);
        // Micro-batch of trainer 0 queued again at the front of trainer 1's list.
        w.m.double_queue(1, first[0].1.micro_batch.id as usize);
        let result = w.finish().expect("the step finishes");
        match result {
            Err(Error::Ledger {
                step: 0,
                source: LedgerError::NotPending { trainer: 1, .. },
            }) => {}
            other => panic!("{other:?}"),
        }
        assert!(w
            .log
            .iter()
            .any(|d| matches!(d.reason, Reason::LedgerRefused { .. })));
        // The machine is consistent again: the next step works.
        assert!(w.step(samples(4, 100)).expect("finishes").is_ok());
    }

    #[test]
    fn ledger_refusal_of_the_only_copy_fails_the_step_instead_of_hanging() {
        // The old supervisor logged a refused hand-out and dropped the micro-batch: the ledger
        // then never completes and the step hangs. The machine fails it with a typed error.
        let mut w = World::new(config(), &[1.0, 1.0]);
        let ds = w.m.start(samples(4, 100), w.now);
        w.apply(ds);
        let queued = w.m.run.as_ref().and_then(|r| r.attempt.queue.own(0).next());
        let queued = queued.expect("trainer 0 has a second micro-batch");
        w.m.corrupt_ledger(queued, 7);
        let result = w.finish().expect("the step finishes, it does not stall");
        assert!(
            matches!(result, Err(Error::Ledger { step: 0, .. })),
            "{result:?}"
        );
        // It was put back, not dropped.
        assert!(w.m.run.is_none());
    }

    #[test]
    fn dynamic_dispatch_steals_from_a_slow_trainer_and_not_between_equals() {
        let dynamic = StepConfig {
            dispatch: DispatchMode::Dynamic,
            token_budget: 65_536,
            ..config()
        };
        let cost = |stats: &StepStats, t: u32| -> f64 {
            stats
                .micro_batch_log
                .iter()
                .filter(|r| r.trainer == t)
                .map(|r| r.cost)
                .sum()
        };
        let mut equal = World::new(dynamic, &[1.0; 4]);
        let stats = equal
            .step(samples(32, 1_000))
            .expect("finishes")
            .expect("ok");
        assert!(!equal
            .log
            .iter()
            .any(|d| matches!(d.reason, Reason::Stolen { .. })));
        let per: Vec<f64> = (0..4).map(|t| cost(&stats, t)).collect();
        assert!(per.iter().all(|&c| (c - per[0]).abs() < 1e-9), "{per:?}");

        let mut slow = World::new(dynamic, &[0.25, 1.0, 1.0, 1.0]);
        let stats = slow
            .step(samples(32, 1_000))
            .expect("finishes")
            .expect("ok");
        let stolen_from_0 = slow
            .log
            .iter()
            .any(|d| matches!(d.reason, Reason::Stolen { from: 0, .. }));
        assert!(stolen_from_0);
        let others = (1..4).map(|t| cost(&stats, t)).sum::<f64>() / 3.0;
        assert!(
            cost(&stats, 0) < 0.6 * others,
            "{} vs {others}",
            cost(&stats, 0)
        );
    }

    #[test]
    fn dynamic_dispatch_fills_micro_batches_to_the_floor_and_still_steals() {
        // 8 samples of 100 tokens per trainer: guided packing halves down to single samples
        // (4, 2, 1, 1); a floor of half the 1,000-token budget keeps 5 together, then the rest.
        let guided = StepConfig {
            dispatch: DispatchMode::Dynamic,
            token_budget: 1_000,
            ..config()
        };
        let filled = StepConfig {
            min_fill: 0.5,
            ..guided
        };
        let run = |c: StepConfig, speeds: &[f64]| {
            let mut w = World::new(c, speeds);
            let stats = w.step(samples(16, 100)).expect("finishes").expect("ok");
            let stolen = w
                .log
                .iter()
                .any(|d| matches!(d.reason, Reason::Stolen { .. }));
            (stats, stolen)
        };
        let (plain, _) = run(guided, &[1.0, 1.0]);
        let (full, _) = run(filled, &[1.0, 1.0]);
        assert_eq!(plain.micro_batches, 8);
        assert_eq!(full.micro_batches, 4);
        assert_eq!(full.samples, 16);
        assert!(full
            .micro_batch_log
            .iter()
            .all(|r| r.tokens >= 500 || r.tokens == 300));
        // A slow trainer still loses its last micro-batch to the other.
        let (_, stolen) = run(filled, &[0.2, 1.0]);
        assert!(stolen);
    }
}

#[cfg(test)]
#[path = "step_reports_test.rs"]
mod reports_test;
