//! A compute driven from outside the runtime, one micro-batch at a time: the core of the trainer
//! API for a loop the runtime does not own (the Python package's `odc.init`, or any foreign
//! caller).
//!
//! The job's [`Compute`] on each trainer is a [`Driven`]: for each micro-batch it hands a
//! [`Turn`] to the [`Driver`] and then carries out the driver's requests against the trainer's
//! context (gather, push, release) until the driver finishes the turn with the micro-batch's
//! summed loss. The driver is any thread outside the async runtime (the Python thread, with the
//! GIL released while it waits); [`drive_step`] runs one step of a job while that thread drives it.
//!
//! Invariants (tested below):
//! - **Nothing waits forever** (I6): a turn not taken by the driver, a request not answered, a
//!   turn not finished, each ends at the job's micro-batch deadline with an error naming what was
//!   waited for; the driver's waits take their own deadline.
//! - **A turn dropped unfinished fails its micro-batch** with an error that names it, so the
//!   supervisor replays it (I2); a request on a turn whose micro-batch has ended is an error, not
//!   a hang.
//! - **The driver's values are the context's**: a gather returns the trainer's buffer itself
//!   (`Arc<[f32]>`, no copy), which stays valid as long as the driver holds it, after the turn
//!   and after the job.
//! - Pushes are acknowledged before the micro-batch counts, as for any [`Compute`].

use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use odc_actors::batch::{ComputeOutput, MicroBatch, SampleMeta};
use odc_actors::layout::UnitId;
use odc_actors::policy::stats::StepStats;
use odc_actors::trainer::{Compute, ComputeFactory, PushTicket, TrainerContext};
use odc_actors::{Error, Result};
use tokio::sync::mpsc;

use crate::Job;

/// What the driver asks of the trainer during a turn.
enum Request {
    Gather(UnitId, std_mpsc::Sender<Result<Arc<[f32]>>>),
    Push(UnitId, Vec<f32>, std_mpsc::Sender<Result<()>>),
    Release(UnitId, std_mpsc::Sender<Result<()>>),
    Finish(f64),
    Fail(String),
}

/// One micro-batch handed to the driver: what to compute, and the trainer to compute it against.
/// Dropping it unfinished fails the micro-batch.
pub struct Turn {
    /// The trainer whose micro-batch this is.
    pub trainer: u32,
    /// The micro-batch: its step (the parameters' version), id and samples.
    pub micro_batch: MicroBatch,
    requests: mpsc::UnboundedSender<Request>,
    wait: Duration,
}

impl Turn {
    fn ask<T>(
        &self,
        what: &str,
        make: impl FnOnce(std_mpsc::Sender<Result<T>>) -> Request,
    ) -> Result<T> {
        let (reply, answer) = std_mpsc::channel();
        self.requests
            .send(make(reply))
            .map_err(|_| self.ended(what))?;
        match answer.recv_timeout(self.wait) {
            Ok(result) => result,
            Err(std_mpsc::RecvTimeoutError::Timeout) => Err(Error::User {
                message: format!(
                    "{what} of micro-batch {} (step {}) not answered within {:?}",
                    self.micro_batch.id, self.micro_batch.step, self.wait
                ),
            }),
            Err(std_mpsc::RecvTimeoutError::Disconnected) => Err(self.ended(what)),
        }
    }

    fn ended(&self, what: &str) -> Error {
        Error::User {
            message: format!(
                "{what}: micro-batch {} of step {} has already ended (its deadline passed, or \
                 the step failed)",
                self.micro_batch.id, self.micro_batch.step
            ),
        }
    }

    /// The whole unit at this micro-batch's version: the trainer's buffer, not a copy.
    pub fn gather(&self, unit: UnitId) -> Result<Arc<[f32]>> {
        self.ask(&format!("gather of unit {unit}"), |r| {
            Request::Gather(unit, r)
        })
    }

    /// Sends `grad`, the gradient of the micro-batch's summed loss with respect to the whole
    /// unit; returns once the trainer has taken it (its acknowledgement is awaited at the end of
    /// the turn).
    pub fn push(&self, unit: UnitId, grad: Vec<f32>) -> Result<()> {
        self.ask(&format!("push to unit {unit}"), |r| {
            Request::Push(unit, grad, r)
        })
    }

