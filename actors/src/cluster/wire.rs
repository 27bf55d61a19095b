//! `ractor::Message` for every actor message of [`messages`](crate::messages): each variant is a
//! cast or a call with one [`codec`](super::codec)-encoded payload, so any of them can be sent to
//! an actor in another process. Local sends never encode (ractor only serializes for a remote
//! actor).

use ractor::message::{BoxedDowncastErr, SerializedMessage};
use ractor::Message;

use super::codec::{call, cast, decode, reply_port, split, unknown};
use crate::cluster::messages::HostMsg;
use crate::server::messages::ServerMsg;
use crate::supervisor::messages::SupervisorMsg;
use crate::trainer::messages::TrainerMsg;

impl Message for ServerMsg {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        match self {
            ServerMsg::Routes(reply) => call("Routes", &(), reply),
            ServerMsg::OpenRelays(cmd, reply) => call("OpenRelays", &cmd, reply),
            ServerMsg::Flush(cmd, reply) => call("Flush", &cmd, reply),
            ServerMsg::ExpectRelays(cmd, reply) => call("ExpectRelays", &cmd, reply),
            ServerMsg::Reduce(cmd, reply) => call("Reduce", &cmd, reply),
            ServerMsg::Apply(cmd, reply) => call("Apply", &cmd, reply),
            ServerMsg::Discard(cmd, reply) => call("Discard", &cmd, reply),
            ServerMsg::Snapshot(cmd, reply) => call("Snapshot", &cmd, reply),
            ServerMsg::WriteShards(cmd, reply) => call("WriteShards", &cmd, reply),
            ServerMsg::ShardsWritten(reply) => call("ShardsWritten", &(), reply),
            ServerMsg::PublishShards(cmd, reply) => call("PublishShards", &cmd, reply),
        }
    }

    fn deserialize(message: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        let (variant, args, reply) = split(message)?;
        let Some(reply) = reply else {
            return unknown("shard server", &variant, false);
        };
        Ok(match variant.as_str() {
            "Routes" => {
                decode::<()>("Routes", &args)?;
                ServerMsg::Routes(reply_port("Routes", reply))
            }
            "OpenRelays" => ServerMsg::OpenRelays(
                decode("OpenRelays", &args)?,
                reply_port("OpenRelays", reply),
            ),
            "Flush" => ServerMsg::Flush(decode("Flush", &args)?, reply_port("Flush", reply)),
            "ExpectRelays" => ServerMsg::ExpectRelays(
                decode("ExpectRelays", &args)?,
                reply_port("ExpectRelays", reply),
            ),
            "Reduce" => ServerMsg::Reduce(decode("Reduce", &args)?, reply_port("Reduce", reply)),
            "Apply" => ServerMsg::Apply(decode("Apply", &args)?, reply_port("Apply", reply)),
            "Discard" => {
                ServerMsg::Discard(decode("Discard", &args)?, reply_port("Discard", reply))
            }
            "Snapshot" => {
                ServerMsg::Snapshot(decode("Snapshot", &args)?, reply_port("Snapshot", reply))
            }
            "WriteShards" => ServerMsg::WriteShards(
                decode("WriteShards", &args)?,
                reply_port("WriteShards", reply),
            ),
            "ShardsWritten" => {
                decode::<()>("ShardsWritten", &args)?;
                ServerMsg::ShardsWritten(reply_port("ShardsWritten", reply))
            }
            "PublishShards" => ServerMsg::PublishShards(
                decode("PublishShards", &args)?,
                reply_port("PublishShards", reply),
            ),
            _ => return unknown("shard server", &variant, true),
        })
    }
}

impl Message for TrainerMsg {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        match self {
            TrainerMsg::Run(assignment) => cast("Run", &assignment),
        }
    }

    fn deserialize(message: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        match split(message)? {
            (variant, args, None) if variant == "Run" => Ok(TrainerMsg::Run(decode("Run", &args)?)),
            (variant, _, reply) => unknown("trainer", &variant, reply.is_some()),
        }
    }
}

