//! [`TrainerContext`]: what user compute calls to move parameters and gradients. It never branches
//! on the communication mode: transfers go through the trainer's [`DataPath`].
//!
//! - `gather(unit)` returns the whole unit at the micro-batch's version, pulled on demand or taken
//!   from a prefetch, then prefetches the next `prefetch` units in forward order, or in reverse
//!   order after [`TrainerContext::backward`].
//! - `release(unit)` drops the context's reference to a gathered unit.
//! - `push_grad(unit, grad)` hands the unit's gradient to the data path, which sends it
//!   asynchronously; the returned [`PushTicket`] resolves when every owner acknowledged. The
//!   trainer waits for all pushes before it reports the micro-batch done (ledger rule,
//!   docs/design.md "One minibatch", step 4).
//! - A gradient with a NaN or ±inf element is never sent (the data path checks it in the pass that
//!   encodes or copies it): `push_grad` returns `Error::Step(StepError::NonFinite)` naming the
//!   trainer, the micro-batch, its samples, the unit and the first bad element, and the
//!   micro-batch fails with that error even if the compute ignores it.
//! - A unit released and gathered again right away (the last unit of a forward pass, needed first
//!   by the backward pass) is served from memory, without a transfer.
//! - Across micro-batches of one step, the unit gathered last (the first one of the forward pass,
//!   in forward–backward order) is kept and serves the next micro-batch's first gather if it asks
//!   for the same unit at the same version: the next micro-batch's first gather is never exposed.
//!
//! Invariants:
//! - **I1 consistency**: every read carries the version it was published with; one of another
//!   version fails the micro-batch ([`Error::VersionMismatch`]); a kept unit is reused only at the
//!   version it was gathered at.
//! - **I5 bounded memory**: prefetches are issued only while gathered units plus prefetches in
//!   flight stay within `prefetch + 1`, so a compute that releases what it no longer needs never
//!   holds more than `prefetch + 1` gathered units; [`TrainerContext::live_unit_buffers`] measures
//!   it from the buffers themselves. Units the user gathers explicitly are always served.
//! - Every transfer has a deadline (`transfer_timeout`, **I6**).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::batch::MicroBatch;
use crate::datapath::{DataPath, GangChannel, Gathered, Op, OpKey, OpKind};
use crate::error::{Error, Result};
use crate::layout::{ModelLayout, UnitId};
use crate::memory::buffers::UnitBuffers;
use crate::memory::device::{DeviceGrad, DeviceMemory, UnitValues};
use crate::metrics as m;
use crate::policy::clock::{Clock, SystemClock, Timestamp};
use crate::policy::stats::{Span, SpanKind};
use crate::policy::step::StepError;
use crate::NonFiniteAt;

/// Knobs of the trainer-side data path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextConfig {
    /// Units prefetched ahead of the one being gathered (0 disables prefetching).
    pub prefetch: u32,
    /// Chunk size of reads and gradient pushes, in elements.
    pub chunk_elems: u64,
    /// Deadline of every gather and push, from when it is issued (I6).
    pub transfer_timeout: Duration,
}

impl Default for ContextConfig {
    fn default() -> Self {
        ContextConfig {
            prefetch: 1,
            chunk_elems: 1 << 18,
            transfer_timeout: Duration::from_secs(120),
        }
    }
}

/// Order in which units are being gathered; prefetching follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Direction {
    Forward,
    Backward,
}

impl ContextConfig {
    /// Checks that transfers can move (a chunk of at least one element) and end (a positive
    /// transfer deadline), naming the first field that is not in range.
    pub fn validate(&self) -> Result<()> {
        if self.chunk_elems == 0 {
            return Err(Error::Config(
                "chunk size must be at least one element".into(),
            ));
        }
        if self.transfer_timeout.is_zero() {
            return Err(Error::Config(
                "the transfer timeout must be positive".into(),
            ));
        }
        Ok(())
    }
}

pub use odc_policy::stats::MicroBatchStats;

