//! Every control-plane message between the supervisor, trainers and shard servers, in one place.
//!
//! Rules (docs/design.md, "As built": the control plane; ready for ractor_cluster):
//! - every payload and every reply is plain serializable data (serde): no `Instant` (times are
//!   [`Timestamp`](crate::policy::clock::Timestamp)s), no trait objects (errors cross as [`Error`](crate::Error), a kind with its context), no
//!   `usize` (fixed-width integers only) — checked for every message by this module's tests;
//! - no tensor bytes and nothing that grows with the model beyond one route or snapshot handle per
//!   unit: parameters and gradients move over the data plane (the transport);
//! - actors start from serializable specs ([`ServerSpec`], [`TrainerSpec`], [`SupervisorSpec`])
//!   plus their process's [`Node`](crate::node::Node), so a per-node spawner can start them from a
//!   message;
//! - RPC replies travel in a `RpcReplyPort` as the last field of their variant (ractor_cluster's
//!   `#[rpc]` form).

use std::ops::Range;
use std::sync::Arc;

use odc_transport::{Dtype, EndpointId, RegionHandle};
use ractor::RpcReplyPort;
use serde::{Deserialize, Serialize};

use crate::batch::SampleMeta;
use crate::directory::{Directory, ShardRoute};
use crate::error::Result;
use crate::layout::UnitId;
use crate::policy::dispatch::Communication;
use crate::policy::relay::{Combined, RelayPlan};
use crate::policy::stats::StepStats;
use crate::policy::step::StepConfig;
use crate::policy::token::JobKey;
use crate::server::optimizer::OptimizerConfig;
use crate::trainer::ContextConfig;

pub use odc_policy::assignment::{Assignment, MicroBatchDone};

/// What a trainer tells the supervisor after a micro-batch; a failed one carries the runtime's
/// [`Error`](crate::Error) (the policy's report, generic over it).
pub type TrainerReport = odc_policy::assignment::TrainerReport<crate::Error>;

// ---------------------------------------------------------------------------------------------
// Shard servers
// ---------------------------------------------------------------------------------------------

/// What a shard server is.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ServerSpec {
    /// This server's endpoint, `0..servers`; it holds shard `endpoint` of every unit.
    pub endpoint: EndpointId,
    pub servers: u32,
    pub optimizer: OptimizerConfig,
    /// Dtype of the published copy trainers pull.
    pub pull_dtype: Dtype,
    /// Epoch the accumulators start at.
    pub epoch: u64,
    /// The job's token key: the server admits a gradient write only with the token of the
    /// (epoch, micro-batch) it names ([`crate::policy::token`]). Sent to servers only, never to
    /// trainers.
    pub key: JobKey,
}

/// Barrier phase 1: take every accumulator (moving to `next_epoch`), scale it by `scale` and keep it
/// for [`ApplyCmd`]; the reply is the sum of squares of the scaled gradient.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReduceCmd {
    pub scale: f64,
    pub next_epoch: u64,
}

/// The reply to [`ReduceCmd`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReduceAck {
    pub sum_sq: f64,
}

/// Barrier phase 2: multiply the kept gradient by `clip`, run the optimizer at `lr_scale` times its
/// base learning rate, publish `version`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ApplyCmd {
    pub clip: f64,
    pub lr_scale: f64,
    pub version: u64,
}

/// Setup of relayed pushes ([`crate::policy::relay`]): the owners' routes of the shards this
/// server relays for its node (trainable ones), and the chunk size of its flushes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpenRelaysCmd {
    pub targets: Vec<ShardRoute>,
    pub chunk_elems: u64,
}

/// One relay: a node-local fp32 accumulator that takes its node's pushes for one owner's shard
/// of one unit (the same elements), and flushes them to the owner at the barrier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RelayRoute {
    /// The relaying server.
    pub relay: EndpointId,
    pub unit: UnitId,
    /// The shard's owner.
    pub owner: EndpointId,
    /// Where the node's trainers push that shard instead of the owner's accumulator.
    pub accumulator: RegionHandle,
}

/// Barrier phase 0 with relayed pushes: take every relay (moving it to `next_epoch`) and add it
/// into its owner's accumulator under `epoch`, within `timeout_ms`; sent to every server, and
/// `Reduce` only once all have acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlushCmd {
    pub epoch: u64,
    pub next_epoch: u64,
    pub timeout_ms: u64,
}

