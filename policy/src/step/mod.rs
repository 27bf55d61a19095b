//! The supervisor's decisions as a pure state machine (torchft's `quorum_compute`, Psyche's
//! coordinator): events in, each with an injected `now`; [`Decision`]s out, each a [`Command`]
//! with the [`Reason`] it was taken for. The supervisor actor only translates: it feeds messages
//! in as events, executes the commands and feeds their outcomes back (`Reduce` → every server
//! reduces → [`StepMachine::on_reduced`]).
//!
//! The machine is generic over the runtime's error `E` ([`Failure`]; `odc_actors::Error` in the
//! runtime): reports and server outcomes carry it in, [`Command::Finish`] carries it out
//! unchanged, and what the machine decides itself is a [`StepError`] made into an `E`.
//!
//! The files follow the events, each importing what it uses by name: `machine.rs` (the state,
//! [`StepMachine`]), `start.rs` (a minibatch arrives), `report.rs` (a trainer reports),
//! `trainers.rs` (a trainer is lost or started), `barrier.rs` (the servers flushed, reduced,
//! applied or discarded), `tick.rs` (time passes, a server is lost) and `outcome.rs` (the moves
//! they share: fail, discard, replay, finish); beside them `planning.rs` (plan and dispatch),
//! `run.rs` (a running step's state), `decision.rs`, `config.rs` and `error.rs`.
//!
//! ## One step
//! `start` plans the minibatch for the live trainers and assigns every idle trainer its first
//! micro-batch. Phases: **Computing** → (ledger complete) [**Flushing** →] **Reducing** →
//! **Applying** → `Finish`.
//! - *Computing*: each admitted report (see below) goes into the ledger and the reporting trainer
//!   gets its next micro-batch: the front of its own list, or (dynamic dispatch) a steal
//!   ([`WorkQueue::steal`](crate::dispatch::WorkQueue::steal)).
//! - *Flushing* (relayed pushes only, [`crate::relay`]): `Flush { epoch, next_epoch }`; the
//!   servers reply what each relay combined ([`Combined`](crate::relay::Combined)). Checked against
//!   the ledger ([`RelayPlan::check_combined`](crate::relay::RelayPlan::check_combined)): agreeing,
//!   `Reduce`; disagreeing (a relayed gradient lost, doubled or from the wrong node), `Discard` and
//!   replay, as for a lost trainer.
//! - *Reducing*: `Reduce { scale = 1 / total weight, next_epoch }`; the servers reply the sum of
//!   squares of the scaled gradient; the norm gives the clip factor.
//! - *Applying*: `Apply { clip, version }`; when every server applied, `Finish(Ok(stats))`.
//!
//! ## Non-finite gradients and losses
//! A non-finite gradient never reaches a parameter. Two places find one: a trainer (every
//! gradient is checked while it is encoded for its push, every loss when the compute returns;
//! the report's error is a non-finite one ([`Failure::non_finite`]) naming trainer, micro-batch,
//! samples and unit), and the barrier (the servers' sum of squares is NaN or inf, e.g. finite
//! gradients whose sum overflowed in an fp32 accumulator). Either way the attempt is `Discard`ed at
//! every owner (no `Apply`: parameters, optimizer moments and the optimizer's step count stay as
//! they were), then per [`StepConfig::non_finite`]:
//! - [`NonFinite::Error`]: `Finish(Err(StepError::NonFinite))` (as an `E`); the job's step counter
//!   does not move, the next step trains at the same global step.
//! - [`NonFinite::SkipStep`] (PyTorch's GradScaler skipping `optimizer.step()`):
//!   `Finish(Ok(stats))` with [`StepStats::skipped`](crate::stats::StepStats::skipped) naming where
//!   ([`NonFiniteAt`](crate::error::NonFiniteAt)). A skipped step counts as a step of the job: the
//!   global step ([`StepMachine::global_step`]), hence the learning-rate schedule's position and
//!   the job's data position, move on, as with `scheduler.step()` called every iteration; the
//!   parameter version and the optimizer's step count do not.
//!
//! ## Failures (the recovery rules are [`crate::recovery`]'s)
//! - A trainer lost while *Computing*: `Discard` (every owner drops the attempt and moves to a new
//!   epoch), then re-plan for the live trainers and replay the whole minibatch; after
//!   `max_replays` replays, `TooManyReplays`. The trainer is respawned (`FailurePolicy::Respawn`,
//!   at most `max_respawns` per slot) or dropped. Lost while *Flushing* / *Reducing* /
//!   *Applying*: only respawned, every gradient of the step already landed (in a relay, if not
//!   at its owner).
//! - A micro-batch returning an error: `Discard`, then `Finish(Err(e))` with the report's error
//!   `e` wrapped by [`Failure::in_micro_batch`] (`odc_actors::Error::MicroBatch`; a non-finite
//!   one: see above).
//! - A micro-batch running past `micro_batch_timeout` (seen on a tick): `Discard`, the hung
//!   trainer `Kill`ed (and respawned per policy), then `Finish(Err(StepError::Deadline))`.
//! - A shard server lost: `Finish(Err(StepError::Actor))` naming it and `Stop`.
//! - A server call failing: `Finish(Err)` with its error.
//! - The ledger refusing a hand-out or a completion: the micro-batch is put back (never dropped),
//!   `Discard`, then `Finish(Err(StepError::Ledger))`. Only the machine's own inconsistency can
//!   cause this (a micro-batch queued twice, a ledger out of step with the slots): a peer's report
//!   never reaches the ledger unless it was admitted.
//!
//! ## Reports are bound to assignments
//! Every [`Assignment`](crate::assignment::Assignment) carries the token of its (epoch,
//! micro-batch) under the job key ([`crate::token`]). A report is **admitted** only if its token is
//! that one and its trainer is the slot running exactly that micro-batch of that epoch. Anything
//! else is dropped with `Ignore` and a [`Reason::ReportRefused`] naming why ([`ReportRefusal`]): an
//! unknown trainer, a wrong token (a forgery, an unknown micro-batch, another epoch), a right token
//! in another trainer's name or from a slot no longer running it, or a duplicate of a report
//! already counted. A dropped report changes nothing: no slot becomes idle, nothing reaches the
//! ledger, no step fails, nothing is dispatched. These are the only refusals a peer can cause; they
//! never fail a step.
//!
//! ## Invariants (tested in `step/tests/` and in the workspace's `tests/runtime`)
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
//!   machine waits for its outcome in the `Discarding`, `Flushing`, `Reducing` or `Applying` phase.
//!
//! ```
//! use odc_policy::batch::SampleMeta;
//! use odc_policy::clock::Timestamp;
//! use odc_policy::step::{Command, StepConfig, StepError, StepMachine};
//! use odc_policy::token::JobKey;
//! // The supervisor draws the key at random; the machine draws nothing. Its errors here are
//! // its own (the runtime's are `odc_actors::Error`).
//! let key = JobKey::from_bytes([9; 32]);
//! let mut m = StepMachine::<StepError>::new(StepConfig::default(), 2, key);
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

mod barrier;
mod config;
mod decision;
mod error;
mod machine;
mod outcome;
mod planning;
mod report;
mod run;
mod start;
#[cfg(test)]
mod tests;
mod tick;
mod trainers;

pub use config::{NonFinite, StepConfig, DEFAULT_MICRO_BATCH_TIMEOUT};
pub use decision::{Command, Decision, Reason, ReportRefusal};
pub use error::{Failure, StepError};
pub use machine::StepMachine;
