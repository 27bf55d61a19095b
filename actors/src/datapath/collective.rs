//! The collective data path: the FSDP baseline at its best (docs/design.md, "As built": data
//! paths), over the same transport, servers and chunking as on-demand mode. Only the paradigm
//! differs.
//!
//! A unit is split into one **piece** per trainer (`shard_range(len, trainers, rank)`); with as
//! many servers as trainers, piece `r` is exactly the shard of server `r`, the server on trainer
//! `r`'s own device, as in FSDP where every rank owns its shard.
//! - **All-gather**: trainer `r` reads its own piece from the owners (raw bytes in the pull dtype,
//!   so bf16 pulls make bf16 all-gathers), decodes it into the unit buffer and sends the bytes to
//!   its right neighbour's inbox. In each of `n − 1` steps it receives one piece from its left
//!   neighbour, decodes it and forwards the same bytes (zero copy) to its right neighbour, except
//!   in the last step.
//! - **Reduce-scatter**: in step `k` trainer `r` sends its partial sum of piece `r − k − 1` to its
//!   right neighbour and adds the partial of piece `r − k − 2` its left neighbour sent into its
//!   own; after `n − 1` steps it holds the full sum of piece `r` and writes it into the owners'
//!   accumulators (its own device's server when servers = trainers), acknowledged, under its own
//!   micro-batch's write ids and assignment token (the servers admit nothing else, transport C8).
//!   The ring's own messages carry the token too, but inboxes do not check it: a peer that can
//!   write into a trainer's inbox can corrupt that trainer's collective.
//! - **Across nodes** ([`CollectiveGroup::with_node_size`] `g`, ranks of a node contiguous): both
//!   collectives run in two levels, as NCCL does across nodes. The all-gather first runs the ring
//!   above over the `nodes` ranks of each rail (lane `j` of every node), then a ring inside the
//!   node whose messages carry a whole rail: its `nodes` pieces, in node order, in one message.
//!   The reduce-scatter does the reverse: a ring inside the node over rails, then a ring over the
//!   nodes of each rail. Each trainer sends `nodes + g − 2` messages per collective instead of
//!   `n − 1`, and every NIC of a node carries its own rail. `g` = 1 is the flat ring.
//!
//! **In device memory** (feature `cuda-code`, the `cuda` transport, one flat ring): the same
//! rings with their pieces as device messages, from and into the trainer's device memory
//! ([`device`]); a two-level ring there keeps the host path.
//!
//! Signalling is neighbour-only: a step's message is its own signal (transport C7, NCCL's
//! send/recv), so no global barrier exists anywhere in a collective. Inboxes are registered once
//! per trainer (persistent staging); messages are keyed by [`OpKey::message_id`] and carry the
//! attempt's epoch.
//!
//! Invariants:
//! - Every trainer must issue the same collectives in the same order with the same micro-batch
//!   count per step (LB-Micro plans guarantee the counts; the context assigns keys in call order).
//! - **I6 / I2 replay**: [`CollectiveGroup::abort_before`] raises an epoch floor. An operation of
//!   an older epoch fails at once with [`Error::CollectiveAborted`] — whether it is already waiting
//!   or only starts after the discard — and every wait also ends at the operation's deadline, with
//!   an error naming the peer it waited for.

#[cfg(feature = "cuda-code")]
mod device;

use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::stream::{FuturesUnordered, StreamExt};
use odc_transport::{
    codec, EndpointId, InboxRegion, RegionHandle, Transport, TransportError, WriteTag,
};
use tokio::sync::watch;

use super::on_demand::unique;
use super::transfer::{self, Out};
use super::{DataPath, Gathered, NonFiniteElement, Op, OpKey, Transfer};
use crate::directory::Directory;
use crate::error::{Error, Result};
use crate::layout::{shard_range, UnitId};
use crate::memory::buffers::Lease;
use crate::metrics::TransferMetrics;

/// Endpoint id of trainer `rank`'s inbox (servers use `0..servers`); `endpoint %
/// TRAINER_ENDPOINT_BASE` is the device a trainer shares with its server.
pub const TRAINER_ENDPOINT_BASE: EndpointId = 1 << 24;

/// The trainers taking part in collectives: where each one's inbox is, and the epoch floor below
/// which every operation is aborted.
#[derive(Debug)]
pub struct CollectiveGroup {
    size: u32,
    /// Trainers per node (`size` is a multiple of it; 1: one flat ring).
    node_size: u32,
    inboxes: Mutex<Vec<Option<RegionHandle>>>,
    floor: watch::Sender<u64>,
}

