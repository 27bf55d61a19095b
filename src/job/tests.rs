//! Every refusal of [`JobBuilder::build`], each an error naming what was wrong, made before
//! anything starts (no actor, no socket, no thread).

use std::sync::Arc;
use std::time::Duration;

use odc_actors::batch::{ComputeOutput, MicroBatch};
use odc_actors::layout::UnitSpec;
use odc_actors::policy::balancer::CostModel;
use odc_actors::policy::dispatch::Communication;
use odc_actors::policy::recovery::FailurePolicy;
use odc_actors::policy::schedule::LrSchedule;
use odc_actors::server::optimizer::OptimizerConfig;
use odc_actors::trainer::{Compute, TrainerContext};
use odc_transport::local::LocalTransport;

use super::*;
use crate::checkpoint::TrainState;
use crate::launch::{Roles, World, WorldSource};

struct Nothing;

#[async_trait::async_trait]
impl Compute for Nothing {
    async fn run(&mut self, _: &mut TrainerContext, _: &MicroBatch) -> Result<ComputeOutput> {
        Ok(ComputeOutput { loss_sum: 0.0 })
    }
}

/// A job that builds: one unit, one trainer, one server, a compute.
fn valid() -> JobBuilder {
    Job::builder()
        .unit(UnitSpec::constant("w", 4, 0.0))
        .compute(|_| Box::new(Nothing) as Box<dyn Compute>)
}

/// Rank 1 of a world of 2.
fn world(coordinator: Option<&str>) -> World {
    World {
        rank: 1,
        world_size: 2,
        coordinator: coordinator.map(str::to_string),
        source: WorldSource::Odc,
        secret: None,
        job: None,
        transport: None,
        bind: None,
        local_world_size: None,
        insecure_frames: false,
    }
}