/// Resolves when every owner acknowledged one `push_grad`.
#[derive(Debug)]
pub struct PushTicket {
    unit: UnitId,
    rx: oneshot::Receiver<Result<()>>,
}

impl PushTicket {
    /// Wait for the acknowledgements.
    pub async fn wait(self) -> Result<()> {
        match self.rx.await {
            Ok(result) => result,
            Err(_) => Err(Error::Internal(format!(
                "push of unit {} was cancelled",
                self.unit
            ))),
        }
    }
}

/// The unit kept from the previous micro-batch (see the module docs).
struct Kept {
    unit: UnitId,
    version: u64,
    values: UnitValues,
}

/// The trainer-side API handed to [`Compute::run`](crate::trainer::Compute::run).
pub struct TrainerContext {
    trainer: u32,
    layout: Arc<ModelLayout>,
    path: Arc<dyn DataPath>,
    config: ContextConfig,
    buffers: UnitBuffers,
    held_gauge: metrics::Gauge,
    /// Micro-batch sequence number within `seq_epoch` (collectives pair up by it).
    seq: u32,
    seq_epoch: Option<u64>,
    occurrences: HashMap<(UnitId, OpKind), u32>,
    // Per micro-batch state.
    version: u64,
    epoch: u64,
    /// The job's step of the current micro-batch ([`TrainerContext::step`]).
    step: u64,
    micro_batch: u32,
    /// Dataset indices of the micro-batch's samples (named by a non-finite gradient's error).
    samples: Vec<u64>,
    /// The first non-finite gradient refused in this micro-batch: its outcome.
    non_finite: Option<Error>,
    /// The assignment's token, carried by every gradient write of the micro-batch.
    token: u128,
    direction: Direction,
    /// The lowest unit the backward gathers (prefetches stop there): 0 unless
    /// [`Self::backward_from`] said otherwise.
    backward_floor: UnitId,
    first_gather: bool,
    last_gathered: Option<(UnitId, UnitValues)>,
    kept: Option<Kept>,
    resident: HashMap<UnitId, UnitValues>,
    /// The compute's device memory, for gathers into it when the data path can
    /// ([`TrainerContext::gather_into_device`]).
    device_memory: Option<Arc<dyn DeviceMemory>>,
    inflight: HashMap<UnitId, JoinHandle<Result<Gathered>>>,
    pushes: Vec<(UnitId, JoinHandle<Result<u64>>)>,
    pushed: HashSet<UnitId>,
    stats: MicroBatchStats,
    /// Where span and wait times are read (the node's clock).
    clock: Arc<dyn Clock>,
    /// The trainer's channel to its gangs' other members (sequence splitting), when the job
    /// splits.
    gang: Option<Arc<GangChannel>>,
}

impl TrainerContext {
    /// A context for trainer `trainer` whose transfers go through `path`.
    pub fn new(
        trainer: u32,
        layout: Arc<ModelLayout>,
        path: Arc<dyn DataPath>,
        config: ContextConfig,
    ) -> Self {
        TrainerContext {
            trainer,
            layout,
            path,
            config,
            buffers: UnitBuffers::default(),
            held_gauge: metrics::gauge!(m::GATHERED_UNITS, "trainer" => trainer.to_string()),
            seq: 0,
            seq_epoch: None,
            occurrences: HashMap::new(),
            version: 0,
            epoch: 0,
            step: 0,
            micro_batch: 0,
            samples: Vec::new(),
            non_finite: None,
            token: 0,
            direction: Direction::Forward,
            backward_floor: 0,
            first_gather: true,
            last_gathered: None,
            kept: None,
            resident: HashMap::new(),
            device_memory: None,
            inflight: HashMap::new(),
            pushes: Vec::new(),
            pushed: HashSet::new(),
            stats: MicroBatchStats::default(),
            clock: Arc::new(SystemClock),
            gang: None,
        }
    }

    /// Give the compute `channel` to exchange with the other members of its gangs.
    pub fn with_gang(mut self, channel: GangChannel) -> Self {
        self.gang = Some(Arc::new(channel));
        self
    }

