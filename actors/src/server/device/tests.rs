//! The GPU store against the host store, through the server actor and its barrier protocol: the
//! same gradients pushed into a server on a `cuda` transport and into one on a `local` transport
//! must give the same sums of squares (up to reassociation), the same parameters and optimizer
//! state after several steps with clipping, weight decay, bias correction and a learning-rate
//! factor, bf16 copies encoded as the host codec encodes, and NaN or infinite sums for
//! non-finite gradients. Tests that need a device print why they were skipped where there is no
//! CUDA driver; the kernels' compilation needs only NVRTC.
//!
//! Tolerance (stated, and printed with what was measured): parameters and optimizer buffers agree
//! within 1e-6 relative (`|Δ| ≤ 1e-6 · max(1, |host|)`); the kernels are written to be bitwise the
//! host loops, so the printed count of bitwise-equal elements is expected to be all of them. Sums of
//! squares agree within 1e-9 relative (f64 sums of ~10⁶ terms in another order).

use std::sync::Arc;
use std::time::Duration;

use odc_transport::cuda::{check_driver, CudaConfig, CudaTransport};
use odc_transport::local::LocalTransport;
use odc_transport::{
    codec, deadline_in, ClusterSecret, Dest, Dtype, RegionHandle, Transport, WriteTag,
};
use ractor::{Actor, ActorRef, RpcReplyPort};

use crate::datapath::micro_batch_of;
use crate::directory::ShardRoute;
use crate::layout::{ModelLayout, UnitOptimizerInit, UnitSpec};
use crate::node::Node;
use crate::policy::token::JobKey;
use crate::server::optimizer::OptimizerConfig;
use crate::server::{
    ApplyCmd, DiscardCmd, ReduceCmd, ServerArgs, ServerMsg, ServerSpec, ShardServer, SnapshotCmd,
};
use crate::trainer::{Compute, SharedComputeFactory};

const KEY: JobKey = JobKey::from_bytes([0x2b; JobKey::LEN]);
/// A unit longer than one launch's threads (several blocks, grid-stride) and of no round length,
/// and a unit smaller than one block.
const BIG: usize = 3 * 256 * 1024 + 7;
const SMALL: usize = 5;
const REL_TOL: f64 = 1e-6;
const SUM_SQ_REL_TOL: f64 = 1e-9;

/// Why the device tests cannot run here, printed; `true` to skip.
fn skip_without_driver(test: &str) -> bool {
    match check_driver() {
        Ok(()) => false,
        Err(e) => {
            eprintln!("skipped `{test}`: {e}");
            true
        }
    }
}

/// The optimizer kernels compile with NVRTC (no driver, no device needed; skipped with the reason
/// where NVRTC does not load).
#[test]
fn optimizer_kernels_compile_with_nvrtc() {
    match odc_kernels::nvrtc::ptx(&odc_kernels::OPTIMIZER, (9, 0)) {
        Ok(ptx) => {
            for name in odc_kernels::OPTIMIZER.functions {
                assert!(ptx.contains(name), "the PTX has no {name}");
            }
            // No fused multiply-add: the kernels are the host's fp32 operations, one by one.
            assert!(
                !ptx.contains("fma.rn.f32"),
                "the PTX fuses fp32 multiply-adds"
            );
        }
        Err(odc_kernels::nvrtc::KernelError(what)) if what.starts_with("no NVRTC") => {
            eprintln!("skipped `optimizer_kernels_compile_with_nvrtc`: {what}")
        }
        Err(e) => panic!("optimizer.cu does not compile: {e}"),
    }
}