/// Relayed pushes with a static plan, as an attempt starts: the micro-batches this server's
/// node runs in `epoch`. A relay that has every write of them flushes at once, while the step
/// runs (moving to `epoch + 1`, as the barrier's flush would), each write within `timeout_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpectRelaysCmd {
    pub epoch: u64,
    pub micro_batches: u32,
    pub timeout_ms: u64,
}

/// The reply to [`FlushCmd`], once every relay of the server reached its owner (at the barrier
/// or earlier): what each combined, which the supervisor checks against its ledger before any
/// owner reduces. (The bytes sent are the server's metric, `odc_relay_flushed_bytes_total`.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlushAck {
    pub combined: Vec<Combined>,
}

/// Drop everything accumulated in this attempt and move to `next_epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DiscardCmd {
    pub next_epoch: u64,
}

/// An fp32 copy of one shard's master values at `version`, readable over the data plane.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardSnapshot {
    pub unit: UnitId,
    /// First element of the shard within its unit.
    pub start: u64,
    pub end: u64,
    pub version: u64,
    pub region: RegionHandle,
    /// The shard's optimizer state, when asked for ([`SnapshotCmd::optimizer`]).
    pub optimizer: Option<OptimizerSnapshot>,
}

/// fp32 copies of one shard's optimizer buffers, readable over the data plane. The default (0
/// steps, no buffers) is a frozen unit's: it has no optimizer state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OptimizerSnapshot {
    /// Optimizer steps taken.
    pub steps: u64,
    /// Each buffer's name (torch's: `exp_avg`, `exp_avg_sq`, `momentum_buffer`) and region.
    pub buffers: Vec<(String, RegionHandle)>,
}

/// Write this server's shards into the directory `dir` (a sharded checkpoint's staging directory:
/// the lead's where this server's host shares its filesystem, else made on this host, see
/// [`step_dir`](crate::server::step_dir)) as `shard-<endpoint>.safetensors`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteShardsCmd {
    pub dir: String,
}

/// What a server wrote for a checkpoint: its file, and the id of the staging directory it wrote
/// into ([`step_dir::claim`](crate::server::step_dir::claim)): the lead's token where it shares
/// the lead's directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrittenShards {
    pub file: crate::server::shard_file::ShardFile,
    pub dir_id: String,
}

/// Publish this host's part of a checkpoint (per-host directories): write `files` (name and
/// bytes: the checkpoint's state and this host's manifest) into `staging`, sync, and rename it to
/// `target` ([`step_dir::publish_with`](crate::server::step_dir::publish_with)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishShardsCmd {
    pub staging: String,
    pub target: String,
    pub files: Vec<(String, Vec<u8>)>,
    /// Then keep this host's newest `keep_last` step directories (0: all).
    pub keep_last: usize,
}

/// What a snapshot holds besides the master values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SnapshotCmd {
    /// Also the optimizer state (for a checkpoint).
    pub optimizer: bool,
}

impl ShardSnapshot {
    /// Elements of the unit this snapshot holds.
    pub fn range(&self) -> Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// Messages of a shard server.
pub enum ServerMsg {
    /// Routes of this server's non-empty shards, in unit order.
    Routes(RpcReplyPort<Vec<ShardRoute>>),
    /// Register a relay for each target and return their routes (once, at the job's start).
    OpenRelays(OpenRelaysCmd, RpcReplyPort<Result<Vec<RelayRoute>>>),
    /// Flush every relay into its owner (relayed pushes only, before `Reduce`).
    Flush(FlushCmd, RpcReplyPort<Result<FlushAck>>),
    ExpectRelays(ExpectRelaysCmd, RpcReplyPort<Result<()>>),
    Reduce(ReduceCmd, RpcReplyPort<Result<ReduceAck>>),
    Apply(ApplyCmd, RpcReplyPort<Result<()>>),
    Discard(DiscardCmd, RpcReplyPort<Result<()>>),
    /// Publish the fp32 master values of every shard (and, when asked, the optimizer state) for a
    /// read-out over the data plane.
    Snapshot(SnapshotCmd, RpcReplyPort<Result<Vec<ShardSnapshot>>>),
    /// Copy every shard (master values and optimizer state, at the server's version) and reply;
    /// then write the copy to one file in the command's directory, synced
    /// ([`shard_file`](crate::server::shard_file)), while the job goes on. Refused while the
    /// previous write runs.
    WriteShards(WriteShardsCmd, RpcReplyPort<Result<()>>),
    /// The file of the last write, once it is on disk (or why it is not).
    ShardsWritten(RpcReplyPort<Result<WrittenShards>>),
    /// Publish this host's part of a checkpoint.
    PublishShards(PublishShardsCmd, RpcReplyPort<Result<()>>),
}

// ---------------------------------------------------------------------------------------------
// Trainers
// ---------------------------------------------------------------------------------------------

/// What a trainer is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerSpec {
    /// The trainer's slot (its rank in collective mode).
    pub rank: u32,
    pub communication: Communication,
    pub context: ContextConfig,
    /// Where every shard lives: one directory shared by every trainer that pushes alike (a
    /// node's, with relayed pushes), not a copy each (its routes grow with units × servers).
    #[serde(with = "shared_directory")]
    pub directory: Arc<Directory>,
}

