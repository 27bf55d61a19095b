//! Collective mode, the FSDP-style baseline of the A/B benchmark: every gather of a unit is a
//! **ring all-gather** across all trainers and every gradient push a **ring reduce-scatter**, each a
//! barrier, over the same transport, chunking and prefetch as on-demand mode.
//!
//! A unit is split into one **piece** per trainer (`shard_range(len, trainers, rank)`).
//! - All-gather: every trainer reads its own piece from the shard servers, then in `trainers - 1`
//!   rounds sends the piece it got last to its right neighbour's staging region (an accumulate into
//!   zeros) and takes the one its left neighbour sent; a barrier closes every round.
//! - Reduce-scatter: in `trainers - 1` rounds every trainer adds its partial sum of one piece into its
//!   right neighbour's staging region and adds what its left neighbour sent into its own partial; rank
//!   `r` ends with the full sum of piece `r + 1` and pushes it to the owning shard servers.
//!
//! Bytes per trainer equal on-demand mode's (one unit in, one unit out); what differs is that every
//! trainer waits for every other one at every collective — the coupling odc removes.
//!
//! Invariants:
//! - Operations are matched across trainers by [`OpKey`] (epoch, the trainer's micro-batch sequence
//!   number in the epoch, unit, kind, occurrence), so prefetches and re-gathers pair up whatever order
//!   tasks run in. Every trainer must run the same number of micro-batches per step (the supervisor
//!   pads LB-Micro plans to equal counts).
//! - [`CollectiveGroup::abort_before`] wakes and fails every operation of a discarded epoch, so a
//!   failed trainer never leaves the others waiting forever (I2 replay).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use odc_transport::{
    chunk_ranges, codec, AccumulatorRegion, Dtype, EndpointId, RegionHandle, Transport, WriteTag,
};
use tokio::sync::Notify;

use crate::error::{Error, Result};
use crate::layout::{shard_range, UnitId};

/// Endpoint id of trainer `rank`'s staging regions (servers use `0..servers`).
pub const TRAINER_ENDPOINT_BASE: EndpointId = 1 << 24;

/// What a collective does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    AllGather,
    ReduceScatter,
}

/// Identifies one collective operation across trainers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpKey {
    pub epoch: u64,
    /// The trainer's micro-batch sequence number within the epoch (equal across trainers).
    pub seq: u64,
    pub unit: UnitId,
    pub kind: OpKind,
    /// How many times this (unit, kind) was issued before in the micro-batch.
    pub occurrence: u32,
}

/// A reusable barrier for a fixed number of parties that can be aborted.
#[derive(Debug)]
pub struct RoundBarrier {
    parties: usize,
    state: Mutex<BarrierState>,
    notify: Notify,
}

#[derive(Debug, Default)]
struct BarrierState {
    arrived: usize,
    generation: u64,
    aborted: bool,
}