/// Deterministic value in [-1, 1) from a key (splitmix64).
fn uniform(key: u64) -> f32 {
    let mut z = key.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn values(seed: u64, len: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .map(|i| uniform(seed.wrapping_mul(1_000_003).wrapping_add(i as u64)) * scale)
        .collect()
}

fn units() -> Vec<UnitSpec> {
    vec![
        UnitSpec::with_values("big", values(1, BIG, 1.0)),
        UnitSpec::with_values("small", values(2, SMALL, 1.0)),
    ]
}

fn spec(optimizer: OptimizerConfig, pull_dtype: Dtype) -> ServerSpec {
    ServerSpec {
        endpoint: 0,
        servers: 1,
        optimizer,
        pull_dtype,
        epoch: 0,
        key: KEY,
    }
}

fn tag(epoch: u64, write_id: u128) -> WriteTag {
    WriteTag {
        epoch,
        write_id,
        token: KEY.token(epoch, micro_batch_of(write_id)),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

async fn cuda_transport(test: &str) -> Arc<dyn Transport> {
    let secret = ClusterSecret::new("odc-actors-gpu-test").expect("secret");
    let job = format!("odcsrv{}-{test}", std::process::id());
    Arc::new(
        CudaTransport::new(CudaConfig::new(0, job, secret))
            .await
            .unwrap_or_else(|e| panic!("cuda transport: {e}")),
    )
}

/// One server and the transport its node uses.
struct Server {
    actor: ActorRef<ServerMsg>,
    transport: Arc<dyn Transport>,
    routes: Vec<ShardRoute>,
}

async fn ask<T: Send + 'static>(
    actor: &ActorRef<ServerMsg>,
    msg: impl FnOnce(RpcReplyPort<T>) -> ServerMsg,
) -> T {
    match actor.call(msg, Some(Duration::from_secs(120))).await {
        Ok(ractor::rpc::CallResult::Success(v)) => v,
        _ => panic!("the server did not answer"),
    }
}

impl Server {
    async fn start(transport: Arc<dyn Transport>, layout: ModelLayout, spec: ServerSpec) -> Self {
        let compute: SharedComputeFactory =
            Arc::new(|_: u32| -> Box<dyn Compute> { unreachable!("no trainer here") });
        let node = Arc::new(Node {
            transport: transport.clone(),
            layout: Arc::new(layout),
            compute,
            collective: None,
            clock: Arc::new(crate::policy::clock::SystemClock),
            trainer_transport: None,
            server_transport: None,
        });
        let (actor, _) = Actor::spawn(None, ShardServer, ServerArgs { spec, node })
            .await
            .unwrap_or_else(|e| panic!("server on {}: {e}", transport.backend()));
        let routes = ask(&actor, ServerMsg::Routes).await;
        Self {
            actor,
            transport,
            routes,
        }
    }

    async fn push(&self, unit: usize, values: &[f32], tag: WriteTag) {
        self.transport
            .accumulate(
                self.routes[unit]
                    .accumulator
                    .as_ref()
                    .expect("a trainable unit's shard"),
                0,
                codec::encode_f32(values),
                tag,
                deadline_in(Duration::from_secs(30)),
            )
            .await
            .unwrap_or_else(|e| panic!("{} accumulate: {e}", self.transport.backend()));
    }

    async fn reduce(&self, scale: f64, next_epoch: u64) -> f64 {
        let cmd = ReduceCmd { scale, next_epoch };
        ask(&self.actor, |r| ServerMsg::Reduce(cmd, r))
            .await
            .unwrap_or_else(|e| panic!("{} reduce: {e}", self.transport.backend()))
            .sum_sq
    }

    async fn apply(&self, clip: f64, lr_scale: f64, version: u64) {
        let cmd = ApplyCmd {
            clip,
            lr_scale,
            version,
        };
        ask(&self.actor, |r| ServerMsg::Apply(cmd, r))
            .await
            .unwrap_or_else(|e| panic!("{} apply: {e}", self.transport.backend()));
    }

    async fn discard(&self, next_epoch: u64) {
        let cmd = DiscardCmd { next_epoch };
        ask(&self.actor, |r| ServerMsg::Discard(cmd, r))
            .await
            .unwrap_or_else(|e| panic!("{} discard: {e}", self.transport.backend()));
    }

    async fn read(&self, handle: &RegionHandle) -> (u64, Vec<f32>) {
        let len = handle.elements();
        let mut out = vec![f32::NAN; len];
        let version = self
            .transport
            .read(
                handle,
                0..len,
                Dest::F32(&mut out),
                deadline_in(Duration::from_secs(30)),
            )
            .await
            .unwrap_or_else(|e| panic!("{} read: {e}", self.transport.backend()));
        (version, out)
    }

    async fn read_bytes(&self, handle: &RegionHandle) -> (u64, Vec<u8>) {
        let len = handle.elements();
        let mut out = vec![0u8; len * handle.dtype.size()];
        let version = self
            .transport
            .read(
                handle,
                0..len,
                Dest::Bytes(&mut out),
                deadline_in(Duration::from_secs(30)),
            )
            .await
            .unwrap_or_else(|e| panic!("{} read: {e}", self.transport.backend()));
        (version, out)
    }

    /// Per unit: (name, values) of the master weights, then of every optimizer buffer, and the
    /// step count, read over the data plane from a snapshot.
    async fn state(&self) -> Vec<(u64, Vec<(String, Vec<f32>)>)> {
        let cmd = SnapshotCmd { optimizer: true };
        let snapshots = ask(&self.actor, |r| ServerMsg::Snapshot(cmd, r))
            .await
            .unwrap_or_else(|e| panic!("{} snapshot: {e}", self.transport.backend()));
        let mut out = Vec::new();
        for s in snapshots {
            let optimizer = s.optimizer.expect("the optimizer's state was asked for");
            let mut named = vec![("master".to_string(), self.read(&s.region).await.1)];
            for (name, handle) in &optimizer.buffers {
                named.push((name.clone(), self.read(handle).await.1));
            }
            out.push((optimizer.steps, named));
        }
        out
    }
}

/// `got` (device) against `want` (host): lengths, NaN, the stated tolerance. Returns how many
/// elements were bitwise equal.
fn compare(what: &str, got: &[f32], want: &[f32]) -> usize {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut bitwise = 0;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(!g.is_nan() && !w.is_nan(), "{what}[{i}]: NaN ({g} vs {w})");
        let bound = REL_TOL * f64::from(w.abs()).max(1.0);
        assert!(
            (f64::from(*g) - f64::from(*w)).abs() <= bound,
            "{what}[{i}]: device {g} vs host {w} (tolerance {bound:e})"
        );
        bitwise += usize::from(g.to_bits() == w.to_bits());
    }
    bitwise
}

/// Both servers' states agree (step counts exactly, values within the tolerance); prints the
/// bitwise-equal counts.
async fn compare_states(label: &str, device: &Server, host: &Server) {
    let (got, want) = (device.state().await, host.state().await);
    assert_eq!(got.len(), want.len(), "{label}: shards");
    for (unit, ((got_steps, got), (want_steps, want))) in got.iter().zip(&want).enumerate() {
        assert_eq!(got_steps, want_steps, "{label}: unit {unit} step count");
        let names = |s: &[(String, Vec<f32>)]| s.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(got), names(want), "{label}: unit {unit} buffers");
        for ((name, g), (_, w)) in got.iter().zip(want) {
            let bitwise = compare(&format!("{label}: unit {unit} {name}"), g, w);
            eprintln!(
                "{label}: unit {unit} {name}: {bitwise} of {} elements bitwise equal to the host",
                g.len()
            );
        }
    }
}