/// A shared [`Directory`] on the wire: its value (each process shares what it decoded).
pub(crate) mod shared_directory {
    use std::sync::Arc;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::directory::Directory;

    pub fn serialize<S: Serializer>(directory: &Arc<Directory>, s: S) -> Result<S::Ok, S::Error> {
        directory.as_ref().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<Directory>, D::Error> {
        Directory::deserialize(d).map(Arc::new)
    }
}

/// Messages of a trainer.
pub enum TrainerMsg {
    Run(Assignment),
}

// ---------------------------------------------------------------------------------------------
// The supervisor
// ---------------------------------------------------------------------------------------------

/// What a job is: the supervisor's serializable configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SupervisorSpec {
    pub trainers: u32,
    pub servers: u32,
    pub optimizer: OptimizerConfig,
    pub pull_dtype: Dtype,
    pub context: ContextConfig,
    pub step: StepConfig,
    /// Relayed pushes: where every trainer and server sits, by node (`None`: every trainer
    /// pushes straight to the owners).
    pub relay: Option<RelayPlan>,
}

/// Outcome of a barrier or discard call to every server (sent by the supervisor's own task).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ServerOutcome {
    /// What every server's relays combined.
    Flushed(Result<Vec<Combined>>),
    /// Sum over servers of their sums of squares.
    Reduced(Result<f64>),
    Applied(Result<()>),
    Discarded(Result<()>),
}

/// Messages of the supervisor.
pub enum SupervisorMsg {
    /// Train one minibatch; replies after the optimizer step.
    Step(Vec<SampleMeta>, RpcReplyPort<Result<StepStats>>),
    /// A trainer finished a micro-batch.
    Done(TrainerReport),
    /// Where to read the fp32 master parameters (and, when asked, the optimizer state) of every
    /// shard over the data plane.
    Parameters(SnapshotCmd, RpcReplyPort<Result<Vec<ShardSnapshot>>>),
    /// Where the published copies are and their version, for a reader outside the trainers
    /// (RL's sampler); [`Error::Busy`](crate::Error::Busy) while a step runs (its version is
    /// about to change).
    Published(RpcReplyPort<Result<crate::datapath::Published>>),
    /// Every server copies its shards and starts writing them into the command's directory (a
    /// sharded checkpoint); replies once every copy is taken.
    WriteShards(WriteShardsCmd, RpcReplyPort<Result<()>>),
    /// Every server's file of the last write, in server order, once all are on disk.
    ShardsWritten(RpcReplyPort<Result<Vec<WrittenShards>>>),
    /// Each named server publishes its host's part of a checkpoint (per-host directories).
    PublishShards(
        Vec<(EndpointId, PublishShardsCmd)>,
        RpcReplyPort<Result<()>>,
    ),
    /// Periodic: time passed (deadlines).
    Tick,
    /// The outcome of server calls the supervisor started.
    Servers(ServerOutcome),
}

// ---------------------------------------------------------------------------------------------
// Node hosts (one per process of a multi-process job)
// ---------------------------------------------------------------------------------------------

/// Start a shard server on this node as `group` (its `ractor::pg` group, unique per spawn).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerSpawn {
    pub spec: ServerSpec,
    pub group: String,
    /// The coordinator's [`ModelLayout::digest`](crate::layout::ModelLayout::digest): every
    /// process must build the same model.
    pub layout: u64,
}

/// Start a trainer on this node as `group`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerSpawn {
    pub spec: TrainerSpec,
    pub group: String,
    pub layout: u64,
}

/// A trainer started: its collective inbox (collective mode), for every other node's group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerStarted {
    pub inbox: Option<RegionHandle>,
}

/// Where the collective inbox of trainer `rank` is now (it started or was respawned).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InboxUpdate {
    pub rank: u32,
    pub inbox: RegionHandle,
}

/// How a step ended, told by the coordinator to every other process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepOutcome {
    pub step: u64,
    pub result: Result<StepStats>,
}

