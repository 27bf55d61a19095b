//! The Prometheus endpoint serves the runtime's `odc_*` metrics over real HTTP. Its own test binary:
//! the recorder is process-global.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use odc::{
    async_trait, Compute, ComputeOutput, Job, MicroBatch, NonFinite, SampleMeta, TrainerContext,
    UnitSpec,
};

/// Scraping the endpoint over HTTP.
#[path = "common/prometheus.rs"]
mod prometheus;
use prometheus::{free_addr, scrape};

/// Pushes ones; the first micro-batch at parameter version 1 returns a NaN loss (once).
struct Ones {
    nan_once: Arc<AtomicBool>,
}

#[async_trait]
impl Compute for Ones {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        mb: &MicroBatch,
    ) -> odc::Result<ComputeOutput> {
        let w = ctx.gather(0).await?;
        ctx.push_grad(0, &vec![1.0; w.len()])?;
        let nan = mb.step == 1 && self.nan_once.swap(false, Ordering::SeqCst);
        Ok(ComputeOutput {
            loss_sum: if nan { f64::NAN } else { mb.tokens as f64 },
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_serves_odc_metrics() {
    // A whole-test timeout: a hang fails the test instead of CI.
    tokio::time::timeout(std::time::Duration::from_secs(120), async {
        let addr = free_addr();
        odc::metrics::serve(addr).expect("serve metrics");
        // A second recorder in the same process is refused with a message naming the address.
        let again = odc::metrics::serve(free_addr()).unwrap_err();
        assert!(again.to_string().contains("metrics endpoint"), "{again}");
        let nan_once = Arc::new(AtomicBool::new(true));
        let mut job = Job::builder()
            .unit(UnitSpec::constant("w", 64, 0.0))
            .trainers(2)
            .servers(2)
            .on_non_finite(NonFinite::SkipStep)
            .compute(move |_| {
                Box::new(Ones {
                    nan_once: nan_once.clone(),
                }) as Box<dyn Compute>
            })
            .data(|_| Ok((0..4).map(|i| SampleMeta::new(i, 10)).collect()))
            .build()
            .unwrap();
        let stats = tokio::time::timeout(Duration::from_secs(30), job.run(3))
            .await
            .expect("timeout")
            .unwrap();
        let skipped: Vec<bool> = stats.iter().map(|s| s.skipped.is_some()).collect();
        assert_eq!(skipped, [false, true, false], "step 1 had a NaN loss");
        job.shutdown().await;
        let body = tokio::task::spawn_blocking(move || scrape(addr))
            .await
            .unwrap();
        assert!(body.starts_with("HTTP/1.1 200"), "{body}");
        // Prometheus conventions: counters are counters named `_total`, durations `_seconds`
        // (summaries: their `_sum` is the total), sizes `_bytes`, fractions `_ratio`.
        for (name, kind) in [
            ("odc_pulled_bytes_total", "counter"),
            ("odc_pushed_bytes_total", "counter"),
            ("odc_tokens_total", "counter"),
            ("odc_skipped_steps_total", "counter"),
            ("odc_micro_batches_total", "counter"),
            ("odc_pull_seconds", "summary"),
            ("odc_trainer_busy_seconds", "summary"),
            ("odc_trainer_idle_seconds", "summary"),
            ("odc_trainer_barrier_wait_seconds", "summary"),
            ("odc_trainer_pull_wait_seconds", "summary"),
            ("odc_step_seconds", "summary"),
            ("odc_trainer_tokens_per_second", "gauge"),
            ("odc_trainer_utilization_ratio", "gauge"),
            ("odc_tokens_per_second", "gauge"),
            ("odc_trainer_gathered_units", "gauge"),
            ("odc_step", "gauge"),
        ] {
            let declared = format!("# TYPE {name} {kind}");
            assert!(body.contains(&declared), "missing `{declared}` in\n{body}");
        }
        // The skipped step's 40 tokens were not trained on.
        assert!(body.contains("odc_tokens_total 80"), "{body}");
        assert!(body.contains("odc_skipped_steps_total 1"), "{body}");
        assert!(body.contains("odc_step 3"), "{body}");
        // Every trainer reports its own tokens per second, and the two add up to the job's.
        let value = |line_start: &str| -> f64 {
            body.lines()
                .find(|l| l.starts_with(line_start))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no `{line_start}` in\n{body}"))
        };
        let per_trainer = value("odc_trainer_tokens_per_second{trainer=\"0\"}")
            + value("odc_trainer_tokens_per_second{trainer=\"1\"}");
        let total = value("odc_tokens_per_second ");
        assert!(total > 0.0 && total.is_finite(), "{total}");
        assert!(
            (per_trainer - total).abs() <= 1e-6 * total,
            "per-trainer tokens/s {per_trainer} vs job {total}"
        );
        // No counter is exported as a gauge under a `_total` name.
        for line in body.lines().filter(|l| l.starts_with("# TYPE ")) {
            let mut parts = line.split(' ').skip(2);
            let (name, kind) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            if name.ends_with("_total") {
                assert_eq!(kind, "counter", "{line}");
            }
        }
        #[cfg(feature = "candle")]
        unit_pulls_follow_the_resharding_setting(addr).await;
    })
    .await
    .expect("test timed out");
}

/// `odc_unit_pulls_total` counts each unit gathered over the data plane: one transformer
/// micro-batch on one trainer pulls every unit once when it keeps them from forward to backward,
/// and every unit but the head's stage and the embedding twice when it reshards after forward
/// (the head's backward follows its forward at once; the embedding's backward reads no weights). Run after the endpoint test, in the same process (the recorder
/// is global), by differences of the counter.
#[cfg(feature = "candle")]
async fn unit_pulls_follow_the_resharding_setting(addr: SocketAddr) {
    use odc::compute::{transformer_job_on, Objective, Placement};
    use odc::model::{unit_count, ModelConfig, Reshard, Sample};
    let pulls = || async move {
        let body = tokio::task::spawn_blocking(move || scrape(addr))
            .await
            .unwrap();
        body.lines()
            .filter(|l| l.starts_with("odc_unit_pulls_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let config = ModelConfig::tiny();
    let units = unit_count(&config) as f64;
    for (reshard, per_micro_batch) in [
        (Reshard::Never, units),
        (Reshard::ALWAYS, 2.0 * units - 2.0),
        (Reshard::KeepLast(2), 2.0 * units - 3.0),
    ] {
        let sample = Sample::all_loss((0..40u32).map(|t| t % 200 + 3).collect());
        let store = move |_: u64| Ok(sample.clone());
        let mut job = transformer_job_on(
            &config,
            None,
            Arc::new(store),
            Objective::CrossEntropy,
            Placement {
                reshard,
                ..Placement::default()
            },
        )
        .unwrap()
        .trainers(1)
        .servers(1)
        .data(|_| Ok(vec![SampleMeta::new(0, 40)]))
        .build()
        .unwrap();
        let before = pulls().await;
        let stats = job.run(1).await.unwrap();
        job.shutdown().await;
        assert_eq!(stats[0].micro_batches, 1);
        let pulled = pulls().await - before;
        assert_eq!(
            pulled, per_micro_batch,
            "{reshard:?}: {pulled} unit pulls for {units} units"
        );
    }
}