impl RoundBarrier {
    pub fn new(parties: usize) -> Self {
        RoundBarrier {
            parties: parties.max(1),
            state: Mutex::new(BarrierState::default()),
            notify: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BarrierState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wait until every party arrived in this round; `Err` once aborted.
    pub async fn wait(&self) -> Result<()> {
        let generation = {
            let mut s = self.lock();
            if s.aborted {
                return Err(Error::CollectiveAborted);
            }
            s.arrived += 1;
            if s.arrived == self.parties {
                s.arrived = 0;
                s.generation += 1;
                self.notify.notify_waiters();
                return Ok(());
            }
            s.generation
        };
        loop {
            // Registered before the check, so a release between the check and the await is seen.
            let notified = self.notify.notified();
            {
                let s = self.lock();
                if s.aborted {
                    return Err(Error::CollectiveAborted);
                }
                if s.generation != generation {
                    return Ok(());
                }
            }
            notified.await;
        }
    }

    /// Fail every current and future wait.
    pub fn abort(&self) {
        self.lock().aborted = true;
        self.notify.notify_waiters();
    }
}

/// One collective operation in progress.
#[derive(Debug)]
struct Op {
    barrier: RoundBarrier,
    staging: Mutex<Vec<Option<RegionHandle>>>,
    left: AtomicUsize,
}

/// The trainers taking part in collectives (all of them), and the operations in progress.
#[derive(Debug)]
pub struct CollectiveGroup {
    size: usize,
    ops: Mutex<HashMap<OpKey, Arc<Op>>>,
}

impl CollectiveGroup {
    pub fn new(size: usize) -> Self {
        CollectiveGroup {
            size: size.max(1),
            ops: Mutex::new(HashMap::new()),
        }
    }

    pub fn size(&self) -> usize {
        self.size
    }

    fn ops(&self) -> std::sync::MutexGuard<'_, HashMap<OpKey, Arc<Op>>> {
        self.ops.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn op(&self, key: OpKey) -> Arc<Op> {
        self.ops()
            .entry(key)
            .or_insert_with(|| {
                Arc::new(Op {
                    barrier: RoundBarrier::new(self.size),
                    staging: Mutex::new(vec![None; self.size]),
                    left: AtomicUsize::new(0),
                })
            })
            .clone()
    }

    fn leave(&self, key: OpKey, op: &Op) {
        if op.left.fetch_add(1, Ordering::SeqCst) + 1 == self.size {
            self.ops().remove(&key);
        }
    }

    /// Abort every operation of an epoch before `epoch` (a discarded attempt).
    pub fn abort_before(&self, epoch: u64) {
        let mut ops = self.ops();
        ops.retain(|key, op| {
            if key.epoch < epoch {
                op.barrier.abort();
                false
            } else {
                true
            }
        });
    }

    /// Operations in progress (for tests and leak checks).
    pub fn pending(&self) -> usize {
        self.ops().len()
    }
}

/// Where a unit's shards live, for reading pieces from and pushing pieces to the servers.
pub(crate) struct UnitPlace<'a> {
    pub unit: UnitId,
    pub len: usize,
    pub routes: &'a [crate::directory::ShardRoute],
}

/// Join `key` as `rank` with the staging region `mine`; returns everyone's staging handles.
async fn join(
    group: &CollectiveGroup,
    key: OpKey,
    rank: usize,
    mine: RegionHandle,
) -> Result<(Arc<Op>, Vec<RegionHandle>)> {
    let op = group.op(key);
    if let Some(slot) = op
        .staging
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_mut(rank)
    {
        *slot = Some(mine);
    }
    op.barrier.wait().await?;
    let handles: Option<Vec<RegionHandle>> = op
        .staging
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .cloned()
        .collect();
    let handles = handles.ok_or(Error::CollectiveAborted)?;
    Ok((op, handles))
}

/// Register this trainer's staging region for `key` and join it; returns the region, the
/// operation and the right neighbour's staging handle.
async fn enter(
    transport: &Arc<dyn Transport>,
    group: &CollectiveGroup,
    key: OpKey,
    rank: usize,
    len: usize,
) -> Result<(Box<dyn AccumulatorRegion>, Arc<Op>, RegionHandle)> {
    let staging =
        transport.register_accumulator(TRAINER_ENDPOINT_BASE + rank as EndpointId, len, 0)?;
    let (op, handles) = join(group, key, rank, staging.handle()).await?;
    let right = handles[(rank + 1) % group.size()].clone();
    Ok((staging, op, right))
}

/// Accumulate `values` (elements `range` of a unit-sized buffer) into `target` at the same
/// offsets, in chunks, concurrently.
async fn send_piece(
    transport: &Arc<dyn Transport>,
    target: &RegionHandle,
    range: Range<usize>,
    values: &[f32],
    round: usize,
    chunk_elems: usize,
) -> Result<u64> {
    let sends = chunk_ranges(0..range.len(), chunk_elems)
        .enumerate()
        .map(|(chunk, r)| {
            let data = codec::encode(Dtype::F32, &values[r.clone()]);
            let tag = WriteTag {
                epoch: 0,
                write_id: ((round as u128) << 64) | chunk as u128,
            };
            let offset = range.start + r.start;
            async move {
                let bytes = data.len() as u64;
                transport
                    .accumulate(target, offset, data, tag)
                    .await
                    .map(|()| bytes)
            }
        });
    let sent: std::result::Result<Vec<u64>, _> =
        futures::future::join_all(sends).await.into_iter().collect();
    Ok(sent?.iter().sum())
}

/// Ring all-gather of a unit among `group`; returns the whole unit and the bytes this trainer moved.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn all_gather(
    transport: Arc<dyn Transport>,
    group: Arc<CollectiveGroup>,
    key: OpKey,
    rank: usize,
    place: UnitPlace<'_>,
    version: u64,
    chunk_elems: usize,
) -> Result<(Vec<f32>, u64)> {
    let (n, len) = (group.size(), place.len);
    let (staging, op, right) = enter(&transport, &group, key, rank, len).await?;
    let mut full = vec![0f32; len];
    let mine = shard_range(len, n, rank);
    let mut bytes = crate::context::pull_range(
        &transport,
        place.routes,
        place.unit,
        mine.clone(),
        version,
        chunk_elems,
        &mut full[mine],
    )
    .await?;
    for round in 0..n.saturating_sub(1) {
        let send = shard_range(len, n, (rank + n - round) % n);
        bytes += send_piece(
            &transport,
            &right,
            send.clone(),
            &full[send],
            round,
            chunk_elems,
        )
        .await?;
        op.barrier.wait().await?;
        let recv = shard_range(len, n, (rank + 2 * n - round - 1) % n);
        full[recv.clone()].copy_from_slice(&staging.read_local(recv)?);
    }
    group.leave(key, &op);
    Ok((full, bytes))
}

