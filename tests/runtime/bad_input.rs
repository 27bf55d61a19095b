//! Bad input from the user or a peer: a typed error naming the problem, no panic, and the job keeps
//! running where it can (a failed step leaves nothing accumulated behind).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use odc::transport::local::LocalTransport;
use odc::transport::{codec, Dest, Dtype, Transport, TransportError};
use odc::{
    async_trait, Compute, ComputeOutput, Error, Job, MicroBatch, OptimizerConfig, Precision,
    SampleMeta, StepError, TrainerContext, UnitSpec,
};

use crate::within;

/// Misbehaves in the way `mode` says, then behaves.
struct Faulty {
    mode: Arc<AtomicU8>,
}

const GOOD: u8 = 0;
const UNKNOWN_UNIT: u8 = 1;
const SHORT_GRAD: u8 = 2;
const TWICE: u8 = 3;
const RELEASE_UNGATHERED: u8 = 4;

#[async_trait]
impl Compute for Faulty {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        _mb: &MicroBatch,
    ) -> odc::Result<ComputeOutput> {
        let w = ctx.gather(0).await?;
        let grad = vec![1.0f32; w.len()];
        match self.mode.load(Ordering::SeqCst) {
            UNKNOWN_UNIT => {
                ctx.gather(99).await?;
            }
            SHORT_GRAD => {
                ctx.push_grad(0, &grad[1..])?;
            }
            TWICE => {
                ctx.push_grad(0, &grad)?;
                ctx.push_grad(0, &grad)?;
            }
            RELEASE_UNGATHERED => ctx.release(1)?,
            _ => {}
        }
        ctx.push_grad(0, &grad)?;
        Ok(ComputeOutput::default())
    }
}

fn job(mode: Arc<AtomicU8>) -> Job {
    Job::builder()
        .unit(UnitSpec::constant("w", 10, 0.0))
        .unit(UnitSpec::constant("v", 3, 0.0))
        .trainers(2)
        .servers(3)
        .pull_precision(Precision::F32)
        .optimizer(OptimizerConfig::sgd(1.0))
        .token_budget(100)
        .compute(move |_| Box::new(Faulty { mode: mode.clone() }) as Box<dyn Compute>)
        .build()
        .unwrap()
}

fn samples() -> Vec<SampleMeta> {
    (0..4).map(|i| SampleMeta::new(i, 25)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_compute_calls_are_typed_errors_and_the_job_keeps_running() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        let mode = Arc::new(AtomicU8::new(GOOD));
        let mut job = job(mode.clone());
        type Expect = fn(&Error) -> bool;
        let cases: [(u8, Expect); 4] = [
            (UNKNOWN_UNIT, |e| {
                matches!(e, Error::UnknownUnit { unit: 99, units: 2 })
            }),
            (SHORT_GRAD, |e| {
                matches!(
                    e,
                    Error::GradLength {
                        unit: 0,
                        expected: 10,
                        got: 9,
                        ..
                    }
                )
            }),
            (TWICE, |e| matches!(e, Error::DuplicatePush { unit: 0, .. })),
            (RELEASE_UNGATHERED, |e| {
                matches!(e, Error::NotGathered { unit: 1 })
            }),
        ];
        within(30, async {
            for (m, expected) in cases {
                mode.store(m, Ordering::SeqCst);
                let err = job
                    .step_with(samples())
                    .await
                    .expect_err("bad call fails the step");
                match &err {
                    Error::MicroBatch {
                        source, step: 0, ..
                    } => {
                        assert!(expected(source), "mode {m}: unexpected {source}")
                    }
                    other => panic!("mode {m}: unexpected {other}"),
                }
                assert!(!err.to_string().is_empty());
            }
            // The job still runs, and nothing of the failed steps was applied: one good step with
            // gradient 1 per token-weighted sample... total weight 100 tokens, 4 micro-batch pushes
            // of 1.0 → mean gradient 4/100 per element, SGD lr 1.
            mode.store(GOOD, Ordering::SeqCst);
            let stats = job
                .step_with(samples())
                .await
                .expect("good step after bad ones");
            assert_eq!(stats.step, 0, "failed steps did not advance the version");
            let params = job.parameters().await.unwrap();
            let micro_batches = stats.micro_batches as f32;
            for p in &params[0] {
                assert!((p + micro_batches / 100.0).abs() < 1e-6, "got {p}");
            }
        })
        .await;
        job.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_minibatches_are_typed_errors() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        let mut job = job(Arc::new(AtomicU8::new(GOOD)));
        within(30, async {
            assert!(matches!(
                job.step_with(vec![]).await,
                Err(Error::Step(StepError::EmptyMinibatch { step: 0 }))
            ));
            let too_long = vec![SampleMeta::new(0, 1000)];
            let err = job.step_with(too_long).await.expect_err("over budget");
            assert!(matches!(err, Error::Step(StepError::Balance(_))), "{err}");
            job.step_with(samples()).await.expect("still running");
        })
        .await;
        job.shutdown().await;
    })
    .await
}