    /// Drops the trainer's reference to a gathered unit (the driver's own stays valid).
    pub fn release(&self, unit: UnitId) -> Result<()> {
        self.ask(&format!("release of unit {unit}"), |r| {
            Request::Release(unit, r)
        })
    }

    /// Ends the turn: the micro-batch's summed loss (not its mean: the servers divide by the
    /// minibatch's total). The micro-batch counts once its pushes are acknowledged.
    pub fn finish(self, loss_sum: f64) -> Result<()> {
        let what = "finishing";
        self.requests
            .send(Request::Finish(loss_sum))
            .map_err(|_| self.ended(what))
    }

    /// Ends the turn with a failure of the driver's own (the micro-batch fails and is replayed
    /// or fails the step, as the job's failure policy says).
    pub fn fail(self, reason: impl Into<String>) {
        let _ = self.requests.send(Request::Fail(reason.into()));
    }
}

/// The driver's side: the turns of every trainer of this process, one at a time.
pub struct Driver {
    turns: Mutex<std_mpsc::Receiver<Turn>>,
}

impl Driver {
    /// The next turn, or `None` when none came within `wait`.
    pub fn next(&self, wait: Duration) -> Option<Turn> {
        let turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
        turns.recv_timeout(wait).ok()
    }
}

/// The trainers' side: makes a [`Driven`] compute for each trainer of the job.
#[derive(Clone)]
pub struct DrivenFactory {
    turns: std_mpsc::Sender<Turn>,
    wait: Duration,
}

impl ComputeFactory for DrivenFactory {
    fn create(&self, trainer: u32) -> Box<dyn Compute> {
        Box::new(Driven {
            trainer,
            turns: self.turns.clone(),
            wait: self.wait,
        })
    }
}

/// A driver and the compute factory it drives. `wait` bounds each of the driver's requests and
/// each of the trainer's waits for the driver (the job's micro-batch timeout is the outer bound).
pub fn driven(wait: Duration) -> (Driver, DrivenFactory) {
    let (turns, taken) = std_mpsc::channel();
    let driver = Driver {
        turns: Mutex::new(taken),
    };
    (driver, DrivenFactory { turns, wait })
}

/// A trainer's compute whose micro-batches the [`Driver`] computes.
pub struct Driven {
    trainer: u32,
    turns: std_mpsc::Sender<Turn>,
    wait: Duration,
}

#[async_trait::async_trait]
impl Compute for Driven {
    async fn run(&mut self, ctx: &mut TrainerContext, mb: &MicroBatch) -> Result<ComputeOutput> {
        let (requests, mut asked) = mpsc::unbounded_channel();
        let turn = Turn {
            trainer: self.trainer,
            micro_batch: mb.clone(),
            requests,
            wait: self.wait,
        };
        self.turns.send(turn).map_err(|_| Error::User {
            message: format!(
                "micro-batch {} of step {}: no driver (the runtime's driver was dropped)",
                mb.id, mb.step
            ),
        })?;
        let mut tickets: Vec<PushTicket> = Vec::new();
        loop {
            let request = tokio::time::timeout(self.wait, asked.recv()).await;
            match request {
                Err(_) => {
                    return Err(Error::User {
                        message: format!(
                            "micro-batch {} of step {}: the driver did not finish it within {:?}",
                            mb.id, mb.step, self.wait
                        ),
                    })
                }
                Ok(None) => {
                    return Err(Error::User {
                        message: format!(
                            "micro-batch {} of step {}: the driver dropped it without finishing it",
                            mb.id, mb.step
                        ),
                    })
                }
                Ok(Some(Request::Gather(unit, reply))) => {
                    let _ = reply.send(ctx.gather(unit).await);
                }
                Ok(Some(Request::Push(unit, grad, reply))) => {
                    let pushed = ctx.push_grad(unit, &grad).map(|t| tickets.push(t));
                    let _ = reply.send(pushed);
                }
                Ok(Some(Request::Release(unit, reply))) => {
                    let _ = reply.send(ctx.release(unit));
                }
                Ok(Some(Request::Fail(message))) => return Err(Error::User { message }),
                Ok(Some(Request::Finish(loss_sum))) => {
                    for ticket in tickets {
                        ticket.wait().await?;
                    }
                    return Ok(ComputeOutput { loss_sum });
                }
            }
        }
    }
}