/// Ring reduce-scatter of one unit's gradient among `group`, then the reduced piece this trainer
/// ends with goes to its owning servers (acknowledged). Returns the bytes this trainer sent.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn reduce_scatter(
    transport: Arc<dyn Transport>,
    group: Arc<CollectiveGroup>,
    key: OpKey,
    rank: usize,
    place: UnitPlace<'_>,
    grad: Vec<f32>,
    server_tag: impl Fn(usize, usize) -> WriteTag,
    chunk_elems: usize,
) -> Result<u64> {
    let (n, len) = (group.size(), place.len);
    let (staging, op, right) = enter(&transport, &group, key, rank, len).await?;
    let mut partial = grad;
    let mut bytes = 0;
    for round in 0..n.saturating_sub(1) {
        let send = shard_range(len, n, (rank + n - round) % n);
        bytes += send_piece(
            &transport,
            &right,
            send.clone(),
            &partial[send],
            round,
            chunk_elems,
        )
        .await?;
        op.barrier.wait().await?;
        let recv = shard_range(len, n, (rank + 2 * n - round - 1) % n);
        let got = staging.read_local(recv.clone())?;
        for (p, g) in partial[recv].iter_mut().zip(got) {
            *p += g;
        }
    }
    group.leave(key, &op);
    let owned = shard_range(len, n, (rank + 1) % n);
    let writes = crate::context::encode_writes(
        place.routes,
        owned.clone(),
        &partial[owned],
        &server_tag,
        chunk_elems,
    );
    bytes += crate::context::send_writes(&transport, place.unit, writes).await?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use odc_transport::local::LocalTransport;

    use super::*;
    use crate::directory::ShardRoute;

    type Regions = (
        Vec<Box<dyn odc_transport::AccumulatorRegion>>,
        Vec<Box<dyn odc_transport::PublishedRegion>>,
    );

    /// `servers` shard servers holding a unit of `len` elements whose element i is i + 1.
    fn servers(
        transport: &Arc<dyn Transport>,
        len: usize,
        servers: usize,
    ) -> (Vec<ShardRoute>, Regions) {
        let (mut routes, mut accs, mut pubs) = (vec![], vec![], vec![]);
        for s in 0..servers {
            let range = shard_range(len, servers, s);
            let values: Vec<f32> = range.clone().map(|i| i as f32 + 1.0).collect();
            let p = transport
                .register_published(s as u32, Dtype::F32, codec::encode(Dtype::F32, &values), 3)
                .unwrap();
            let a = transport
                .register_accumulator(s as u32, range.len(), 9)
                .unwrap();
            routes.push(ShardRoute {
                owner: s as u32,
                range,
                published: p.handle(),
                accumulator: a.handle(),
            });
            accs.push(a);
            pubs.push(p);
        }
        (routes, (accs, pubs))
    }

    fn key(kind: OpKind) -> OpKey {
        OpKey {
            epoch: 9,
            seq: 0,
            unit: 0,
            kind,
            occurrence: 0,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ring_all_gather_is_exact_for_uneven_pieces() {
        for (len, n, s) in [(10, 3, 4), (7, 4, 3), (5, 8, 2), (1, 2, 1), (33, 5, 3)] {
            let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
            let (routes, _regions) = servers(&transport, len, s);
            let group = Arc::new(CollectiveGroup::new(n));
            let tasks: Vec<_> = (0..n)
                .map(|rank| {
                    let (t, g, r) = (transport.clone(), group.clone(), routes.clone());
                    tokio::spawn(async move {
                        let place = UnitPlace {
                            unit: 0,
                            len,
                            routes: &r,
                        };
                        all_gather(t, g, key(OpKind::AllGather), rank, place, 3, 2).await
                    })
                })
                .collect();
            let want: Vec<f32> = (0..len).map(|i| i as f32 + 1.0).collect();
            for t in tasks {
                let (got, _) = tokio::time::timeout(Duration::from_secs(10), t)
                    .await
                    .unwrap()
                    .unwrap()
                    .unwrap();
                assert_eq!(got, want, "len {len}, {n} trainers, {s} servers");
            }
            assert_eq!(group.pending(), 0, "finished operations are forgotten");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ring_reduce_scatter_sums_exactly_into_the_owners() {
        for (len, n, s) in [(10, 3, 4), (7, 4, 3), (5, 8, 2), (33, 5, 3)] {
            let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
            let (routes, (accs, _pubs)) = servers(&transport, len, s);
            let group = Arc::new(CollectiveGroup::new(n));
            let tasks: Vec<_> = (0..n)
                .map(|rank| {
                    let (t, g, r) = (transport.clone(), group.clone(), routes.clone());
                    tokio::spawn(async move {
                        // Trainer `rank` contributes (rank + 1) · (i + 1) at element i.
                        let grad = (0..len).map(|i| ((rank + 1) * (i + 1)) as f32).collect();
                        let place = UnitPlace {
                            unit: 0,
                            len,
                            routes: &r,
                        };
                        let tag = move |shard: usize, chunk: usize| WriteTag {
                            epoch: 9,
                            write_id: ((rank as u128) << 64)
                                | ((shard as u128) << 32)
                                | chunk as u128,
                        };
                        reduce_scatter(t, g, key(OpKind::ReduceScatter), rank, place, grad, tag, 2)
                            .await
                    })
                })
                .collect();
            for t in tasks {
                tokio::time::timeout(Duration::from_secs(10), t)
                    .await
                    .unwrap()
                    .unwrap()
                    .unwrap();
            }
            let ranks: usize = (1..=n).sum();
            let got: Vec<f32> = accs.iter().flat_map(|a| a.take(10)).collect();
            let want: Vec<f32> = (0..len).map(|i| (ranks * (i + 1)) as f32).collect();
            assert_eq!(got, want, "len {len}, {n} trainers, {s} servers");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn aborting_an_epoch_wakes_waiters_with_an_error() {
        let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
        let (routes, _regions) = servers(&transport, 8, 2);
        let group = Arc::new(CollectiveGroup::new(3));
        // Only one of three trainers arrives: it would wait forever without the abort.
        let (t, g) = (transport.clone(), group.clone());
        let lonely = tokio::spawn(async move {
            let place = UnitPlace {
                unit: 0,
                len: 8,
                routes: &routes,
            };
            all_gather(t, g, key(OpKind::AllGather), 0, place, 3, 4).await
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(group.pending(), 1);
        group.abort_before(10);
        let result = tokio::time::timeout(Duration::from_secs(5), lonely)
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(result, Err(Error::CollectiveAborted)));
        assert_eq!(group.pending(), 0);
    }
}
