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
//! - **Device memory only where asked and reachable**: a factory given device memory
//!   ([`DrivenFactory::with_device_memory`]) makes its trainers gather into it and push from it
//!   when their data path reaches the device ([`Turn::on_device`] says so for each turn); a
//!   device push where the path cannot is an error naming it, never a host copy.
//! - **A step's end reaches the driver when it happens**: a wait for the step's next turn ends
//!   with the step, not at the wait's own length (a Python loop polling in 50 ms waits lost up to
//!   50 ms a step before).

use std::collections::VecDeque;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use odc_actors::batch::{ComputeOutput, MicroBatch, SampleMeta};
use odc_actors::layout::UnitId;
use odc_actors::policy::stats::StepStats;
use odc_actors::trainer::{
    Compute, ComputeFactory, DeviceGrad, DeviceMemory, PushTicket, TrainerContext, UnitValues,
};
use odc_actors::{Error, Result};
use tokio::sync::mpsc;

use crate::Job;

/// What the driver asks of the trainer during a turn.
enum Request {
    Gather(UnitId, std_mpsc::Sender<Result<UnitValues>>),
    Push(UnitId, Vec<f32>, std_mpsc::Sender<Result<()>>),
    PushDevice(UnitId, Arc<dyn DeviceGrad>, std_mpsc::Sender<Result<()>>),
    Release(UnitId, std_mpsc::Sender<Result<()>>),
    Finish(f64),
    Fail(String),
}

/// One micro-batch handed to the driver: what to compute, and the trainer to compute it against.
/// Dropping it unfinished fails the micro-batch.
pub struct Turn {
    /// The trainer whose micro-batch this is.
    pub trainer: u32,
    /// The job's step the micro-batch trains (`micro_batch.step` is the parameters' version).
    pub step: u64,
    /// The micro-batch: its step (the parameters' version), id and samples.
    pub micro_batch: MicroBatch,
    /// Whether this turn's gathers land in device memory and its gradients may be pushed from
    /// there ([`Turn::gather_values`], [`Turn::push_device`]).
    pub on_device: bool,
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

    /// The whole unit at this micro-batch's version in host memory: the trainer's buffer, not a
    /// copy. A unit gathered into device memory is an error here ([`Turn::gather_values`]).
    pub fn gather(&self, unit: UnitId) -> Result<Arc<[f32]>> {
        match self.gather_values(unit)? {
            UnitValues::Host(values) => Ok(values),
            UnitValues::Device { .. } => Err(Error::User {
                message: format!(
                    "gather of unit {unit}: the unit is in device memory (this turn gathers on \
                     the device)"
                ),
            }),
        }
    }

    /// The whole unit at this micro-batch's version: host values, or (on a turn
    /// [`on_device`](Turn::on_device)) the device buffer the transport wrote, in the published
    /// dtype. Either is the trainer's buffer, not a copy.
    pub fn gather_values(&self, unit: UnitId) -> Result<UnitValues> {
        self.ask(&format!("gather of unit {unit}"), |r| {
            Request::Gather(unit, r)
        })
    }

