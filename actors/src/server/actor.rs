//! The shard server actor (see the [module docs](super)).

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use odc_transport::{WriteGuard, WriteTag};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::optimizer::{OptimizerConfig, OptimizerState};
use super::relay::{self, Relays, Taken};
use super::shard::{Captured, Context, HostShard, ShardStore};
use super::{
    shard_file, step_dir, ApplyCmd, DiscardCmd, ReduceAck, ReduceCmd, ServerMsg, ServerSpec,
    ShardSnapshot, SnapshotCmd,
};
use crate::datapath::micro_batch_of;
use crate::directory::ShardRoute;
use crate::error::{Error, Result};
use crate::layout::{shard_range, UnitId};
use crate::node::Node;
use crate::policy::token::JobKey;
use crate::server::messages::{
    FlushAck, FlushCmd, OpenRelaysCmd, PublishShardsCmd, RelayRoute, WriteShardsCmd, WrittenShards,
};

/// How to start a shard server: its serializable spec and its process's resources.
pub struct ServerArgs {
    pub spec: ServerSpec,
    pub node: Arc<Node>,
}

struct Shard {
    unit: UnitId,
    range: Range<usize>,
    store: Box<dyn ShardStore>,
}

/// State of a shard server: its non-empty shards.
pub struct ServerState {
    spec: ServerSpec,
    node: Arc<Node>,
    shards: Vec<Shard>,
    version: u64,
    /// Node-local accumulators for owners on other nodes (relayed pushes only).
    relays: Relays,
    /// The checkpoint write started by the last [`ServerMsg::WriteShards`]: its file once done.
    writing: Option<tokio::sync::watch::Receiver<Option<Result<WrittenShards>>>>,
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
            let in_unit =
                |e: Error| Error::Layout(format!("unit {unit} ({}): {e}", unit_spec.name));
            let master = unit_spec
                .init
                .slice(range.clone())
                .map_err(|e| in_unit(e.into()))?;
            let optimizer = match node.layout.optimizer_init(unit as UnitId) {
                // A frozen unit has no optimizer state (nor accumulator).
                _ if !unit_spec.trainable => None,
                None => Some(OptimizerState::new(&spec.optimizer, range.len())),
                Some(init) => Some({
                    let buffers = init
                        .buffers
                        .iter()
                        .map(|(name, values)| Ok((name.clone(), values.slice(range.clone())?)))
                        .collect::<Result<Vec<_>>>()
                        .map_err(in_unit)?;
                    OptimizerState::restore(&spec.optimizer, range.len(), init.steps, buffers)
                        .map_err(|e| in_unit(e.into()))?
                }),
            };
            let served = unit_spec.served;
            let store = new_store(&node, &spec, master, optimizer, admission(spec.key), served)?;
            shards.push(Shard {
                unit: unit as UnitId,
                range,
                store,
            });
        }
        Ok(ServerState {
            spec,
            node,
            shards,
            version: 0,
            relays: Relays::default(),
            writing: None,
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
                let _ = reply.send(routes(state));
            }
            ServerMsg::OpenRelays(cmd, reply) => {
                let _ = reply.send(open_relays(state, cmd));
            }
            ServerMsg::Flush(cmd, reply) => flush_relays(state, cmd, reply).await?,
            ServerMsg::ExpectRelays(cmd, reply) => {
                state.relays.expect(&flusher(state), cmd);
                let _ = reply.send(Ok(()));
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
                let relays = state.relays.clone();
                let result = off_runtime(state, move |shards, _| {
                    relays.discard(cmd.next_epoch);
                    discard(shards, cmd)
                })
                .await?;
                let _ = reply.send(result);
            }
            ServerMsg::Snapshot(cmd, reply) => {
                let result =
                    off_runtime(state, move |shards, context| snapshot(shards, context, cmd))
                        .await?;
                let _ = reply.send(result);
            }
            ServerMsg::WriteShards(cmd, reply) => write_shards(state, cmd, reply).await?,
            ServerMsg::ShardsWritten(reply) => shards_written(state, reply),
            ServerMsg::PublishShards(cmd, reply) => publish_shards(cmd, reply),
        }
        Ok(())
    }
}

