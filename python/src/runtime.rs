//! `odc.Runtime`: this rank's part of an odc job, driven from a Python loop — its shard server
//! and trainer started over the transport the launcher's world asks for, each micro-batch handed
//! to Python as a [`PyMicroBatch`] whose gathers view odc's buffers and whose pushes go to the
//! owners, one barrier per step ([`odc::driven`]).
//!
//! The job is built by the same recipe as the Rust examples' (`odc::recipe`: [`Process`] reads
//! torchrun's, Slurm's or `odc launch`'s variables; [`Fleet`] places one trainer and one shard
//! server per rank, or the counts asked for in one process; [`odc::recipe::adamw`]'s betas unless
//! given). Every blocking call releases the GIL; no Rust thread touches a Python object (the
//! runtime's threads see only Rust values: the turns carry `f32`s or device addresses, never
//! Python objects). With `device="cuda"` (`device.rs`) the shard servers and this rank's data
//! path are on the GPU: gathers are device buffers, CUDA gradients are pushed from where autograd
//! wrote them.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use odc::driven::{driven, Driver, Next, Running, Turn};
use odc::recipe::{Fleet, Process};
use odc::{
    DispatchMode, Job, OptimizerConfig, Precision, SampleMeta, StepStats, UnitSpec, UnitValues,
};
use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::checkpoint::{self, Checkpoints, Resumed, UnitTensors};
use crate::device::{self, OnDevice, Place};
use crate::dlpack::{self as dl, host_values, Buffer};
use crate::errors;

/// How long one poll of a running step waits before Python's signals are checked.
const POLL: Duration = Duration::from_millis(50);

/// The job's units: names and lengths, in unit order.
struct Units {
    names: Vec<String>,
    lens: Vec<usize>,
    by_name: HashMap<String, usize>,
    /// Bytes this rank's gathers and pushes moved through host memory (4 per fp32 element of a
    /// host gather, 4 per element of a host push; 0 on the GPU path).
    host_bytes: AtomicU64,
}

impl Units {
    fn count_host(&self, elements: usize) {
        self.host_bytes
            .fetch_add(elements as u64 * 4, Ordering::Relaxed);
    }

    /// The unit a Python value names: its name, or its index.
    fn id(&self, unit: &Bound<'_, PyAny>) -> PyResult<usize> {
        if let Ok(name) = unit.extract::<String>() {
            return self.by_name.get(&name).copied().ok_or_else(|| {
                errors::unknown_unit(format!("unit {name:?} is not one of {:?}", self.names))
            });
        }
        match unit.extract::<usize>() {
            Ok(id) if id < self.names.len() => Ok(id),
            Ok(id) => Err(errors::unknown_unit(format!(
                "unit {id} is out of range: the job has {} units",
                self.names.len()
            ))),
            Err(_) => Err(errors::invalid(format!(
                "a unit is named by its name (str) or its index (int), not {}",
                unit.get_type().name()?
            ))),
        }
    }
}

/// A live job and what drives it.
struct Open {
    runtime: tokio::runtime::Runtime,
    job: Arc<tokio::sync::Mutex<Job>>,
    driver: Arc<Driver>,
    checkpoints: Checkpoints,
}

/// This rank's part of an odc job (see the [module docs](self)).
#[pyclass(frozen, name = "Runtime", module = "odc")]
pub(crate) struct PyRuntime {
    open: Mutex<Option<Arc<Open>>>,
    units: Arc<Units>,
    #[pyo3(get)]
    rank: u32,
    #[pyo3(get)]
    world_size: u32,
    resumed: Option<Resumed>,
    /// The GPU path, where `device="cuda"` asked for it.
    on_device: Option<Arc<OnDevice>>,
}

/// The optimizer the arguments name.
fn optimizer(
    name: &str,
    lr: f32,
    betas: (f32, f32),
    eps: f32,
    wd: f32,
    momentum: f32,
) -> PyResult<OptimizerConfig> {
    let config = match name {
        "adamw" => OptimizerConfig::AdamW {
            lr,
            beta1: betas.0,
            beta2: betas.1,
            eps,
            weight_decay: wd,
        },
        "sgd" => OptimizerConfig::Sgd {
            lr,
            momentum,
            weight_decay: wd,
        },
        other => {
            return Err(errors::invalid(format!(
                "optimizer {other:?}: expected \"adamw\" or \"sgd\""
            )))
        }
    };
    config
        .validate()
        .map_err(|e| errors::invalid(format!("optimizer: {e}")))?;
    Ok(config)
}

