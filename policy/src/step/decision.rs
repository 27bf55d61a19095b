//! What the machine decides: a [`Command`] with the [`Reason`] it was taken for, and why a report
//! was refused ([`ReportRefusal`]).

use std::time::Duration;

use crate::assignment::Assignment;
use crate::ledger::LedgerError;
use crate::relay::FlushMismatch;
use crate::stats::StepStats;

use super::config::NonFinite;

/// One decision: what to do and why (failing with `E`, the runtime's error).
#[derive(Debug, Clone)]
pub struct Decision<E> {
    pub command: Command<E>,
    pub reason: Reason,
}

/// What the actor executes. Outcomes come back as events (named on each variant).
#[derive(Debug, Clone)]
pub enum Command<E> {
    /// Send `assignment` to the trainer in `slot` (a failed send →
    /// [`StepMachine::on_trainer_lost`](super::StepMachine::on_trainer_lost)).
    Assign { slot: u32, assignment: Assignment },
    /// Every server: take the accumulators (moving to `next_epoch`), scale, reply the sum of
    /// squares → [`StepMachine::on_reduced`](super::StepMachine::on_reduced) with the sum over all
    /// servers.
    Reduce { scale: f64, next_epoch: u64 },
    /// Relayed pushes on demand, once each node's micro-batches are final (a static plan at
    /// once, a dynamic one when nothing is left to hand out): how many each node's trainers run
    /// in `epoch` (by node). Every server may then flush a relay as soon as all of its node's
    /// writes are in, while the step still runs; no outcome comes back (the barrier's `Flush`
    /// collects them).
    ExpectRelays { epoch: u64, per_node: Vec<u32> },
    /// Relayed pushes only ([`crate::relay`]), before `Reduce`: every server flushes its relays
    /// of `epoch` into their owners (moving them to `next_epoch`) and replies what each relay
    /// combined → [`StepMachine::on_flushed`](super::StepMachine::on_flushed) with every server's
    /// relays.
    Flush { epoch: u64, next_epoch: u64 },
    /// Every server: clip, optimizer step at `lr_scale` times the base learning rate, publish
    /// `version` → [`StepMachine::on_applied`](super::StepMachine::on_applied).
    Apply {
        clip: f64,
        lr_scale: f64,
        version: u64,
    },
    /// Every server: drop the attempt, move to `next_epoch`; the actor also aborts collectives
    /// below `next_epoch` → [`StepMachine::on_discarded`](super::StepMachine::on_discarded).
    Discard { next_epoch: u64 },
    /// Spawn a fresh trainer in `slot` →
    /// [`StepMachine::on_trainer_started`](super::StepMachine::on_trainer_started), or
    /// [`StepMachine::on_trainer_lost`](super::StepMachine::on_trainer_lost) if that fails.
    Respawn { slot: u32 },
    /// Kill the trainer in `slot` and forget it: the machine already counts it as lost (no
    /// `on_trainer_lost` follows for it).
    Kill { slot: u32 },
    /// Answer the running step's caller.
    Finish(Result<StepStats, E>),
    /// Answer the caller of [`StepMachine::start`](super::StepMachine::start) that its request was
    /// refused; a running step (if any) goes on.
    Reject(E),
    /// Stop the supervisor (after answering the running step, if any).
    Stop(E),
    /// Nothing to execute: the event was dropped (a refused report); the actor logs the reason
    /// once and counts it.
    Ignore,
}

impl<E> Command<E> {
    /// Short name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Assign { .. } => "assign",
            Command::Reduce { .. } => "reduce",
            Command::Flush { .. } => "flush",
            Command::ExpectRelays { .. } => "expect-relays",
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
    /// Each node's micro-batches of the attempt in `epoch` are final (relays may flush early).
    NodeCountsFinal { epoch: u64 },
    /// Every relay flushed into its owners, and what each combined agrees with the ledger.
    RelaysFlushed { relays: u32 },
    /// A relay's flush disagrees with the ledger ([`FlushMismatch`]): the attempt is discarded
    /// and replayed.
    RelayMismatch { mismatch: FlushMismatch },
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
            Reason::NodeCountsFinal { epoch } => {
                write!(f, "each node's micro-batches of epoch {epoch} are final")
            }
            Reason::RelaysFlushed { relays } => {
                write!(f, "{relays} relays flushed, each as the ledger counts")
            }
            Reason::RelayMismatch { mismatch } => {
                write!(f, "a relay's flush disagrees with the ledger: {mismatch}")
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

/// A decision of `command` for `reason`.
pub(super) fn decision<E>(command: Command<E>, reason: Reason) -> Decision<E> {
    Decision { command, reason }
}