    /// The trainer's channel to its gangs' other members (`None` when the job does not split).
    pub fn gang(&self) -> Option<Arc<GangChannel>> {
        self.gang.clone()
    }

    /// Read times from `clock` instead of the [`SystemClock`] (a virtual clock in a simulation).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Now on the job's clock: what a compute's own spans ([`TrainerContext::record_span`]) are
    /// measured with.
    pub fn now(&self) -> Timestamp {
        self.clock.now()
    }

    /// This trainer's index.
    pub fn trainer(&self) -> u32 {
        self.trainer
    }

    /// The step of the job this micro-batch trains (the same on every rank; the parameters'
    /// version, [`TrainerContext::version`], stays behind it after skipped steps or a resume).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Parameter version every read of this micro-batch returns (I1).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The model's units.
    pub fn layout(&self) -> &ModelLayout {
        &self.layout
    }

    /// The current gathering direction.
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// Units currently gathered and not released.
    pub fn gathered(&self) -> usize {
        self.resident.len()
    }

    /// Unit buffers alive right now, wherever they are referenced (in flight, gathered, kept for
    /// the next micro-batch, or held by the compute): the measured side of I5.
    pub fn live_unit_buffers(&self) -> usize {
        self.buffers.live()
    }

    /// Start of a micro-batch of attempt `epoch` of the job's step `step` whose assignment
    /// carries `token` (called by the trainer actor).
    pub(crate) fn begin(&mut self, micro_batch: &MicroBatch, epoch: u64, token: u128, step: u64) {
        self.cancel_prefetches();
        self.resident.clear();
        self.pushed.clear();
        self.seq = match self.seq_epoch {
            Some(e) if e == epoch => self.seq.wrapping_add(1),
            _ => 0,
        };
        if self.seq_epoch != Some(epoch) {
            self.path.begin(epoch);
        }
        self.seq_epoch = Some(epoch);
        self.occurrences.clear();
        self.version = micro_batch.step;
        self.step = step;
        self.epoch = epoch;
        if let Some(gang) = &self.gang {
            gang.begin(epoch);
        }
        self.micro_batch = micro_batch.id;
        self.samples.clear();
        self.samples
            .extend(micro_batch.samples.iter().map(|s| s.index));
        self.non_finite = None;
        self.token = token;
        self.direction = Direction::Forward;
        self.backward_floor = 0;
        self.first_gather = true;
        self.last_gathered = None;
        self.stats = MicroBatchStats::default();
    }

    /// End of a micro-batch: drop gathered units and prefetches (keeping the unit gathered last for
    /// the next micro-batch), wait for every push's acknowledgement. Returns the micro-batch's
    /// stats, or the refused non-finite gradient's error, or the first push failure.
    pub(crate) async fn finish(&mut self) -> Result<MicroBatchStats> {
        self.cancel_prefetches();
        self.resident.clear();
        self.kept = self.last_gathered.take().map(|(unit, values)| Kept {
            unit,
            version: self.version,
            values,
        });
        let start = self.clock.now();
        let mut first_err = None;
        for (unit, handle) in self.pushes.drain(..) {
            let outcome = match handle.await {
                Ok(Ok(bytes)) => {
                    self.stats.bytes_pushed += bytes;
                    continue;
                }
                Ok(Err(e)) => e,
                Err(e) => Error::Internal(format!("push task of unit {unit} failed: {e}")),
            };
            first_err.get_or_insert(outcome);
        }
        let end = self.clock.now();
        self.stats.push_wait += end.saturating_duration_since(start);
        self.record_span(SpanKind::PushWait, start, end);
        self.note_held();
        match self.non_finite.take().or(first_err) {
            Some(e) => Err(e),
            None => Ok(std::mem::take(&mut self.stats)),
        }
    }