/// The device server's published copy: exactly `codec::encode` of its master weights (the
/// kernel's encoding is the host codec's), at `version`.
async fn check_published(label: &str, server: &Server, version: u64) {
    let state = server.state().await;
    for (unit, route) in server.routes.iter().enumerate() {
        let (read_version, bytes) = server.read_bytes(&route.published).await;
        assert_eq!(
            read_version, version,
            "{label}: unit {unit} published version"
        );
        let master = &state[unit].1[0].1;
        let want = codec::encode(route.published.dtype, master);
        assert_eq!(
            bytes.len(),
            want.len(),
            "{label}: unit {unit} published length"
        );
        let differ = bytes
            .chunks(route.published.dtype.size())
            .zip(want.chunks(route.published.dtype.size()))
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(
            differ, 0,
            "{label}: unit {unit}: {differ} published elements are not the host codec's encoding"
        );
    }
}

/// The device store equals the host store over five barriers: two pushes per unit and step, a
/// reduce (scale 0.5) whose sums of squares agree, and applies with clip factors below 1 and
/// learning-rate factors (a schedule's) — AdamW with weight decay and bias correction, and SGD
/// with momentum and weight decay; bf16 and fp32 pulls.
#[test]
fn device_steps_equal_host_steps() {
    if skip_without_driver("device_steps_equal_host_steps") {
        return;
    }
    let adamw = OptimizerConfig::AdamW {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let sgd = OptimizerConfig::Sgd {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 0.01,
    };
    // (clip, lr_scale) per step: clipping on and off, a warm-up and a decay.
    let steps = [
        (1.0, 0.2),
        (0.37, 0.6),
        (1.0, 1.0),
        (0.81, 0.75),
        (0.5, 0.3),
    ];
    runtime().block_on(async {
        tokio::time::timeout(Duration::from_secs(300), async {
            for (label, optimizer, dtype, job) in [
                ("AdamW bf16", adamw, Dtype::Bf16, "adamw"),
                ("SGD fp32", sgd, Dtype::F32, "sgd"),
            ] {
                let layout = || ModelLayout::new(units()).expect("layout");
                let device =
                    Server::start(cuda_transport(job).await, layout(), spec(optimizer, dtype))
                        .await;
                let host = Server::start(
                    Arc::new(LocalTransport::new()),
                    layout(),
                    spec(optimizer, dtype),
                )
                .await;
                for (step, &(clip, lr_scale)) in steps.iter().enumerate() {
                    let epoch = step as u64;
                    for (unit, len) in [BIG, SMALL].into_iter().enumerate() {
                        for write in 0..2u64 {
                            let seed = 100 + epoch * 10 + unit as u64 * 3 + write;
                            // Gradients of several magnitudes, a few of them large.
                            let grad = values(seed, len, if write == 0 { 3.0 } else { 40.0 });
                            let id = crate::datapath::write_id(write as u32, unit as u32, 0, 0);
                            device.push(unit, &grad, tag(epoch, id)).await;
                            host.push(unit, &grad, tag(epoch, id)).await;
                        }
                    }
                    let (got, want) = (
                        device.reduce(0.5, epoch + 1).await,
                        host.reduce(0.5, epoch + 1).await,
                    );
                    assert!(got.is_finite() && want.is_finite(), "{label} step {step}");
                    let rel = (got - want).abs() / want;
                    assert!(
                        rel <= SUM_SQ_REL_TOL,
                        "{label} step {step}: sum of squares {got} (device) vs {want} (host), \
                         relative {rel:e}"
                    );
                    eprintln!("{label} step {step}: sum of squares relative difference {rel:e}");
                    device.apply(clip, lr_scale, epoch + 1).await;
                    host.apply(clip, lr_scale, epoch + 1).await;
                }
                let last = steps.len() as u64;
                compare_states(label, &device, &host).await;
                check_published(label, &device, last).await;
                let initial = values(1, BIG, 1.0);
                let moved = device.state().await[0].1[0]
                    .1
                    .iter()
                    .zip(&initial)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(moved > 1e-3, "{label}: the parameters moved only {moved}");
                device.actor.stop(None);
                host.actor.stop(None);
            }
        })
        .await
        .expect("test timed out")
    });
}

/// A non-finite case: what it is, its pushes, and the check of the sum of squares it must give.
type Case = (&'static str, Vec<Vec<f32>>, fn(f64) -> bool);

/// The barrier's non-finite check on the GPU: a NaN pushed into an accumulator makes the server's
/// sum of squares NaN, a sum that overflows fp32 in the accumulator makes it infinite — as on the
/// host — and after the supervisor's `Discard` nothing was applied (the published copy is still
/// version 0, unchanged) and the next step is clean.
#[test]
fn non_finite_gradients_give_a_non_finite_sum_and_nothing_is_applied() {
    if skip_without_driver("non_finite_gradients_give_a_non_finite_sum_and_nothing_is_applied") {
        return;
    }
    runtime().block_on(async {
        tokio::time::timeout(Duration::from_secs(300), async {
            let optimizer = OptimizerConfig::adamw(1e-2);
            let layout = || ModelLayout::new(units()).expect("layout");
            let device = Server::start(
                cuda_transport("nonfinite").await,
                layout(),
                spec(optimizer, Dtype::Bf16),
            )
            .await;
            let host = Server::start(
                Arc::new(LocalTransport::new()),
                layout(),
                spec(optimizer, Dtype::Bf16),
            )
            .await;
            let before = device.read_bytes(&device.routes[0].published).await;
            assert_eq!(before.0, 0);
            let mut nan = values(7, BIG, 1.0);
            nan[BIG / 2 + 1] = f32::NAN;
            let mut huge = vec![0.0f32; BIG];
            huge[BIG - 1] = 3.0e38;
            let id = |n: u32| crate::datapath::write_id(n, 0, 0, 0);
            // Epoch 0: a NaN. Epoch 1: two finite pushes whose sum overflows to infinity.
            let cases: [Case; 2] = [
                ("a NaN", vec![nan], f64::is_nan),
                ("an fp32 overflow", vec![huge.clone(), huge], |s| {
                    s.is_infinite() && s > 0.0
                }),
            ];
            for (case, (what, pushes, expected)) in cases.into_iter().enumerate() {
                // Each case moves the accumulators two epochs: reduce, then discard.
                let epoch = 2 * case as u64;
                for server in [&device, &host] {
                    for (n, grad) in pushes.iter().enumerate() {
                        server.push(0, grad, tag(epoch, id(n as u32))).await;
                    }
                    let sum_sq = server.reduce(1.0, epoch + 1).await;
                    assert!(
                        expected(sum_sq),
                        "{what} on {}: the sum of squares is {sum_sq}",
                        server.transport.backend()
                    );
                    // The supervisor refuses the norm and discards the attempt.
                    server.discard(epoch + 2).await;
                }
            }
            assert_eq!(
                device.read_bytes(&device.routes[0].published).await,
                before,
                "nothing was applied"
            );
            // A clean step after the discards: both agree, finite.
            let grad = values(8, BIG, 1.0);
            for server in [&device, &host] {
                server.push(0, &grad, tag(4, id(5))).await;
                let sum_sq = server.reduce(1.0, 5).await;
                assert!(sum_sq.is_finite() && sum_sq > 0.0);
                server.apply(1.0, 1.0, 1).await;
            }
            compare_states("after the discards", &device, &host).await;
            check_published("after the discards", &device, 1).await;
            device.actor.stop(None);
            host.actor.stop(None);
        })
        .await
        .expect("test timed out")
    });
}

/// A frozen unit's shard on the GPU: no accumulator, no optimizer state, nothing added to the
/// sum of squares, and after steps of AdamW with weight decay its values are bit-identical to the
/// initial ones, published at every step's version with the same bytes. A served unit's shard
/// likewise, and it is left out of the snapshots (it keeps no masters).
#[test]
fn frozen_unit_on_the_device_keeps_no_training_state_and_never_changes() {
    if skip_without_driver("frozen_unit_on_the_device_keeps_no_training_state_and_never_changes") {
        return;
    }
    runtime().block_on(async {
        tokio::time::timeout(Duration::from_secs(300), async {
            let optimizer = OptimizerConfig::AdamW {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
            };
            let initial = values(1, BIG, 1.0);
            let layout = ModelLayout::new(vec![
                UnitSpec::with_values("big", initial.clone()).frozen(),
                UnitSpec::with_values("small", values(2, SMALL, 1.0)),
                UnitSpec::with_values("reference.big", initial.clone()).served(),
            ])
            .expect("layout");
            let device = Server::start(
                cuda_transport("frozen").await,
                layout,
                spec(optimizer, Dtype::Bf16),
            )
            .await;
            assert_eq!(device.routes[0].accumulator, None, "no accumulator region");
            let published = codec::encode(Dtype::Bf16, &initial).to_vec();
            for epoch in 0..3u64 {
                let grad = values(40 + epoch, SMALL, 2.0);
                let id = crate::datapath::write_id(0, 1, 0, 0);
                device.push(1, &grad, tag(epoch, id)).await;
                let scaled: f64 = grad.iter().map(|g| f64::from(*g).powi(2)).sum();
                let sum_sq = device.reduce(1.0, epoch + 1).await;
                assert!(
                    (sum_sq - scaled).abs() <= SUM_SQ_REL_TOL * scaled,
                    "the frozen unit adds nothing: {sum_sq} vs {scaled}"
                );
                device.apply(1.0, 1.0, epoch + 1).await;
                for unit in [0, 2] {
                    let (version, bytes) = device.read_bytes(&device.routes[unit].published).await;
                    assert_eq!(version, epoch + 1, "I1: published at every step's version");
                    assert!(bytes == published, "unit {unit}: the same published bytes");
                }
            }
            let state = device.state().await;
            assert_eq!(state.len(), 2, "a served unit is not the model's");
            assert_eq!(state[0].0, 0, "no optimizer steps");
            assert_eq!(state[0].1.len(), 1, "the master weights only, no buffers");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&state[0].1[0].1) == bits(&initial),
                "bit-identical master weights"
            );
            assert_eq!((state[1].0, state[1].1.len()), (3, 3));
            device.actor.stop(None);
        })
        .await
        .expect("test timed out")
    });
}

