//! The shard server actor: owns, per unit, one shard of fp32 master weights, its optimizer state,
//! an fp32 gradient accumulator region and a published copy (bf16 or fp32) region.
//!
//! Invariants:
//! - **I1 consistency**: the published copy changes only in [`ServerMsg::Apply`], which the
//!   supervisor sends after the barrier, and each publication is atomic for readers (transport C1).
//! - **I2 exactly once**: [`ServerMsg::Reduce`] and [`ServerMsg::Discard`] take the accumulator and move
//!   it to the next epoch atomically (transport C3): writes of a discarded attempt, late or duplicated,
//!   are refused and never reach a step.
//!
//! The actor is not on the data path: reads and accumulates go through the transport.

use std::ops::Range;
use std::sync::Arc;

use odc_transport::{codec, AccumulatorRegion, Dtype, EndpointId, PublishedRegion, Transport};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::directory::ShardRoute;
use crate::error::{Error, Result};
use crate::layout::{shard_range, ModelLayout};
use crate::optimizer::{OptimizerConfig, OptimizerState};

/// Messages of a shard server. Control only: no tensor bytes but the final parameter read-out.
pub enum ServerMsg {
    /// Routes of this server's shards, one per unit (None for an empty shard).
    Routes(RpcReplyPort<Vec<Option<ShardRoute>>>),
    /// Barrier phase 1: take every accumulator (moving to `next_epoch`), scale it by `scale`, keep it
    /// for `Apply`, reply the sum of squares of the scaled gradient.
    Reduce {
        scale: f64,
        next_epoch: u64,
        reply: RpcReplyPort<f64>,
    },
    /// Barrier phase 2: multiply the kept gradient by `clip`, run the optimizer, publish `version`.
    Apply {
        clip: f64,
        version: u64,
        reply: RpcReplyPort<Result<()>>,
    },
    /// Drop everything accumulated in this attempt and move to `next_epoch`.
    Discard {
        next_epoch: u64,
        reply: RpcReplyPort<()>,
    },
    /// fp32 master values of every shard: (unit, range within the unit, values).
    Parameters(RpcReplyPort<Vec<ShardValues>>),
}

/// fp32 master values of one shard: (unit, range within the unit, values).
pub type ShardValues = (usize, Range<usize>, Vec<f32>);

/// How to build a shard server.
pub struct ServerArgs {
    pub endpoint: EndpointId,
    pub servers: usize,
    pub layout: Arc<ModelLayout>,
    pub transport: Arc<dyn Transport>,
    pub optimizer: OptimizerConfig,
    /// Dtype of the published copy trainers pull.
    pub pull_dtype: Dtype,
    /// Epoch the accumulators start at.
    pub epoch: u64,
}

struct Shard {
    unit: usize,
    range: Range<usize>,
    master: Vec<f32>,
    optimizer: OptimizerState,
    published: Box<dyn PublishedRegion>,
    accumulator: Box<dyn AccumulatorRegion>,
    grad: Option<Vec<f32>>,
}

/// State of a shard server: its shards (non-empty ones only).
pub struct ServerState {
    endpoint: EndpointId,
    shards: Vec<Shard>,
    units: usize,
    optimizer: OptimizerConfig,
    pull_dtype: Dtype,
}

/// The shard server actor.
pub struct ShardServer;