/// A shard's store: in the memory of the `cuda` transport's device when the node's transport is
/// one (and this crate has its `cuda` feature), else in host memory. `optimizer` is `None` for a
/// frozen unit's shard.
fn new_store(
    node: &Node,
    spec: &ServerSpec,
    master: Vec<f32>,
    optimizer: Option<OptimizerState>,
    admission: WriteGuard,
    served: bool,
) -> Result<Box<dyn ShardStore>> {
    #[cfg(all(feature = "cuda-code", target_os = "linux"))]
    if let Some(cuda) = super::device::cuda_transport(node) {
        let shard = super::device::DeviceShard::new(
            cuda,
            spec,
            &master,
            optimizer.as_ref(),
            admission,
            served,
        )?;
        return Ok(Box::new(shard));
    }
    #[cfg(not(all(feature = "cuda-code", target_os = "linux")))]
    if node.transport.backend() == "cuda" {
        tracing::info!(
            server = spec.endpoint,
            "shard server on a cuda transport keeps its shards in host memory: odc-actors was \
             built without its `cuda` feature"
        );
    }
    Ok(Box::new(HostShard::new(
        node, spec, master, optimizer, admission, served,
    )?))
}

/// Take every relay on a blocking thread (I6), then, off the mailbox, flush the sums to their
/// owners, collect the early flushes' outcomes and reply with the bytes sent and what each relay
/// combined (see [`relay`]).
async fn flush_relays(
    state: &mut ServerState,
    cmd: FlushCmd,
    reply: ractor::RpcReplyPort<Result<FlushAck>>,
) -> std::result::Result<(), ActorProcessingErr> {
    let endpoint = state.spec.endpoint;
    if state.relays.is_empty() {
        let _ = reply.send(Ok(FlushAck {
            combined: Vec::new(),
        }));
        return Ok(());
    }
    let relays = state.relays.clone();
    let taken =
        tokio::task::spawn_blocking(move || relays.take(endpoint, cmd.epoch, cmd.next_epoch))
            .await
            .map_err(|e| format!("shard server {endpoint}: {e}"))?;
    let Taken {
        sums,
        mut combined,
        early,
    } = match taken {
        Ok(taken) => taken,
        Err(e) => {
            let _ = reply.send(Err(e));
            return Ok(());
        }
    };
    let flusher = flusher(state);
    let chunk = state.relays.chunk_elems();
    tokio::spawn(async move {
        let timeout = std::time::Duration::from_millis(cmd.timeout_ms);
        let mut sent = relay::flush(&flusher, sums, chunk, cmd.epoch, timeout).await;
        // The early flushes: each already sent (or failing) on its own.
        for outcome in early {
            let outcome = outcome.await.unwrap_or_else(|_| {
                Err(Error::Internal(format!(
                    "shard server {endpoint}: an early relay flush ended without an outcome"
                )))
            });
            match outcome {
                Ok(relay) => combined.push(relay),
                // The first failure is the flush's.
                Err(e) => sent = sent.and(Err(e)),
            }
        }
        let _ = reply.send(sent.map(|()| FlushAck { combined }));
    });
    Ok(())
}

/// What this server's relays flush with.
fn flusher(state: &ServerState) -> relay::Flusher {
    relay::Flusher {
        transport: state.node.transport_of_server(state.spec.endpoint),
        endpoint: state.spec.endpoint,
        key: state.spec.key,
    }
}