impl CollectiveGroup {
    /// A group of `size` trainers (ranks `0..size`), floor 0, one flat ring.
    pub fn new(size: u32) -> Self {
        CollectiveGroup {
            size: size.max(1),
            node_size: 1,
            inboxes: Mutex::new(vec![None; size.max(1) as usize]),
            floor: watch::Sender::new(0),
        }
    }

    /// Trainers `node_size` to a node (ranks of a node contiguous): collectives run as a ring over
    /// the nodes on each rail, then a ring inside each node (see the module docs). A size that
    /// does not divide the group (or 0) keeps the flat ring.
    pub fn with_node_size(mut self, node_size: u32) -> Self {
        self.node_size = if node_size > 0 && self.size % node_size == 0 {
            node_size
        } else {
            1
        };
        self
    }

    pub fn size(&self) -> u32 {
        self.size
    }

    /// Trainers per node (1: a flat ring).
    pub fn node_size(&self) -> u32 {
        self.node_size
    }

    fn inboxes(&self) -> std::sync::MutexGuard<'_, Vec<Option<RegionHandle>>> {
        self.inboxes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Record (or replace, for a respawned trainer) the inbox of `rank`.
    pub fn register(&self, rank: u32, inbox: RegionHandle) -> Result<()> {
        let size = self.size;
        match self.inboxes().get_mut(rank as usize) {
            Some(slot) => {
                *slot = Some(inbox);
                Ok(())
            }
            None => Err(Error::Config(format!(
                "collective rank {rank} is outside a group of {size}"
            ))),
        }
    }

    /// The inbox of `rank`.
    pub fn inbox(&self, rank: u32) -> Result<RegionHandle> {
        self.inboxes()
            .get(rank as usize)
            .cloned()
            .flatten()
            .ok_or_else(|| Error::Config(format!("collective rank {rank} has no inbox yet")))
    }

    /// Abort every operation of an epoch before `epoch` (a discarded attempt), now and later.
    pub fn abort_before(&self, epoch: u64) {
        self.floor.send_if_modified(|floor| {
            let raise = epoch > *floor;
            if raise {
                *floor = epoch;
            }
            raise
        });
    }

    /// Operations of epochs below this fail at once.
    pub fn floor(&self) -> u64 {
        *self.floor.borrow()
    }

    /// Resolves once operations of `epoch` are aborted.
    pub fn aborted(&self, epoch: u64) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.floor.subscribe();
        async move {
            while *rx.borrow_and_update() <= epoch {
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        }
    }

    fn check(&self, key: &OpKey) -> Result<()> {
        if key.epoch < self.floor() {
            Err(Error::CollectiveAborted)
        } else {
            Ok(())
        }
    }
}

/// One trainer's collective data path. See the [module docs](self).
pub struct Collective {
    inner: Arc<Inner>,
}

struct Inner {
    rank: u32,
    transport: Arc<dyn Transport>,
    group: Arc<CollectiveGroup>,
    inbox: Arc<dyn InboxRegion>,
    /// The inbox's region id, named by errors about what arrived in it.
    inbox_id: odc_transport::RegionId,
    directory: Arc<Directory>,
    chunk_elems: usize,
    metrics: TransferMetrics,
}

impl Collective {
    /// Register trainer `rank`'s inbox on `transport` and join `group`.
    pub fn new(
        rank: u32,
        transport: Arc<dyn Transport>,
        group: Arc<CollectiveGroup>,
        directory: Arc<Directory>,
        chunk_elems: usize,
    ) -> Result<Self> {
        let inbox: Arc<dyn InboxRegion> =
            Arc::from(transport.register_inbox(TRAINER_ENDPOINT_BASE + rank, group.floor())?);
        group.register(rank, inbox.handle())?;
        let metrics = TransferMetrics::new(transport.backend());
        Ok(Collective {
            inner: Arc::new(Inner {
                rank,
                transport,
                group,
                inbox_id: inbox.handle().id,
                inbox,
                directory,
                chunk_elems: chunk_elems.max(1),
                metrics,
            }),
        })
    }
}

impl Collective {
    /// This trainer's inbox, which its gangs' exchange shares in collective mode
    /// ([`GangChannel::sharing`](super::GangChannel::sharing)).
    pub fn inbox(&self) -> Arc<dyn InboxRegion> {
        self.inner.inbox.clone()
    }
}

type SendFut = futures::future::BoxFuture<'static, Result<()>>;