fn word<T>(what: &str, text: &str, words: &[(&str, T)]) -> PyResult<T>
where
    T: Copy,
{
    words
        .iter()
        .find(|(w, _)| *w == text)
        .map(|(_, v)| *v)
        .ok_or_else(|| {
            let names: Vec<&str> = words.iter().map(|(w, _)| *w).collect();
            errors::invalid(format!("{what} {text:?}: expected one of {names:?}"))
        })
}

fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            errors::invalid(format!(
                "{what} must be a positive number of seconds, got {s}"
            ))
        })
}

#[pymethods]
impl PyRuntime {
    #[new]
    #[pyo3(signature = (
        units, *, frozen = Vec::new(), optimizer = "adamw", lr = 1e-3, betas = (0.9, 0.999),
        eps = 1e-8, weight_decay = 0.0, momentum = 0.0, clip_grad_norm = None,
        token_budget = 65_536, precision = "fp32", dispatch = "static", trainers = 1, servers = 1,
        micro_batch_timeout = 600.0, step_timeout = 3600.0, tensors = None,
        checkpoint_dir = None, resume = None, keep_last_checkpoints = 0, device = "cpu",
        direct_pushes = false,
    ))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, each with its default
    fn new(
        py: Python<'_>,
        units: Vec<(String, Bound<'_, PyAny>)>,
        frozen: Vec<String>,
        optimizer: &str,
        lr: f32,
        betas: (f32, f32),
        eps: f32,
        weight_decay: f32,
        momentum: f32,
        clip_grad_norm: Option<f64>,
        token_budget: u64,
        precision: &str,
        dispatch: &str,
        trainers: usize,
        servers: usize,
        micro_batch_timeout: f64,
        step_timeout: f64,
        tensors: Option<Vec<UnitTensors>>,
        checkpoint_dir: Option<PathBuf>,
        resume: Option<String>,
        keep_last_checkpoints: usize,
        device: &str,
        direct_pushes: bool,
    ) -> PyResult<Self> {
        let place = device::place(device)?;
        let config = self::optimizer(optimizer, lr, betas, eps, weight_decay, momentum)?;
        let precision = word(
            "precision",
            precision,
            &[("fp32", Precision::F32), ("bf16", Precision::Bf16)],
        )?;
        let dispatch = word(
            "dispatch",
            dispatch,
            &[
                ("static", DispatchMode::Static),
                ("dynamic", DispatchMode::Dynamic),
            ],
        )?;
        let micro_batch_timeout = seconds("micro_batch_timeout", micro_batch_timeout)?;
        let step_timeout = seconds("step_timeout", step_timeout)?;
        if units.is_empty() {
            return Err(errors::invalid("a job needs at least one unit".into()));
        }
        let mut specs = Vec::with_capacity(units.len());
        let mut by_name = HashMap::new();
        for (i, (name, tensor)) in units.iter().enumerate() {
            if by_name.insert(name.clone(), i).is_some() {
                return Err(errors::invalid(format!("unit {name:?} is given twice")));
            }
            let values = host_values(tensor, None, &format!("unit {name:?}"))?;
            let spec = UnitSpec::with_values(name.clone(), values);
            specs.push(if frozen.contains(name) {
                spec.frozen()
            } else {
                spec
            });
        }
        if let Some(name) = frozen.iter().find(|n| !by_name.contains_key(*n)) {
            return Err(errors::unknown_unit(format!(
                "frozen unit {name:?} is not a unit"
            )));
        }
        let lens: Vec<usize> = specs.iter().map(|s| s.len).collect();
        let names: Vec<String> = units.into_iter().map(|(n, _)| n).collect();
        let flat: Vec<(String, usize)> = names.iter().cloned().zip(lens.iter().copied()).collect();
        // Embedded: PyTorch's threads already run, so odc sets no environment variable.
        let mut process =
            Process::embedded(trainers).map_err(|e| errors::invalid(e.to_string()))?;
        let on_device = match place {
            Place::Host => None,
            Place::Cuda(asked) => {
                device::use_cuda_transport(&mut process.world)?;
                let opened = OnDevice::open(asked, &process.world);
                Some(opened.map_err(|e| errors::invalid(format!("device {device:?}: {e}")))?)
            }
        };
        let (rank, world_size) = (process.rank(), process.ranks());
        if process.is_distributed() {
            // The secret is first used when the ranks join, at the first step: checked here.
            odc::launch::secret(&process.world).map_err(|e| errors::invalid(e.to_string()))?;
        }
        let checkpoints = Checkpoints {
            tensors: checkpoint::tensor_map(&flat, tensors)?,
            dir: checkpoint_dir,
            lead: process.is_lead(),
        };
        let opened = checkpoint::open(
            resume.as_deref(),
            checkpoints.dir.as_deref(),
            &checkpoints.tensors,
            checkpoints.lead,
        )?;
        let (resumed, opened) = match opened {
            Some((resumed, opened)) => (Some(resumed), Some(opened)),
            None => (None, None),
        };
        let (driver, mut factory) = driven(micro_batch_timeout);
        let servers_on = on_device.as_ref().map(|d| d.ordinal());
        if let Some(on_device) = &on_device {
            factory = factory.with_device_memory(on_device.memory());
        }
        let open = py.detach(move || -> odc::Result<Open> {
            let runtime = process
                .runtime()
                .map_err(|e| odc::Error::Config(e.to_string()))?;
            let mut builder = Job::builder()
                .units(specs)
                .optimizer(config)
                .pull_precision(precision)
                .token_budget(token_budget)
                .dispatch(dispatch)
                .micro_batch_timeout(micro_batch_timeout)
                .step_timeout(step_timeout)
                .keep_last_checkpoints(keep_last_checkpoints)
                .compute(factory);
            if !process.is_distributed() {
                builder = builder.servers_on_device(servers_on);
            }
            if let Some(opened) = opened {
                builder = builder.resume_from(opened);
            }
            if let Some(norm) = clip_grad_norm {
                builder = builder.clip_grad_norm(norm);
            }
            if direct_pushes {
                builder = builder.direct_pushes();
            }
            let builder = Fleet::new(trainers, servers)
                .apply(builder, &process.world)
                .map_err(|e| odc::Error::Config(e.to_string()))?;
            let job = runtime.block_on(async { builder.build() })?;
            Ok(Open {
                runtime,
                job: Arc::new(tokio::sync::Mutex::new(job)),
                driver: Arc::new(driver),
                checkpoints,
            })
        });
        let open = open.map_err(errors::runtime)?;
        Ok(PyRuntime {
            open: Mutex::new(Some(Arc::new(open))),
            units: Arc::new(Units {
                names,
                lens,
                by_name,
                host_bytes: AtomicU64::new(0),
            }),
            rank,
            world_size,
            resumed,
            on_device,
        })
    }

    /// Bytes this rank's gathers and pushes have moved through host memory so far (0 on the
    /// GPU path).
    #[getter]
    fn host_bytes(&self) -> u64 {
        self.units.host_bytes.load(Ordering::Relaxed)
    }

    /// Where this rank computes: `"cpu"`, or `"cuda:N"` on the GPU path.
    #[getter]
    fn device(&self) -> String {
        match &self.on_device {
            Some(d) => format!("cuda:{}", d.ordinal()),
            None => "cpu".into(),
        }
    }

    /// The units' names, in unit order.
    #[getter]
    fn units(&self) -> Vec<String> {
        self.units.names.clone()
    }

    /// Starts one step on a minibatch whose samples have `lengths` tokens (rank 0's are used;
    /// every rank calls it, as an SPMD program does): an iterator over this rank's micro-batches.
    /// `loss_tokens` (each sample's tokens that carry loss; all of them unless given) is what the
    /// servers divide the summed gradient by, so that the step trains the minibatch's token mean.
    #[pyo3(signature = (lengths, loss_tokens = None))]
    fn step(&self, lengths: Vec<u64>, loss_tokens: Option<Vec<u64>>) -> PyResult<PyStep> {
        let samples = samples(&lengths, loss_tokens.as_deref())?;
        let open = self.open()?;
        let Ok(job) = Arc::clone(&open.job).try_lock_owned() else {
            return Err(running("step"));
        };
        let running = Running::start(open.runtime.handle(), job, samples, &open.driver);
        Ok(PyStep {
            state: Mutex::new(StepState::Running(running)),
            driver: Arc::clone(&open.driver),
            units: Arc::clone(&self.units),
            on_device: self.on_device.clone(),
        })
    }

    /// Every unit's parameters now (after the last step's update), as buffers in unit order.
    fn parameters(&self, py: Python<'_>) -> PyResult<Vec<(String, Buffer)>> {
        let open = self.open()?;
        let mut job = open.idle_job("parameters")?;
        let values = py.detach(|| open.runtime.block_on(job.parameters()));
        let values = values.map_err(errors::runtime)?;
        Ok(self
            .units
            .names
            .iter()
            .cloned()
            .zip(values.into_iter().map(|v| Buffer::new(v.into())))
            .collect())
    }

    /// Steps the job has taken (a resumed job counts the checkpoint's).
    #[getter]
    fn steps_done(&self) -> PyResult<u64> {
        let open = self.open()?;
        let done = open.idle_job("steps_done")?.steps_done();
        Ok(done)
    }

    /// The checkpoint this job resumed from: (its directory, its step, the `extra` JSON saved
    /// with it), or `None`.
    #[getter]
    fn resumed(&self) -> Option<(String, u64, String)> {
        self.resumed
            .as_ref()
            .map(|r| (r.path.display().to_string(), r.step, r.extra.clone()))
    }

    /// Writes a checkpoint of the job's state at its current step into
    /// `checkpoint_dir/step-<N>` with `extra` (JSON text), once it is on disk: its directory on
    /// the lead rank, `None` on the others (every rank may call; only the lead writes).
    #[pyo3(signature = (extra = "null"))]
    fn save_checkpoint(&self, py: Python<'_>, extra: &str) -> PyResult<Option<String>> {
        let extra: serde_json::Value = serde_json::from_str(extra)
            .map_err(|e| errors::invalid(format!("extra is not JSON: {e}")))?;
        let open = self.open()?;
        let mut job = open.idle_job("save_checkpoint")?;
        let written = py.detach(|| {
            open.runtime
                .block_on(checkpoint::save(&mut job, &open.checkpoints, &extra))
        });
        let written = written.map_err(errors::runtime)?;
        Ok(written.map(|p| p.display().to_string()))
    }

    /// Stops this rank's part of the job (waiting for the other ranks as `Job::shutdown` does).
    /// Buffers handed out stay valid; every later call raises `odc.Closed`.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let taken = self.open.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(open) = taken else { return Ok(()) };
        let on_device = self.on_device.clone();
        py.detach(move || {
            let Ok(open) = Arc::try_unwrap(open) else {
                return; // another call is in flight: the job drops when it returns
            };
            let Open { runtime, job, .. } = open;
            // A step still running holds the job (it ends by its deadline): no orderly shutdown.
            if let Ok(job) = Arc::try_unwrap(job) {
                runtime.block_on(job.into_inner().shutdown());
            }
            runtime.shutdown_timeout(Duration::from_secs(5));
        });
        if let Some(on_device) = on_device {
            // After an orderly shutdown no push holds a gradient any more; one still held (a step
            // cut short) keeps its tensor, which a copy in flight may still read.
            let held = on_device.sweep(py);
            if held > 0 {
                tracing::warn!("odc: {held} pushed gradients still held at close are kept");
            }
        }
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _a: Py<PyAny>,
        _b: Py<PyAny>,
        _c: Py<PyAny>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }
}