/// One step of the resume test: a push per unit, reduce, apply with clipping and a factor.
async fn resume_step(server: &Server, epoch: u64) {
    for (unit, len) in [BIG, SMALL].into_iter().enumerate() {
        let grad = values(300 + epoch * 7 + unit as u64, len, 2.0);
        let id = crate::datapath::write_id(0, unit as u32, 0, 0);
        server.push(unit, &grad, tag(epoch, id)).await;
    }
    server.reduce(1.0, epoch + 1).await;
    server.apply(0.9, 0.5, epoch + 1).await;
}

/// A server on the GPU resumes from a host checkpoint (master weights and AdamW state with its
/// step count, as `optimizer_init` gives them) and continues exactly as the host server that
/// wrote it.
#[test]
fn device_server_resumes_from_a_host_checkpoint() {
    if skip_without_driver("device_server_resumes_from_a_host_checkpoint") {
        return;
    }
    runtime().block_on(async {
        tokio::time::timeout(Duration::from_secs(300), async {
            let optimizer = OptimizerConfig::adamw(3e-3);
            let host = Server::start(
                Arc::new(LocalTransport::new()),
                ModelLayout::new(units()).expect("layout"),
                spec(optimizer, Dtype::Bf16),
            )
            .await;
            resume_step(&host, 0).await;
            resume_step(&host, 1).await;
            // The checkpoint: the host's state, as a resumed layout.
            let state = host.state().await;
            let specs = units();
            let mut resumed_units = Vec::new();
            let mut inits = Vec::new();
            for (spec_unit, (steps, named)) in specs.iter().zip(&state) {
                resumed_units.push(UnitSpec::with_values(
                    spec_unit.name.clone(),
                    named[0].1.clone(),
                ));
                inits.push(UnitOptimizerInit {
                    steps: *steps,
                    buffers: named[1..]
                        .iter()
                        .map(|(name, values)| (name.clone(), Arc::from(values.as_slice())))
                        .collect(),
                });
            }
            let layout = ModelLayout::new(resumed_units)
                .and_then(|l| l.with_optimizer_state(inits))
                .expect("resumed layout");
            let device = Server::start(
                cuda_transport("resume").await,
                layout,
                ServerSpec {
                    epoch: 2,
                    ..spec(optimizer, Dtype::Bf16)
                },
            )
            .await;
            compare_states("resumed", &device, &host).await;
            resume_step(&device, 2).await;
            resume_step(&host, 2).await;
            compare_states("resumed, one more step", &device, &host).await;
            device.actor.stop(None);
            host.actor.stop(None);
        })
        .await
        .expect("test timed out")
    });
}