/// The accumulators' admission guard (transport C8): a write must carry the token of the
/// (epoch, micro-batch) its write id names.
fn admission(key: JobKey) -> WriteGuard {
    Arc::new(move |tag: &WriteTag| key.admits(tag.epoch, micro_batch_of(tag.write_id), tag.token))
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

fn reduce(shards: &mut [Shard], cmd: ReduceCmd) -> Result<ReduceAck> {
    let mut sum_sq = 0f64;
    for shard in shards {
        shard.store.reduce(cmd.scale, cmd.next_epoch, &mut sum_sq)?;
    }
    Ok(ReduceAck { sum_sq })
}

/// Optimizer step on every shard with the gradient kept by `Reduce`, then publish `version`.
fn apply(shards: &mut [Shard], spec: &ServerSpec, cmd: ApplyCmd) -> Result<()> {
    // Scaled in f64 and rounded once, so every server applies bitwise the same rate (I3).
    let lr = (f64::from(spec.optimizer.lr()) * cmd.lr_scale) as f32;
    let optimizer: &OptimizerConfig = &spec.optimizer.with_lr(lr);
    for shard in shards {
        shard.store.apply(optimizer, cmd.clip, cmd.version)?;
    }
    Ok(())
}

fn discard(shards: &mut [Shard], cmd: DiscardCmd) -> Result<()> {
    for shard in shards {
        shard.store.discard(cmd.next_epoch)?;
    }
    Ok(())
}

fn snapshot(
    shards: &mut [Shard],
    context: &Context,
    cmd: SnapshotCmd,
) -> Result<Vec<ShardSnapshot>> {
    let mut out = Vec::with_capacity(shards.len());
    for shard in model_shards(shards, context) {
        let (region, optimizer) = shard.store.snapshot(context, cmd.optimizer)?;
        out.push(ShardSnapshot {
            unit: shard.unit,
            start: shard.range.start as u64,
            end: shard.range.end as u64,
            version: context.version,
            region,
            optimizer,
        });
    }
    Ok(out)
}

/// Lowers the calling thread's CPU priority to the lowest (nice 19; Linux applies it to this
/// thread alone). Best effort: where it cannot, the thread keeps its priority.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: plain FFI call on the calling thread (who = 0), no pointers.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, 0, 19);
    }
}

/// Every shard's route: where trainers read its published copy and push into its accumulator.
fn routes(state: &ServerState) -> Vec<ShardRoute> {
    state
        .shards
        .iter()
        .map(|shard| ShardRoute {
            unit: shard.unit,
            owner: state.spec.endpoint,
            start: shard.range.start as u64,
            end: shard.range.end as u64,
            published: shard.store.published(),
            accumulator: shard.store.accumulator(),
        })
        .collect()
}

/// Opens this server's relays (once, at the job's start) and returns their routes.
fn open_relays(state: &mut ServerState, cmd: OpenRelaysCmd) -> Result<Vec<RelayRoute>> {
    if !state.relays.is_empty() {
        return Err(Error::Config(format!(
            "shard server {}: its relays are already open",
            state.spec.endpoint
        )));
    }
    let (relays, routes) = Relays::open(
        state.node.transport.as_ref(),
        state.spec.endpoint,
        state.spec.epoch,
        admission(state.spec.key),
        cmd,
    )?;
    state.relays = relays;
    Ok(routes)
}

/// Copies every shard at this version, replies, then writes the copy to one file on a thread of
/// its own at the lowest CPU priority while the job goes on (refused while a write runs).
async fn write_shards(
    state: &mut ServerState,
    cmd: WriteShardsCmd,
    reply: RpcReplyPort<Result<()>>,
) -> std::result::Result<(), ActorProcessingErr> {
    let busy = state.writing.as_ref().is_some_and(|w| w.borrow().is_none());
    if busy {
        let _ = reply.send(Err(Error::Config(format!(
            "shard server {}: a checkpoint write is still running",
            state.spec.endpoint
        ))));
        return Ok(());
    }
    // The copy, at this version, before the reply: the next step cannot change it.
    let copied = off_runtime(state, copy_shards).await?;
    let values = match copied {
        Ok(values) => values,
        Err(e) => {
            let _ = reply.send(Err(e));
            return Ok(());
        }
    };
    let (done, writing) = tokio::sync::watch::channel(None);
    state.writing = Some(writing);
    let file = format!("shard-{:05}.safetensors", state.spec.endpoint);
    let token = format!("server-{}", state.spec.endpoint);
    // A thread of its own at the lowest CPU priority: the write takes the cores only
    // when the step leaves them idle.
    let writer = std::thread::Builder::new()
        .name(format!("odc-ckpt-{}", state.spec.endpoint))
        .spawn(move || {
            lower_priority();
            if let Some(delay) = crate::faults::installed().checkpoint_write_delay {
                std::thread::sleep(delay);
            }
            let dir = std::path::Path::new(&cmd.dir);
            // The lead's staging directory where this host shares it, else this
            // host's own (per-host checkpoint directories).
            let written = (|| -> Result<WrittenShards> {
                let dir_id = step_dir::claim(dir, &token)?;
                let values = values
                    .into_iter()
                    .map(CapturedShard::into_values)
                    .collect::<Result<Vec<_>>>()?;
                let file = shard_file::write(dir, &file, &values)?;
                Ok(WrittenShards { file, dir_id })
            })();
            let _ = done.send(Some(written));
        });
    if let Err(e) = writer {
        state.writing = None;
        let _ = reply.send(Err(Error::Internal(format!(
            "shard server {}: cannot start the checkpoint writer: {e}",
            state.spec.endpoint
        ))));
        return Ok(());
    }
    let _ = reply.send(Ok(()));
    Ok(())
}

