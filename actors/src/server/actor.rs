//! The shard server actor (see the [module docs](super)).

use std::ops::Range;
use std::sync::Arc;

use odc_transport::{codec, AccumulatorRegion, Dtype, PublishedRegion};
use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::optimizer::{OptimizerConfig, OptimizerState};
use super::{ApplyCmd, DiscardCmd, ReduceAck, ReduceCmd, ServerMsg, ServerSpec, ShardSnapshot};
use crate::directory::ShardRoute;
use crate::error::{Error, Result};
use crate::layout::{shard_range, UnitId};
use crate::node::Node;

/// How to start a shard server: its serializable spec and its process's resources.
pub struct ServerArgs {
    pub spec: ServerSpec,
    pub node: Arc<Node>,
}

struct Shard {
    unit: UnitId,
    range: Range<usize>,
    master: Vec<f32>,
    optimizer: OptimizerState,
    published: Box<dyn PublishedRegion>,
    accumulator: Box<dyn AccumulatorRegion>,
    /// fp32 copy for read-outs, registered on first use (bf16 pulls only; fp32 pulls read the
    /// published copy, which is the same bytes).
    snapshot: Option<Box<dyn PublishedRegion>>,
    /// The scaled gradient `Reduce` kept for `Apply`.
    grad: Option<Vec<f32>>,
}

/// State of a shard server: its non-empty shards.
pub struct ServerState {
    spec: ServerSpec,
    node: Arc<Node>,
    shards: Vec<Shard>,
    version: u64,
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
        let ServerArgs { spec, node } = args;
        spec.optimizer.validate().map_err(Error::from)?;
        let mut shards = Vec::new();
        for (unit, unit_spec) in node.layout.units().iter().enumerate() {
            let range = shard_range(unit_spec.len, spec.servers as usize, spec.endpoint as usize);
            if range.is_empty() {
                continue;
            }
            let master = unit_spec.init.slice(range.clone());
            let published = node.transport.register_published(
                spec.endpoint,
                spec.pull_dtype,
                codec::encode(spec.pull_dtype, &master),
                0,
            )?;
            let accumulator =
                node.transport
                    .register_accumulator(spec.endpoint, range.len(), spec.epoch)?;
            shards.push(Shard {
                unit: unit as UnitId,
                optimizer: OptimizerState::new(&spec.optimizer, range.len()),
                range,
                master,
                published,
                accumulator,
                snapshot: None,
                grad: None,
            });
        }
        Ok(ServerState {
            spec,
            node,
            shards,
            version: 0,
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
                let routes = state
                    .shards
                    .iter()
                    .map(|shard| ShardRoute {
                        unit: shard.unit,
                        owner: state.spec.endpoint,
                        start: shard.range.start as u64,
                        end: shard.range.end as u64,
                        published: shard.published.handle(),
                        accumulator: shard.accumulator.handle(),
                    })
                    .collect();
                let _ = reply.send(routes);
            }
            ServerMsg::Reduce(cmd, reply) => {
                let result = off_runtime(state, move |shards, _| reduce(shards, cmd)).await?;
                let _ = reply.send(result);
            }
            ServerMsg::Apply(cmd, reply) => {
                let spec = state.spec;
                let result = off_runtime(state, move |shards, _| apply(shards, &spec, cmd)).await?;
                if result.is_ok() {
                    state.version = cmd.version;
                }
                let _ = reply.send(result);
            }
            ServerMsg::Discard(cmd, reply) => {
                let result = off_runtime(state, move |shards, _| discard(shards, cmd)).await?;
                let _ = reply.send(result);
            }
            ServerMsg::Snapshot(reply) => {
                let result = off_runtime(state, snapshot).await?;
                let _ = reply.send(result);
            }
        }
        Ok(())
    }
}

/// Run `work` on the shards on a blocking thread (never on a tokio worker: I6), then put them back.
/// A panic in `work` loses the shards: the server fails (its supervisor reports it).
async fn off_runtime<T: Send + 'static>(
    state: &mut ServerState,
    work: impl FnOnce(&mut [Shard], &Context) -> Result<T> + Send + 'static,
) -> std::result::Result<Result<T>, ActorProcessingErr> {
    let mut shards = std::mem::take(&mut state.shards);
    let context = Context {
        node: state.node.clone(),
        spec: state.spec,
        version: state.version,
    };
    let (shards, result) = tokio::task::spawn_blocking(move || {
        let result = work(&mut shards, &context);
        (shards, result)
    })
    .await
    .map_err(|e| format!("shard server {}: {e}", state.spec.endpoint))?;
    state.shards = shards;
    Ok(result)
}

/// What blocking work may read of the server besides its shards.
struct Context {
    node: Arc<Node>,
    spec: ServerSpec,
    version: u64,
}

fn reduce(shards: &mut [Shard], cmd: ReduceCmd) -> Result<ReduceAck> {
    let mut sum_sq = 0f64;
    for shard in shards {
        let mut grad = shard.accumulator.take(cmd.next_epoch);
        for g in &mut grad {
            *g = (*g as f64 * cmd.scale) as f32;
            sum_sq += (*g as f64) * (*g as f64);
        }
        shard.grad = Some(grad);
    }
    Ok(ReduceAck { sum_sq })
}

/// Optimizer step on every shard with the gradient kept by `Reduce`, then publish `version`.
fn apply(shards: &mut [Shard], spec: &ServerSpec, cmd: ApplyCmd) -> Result<()> {
    let optimizer: &OptimizerConfig = &spec.optimizer;
    for shard in shards {
        let mut grad = shard
            .grad
            .take()
            .unwrap_or_else(|| vec![0.0; shard.master.len()]);
        if cmd.clip != 1.0 {
            for g in &mut grad {
                *g = (*g as f64 * cmd.clip) as f32;
            }
        }
        shard.optimizer.step(optimizer, &mut shard.master, &grad)?;
        shard
            .published
            .publish(cmd.version, codec::encode(spec.pull_dtype, &shard.master))?;
    }
    Ok(())
}

fn discard(shards: &mut [Shard], cmd: DiscardCmd) -> Result<()> {
    for shard in shards {
        shard.accumulator.take(cmd.next_epoch);
        shard.grad = None;
    }
    Ok(())
}

fn snapshot(shards: &mut [Shard], context: &Context) -> Result<Vec<ShardSnapshot>> {
    let mut out = Vec::with_capacity(shards.len());
    for shard in shards {
        let region = if context.spec.pull_dtype == Dtype::F32 {
            shard.published.handle()
        } else {
            let bytes = codec::encode(Dtype::F32, &shard.master);
            match &shard.snapshot {
                Some(region) => {
                    region.publish(context.version, bytes)?;
                    region.handle()
                }
                None => {
                    let region = context.node.transport.register_published(
                        context.spec.endpoint,
                        Dtype::F32,
                        bytes,
                        context.version,
                    )?;
                    let handle = region.handle();
                    shard.snapshot = Some(region);
                    handle
                }
            }
        };
        out.push(ShardSnapshot {
            unit: shard.unit,
            start: shard.range.start as u64,
            end: shard.range.end as u64,
            version: context.version,
            region,
        });
    }
    Ok(out)
}