impl Message for SupervisorMsg {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        match self {
            SupervisorMsg::Step(samples, reply) => call("Step", &samples, reply),
            SupervisorMsg::Done(report) => cast("Done", &report),
            SupervisorMsg::Parameters(cmd, reply) => call("Parameters", &cmd, reply),
            SupervisorMsg::Published(reply) => call("Published", &(), reply),
            SupervisorMsg::WriteShards(cmd, reply) => call("WriteShards", &cmd, reply),
            SupervisorMsg::ShardsWritten(reply) => call("ShardsWritten", &(), reply),
            SupervisorMsg::PublishShards(cmds, reply) => call("PublishShards", &cmds, reply),
            SupervisorMsg::Tick => cast("Tick", &()),
            SupervisorMsg::Servers(outcome) => cast("Servers", &outcome),
        }
    }

    fn deserialize(message: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        let (variant, args, reply) = split(message)?;
        Ok(match (variant.as_str(), reply) {
            ("Step", Some(reply)) => {
                SupervisorMsg::Step(decode("Step", &args)?, reply_port("Step", reply))
            }
            ("Parameters", Some(reply)) => SupervisorMsg::Parameters(
                decode("Parameters", &args)?,
                reply_port("Parameters", reply),
            ),
            ("Published", Some(reply)) => {
                decode::<()>("Published", &args)?;
                SupervisorMsg::Published(reply_port("Published", reply))
            }
            ("WriteShards", Some(reply)) => SupervisorMsg::WriteShards(
                decode("WriteShards", &args)?,
                reply_port("WriteShards", reply),
            ),
            ("ShardsWritten", Some(reply)) => {
                decode::<()>("ShardsWritten", &args)?;
                SupervisorMsg::ShardsWritten(reply_port("ShardsWritten", reply))
            }
            ("PublishShards", Some(reply)) => SupervisorMsg::PublishShards(
                decode("PublishShards", &args)?,
                reply_port("PublishShards", reply),
            ),
            ("Done", None) => SupervisorMsg::Done(decode("Done", &args)?),
            ("Tick", None) => {
                decode::<()>("Tick", &args)?;
                SupervisorMsg::Tick
            }
            ("Servers", None) => SupervisorMsg::Servers(decode("Servers", &args)?),
            (_, reply) => return unknown("supervisor", &variant, reply.is_some()),
        })
    }
}