/// The file of the last write, once it is on disk; waited for off the mailbox, so the server
/// keeps serving the step meanwhile.
fn shards_written(state: &ServerState, reply: RpcReplyPort<Result<WrittenShards>>) {
    let Some(mut writing) = state.writing.clone() else {
        let _ = reply.send(Err(Error::Config(format!(
            "shard server {}: no checkpoint write was started",
            state.spec.endpoint
        ))));
        return;
    };
    tokio::spawn(async move {
        let file = match writing.wait_for(Option::is_some).await {
            Ok(done) => done
                .clone()
                .unwrap_or_else(|| Err(Error::Internal("an empty checkpoint write".into()))),
            Err(_) => Err(Error::Internal("the checkpoint writer vanished".into())),
        };
        let _ = reply.send(file);
    });
}

/// Publishes this host's part of a checkpoint: small synced files and a rename, off the mailbox.
fn publish_shards(cmd: PublishShardsCmd, reply: RpcReplyPort<Result<()>>) {
    tokio::task::spawn_blocking(move || {
        let (staging, target) = (Path::new(&cmd.staging), Path::new(&cmd.target));
        let _ = reply.send(
            step_dir::publish_with(staging, target, &cmd.files, cmd.keep_last).map_err(Error::from),
        );
    });
}

/// The shards of the model's units: what the job's parameters and checkpoints hold (a served
/// unit's, [`crate::layout::UnitSpec::served`], are left out).
fn model_shards<'a>(
    shards: &'a mut [Shard],
    context: &Context,
) -> impl Iterator<Item = &'a mut Shard> {
    let model_units = context.node.layout.model_units();
    shards
        .iter_mut()
        .filter(move |shard| (shard.unit as usize) < model_units)
}

/// Every shard's values, copied to host memory (what a checkpoint writes).
fn copy_shards(shards: &mut [Shard], context: &Context) -> Result<Vec<CapturedShard>> {
    model_shards(shards, context)
        .map(|shard| {
            Ok(CapturedShard {
                unit: shard.unit,
                range: shard.range.clone(),
                values: shard.store.capture(context)?,
            })
        })
        .collect()
}

/// A shard's values taken for a checkpoint ([`copy_shards`]), brought to host memory by the
/// writer.
struct CapturedShard {
    unit: UnitId,
    range: Range<usize>,
    values: Captured,
}

