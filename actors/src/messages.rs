//! The control plane's messages. Each actor's live beside it — [`crate::server::messages`],
//! [`crate::trainer::messages`], [`crate::supervisor::messages`] and the node host's
//! [`crate::cluster::messages`] — and are re-exported here; this module states the rules they all
//! follow and tests them together.
//!
//! Rules (docs/design.md, "As built": the control plane; ready for ractor_cluster):
//! - every payload and every reply is plain serializable data (serde): no `Instant` (times are
//!   [`Timestamp`](crate::policy::clock::Timestamp)s), no trait objects (errors cross as
//!   [`Error`](crate::Error), a kind with its context), no `usize` (fixed-width integers only) —
//!   checked for every message by this module's tests;
//! - no tensor bytes and nothing that grows with the model beyond one route or snapshot handle per
//!   unit: parameters and gradients move over the data plane (the transport);
//! - actors start from serializable specs ([`ServerSpec`], [`TrainerSpec`], [`SupervisorSpec`])
//!   plus their process's [`Node`](crate::node::Node), so a per-node spawner can start them from a
//!   message;
//! - RPC replies travel in a `RpcReplyPort` as the last field of their variant (ractor_cluster's
//!   `#[rpc]` form).

pub use crate::cluster::messages::{
    Contribution, Gathered, HostMsg, InboxUpdate, ServerSpawn, StepOutcome, TrainerSpawn,
    TrainerStarted,
};
pub use crate::server::messages::{
    ApplyCmd, DiscardCmd, ExpectRelaysCmd, FlushAck, FlushCmd, OpenRelaysCmd, OptimizerSnapshot,
    PublishShardsCmd, ReduceAck, ReduceCmd, RelayRoute, ServerMsg, ServerSpec, ShardSnapshot,
    SnapshotCmd, WriteShardsCmd, WrittenShards,
};
pub use crate::supervisor::messages::{ServerOutcome, SupervisorMsg, SupervisorSpec};
pub use crate::trainer::messages::{
    Assignment, MicroBatchDone, TrainerMsg, TrainerReport, TrainerSpec,
};

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use odc_transport::local::LocalTransport;
    use odc_transport::{Transport, TransportError};

    use crate::policy::step::StepError;
    use serde::de::DeserializeOwned;

    use std::sync::Arc;

    use odc_transport::{Dtype, RegionHandle};
    use serde::Serialize;

    use super::*;
    use crate::batch::{ComputeOutput, LossWeighting, MicroBatch, SampleMeta};
    use crate::directory::{Directory, ShardRoute};
    use crate::error::{Error, Result};
    use crate::policy::clock::Timestamp;
    use crate::policy::dispatch::Communication;
    use crate::policy::relay::Combined;
    use crate::policy::stats::{MicroBatchStats, Span, SpanKind};
    use crate::policy::step::StepConfig;
    use crate::policy::token::JobKey;
    use crate::server::optimizer::OptimizerConfig;
    use crate::trainer::ContextConfig;

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
            step: 9,
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
            Err(Error::Step(StepError::NonFinite(Box::new(
                crate::NonFiniteAt {
                    what: "gradient".into(),
                    step: 4,
                    trainer: Some(1),
                    micro_batch: Some(3),
                    samples: vec![11, 12],
                    unit: Some(2),
                    element: Some(17),
                    value: f32::NEG_INFINITY.to_string(),
                },
            )))),
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
        round_trip(ServerOutcome::Reduced(Err(Error::Step(
            StepError::Deadline {
                what: "reduce".into(),
                step: 3,
                trainer: None,
                micro_batch: None,
                after_ms: 60_000,
            },
        ))));
        round_trip(ServerOutcome::Applied(Ok(())));
        round_trip(ServerOutcome::Discarded(Ok(())));
    }

    #[test]
    fn user_errors_keep_their_message_chain() {
        let e = Error::user(std::io::Error::other("disk on fire"));
        assert_eq!(e.to_string(), "user compute: disk on fire");
    }
}