    /// Switch to backward order: forward prefetches still in flight are dropped and prefetching
    /// starts at once below the unit gathered last, in reverse order.
    pub fn backward(&mut self) {
        if self.direction != Direction::Backward {
            self.direction = Direction::Backward;
            self.cancel_prefetches();
            if let Some(last) = self.last_gathered.as_ref().map(|(unit, _)| *unit) {
                self.prefetch_after(last);
                self.note_held();
            }
        }
    }

    /// Switch to backward order with `next` the next unit to gather and `floor` the lowest:
    /// forward prefetches still in flight are dropped and prefetching runs from `next` down to
    /// `floor`. For a compute that keeps some units from forward to backward (resharding all but
    /// the last few; [`Self::backward`] would prefetch the kept ones below the unit gathered
    /// last) and differentiates the lowest ones without their weights (an embedding lookup).
    pub fn backward_from(&mut self, next: UnitId, floor: UnitId) {
        self.direction = Direction::Backward;
        self.backward_floor = floor;
        self.cancel_prefetches();
        self.prefetch_after(next.saturating_add(1));
        self.note_held();
    }

    /// From now on, gather into `memory` (device memory of the compute) whenever the data path
    /// can ([`TrainerContext::gathers_into_device`]); [`TrainerContext::gather_values`] then
    /// returns device buffers. Units gathered before keep their kind; prefetches in flight are
    /// dropped (the next gather of their unit goes to the device).
    pub fn gather_into_device(&mut self, memory: Arc<dyn DeviceMemory>) {
        self.cancel_prefetches();
        self.device_memory = Some(memory);
    }

    /// Whether gathers land in device memory (the compute asked for it and the data path can).
    pub fn gathers_into_device(&self) -> bool {
        self.device_memory.is_some() && self.path.device_gathers()
    }

    /// Whether gradients can be pushed from device memory ([`TrainerContext::push_grad_device`]):
    /// the data path reaches the owners' accumulators from there.
    pub fn pushes_from_device(&self) -> bool {
        self.path.device_pushes()
    }

    /// The whole unit at this micro-batch's version as host values (see
    /// [`TrainerContext::gather_values`]); a unit gathered into device memory is an error here.
    pub async fn gather(&mut self, unit: UnitId) -> Result<Arc<[f32]>> {
        match self.gather_values(unit).await? {
            UnitValues::Host(values) => Ok(values),
            UnitValues::Device { .. } => Err(Error::Internal(format!(
                "unit {unit} was gathered into device memory: use gather_values"
            ))),
        }
    }

    /// The whole unit at this micro-batch's version: already gathered, kept from the previous
    /// micro-batch, prefetched, or pulled now; then prefetch ahead. In device memory when the
    /// context gathers there ([`TrainerContext::gather_into_device`]), else host values.
    pub async fn gather_values(&mut self, unit: UnitId) -> Result<UnitValues> {
        self.layout.unit(unit)?;
        let kept = self.take_kept(unit);
        let cached = self
            .resident
            .get(&unit)
            .cloned()
            .or_else(|| {
                // Released a moment ago and gathered again: still in memory, same version.
                let (last, values) = self.last_gathered.as_ref()?;
                (*last == unit).then(|| values.clone())
            })
            .or(kept);
        if let Some(values) = cached {
            self.resident.insert(unit, values.clone());
            self.last_gathered = Some((unit, values.clone()));
            self.prefetch_after(unit);
            self.note_held();
            return Ok(values);
        }
        // The unit released last is not needed any more: free it before another transfer (I5).
        self.last_gathered = None;
        let start = self.clock.now();
        let gathered = match self.inflight.remove(&unit) {
            Some(handle) => handle
                .await
                .map_err(|e| Error::Internal(format!("prefetch of unit {unit} failed: {e}")))??,
            None => self.start_gather(unit)?.await?,
        };
        let end = self.clock.now();
        self.stats.pull_wait += end.saturating_duration_since(start);
        self.record_span(SpanKind::PullWait, start, end);
        let values = self.take_over(gathered);
        self.resident.insert(unit, values.clone());
        self.last_gathered = Some((unit, values.clone()));
        self.prefetch_after(unit);
        self.note_held();
        Ok(values)
    }