/// Where a trainer sits: `nodes` × `per_node` ranks, rank = node · per_node + lane.
#[derive(Debug, Clone, Copy)]
struct Grid {
    n: u32,
    per_node: u32,
    nodes: u32,
    node: u32,
    lane: u32,
}

impl Grid {
    /// Its neighbours (left, right) on its rail's ring over the nodes.
    fn rail(&self) -> (u32, u32) {
        let at = |node: u32| node * self.per_node + self.lane;
        (
            at((self.node + self.nodes - 1) % self.nodes),
            at((self.node + 1) % self.nodes),
        )
    }

    /// Its neighbours (left, right) on its node's ring.
    fn ring_in_node(&self) -> (u32, u32) {
        let at = |lane: u32| self.node * self.per_node + lane;
        (
            at((self.lane + self.per_node - 1) % self.per_node),
            at((self.lane + 1) % self.per_node),
        )
    }

    /// `x − back` modulo `m`.
    fn behind(x: u32, back: u32, m: u32) -> u32 {
        ((u64::from(x) + 2 * u64::from(m) - u64::from(back) % u64::from(m)) % u64::from(m)) as u32
    }

    /// The pieces of `lane`'s rail (one per node, in node order) of a unit of `len` elements.
    fn bundle(&self, len: usize, lane: u32) -> Vec<std::ops::Range<usize>> {
        (0..self.nodes)
            .map(|m| shard_range(len, self.n as usize, (m * self.per_node + lane) as usize))
            .collect()
    }

    /// Piece of rank (node, lane) of a unit of `len` elements.
    fn piece(&self, len: usize, node: u32, lane: u32) -> std::ops::Range<usize> {
        shard_range(len, self.n as usize, (node * self.per_node + lane) as usize)
    }
}

impl Inner {
    fn grid(&self) -> Grid {
        let (n, per_node) = (self.group.size, self.group.node_size);
        Grid {
            n,
            per_node,
            nodes: n / per_node,
            node: self.rank / per_node,
            lane: self.rank % per_node,
        }
    }

    fn send(&self, to: &RegionHandle, peer: u32, op: &Op, round: u32, data: Bytes) -> SendFut {
        let (transport, handle) = (self.transport.clone(), to.clone());
        let tag = Self::tag(op, round);
        let (unit, deadline) = (op.key.unit, op.deadline);
        Box::pin(async move {
            transport
                .send(&handle, tag, data, deadline)
                .await
                .map_err(|source| ring_error(unit, peer, source))
        })
    }

    /// Wait for step `round`'s message from the left neighbour `left`, driving this trainer's own
    /// sends meanwhile; fails at once when the epoch is aborted.
    async fn recv(
        &self,
        op: &Op,
        round: u32,
        left: u32,
        sends: &mut FuturesUnordered<SendFut>,
    ) -> Result<Bytes> {
        let recv = self.inbox.recv(Self::tag(op, round), op.deadline);
        self.ring_recv(op, left, sends, recv).await
    }

    /// Step `round`'s message tag. Inboxes match epoch and write id only; the token is the
    /// sender's, not the receiver's.
    fn tag(op: &Op, round: u32) -> WriteTag {
        WriteTag {
            epoch: op.key.epoch,
            write_id: op.key.message_id(round),
            token: op.token,
        }
    }

    /// `recv` (a receive from the left neighbour `left`), driving this trainer's own sends
    /// meanwhile; fails at once when the epoch is aborted.
    async fn ring_recv<T>(
        &self,
        op: &Op,
        left: u32,
        sends: &mut FuturesUnordered<SendFut>,
        recv: impl Future<Output = std::result::Result<T, TransportError>>,
    ) -> Result<T> {
        let aborted = self.group.aborted(op.key.epoch);
        tokio::pin!(recv, aborted);
        loop {
            tokio::select! {
                biased;
                () = &mut aborted => return Err(Error::CollectiveAborted),
                Some(sent) = sends.next(), if !sends.is_empty() => sent?,
                got = &mut recv => {
                    return got.map_err(|source| match source {
                        TransportError::Aborted { .. } => Error::CollectiveAborted,
                        source => ring_error(op.key.unit, left, source),
                    });
                }
            }
        }
    }

    /// Decode a piece `peer` sent (or this trainer read) into `out`; a piece of the wrong length is
    /// an error naming the peer and this trainer's inbox.
    fn decode(
        &self,
        dtype: odc_transport::Dtype,
        bytes: &[u8],
        out: &mut [f32],
        unit: UnitId,
        peer: u32,
    ) -> Result<()> {
        codec::decode_into(dtype, bytes, out)
            .map_err(|e| ring_error(unit, peer, e.for_region(self.inbox_id)))
    }