/// Runs one step of `job` on `samples` on the job's own runtime (`runtime`) while this thread
/// drives its turns with `compute`, and returns the step's result. A turn `compute` returns an
/// error for fails its micro-batch with that error.
pub fn drive_step(
    runtime: &tokio::runtime::Handle,
    job: &mut Job,
    samples: Vec<SampleMeta>,
    driver: &Driver,
    mut compute: impl FnMut(&Turn) -> Result<f64>,
) -> Result<StepStats> {
    let (done, finished) = std_mpsc::channel();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            // Rank 0 feeds the samples; every other rank waits for rank 0's step.
            let step = async {
                match job.rank() {
                    0 => job.step_with(samples).await,
                    _ => job.step().await,
                }
            };
            let _ = done.send(runtime.block_on(step));
        });
        loop {
            match finished.try_recv() {
                Ok(result) => return result,
                Err(std_mpsc::TryRecvError::Disconnected) => {
                    return Err(Error::Internal(
                        "the step's thread ended without a result".into(),
                    ))
                }
                Err(std_mpsc::TryRecvError::Empty) => {}
            }
            let Some(turn) = driver.next(Duration::from_millis(5)) else {
                continue;
            };
            match compute(&turn) {
                Ok(loss_sum) => {
                    let _ = turn.finish(loss_sum);
                }
                Err(e) => turn.fail(e.to_string()),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{OptimizerConfig, Precision, UnitSpec};

    const UNIT: usize = 16;

    /// The README's example: one unit `w`, squared error per token of `w · x - 1`; the summed
    /// loss and the gradient of sample `s` against `w`.
    fn linear(w: &[f32], samples: &[SampleMeta]) -> (f64, Vec<f32>) {
        let (mut grad, mut loss) = (vec![0.0f32; w.len()], 0.0);
        for s in samples {
            let x: Vec<f32> = (0..w.len())
                .map(|i| ((s.index + i as u64) % 7) as f32)
                .collect();
            let err = w.iter().zip(&x).map(|(w, x)| w * x).sum::<f32>() - 1.0;
            loss += 0.5 * (err * err) as f64 * s.tokens as f64;
            for (g, x) in grad.iter_mut().zip(&x) {
                *g += err * x * s.tokens as f32;
            }
        }
        (loss, grad)
    }

    struct Native;

    #[async_trait::async_trait]
    impl Compute for Native {
        async fn run(
            &mut self,
            ctx: &mut TrainerContext,
            mb: &MicroBatch,
        ) -> Result<ComputeOutput> {
            let w = ctx.gather(0).await?;
            let (loss_sum, grad) = linear(&w, &mb.samples);
            ctx.push_grad(0, &grad)?;
            ctx.release(0)?;
            Ok(ComputeOutput { loss_sum })
        }
    }

    fn samples(step: u64) -> Vec<SampleMeta> {
        (0..12)
            .map(|i| SampleMeta::new(step * 12 + i, 1 + (i * 5) % 9))
            .collect()
    }

    fn builder(wait: Duration) -> crate::JobBuilder {
        Job::builder()
            .unit(UnitSpec::constant("w", UNIT, 0.0))
            .trainers(3)
            .servers(2)
            .optimizer(OptimizerConfig::sgd(0.001))
            .pull_precision(Precision::F32)
            .micro_batch_timeout(wait * 4)
            .step_timeout(wait * 20)
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime")
    }

    fn driven_compute(turn: &Turn) -> Result<f64> {
        let w = turn.gather(0)?;
        let (loss, grad) = linear(&w, &turn.micro_batch.samples);
        turn.push(0, grad)?;
        turn.release(0)?;
        Ok(loss)
    }

    #[test]
    fn a_driven_job_trains_as_the_same_compute_run_by_the_trainers() {
        let rt = runtime();
        let wait = Duration::from_secs(10);
        let mut native = rt
            .block_on(async {
                builder(wait)
                    .compute(|_| Box::new(Native) as Box<dyn Compute>)
                    .build()
            })
            .unwrap();
        let (driver, factory) = driven(wait);
        let mut job = rt
            .block_on(async { builder(wait).compute(factory).build() })
            .unwrap();
        for step in 0..3 {
            let want = rt.block_on(native.step_with(samples(step))).unwrap();
            let got = drive_step(
                rt.handle(),
                &mut job,
                samples(step),
                &driver,
                driven_compute,
            )
            .unwrap();
            // Equal but for the order the servers summed gradients in (fp32 reassociation).
            let (got, want) = (got.loss, want.loss);
            assert!(
                (got - want).abs() <= 1e-6 * want.abs(),
                "step {step}: {got} vs {want}"
            );
        }
        let want = rt.block_on(native.parameters()).unwrap();
        let got = rt.block_on(job.parameters()).unwrap();
        let diff = want[0]
            .iter()
            .zip(&got[0])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        // Only the order in which the servers sum gradients differs (fp32 reassociation).
        assert!(diff <= 1e-6, "max |Δ| = {diff}");
        assert!(
            got[0].iter().any(|&w| w.abs() > 1e-3),
            "the job did not train: {got:?}"
        );
        rt.block_on(native.shutdown());
        rt.block_on(job.shutdown());
    }

    #[test]
    fn a_gathered_unit_is_the_trainers_buffer_and_outlives_the_turn_and_the_job() {
        let rt = runtime();
        let wait = Duration::from_secs(10);
        let (driver, factory) = driven(wait);
        let mut job = rt
            .block_on(async { builder(wait).compute(factory).build() })
            .unwrap();
        let mut kept: Vec<Arc<[f32]>> = Vec::new();
        drive_step(rt.handle(), &mut job, samples(0), &driver, |turn| {
            let first = turn.gather(0)?;
            let again = turn.gather(0)?;
            assert!(
                Arc::ptr_eq(&first, &again),
                "a second gather copied the unit"
            );
            kept.push(first);
            driven_compute(turn)
        })
        .unwrap();
        rt.block_on(job.shutdown());
        drop(rt);
        assert!(!kept.is_empty());
        assert!(kept
            .iter()
            .all(|w| w.len() == UNIT && w.iter().all(|&v| v == 0.0)));
    }

    #[test]
    fn a_turn_failed_by_the_driver_fails_its_step_naming_why() {
        let rt = runtime();
        let wait = Duration::from_secs(10);
        let (driver, factory) = driven(wait);
        let mut job = rt
            .block_on(async { builder(wait).max_replays(1).compute(factory).build() })
            .unwrap();
        let e = drive_step(rt.handle(), &mut job, samples(0), &driver, |turn| {
            Err(Error::User {
                message: format!("bad batch {}", turn.micro_batch.id),
            })
        })
        .unwrap_err();
        assert!(e.to_string().contains("bad batch"), "{e}");
        rt.block_on(job.shutdown());
    }

    #[test]
    fn a_turn_nobody_takes_or_finishes_ends_at_its_deadline_and_later_requests_are_refused() {
        let rt = runtime();
        let wait = Duration::from_millis(300);
        let (driver, factory) = driven(wait);
        let mut job = rt
            .block_on(async { builder(wait).max_replays(0).compute(factory).build() })
            .unwrap();
        // Nobody drives: the step ends with the trainers' deadline, not a hang.
        let started = std::time::Instant::now();
        let e = rt.block_on(job.step_with(samples(0))).unwrap_err();
        assert!(started.elapsed() < wait * 20, "{:?}", started.elapsed());
        assert!(e.to_string().contains("did not finish it within"), "{e}");
        // A turn left over from that step: its requests name that its micro-batch has ended.
        let stale = driver
            .next(Duration::from_secs(1))
            .expect("the turns handed out");
        let e = stale.gather(0).unwrap_err();
        assert!(e.to_string().contains("has already ended"), "{e}");
        rt.block_on(job.shutdown());
    }
}