    /// Drop the context's reference to a gathered unit.
    pub fn release(&mut self, unit: UnitId) -> Result<()> {
        self.layout.unit(unit)?;
        match self.resident.remove(&unit) {
            Some(_) => {
                self.note_held();
                Ok(())
            }
            None => Err(Error::NotGathered { unit }),
        }
    }

    /// Record a span of the micro-batch's timeline (e.g. the compute's own work).
    pub fn record_span(&mut self, kind: SpanKind, start: Timestamp, end: Timestamp) {
        self.stats.spans.push(Span { kind, start, end });
    }

    /// Send `grad` (the gradient of the micro-batch's summed loss w.r.t. the whole unit) to the
    /// unit's owners through the data path, asynchronously. A gradient with a NaN or ±inf is not
    /// sent: `Error::Step(StepError::NonFinite)` (see the module docs). A frozen unit
    /// ([`UnitSpec::frozen`](crate::layout::UnitSpec::frozen)) takes no gradient:
    /// [`Error::FrozenUnit`] and nothing is sent, not even a collective: in collective mode
    /// every trainer skips the unit alike.
    pub fn push_grad(&mut self, unit: UnitId, grad: &[f32]) -> Result<PushTicket> {
        self.check_push(unit, grad.len() as u64)?;
        let op = self.op(unit, OpKind::Push);
        let transfer = match self.path.push(op, grad) {
            Ok(transfer) => transfer,
            Err(bad) => {
                let error = self.non_finite_gradient(unit, Some(bad.index as u64), bad.value);
                return Err(error);
            }
        };
        Ok(self.spawn_push(unit, transfer))
    }

    /// [`TrainerContext::push_grad`] of a gradient in device memory (fp32, the whole unit), when
    /// [`TrainerContext::pushes_from_device`] says the data path reaches the owners: added into
    /// the accumulators device to device once it is ready. Its finiteness is the compute's to
    /// check ([`TrainerContext::non_finite_gradient`] fails the micro-batch).
    pub fn push_grad_device(
        &mut self,
        unit: UnitId,
        grad: Arc<dyn DeviceGrad>,
    ) -> Result<PushTicket> {
        self.check_push(unit, grad.src().bytes / 4)?;
        let op = self.op(unit, OpKind::Push);
        let transfer = self.path.push_device(op, grad);
        Ok(self.spawn_push(unit, transfer))
    }

    /// A non-finite gradient of `unit` (element `element` when known, `value` the first bad one
    /// seen): the error naming the trainer, micro-batch and samples, which also fails the
    /// micro-batch at its end whatever the compute does with it.
    pub fn non_finite_gradient(&mut self, unit: UnitId, element: Option<u64>, value: f32) -> Error {
        let error = Error::Step(StepError::NonFinite(Box::new(NonFiniteAt {
            what: "gradient".into(),
            step: self.version,
            trainer: Some(self.trainer),
            micro_batch: Some(self.micro_batch),
            samples: self.samples.clone(),
            unit: Some(unit),
            element,
            value: value.to_string(),
        })));
        self.non_finite.get_or_insert_with(|| error.clone());
        error
    }

    /// The checks of every push: the unit trains, the gradient is the unit's length, and the
    /// unit is pushed once per micro-batch.
    fn check_push(&mut self, unit: UnitId, len: u64) -> Result<()> {
        let spec = self.layout.unit(unit)?;
        if !spec.trainable {
            return Err(Error::FrozenUnit {
                unit,
                name: spec.name.clone(),
            });
        }
        if len != spec.len as u64 {
            return Err(Error::GradLength {
                unit,
                name: spec.name.clone(),
                expected: spec.len as u64,
                got: len,
            });
        }
        if !self.pushed.insert(unit) {
            return Err(Error::DuplicatePush {
                unit,
                micro_batch: self.micro_batch,
            });
        }
        Ok(())
    }