    async fn all_gather(&self, op: Op, mut buffer: Arc<[f32]>, lease: Lease) -> Result<Gathered> {
        self.group.check(&op.key)?;
        let unit = op.key.unit;
        let routes = self.directory.routes(unit)?;
        let dtype = transfer::published_dtype(routes, unit)?;
        let g = self.grid();
        let out = unique(&mut buffer, unit)?;
        let len = out.len();
        let mine = g.piece(len, g.node, g.lane);
        let mut raw = vec![0u8; mine.len() * dtype.size()];
        let mut bytes = transfer::pull(
            self.transport.as_ref(),
            routes,
            unit,
            mine.clone(),
            op.version,
            self.chunk_elems,
            Out::Bytes(&mut raw),
            op.deadline,
        )
        .await?;
        let raw = Bytes::from(raw);
        self.decode(dtype, &raw, &mut out[mine], unit, self.rank)?;
        let mut sends: FuturesUnordered<SendFut> = FuturesUnordered::new();
        // Across nodes, on this trainer's rail: the rail's piece of every node.
        let mut rail = vec![Bytes::new(); g.nodes as usize];
        rail[g.node as usize] = raw.clone();
        if g.nodes > 1 {
            let (left, right) = g.rail();
            let to = self.group.inbox(right)?;
            sends.push(self.send(&to, right, &op, 0, raw));
            for round in 0..g.nodes - 1 {
                let node = Grid::behind(g.node, round + 1, g.nodes);
                let got = self.recv(&op, round, left, &mut sends).await?;
                self.decode(
                    dtype,
                    &got,
                    &mut out[g.piece(len, node, g.lane)],
                    unit,
                    left,
                )?;
                bytes += got.len() as u64;
                rail[node as usize] = got.clone();
                if round + 2 < g.nodes {
                    sends.push(self.send(&to, right, &op, round + 1, got));
                }
            }
        }
        // Inside the node: every lane's rail, as one message of its pieces in node order.
        if g.per_node > 1 {
            let first = g.nodes - 1;
            let (left, right) = g.ring_in_node();
            let to = self.group.inbox(right)?;
            let own: Vec<u8> = rail.iter().flat_map(|b| b.iter().copied()).collect();
            sends.push(self.send(&to, right, &op, first, Bytes::from(own)));
            for round in 0..g.per_node - 1 {
                let lane = Grid::behind(g.lane, round + 1, g.per_node);
                let got = self.recv(&op, first + round, left, &mut sends).await?;
                let pieces = g.bundle(len, lane);
                let mut values = vec![0f32; pieces.iter().map(|p| p.len()).sum()];
                self.decode(dtype, &got, &mut values, unit, left)?;
                let mut at = 0usize;
                for piece in pieces {
                    let k = piece.len();
                    out[piece].copy_from_slice(&values[at..at + k]);
                    at += k;
                }
                bytes += got.len() as u64;
                if round + 2 < g.per_node {
                    sends.push(self.send(&to, right, &op, first + round + 1, got));
                }
            }
        }
        while let Some(sent) = sends.next().await {
            sent?;
        }
        Ok(Gathered {
            values: crate::memory::UnitValues::Host(buffer),
            bytes,
            lease,
        })
    }