    /// Sends `grad`, a gradient in device memory (fp32, the whole unit), to the unit's owners
    /// device to device, once [ready](DeviceGrad::ready); returns once the trainer has taken it.
    /// `grad` is held until its push is over. On a turn not [`on_device`](Turn::on_device) it is
    /// an error naming why, and nothing is sent.
    pub fn push_device(&self, unit: UnitId, grad: Arc<dyn DeviceGrad>) -> Result<()> {
        if !self.on_device {
            return Err(Error::User {
                message: format!(
                    "push to unit {unit}: a gradient in device memory, but this job's data path \
                     does not reach the device (its transport is not `cuda`)"
                ),
            });
        }
        self.ask(&format!("push to unit {unit}"), |r| {
            Request::PushDevice(unit, grad, r)
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
    turns: Mutex<Turns>,
    /// A running step's task says here that it ended, so the driver's wait ends with it.
    ended: std_mpsc::Sender<Handed>,
}

/// What reaches the driver: a turn, or the end of a step (its number).
enum Handed {
    Turn(Turn),
    Ended(u64),
}

/// What one wait of the driver brought.
enum Waited {
    Turn(Turn),
    /// The step asked for ended: no turn of it comes after this.
    Ended,
    Nothing,
}

/// The turns handed out, and those of a later step held until its driver asks.
struct Turns {
    handed: std_mpsc::Receiver<Handed>,
    held: VecDeque<Turn>,
}

impl Driver {
    /// The next live turn of the job's step `step`, or `None` when none came within `wait`.
    /// A turn of a later step is held for it (on a rank other than 0 the next step's first
    /// micro-batch may come before this step's outcome); a turn whose micro-batch has already
    /// ended (by its deadline, or with a failed step), or of an earlier step, is dropped unseen.
    pub fn next_of(&self, step: u64, wait: Duration) -> Option<Turn> {
        match self.wait_of(step, wait) {
            Waited::Turn(turn) => Some(turn),
            Waited::Ended | Waited::Nothing => None,
        }
    }

    /// [`Driver::next_of`], and whether step `step` said it ended while it waited: the wait ends
    /// then, not at `wait`.
    fn wait_of(&self, step: u64, wait: Duration) -> Waited {
        let until = std::time::Instant::now() + wait;
        let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
        turns
            .held
            .retain(|t| !t.requests.is_closed() && t.step >= step);
        if let Some(at) = turns.held.iter().position(|t| t.step == step) {
            return turns.held.remove(at).map_or(Waited::Nothing, Waited::Turn);
        }
        loop {
            let left = until.saturating_duration_since(std::time::Instant::now());
            let Ok(handed) = turns.handed.recv_timeout(left) else {
                return Waited::Nothing;
            };
            let turn = match handed {
                Handed::Ended(ended) if ended == step => return Waited::Ended,
                Handed::Ended(_) => continue,
                Handed::Turn(turn) => turn,
            };
            if turn.requests.is_closed() || turn.step < step {
                continue;
            }
            if turn.step == step {
                return Waited::Turn(turn);
            }
            turns.held.push_back(turn);
        }
    }
}

/// The trainers' side: makes a [`Driven`] compute for each trainer of the job.
#[derive(Clone)]
pub struct DrivenFactory {
    turns: std_mpsc::Sender<Handed>,
    wait: Duration,
    memory: Option<Arc<dyn DeviceMemory>>,
}

impl DrivenFactory {
    /// Trainers that gather into `memory` (the driver's device) and push from it wherever their
    /// data path reaches that device (the `cuda` transport); elsewhere they keep host memory.
    pub fn with_device_memory(mut self, memory: Arc<dyn DeviceMemory>) -> Self {
        self.memory = Some(memory);
        self
    }
}

impl ComputeFactory for DrivenFactory {
    fn create(&self, trainer: u32) -> Box<dyn Compute> {
        Box::new(Driven {
            trainer,
            turns: self.turns.clone(),
            wait: self.wait,
            memory: self.memory.clone(),
        })
    }
}

/// A driver and the compute factory it drives. `wait` bounds each of the driver's requests and
/// each of the trainer's waits for the driver (the job's micro-batch timeout is the outer bound).
pub fn driven(wait: Duration) -> (Driver, DrivenFactory) {
    let (turns, taken) = std_mpsc::channel();
    let driver = Driver {
        turns: Mutex::new(Turns {
            handed: taken,
            held: VecDeque::new(),
        }),
        ended: turns.clone(),
    };
    let factory = DrivenFactory {
        turns,
        wait,
        memory: None,
    };
    (driver, factory)
}

/// A trainer's compute whose micro-batches the [`Driver`] computes.
pub struct Driven {
    trainer: u32,
    turns: std_mpsc::Sender<Handed>,
    wait: Duration,
    /// Device memory not yet given to the trainer's context (given once, at the first turn).
    memory: Option<Arc<dyn DeviceMemory>>,
}

#[async_trait::async_trait]
impl Compute for Driven {
    async fn run(&mut self, ctx: &mut TrainerContext, mb: &MicroBatch) -> Result<ComputeOutput> {
        let (requests, mut asked) = mpsc::unbounded_channel();
        if let Some(memory) = self.memory.take() {
            ctx.gather_into_device(memory);
        }
        let turn = Turn {
            trainer: self.trainer,
            step: ctx.step(),
            micro_batch: mb.clone(),
            on_device: ctx.gathers_into_device() && ctx.pushes_from_device(),
            requests,
            wait: self.wait,
        };
        self.turns
            .send(Handed::Turn(turn))
            .map_err(|_| Error::User {
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
                    let _ = reply.send(ctx.gather_values(unit).await);
                }
                Ok(Some(Request::Push(unit, grad, reply))) => {
                    let pushed = ctx.push_grad(unit, &grad).map(|t| tickets.push(t));
                    let _ = reply.send(pushed);
                }
                Ok(Some(Request::PushDevice(unit, grad, reply))) => {
                    let pushed = ctx.push_grad_device(unit, grad).map(|t| tickets.push(t));
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
/// error for fails its micro-batch with that error. Call it from outside the runtime (it blocks).
pub fn drive_step(
    runtime: &tokio::runtime::Handle,
    job: &Arc<tokio::sync::Mutex<Job>>,
    samples: Vec<SampleMeta>,
    driver: &Driver,
    mut compute: impl FnMut(&Turn) -> Result<f64>,
) -> Result<StepStats> {
    let locked = runtime.block_on(Arc::clone(job).lock_owned());
    let mut running = Running::start(runtime, locked, samples, driver);
    loop {
        match running.next(driver, Duration::from_millis(5)) {
            None => {}
            Some(Next::Done(result)) => return result,
            Some(Next::Turn(turn)) => match compute(&turn) {
                Ok(loss_sum) => {
                    let _ = turn.finish(loss_sum);
                }
                Err(e) => turn.fail(e.to_string()),
            },
        }
    }
}

/// A step of a job in flight on the job's runtime, its turns handed to the driver as they come:
/// what a driver that returns to its caller between turns (a Python iterator) holds.
pub struct Running {
    /// The job's step it runs.
    step: u64,
    handle: Option<tokio::task::JoinHandle<Result<StepStats>>>,
    runtime: tokio::runtime::Handle,
}

/// What a running step has for the driver.
pub enum Next {
    /// A micro-batch to compute.
    Turn(Turn),
    /// The step ended (its stats, or why it failed); no turn of it comes after this.
    Done(Result<StepStats>),
}

impl Running {
    /// Starts one step of the locked `job` on `samples` (rank 0 plans them; every other rank
    /// waits for rank 0's step, [`Job::step_spmd`]). The job stays locked until the step ends;
    /// then `driver`'s wait for this step's next turn ends at once.
    pub fn start(
        runtime: &tokio::runtime::Handle,
        mut job: tokio::sync::OwnedMutexGuard<Job>,
        samples: Vec<SampleMeta>,
        driver: &Driver,
    ) -> Running {
        let step = job.steps_done();
        let ended = driver.ended.clone();
        let handle = runtime.spawn(async move {
            let result = job.step_spmd(samples).await;
            drop(job); // unlocked before the driver hears of the end
            let _ = ended.send(Handed::Ended(step));
            result
        });
        Running {
            step,
            handle: Some(handle),
            runtime: runtime.clone(),
        }
    }

    /// The next turn or the step's end, waiting at most `wait`; `None` if neither came.
    pub fn next(&mut self, driver: &Driver, wait: Duration) -> Option<Next> {
        let ended = match driver.wait_of(self.step, wait) {
            Waited::Turn(turn) => return Some(Next::Turn(turn)),
            Waited::Ended => true,
            Waited::Nothing => false,
        };
        // Said to have ended: its task is returning now (joined below, not polled for).
        let finished = ended || self.handle.as_ref().is_none_or(|h| h.is_finished());
        if !finished {
            return None;
        }
        let result = match self.handle.take() {
            Some(handle) => match self.runtime.block_on(handle) {
                Ok(result) => result,
                Err(e) => Err(Error::Internal(format!("the step's task failed: {e}"))),
            },
            None => Err(Error::Internal("this step has already ended".into())),
        };
        Some(Next::Done(result))
    }
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

    /// A driven job of `builder`, shared as [`Running`] takes it.
    fn shared(
        rt: &tokio::runtime::Runtime,
        builder: crate::JobBuilder,
    ) -> Arc<tokio::sync::Mutex<Job>> {
        let job = rt.block_on(async { builder.build() }).unwrap();
        Arc::new(tokio::sync::Mutex::new(job))
    }

    fn shut(rt: &tokio::runtime::Runtime, job: Arc<tokio::sync::Mutex<Job>>) {
        let job = Arc::try_unwrap(job).ok().expect("no step holds the job");
        rt.block_on(job.into_inner().shutdown());
    }

    #[test]
    fn a_driven_job_trains_as_the_same_compute_run_by_the_trainers() {
        let rt = runtime();
        let wait = Duration::from_secs(10);
        let native = builder(wait).compute(|_| Box::new(Native) as Box<dyn Compute>);
        let native = shared(&rt, native);
        let (driver, factory) = driven(wait);
        let job = shared(&rt, builder(wait).compute(factory));
        for step in 0..3 {
            let want = rt.block_on(async { native.lock().await.step_with(samples(step)).await });
            let got = drive_step(rt.handle(), &job, samples(step), &driver, driven_compute);
            // Equal but for the order the servers summed gradients in (fp32 reassociation).
            let (got, want) = (got.unwrap().loss, want.unwrap().loss);
            assert!(
                (got - want).abs() <= 1e-6 * want.abs(),
                "step {step}: {got} vs {want}"
            );
        }
        let read = |job: &Arc<tokio::sync::Mutex<Job>>| {
            rt.block_on(async { job.lock().await.parameters().await })
                .unwrap()
        };
        let (want, got) = (read(&native), read(&job));
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
        shut(&rt, native);
        shut(&rt, job);
    }

    #[test]
    fn a_steps_end_reaches_the_driver_when_it_happens_not_at_the_end_of_its_wait() {
        let rt = runtime();
        let wait = Duration::from_secs(10);
        let (driver, factory) = driven(wait);
        let job = shared(&rt, builder(wait).compute(factory));
        for step in 0..3 {
            let locked = rt.block_on(Arc::clone(&job).lock_owned());
            let mut running = Running::start(rt.handle(), locked, samples(step), &driver);
            let mut waits = 0;
            let ended = loop {
                let asked = std::time::Instant::now();
                // Each wait is as long as a whole test: only the step's end cuts it short.
                let next = running.next(&driver, Duration::from_secs(30));
                assert!(asked.elapsed() < Duration::from_secs(20), "a wait ran out");
                waits += 1;
                match next {
                    Some(Next::Turn(turn)) => {
                        let loss = driven_compute(&turn).unwrap();
                        turn.finish(loss).unwrap();
                    }
                    Some(Next::Done(result)) => break result,
                    None => panic!("a wait of 30 s ended with nothing"),
                }
            };
            assert_eq!(ended.unwrap().step, step);
            assert!(waits > 1, "the step had turns");
        }
        shut(&rt, job);
    }

    /// Device memory that must never be asked for (a host data path never allocates from it).
    struct NoMemory;

    impl DeviceMemory for NoMemory {
        fn allocate(
            &self,
            _elements: usize,
            _dtype: odc_transport::Dtype,
        ) -> odc_actors::datapath::Transfer<Arc<dyn odc_actors::trainer::DeviceUnit>> {
            panic!("a host data path allocated device memory")
        }
    }

    /// A gradient "in device memory" (never read: the push is refused before any transfer).
    struct NoGrad;

    impl DeviceGrad for NoGrad {
        fn src(&self) -> odc_transport::DeviceDest {
            odc_transport::DeviceDest {
                device: 0,
                ptr: 0x1000,
                bytes: UNIT as u64 * 4,
            }
        }

        fn ready(&self) -> odc_actors::datapath::Transfer<()> {
            Box::pin(std::future::ready(Ok(())))
        }
    }

    #[test]
    fn device_memory_over_a_host_path_keeps_host_memory_and_refuses_a_device_push() {
        let rt = runtime();
        let wait = Duration::from_secs(10);
        let (driver, factory) = driven(wait);
        let factory = factory.with_device_memory(Arc::new(NoMemory));
        let job = shared(&rt, builder(wait).compute(factory));
        let stats = drive_step(rt.handle(), &job, samples(0), &driver, |turn| {
            assert!(!turn.on_device, "a local transport does not reach a device");
            let refused = turn
                .push_device(0, Arc::new(NoGrad))
                .unwrap_err()
                .to_string();
            assert!(refused.contains("does not reach the device"), "{refused}");
            assert!(matches!(turn.gather_values(0)?, UnitValues::Host(_)));
            driven_compute(turn)
        });
        assert_eq!(stats.unwrap().step, 0);
        shut(&rt, job);
    }

    #[test]
    fn a_gathered_unit_is_the_trainers_buffer_and_outlives_the_turn_and_the_job() {
        let rt = runtime();
        let wait = Duration::from_secs(10);
        let (driver, factory) = driven(wait);
        let job = shared(&rt, builder(wait).compute(factory));
        let mut kept: Vec<Arc<[f32]>> = Vec::new();
        drive_step(rt.handle(), &job, samples(0), &driver, |turn| {
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
        shut(&rt, job);
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
        let job = shared(&rt, builder(wait).max_replays(1).compute(factory));
        let e = drive_step(rt.handle(), &job, samples(0), &driver, |turn| {
            Err(Error::User {
                message: format!("bad batch {}", turn.micro_batch.id),
            })
        })
        .unwrap_err();
        assert!(e.to_string().contains("bad batch"), "{e}");
        shut(&rt, job);
    }

    #[test]
    fn a_turn_nobody_takes_or_finishes_ends_at_its_deadline_and_later_requests_are_refused() {
        let rt = runtime();
        let wait = Duration::from_millis(300);
        let (driver, factory) = driven(wait);
        let job = shared(&rt, builder(wait).max_replays(0).compute(factory));
        // Nobody drives: the step ends with the trainers' deadline, not a hang.
        let started = std::time::Instant::now();
        let e = rt
            .block_on(async { job.lock().await.step_with(samples(0)).await })
            .unwrap_err();
        assert!(started.elapsed() < wait * 20, "{:?}", started.elapsed());
        assert!(e.to_string().contains("did not finish it within"), "{e}");
        // The turns of that step are dead: the driver never sees them.
        assert!(driver.next_of(0, Duration::from_millis(100)).is_none());
        // A turn held past its deadline: its requests name that its micro-batch has ended.
        let mut late = None;
        let e = drive_step(rt.handle(), &job, samples(1), &driver, |turn| {
            std::thread::sleep(wait * 3);
            let refused = turn.gather(0).unwrap_err();
            late.get_or_insert(refused.to_string());
            Err(refused)
        })
        .unwrap_err();
        assert!(e.to_string().contains("did not finish it within"), "{e}");
        let late = late.expect("a turn was driven");
        assert!(late.contains("has already ended"), "{late}");
        shut(&rt, job);
    }

    #[test]
    fn a_turn_of_a_later_step_waits_for_its_step_and_dead_or_earlier_ones_are_dropped() {
        let (driver, factory) = driven(Duration::from_secs(1));
        let mut alive = Vec::new();
        let mut turn = |step: u64, id: u32, live: bool| {
            let (requests, asked) = mpsc::unbounded_channel();
            if live {
                alive.push(asked); // dropped: a turn whose micro-batch has ended
            }
            let micro_batch = MicroBatch {
                step: 0,
                id,
                samples: Vec::new(),
                tokens: 0,
                cost: 0.0,
                weighting: odc_actors::batch::LossWeighting::Tokens,
                pieces: Vec::new(),
            };
            Turn {
                trainer: 0,
                step,
                micro_batch,
                on_device: false,
                requests,
                wait: Duration::from_secs(1),
            }
        };
        let sent = [
            turn(2, 0, true),
            turn(1, 1, false),
            turn(1, 2, true),
            turn(0, 3, true),
        ];
        for t in sent {
            factory.turns.send(Handed::Turn(t)).unwrap();
        }
        let wait = Duration::from_millis(50);
        let id = |t: Option<Turn>| t.map(|t| t.micro_batch.id);
        // Step 1: its live turn; step 2's is held, the dead one dropped.
        assert_eq!(id(driver.next_of(1, wait)), Some(2));
        // Nothing more of step 1: step 0's turn is dropped, step 2's still held.
        assert_eq!(id(driver.next_of(1, wait)), None);
        assert_eq!(id(driver.next_of(2, wait)), Some(0));
        assert_eq!(id(driver.next_of(2, wait)), None);
    }

    #[test]
    fn a_turn_names_the_jobs_step_which_the_version_trails_after_a_skipped_step() {
        let rt = runtime();
        let wait = Duration::from_secs(10);
        let (driver, factory) = driven(wait);
        let skip = builder(wait).on_non_finite(crate::NonFinite::SkipStep);
        let job = shared(&rt, skip.compute(factory));
        let mut seen = Vec::new();
        for step in 0..2 {
            let stats = drive_step(rt.handle(), &job, samples(step), &driver, |turn| {
                seen.push((turn.step, turn.micro_batch.step));
                let w = turn.gather(0)?;
                let (loss, mut grad) = linear(&w, &turn.micro_batch.samples);
                if step == 0 {
                    grad[0] = f32::NAN; // step 0 is skipped: the version stays at 0
                }
                turn.push(0, grad).or_else(|e| match step {
                    0 => Ok(()), // refused as non-finite, as the context refuses it
                    _ => Err(e),
                })?;
                Ok(loss)
            })
            .unwrap();
            assert_eq!(stats.skipped.is_some(), step == 0, "step {step}");
        }
        assert!(seen.contains(&(1, 0)), "{seen:?}");
        assert!(
            seen.iter()
                .all(|&(step, version)| version == 0 && step <= 1),
            "{seen:?}"
        );
        shut(&rt, job);
    }
}