    /// Runs a push's transfer in its own task; its ticket resolves with the acknowledgements.
    fn spawn_push(&mut self, unit: UnitId, transfer: crate::datapath::Transfer<u64>) -> PushTicket {
        let (tx, rx) = oneshot::channel();
        let handle = tokio::spawn(async move {
            let result = transfer.await;
            let _ = tx.send(result.as_ref().map(|_| ()).map_err(Clone::clone));
            result
        });
        self.pushes.push((unit, handle));
        PushTicket { unit, rx }
    }

    /// The next operation on `unit` of `kind`; keys are assigned in call order.
    fn op(&mut self, unit: UnitId, kind: OpKind) -> Op {
        let occurrence = self.occurrences.entry((unit, kind)).or_insert(0);
        let key = OpKey {
            epoch: self.epoch,
            seq: self.seq,
            unit,
            kind,
            occurrence: *occurrence,
        };
        *occurrence += 1;
        Op {
            key,
            version: self.version,
            micro_batch: self.micro_batch,
            token: self.token,
            deadline: odc_transport::deadline_in(self.config.transfer_timeout),
        }
    }

    fn start_gather(&mut self, unit: UnitId) -> Result<crate::datapath::Transfer<Gathered>> {
        let len = self.layout.unit(unit)?.len;
        let op = self.op(unit, OpKind::Gather);
        if let (Some(memory), true) = (&self.device_memory, self.path.device_gathers()) {
            let lease = self.buffers.lease();
            return Ok(self.path.gather_device(op, len, memory.clone(), lease));
        }
        let (buffer, lease) = self.buffers.allocate(len);
        Ok(self.path.gather(op, buffer, lease))
    }

    /// The context takes a gathered buffer over: counted by weak reference from now on.
    fn take_over(&mut self, gathered: Gathered) -> UnitValues {
        let Gathered {
            values,
            bytes,
            lease,
        } = gathered;
        self.buffers.track(&values);
        drop(lease);
        self.stats.bytes_pulled += bytes;
        self.stats.pulls += 1;
        values
    }

    /// The kept unit, if this is the micro-batch's first gather and it asks for that unit at the
    /// version it was gathered at; any other first gather drops it.
    fn take_kept(&mut self, unit: UnitId) -> Option<UnitValues> {
        if !std::mem::take(&mut self.first_gather) {
            return None;
        }
        let kept = self.kept.take()?;
        (kept.unit == unit && kept.version == self.version).then_some(kept.values)
    }

    fn prefetch_after(&mut self, unit: UnitId) {
        let depth = self.config.prefetch as usize;
        let units = self.layout.len() as UnitId;
        let candidates: Vec<UnitId> = match self.direction {
            Direction::Forward => (unit.saturating_add(1)..units).take(depth).collect(),
            Direction::Backward => (self.backward_floor.min(unit)..unit)
                .rev()
                .take(depth)
                .collect(),
        };
        for next in candidates {
            if self.resident.len() + self.inflight.len() > depth {
                break;
            }
            if self.resident.contains_key(&next) || self.inflight.contains_key(&next) {
                continue;
            }
            if let Ok(transfer) = self.start_gather(next) {
                self.inflight.insert(next, tokio::spawn(transfer));
            }
        }
    }

    fn cancel_prefetches(&mut self) {
        for (_, handle) in self.inflight.drain() {
            handle.abort();
        }
    }

    fn note_held(&mut self) {
        let held = (self.resident.len() + self.inflight.len()) as u32;
        self.stats.peak_gathered = self.stats.peak_gathered.max(held);
        self.held_gauge.set(f64::from(held));
    }
}

impl Drop for TrainerContext {
    fn drop(&mut self) {
        self.cancel_prefetches();
    }
}

#[cfg(test)]
mod device_tests {
    //! The context's device plumbing on the CPU, with a data path that "gathers into device
    //! memory" by filling fake device buffers: what kind a gather returns, I5 over device
    //! buffers, the push checks, and a non-finite gradient failing the micro-batch.

    use std::any::Any;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;

    use odc_transport::{DeviceDest, Dtype};