impl Message for HostMsg {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        match self {
            HostMsg::SpawnServer(spawn, reply) => call("SpawnServer", &spawn, reply),
            HostMsg::SpawnTrainer(spawn, reply) => call("SpawnTrainer", &spawn, reply),
            HostMsg::Inbox(update, reply) => call("Inbox", &update, reply),
            HostMsg::Kill(group) => cast("Kill", &group),
            HostMsg::Abort(epoch) => cast("Abort", &epoch),
            HostMsg::Step(outcome) => cast("Step", &outcome),
            HostMsg::StepFailed(outcome, reply) => call("StepFailed", &outcome, reply),
            HostMsg::Leaving(rank) => cast("Leaving", &rank),
            HostMsg::Shutdown(reason) => cast("Shutdown", &reason),
            HostMsg::Heartbeat(reply) => call("Heartbeat", &(), reply),
            HostMsg::Contribute(part) => cast("Contribute", &part),
            HostMsg::Gathered(parts) => cast("Gathered", &parts),
        }
    }

    fn deserialize(message: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        let (variant, args, reply) = split(message)?;
        Ok(match (variant.as_str(), reply) {
            ("SpawnServer", Some(reply)) => HostMsg::SpawnServer(
                decode("SpawnServer", &args)?,
                reply_port("SpawnServer", reply),
            ),
            ("SpawnTrainer", Some(reply)) => HostMsg::SpawnTrainer(
                decode("SpawnTrainer", &args)?,
                reply_port("SpawnTrainer", reply),
            ),
            ("Inbox", Some(reply)) => {
                HostMsg::Inbox(decode("Inbox", &args)?, reply_port("Inbox", reply))
            }
            ("StepFailed", Some(reply)) => HostMsg::StepFailed(
                decode("StepFailed", &args)?,
                reply_port("StepFailed", reply),
            ),
            ("Heartbeat", Some(reply)) => {
                decode::<()>("Heartbeat", &args)?;
                HostMsg::Heartbeat(reply_port("Heartbeat", reply))
            }
            ("Kill", None) => HostMsg::Kill(decode("Kill", &args)?),
            ("Abort", None) => HostMsg::Abort(decode("Abort", &args)?),
            ("Step", None) => HostMsg::Step(decode("Step", &args)?),
            ("Leaving", None) => HostMsg::Leaving(decode("Leaving", &args)?),
            ("Shutdown", None) => HostMsg::Shutdown(decode("Shutdown", &args)?),
            ("Contribute", None) => HostMsg::Contribute(decode("Contribute", &args)?),
            ("Gathered", None) => HostMsg::Gathered(decode("Gathered", &args)?),
            (_, reply) => return unknown("node host", &variant, reply.is_some()),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use odc_transport::local::LocalTransport;
    use odc_transport::Transport;

    use crate::policy::step::StepError;
    use ractor::concurrency::oneshot;
    use ractor::RpcReplyPort;

    use super::*;
    use crate::batch::{LossWeighting, MicroBatch, SampleMeta};
    use crate::cluster::messages::{Contribution, Gathered, InboxUpdate, StepOutcome};
    use crate::error::{Error, Result};
    use crate::policy::clock::Timestamp;
    use crate::server::messages::{
        ApplyCmd, FlushAck, FlushCmd, OpenRelaysCmd, ReduceAck, ReduceCmd,
    };
    use crate::trainer::messages::{Assignment, TrainerReport};

    /// A message as a peer would receive it: serialized, then deserialized.
    fn cross<M: Message>(message: M) -> M {
        M::deserialize(message.serialize().expect("serializes")).expect("deserializes")
    }

    /// A call crossing the wire: the receiver answers `answer` and the caller gets it back.
    async fn call_across<M: Message, T: Send + 'static + std::fmt::Debug + PartialEq + Clone>(
        make: impl FnOnce(RpcReplyPort<T>) -> M,
        answer_on: impl FnOnce(M) -> Option<(RpcReplyPort<T>, T)>,
        expect: T,
    ) {
        let (tx, rx) = oneshot();
        let sent = make(RpcReplyPort::from((tx, Duration::from_secs(5))));
        let received = cross(sent);
        let (port, value) = answer_on(received).expect("the same variant");
        port.send(value).expect("the bridge is open");
        let got = tokio::time::timeout(Duration::from_secs(5), rx)
            .await
            .expect("answered in time")
            .expect("not dropped");
        assert_eq!(got, expect);
    }

    #[tokio::test]
    async fn every_call_crosses_with_its_reply() {
        call_across(
            |r| {
                ServerMsg::Reduce(
                    ReduceCmd {
                        scale: 0.1,
                        next_epoch: 3,
                    },
                    r,
                )
            },
            |m| match m {
                ServerMsg::Reduce(cmd, r) if cmd.scale == 0.1 && cmd.next_epoch == 3 => {
                    Some((r, Ok(ReduceAck { sum_sq: 1.0 / 3.0 })))
                }
                _ => None,
            },
            Ok(ReduceAck { sum_sq: 1.0 / 3.0 }),
        )
        .await;
        let flush = FlushCmd {
            epoch: 2,
            next_epoch: 3,
            timeout_ms: 9,
        };
        let ack = FlushAck {
            combined: vec![crate::policy::relay::Combined {
                server: 1,
                unit: 3,
                owner: 0,
                micro_batches: vec![2, 5],
                early: false,
            }],
        };
        let answer = ack.clone();
        call_across(
            |r| ServerMsg::Flush(flush, r),
            |m| match m {
                ServerMsg::Flush(cmd, r) if cmd == flush => Some((r, Ok(answer))),
                _ => None,
            },
            Ok(ack),
        )
        .await;
        call_across(
            |r| {
                let cmd = OpenRelaysCmd {
                    targets: Vec::new(),
                    chunk_elems: 5,
                };
                ServerMsg::OpenRelays(cmd, r)
            },
            |m| match m {
                ServerMsg::OpenRelays(cmd, r) if cmd.chunk_elems == 5 => Some((r, Ok(Vec::new()))),
                _ => None,
            },
            Ok(Vec::<crate::server::messages::RelayRoute>::new()),
        )
        .await;
        call_across(
            |r| {
                ServerMsg::Apply(
                    ApplyCmd {
                        lr_scale: 1.0,
                        clip: 0.5,
                        version: 2,
                    },
                    r,
                )
            },
            |m| match m {
                ServerMsg::Apply(_, r) => Some((r, Err(Error::Step(StepError::Busy)))),
                _ => None,
            },
            Err::<(), _>(Error::Step(StepError::Busy)),
        )
        .await;
        call_across(
            |r| SupervisorMsg::Step(vec![SampleMeta::new(1, 2)], r),
            |m| match m {
                SupervisorMsg::Step(samples, r) if samples == vec![SampleMeta::new(1, 2)] => {
                    Some((r, Err(Error::Step(StepError::EmptyMinibatch { step: 9 }))))
                }
                _ => None,
            },
            Err(Error::Step(StepError::EmptyMinibatch { step: 9 })),
        )
        .await;
        let handle = LocalTransport::new()
            .register_accumulator(1, 4, 0)
            .expect("register")
            .handle();
        call_across(
            |r| {
                HostMsg::Inbox(
                    InboxUpdate {
                        rank: 2,
                        inbox: handle.clone(),
                    },
                    r,
                )
            },
            |m| match m {
                HostMsg::Inbox(u, r) if u.rank == 2 => Some((r, Ok(()))),
                _ => None,
            },
            Ok::<(), Error>(()),
        )
        .await;
    }

    #[test]
    fn every_cast_crosses_unchanged() {
        let report = TrainerReport {
            trainer: 1,
            epoch: 2,
            micro_batch: 3,
            token: u128::MAX - 1,
            started: Timestamp::from_nanos(4),
            finished: Timestamp::from_nanos(5),
            result: Err(Error::user(std::io::Error::other("boom"))),
        };
        match cross(SupervisorMsg::Done(report.clone())) {
            SupervisorMsg::Done(r) => assert_eq!(r, report),
            _ => panic!("Done"),
        }
        let assignment = Assignment {
            micro_batch: MicroBatch {
                step: 1,
                id: 2,
                samples: vec![SampleMeta::new(3, 4)],
                tokens: 4,
                cost: 0.1 + 0.2,
                weighting: LossWeighting::Tokens,
                pieces: Vec::new(),
            },
            epoch: 6,
            step: 3,
            token: 1 << 90,
        };
        match cross(TrainerMsg::Run(assignment.clone())) {
            TrainerMsg::Run(a) => assert_eq!(a, assignment, "f64 bits survive"),
        }
        let outcome = StepOutcome {
            step: 3,
            result: Err::<_, Error>(Error::Step(StepError::NoTrainers { step: 3 })),
        };
        match cross(HostMsg::Step(outcome.clone())) {
            HostMsg::Step(o) => assert_eq!(o, outcome),
            _ => panic!("Step"),
        }
        assert!(matches!(cross(HostMsg::Abort(7)), HostMsg::Abort(7)));
        assert!(matches!(cross(HostMsg::Leaving(3)), HostMsg::Leaving(3)));
        assert!(matches!(
            cross(HostMsg::Shutdown(Some("x".into()))),
            HostMsg::Shutdown(Some(r)) if r == "x"
        ));
        assert!(matches!(cross(SupervisorMsg::Tick), SupervisorMsg::Tick));
        let part = Contribution {
            round: 2,
            rank: 1,
            bytes: vec![0, 255, 7],
        };
        match cross(HostMsg::Contribute(part.clone())) {
            HostMsg::Contribute(p) => assert_eq!(p, part),
            _ => panic!("Contribute"),
        }
        for parts in [Ok(vec![vec![1], vec![], vec![2, 3]]), Err("lost".into())] {
            let gathered = Gathered { round: 2, parts };
            match cross(HostMsg::Gathered(gathered.clone())) {
                HostMsg::Gathered(g) => assert_eq!(g, gathered),
                _ => panic!("Gathered"),
            }
        }
    }

    #[test]
    fn bad_bytes_from_a_peer_are_dropped_not_panicked_on() {
        let good = match SupervisorMsg::Done(TrainerReport {
            trainer: 0,
            epoch: 0,
            micro_batch: 0,
            token: 0,
            started: Timestamp::from_nanos(0),
            finished: Timestamp::from_nanos(0),
            result: Err(Error::Step(StepError::Busy)),
        })
        .serialize()
        .expect("serializes")
        {
            SerializedMessage::Cast { args, .. } => args,
            _ => panic!("a cast"),
        };
        let cast = |variant: &str, args: Vec<u8>| SerializedMessage::Cast {
            variant: variant.into(),
            args,
            metadata: None,
        };
        // Truncated, trailing garbage, empty, an unknown variant, a cast of a call variant.
        for (variant, args) in [
            ("Done", good[..good.len() - 1].to_vec()),
            ("Done", [good.clone(), vec![0]].concat()),
            ("Done", vec![]),
            ("Explode", good.clone()),
            ("Step", good.clone()),
            ("Done", vec![0xff; 64]),
        ] {
            assert!(
                SupervisorMsg::deserialize(cast(variant, args.clone())).is_err(),
                "{variant} {args:?}"
            );
        }
        assert!(TrainerMsg::deserialize(cast("Run", vec![0xff; 3])).is_err());
        assert!(HostMsg::deserialize(cast("Kill", vec![200, 1])).is_err());
        assert!(
            ServerMsg::deserialize(cast("Routes", vec![])).is_err(),
            "a call sent as a cast"
        );
        // A length prefix claiming more than is there allocates nothing and fails.
        assert!(HostMsg::deserialize(cast("Kill", vec![0xff, 0xff, 0xff, 0xff, 0x0f])).is_err());
    }

    #[test]
    fn the_payload_is_small() -> Result<()> {
        let SerializedMessage::Cast { args, .. } = HostMsg::Abort(1)
            .serialize()
            .map_err(|_| Error::Internal("serialize".into()))?
        else {
            return Err(Error::Internal("a cast".into()));
        };
        assert_eq!(args, [1]);
        Ok(())
    }
}
