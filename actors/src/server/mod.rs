//! The shard server: owns, per unit, one shard of fp32 master weights, its optimizer state, an fp32
//! gradient accumulator region and a published copy (bf16 or fp32) region that trainers read.
//!
//! Invariants:
//! - **I1 consistency**: the published copy changes only in [`ServerMsg::Apply`], which the
//!   supervisor sends after the barrier, and each publication is atomic for readers (transport C1).
//! - **I2 exactly once**: [`ServerMsg::Reduce`] and [`ServerMsg::Discard`] take the accumulator and
//!   move it to the next epoch atomically (transport C3): writes of a discarded attempt, late or
//!   duplicated, are refused and never reach a step. Every accumulator admits only writes that
//!   carry the token of the (epoch, micro-batch) their write id names, under the job key of the
//!   server's [`ServerSpec`] (transport C8, [`crate::policy::token`]): a write forged by any peer,
//!   authenticated or not, is refused before it touches the accumulator or consumes a write id,
//!   so the genuine write still lands.
//! - **I6 liveness**: the reduce, optimizer and discard loops run on blocking threads, never on a
//!   tokio worker, so a large shard cannot stall the runtime's other tasks (transfers, timers).
//! - **Frozen units** ([`UnitSpec::frozen`](crate::layout::UnitSpec::frozen)): a frozen unit's
//!   shard holds only its fp32 master weights and published copy — no accumulator region (its
//!   [`ShardRoute`](crate::directory::ShardRoute) has none), no optimizer state (its
//!   [`OptimizerSnapshot`] is 0 steps and no buffers), no kept gradient. `Reduce` adds nothing
//!   for it, `Apply` steps nothing (no weight decay: its values stay bit-identical) and publishes
//!   the same bytes as the new version (I1), without encoding them again on the host.
//!
//! The actor is not on the data path: reads and accumulates go through the transport, and so does
//! the parameter read-out ([`ServerMsg::Snapshot`] hands out fp32 regions to read). A sharded
//! checkpoint is written by each server from its own memory ([`ServerMsg::WriteShards`],
//! [`shard_file`]). Every message
//! payload is plain serializable data, fixed-width integers only (ready for ractor_cluster); the
//! actor starts from a serializable [`ServerSpec`] plus its process's [`Node`](crate::node::Node).

mod actor;
#[cfg(all(feature = "cuda-code", target_os = "linux"))]
mod device;
pub mod messages;
/// The update rule, a pure core (`odc_policy::optimizer`).
pub use odc_policy::optimizer;
pub mod optimizer_kernels;
mod relay;
mod shard;

pub use actor::{ServerArgs, ShardServer};
pub use messages::{
    ApplyCmd, DiscardCmd, OptimizerSnapshot, ReduceAck, ReduceCmd, ServerMsg, ServerSpec,
    ShardSnapshot, SnapshotCmd, WriteShardsCmd,
};

/// A server's part of a sharded checkpoint: the files it writes (`odc-checkpoint`'s).
pub use odc_checkpoint::{shard_file, step_dir};