/// A server on the GPU writes its shards for a checkpoint as they were when it was asked: the
/// device copies are taken before the reply and downloaded by the writer, so a step applied right
/// after the reply does not change the file, which holds exactly the state read out before it.
#[test]
fn a_checkpoint_of_device_shards_holds_them_as_they_were_when_asked() {
    use crate::server::messages::WriteShardsCmd;
    use crate::server::shard_file::{tensor_name, PARAMS};

    if skip_without_driver("a_checkpoint_of_device_shards_holds_them_as_they_were_when_asked") {
        return;
    }
    runtime().block_on(async {
        tokio::time::timeout(Duration::from_secs(300), async {
            let device = Server::start(
                cuda_transport("checkpoint").await,
                ModelLayout::new(units()).expect("layout"),
                spec(OptimizerConfig::adamw(3e-3), Dtype::Bf16),
            )
            .await;
            resume_step(&device, 0).await;
            let before = device.state().await;
            let dir = std::env::temp_dir().join(format!("odc-device-ckpt-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let cmd = WriteShardsCmd {
                dir: dir.display().to_string(),
            };
            ask(&device.actor, |r| ServerMsg::WriteShards(cmd, r))
                .await
                .expect("the copy is taken");
            resume_step(&device, 1).await;
            let written = ask(&device.actor, ServerMsg::ShardsWritten)
                .await
                .expect("the file is written");
            let bytes = std::fs::read(dir.join(&written.file.file)).expect("the shard file");
            let file = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
            assert_eq!(written.file.pieces.len(), before.len());
            for (piece, (steps, named)) in written.file.pieces.iter().zip(&before) {
                assert_eq!(piece.steps, *steps, "unit {}", piece.unit);
                for (what, values) in named {
                    let what = if what == "master" { PARAMS } else { what };
                    let name = tensor_name(piece.unit, piece.start, piece.end, what);
                    let tensor = file.tensor(&name).expect("every tensor is in the file");
                    let got = codec::decode_f32(tensor.data()).expect("fp32");
                    assert_eq!(
                        compare(&name, &got, values),
                        values.len(),
                        "{name}: bitwise"
                    );
                }
            }
            assert_ne!(
                device.state().await,
                before,
                "the step after the copy changed the shards"
            );
            let _ = std::fs::remove_dir_all(&dir);
            device.actor.stop(None);
        })
        .await
        .expect("test timed out")
    });
}