    use super::*;
    use crate::datapath::Transfer;
    use crate::layout::UnitSpec;
    use crate::memory::buffers::Lease;
    use crate::memory::device::DeviceUnit;
    use crate::policy::batch::{LossWeighting, MicroBatch};

    /// A "device" buffer: host values behind a made-up address.
    struct FakeUnit {
        values: Mutex<Vec<f32>>,
        ptr: u64,
    }

    impl DeviceUnit for FakeUnit {
        fn dest(&self) -> DeviceDest {
            let len = self.values.lock().unwrap().len();
            DeviceDest {
                device: 0,
                ptr: self.ptr,
                bytes: (len * 4) as u64,
            }
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    #[derive(Default)]
    struct FakeMemory(AtomicU64);

    impl DeviceMemory for FakeMemory {
        fn allocate(&self, elements: usize, _: Dtype) -> Transfer<Arc<dyn DeviceUnit>> {
            let ptr = 0x1000 + self.0.fetch_add(1, Ordering::SeqCst) * 0x10_0000;
            Box::pin(async move {
                Ok(Arc::new(FakeUnit {
                    values: Mutex::new(vec![0.0; elements]),
                    ptr,
                }) as Arc<dyn DeviceUnit>)
            })
        }
    }

    struct FakeGrad(DeviceDest);

    impl DeviceGrad for FakeGrad {
        fn src(&self) -> DeviceDest {
            self.0
        }
        fn ready(&self) -> Transfer<()> {
            Box::pin(async { Ok(()) })
        }
    }

    /// Every unit is gathered with the value `unit + 1`; device pushes are counted.
    #[derive(Default)]
    struct FakePath {
        device_pushes: AtomicU64,
    }

    impl DataPath for FakePath {
        fn begin(&self, _: u64) {}

        fn gather(&self, op: Op, mut buffer: Arc<[f32]>, lease: Lease) -> Transfer<Gathered> {
            let value = op.key.unit as f32 + 1.0;
            Arc::get_mut(&mut buffer).unwrap().fill(value);
            Box::pin(async move {
                Ok(Gathered {
                    bytes: buffer.len() as u64 * 4,
                    values: UnitValues::Host(buffer),
                    lease,
                })
            })
        }

        fn push(
            &self,
            _: Op,
            grad: &[f32],
        ) -> std::result::Result<Transfer<u64>, crate::datapath::NonFiniteElement> {
            let bytes = grad.len() as u64 * 4;
            Ok(Box::pin(async move { Ok(bytes) }))
        }

        fn device_gathers(&self) -> bool {
            true
        }

        fn gather_device(
            &self,
            op: Op,
            len: usize,
            memory: Arc<dyn DeviceMemory>,
            lease: Lease,
        ) -> Transfer<Gathered> {
            Box::pin(async move {
                let buffer = memory.allocate(len, Dtype::F32).await?;
                let unit = buffer.as_any().downcast_ref::<FakeUnit>().unwrap();
                unit.values.lock().unwrap().fill(op.key.unit as f32 + 1.0);
                Ok(Gathered {
                    values: UnitValues::Device {
                        buffer,
                        dtype: Dtype::F32,
                    },
                    bytes: len as u64 * 4,
                    lease,
                })
            })
        }

        fn device_pushes(&self) -> bool {
            true
        }

        fn push_device(&self, _: Op, grad: Arc<dyn DeviceGrad>) -> Transfer<u64> {
            self.device_pushes.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move { Ok(grad.src().bytes) })
        }
    }

    fn context(path: Arc<FakePath>) -> TrainerContext {
        let mut frozen = UnitSpec::with_values("frozen", vec![0.0; 3]);
        frozen.trainable = false;
        let layout = ModelLayout::new(vec![
            UnitSpec::with_values("a", vec![0.0; 4]),
            UnitSpec::with_values("b", vec![0.0; 8]),
            frozen,
        ])
        .unwrap();
        TrainerContext::new(0, Arc::new(layout), path, ContextConfig::default())
    }