/// The error `builder` is refused with, rendered; `names` says which case it is.
fn refused(builder: JobBuilder, names: &str) -> String {
    match builder.build() {
        Ok(_) => panic!("built, but should have been refused naming {names:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_valid_job_builds() {
    valid().build().expect("builds");
}

#[test]
fn every_refusal_names_what_was_wrong() {
    let zero = Duration::ZERO;
    let cases: Vec<(JobBuilder, &str)> = vec![
        (valid().trainers(0), "at least one trainer"),
        (valid().servers(0), "at least one shard server"),
        (valid().trainers(1 << 21), "at most"),
        (valid().step_timeout(zero), "step timeout"),
        (valid().parameters_timeout(zero), "parameters timeout"),
        (valid().join_timeout(zero), "join timeout"),
        (valid().micro_batch_timeout(zero), "micro-batch timeout"),
        (valid().transfer_timeout(zero), "transfer timeout"),
        (
            valid().heartbeat(Duration::from_secs(2), Duration::from_secs(1)),
            "heartbeat",
        ),
        (valid().chunk_elems(0), "chunk size"),
        (
            valid().relay_pushes(0),
            "relayed pushes: a node of 0 devices",
        ),
        (
            valid()
                .world(world(Some("127.0.0.1:29500")))
                .relay_pushes(0),
            "relayed pushes: a node of 0 devices",
        ),
        (valid().token_budget(0), "token budget"),
        (valid().micro_batch_min_fill(1.5), "fill floor"),
        (valid().clip_grad_norm(-1.0), "clip norm"),
        (valid().optimizer(OptimizerConfig::adamw(f32::NAN)), "lr"),
        (
            valid().cost_model(CostModel {
                a: -1.0,
                b: 1.0,
                scale: 1.0,
                transfer: 0.0,
            }),
            "a",
        ),
        (
            valid().lr_schedule(LrSchedule::WarmupCosine {
                warmup_steps: 10,
                total_steps: 5,
                min_ratio: 0.1,
            }),
            "warms up",
        ),
        (
            valid()
                .communication(Communication::Collective)
                .failure_policy(FailurePolicy::Drop),
            "collective mode needs every trainer",
        ),
        (
            Job::builder().unit(UnitSpec::constant("w", 4, 0.0)),
            "no compute",
        ),
        (
            valid().resume(TrainState {
                step: 3,
                params: vec![],
                optimizer: vec![],
            }),
            "the state to resume holds 0 units",
        ),
        (
            valid().resume(TrainState {
                step: 3,
                params: vec![vec![0.0; 5]],
                optimizer: vec![Default::default()],
            }),
            "has 4 elements, the state to resume has 5",
        ),
        (valid().world(world(None)), "coordinator's address"),
        (
            valid()
                .world(world(Some("127.0.0.1:29500")))
                .roles(Roles::explicit(vec![0], vec![3])),
            "trainer",
        ),
        (
            valid()
                .world(world(Some("127.0.0.1:29500")))
                .roles(Roles::explicit(vec![0, 1], vec![0, 1]))
                .trainers(3),
            "3 trainers asked for, but the roles place 2",
        ),
        (
            valid()
                .world(world(Some("127.0.0.1:29500")))
                .transport(Arc::new(LocalTransport::new())),
            "makes its transport from the world",
        ),
    ];
    for (builder, names) in cases {
        let message = refused(builder, names);
        assert!(message.contains(names), "{message:?} should name {names:?}");
    }
}

#[test]
fn relayed_pushes_place_slots_in_one_process_and_ranks_in_a_world() {
    let one = super::builder::relay_plan(None, 16, 2, 8).expect("plan");
    assert_eq!(one.server_nodes, vec![0, 1]);
    assert_eq!(one.trainer_node(9), Some(1));
    // Ranks 0–3 on host 0, 4–7 on host 1; servers on ranks 1 and 6, trainers on 0, 5 and 7.
    let roles = Roles::explicit(vec![1, 6], vec![0, 5, 7]);
    let world = super::builder::relay_plan(Some(&roles), 3, 2, 4).expect("plan");
    assert_eq!(world.server_nodes, vec![0, 1]);
    assert_eq!(world.trainer_nodes, vec![0, 1, 1]);
    assert_eq!(
        world.relay(0, 1),
        Some(0),
        "host 0 relays server 1's shards on server 0"
    );
}

#[test]
fn pushes_are_relayed_by_default_only_where_the_world_spans_hosts() {
    use super::builder::Pushes;
    let spanning = World {
        world_size: 4,
        local_world_size: Some(2),
        ..world(Some("127.0.0.1:29500"))
    };
    assert_eq!(Pushes::Auto.node_size(Some(&spanning)), Some(2));
    assert_eq!(Pushes::Direct.node_size(Some(&spanning)), None);
    assert_eq!(Pushes::Relayed(4).node_size(Some(&spanning)), Some(4));
    let one_host = World {
        local_world_size: Some(4),
        ..spanning.clone()
    };
    assert_eq!(Pushes::Auto.node_size(Some(&one_host)), None, "one host");
    let one_a_host = World {
        local_world_size: Some(1),
        ..spanning.clone()
    };
    assert_eq!(Pushes::Auto.node_size(Some(&one_a_host)), None, "1 a host");
    assert_eq!(Pushes::Relayed(1).node_size(Some(&one_a_host)), Some(1));
    let unknown = World {
        local_world_size: None,
        ..spanning.clone()
    };
    assert_eq!(
        Pushes::Auto.node_size(Some(&unknown)),
        None,
        "hosts unknown"
    );
    let cuda = World {
        transport: Some("cuda".into()),
        ..spanning.clone()
    };
    assert_eq!(Pushes::Auto.node_size(Some(&cuda)), None, "cuda: one host");
    assert_eq!(Pushes::Auto.node_size(None), None, "one process");
    // The built job's plan: ranks 0-1 on host 0, 2-3 on host 1, a server on each rank.
    let job = valid().world(spanning.clone()).build().expect("builds");
    let relay = job.setup.as_ref().and_then(|s| s.spec.relay.clone());
    assert_eq!(
        relay.map(|r| r.server_nodes),
        Some(vec![0, 0, 1, 1]),
        "relayed by default"
    );
    let direct = valid()
        .world(spanning)
        .direct_pushes()
        .build()
        .expect("builds");
    assert_eq!(
        direct.setup.as_ref().and_then(|s| s.spec.relay.clone()),
        None
    );
}