/// One rank's part of an all-gather (`Job::all_gather`): bytes the application encoded (a small
/// object such as a rank's sampled responses, never tensors: those move over the data plane),
/// sent by rank `rank` to the coordinator for gather `round` (the job's count of earlier ones).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Contribution {
    pub round: u64,
    pub rank: u32,
    pub bytes: Vec<u8>,
}

/// The coordinator's answer to gather `round`: every rank's bytes in rank order, or why the
/// gather failed (a rank was lost, the parts exceed a control frame).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gathered {
    pub round: u64,
    pub parts: std::result::Result<Vec<Vec<u8>>, String>,
}

/// Messages of a node host: the per-process actor that starts servers and trainers on request
/// of the supervisor (which may be in another process) and relays the job's progress to the
/// process's [`Job`](crate::cluster).
pub enum HostMsg {
    SpawnServer(ServerSpawn, RpcReplyPort<Result<()>>),
    SpawnTrainer(TrainerSpawn, RpcReplyPort<Result<TrainerStarted>>),
    /// Register a trainer's collective inbox in this node's group.
    Inbox(InboxUpdate, RpcReplyPort<Result<()>>),
    /// Kill the actor of this `group` (a hung trainer).
    Kill(String),
    /// Abort every collective of an epoch below this one (a discarded attempt).
    Abort(u64),
    /// A step ended (coordinator to every other process).
    Step(StepOutcome),
    /// A step failed (coordinator to every other process, acknowledged: the coordinator is
    /// about to stop and must know the others heard why before it exits).
    StepFailed(StepOutcome, RpcReplyPort<()>),
    /// Rank `n` is done with the job and waits for [`HostMsg::Shutdown`] (to the coordinator).
    Leaving(u32),
    /// The job is over: stop this node's actors (`Some(reason)` when it failed).
    Shutdown(Option<String>),
    /// The coordinator's heartbeat (answered at once; a rank that stops answering is lost).
    Heartbeat(RpcReplyPort<()>),
    /// A rank's part of an all-gather (to the coordinator).
    Contribute(Contribution),
    /// Every rank's parts of an all-gather (coordinator to every other process).
    Gathered(Gathered),
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use odc_transport::local::LocalTransport;
    use odc_transport::{Transport, TransportError};
    use serde::de::DeserializeOwned;

    use super::*;
    use crate::batch::{ComputeOutput, LossWeighting, MicroBatch};
    use crate::error::Error;
    use crate::policy::clock::Timestamp;
    use crate::policy::stats::{MicroBatchStats, Span, SpanKind};

    /// `value` survives a serialization round trip unchanged.
    fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(value: T) {
        let bytes = serde_json::to_vec(&value).expect("serializes");
        let back: T = serde_json::from_slice(&bytes).expect("deserializes");
        assert_eq!(back, value);
    }

    fn handle() -> RegionHandle {
        let t = LocalTransport::new();
        let region = t.register_accumulator(3, 8, 2).expect("register");
        region.handle()
    }

    fn micro_batch() -> MicroBatch {
        MicroBatch {
            step: 4,
            id: 7,
            samples: vec![SampleMeta::new(11, 300), SampleMeta::new(12, 5)],
            tokens: 305,
            cost: 0.25,
            weighting: LossWeighting::Samples,
            pieces: vec![crate::batch::Piece {
                sample: SampleMeta::new(13, 9000),
                epoch: 3,
                gang: 1,
                member: 2,
                members: 4,
                ranks: vec![5, 1, 7, 2],
            }],
        }
    }

