//! The collective data path in device memory (feature `cuda-code`; the job's transport
//! odc-transport's `cuda` backend, the trainers on one flat ring: a host's GPUs): the same ring
//! all-gather and reduce-scatter as the host path, their pieces carried as device messages
//! (`CudaTransport::send_device`), so no parameter or gradient byte crosses host memory.
//!
//! - **All-gather**: the unit's buffer comes from the compute's device memory, in the published
//!   dtype (bf16 pulls stay bf16, as on demand). This trainer's piece is read from its owners
//!   device to device into its place in the buffer (the version checked per shard, I1); in each
//!   ring step the left neighbour's piece is copied from its message into its place and
//!   forwarded from there.
//! - **Reduce-scatter**: once the gradient is [ready](DeviceGrad::ready) it is copied into a
//!   partial-sum buffer of the transport's device (`CudaTransport::scratch`, reused across
//!   operations, as the messages' buffers are); in each step one piece's partial sum goes to
//!   the right neighbour and the left neighbour's is added into another piece (the accumulate
//!   kernel). The own piece's full sum is then added into its owners' accumulators from device
//!   memory (`accumulate_device`), under this trainer's micro-batch write ids and assignment
//!   token (C8), acknowledged.
//! - Waits, aborts and errors are the host path's: every receive ends at the operation's
//!   deadline or at once when its epoch is discarded, naming the peer.
//! - Copies never race: a piece is sent only once it is whole (a copy or an add completed), and
//!   no step writes a piece that a send of the same operation may still read.

use std::ops::Range;

use odc_transport::cuda::{CudaTransport, DeviceValues};
use odc_transport::DeviceDest;

use super::*;
use crate::datapath::cuda_backend;
use crate::memory::device::{DeviceGrad, DeviceMemory, UnitValues};

/// `piece` (elements of `size` bytes) of the buffer at `whole`.
fn place(whole: DeviceDest, piece: Range<usize>, size: usize) -> DeviceDest {
    DeviceDest {
        device: whole.device,
        ptr: whole.ptr + (piece.start * size) as u64,
        bytes: (piece.len() * size) as u64,
    }
}

impl Inner {
    /// Whether this path runs in device memory: the `cuda` backend and one flat ring.
    pub(super) fn device_ring(&self) -> bool {
        cuda_backend(&self.transport).is_some() && self.group.node_size == 1
    }

    fn cuda(&self) -> Result<&CudaTransport> {
        cuda_backend(&self.transport).ok_or_else(|| {
            Error::Internal(format!(
                "trainer {}: a device collective on the {} transport",
                self.rank,
                self.transport.backend()
            ))
        })
    }

    /// Send `piece` (device memory, whole) to `peer`'s inbox as step `round`'s message.
    fn send_device(
        &self,
        to: &RegionHandle,
        peer: u32,
        op: &Op,
        round: u32,
        piece: DeviceDest,
    ) -> SendFut {
        let (transport, handle) = (self.transport.clone(), to.clone());
        let tag = Self::tag(op, round);
        let (unit, deadline, rank) = (op.key.unit, op.deadline, self.rank);
        Box::pin(async move {
            let cuda = cuda_backend(&transport).ok_or_else(|| {
                Error::Internal(format!("trainer {rank}: a device send without cuda"))
            })?;
            cuda.send_device(&handle, tag, Bytes::new(), &[piece], deadline)
                .await
                .map_err(|source| ring_error(unit, peer, source))
        })
    }

    /// Step `round`'s values from the left neighbour `left`, in the transport's device memory.
    async fn recv_device(
        &self,
        op: &Op,
        round: u32,
        left: u32,
        sends: &mut FuturesUnordered<SendFut>,
    ) -> Result<DeviceValues> {
        let cuda = self.cuda()?;
        let recv = cuda.recv_device(self.inbox.as_ref(), Self::tag(op, round), op.deadline);
        let (_, values) = self.ring_recv(op, left, sends, recv).await?;
        values.ok_or_else(|| {
            ring_error(
                op.key.unit,
                left,
                TransportError::Unsupported {
                    what: format!("ring step {round}'s message came without device values"),
                },
            )
        })
    }

