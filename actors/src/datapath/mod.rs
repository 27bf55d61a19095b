//! Data paths: how a trainer's gathers and gradient pushes move. This is the one place the two
//! modes differ; [`TrainerContext`](crate::trainer::TrainerContext) calls the [`DataPath`] trait
//! and never branches on the mode.
//!
//! - [`OnDemand`] (odc): a gather reads every chunk of every shard of the unit straight from its
//!   owner's published copy (one-sided, every owner at once, one batch with one deadline); a push
//!   writes every chunk of the gradient into its owner's accumulator. A trainer waits only on its
//!   own transfers, never on another trainer (**I4**).
//! - [`Collective`] (the FSDP baseline at its best, docs/design.md, "As built": data paths): a
//!   gather is a ring all-gather among all trainers and a push a ring reduce-scatter. Signalling is
//!   neighbour-only: each ring step is a message into the right neighbour's persistent inbox
//!   (transport C7), so a trainer waits for its left neighbour only, never for a global barrier.
//!
//! Both reach device memory where the job's transport is odc-transport's `cuda` backend (feature
//! `cuda-code`; [`DataPath::gather_device`], [`DataPath::push_device`]): on demand one read per
//! shard and one kernel add per owner, the collective its rings with device messages.
//!
//! What both paths cost per trainer and unit (so the A/B compares paradigms, not implementations):
//!
//! | | on-demand | collective |
//! |---|---|---|
//! | bytes in per gather | one unit (pull dtype) | one unit (pull dtype: bf16 all-gathers when
//! pulls are bf16) |
//! | passes over a gathered element | 1 decode into the unit buffer | 1 decode (its own piece: 1
//! copy + 1 decode) |
//! | bytes out per push | one unit of fp32 | one unit of fp32 |
//! | passes over a gradient element | 1 encode (with the finiteness check) + 1 add at the owner | 1
//! copy (with the finiteness check) + 1 encode + 1 add (at the neighbour or the owner) |
//! | registration per operation | none | none (inboxes are registered once per trainer) |
//! | waits on other trainers | never | its left neighbour, once per ring step |
//!
//! A frozen unit ([`UnitSpec::frozen`](crate::layout::UnitSpec::frozen)) is gathered like any
//! other and never pushed: its shards have no accumulator, the trainer context refuses its push,
//! and both paths refuse one that reaches them ([`Error::FrozenUnit`](crate::Error::FrozenUnit))
//! before anything is sent — so a collective never reduce-scatters it.
//!
//! Operations are identified across trainers by an [`OpKey`] (epoch, micro-batch sequence number in
//! the epoch, unit, kind, occurrence), which the context assigns in call order, so prefetches and
//! re-gathers pair up whatever order tasks run in.
//!
//! Every gradient write into a server's accumulator is tagged with the attempt's epoch, a
//! [`write_id`] naming its micro-batch, unit, shard and chunk, and the token of the micro-batch's
//! assignment ([`Op::token`], [`crate::policy::token`]); the server applies it only if the token is
//! the one of (epoch, [`micro_batch_of`] the write id). In collective mode each trainer writes its
//! reduced piece under its own micro-batch and token. Messages between trainers (the ring's inbox
//! sends) are not covered: inboxes check epoch and write id only.

pub mod collective;
pub mod gang;
pub mod on_demand;
pub mod published;
pub(crate) mod transfer;

use std::sync::Arc;
use std::time::Instant;

pub use odc_transport::codec::NonFiniteElement;
use serde::{Deserialize, Serialize};

pub use collective::{Collective, CollectiveGroup};
pub use gang::GangChannel;
pub use on_demand::OnDemand;
pub use published::Published;
pub use transfer::{micro_batch_of, write_id};

use crate::error::Result;
use crate::layout::UnitId;
use crate::memory::{DeviceGrad, DeviceMemory, Lease, UnitValues};

/// What a collective operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OpKind {
    /// A gather (all-gather in collective mode).
    Gather,
    /// A gradient push (reduce-scatter in collective mode).
    Push,
}

/// Identifies one gather or push of a trainer; equal across trainers for the same logical
/// operation of the same micro-batch sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OpKey {
    /// Accumulator epoch of the minibatch attempt.
    pub epoch: u64,
    /// The trainer's micro-batch sequence number within the epoch.
    pub seq: u32,
    pub unit: UnitId,
    pub kind: OpKind,
    /// How many times this (unit, kind) was issued before in the micro-batch.
    pub occurrence: u32,
}

