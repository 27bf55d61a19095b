//! [`TrainerContext`]: what user compute calls to move parameters and gradients.
//!
//! - `gather(unit)` pulls every shard of the unit concurrently, each shard in chunks
//!   ([`odc_transport::chunk_ranges`]), from every owner at once; it then prefetches the next
//!   `prefetch` units in forward order, or in reverse order after [`TrainerContext::backward`].
//! - `release(unit)` drops the context's reference to a gathered unit.
//! - `push_grad(unit, grad)` splits the gradient by owner and chunk and sends it asynchronously; the
//!   returned [`PushTicket`] resolves when every owner acknowledged. The trainer waits for all pushes
//!   before it reports the micro-batch done (ledger rule, DESIGN step 4).
//!
//! Invariants:
//! - **I1 consistency**: every chunk read carries the version it was published with; a chunk whose
//!   version differs from the micro-batch's step is refused ([`Error::VersionMismatch`]).
//! - **I5 bounded memory**: prefetches are issued only while gathered units plus prefetches in flight
//!   stay within `prefetch + 1`, so a compute that releases what it no longer needs never holds more
//!   than `prefetch + 1` gathered units ([`MicroBatchStats::peak_gathered`]). Units the user gathers
//!   explicitly are always served.
//! - Pushes carry a [`WriteTag`] with the attempt's epoch and a write id unique per
//!   (micro-batch, unit, shard, chunk), so owners refuse duplicates and late writes (I2).

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::join_all;
use odc_transport::{chunk_ranges, codec, Dtype, EndpointId, RegionHandle, Transport, WriteTag};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::collective::{self, CollectiveGroup, OpKey, OpKind, UnitPlace};
use crate::compute::MicroBatch;
use crate::directory::{Directory, ShardRoute};
use crate::error::{Error, Result};
use crate::layout::{ModelLayout, UnitId};
use crate::metrics as m;
use crate::policy::clock::SystemClock;
use crate::policy::stats::{Span, SpanKind};

/// Knobs of the trainer-side data path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextConfig {
    /// Units prefetched ahead of the one being gathered (0 disables prefetching).
    pub prefetch: usize,
    /// Chunk size of reads and gradient pushes, in elements.
    pub chunk_elems: usize,
}

impl Default for ContextConfig {
    fn default() -> Self {
        ContextConfig {
            prefetch: 1,
            chunk_elems: 1 << 18,
        }
    }
}

/// Order in which units are being gathered; prefetching follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Forward,
    Backward,
}

/// What one micro-batch's data path did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MicroBatchStats {
    /// Time the compute was blocked in `gather`.
    pub pull_wait: Duration,
    /// Time spent waiting for push acknowledgements after the compute returned.
    pub push_wait: Duration,
    pub bytes_pulled: u64,
    pub bytes_pushed: u64,
    /// Most gathered units held at once (gathered and not released, plus prefetches in flight).
    pub peak_gathered: usize,
    /// Units pulled (demand pulls and prefetches).
    pub pulls: usize,
    /// Timeline of the micro-batch: pull waits, push wait, and spans the compute recorded.
    pub spans: Vec<Span>,
}

/// A pulled unit's values and the bytes moved.
type Pulled = (Arc<[f32]>, u64);

/// Bytes a push moved once acknowledged.
type PushResult = Result<u64>;

/// Resolves when every owner acknowledged one `push_grad`.
#[derive(Debug)]
pub struct PushTicket {
    unit: UnitId,
    rx: oneshot::Receiver<PushResult>,
}

impl PushTicket {
    /// Wait for the acknowledgements.
    pub async fn wait(self) -> Result<()> {
        match self.rx.await {
            Ok(result) => result.map(|_| ()),
            Err(_) => Err(Error::Actor {
                actor: "trainer".into(),
                reason: format!("push of unit {} was cancelled", self.unit),
            }),
        }
    }
}

/// The trainer-side API handed to [`Compute::run`](crate::compute::Compute::run).
pub struct TrainerContext {
    trainer: usize,
    transport: Arc<dyn Transport>,
    layout: Arc<ModelLayout>,
    directory: Arc<Directory>,
    config: ContextConfig,
    /// Some in collective mode: gathers are all-gathers, pushes reduce-scatters.
    collective: Option<Arc<CollectiveGroup>>,
    /// Micro-batch sequence number within `epoch` (collectives pair up by it).
    seq: u64,
    seq_epoch: Option<u64>,
    occurrences: HashMap<(UnitId, OpKind), u32>,
    // Per micro-batch state.
    version: u64,
    epoch: u64,
    micro_batch: usize,
    direction: Direction,
    /// The unit gathered last; backward prefetching starts below it.
    last_gathered: Option<UnitId>,
    resident: HashMap<UnitId, Arc<[f32]>>,
    inflight: HashMap<UnitId, JoinHandle<Result<Pulled>>>,
    pushes: Vec<(UnitId, JoinHandle<PushResult>)>,
    pushed: HashSet<UnitId>,
    stats: MicroBatchStats,
}