    async fn reduce_scatter(&self, op: Op, mut partial: Vec<f32>) -> Result<u64> {
        self.group.check(&op.key)?;
        let unit = op.key.unit;
        let routes = self.directory.routes(unit)?;
        transfer::check_pushable(routes, unit)?;
        let g = self.grid();
        let len = partial.len();
        let mut bytes = 0u64;
        let mut sends: FuturesUnordered<SendFut> = FuturesUnordered::new();
        // Inside the node: after it, this lane's rail holds the node's sum.
        if g.per_node > 1 {
            let (left, right) = g.ring_in_node();
            let to = self.group.inbox(right)?;
            for round in 0..g.per_node - 1 {
                let lane = Grid::behind(g.lane, round + 1, g.per_node);
                let mut data = Vec::new();
                for piece in g.bundle(len, lane) {
                    data.extend_from_slice(&codec::encode_f32(&partial[piece]));
                }
                bytes += data.len() as u64;
                sends.push(self.send(&to, right, &op, round, Bytes::from(data)));
                let got = self.recv(&op, round, left, &mut sends).await?;
                let pieces = g.bundle(len, Grid::behind(g.lane, round + 2, g.per_node));
                let mut values = vec![0f32; pieces.iter().map(|p| p.len()).sum()];
                self.decode(odc_transport::Dtype::F32, &got, &mut values, unit, left)?;
                let mut at = 0usize;
                for piece in pieces {
                    let k = piece.len();
                    for (p, v) in partial[piece].iter_mut().zip(&values[at..at + k]) {
                        *p += v;
                    }
                    at += k;
                }
            }
        }
        // Across nodes, on this trainer's rail: after it, its own piece holds every sum.
        if g.nodes > 1 {
            let first = g.per_node - 1;
            let (left, right) = g.rail();
            let to = self.group.inbox(right)?;
            for round in 0..g.nodes - 1 {
                let node = Grid::behind(g.node, round + 1, g.nodes);
                let data = codec::encode_f32(&partial[g.piece(len, node, g.lane)]);
                bytes += data.len() as u64;
                sends.push(self.send(&to, right, &op, first + round, data));
                let got = self.recv(&op, first + round, left, &mut sends).await?;
                let node = Grid::behind(g.node, round + 2, g.nodes);
                codec::add_f32_into(&got, &mut partial[g.piece(len, node, g.lane)])
                    .map_err(|e| ring_error(unit, left, e.for_region(self.inbox_id)))?;
            }
        }
        while let Some(sent) = sends.next().await {
            sent?;
        }
        // Piece `rank` now holds every trainer's contribution: write it into its owners.
        let owned = g.piece(len, g.node, g.lane);
        let tag = |shard, chunk| WriteTag {
            epoch: op.key.epoch,
            write_id: transfer::write_id(op.micro_batch, unit, shard, chunk),
            token: op.token,
        };
        // A sum of finite gradients may still overflow: the barrier finds that.
        let Ok(writes) = transfer::encode_writes(
            routes,
            owned.clone(),
            &partial[owned],
            tag,
            self.chunk_elems,
            |piece| Ok::<_, Infallible>(codec::encode_f32(piece)),
        );
        bytes += transfer::send_writes(self.transport.as_ref(), unit, writes, op.deadline).await?;
        Ok(bytes)
    }
}

impl DataPath for Collective {
    fn begin(&self, epoch: u64) {
        self.inner.inbox.advance(epoch);
    }

    fn gather(&self, op: Op, buffer: Arc<[f32]>, lease: Lease) -> Transfer<Gathered> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let started = tokio::time::Instant::now();
            let gathered = inner.all_gather(op, buffer, lease).await?;
            inner.metrics.pulled(gathered.bytes, started.elapsed());
            Ok(gathered)
        })
    }

    #[cfg(feature = "cuda-code")]
    fn device_gathers(&self) -> bool {
        self.inner.device_ring()
    }

    /// The ring all-gather into device memory ([`device`]).
    #[cfg(feature = "cuda-code")]
    fn gather_device(
        &self,
        op: Op,
        len: usize,
        memory: Arc<dyn crate::memory::DeviceMemory>,
        lease: Lease,
    ) -> Transfer<Gathered> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let started = tokio::time::Instant::now();
            let gathered = inner.all_gather_device(op, len, memory, lease).await?;
            inner.metrics.pulled(gathered.bytes, started.elapsed());
            Ok(gathered)
        })
    }

    #[cfg(feature = "cuda-code")]
    fn device_pushes(&self) -> bool {
        self.inner.device_ring()
    }

    /// The ring reduce-scatter from device memory ([`device`]).
    #[cfg(feature = "cuda-code")]
    fn push_device(&self, op: Op, grad: Arc<dyn crate::memory::DeviceGrad>) -> Transfer<u64> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let bytes = inner.reduce_scatter_device(op, grad).await?;
            inner.metrics.pushed(bytes);
            Ok(bytes)
        })
    }

    fn push(&self, op: Op, grad: &[f32]) -> std::result::Result<Transfer<u64>, NonFiniteElement> {
        // A reduce-scatter adds partial sums into its own copy of the gradient, checked for
        // non-finite elements as it is made.
        let (inner, partial) = (self.inner.clone(), copy_finite(grad)?);
        Ok(Box::pin(async move {
            let bytes = inner.reduce_scatter(op, partial).await?;
            inner.metrics.pushed(bytes);
            Ok(bytes)
        }))
    }
}

