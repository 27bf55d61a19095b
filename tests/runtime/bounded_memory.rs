//! I5 bounded memory: a compute that releases each unit after use never has more than
//! `prefetch + 1` gathered units alive. Measured from outside the context's bookkeeping: the unit
//! buffers still alive anywhere (in flight, gathered, kept, or held by the compute), counted by
//! weak references and transfer leases ([`TrainerContext::live_unit_buffers`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use odc::{
    async_trait, Compute, ComputeOutput, Job, MicroBatch, Precision, SampleMeta, TrainerContext,
    UnitId, UnitSpec,
};

use crate::within;

const UNITS: UnitId = 8;

/// Gathers forward and backward like a model, measuring the live buffers at every point; with
/// `hold`, it keeps every unit it gathered (a compute that never releases).
struct LayerByLayer {
    peak: Arc<AtomicUsize>,
    hold: bool,
}

impl LayerByLayer {
    fn measure(&self, ctx: &TrainerContext) {
        self.peak
            .fetch_max(ctx.live_unit_buffers(), Ordering::SeqCst);
    }
}

#[async_trait]
impl Compute for LayerByLayer {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        _mb: &MicroBatch,
    ) -> odc::Result<ComputeOutput> {
        let mut kept = Vec::new();
        for u in 0..UNITS {
            let w = ctx.gather(u).await?;
            self.measure(ctx);
            if self.hold {
                kept.push(w);
            } else {
                drop(w);
                ctx.release(u)?;
            }
            self.measure(ctx);
        }
        ctx.backward();
        for u in (0..UNITS).rev() {
            let w = ctx.gather(u).await?;
            self.measure(ctx);
            ctx.push_grad(u, &w)?;
            drop(w);
            if !self.hold {
                ctx.release(u)?;
            }
            self.measure(ctx);
        }
        Ok(ComputeOutput::default())
    }
}

async fn peak_live_buffers(prefetch: u32, hold: bool) -> usize {
    let peak = Arc::new(AtomicUsize::new(0));
    let p = peak.clone();
    let mut job = Job::builder()
        .units((0..UNITS).map(|u| UnitSpec::constant(format!("u{u}"), 1000 + u as usize, 0.5)))
        .trainers(2)
        .servers(3)
        .prefetch(prefetch)
        .chunk_elems(128)
        .pull_precision(Precision::Bf16)
        .compute(move |_| {
            Box::new(LayerByLayer {
                peak: p.clone(),
                hold,
            }) as Box<dyn Compute>
        })
        .build()
        .unwrap();
    let samples: Vec<SampleMeta> = (0..6).map(|i| SampleMeta::new(i, 100)).collect();
    within(30, job.step_with(samples)).await.unwrap();
    job.shutdown().await;
    peak.load(Ordering::SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i5_live_unit_buffers_never_exceed_prefetch_plus_one() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        for prefetch in 0..4 {
            let peak = peak_live_buffers(prefetch, false).await;
            let bound = prefetch as usize + 1;
            assert!(
                peak <= bound,
                "prefetch {prefetch}: {peak} unit buffers alive"
            );
            // Prefetching really happened, so the bound was reached, not just respected.
            assert_eq!(peak, bound, "prefetch {prefetch}: peak {peak}");
        }
    })
    .await
}

/// The measurement sees buffers wherever they are: a compute that keeps every unit has them all
/// alive, beyond the bound (what I5 excludes: memory the user's compute keeps itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i5_measurement_counts_what_the_compute_keeps() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        let peak = peak_live_buffers(1, true).await;
        assert_eq!(
            peak, UNITS as usize,
            "every gathered unit is alive while the compute keeps it"
        );
    })
    .await
}