/// A call refused because a step holds the job (waiting for it would wait for this very thread,
/// which drives the step).
fn running(what: &str) -> PyErr {
    errors::invalid(format!(
        "{what}: a step is already running: finish iterating its micro-batches first"
    ))
}

impl Open {
    /// The job, unless a step holds it.
    fn idle_job(&self, what: &str) -> PyResult<tokio::sync::MutexGuard<'_, Job>> {
        self.job.try_lock().map_err(|_| running(what))
    }
}

impl PyRuntime {
    fn open(&self) -> PyResult<Arc<Open>> {
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| errors::closed("the runtime is closed".into()))
    }
}

/// A step's samples: each index, length and loss tokens (at most its length), checked.
fn samples(lengths: &[u64], loss_tokens: Option<&[u64]>) -> PyResult<Vec<SampleMeta>> {
    let Some(loss) = loss_tokens else {
        let meta = |(i, &n): (usize, &u64)| SampleMeta::new(i as u64, n);
        return Ok(lengths.iter().enumerate().map(meta).collect());
    };
    if loss.len() != lengths.len() {
        return Err(errors::invalid(format!(
            "loss_tokens has {} entries for {} samples",
            loss.len(),
            lengths.len()
        )));
    }
    let mut samples = Vec::with_capacity(lengths.len());
    for (i, (&tokens, &loss_tokens)) in lengths.iter().zip(loss).enumerate() {
        if loss_tokens > tokens {
            return Err(errors::invalid(format!(
                "sample {i}: {loss_tokens} loss tokens in a sample of {tokens} tokens"
            )));
        }
        samples.push(SampleMeta {
            index: i as u64,
            tokens,
            loss_tokens,
        });
    }
    Ok(samples)
}

