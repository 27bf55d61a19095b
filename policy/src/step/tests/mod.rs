//! The step machine's tests, by topic; the helpers and the simulated [`World`] they share. The
//! machines under test fail with [`TestError`], a runtime's error in miniature.

use std::collections::VecDeque;

use super::config::StepConfig;
use super::error::{Failure, StepError};
use crate::assignment::Assignment;
use crate::assignment::MicroBatchDone;
use crate::balancer::CostModel;
use crate::batch::ComputeOutput;
use crate::batch::{MicroBatch, SampleMeta};
use crate::clock::Timestamp;
use crate::dispatch::DispatchMode;
use crate::error::NonFiniteAt;
use crate::relay::{Combined, RelayPlan};
use crate::stats::MicroBatchStats;
use crate::stats::StepStats;
use crate::token::JobKey;
use std::time::Duration;

/// The runtime's error as the machine sees it: its own decisions, a trainer's failure, and a
/// failed micro-batch wrapping either (as `odc_actors::Error` does).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
enum TestError {
    #[error(transparent)]
    Step(#[from] StepError),
    /// A trainer's compute failed.
    #[error("user compute: {0}")]
    User(String),
    #[error("micro-batch {micro_batch} of step {step} failed on trainer {trainer}: {source}")]
    MicroBatch {
        step: u64,
        micro_batch: u32,
        trainer: u32,
        source: Box<TestError>,
    },
}

impl Failure for TestError {
    fn non_finite(&self) -> Option<&NonFiniteAt> {
        match self {
            TestError::Step(e) => e.non_finite(),
            _ => None,
        }
    }

    fn in_micro_batch(self, step: u64, micro_batch: u32, trainer: u32) -> Self {
        TestError::MicroBatch {
            step,
            micro_batch,
            trainer,
            source: Box::new(self),
        }
    }
}

impl TestError {
    fn non_finite_at(at: NonFiniteAt) -> Self {
        TestError::Step(StepError::NonFinite(Box::new(at)))
    }
}

type StepMachine = super::StepMachine<TestError>;
type Decision = super::Decision<TestError>;
type Command = super::Command<TestError>;
type TrainerReport = crate::assignment::TrainerReport<TestError>;

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

fn ok_report(slot: u32, a: &Assignment, started: Timestamp, finished: Timestamp) -> TrainerReport {
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

/// What a test does to the relays' honest answer to one flush.
type Tamper = fn(&mut Vec<Combined>);

enum Pending {
    /// The relays of this epoch flushed.
    Flushed(u64),
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
    finished: Option<Result<StepStats, TestError>>,
    stopped: bool,
    /// Relayed pushes: where trainers and servers sit, every (epoch, micro-batch, slot) reported
    /// done, and what the next flushes do to the relays' honest answers.
    relay: Option<RelayPlan>,
    done: Vec<(u64, u32, u32)>,
    tamper: VecDeque<Tamper>,
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
            relay: None,
            done: Vec::new(),
            tamper: VecDeque::new(),
        }
    }

    /// The same world with pushes relayed as `plan` places trainers and servers.
    fn relayed(mut self, plan: RelayPlan) -> Self {
        self.m = self.m.clone().with_relay(Some(plan.clone()));
        self.relay = Some(plan);
        self
    }

    /// What every relay of the plan combined in `epoch`, as honest servers answer: one entry
    /// per relay (unit 0), holding every micro-batch its node's trainers reported done.
    fn combined(&self, epoch: u64) -> Vec<Combined> {
        let Some(plan) = &self.relay else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for server in 0..plan.server_nodes.len() as u32 {
            let node = plan.server_nodes[server as usize];
            for owner in plan.relays_of(server) {
                let mut micro_batches: Vec<u32> = self
                    .done
                    .iter()
                    .filter(|&&(e, _, slot)| e == epoch && plan.trainer_node(slot) == Some(node))
                    .map(|&(_, mb, _)| mb)
                    .collect();
                micro_batches.sort_unstable();
                out.push(Combined {
                    server,
                    unit: 0,
                    owner,
                    micro_batches,
                    early: false,
                });
            }
        }
        out
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
                Command::Flush { epoch, .. } => self.pending.push_back(Pending::Flushed(*epoch)),
                Command::Reduce { .. } => self.pending.push_back(Pending::Reduced),
                Command::Apply { .. } => self.pending.push_back(Pending::Applied),
                Command::Discard { .. } => self.pending.push_back(Pending::Discarded),
                Command::Respawn { slot } => self.pending.push_back(Pending::Started(*slot)),
                Command::Kill { slot } => self.running[*slot as usize] = None,
                Command::Finish(r) => self.finished = Some(r.clone()),
                Command::Reject(_) | Command::Ignore | Command::ExpectRelays { .. } => {}
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
                Pending::Flushed(epoch) => {
                    let mut combined = self.combined(epoch);
                    if let Some(tamper) = self.tamper.pop_front() {
                        tamper(&mut combined);
                    }
                    self.m.on_flushed(Ok(combined), now)
                }
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
        self.done.push((a.epoch, a.micro_batch.id, slot as u32));
        let ds = self
            .m
            .on_report(ok_report(slot as u32, &a, since, end), end);
        self.apply(ds);
        true
    }

    /// Run until the step finishes: its result, or `None` if it stalled.
    fn finish(&mut self) -> Option<Result<StepStats, TestError>> {
        while self.finished.is_none() && !self.stopped {
            if !self.event() {
                break;
            }
        }
        self.finished.take()
    }

    fn step(&mut self, samples: Vec<SampleMeta>) -> Option<Result<StepStats, TestError>> {
        self.log.clear();
        let ds = self.m.start(samples, self.now);
        self.apply(ds);
        self.finish()
    }
}

mod barrier;
mod deadlines;
mod dispatch;
mod failures;
mod non_finite;
mod relay;
mod reports;
mod split;