    fn micro_batch() -> MicroBatch {
        MicroBatch {
            step: 1,
            id: 0,
            samples: Vec::new(),
            tokens: 0,
            cost: 0.0,
            weighting: LossWeighting::Tokens,
            pieces: Vec::new(),
        }
    }

    fn device_values(values: &UnitValues) -> Vec<f32> {
        match values {
            UnitValues::Device { buffer, .. } => buffer
                .as_any()
                .downcast_ref::<FakeUnit>()
                .unwrap()
                .values
                .lock()
                .unwrap()
                .clone(),
            UnitValues::Host(_) => panic!("a host unit where a device one was expected"),
        }
    }

    fn grad(len: usize) -> Arc<dyn DeviceGrad> {
        Arc::new(FakeGrad(DeviceDest {
            device: 0,
            ptr: 0x9000,
            bytes: len as u64 * 4,
        }))
    }

    #[tokio::test]
    async fn gathers_land_in_device_memory_once_given_and_stay_bounded_i5() {
        let path = Arc::new(FakePath::default());
        let mut ctx = context(path.clone());
        ctx.begin(&micro_batch(), 1, 7, 0);
        assert!(!ctx.gathers_into_device(), "no device memory given yet");
        assert!(ctx.gather_values(0).await.unwrap().as_host().is_some());
        ctx.release(0).unwrap();
        ctx.gather_into_device(Arc::new(FakeMemory::default()));
        assert!(ctx.gathers_into_device());
        // The host prefetch of unit 1 was aborted: let the runtime drop it (and its lease).
        tokio::task::yield_now().await;
        for unit in 1..3 {
            let values = ctx.gather_values(unit).await.unwrap();
            assert_eq!(
                device_values(&values),
                vec![unit as f32 + 1.0; [4, 8, 3][unit as usize]]
            );
            assert!(
                ctx.live_unit_buffers() <= 2,
                "I5: {} live buffers with prefetch 1",
                ctx.live_unit_buffers()
            );
            drop(values);
            ctx.release(unit).unwrap();
        }
        // The host API names what went wrong instead of handing out device memory as host values.
        let err = ctx.gather(2).await.unwrap_err().to_string();
        assert!(err.contains("device memory"), "{err}");
        ctx.finish().await.unwrap();
    }

    #[tokio::test]
    async fn device_pushes_are_checked_like_host_ones() {
        let path = Arc::new(FakePath::default());
        let mut ctx = context(path.clone());
        ctx.begin(&micro_batch(), 1, 7, 0);
        assert!(ctx.pushes_from_device());
        let short = ctx.push_grad_device(0, grad(3)).unwrap_err();
        assert!(matches!(short, Error::GradLength { .. }), "{short}");
        ctx.push_grad_device(0, grad(4)).unwrap();
        let twice = ctx.push_grad_device(0, grad(4)).unwrap_err();
        assert!(matches!(twice, Error::DuplicatePush { .. }), "{twice}");
        let frozen = ctx.push_grad_device(2, grad(3)).unwrap_err();
        assert!(matches!(frozen, Error::FrozenUnit { .. }), "{frozen}");
        ctx.push_grad_device(1, grad(8))
            .unwrap()
            .wait()
            .await
            .unwrap();
        let stats = ctx.finish().await.unwrap();
        assert_eq!(stats.bytes_pushed, (4 + 8) * 4);
        assert_eq!(path.device_pushes.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_non_finite_device_gradient_fails_the_micro_batch() {
        let mut ctx = context(Arc::new(FakePath::default()));
        ctx.begin(&micro_batch(), 1, 7, 0);
        ctx.push_grad_device(0, grad(4)).unwrap();
        let said = ctx.non_finite_gradient(0, None, f32::NAN);
        assert!(
            matches!(said, Error::Step(StepError::NonFinite(_))),
            "{said}"
        );
        let outcome = ctx.finish().await.unwrap_err();
        assert_eq!(outcome.to_string(), said.to_string());
    }
}