impl TrainerContext {
    /// A context for trainer `trainer`.
    pub fn new(
        trainer: usize,
        transport: Arc<dyn Transport>,
        layout: Arc<ModelLayout>,
        directory: Arc<Directory>,
        config: ContextConfig,
        collective: Option<Arc<CollectiveGroup>>,
    ) -> Self {
        TrainerContext {
            trainer,
            transport,
            layout,
            directory,
            config,
            collective,
            seq: 0,
            seq_epoch: None,
            occurrences: HashMap::new(),
            version: 0,
            epoch: 0,
            micro_batch: 0,
            direction: Direction::Forward,
            last_gathered: None,
            resident: HashMap::new(),
            inflight: HashMap::new(),
            pushes: Vec::new(),
            pushed: HashSet::new(),
            stats: MicroBatchStats::default(),
        }
    }

    /// This trainer's index.
    pub fn trainer(&self) -> usize {
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

    /// Start of a micro-batch (called by the trainer actor).
    pub(crate) fn begin(&mut self, micro_batch: &MicroBatch, epoch: u64) {
        self.cancel_prefetches();
        self.resident.clear();
        self.pushed.clear();
        self.version = micro_batch.step;
        self.seq = match self.seq_epoch {
            Some(e) if e == epoch => self.seq + 1,
            _ => 0,
        };
        self.seq_epoch = Some(epoch);
        self.occurrences.clear();
        self.epoch = epoch;
        self.micro_batch = micro_batch.id;
        self.direction = Direction::Forward;
        self.last_gathered = None;
        self.stats = MicroBatchStats::default();
    }

    /// End of a micro-batch: drop gathered units and prefetches, wait for every push's
    /// acknowledgement. Returns the micro-batch's stats, or the first push failure.
    pub(crate) async fn finish(&mut self) -> Result<MicroBatchStats> {
        self.cancel_prefetches();
        self.resident.clear();
        let started = Instant::now();
        let mut first_err = None;
        for (unit, handle) in self.pushes.drain(..) {
            let outcome = match handle.await {
                Ok(Ok(bytes)) => {
                    self.stats.bytes_pushed += bytes;
                    continue;
                }
                Ok(Err(e)) => e,
                Err(e) => Error::Actor {
                    actor: format!("trainer {}", self.trainer),
                    reason: format!("push task of unit {unit} failed: {e}"),
                },
            };
            first_err.get_or_insert(outcome);
        }
        self.stats.push_wait += started.elapsed();
        self.record_span(SpanKind::PushWait, started, Instant::now());
        metrics::gauge!(m::GATHERED_UNITS, "trainer" => self.trainer.to_string()).set(0.0);
        match first_err {
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
            if let Some(last) = self.last_gathered {
                self.prefetch_after(last);
                self.note_held();
            }
        }
    }

    /// Pull every shard of `unit` (or take it from a prefetch), then prefetch ahead.
    pub async fn gather(&mut self, unit: UnitId) -> Result<Arc<[f32]>> {
        self.layout.unit(unit)?;
        self.last_gathered = Some(unit);
        if let Some(data) = self.resident.get(&unit) {
            return Ok(data.clone());
        }
        let started = Instant::now();
        let prefetched = match self.inflight.remove(&unit) {
            Some(handle) => handle.await.ok(),
            None => None,
        };
        let (data, bytes) = match prefetched {
            Some(result) => result?,
            None => self.pull_task(unit).await?,
        };
        self.stats.pull_wait += started.elapsed();
        self.record_span(SpanKind::PullWait, started, Instant::now());
        self.stats.bytes_pulled += bytes;
        self.stats.pulls += 1;
        self.resident.insert(unit, data.clone());
        self.prefetch_after(unit);
        self.note_held();
        Ok(data)
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
    pub fn record_span(&mut self, kind: SpanKind, start: Instant, end: Instant) {
        self.stats.spans.push(Span {
            kind,
            start: SystemClock::at(start),
            end: SystemClock::at(end),
        });
    }

    /// Units currently gathered and not released.
    pub fn gathered(&self) -> usize {
        self.resident.len()
    }

    /// Send `grad` (the gradient of the micro-batch's summed loss w.r.t. the whole unit) to the
    /// unit's owners, split by shard and chunk, asynchronously.
    pub fn push_grad(&mut self, unit: UnitId, grad: &[f32]) -> Result<PushTicket> {
        let spec = self.layout.unit(unit)?;
        if grad.len() != spec.len {
            return Err(Error::GradLength {
                unit,
                name: spec.name.clone(),
                expected: spec.len,
                got: grad.len(),
            });
        }
        if !self.pushed.insert(unit) {
            return Err(Error::DuplicatePush {
                unit,
                micro_batch: self.micro_batch,
            });
        }
        let routes = self.routes(unit)?.to_vec();
        let transport = self.transport.clone();
        let (epoch, micro_batch, chunk) = (self.epoch, self.micro_batch, self.config.chunk_elems);
        let tag = move |shard: usize, chunk: usize| WriteTag {
            epoch,
            write_id: write_id(micro_batch, unit, shard, chunk),
        };
        let len = grad.len();
        // On demand, the chunks are encoded here, straight from the caller's gradient; a
        // reduce-scatter needs its own copy to add partial sums into.
        let work = match self.collective_op(unit, OpKind::ReduceScatter) {
            Some(op) => PushWork::ReduceScatter(op, grad.to_vec()),
            None => PushWork::Encoded(encode_writes(&routes, 0..len, grad, &tag, chunk)),
        };
        let (tx, rx) = oneshot::channel();
        let handle = tokio::spawn(async move {
            let result = match work {
                PushWork::Encoded(writes) => send_writes(&transport, unit, writes).await,
                PushWork::ReduceScatter((group, key, rank), grad) => {
                    let place = UnitPlace {
                        unit,
                        len,
                        routes: &routes,
                    };
                    collective::reduce_scatter(
                        transport.clone(),
                        group,
                        key,
                        rank,
                        place,
                        grad,
                        tag,
                        chunk,
                    )
                    .await
                }
            };
            if let Ok(bytes) = result {
                metrics::counter!(m::BYTES_PUSHED, "transport" => transport.backend())
                    .increment(bytes);
            }
            let _ = tx.send(result.clone());
            result
        });
        self.pushes.push((unit, handle));
        Ok(PushTicket { unit, rx })
    }

    fn routes(&self, unit: UnitId) -> Result<&[ShardRoute]> {
        self.directory
            .units
            .get(unit)
            .map(Vec::as_slice)
            .ok_or(Error::UnknownUnit {
                unit,
                units: self.directory.units.len(),
            })
    }

    /// The collective operation a gather or push of `unit` joins (collective mode only).
    fn collective_op(
        &mut self,
        unit: UnitId,
        kind: OpKind,
    ) -> Option<(Arc<CollectiveGroup>, OpKey, usize)> {
        let group = self.collective.clone()?;
        let occurrence = self.occurrences.entry((unit, kind)).or_insert(0);
        let key = OpKey {
            epoch: self.epoch,
            seq: self.seq,
            unit,
            kind,
            occurrence: *occurrence,
        };
        *occurrence += 1;
        Some((group, key, self.trainer))
    }

    fn pull_task(&mut self, unit: UnitId) -> impl std::future::Future<Output = Result<Pulled>> {
        let routes = self.routes(unit).map(<[ShardRoute]>::to_vec);
        let len = self.layout.unit(unit).map(|u| u.len);
        let transport = self.transport.clone();
        let (version, chunk) = (self.version, self.config.chunk_elems);
        let collective = self.collective_op(unit, OpKind::AllGather);
        async move {
            let (routes, len) = (routes?, len?);
            let started = Instant::now();
            let (values, bytes) = match collective {
                Some((group, key, rank)) => {
                    let place = UnitPlace {
                        unit,
                        len,
                        routes: &routes,
                    };
                    collective::all_gather(
                        transport.clone(),
                        group,
                        key,
                        rank,
                        place,
                        version,
                        chunk,
                    )
                    .await?
                }
                None => {
                    let mut out = vec![0f32; len];
                    let bytes =
                        pull_range(&transport, &routes, unit, 0..len, version, chunk, &mut out)
                            .await?;
                    (out, bytes)
                }
            };
            metrics::histogram!(m::PULL_SECONDS, "transport" => transport.backend())
                .record(started.elapsed().as_secs_f64());
            Ok((values.into(), bytes))
        }
    }

    fn prefetch_after(&mut self, unit: UnitId) {
        let depth = self.config.prefetch;
        let candidates: Vec<UnitId> = match self.direction {
            Direction::Forward => (unit + 1..self.layout.len()).take(depth).collect(),
            Direction::Backward => (0..unit).rev().take(depth).collect(),
        };
        for next in candidates {
            if self.resident.len() + self.inflight.len() > depth {
                break;
            }
            if self.resident.contains_key(&next) || self.inflight.contains_key(&next) {
                continue;
            }
            let task = tokio::spawn(self.pull_task(next));
            self.inflight.insert(next, task);
        }
    }

    fn cancel_prefetches(&mut self) {
        for (_, handle) in self.inflight.drain() {
            handle.abort();
        }
    }

    fn note_held(&mut self) {
        let held = self.resident.len() + self.inflight.len();
        self.stats.peak_gathered = self.stats.peak_gathered.max(held);
        metrics::gauge!(m::GATHERED_UNITS, "trainer" => self.trainer.to_string()).set(held as f64);
    }
}

impl Drop for TrainerContext {
    fn drop(&mut self) {
        self.cancel_prefetches();
    }
}

/// Write id unique per (micro-batch, unit, shard, chunk) within one epoch.
fn write_id(micro_batch: usize, unit: UnitId, shard: usize, chunk: usize) -> u128 {
    ((micro_batch as u128 & 0xffff_ffff) << 96)
        | ((unit as u128 & 0xffff_ffff) << 64)
        | ((shard as u128 & 0xffff_ffff) << 32)
        | (chunk as u128 & 0xffff_ffff)
}

/// Read elements `range` of a unit from the shards overlapping it, every chunk of every shard
/// concurrently, decoding into `out` (`range.len()` elements). Returns the bytes moved.
pub(crate) async fn pull_range(
    transport: &Arc<dyn Transport>,
    routes: &[ShardRoute],
    unit: UnitId,
    range: Range<usize>,
    version: u64,
    chunk_elems: usize,
    out: &mut [f32],
) -> Result<u64> {
    let reads = routes.iter().flat_map(|route| {
        let overlap = overlap(&route.range, &range);
        chunk_ranges(overlap, chunk_elems).map(move |r: Range<usize>| async move {
            // `r` is in unit coordinates; the region starts at the shard's start.
            let local = r.start - route.range.start..r.end - route.range.start;
            let result = transport.read(&route.published, local).await;
            (route, r, result)
        })
    });
    let mut bytes = 0u64;
    for (route, r, result) in join_all(reads).await {
        let owner = route.owner;
        let chunk = result.map_err(|source| Error::Pull {
            unit,
            owner,
            source,
        })?;
        if chunk.version != version {
            return Err(Error::VersionMismatch {
                unit,
                owner,
                expected: version,
                got: chunk.version,
            });
        }
        let dst = &mut out[r.start - range.start..r.end - range.start];
        codec::decode_into(route.published.dtype, &chunk.bytes, dst).map_err(|e| Error::Pull {
            unit,
            owner,
            source: e.for_region(route.published.id),
        })?;
        bytes += chunk.bytes.len() as u64;
    }
    metrics::counter!(m::BYTES_PULLED, "transport" => transport.backend()).increment(bytes);
    Ok(bytes)
}

/// What a push task does: send chunks already encoded, or reduce-scatter an owned gradient.
enum PushWork {
    Encoded(Vec<Write>),
    ReduceScatter((Arc<CollectiveGroup>, OpKey, usize), Vec<f32>),
}

/// One encoded gradient chunk bound for one shard's accumulator.
pub(crate) struct Write {
    accumulator: RegionHandle,
    owner: EndpointId,
    offset: usize,
    data: Bytes,
    tag: WriteTag,
}

/// Encode `values` (elements `range` of a unit's gradient) as chunks for the shards overlapping
/// it, tagged by `tag(shard index, chunk index)`. The only copy of the gradient's bytes.
pub(crate) fn encode_writes(
    routes: &[ShardRoute],
    range: Range<usize>,
    values: &[f32],
    tag: &impl Fn(usize, usize) -> WriteTag,
    chunk_elems: usize,
) -> Vec<Write> {
    let mut writes = Vec::new();
    for (shard, route) in routes.iter().enumerate() {
        for (chunk, r) in chunk_ranges(overlap(&route.range, &range), chunk_elems).enumerate() {
            writes.push(Write {
                accumulator: route.accumulator.clone(),
                owner: route.owner,
                offset: r.start - route.range.start,
                data: codec::encode(
                    Dtype::F32,
                    &values[r.start - range.start..r.end - range.start],
                ),
                tag: tag(shard, chunk),
            });
        }
    }
    writes
}

/// Accumulate every write concurrently; resolves when all are acknowledged. Returns the bytes moved.
pub(crate) async fn send_writes(
    transport: &Arc<dyn Transport>,
    unit: UnitId,
    writes: Vec<Write>,
) -> Result<u64> {
    let sends = writes.into_iter().map(|w| async move {
        let bytes = w.data.len() as u64;
        transport
            .accumulate(&w.accumulator, w.offset, w.data, w.tag)
            .await
            .map(|()| bytes)
            .map_err(|source| Error::Push {
                unit,
                owner: w.owner,
                source,
            })
    });
    join_all(sends).await.into_iter().sum()
}

/// The intersection of two ranges (empty when disjoint).
fn overlap(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    let start = a.start.max(b.start);
    start..a.end.min(b.end).max(start)
}
