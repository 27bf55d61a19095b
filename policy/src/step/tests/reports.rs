//! Property test of the step machine's report admission (`step/mod.rs`, "Reports are bound to
//! assignments"): forged, duplicated and reordered reports never change the parameters of a step.
//! At the level of the pure machine that means: nothing happens before every genuine report is
//! in (no `Reduce`, no failure, nothing in the ledger but genuine reports), and what happens then
//! is what the genuine reports alone decide (one `Reduce` with the minibatch's scale, stats that
//! count each micro-batch once with its genuine loss).

use proptest::collection::vec;
use proptest::prelude::*;

use super::super::decision::{Reason, ReportRefusal};
use super::*;
use crate::assignment::MicroBatchDone;
use crate::batch::ComputeOutput;
use crate::stats::MicroBatchStats;

fn key() -> JobKey {
    JobKey::from_bytes([0x5a; JobKey::LEN])
}

fn ms(n: u64) -> Timestamp {
    Timestamp::from_nanos(n * 1_000_000)
}

/// A report of `micro_batch` of `epoch` in `trainer`'s name: `Ok` with `loss_sum`, or an error.
fn report(
    trainer: u32,
    epoch: u64,
    micro_batch: u32,
    token: u128,
    loss_sum: f64,
    failed: bool,
) -> TrainerReport {
    TrainerReport {
        trainer,
        epoch,
        micro_batch,
        token,
        started: ms(0),
        finished: ms(1),
        result: if failed {
            Err(TestError::User("forged failure".into()))
        } else {
            Ok(MicroBatchDone {
                output: ComputeOutput { loss_sum },
                stats: MicroBatchStats::default(),
            })
        },
    }
}

/// What the forger sends (or, for `Genuine`, the trainer that finished).
#[derive(Debug, Clone, Copy)]
enum Event {
    Genuine,
    WrongToken,
    WrongTrainer,
    UnknownMicroBatch,
    OtherEpoch,
    UnknownTrainer,
    Duplicate,
}

fn event(code: u8) -> Event {
    match code % 8 {
        0 | 1 => Event::Genuine,
        2 => Event::WrongToken,
        3 => Event::WrongTrainer,
        4 => Event::UnknownMicroBatch,
        5 => Event::OtherEpoch,
        6 => Event::UnknownTrainer,
        _ => Event::Duplicate,
    }
}

/// The loss every forged `Ok` report claims: counted even once, it would show in the step's loss.
const FORGED_LOSS: f64 = 1.0e6;

/// The machine and what the test knows: assignments handed out, genuine reports delivered.
struct Run {
    m: StepMachine,
    trainers: u32,
    now: u64,
    /// Per slot: the assignment it is computing.
    running: Vec<Option<Assignment>>,
    /// Every assignment handed out, with its slot.
    assigned: Vec<(u32, Assignment)>,
    /// Genuine reports delivered (each may be sent again as a duplicate).
    delivered: Vec<TrainerReport>,
    reduces: Vec<(f64, usize)>,
    finished: Option<Result<StepStats, TestError>>,
}

impl Run {
    /// Record the decisions of a genuine event; anything but assignments, a reduce and the final
    /// apply/finish is a failure of the property.
    fn absorb(&mut self, ds: Vec<Decision>) -> Result<(), TestCaseError> {
        for d in ds {
            match d.command {
                Command::Assign { slot, assignment } => {
                    let s = slot as usize;
                    prop_assert!(self.running[s].is_none(), "slot {s} got two assignments");
                    prop_assert_eq!(
                        assignment.token,
                        key().token(assignment.epoch, assignment.micro_batch.id)
                    );
                    self.running[s] = Some(assignment.clone());
                    self.assigned.push((slot, assignment));
                }
                Command::Reduce { scale, .. } => self.reduces.push((scale, self.delivered.len())),
                Command::Apply { .. } => {}
                Command::Finish(result) => self.finished = Some(result),
                other => {
                    return Err(TestCaseError::fail(format!(
                        "unexpected {} ({})",
                        other.name(),
                        d.reason
                    )))
                }
            }
        }
        Ok(())
    }

