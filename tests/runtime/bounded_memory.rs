//! I5 bounded memory: a compute that releases each unit after use never holds more than
//! `prefetch + 1` gathered units (gathered plus prefetches in flight), for every prefetch depth.

use odc::{
    async_trait, Compute, ComputeOutput, Job, MicroBatch, Precision, SampleMeta, TrainerContext,
    UnitSpec,
};

use crate::within;

const UNITS: usize = 8;

struct LayerByLayer;

#[async_trait]
impl Compute for LayerByLayer {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        _mb: &MicroBatch,
    ) -> odc::Result<ComputeOutput> {
        for u in 0..UNITS {
            let _w = ctx.gather(u as u32).await?;
            ctx.release(u as u32)?;
        }
        ctx.backward();
        for u in (0..UNITS).rev() {
            let w = ctx.gather(u as u32).await?;
            ctx.push_grad(u as u32, &w)?;
            ctx.release(u as u32)?;
        }
        Ok(ComputeOutput::default())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i5_gathered_units_never_exceed_prefetch_plus_one() {
    for prefetch in 0..4 {
        let mut job = Job::builder()
            .units((0..UNITS).map(|u| UnitSpec::constant(format!("u{u}"), 1000 + u, 0.5)))
            .trainers(2)
            .servers(3)
            .prefetch(prefetch)
            .chunk_elems(128)
            .pull_precision(Precision::Bf16)
            .compute(|_| Box::new(LayerByLayer) as Box<dyn Compute>)
            .build()
            .unwrap();
        let samples: Vec<SampleMeta> = (0..6).map(|i| SampleMeta::new(i, 100)).collect();
        let stats = within(30, job.step_with(samples)).await.unwrap();
        job.shutdown().await;
        let peak = stats
            .trainers
            .iter()
            .map(|t| t.peak_gathered)
            .max()
            .unwrap();
        assert!(peak <= prefetch + 1, "prefetch {prefetch}: peak {peak}");
        if prefetch > 0 {
            // Prefetching really happened, so the bound was exercised.
            assert_eq!(peak, prefetch + 1, "prefetch {prefetch}: peak {peak}");
        }
    }
}