impl CapturedShard {
    fn into_values(self) -> Result<shard_file::ShardValues> {
        let v = self.values.into_values()?;
        Ok(shard_file::ShardValues {
            unit: self.unit,
            start: self.range.start as u64,
            end: self.range.end as u64,
            params: v.params,
            steps: v.steps,
            buffers: v.buffers,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Condvar, Mutex};
    use std::time::Duration;

    use bytes::Bytes;
    use odc_transport::local::LocalTransport;
    use odc_transport::wrap::{Wrap, Wrapped};
    use odc_transport::{
        codec, deadline_in, Dest, Dtype, EndpointId, PublishedRegion, RegionHandle, Transport,
        TransportError, WriteTag,
    };
    use ractor::RpcReplyPort;

    use super::*;
    use crate::layout::{ModelLayout, UnitSpec};
    use crate::server::OptimizerSnapshot;
    use crate::trainer::{Compute, SharedComputeFactory};

    fn node(transport: Arc<dyn Transport>, values: Vec<f32>) -> Arc<Node> {
        node_of(transport, vec![UnitSpec::with_values("u", values)])
    }

    fn node_of(transport: Arc<dyn Transport>, units: Vec<UnitSpec>) -> Arc<Node> {
        let layout = ModelLayout::new(units).unwrap();
        let compute: SharedComputeFactory =
            Arc::new(|_: u32| -> Box<dyn Compute> { unreachable!("no trainer here") });
        Arc::new(Node {
            transport,
            layout: Arc::new(layout),
            compute,
            collective: None,
            clock: Arc::new(crate::policy::clock::SystemClock),
            trainer_transport: None,
            server_transport: None,
        })
    }

    fn spec(servers: u32, endpoint: u32) -> ServerSpec {
        ServerSpec {
            endpoint,
            servers,
            optimizer: OptimizerConfig::Sgd {
                lr: 1.0,
                momentum: 0.0,
                weight_decay: 0.0,
            },
            pull_dtype: Dtype::F32,
            epoch: 0,
            key: KEY,
        }
    }

    const KEY: JobKey = JobKey::from_bytes([0x17; JobKey::LEN]);

    /// A genuine write's tag: the token of the micro-batch its write id names.
    fn tag(epoch: u64, write_id: u128) -> WriteTag {
        WriteTag {
            epoch,
            write_id,
            token: KEY.token(epoch, micro_batch_of(write_id)),
        }
    }

    async fn server(
        transport: Arc<dyn Transport>,
        servers: u32,
        endpoint: u32,
    ) -> ActorRef<ServerMsg> {
        let args = ServerArgs {
            spec: spec(servers, endpoint),
            node: node(transport, (0..10).map(|i| i as f32).collect()),
        };
        Actor::spawn(None, ShardServer, args).await.unwrap().0
    }

    async fn ask<T: Send + 'static>(
        actor: &ActorRef<ServerMsg>,
        msg: impl FnOnce(RpcReplyPort<T>) -> ServerMsg,
    ) -> T {
        match actor.call(msg, Some(Duration::from_secs(10))).await {
            Ok(ractor::rpc::CallResult::Success(v)) => v,
            _ => panic!("the server did not answer"),
        }
    }

    async fn read(t: &dyn Transport, handle: &RegionHandle, len: usize) -> (u64, Vec<f32>) {
        let mut out = vec![f32::NAN; len];
        let version = t
            .read(
                handle,
                0..len,
                Dest::F32(&mut out),
                deadline_in(Duration::from_secs(5)),
            )
            .await
            .unwrap();
        (version, out)
    }

    async fn add(
        t: &dyn Transport,
        route: &ShardRoute,
        values: &[f32],
        tag: WriteTag,
    ) -> Result<()> {
        let accumulator = route
            .accumulator
            .as_ref()
            .expect("a trainable unit's shard");
        t.accumulate(
            accumulator,
            0,
            codec::encode_f32(values),
            tag,
            deadline_in(Duration::from_secs(5)),
        )
        .await
        .map_err(Error::from)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn i2_discard_drops_landed_writes_and_refuses_late_ones() {
        tokio::time::timeout(Duration::from_secs(30), async {
            let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
            let actor = server(transport.clone(), 3, 2).await;
            let route = ask(&actor, ServerMsg::Routes).await.remove(0);
            assert_eq!(route.range(), 6..10, "uneven shard of the last server");
            // A failed attempt's write lands, then the attempt is discarded.
            add(transport.as_ref(), &route, &[1.0; 4], tag(0, 1))
                .await
                .unwrap();
            let discard = DiscardCmd { next_epoch: 1 };
            ask(&actor, |r| ServerMsg::Discard(discard, r))
                .await
                .unwrap();
            // The failed trainer's late write is refused...
            let late = add(transport.as_ref(), &route, &[1.0; 4], tag(0, 2)).await;
            assert!(matches!(
                late,
                Err(Error::Transport(TransportError::StaleEpoch {
                    got: 0,
                    current: 1,
                    ..
                }))
            ));
            // ...the replay's write counts once, its duplicate is refused...
            add(transport.as_ref(), &route, &[1.0; 4], tag(1, 1))
                .await
                .unwrap();
            let dup = add(transport.as_ref(), &route, &[1.0; 4], tag(1, 1)).await;
            assert!(matches!(
                dup,
                Err(Error::Transport(TransportError::DuplicateWrite { .. }))
            ));
            // ...so the step sees exactly one gradient of ones.
            let reduce = ReduceCmd {
                scale: 1.0,
                next_epoch: 2,
            };
            let ack = ask(&actor, |r| ServerMsg::Reduce(reduce, r)).await.unwrap();
            assert_eq!(ack.sum_sq, 4.0);
            let apply = ApplyCmd {
                lr_scale: 1.0,
                clip: 1.0,
                version: 1,
            };
            ask(&actor, |r| ServerMsg::Apply(apply, r)).await.unwrap();
            let (version, values) = read(transport.as_ref(), &route.published, 4).await;
            assert_eq!(version, 1, "I1: the step published version 1");
            assert_eq!(values, vec![5.0, 6.0, 7.0, 8.0]);
            actor.stop(None);
        })
        .await
        .expect("test timed out");
    }

    /// Transport C8 at the server: a write without the token of the micro-batch its write id
    /// names (a forgery, a token of another micro-batch or epoch) is refused and changes nothing,
    /// so the genuine write with the same id still lands and the step sees exactly it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn forged_writes_are_refused_and_the_genuine_one_still_lands() {
        tokio::time::timeout(Duration::from_secs(30), async {
            let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
            let actor = server(transport.clone(), 1, 0).await;
            let route = ask(&actor, ServerMsg::Routes).await.remove(0);
            let id = crate::datapath::write_id(3, 0, 0, 0);
            let genuine = tag(0, id);
            let forgeries = [
                WriteTag {
                    token: genuine.token ^ 1,
                    ..genuine
                },
                WriteTag {
                    token: KEY.token(0, 4),
                    ..genuine
                },
                WriteTag {
                    token: KEY.token(1, 3),
                    ..genuine
                },
                WriteTag {
                    token: tag(0, id).token,
                    write_id: crate::datapath::write_id(4, 0, 0, 0),
                    ..genuine
                },
            ];
            for forged in forgeries {
                let refused = add(transport.as_ref(), &route, &[100.0; 10], forged).await;
                assert!(
                    matches!(
                        refused,
                        Err(Error::Transport(TransportError::RefusedWrite {
                            owner: 0,
                            ..
                        }))
                    ),
                    "{forged:?}: {refused:?}"
                );
            }
            add(transport.as_ref(), &route, &[1.0; 10], genuine)
                .await
                .unwrap();
            let reduce = ReduceCmd {
                scale: 1.0,
                next_epoch: 1,
            };
            let ack = ask(&actor, |r| ServerMsg::Reduce(reduce, r)).await.unwrap();
            assert_eq!(ack.sum_sq, 10.0, "exactly the genuine gradient of ones");
            actor.stop(None);
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn i1_published_copy_changes_only_at_apply_and_snapshots_read_over_the_data_plane() {
        tokio::time::timeout(Duration::from_secs(30), async {
            let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
            let actor = server(transport.clone(), 1, 0).await;
            let route = ask(&actor, ServerMsg::Routes).await.remove(0);
            let before = read(transport.as_ref(), &route.published, 10).await;
            add(transport.as_ref(), &route, &[1.0; 10], tag(0, 0))
                .await
                .unwrap();
            let reduce = ReduceCmd {
                scale: 0.5,
                next_epoch: 1,
            };
            ask(&actor, |r| ServerMsg::Reduce(reduce, r)).await.unwrap();
            // Gradients reduced, step not applied: readers still see version 0.
            assert_eq!(read(transport.as_ref(), &route.published, 10).await, before);
            let apply = ApplyCmd {
                lr_scale: 1.0,
                clip: 1.0,
                version: 1,
            };
            ask(&actor, |r| ServerMsg::Apply(apply, r)).await.unwrap();
            let (version, values) = read(transport.as_ref(), &route.published, 10).await;
            assert_eq!((version, values[3]), (1, 2.5));
            // The read-out goes over the data plane: a snapshot handle, read by another
            // transport instance of the process.
            let snapshots = ask(&actor, |r| ServerMsg::Snapshot(SnapshotCmd::default(), r))
                .await
                .unwrap();
            assert_eq!(snapshots.len(), 1);
            assert_eq!((snapshots[0].range(), snapshots[0].version), (0..10, 1));
            let reader = LocalTransport::new();
            let (_, master) = read(&reader, &snapshots[0].region, 10).await;
            assert_eq!(master[0], -0.5);
            assert_eq!(master[9], 8.5);
            actor.stop(None);
        })
        .await
        .expect("test timed out");
    }

    /// A frozen unit's shard: no accumulator (its route has none), no optimizer state (its
    /// snapshot: 0 steps, no buffers), nothing added to the sum of squares, and after steps of
    /// AdamW with weight decay its values are bit-identical to the initial ones, published at
    /// every step's version (I1) with the same bytes — while the trainable unit beside it moves.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frozen_and_served_units_keep_no_training_state_and_never_change() {
        tokio::time::timeout(Duration::from_secs(30), async {
            for pull_dtype in [Dtype::F32, Dtype::Bf16] {
                let initial: Vec<f32> = (0..10).map(|i| i as f32 * 0.37 - 1.1).collect();
                let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
                let units = vec![
                    UnitSpec::with_values("base", initial.clone()).frozen(),
                    UnitSpec::constant("adapter", 4, 1.0),
                    UnitSpec::with_values("reference.base", initial.clone()).served(),
                ];
                let args = ServerArgs {
                    spec: ServerSpec {
                        optimizer: OptimizerConfig::AdamW {
                            lr: 0.1,
                            beta1: 0.9,
                            beta2: 0.999,
                            eps: 1e-8,
                            weight_decay: 0.5,
                        },
                        pull_dtype,
                        ..spec(1, 0)
                    },
                    node: node_of(transport.clone(), units),
                };
                let actor = Actor::spawn(None, ShardServer, args).await.unwrap().0;
                let routes = ask(&actor, ServerMsg::Routes).await;
                assert_eq!(routes.len(), 3);
                assert_eq!(routes[0].accumulator, None, "no accumulator region");
                assert!(routes[1].accumulator.is_some());
                assert_eq!(routes[2].accumulator, None, "a served unit is frozen");
                let bytes = codec::encode(pull_dtype, &initial);
                for version in 1..=3u64 {
                    let epoch = version - 1;
                    add(transport.as_ref(), &routes[1], &[2.0; 4], tag(epoch, 0))
                        .await
                        .unwrap();
                    let reduce = ReduceCmd {
                        scale: 1.0,
                        next_epoch: epoch + 1,
                    };
                    let ack = ask(&actor, |r| ServerMsg::Reduce(reduce, r)).await.unwrap();
                    assert_eq!(ack.sum_sq, 16.0, "the frozen unit adds nothing");
                    let apply = ApplyCmd {
                        lr_scale: 1.0,
                        clip: 1.0,
                        version,
                    };
                    ask(&actor, |r| ServerMsg::Apply(apply, r)).await.unwrap();
                    for route in [&routes[0], &routes[2]] {
                        let mut published = vec![0u8; bytes.len()];
                        let got = transport
                            .read(
                                &route.published,
                                0..10,
                                Dest::Bytes(&mut published),
                                deadline_in(Duration::from_secs(5)),
                            )
                            .await
                            .unwrap();
                        assert_eq!(got, version, "I1: published at every step's version");
                        assert_eq!(published, bytes.to_vec(), "{pull_dtype:?}: the same bytes");
                    }
                }
                let cmd = SnapshotCmd { optimizer: true };
                let snapshots = ask(&actor, |r| ServerMsg::Snapshot(cmd, r)).await.unwrap();
                assert_eq!(snapshots.len(), 2, "a served unit is not the model's");
                assert_eq!(snapshots[0].optimizer, Some(OptimizerSnapshot::default()));
                let trained = snapshots[1].optimizer.as_ref().unwrap();
                assert_eq!((trained.steps, trained.buffers.len()), (3, 2));
                let (_, master) = read(transport.as_ref(), &snapshots[0].region, 10).await;
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&master), bits(&initial), "bit-identical master values");
                let (_, adapter) = read(transport.as_ref(), &snapshots[1].region, 4).await;
                assert!(
                    adapter.iter().all(|&x| x < 0.8),
                    "the adapter trained: {adapter:?}"
                );
                actor.stop(None);
            }
        })
        .await
        .expect("test timed out");
    }

    /// A transport whose owner-side `publish` and `take` block until the test grants a permit:
    /// work that ran on the runtime's only thread would block the task that grants it.
    struct Gated {
        inner: LocalTransport,
        permits: Arc<(Mutex<u32>, Condvar)>,
    }

    fn pass(permits: &(Mutex<u32>, Condvar)) -> bool {
        let (lock, cvar) = permits;
        let guard = lock.lock().unwrap();
        let (mut guard, timeout) = cvar
            .wait_timeout_while(guard, Duration::from_secs(5), |n| *n == 0)
            .unwrap();
        if timeout.timed_out() {
            return false;
        }
        *guard -= 1;
        true
    }

    struct GatedPublished(Box<dyn PublishedRegion>, Arc<(Mutex<u32>, Condvar)>);
    impl PublishedRegion for GatedPublished {
        fn handle(&self) -> RegionHandle {
            self.0.handle()
        }
        fn publish(&self, version: u64, data: Bytes) -> std::result::Result<(), TransportError> {
            if !pass(&self.1) {
                return Err(TransportError::Unsupported {
                    what: "the gate never opened: publish ran on the runtime thread".into(),
                });
            }
            self.0.publish(version, data)
        }
        fn republish(&self, version: u64) -> std::result::Result<(), TransportError> {
            if !pass(&self.1) {
                return Err(TransportError::Unsupported {
                    what: "the gate never opened: republish ran on the runtime thread".into(),
                });
            }
            self.0.republish(version)
        }
        fn version(&self) -> u64 {
            self.0.version()
        }
    }

    impl Wrap for Gated {
        fn inner(&self) -> &dyn Transport {
            &self.inner
        }
        fn register_published(
            &self,
            owner: EndpointId,
            dtype: Dtype,
            initial: Bytes,
            version: u64,
        ) -> std::result::Result<Box<dyn PublishedRegion>, TransportError> {
            let inner = self
                .inner
                .register_published(owner, dtype, initial, version)?;
            Ok(Box::new(GatedPublished(inner, self.permits.clone())))
        }
    }

    /// I6: the optimizer loop runs off the runtime's threads. On a runtime with one thread, the
    /// publish at the end of `Apply` waits for a permit that a task on that same thread grants;
    /// had `Apply` run on the runtime thread, the permit could never be granted (the publish
    /// gives up after 5 s and the step fails).
    #[test]
    fn i6_apply_runs_off_the_runtime_thread() {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let outcome = runtime.block_on(async {
                let permits = Arc::new((Mutex::new(0u32), Condvar::new()));
                let transport: Arc<dyn Transport> = Arc::new(Wrapped(Gated {
                    inner: LocalTransport::new(),
                    permits: permits.clone(),
                }));
                let actor = server(transport, 1, 0).await;
                let apply = ApplyCmd {
                    lr_scale: 1.0,
                    clip: 1.0,
                    version: 1,
                };
                let call = tokio::spawn({
                    let actor = actor.clone();
                    async move { ask(&actor, |r| ServerMsg::Apply(apply, r)).await }
                });
                // Runs only if the runtime thread is free while `Apply` waits for its permit.
                tokio::task::yield_now().await;
                let (lock, cvar) = &*permits;
                *lock.lock().unwrap() += 1;
                cvar.notify_all();
                let outcome = call.await.unwrap();
                actor.stop(None);
                outcome
            });
            let _ = done_tx.send(outcome);
        });
        let outcome = done_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the server answered");
        assert_eq!(
            outcome,
            Ok(()),
            "Apply completed with the permit granted from the runtime"
        );
    }
}