    /// Send a forged report of kind `kind` (x, y pick its details); it must be dropped with
    /// exactly one `Ignore` for the expected reason (a duplicate before any genuine report is
    /// skipped).
    fn forge(&mut self, kind: Event, x: u32, y: u64, failed: bool) -> Result<(), TestCaseError> {
        let (slot, base) = self.assigned[x as usize % self.assigned.len()].clone();
        let mb = base.micro_batch.id;
        let (forged, why) = match kind {
            Event::Genuine => return Ok(()),
            Event::WrongToken => {
                let token = base.token ^ u128::from(y | 1);
                let r = report(slot, base.epoch, mb, token, FORGED_LOSS, failed);
                (r, ReportRefusal::WrongToken)
            }
            Event::WrongTrainer if self.trainers > 1 => {
                let other = (slot + 1 + x % (self.trainers - 1)) % self.trainers;
                let r = report(other, base.epoch, mb, base.token, FORGED_LOSS, failed);
                (r, ReportRefusal::NotRunning)
            }
            Event::WrongTrainer | Event::UnknownTrainer => {
                let r = report(
                    self.trainers + x % 7,
                    base.epoch,
                    mb,
                    base.token,
                    FORGED_LOSS,
                    failed,
                );
                (r, ReportRefusal::UnknownTrainer)
            }
            Event::UnknownMicroBatch => {
                // Past the plan; with a guessed token, or (a forger holding the key) the valid one.
                let plan = self.assigned.iter().map(|(_, a)| a.micro_batch.id).max();
                let unknown = plan.unwrap_or(0) + 1 + x % 5;
                let epoch = self.m.epoch();
                if failed {
                    let token = key().token(epoch, unknown);
                    let r = report(slot, epoch, unknown, token, FORGED_LOSS, false);
                    (r, ReportRefusal::NotRunning)
                } else {
                    let r = report(slot, epoch, unknown, u128::from(y), FORGED_LOSS, false);
                    (r, ReportRefusal::WrongToken)
                }
            }
            Event::OtherEpoch => {
                // A token that is valid, but for another epoch than the one the trainer runs.
                let epoch = base.epoch + 1 + u64::from(x % 3);
                let token = key().token(epoch, mb);
                let r = report(slot, epoch, mb, token, FORGED_LOSS, failed);
                (r, ReportRefusal::NotRunning)
            }
            Event::Duplicate => {
                let Some(genuine) = self.delivered.get(x as usize % self.delivered.len().max(1))
                else {
                    return Ok(());
                };
                let duplicate = self.m.run.as_ref().is_some();
                let why = if duplicate {
                    ReportRefusal::Duplicate
                } else {
                    ReportRefusal::NotRunning
                };
                (genuine.clone(), why)
            }
        };
        let done_before = self.ledger_done();
        self.now += 1;
        let ds = self.m.on_report(forged.clone(), ms(self.now));
        prop_assert_eq!(ds.len(), 1, "{:?}: {:?}", forged, ds);
        prop_assert!(matches!(ds[0].command, Command::Ignore));
        prop_assert_eq!(
            &ds[0].reason,
            &Reason::ReportRefused {
                trainer: forged.trainer,
                micro_batch: forged.micro_batch,
                epoch: forged.epoch,
                why,
            }
        );
        prop_assert_eq!(
            self.ledger_done(),
            done_before,
            "a dropped report reached the ledger"
        );
        Ok(())
    }

    /// The genuine report of the slot `x` picks among the running ones.
    fn deliver(&mut self, x: u32) -> Result<(), TestCaseError> {
        let busy: Vec<usize> = (0..self.running.len())
            .filter(|&s| self.running[s].is_some())
            .collect();
        let Some(&slot) = busy.get(x as usize % busy.len().max(1)) else {
            return Ok(());
        };
        let Some(a) = self.running[slot].take() else {
            return Ok(());
        };
        self.now += 1;
        let genuine = report(
            slot as u32,
            a.epoch,
            a.micro_batch.id,
            a.token,
            a.micro_batch.tokens as f64,
            false,
        );
        self.delivered.push(genuine.clone());
        let ds = self.m.on_report(genuine, ms(self.now));
        self.absorb(ds)
    }

