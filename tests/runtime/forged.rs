//! Reports and gradient writes bound to assignments (issue 19, item 4; docs/design.md "Security model"): an
//! authenticated peer that forges `Done` reports for micro-batches other trainers are computing,
//! and accumulates garbage under their write ids, changes nothing. Every trainer here is such a
//! peer: besides its real work it casts forged reports to the supervisor (every other
//! micro-batch, every trainer's name, several epochs, success and failure, guessed tokens) and
//! writes into every server's accumulator under every other micro-batch's write ids (several
//! epochs, guessed tokens). Every forged write must come back `RefusedWrite`, no step may fail,
//! and the parameters must equal a clean run's and the exact expectation (I2).
//!
//! The supervisor is spawned directly (as `Job` does) so the trainers can reach it, over a
//! transport that records the accumulators it registers (the forger's map of the servers).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use odc::transport::local::LocalTransport;
use odc::transport::wrap::{Wrap, Wrapped};
use odc::transport::{
    codec, AccumulatorRegion, Dest, Dtype, EndpointId, RegionHandle, Transport, TransportError,
    WriteTag,
};
use odc::{
    async_trait, Compute, ComputeOutput, DispatchMode, LossWeighting, MicroBatch, OptimizerConfig,
    SampleMeta, Timestamp, TrainerContext, UnitSpec,
};
use odc_actors::datapath::write_id;
use odc_actors::layout::ModelLayout;
use odc_actors::messages::{MicroBatchDone, SnapshotCmd, SupervisorSpec, TrainerReport};
use odc_actors::node::Node;
use odc_actors::policy::step::StepConfig;
use odc_actors::supervisor::{Supervisor, SupervisorArgs, SupervisorMsg};
use odc_actors::trainer::{ContextConfig, MicroBatchStats, SharedComputeFactory};
use ractor::rpc::CallResult;
use ractor::{Actor, ActorRef};

use crate::within;

const LEN: usize = 8;
const TRAINERS: u32 = 3;
const SERVERS: u32 = 2;
/// Micro-batch ids the forger targets: more than a step of 8 one-token samples has.
const MICRO_BATCHES: u32 = 8;
const STEPS: usize = 2;
/// Epochs the forger tries (a step's reduce moves to the next).
const EPOCHS: Range<u64> = 0..4;

/// A `LocalTransport` that records every accumulator registered through it.
struct Recording {
    inner: LocalTransport,
    accumulators: Mutex<Vec<RegionHandle>>,
}