impl OpKey {
    /// A message id unique within an epoch for step `round` of this operation: sequence number
    /// (31 bits; the top bit is the gangs' namespace, [`GangChannel`]'s ids share the inbox in
    /// collective mode), unit (32), kind (1), occurrence (31) and round (32) packed into 128
    /// bits. Values beyond their field width wrap, which only a run of more than 2³¹ operations
    /// per epoch or 2³¹ repeats of one unit in one micro-batch could reach.
    pub fn message_id(&self, round: u32) -> u128 {
        let kind = match self.kind {
            OpKind::Gather => 0u128,
            OpKind::Push => 1u128,
        };
        (u128::from(self.seq & 0x7fff_ffff) << 96)
            | (u128::from(self.unit) << 64)
            | (kind << 63)
            | (u128::from(self.occurrence & 0x7fff_ffff) << 32)
            | u128::from(round)
    }
}

/// One gather or push as the data path sees it.
#[derive(Debug, Clone, Copy)]
pub struct Op {
    pub key: OpKey,
    /// Parameter version every read must return (I1).
    pub version: u64,
    /// Index of the micro-batch in its plan (part of every gradient write id).
    pub micro_batch: u32,
    /// The micro-batch's assignment token, carried by every gradient write into a server.
    pub token: u128,
    /// Every wait of the operation ends by then (I6).
    pub deadline: Instant,
}

/// A gathered unit: its values, the bytes this trainer moved for it, and the lease that counts the
/// buffer as held until the context takes it over (I5 accounting).
pub struct Gathered {
    pub values: UnitValues,
    pub bytes: u64,
    pub lease: Lease,
}

pub use crate::memory::Transfer;

/// How gathers and pushes move. Implementations build the future synchronously (taking what they
/// need from borrowed arguments) so the context can spawn it.
pub trait DataPath: Send + Sync + 'static {
    /// A micro-batch of attempt `epoch` starts (collective: the inbox forgets older epochs).
    fn begin(&self, epoch: u64);

    /// Fill `buffer` (exactly the unit's length, uniquely owned) with the whole unit at
    /// `op.version`.
    fn gather(&self, op: Op, buffer: Arc<[f32]>, lease: Lease) -> Transfer<Gathered>;

    /// Send `grad` (the gradient of the micro-batch's summed loss w.r.t. the whole unit) to the
    /// unit's owners; resolves to the bytes this trainer sent once every write was acknowledged.
    /// Refuses, before anything is sent, a gradient with an element that is not finite (the
    /// first one found, index in the unit), checked in the same pass that encodes or copies it.
    fn push(&self, op: Op, grad: &[f32]) -> Result<Transfer<u64>, NonFiniteElement>;

    /// Whether [`DataPath::gather_device`] can fill device memory (default: no).
    fn device_gathers(&self) -> bool {
        false
    }

    /// [`DataPath::gather`] into a buffer of `len` elements of the published dtype from
    /// `memory`, device to device (see [`crate::memory::device`]).
    fn gather_device(
        &self,
        op: Op,
        len: usize,
        memory: Arc<dyn DeviceMemory>,
        lease: Lease,
    ) -> Transfer<Gathered> {
        let _ = (len, memory, lease);
        Box::pin(std::future::ready(Err(device_unsupported(op, "gather"))))
    }

    /// Whether [`DataPath::push_device`] reaches the owners' accumulators (default: no).
    fn device_pushes(&self) -> bool {
        false
    }

    /// [`DataPath::push`] from device memory: `grad` (the whole unit, fp32) is added into the
    /// owners' accumulators once it is [ready](DeviceGrad::ready), device to device. Its
    /// finiteness is the compute's to check (the servers' barrier refuses a non-finite sum
    /// anyway).
    fn push_device(&self, op: Op, grad: Arc<dyn DeviceGrad>) -> Transfer<u64> {
        let _ = grad;
        Box::pin(std::future::ready(Err(device_unsupported(op, "push"))))
    }
}

/// The job's transport as odc-transport's `cuda` backend, which reaches device memory.
#[cfg(feature = "cuda-code")]
pub(crate) fn cuda_backend(
    transport: &Arc<dyn odc_transport::Transport>,
) -> Option<&odc_transport::cuda::CudaTransport> {
    transport.as_any()?.downcast_ref()
}

/// A device operation on a data path that has none.
fn device_unsupported(op: Op, what: &str) -> crate::error::Error {
    crate::error::Error::Internal(format!(
        "unit {}: this data path cannot {what} device memory",
        op.key.unit
    ))
}