enum StepState {
    Running(Running),
    Done(StepStats),
    Failed(String),
}

/// One step in flight: iterating it yields this rank's micro-batches as the runtime hands them
/// out; it ends when the step's barrier has passed (`stats` then holds the step's figures) or
/// raises `odc.StepError` naming why the step failed.
#[pyclass(frozen, name = "Step", module = "odc")]
pub(crate) struct PyStep {
    state: Mutex<StepState>,
    // The driver only, not the job: a step object kept after its end never stops `close` from
    // shutting the job down (a rank that left without it took its shard server with it).
    driver: Arc<Driver>,
    units: Arc<Units>,
    on_device: Option<Arc<OnDevice>>,
}

#[pymethods]
impl PyStep {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<PyMicroBatch> {
        if let Some(on_device) = &self.on_device {
            on_device.sweep(py);
        }
        loop {
            let next = py.detach(|| {
                let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                match &mut *state {
                    StepState::Running(running) => running.next(&self.driver, POLL),
                    _ => None,
                }
            });
            match next {
                Some(Next::Turn(turn)) => return Ok(self.micro_batch(turn)),
                Some(Next::Done(result)) => {
                    let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                    *state = match result {
                        Ok(stats) => StepState::Done(stats),
                        Err(e) => StepState::Failed(e.to_string()),
                    };
                }
                None => {}
            }
            match &*self.state.lock().unwrap_or_else(|p| p.into_inner()) {
                StepState::Running(_) => py.check_signals()?,
                StepState::Done(_) => return Err(PyStopIteration::new_err(())),
                StepState::Failed(reason) => return Err(errors::step(reason.clone())),
            }
        }
    }