impl Actor for ShardServer {
    type Msg = ServerMsg;
    type State = ServerState;
    type Arguments = ServerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: ServerArgs,
    ) -> std::result::Result<ServerState, ActorProcessingErr> {
        let mut shards = Vec::new();
        for (unit, spec) in args.layout.units().iter().enumerate() {
            let range = shard_range(spec.len, args.servers, args.endpoint as usize);
            if range.is_empty() {
                continue;
            }
            let master = spec.init.slice(range.clone());
            let published = args.transport.register_published(
                args.endpoint,
                args.pull_dtype,
                codec::encode(args.pull_dtype, &master),
                0,
            )?;
            let accumulator =
                args.transport
                    .register_accumulator(args.endpoint, range.len(), args.epoch)?;
            shards.push(Shard {
                unit,
                optimizer: OptimizerState::new(&args.optimizer, range.len()),
                range,
                master,
                published,
                accumulator,
                grad: None,
            });
        }
        Ok(ServerState {
            endpoint: args.endpoint,
            shards,
            units: args.layout.len(),
            optimizer: args.optimizer,
            pull_dtype: args.pull_dtype,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: ServerMsg,
        state: &mut ServerState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        match msg {
            ServerMsg::Routes(reply) => {
                let mut routes = vec![None; state.units];
                for shard in &state.shards {
                    routes[shard.unit] = Some(ShardRoute {
                        owner: state.endpoint,
                        range: shard.range.clone(),
                        published: shard.published.handle(),
                        accumulator: shard.accumulator.handle(),
                    });
                }
                let _ = reply.send(routes);
            }
            ServerMsg::Reduce {
                scale,
                next_epoch,
                reply,
            } => {
                let mut sum_sq = 0f64;
                for shard in &mut state.shards {
                    let mut grad = shard.accumulator.take(next_epoch);
                    for g in &mut grad {
                        *g = (*g as f64 * scale) as f32;
                        sum_sq += (*g as f64) * (*g as f64);
                    }
                    shard.grad = Some(grad);
                }
                let _ = reply.send(sum_sq);
            }
            ServerMsg::Apply {
                clip,
                version,
                reply,
            } => {
                let _ = reply.send(apply(state, clip, version));
            }
            ServerMsg::Discard { next_epoch, reply } => {
                for shard in &mut state.shards {
                    shard.accumulator.take(next_epoch);
                    shard.grad = None;
                }
                let _ = reply.send(());
            }
            ServerMsg::Parameters(reply) => {
                let params = state
                    .shards
                    .iter()
                    .map(|s| (s.unit, s.range.clone(), s.master.clone()))
                    .collect();
                let _ = reply.send(params);
            }
        }
        Ok(())
    }
}

/// Optimizer step on every shard with the gradient kept by `Reduce`, then publish `version`.
fn apply(state: &mut ServerState, clip: f64, version: u64) -> Result<()> {
    for shard in &mut state.shards {
        let mut grad = shard
            .grad
            .take()
            .unwrap_or_else(|| vec![0.0; shard.master.len()]);
        if clip != 1.0 {
            for g in &mut grad {
                *g = (*g as f64 * clip) as f32;
            }
        }
        shard
            .optimizer
            .step(&state.optimizer, &mut shard.master, &grad)?;
        shard
            .published
            .publish(version, codec::encode(state.pull_dtype, &shard.master))
            .map_err(Error::Transport)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use odc_transport::local::LocalTransport;
    use odc_transport::{TransportError, WriteTag};

    use super::*;
    use crate::layout::UnitSpec;

    async fn server(servers: usize, endpoint: u32) -> (ActorRef<ServerMsg>, Arc<dyn Transport>) {
        let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
        let layout = ModelLayout::new(vec![UnitSpec::with_values(
            "u",
            (0..10).map(|i| i as f32).collect(),
        )])
        .unwrap();
        let args = ServerArgs {
            endpoint,
            servers,
            layout: Arc::new(layout),
            transport: transport.clone(),
            optimizer: OptimizerConfig::Sgd {
                lr: 1.0,
                momentum: 0.0,
                weight_decay: 0.0,
            },
            pull_dtype: Dtype::F32,
            epoch: 0,
        };
        let (actor, _) = Actor::spawn(None, ShardServer, args).await.unwrap();
        (actor, transport)
    }

    async fn ask<T: Send + 'static>(
        actor: &ActorRef<ServerMsg>,
        msg: impl FnOnce(RpcReplyPort<T>) -> ServerMsg,
    ) -> T {
        actor
            .call(msg, Some(Duration::from_secs(5)))
            .await
            .unwrap()
            .success_or(())
            .map_err(|_| "no reply")
            .unwrap()
    }

    async fn reduce(actor: &ActorRef<ServerMsg>, scale: f64, next_epoch: u64) -> f64 {
        ask(actor, |reply| ServerMsg::Reduce {
            scale,
            next_epoch,
            reply,
        })
        .await
    }

    async fn apply_step(actor: &ActorRef<ServerMsg>, version: u64) {
        ask(actor, |reply| ServerMsg::Apply {
            clip: 1.0,
            version,
            reply,
        })
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn i2_discard_drops_landed_writes_and_refuses_late_ones() {
        let (actor, transport) = server(3, 2).await;
        let route = ask(&actor, ServerMsg::Routes).await[0].clone().unwrap();
        assert_eq!(route.range, 6..10, "uneven shard of the last server");
        let grad = codec::encode(Dtype::F32, &[1.0; 4]);
        let tag = |write_id| WriteTag { epoch: 0, write_id };
        // A failed attempt's write lands, then the attempt is discarded.
        transport
            .accumulate(&route.accumulator, 0, grad.clone(), tag(1))
            .await
            .unwrap();
        ask(&actor, |reply| ServerMsg::Discard {
            next_epoch: 1,
            reply,
        })
        .await;
        // The failed trainer's late write is refused...
        let late = transport
            .accumulate(&route.accumulator, 0, grad.clone(), tag(2))
            .await;
        assert!(matches!(
            late,
            Err(TransportError::StaleEpoch {
                got: 0,
                current: 1,
                ..
            })
        ));
        // ...the replay's write counts once, its duplicate is refused...
        let replay = WriteTag {
            epoch: 1,
            write_id: 1,
        };
        transport
            .accumulate(&route.accumulator, 0, grad.clone(), replay)
            .await
            .unwrap();
        let dup = transport
            .accumulate(&route.accumulator, 0, grad, replay)
            .await;
        assert!(matches!(dup, Err(TransportError::DuplicateWrite { .. })));
        // ...so the step sees exactly one gradient of ones.
        let sum_sq = reduce(&actor, 1.0, 2).await;
        assert_eq!(sum_sq, 4.0);
        apply_step(&actor, 1).await;
        let read = transport.read(&route.published, 0..4).await.unwrap();
        assert_eq!(read.version, 1, "I1: the step published version 1");
        assert_eq!(
            codec::decode(Dtype::F32, &read.bytes).unwrap(),
            vec![5.0, 6.0, 7.0, 8.0]
        );
        actor.stop(None);
    }

    #[tokio::test]
    async fn i1_published_copy_changes_only_at_apply() {
        let (actor, transport) = server(1, 0).await;
        let route = ask(&actor, ServerMsg::Routes).await[0].clone().unwrap();
        let before = transport.read(&route.published, 0..10).await.unwrap();
        transport
            .accumulate(
                &route.accumulator,
                0,
                codec::encode(Dtype::F32, &[1.0; 10]),
                WriteTag {
                    epoch: 0,
                    write_id: 0,
                },
            )
            .await
            .unwrap();
        reduce(&actor, 0.5, 1).await;
        // Gradients reduced, step not applied: readers still see version 0.
        assert_eq!(
            transport.read(&route.published, 0..10).await.unwrap(),
            before
        );
        apply_step(&actor, 1).await;
        let after = transport.read(&route.published, 0..10).await.unwrap();
        assert_eq!(after.version, 1);
        assert_eq!(codec::decode(Dtype::F32, &after.bytes).unwrap()[3], 2.5);
        let params = ask(&actor, ServerMsg::Parameters).await;
        assert_eq!(params[0].2[0], -0.5);
        actor.stop(None);
    }
}