impl Recording {
    fn accumulators(&self) -> Vec<RegionHandle> {
        self.accumulators
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Wrap for Recording {
    fn inner(&self) -> &dyn Transport {
        &self.inner
    }
    fn register_accumulator(
        &self,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<Box<dyn AccumulatorRegion>, TransportError> {
        let region = self.inner.register_accumulator(owner, len, epoch)?;
        self.accumulators
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(region.handle());
        Ok(region)
    }
}

/// What the forging trainers share.
#[derive(Default)]
struct Forgery {
    on: bool,
    transport: OnceLock<Arc<Wrapped<Recording>>>,
    supervisor: OnceLock<ActorRef<SupervisorMsg>>,
    /// A cheap source of guessed tokens.
    guesses: AtomicU64,
    refused_writes: AtomicU64,
    /// Forged writes that were not refused as `RefusedWrite` (must stay 0).
    other_outcomes: Mutex<Vec<String>>,
    forged_reports: AtomicU64,
    /// Micro-batches computed (each one forges).
    runs: AtomicU64,
}

impl Forgery {
    fn guess(&self) -> u128 {
        let n = self.guesses.fetch_add(1, Ordering::Relaxed);
        u128::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835) | 1
    }

    /// Done reports for every micro-batch but `own`, in every trainer's name, of several epochs.
    fn reports(&self, own: u32) {
        let Some(supervisor) = self.supervisor.get() else {
            return;
        };
        for micro_batch in (0..MICRO_BATCHES).filter(|&m| m != own) {
            for trainer in 0..TRAINERS + 1 {
                for epoch in EPOCHS {
                    let failed = (micro_batch + trainer) % 2 == 0;
                    let result = if failed {
                        Err(odc::Error::user(std::io::Error::other("forged failure")))
                    } else {
                        Ok(MicroBatchDone {
                            output: ComputeOutput { loss_sum: 1.0e6 },
                            stats: MicroBatchStats::default(),
                        })
                    };
                    let report = TrainerReport {
                        trainer,
                        epoch,
                        micro_batch,
                        token: self.guess(),
                        started: Timestamp::from_nanos(0),
                        finished: Timestamp::from_nanos(1),
                        result,
                    };
                    if supervisor.cast(SupervisorMsg::Done(report)).is_ok() {
                        self.forged_reports.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    /// Garbage into every accumulator under the write ids of every micro-batch but `own` (every
    /// shard index, chunk 0), of several epochs, with guessed tokens.
    async fn writes(&self, own: u32) {
        let Some(transport) = self.transport.get() else {
            return;
        };
        let deadline = odc::transport::deadline_in(Duration::from_secs(10));
        for handle in transport.0.accumulators() {
            let garbage = codec::encode_f32(&vec![1000.0; handle.elements()]);
            for micro_batch in (0..MICRO_BATCHES).filter(|&m| m != own) {
                for shard in 0..SERVERS {
                    for epoch in EPOCHS {
                        let tag = WriteTag {
                            epoch,
                            write_id: write_id(micro_batch, 0, shard, 0),
                            token: self.guess(),
                        };
                        let outcome = transport
                            .accumulate(&handle, 0, garbage.clone(), tag, deadline)
                            .await;
                        match outcome {
                            Err(TransportError::RefusedWrite { .. }) => {
                                self.refused_writes.fetch_add(1, Ordering::Relaxed);
                            }
                            other => self
                                .other_outcomes
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push(format!("{tag:?}: {other:?}")),
                        }
                    }
                }
            }
        }
    }
}

/// Each sample pushes 1.0 at its own position; with SGD(lr = 1) and sample weighting over 8
/// samples, a sample counted k times moves its parameter by exactly -k/8.
struct OneHot {
    forgery: Arc<Forgery>,
}

#[async_trait]
impl Compute for OneHot {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        mb: &MicroBatch,
    ) -> odc::Result<ComputeOutput> {
        if self.forgery.on {
            self.forgery.runs.fetch_add(1, Ordering::Relaxed);
            self.forgery.reports(mb.id);
            self.forgery.writes(mb.id).await;
        }
        let _ = ctx.gather(0).await?;
        // Long enough for the other trainers' forgeries to arrive while this one computes.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut grad = vec![0f32; LEN];
        for s in &mb.samples {
            grad[s.index as usize] += 1.0;
        }
        ctx.push_grad(0, &grad)?;
        Ok(ComputeOutput::default())
    }
}

async fn call<T: Send + 'static>(
    supervisor: &ActorRef<SupervisorMsg>,
    msg: impl FnOnce(ractor::RpcReplyPort<T>) -> SupervisorMsg,
) -> T {
    match supervisor.call(msg, Some(Duration::from_secs(30))).await {
        Ok(CallResult::Success(value)) => value,
        Ok(_) => panic!("the supervisor did not answer"),
        Err(e) => panic!("the supervisor is unreachable: {e}"),
    }
}

/// Train `STEPS` steps of 8 one-token samples with forgeries on or off; the final parameters.
async fn train(forgery: Arc<Forgery>) -> (Vec<f32>, u64) {
    let transport = Arc::new(Wrapped(Recording {
        inner: LocalTransport::new(),
        accumulators: Mutex::default(),
    }));
    let _ = forgery.transport.set(transport.clone());
    let layout = ModelLayout::new(vec![UnitSpec::constant("counts", LEN, 0.0)]).unwrap();
    let shared = forgery.clone();
    let compute: SharedComputeFactory = Arc::new(move |_: u32| -> Box<dyn Compute> {
        Box::new(OneHot {
            forgery: shared.clone(),
        })
    });
    let node = Arc::new(Node {
        transport: transport.clone(),
        layout: Arc::new(layout),
        compute,
        collective: None,
        clock: Arc::new(odc::SystemClock),
        trainer_transport: None,
        server_transport: None,
    });
    let spec = SupervisorSpec {
        trainers: TRAINERS,
        servers: SERVERS,
        optimizer: OptimizerConfig::sgd(1.0),
        pull_dtype: Dtype::F32,
        context: ContextConfig::default(),
        step: StepConfig {
            dispatch: DispatchMode::Static,
            weighting: LossWeighting::Samples,
            token_budget: 2,
            ..StepConfig::default()
        },
        relay: None,
    };
    let args = SupervisorArgs {
        spec,
        node,
        placement: None,
    };
    let (supervisor, handle) = Actor::spawn(None, Supervisor, args).await.unwrap();
    let _ = forgery.supervisor.set(supervisor.clone());
    let mut micro_batches = 0;
    for step in 0..STEPS {
        let samples: Vec<SampleMeta> = (0..LEN as u64).map(|i| SampleMeta::new(i, 1)).collect();
        let stats = call(&supervisor, |r| SupervisorMsg::Step(samples, r))
            .await
            .unwrap_or_else(|e| panic!("step {step} failed: {e}"));
        assert!(stats.micro_batches < MICRO_BATCHES, "step {step}");
        assert_eq!(stats.replays, 0, "step {step}: nothing was replayed");
        micro_batches += u64::from(stats.micro_batches);
    }
    let snapshots = call(&supervisor, |r| {
        SupervisorMsg::Parameters(SnapshotCmd::default(), r)
    })
    .await
    .unwrap();
    let mut params = vec![f32::NAN; LEN];
    let deadline = odc::transport::deadline_in(Duration::from_secs(10));
    for s in &snapshots {
        let range = s.range();
        transport
            .read(
                &s.region,
                0..range.len(),
                Dest::F32(&mut params[range]),
                deadline,
            )
            .await
            .unwrap();
    }
    supervisor.stop(None);
    handle.await.unwrap();
    (params, micro_batches)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i2_forged_reports_and_writes_change_nothing() {
    within(120, async {
        let (clean, _) = train(Arc::new(Forgery::default())).await;
        let forgery = Arc::new(Forgery {
            on: true,
            ..Forgery::default()
        });
        let (forged, micro_batches) = train(forgery.clone()).await;
        let others = forgery
            .other_outcomes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        assert!(others.is_empty(), "forged writes not refused: {others:?}");
        // Each micro-batch run forges, for each of the other micro-batches and each epoch tried:
        // a write into every accumulator (one per server) under every shard index, and a report
        // in every trainer's name and one unknown.
        let runs = forgery.runs.load(Ordering::Relaxed);
        assert_eq!(runs, micro_batches, "each micro-batch computed once");
        let others = u64::from(MICRO_BATCHES - 1) * (EPOCHS.end - EPOCHS.start);
        let servers = u64::from(SERVERS);
        assert_eq!(
            forgery.refused_writes.load(Ordering::Relaxed),
            runs * others * servers * servers
        );
        assert_eq!(
            forgery.forged_reports.load(Ordering::Relaxed),
            runs * others * u64::from(TRAINERS + 1)
        );
        let exact = -(STEPS as f32) / LEN as f32;
        for (name, params) in [("clean", &clean), ("forged", &forged)] {
            assert_eq!(params.len(), LEN, "{name}");
            assert!(params.iter().all(|p| p.is_finite()), "{name}: {params:?}");
            for (i, p) in params.iter().enumerate() {
                assert!(
                    (p - exact).abs() <= 1e-6,
                    "{name}: parameter {i} is {p}, each sample once gives {exact}"
                );
            }
        }
        let diff = clean
            .iter()
            .zip(&forged)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            diff <= 1e-6,
            "forged run differs from the clean one by {diff}"
        );
    })
    .await
}