    /// Micro-batches the running attempt's ledger counts.
    fn ledger_done(&self) -> usize {
        self.m.run.as_ref().map_or(0, |r| r.attempt.ledger.done())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// I2, reports bound to assignments: genuine reports delivered in any order among forged
    /// ones (wrong token, another trainer's name, an unknown micro-batch, another epoch, an
    /// unknown trainer; claiming success or failure) and duplicates. Every forgery is dropped
    /// with one `Ignore` naming why and never reaches the ledger; the step never fails; `Reduce`
    /// comes exactly once, with the last genuine report, with the minibatch's scale; forgeries
    /// after it change nothing; the finished step counts each micro-batch once, by the trainer it
    /// was assigned to, with the genuine losses only.
    #[test]
    fn reports_bound_to_assignments(
        trainers in 1u32..=4,
        n_samples in 1u64..=12,
        dynamic in any::<bool>(),
        script in vec((any::<u8>(), any::<u32>(), any::<u64>(), any::<bool>()), 0..160),
    ) {
        let config = StepConfig {
            dispatch: if dynamic { DispatchMode::Dynamic } else { DispatchMode::Static },
            cost: CostModel::linear(),
            token_budget: 100,
            ..StepConfig::default()
        };
        let samples: Vec<SampleMeta> = (0..n_samples).map(|i| SampleMeta::new(i, 100)).collect();
        let mut run = Run {
            m: StepMachine::new(config, trainers, key()),
            trainers,
            now: 0,
            running: vec![None; trainers as usize],
            assigned: Vec::new(),
            delivered: Vec::new(),
            reduces: Vec::new(),
            finished: None,
        };
        let ds = run.m.start(samples, ms(0));
        run.absorb(ds)?;
        let plan = run.m.run.as_ref().map_or(0, |r| r.attempt.micro_batches.len());
        prop_assert_eq!(plan as u64, n_samples, "one sample per micro-batch");
        for &(code, x, y, failed) in &script {
            match event(code) {
                Event::Genuine => run.deliver(x)?,
                kind => run.forge(kind, x, y, failed)?,
            }
            prop_assert_eq!(run.ledger_done(), run.delivered.len().min(plan));
        }
        // The rest of the genuine reports, in slot order.
        while run.running.iter().any(Option::is_some) {
            run.deliver(0)?;
        }
        prop_assert_eq!(run.delivered.len(), plan, "every micro-batch ran once");
        prop_assert_eq!(
            &run.reduces,
            &vec![(1.0 / (100.0 * n_samples as f64), plan)],
            "one reduce, with the last genuine report"
        );
        // Forgeries while the barrier runs change nothing either.
        for &(code, x, y, failed) in &script {
            run.forge(event(code), x, y, failed)?;
        }
        let ds = run.m.on_reduced(Ok(1.0), ms(run.now));
        run.absorb(ds)?;
        let ds = run.m.on_applied(Ok(()), ms(run.now));
        run.absorb(ds)?;
        prop_assert_eq!(run.reduces.len(), 1);
        let stats = match run.finished.take() {
            Some(Ok(stats)) => stats,
            other => return Err(TestCaseError::fail(format!("the step ended with {other:?}"))),
        };
        prop_assert_eq!(stats.micro_batches as usize, plan);
        prop_assert_eq!(stats.loss, 1.0, "genuine losses only (a forged one is {})", FORGED_LOSS);
        let mut counted: Vec<(u32, u32)> = stats
            .micro_batch_log
            .iter()
            .map(|r| (r.micro_batch, r.trainer))
            .collect();
        counted.sort_unstable();
        let mut want: Vec<(u32, u32)> =
            run.assigned.iter().map(|(s, a)| (a.micro_batch.id, *s)).collect();
        want.sort_unstable();
        prop_assert_eq!(counted, want, "each micro-batch once, by its trainer");
    }
}