    /// The step's figures once it has ended (`None` before): loss (the minibatch's mean),
    /// tokens, samples, micro-batches, grad_norm (before clipping), replays, wall seconds, and
    /// early_relay_flushes (relays flushed before the barrier, where pushes are relayed).
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let StepState::Done(s) = &*state else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("step", s.step)?;
        d.set_item("loss", s.loss)?;
        d.set_item("tokens", s.tokens)?;
        d.set_item("samples", s.samples)?;
        d.set_item("micro_batches", s.micro_batches)?;
        d.set_item("grad_norm", s.grad_norm)?;
        d.set_item("replays", s.replays)?;
        d.set_item("wall_s", s.wall.as_secs_f64())?;
        d.set_item("early_relay_flushes", s.early_relay_flushes)?;
        Ok(Some(d))
    }
}

impl PyStep {
    fn micro_batch(&self, turn: Turn) -> PyMicroBatch {
        PyMicroBatch {
            samples: turn.micro_batch.samples.iter().map(|s| s.index).collect(),
            tokens: turn.micro_batch.tokens,
            step: turn.micro_batch.step,
            id: turn.micro_batch.id,
            trainer: turn.trainer,
            on_device: turn.on_device,
            turn: Mutex::new(Some(turn)),
            units: Arc::clone(&self.units),
            device: self.on_device.clone(),
        }
    }
}

/// One micro-batch of this rank: its samples (indices into the step's lengths), and the calls
/// that compute it: `gather` a unit, `push` its gradient, `finish` with the summed loss.
/// Dropped unfinished, it fails (and the step replays it or fails, naming it).
#[pyclass(frozen, name = "MicroBatchTurn", module = "odc")]
pub(crate) struct PyMicroBatch {
    #[pyo3(get)]
    samples: Vec<u64>,
    #[pyo3(get)]
    tokens: u64,
    #[pyo3(get)]
    step: u64,
    #[pyo3(get)]
    id: u32,
    #[pyo3(get)]
    trainer: u32,
    /// Whether gathers are device buffers and CUDA gradients are pushed from device memory.
    #[pyo3(get)]
    on_device: bool,
    turn: Mutex<Option<Turn>>,
    units: Arc<Units>,
    device: Option<Arc<OnDevice>>,
}

