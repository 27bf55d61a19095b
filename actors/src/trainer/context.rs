//! [`TrainerContext`]: what user compute calls to move parameters and gradients. It never branches on
//! the communication mode: transfers go through the trainer's [`DataPath`].
//!
//! - `gather(unit)` returns the whole unit at the micro-batch's version, pulled on demand or taken
//!   from a prefetch, then prefetches the next `prefetch` units in forward order, or in reverse
//!   order after [`TrainerContext::backward`].
//! - `release(unit)` drops the context's reference to a gathered unit.
//! - `push_grad(unit, grad)` hands the unit's gradient to the data path, which sends it
//!   asynchronously; the returned [`PushTicket`] resolves when every owner acknowledged. The trainer
//!   waits for all pushes before it reports the micro-batch done (ledger rule, docs/design.md "One minibatch", step 4).
//! - A gradient with a NaN or ±inf element is never sent (the data path checks it in the pass that
//!   encodes or copies it): `push_grad` returns [`Error::NonFinite`] naming the trainer, the
//!   micro-batch, its samples, the unit and the first bad element, and the micro-batch fails with
//!   that error even if the compute ignores it.
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
//! - **I5 bounded memory**: prefetches are issued only while gathered units plus prefetches in flight
//!   stay within `prefetch + 1`, so a compute that releases what it no longer needs never holds more
//!   than `prefetch + 1` gathered units; [`TrainerContext::live_unit_buffers`] measures it from the
//!   buffers themselves. Units the user gathers explicitly are always served.
//! - Every transfer has a deadline (`transfer_timeout`, **I6**).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::buffers::UnitBuffers;
use crate::batch::MicroBatch;
use crate::datapath::{DataPath, GangChannel, Gathered, Op, OpKey, OpKind};
use crate::error::{Error, Result};
use crate::layout::{ModelLayout, UnitId};
use crate::metrics as m;
use crate::policy::clock::{Clock, SystemClock, Timestamp};
use crate::policy::stats::{Span, SpanKind};
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
    values: Arc<[f32]>,
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
    last_gathered: Option<(UnitId, Arc<[f32]>)>,
    kept: Option<Kept>,
    resident: HashMap<UnitId, Arc<[f32]>>,
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

    /// Start of a micro-batch of attempt `epoch` whose assignment carries `token` (called by the
    /// trainer actor).
    pub(crate) fn begin(&mut self, micro_batch: &MicroBatch, epoch: u64, token: u128) {
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

    /// The whole unit at this micro-batch's version: already gathered, kept from the previous
    /// micro-batch, prefetched, or pulled now; then prefetch ahead.
    pub async fn gather(&mut self, unit: UnitId) -> Result<Arc<[f32]>> {
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
    /// sent: [`Error::NonFinite`] (see the module docs). A frozen unit
    /// ([`UnitSpec::frozen`](crate::layout::UnitSpec::frozen)) takes no gradient:
    /// [`Error::FrozenUnit`] and nothing is sent, not even a collective: in collective mode
    /// every trainer skips the unit alike.
    pub fn push_grad(&mut self, unit: UnitId, grad: &[f32]) -> Result<PushTicket> {
        let spec = self.layout.unit(unit)?;
        if !spec.trainable {
            return Err(Error::FrozenUnit {
                unit,
                name: spec.name.clone(),
            });
        }
        if grad.len() != spec.len {
            return Err(Error::GradLength {
                unit,
                name: spec.name.clone(),
                expected: spec.len as u64,
                got: grad.len() as u64,
            });
        }
        if !self.pushed.insert(unit) {
            return Err(Error::DuplicatePush {
                unit,
                micro_batch: self.micro_batch,
            });
        }
        let op = self.op(unit, OpKind::Push);
        let transfer = match self.path.push(op, grad) {
            Ok(transfer) => transfer,
            Err(bad) => {
                let error = Error::NonFinite(Box::new(NonFiniteAt {
                    what: "gradient".into(),
                    step: self.version,
                    trainer: Some(self.trainer),
                    micro_batch: Some(self.micro_batch),
                    samples: self.samples.clone(),
                    unit: Some(unit),
                    element: Some(bad.index as u64),
                    value: bad.value.to_string(),
                }));
                self.non_finite.get_or_insert_with(|| error.clone());
                return Err(error);
            }
        };
        let (tx, rx) = oneshot::channel();
        let handle = tokio::spawn(async move {
            let result = transfer.await;
            let _ = tx.send(result.as_ref().map(|_| ()).map_err(Clone::clone));
            result
        });
        self.pushes.push((unit, handle));
        Ok(PushTicket { unit, rx })
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
        let (buffer, lease) = self.buffers.allocate(len);
        let op = self.op(unit, OpKind::Gather);
        Ok(self.path.gather(op, buffer, lease))
    }

    /// The context takes a gathered buffer over: counted by weak reference from now on.
    fn take_over(&mut self, gathered: Gathered) -> Arc<[f32]> {
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
    fn take_kept(&mut self, unit: UnitId) -> Option<Arc<[f32]>> {
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