    /// The all-gather into device memory (see the [module docs](self)).
    pub(super) async fn all_gather_device(
        &self,
        op: Op,
        len: usize,
        memory: Arc<dyn DeviceMemory>,
        lease: Lease,
    ) -> Result<Gathered> {
        self.group.check(&op.key)?;
        let unit = op.key.unit;
        let routes = self.directory.routes(unit)?;
        let dtype = transfer::published_dtype(routes, unit)?;
        let cuda = self.cuda()?;
        let g = self.grid();
        let buffer = memory.allocate(len, dtype).await?;
        let (whole, size) = (buffer.dest(), dtype.size());
        let mine = g.piece(len, g.node, g.lane);
        let mut bytes = transfer::pull(
            self.transport.as_ref(),
            routes,
            unit,
            mine.clone(),
            op.version,
            len.max(1),
            Out::Device(place(whole, mine.clone(), size)),
            op.deadline,
        )
        .await?;
        let mut sends: FuturesUnordered<SendFut> = FuturesUnordered::new();
        if g.nodes > 1 {
            let (left, right) = g.rail();
            let to = self.group.inbox(right)?;
            sends.push(self.send_device(&to, right, &op, 0, place(whole, mine, size)));
            for round in 0..g.nodes - 1 {
                let node = Grid::behind(g.node, round + 1, g.nodes);
                let values = self.recv_device(&op, round, left, &mut sends).await?;
                let at = place(whole, g.piece(len, node, g.lane), size);
                cuda.copy_out(&values, &[at], op.deadline)
                    .map_err(|source| ring_error(unit, left, source))?;
                bytes += values.len() as u64;
                if round + 2 < g.nodes {
                    sends.push(self.send_device(&to, right, &op, round + 1, at));
                }
            }
        }
        while let Some(sent) = sends.next().await {
            sent?;
        }
        Ok(Gathered {
            values: UnitValues::Device { buffer, dtype },
            bytes,
            lease,
        })
    }

    /// The reduce-scatter from device memory (see the [module docs](self)).
    pub(super) async fn reduce_scatter_device(
        &self,
        op: Op,
        grad: Arc<dyn DeviceGrad>,
    ) -> Result<u64> {
        self.group.check(&op.key)?;
        let unit = op.key.unit;
        let routes = self.directory.routes(unit)?;
        transfer::check_pushable(routes, unit)?;
        let cuda = self.cuda()?;
        grad.ready().await?;
        let src = grad.src();
        let len = usize::try_from(src.bytes / 4).unwrap_or(usize::MAX);
        let partial = cuda.scratch(len * 4)?;
        let whole = partial.dest();
        cuda.copy_device(src, whole, op.deadline)?;
        drop(grad);
        let g = self.grid();
        let mut bytes = 0u64;
        let mut sends: FuturesUnordered<SendFut> = FuturesUnordered::new();
        if g.nodes > 1 {
            let (left, right) = g.rail();
            let to = self.group.inbox(right)?;
            for round in 0..g.nodes - 1 {
                let node = Grid::behind(g.node, round + 1, g.nodes);
                let out = place(whole, g.piece(len, node, g.lane), 4);
                bytes += out.bytes;
                sends.push(self.send_device(&to, right, &op, round, out));
                let values = self.recv_device(&op, round, left, &mut sends).await?;
                let node = Grid::behind(g.node, round + 2, g.nodes);
                let into = place(whole, g.piece(len, node, g.lane), 4);
                cuda.add_device(values.dest(), into, op.deadline)
                    .map_err(|source| ring_error(unit, left, source))?;
            }
        }
        while let Some(sent) = sends.next().await {
            sent?;
        }
        // Piece `rank` now holds every trainer's contribution: add it into its owners.
        let owned = g.piece(len, g.node, g.lane);
        let from = place(whole, owned.clone(), 4);
        bytes += transfer::push_device(cuda, routes, &op, owned, from).await?;
        Ok(bytes)
    }
}