impl PyMicroBatch {
    /// Runs `f` on the turn without the GIL (the turn's lock is taken there too, so a thread
    /// waiting for it never holds the GIL another needs); a finished turn is `odc.Closed`.
    fn with_turn<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Turn) -> odc::Result<T> + Send,
    ) -> PyResult<T> {
        let result = py.detach(|| {
            let guard = self.turn.lock().unwrap_or_else(|p| p.into_inner());
            guard.as_ref().map(f)
        });
        match result {
            Some(result) => result.map_err(errors::runtime),
            None => Err(self.finished()),
        }
    }

    /// The turn, taken (once) without the GIL.
    fn take(&self, py: Python<'_>) -> PyResult<Turn> {
        py.detach(|| self.turn.lock().unwrap_or_else(|p| p.into_inner()).take())
            .ok_or_else(|| self.finished())
    }

    fn finished(&self) -> PyErr {
        errors::closed(format!(
            "micro-batch {} of step {} is finished",
            self.id, self.step
        ))
    }
}

#[pymethods]
impl PyMicroBatch {
    /// The whole unit at this micro-batch's parameters: a buffer viewing odc's memory (a
    /// `Buffer` in host memory, or on the GPU path a `DeviceBuffer`).
    fn gather(&self, py: Python<'_>, unit: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let id = self.units.id(unit)?;
        match self.with_turn(py, |t| t.gather_values(id as u32))? {
            UnitValues::Host(values) => {
                self.units.count_host(values.len());
                Ok(Py::new(py, Buffer::new(values))?.into_any())
            }
            UnitValues::Device { buffer, dtype } => match &self.device {
                Some(on_device) => on_device.buffer(py, buffer, dtype),
                None => Err(errors::runtime(odc::Error::Internal(
                    "a unit gathered into device memory by a runtime on the host".into(),
                ))),
            },
        }
    }

    /// Sends `grad` (the unit's element count: fp32 or bf16 in host memory, or on the GPU path
    /// fp32 on the runtime's device) as the gradient of this micro-batch's summed loss with
    /// respect to the unit.
    fn push(
        &self,
        py: Python<'_>,
        unit: &Bound<'_, PyAny>,
        grad: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = self.units.id(unit)?;
        let what = format!("the gradient of unit {:?}", self.units.names[id]);
        let len = self.units.lens[id];
        let on_cuda = matches!(dl::device_of(grad)?, Some((dl::CUDA, _)));
        if let Some(on_device) = self.device.as_ref().filter(|_| on_cuda) {
            let grad = on_device.grad(grad, len, &what)?;
            return self.with_turn(py, |t| t.push_device(id as u32, grad));
        }
        let values = host_values(grad, Some(len), &what)?;
        self.units.count_host(values.len());
        self.with_turn(py, |t| t.push(id as u32, values))
    }

    /// Drops the trainer's reference to a gathered unit (buffers handed out stay valid).
    fn release(&self, py: Python<'_>, unit: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self.units.id(unit)?;
        self.with_turn(py, |t| t.release(id as u32))
    }

    /// Ends the micro-batch with its summed loss (not its mean: odc divides by the minibatch's
    /// total tokens).
    fn finish(&self, py: Python<'_>, loss_sum: f64) -> PyResult<()> {
        self.take(py)?.finish(loss_sum).map_err(errors::runtime)
    }

    /// Ends the micro-batch as failed, with `reason` (a finished one stays as it ended).
    fn fail(&self, py: Python<'_>, reason: String) {
        if let Ok(turn) = self.take(py) {
            turn.fail(reason);
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "MicroBatchTurn(step={}, id={}, samples={:?}, tokens={})",
            self.step, self.id, self.samples, self.tokens
        )
    }
}

/// Adds the runtime's types to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRuntime>()?;
    m.add_class::<PyStep>()?;
    m.add_class::<PyMicroBatch>()?;
    m.add_class::<Buffer>()?;
    m.add_class::<crate::gpu::DeviceBuffer>()?;
    Ok(())
}