    #[test]
    fn every_payload_and_reply_round_trips() {
        let route = ShardRoute {
            unit: 2,
            owner: 3,
            start: 4,
            end: 12,
            published: handle(),
            accumulator: Some(handle()),
        };
        let frozen = ShardRoute {
            accumulator: None,
            ..route.clone()
        };
        let spec = ServerSpec {
            endpoint: 1,
            servers: 4,
            optimizer: OptimizerConfig::adamw(1e-3),
            pull_dtype: Dtype::Bf16,
            epoch: 9,
            key: JobKey::from_bytes([5; 32]),
        };
        round_trip(spec);
        round_trip(vec![route.clone(), frozen]);
        round_trip(ReduceCmd {
            scale: 0.5,
            next_epoch: 3,
        });
        round_trip::<Result<ReduceAck>>(Ok(ReduceAck { sum_sq: 2.5 }));
        round_trip(ApplyCmd {
            lr_scale: 1.0,
            clip: 0.9,
            version: 8,
        });
        round_trip(DiscardCmd { next_epoch: 4 });
        round_trip(OpenRelaysCmd {
            targets: vec![route.clone()],
            chunk_elems: 1 << 16,
        });
        round_trip::<Result<Vec<RelayRoute>>>(Ok(vec![RelayRoute {
            relay: 1,
            unit: 2,
            owner: 3,
            accumulator: handle(),
        }]));
        round_trip(FlushCmd {
            epoch: 3,
            next_epoch: 4,
            timeout_ms: 50_000,
        });
        round_trip(ExpectRelaysCmd {
            epoch: 4,
            micro_batches: 9,
            timeout_ms: 1_000,
        });
        round_trip::<Result<FlushAck>>(Ok(FlushAck {
            combined: vec![Combined {
                server: 1,
                unit: 2,
                owner: 0,
                micro_batches: vec![0, 3, 5],
                early: true,
            }],
        }));
        round_trip::<Result<Vec<ShardSnapshot>>>(Ok(vec![ShardSnapshot {
            unit: 0,
            start: 0,
            end: 8,
            version: 2,
            region: handle(),
            optimizer: Some(OptimizerSnapshot {
                steps: 3,
                buffers: vec![("exp_avg".into(), handle())],
            }),
        }]));
        round_trip(SnapshotCmd { optimizer: true });
        let directory = Arc::new(Directory::from_routes(3, vec![route]).expect("directory"));
        round_trip::<Result<crate::datapath::Published>>(Ok(crate::datapath::Published {
            version: 6,
            directory: directory.clone(),
        }));
        round_trip(TrainerSpec {
            rank: 2,
            communication: Communication::Collective,
            context: ContextConfig::default(),
            directory,
        });
        round_trip(Assignment {
            micro_batch: micro_batch(),
            epoch: 5,
            token: u128::MAX - 3,
        });
        let stats = MicroBatchStats {
            pull_wait: Duration::from_micros(15),
            push_wait: Duration::from_micros(3),
            bytes_pulled: 1 << 20,
            bytes_pushed: 2 << 20,
            peak_gathered: 2,
            pulls: 8,
            spans: vec![Span {
                kind: SpanKind::Compute,
                start: Timestamp::from_nanos(10),
                end: Timestamp::from_nanos(30),
            }],
        };
        for result in [
            Ok(MicroBatchDone {
                output: ComputeOutput { loss_sum: 1.5 },
                stats,
            }),
            Err(Error::MicroBatch {
                step: 1,
                micro_batch: 2,
                trainer: 3,
                source: Box::new(Error::Pull {
                    unit: 1,
                    owner: 2,
                    source: TransportError::DeadlineExceeded {
                        owner: 2,
                        region: 5,
                        op: odc_transport::Op::Read,
                    },
                }),
            }),
            Err(Error::user(std::io::Error::other("disk on fire"))),
            Err(Error::NonFinite(Box::new(crate::NonFiniteAt {
                what: "gradient".into(),
                step: 4,
                trainer: Some(1),
                micro_batch: Some(3),
                samples: vec![11, 12],
                unit: Some(2),
                element: Some(17),
                value: f32::NEG_INFINITY.to_string(),
            }))),
        ] {
            round_trip(TrainerReport {
                trainer: 1,
                epoch: 2,
                micro_batch: 3,
                token: 1 << 100,
                started: Timestamp::from_nanos(5),
                finished: Timestamp::from_nanos(9),
                result,
            });
        }
        round_trip(SupervisorSpec {
            trainers: 4,
            servers: 2,
            optimizer: OptimizerConfig::sgd(0.1),
            pull_dtype: Dtype::F32,
            context: ContextConfig::default(),
            step: StepConfig {
                non_finite: crate::policy::step::NonFinite::SkipStep,
                ..StepConfig::default()
            },
            relay: Some(crate::policy::relay::RelayPlan::even(4, 2, 2).expect("plan")),
        });
        round_trip(vec![SampleMeta::new(1, 2)]);
        round_trip(ServerOutcome::Reduced(Err(Error::Deadline {
            what: "reduce".into(),
            step: 3,
            trainer: None,
            micro_batch: None,
            after_ms: 60_000,
        })));
        round_trip(ServerOutcome::Applied(Ok(())));
        round_trip(ServerOutcome::Discarded(Ok(())));
    }

    #[test]
    fn user_errors_keep_their_message_chain() {
        let e = Error::user(std::io::Error::other("disk on fire"));
        assert_eq!(e.to_string(), "user compute: disk on fire");
    }
}
