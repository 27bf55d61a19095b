//! A gang's K/V ring in the simulated device: its members pay what the planner priced
//! (`odc::sim::SimDevice::ring`, the job's `RingPrice`), waiting without computing. Run in
//! virtual time, so the step's length is exact.

use std::sync::Arc;

use odc::sim::clock::{on_virtual_runtime, VirtualClock};
use odc::sim::{Pace, SimDevice};
use odc::{Job, OptimizerConfig, RingPrice, SampleMeta, SpanKind, SplitPolicy, StepStats};

use crate::within;

/// A ring over nodes of one trainer (every gang crosses them), 2 attention layers, 10 ms of
/// launches a step and a link that takes 1 s a megabyte (a cost unit is a second here).
fn ring() -> RingPrice {
    let link = odc::Link {
        bytes_per_s: 1e6,
        latency_s: 0.0,
    };
    RingPrice {
        layers: 2,
        kv_bytes_per_token: 100,
        intra: link,
        inter: link,
        node_size: 1,
        step_s: 0.01,
        step_per_token_s: 0.0,
    }
}

/// One step of one 65,536-token sample over 2 trainers whose budget holds only half of it (so it
/// runs split over both), the ring priced and paid as `ring` says.
async fn split_step(ring: Option<RingPrice>) -> (StepStats, f64) {
    let device = Arc::new(SimDevice {
        units: 2,
        unit_elems: 256,
        seconds_per_cost: 1.0,
        pace: Pace::Virtual,
        ring,
        ..SimDevice::default()
    });
    let mut job = Job::builder()
        .units(device.layout())
        .trainers(2)
        .servers(1)
        .sequence_parallel(SplitPolicy::Auto)
        .token_budget(40_000)
        .ring_price(ring.unwrap_or_else(RingPrice::free))
        .optimizer(OptimizerConfig::sgd(0.0))
        .compute(device.factory())
        .clock(Arc::new(VirtualClock::new()))
        .build()
        .expect("job");
    let stats = job
        .step_with(vec![SampleMeta::new(0, 65_536)])
        .await
        .expect("step");
    job.shutdown().await;
    let piece = stats
        .micro_batch_log
        .iter()
        .find_map(|r| r.pieces.first().cloned())
        .expect("the sample ran split");
    (stats, device.ring_seconds(&piece))
}

/// Modelled compute seconds the step recorded, all trainers.
fn busy(stats: &StepStats) -> f64 {
    let spans = stats.micro_batch_log.iter().flat_map(|r| &r.spans);
    spans
        .filter(|s| s.kind == SpanKind::Compute)
        .map(|s| s.end.saturating_duration_since(s.start).as_secs_f64())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gangs_members_pay_the_priced_ring_beside_their_compute() {
    within(120, async {
        let (free, none) = on_virtual_runtime(|| split_step(None)).await.unwrap();
        let (priced, paid) = on_virtual_runtime(|| split_step(Some(ring())))
            .await
            .unwrap();
        assert_eq!(none, 0.0, "no ring price, nothing paid");
        // 32,768 tokens a member: a hop of 3.3 s, one step a layer (2 members) paying 3 hops
        // (forward's, backward's two), 2 layers, and the launches; attention hides part of it.
        assert!(paid > 5.0 && paid < 2.0 * 3.0 * 3.3 + 0.1, "{paid}");
        let longer = priced.wall.as_secs_f64() - free.wall.as_secs_f64();
        eprintln!("ring {paid:.3} s a member, step {longer:.3} s longer");
        assert!(
            (longer - paid).abs() < 0.01,
            "the step grew by {longer} s, the ring costs each member {paid} s"
        );
        assert!(
            // The timer's 1 ms ticks, over 8 compute spans a member.
            (busy(&priced) - busy(&free)).abs() < 0.02,
            "the ring is no compute: busy {} s against {} s",
            busy(&priced),
            busy(&free)
        );
    })
    .await
}