/// A copy of `values`, made in the pass that checks every element is finite.
fn copy_finite(values: &[f32]) -> std::result::Result<Vec<f32>, NonFiniteElement> {
    let mut finite = true;
    let copy: Vec<f32> = values
        .iter()
        .map(|&v| {
            finite &= v.is_finite();
            v
        })
        .collect();
    if finite {
        return Ok(copy);
    }
    let index = values.iter().position(|v| !v.is_finite()).unwrap_or(0);
    Err(NonFiniteElement {
        index,
        value: values.get(index).copied().unwrap_or(f32::NAN),
    })
}

fn ring_error(unit: UnitId, peer: u32, source: TransportError) -> Error {
    Error::Collective { unit, peer, source }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use odc_transport::local::LocalTransport;
    use odc_transport::{AccumulatorRegion, Dtype, PublishedRegion};

    use super::*;
    use crate::datapath::OpKind;
    use crate::directory::ShardRoute;
    use crate::memory::buffers::UnitBuffers;

    type Regions = (
        Vec<Box<dyn AccumulatorRegion>>,
        Vec<Box<dyn PublishedRegion>>,
    );

    /// `servers` shard servers holding a unit of `len` elements whose element i is i + 1.
    fn servers(
        transport: &Arc<dyn Transport>,
        len: usize,
        servers: usize,
        dtype: Dtype,
    ) -> (Arc<Directory>, Regions) {
        let (mut routes, mut accs, mut pubs) = (vec![], vec![], vec![]);
        for s in 0..servers {
            let range = shard_range(len, servers, s);
            if range.is_empty() {
                continue;
            }
            let values: Vec<f32> = range.clone().map(|i| i as f32 + 1.0).collect();
            let p = transport
                .register_published(s as u32, dtype, codec::encode(dtype, &values), 3)
                .unwrap();
            let a = transport
                .register_accumulator(s as u32, range.len(), 9)
                .unwrap();
            routes.push(ShardRoute {
                unit: 0,
                owner: s as u32,
                start: range.start as u64,
                end: range.end as u64,
                published: p.handle(),
                accumulator: Some(a.handle()),
            });
            accs.push(a);
            pubs.push(p);
        }
        let directory = Directory::from_routes(1, routes).unwrap();
        (Arc::new(directory), (accs, pubs))
    }

    fn op(kind: OpKind, epoch: u64, micro_batch: u32) -> Op {
        Op {
            key: OpKey {
                epoch,
                seq: 0,
                unit: 0,
                kind,
                occurrence: 0,
            },
            version: 3,
            micro_batch,
            token: u128::from(micro_batch) + 1,
            deadline: Instant::now() + Duration::from_secs(20),
        }
    }

    /// One collective path per rank, each on its own transport instance (joined by handles only).
    fn ranks(n: u32, directory: &Arc<Directory>) -> (Arc<CollectiveGroup>, Vec<Arc<Collective>>) {
        ranks_in_nodes(n, 1, directory)
    }

    /// [`ranks`] with `node_size` trainers to a node (two-level rings).
    fn ranks_in_nodes(
        n: u32,
        node_size: u32,
        directory: &Arc<Directory>,
    ) -> (Arc<CollectiveGroup>, Vec<Arc<Collective>>) {
        let group = Arc::new(CollectiveGroup::new(n).with_node_size(node_size));
        let paths = (0..n)
            .map(|rank| {
                let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
                let path =
                    Collective::new(rank, transport, group.clone(), directory.clone(), 2).unwrap();
                path.begin(9);
                Arc::new(path)
            })
            .collect();
        (group, paths)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ring_all_gather_is_exact_for_uneven_pieces_in_both_dtypes() {
        for dtype in [Dtype::F32, Dtype::Bf16] {
            for (len, n, s, g) in [
                (10, 3, 4, 1),
                (7, 4, 3, 1),
                (5, 8, 2, 1),
                (1, 2, 1, 1),
                (33, 5, 3, 1),
                (7, 4, 3, 2),
                (5, 8, 2, 4),
                (33, 6, 3, 3),
                (33, 6, 3, 2),
                (13, 6, 2, 6),
            ] {
                let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
                let (directory, _regions) = servers(&transport, len, s, dtype);
                let (group, paths) = ranks_in_nodes(n, g, &directory);
                assert_eq!(group.node_size(), g);
                let buffers = UnitBuffers::default();
                let tasks: Vec<_> = paths
                    .iter()
                    .map(|path| {
                        let (buffer, lease) = buffers.allocate(len);
                        tokio::spawn(path.gather(op(OpKind::Gather, 9, 0), buffer, lease))
                    })
                    .collect();
                let want: Vec<f32> = (0..len)
                    .map(|i| codec::round_trip(dtype, i as f32 + 1.0))
                    .collect();
                for (rank, task) in tasks.into_iter().enumerate() {
                    let got = tokio::time::timeout(Duration::from_secs(20), task)
                        .await
                        .expect("all-gather finishes")
                        .expect("task")
                        .expect("all-gather succeeds");
                    assert_eq!(got.values.as_host().unwrap().len(), len);
                    assert_eq!(
                        &got.values.as_host().unwrap()[..],
                        &want[..],
                        "{dtype:?}, len {len}, {n} trainers in nodes of {g}, {s} servers, rank {rank}"
                    );
                    // Bytes in: one unit in the pull dtype, whatever the ring did.
                    assert_eq!(got.bytes, (len * dtype.size()) as u64);
                }
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ring_reduce_scatter_sums_exactly_into_the_owners() {
        for (len, n, s, g) in [
            (10, 3, 4, 1),
            (7, 4, 3, 1),
            (5, 8, 2, 1),
            (33, 5, 3, 1),
            (6, 1, 2, 1),
            (7, 4, 3, 2),
            (5, 8, 2, 4),
            (33, 6, 3, 3),
            (33, 6, 3, 2),
            (13, 6, 2, 6),
            (10, 4, 2, 3),
        ] {
            let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
            let (directory, (accs, _pubs)) = servers(&transport, len, s, Dtype::F32);
            // Each trainer writes its piece under its own micro-batch and token (see `op`).
            for acc in &accs {
                acc.admit_only(Arc::new(|tag: &WriteTag| {
                    tag.token == u128::from(crate::datapath::micro_batch_of(tag.write_id)) + 1
                }))
                .unwrap();
            }
            let (_group, paths) = ranks_in_nodes(n, g, &directory);
            let tasks: Vec<_> = paths
                .iter()
                .enumerate()
                .map(|(rank, path)| {
                    // Trainer `rank` contributes (rank + 1) · (i + 1) at element i.
                    let grad: Vec<f32> = (0..len).map(|i| ((rank + 1) * (i + 1)) as f32).collect();
                    let push = path.push(op(OpKind::Push, 9, rank as u32), &grad);
                    tokio::spawn(push.expect("a finite gradient"))
                })
                .collect();
            for task in tasks {
                tokio::time::timeout(Duration::from_secs(20), task)
                    .await
                    .expect("reduce-scatter finishes")
                    .expect("task")
                    .expect("reduce-scatter succeeds");
            }
            let ranks: usize = (1..=n as usize).sum();
            let got: Vec<f32> = accs.iter().flat_map(|a| a.take(10)).collect();
            let want: Vec<f32> = (0..len).map(|i| (ranks * (i + 1)) as f32).collect();
            assert_eq!(got.len(), want.len());
            assert_eq!(
                got, want,
                "len {len}, {n} trainers in nodes of {g}, {s} servers"
            );
        }
    }

    /// Both data paths refuse a gradient with a NaN or ±inf before anything is sent, naming the
    /// first one (index in the unit, across shards and chunks).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_non_finite_gradient_is_refused_before_anything_is_sent() {
        let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
        let (directory, (accs, _pubs)) = servers(&transport, 8, 2, Dtype::F32);
        let (_group, collective) = ranks(1, &directory);
        let on_demand = crate::datapath::OnDemand::new(transport.clone(), directory.clone(), 3);
        let paths: [&dyn DataPath; 2] = [collective[0].as_ref(), &on_demand];
        for path in paths {
            for (bad, at) in [(f32::NAN, 3), (f32::INFINITY, 0), (f32::NEG_INFINITY, 7)] {
                let mut grad = vec![1.0f32; 8];
                grad[at] = bad;
                grad[(at + 2) % 8] = f32::NAN;
                let Err(e) = path.push(op(OpKind::Push, 9, 0), &grad) else {
                    panic!("a gradient with {bad} at {at} was accepted");
                };
                let first = at.min((at + 2) % 8);
                assert_eq!(e.index, first, "the first non-finite element");
                assert_eq!(e.value.to_bits(), grad[first].to_bits());
            }
        }
        let landed: Vec<f32> = accs.iter().flat_map(|a| a.take(10)).collect();
        assert_eq!(landed, vec![0.0; 8], "nothing was sent");
    }

    /// A frozen unit's shards have no accumulator: both data paths refuse its push with
    /// [`Error::FrozenUnit`] before anything is sent (the trainer context refuses it before
    /// them), while gathers of it are served as any other unit's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_frozen_units_push_is_refused_and_its_gather_served() {
        tokio::time::timeout(Duration::from_secs(20), async {
            let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
            let (directory, (accs, _pubs)) = servers(&transport, 8, 2, Dtype::F32);
            let mut frozen = (*directory).clone();
            for route in &mut frozen.units[0] {
                route.accumulator = None;
            }
            let frozen = Arc::new(frozen);
            let (_group, collective) = ranks(1, &frozen);
            let on_demand = crate::datapath::OnDemand::new(transport.clone(), frozen.clone(), 3);
            let paths: [&dyn DataPath; 2] = [collective[0].as_ref(), &on_demand];
            let buffers = UnitBuffers::default();
            for path in paths {
                let push = path
                    .push(op(OpKind::Push, 9, 0), &[1.0; 8])
                    .expect("a finite gradient");
                assert!(
                    matches!(push.await, Err(Error::FrozenUnit { unit: 0, .. })),
                    "the push is refused"
                );
                let (buffer, lease) = buffers.allocate(8);
                let got = path
                    .gather(op(OpKind::Gather, 9, 0), buffer, lease)
                    .await
                    .expect("the gather is served");
                assert_eq!(
                    got.values.as_host().unwrap()[..],
                    (1..=8).map(|i| i as f32).collect::<Vec<_>>()
                );
            }
            let landed: Vec<f32> = accs.iter().flat_map(|a| a.take(10)).collect();
            assert_eq!(landed, vec![0.0; 8], "nothing was sent");
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn aborting_an_epoch_fails_waiting_and_later_operations_at_once() {
        let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
        let (directory, _regions) = servers(&transport, 8, 2, Dtype::F32);
        let (group, paths) = ranks(3, &directory);
        let buffers = UnitBuffers::default();
        // Only rank 0 arrives: without the abort it would wait for its left neighbour until its
        // deadline (20 s, beyond this test's timeout).
        let (buffer, lease) = buffers.allocate(8);
        let lonely = tokio::spawn(paths[0].gather(op(OpKind::Gather, 9, 0), buffer, lease));
        // Whether it is already waiting in the ring or not yet started, the abort ends it.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        group.abort_before(10);
        let result = tokio::time::timeout(Duration::from_secs(5), lonely)
            .await
            .expect("the abort wakes the waiter")
            .expect("task");
        assert!(
            matches!(result, Err(Error::CollectiveAborted)),
            "{:?}",
            result.err()
        );
        // A trainer joining an operation of the discarded epoch after the discard fails at once
        // (the epoch floor), instead of waiting for peers that will never come.
        let (buffer, lease) = buffers.allocate(8);
        let late = tokio::time::timeout(
            Duration::from_secs(5),
            paths[1].gather(op(OpKind::Gather, 9, 0), buffer, lease),
        )
        .await
        .expect("an old-epoch operation fails at once");
        assert!(matches!(late, Err(Error::CollectiveAborted)));
        let grad = [1.0f32; 8];
        let late_push = tokio::time::timeout(
            Duration::from_secs(5),
            paths[2]
                .push(op(OpKind::Push, 9, 0), &grad)
                .expect("a finite gradient"),
        )
        .await
        .expect("an old-epoch reduce-scatter fails at once");
        assert!(matches!(late_push, Err(Error::CollectiveAborted)));
        assert_eq!(buffers.live(), 0, "aborted operations hold no buffer");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_missing_peer_is_a_deadline_error_naming_it() {
        let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
        let (directory, _regions) = servers(&transport, 6, 2, Dtype::F32);
        let (_group, paths) = ranks(2, &directory);
        let buffers = UnitBuffers::default();
        let (buffer, lease) = buffers.allocate(6);
        let mut short = op(OpKind::Gather, 9, 0);
        short.deadline = Instant::now() + Duration::from_millis(50);
        let result = tokio::time::timeout(
            Duration::from_secs(10),
            paths[0].gather(short, buffer, lease),
        )
        .await
        .expect("the deadline ends the wait");
        match result {
            Err(Error::Collective {
                unit: 0,
                peer: 1,
                source,
            }) => assert!(
                matches!(source, TransportError::DeadlineExceeded { .. }),
                "{source}"
            ),
            other => panic!("expected a deadline naming peer 1, got {:?}", other.err()),
        }
    }
}