#[test]
fn zero_trainers_or_servers_or_missing_compute_are_refused() {
    let unit = || UnitSpec::constant("w", 4, 0.0);
    let compute = |_| {
        Box::new(Faulty {
            mode: Arc::new(AtomicU8::new(GOOD)),
        }) as Box<dyn Compute>
    };
    let err = Job::builder()
        .unit(unit())
        .trainers(0)
        .compute(compute)
        .build()
        .err();
    assert!(matches!(err, Some(Error::Zero { what }) if what == "trainer"));
    let err = Job::builder()
        .unit(unit())
        .servers(0)
        .compute(compute)
        .build()
        .err();
    assert!(matches!(err, Some(Error::Zero { what }) if what == "shard server"));
    let err = Job::builder().unit(unit()).build().err();
    assert!(matches!(err, Some(Error::Config(_))));
    let err = Job::builder().compute(compute).build().err();
    assert!(matches!(err, Some(Error::Layout(_))));
    let err = Job::builder()
        .unit(unit())
        .chunk_elems(0)
        .compute(compute)
        .build()
        .err();
    assert!(matches!(err, Some(Error::Config(_))));
}

#[tokio::test]
async fn out_of_range_region_read_is_a_typed_error() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        let t = LocalTransport::new();
        let region = t
            .register_published(0, Dtype::F32, codec::encode(Dtype::F32, &[1.0; 4]), 0)
            .unwrap();
        let handle = region.handle();
        let deadline = odc::transport::deadline_in(Duration::from_secs(5));
        let mut out = [7.0f32; 7];
        let err = t
            .read(&handle, 2..9, Dest::F32(&mut out), deadline)
            .await
            .unwrap_err();
        assert!(matches!(
            err,
            TransportError::OutOfRange {
                start: 2,
                end: 9,
                len: 4,
                ..
            }
        ));
        assert!(err.to_string().contains("2..9"));
        assert_eq!(out, [7.0; 7], "nothing written");
        // The region is unharmed.
        let mut whole = [0.0f32; 4];
        let version = t
            .read(&handle, 0..4, Dest::F32(&mut whole), deadline)
            .await
            .unwrap();
        assert_eq!((version, whole), (0, [1.0; 4]));
    })
    .await
}

/// `Job::all_gather` in one process: the value back through the same encoding (`[value]`), and
/// `barrier` returns at once. A value the encoding cannot carry is an error naming its type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_process_all_gather_returns_the_value_and_refuses_what_it_cannot_encode() {
    crate::within(60, async {
        let mut job = job(Arc::new(AtomicU8::new(GOOD)));
        let timeout = std::time::Duration::from_secs(5);
        let value = (7u64, vec![1.5f32, -0.0], "response".to_string());
        assert_eq!(job.all_gather(&value, timeout).await.unwrap(), vec![value]);
        job.barrier(timeout).await.unwrap();
        /// A type whose serializer always fails (as a map with non-string keys does for JSON).
        #[derive(Debug)]
        struct Unencodable;
        impl serde::Serialize for Unencodable {
            fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
                Err(serde::ser::Error::custom("no encoding"))
            }
        }
        impl<'de> serde::Deserialize<'de> for Unencodable {
            fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
                Ok(Unencodable)
            }
        }
        let err = job
            .all_gather(&Unencodable, timeout)
            .await
            .expect_err("cannot encode");
        assert!(err.to_string().contains("Unencodable"), "{err}");
        job.step_with(samples()).await.expect("the job still runs");
        job.shutdown().await;
    })
    .await
}
