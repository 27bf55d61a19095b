//! Metric names (all `odc_*`, Prometheus conventions: base units, `_total` for counters, `_seconds`,
//! `_bytes`, `_ratio`), recorded through the `metrics` facade, and the cached handles the hot paths
//! use (no label string is built per gather or push). Nothing is exported unless a recorder is
//! installed (the `odc` crate's Prometheus endpoint does that) before the job starts: handles
//! taken earlier record into nothing.
//!
//! Time spent per trainer is a histogram (`_seconds`): its `_sum` is the total, its `_count` the
//! number of micro-batches or steps, so `rate(odc_trainer_busy_seconds_sum[1m])` is the busy
//! fraction.

use std::time::Duration;

use metrics::{Counter, Gauge, Histogram};

/// Bytes read from published regions (demand gathers and prefetches), label `transport`.
pub const PULLED_BYTES: &str = "odc_pulled_bytes_total";
/// Gradient bytes acknowledged by their receivers, label `transport`.
pub const PUSHED_BYTES: &str = "odc_pushed_bytes_total";
/// Gradient bytes shard servers' relays flushed to owners on other nodes (relayed pushes).
pub const RELAY_FLUSHED_BYTES: &str = "odc_relay_flushed_bytes_total";
/// Relays flushed before the barrier, as soon as their node's writes were all in (static plans).
pub const RELAY_EARLY_FLUSHES: &str = "odc_relay_early_flushes_total";
/// Latency of gathering one whole unit (all shards, all chunks), label `transport`.
pub const PULL_SECONDS: &str = "odc_pull_seconds";
/// Units gathered over the data plane (demand pulls and prefetches, not a unit served from the
/// trainer's memory), label `transport`: with resharding after forward a released unit is
/// gathered twice per micro-batch (forward and backward), as FSDP all-gathers twice.
pub const UNIT_PULLS: &str = "odc_unit_pulls_total";
/// Gathered units a trainer holds (resident plus prefetching), label `trainer`.
pub const GATHERED_UNITS: &str = "odc_trainer_gathered_units";
/// Compute seconds per micro-batch (pushes acknowledged included), label `trainer`.
pub const TRAINER_BUSY: &str = "odc_trainer_busy_seconds";
/// Seconds a trainer was idle per step (waiting for work or for the barrier), label `trainer`.
pub const TRAINER_IDLE: &str = "odc_trainer_idle_seconds";
/// Seconds from a trainer's last micro-batch of a step to the end of the barrier, label `trainer`.
pub const TRAINER_BARRIER_WAIT: &str = "odc_trainer_barrier_wait_seconds";
/// Seconds the compute was blocked in `gather`, per micro-batch, label `trainer`.
pub const TRAINER_PULL_WAIT: &str = "odc_trainer_pull_wait_seconds";
/// Tokens a trainer trained on in the last step divided by the step's wall time, label `trainer`.
pub const TRAINER_TOKENS_PER_SECOND: &str = "odc_trainer_tokens_per_second";
/// Busy seconds over wall seconds of the last step, label `trainer`.
pub const TRAINER_UTILIZATION: &str = "odc_trainer_utilization_ratio";
/// Micro-batches completed, label `trainer`.
pub const MICRO_BATCHES: &str = "odc_micro_batches_total";
/// Tokens trained on (completed steps).
pub const TOKENS: &str = "odc_tokens_total";
/// Tokens of the last step divided by its wall time.
pub const TOKENS_PER_SECOND: &str = "odc_tokens_per_second";
/// Current parameter version (optimizer steps applied).
pub const STEP: &str = "odc_step";
/// The model's parameters, label `kind`: `trainable` or `frozen` (units pulled and never pushed or
/// optimised, [`UnitSpec::frozen`](crate::layout::UnitSpec::frozen)).
pub const PARAMETERS: &str = "odc_parameters";
/// Wall time of a whole step (plan, compute, barrier).
pub const STEP_SECONDS: &str = "odc_step_seconds";
/// Mean loss of the last step.
pub const LOSS: &str = "odc_loss";
/// Minibatch replays after a trainer failure.
pub const REPLAYS: &str = "odc_replays_total";
/// Counter: samples split over a gang of trainers (sequence splitting).
pub const SPLIT_SAMPLES: &str = "odc_split_samples_total";
/// Histogram: members of each gang.
pub const GANG_SIZE: &str = "odc_gang_size";
/// Steps skipped for a non-finite gradient, loss or global norm (`NonFinite::SkipStep`).
pub const SKIPPED_STEPS: &str = "odc_skipped_steps_total";
/// Trainer failures seen by the supervisor.
pub const TRAINER_FAILURES: &str = "odc_trainer_failures_total";
/// Work moved between trainers at run time (micro-batches stolen by an idle trainer).
pub const REBALANCES: &str = "odc_rebalances_total";
/// Connections closed at once because a listener already held its maximum of connections still
/// in the handshake, label `listener` (`control`, or the data plane's backend).
pub const UNAUTHENTICATED_REFUSED: &str = odc_transport::wire::gate::REFUSED_METRIC;
/// Ranks treated as lost because they answered no heartbeat within the timeout (coordinator).
pub const SILENT_RANKS: &str = "odc_silent_ranks_total";
/// Trainer reports the supervisor dropped (a wrong token, a trainer not running that
/// micro-batch, a duplicate), label `reason` ([`ReportRefusal::label`](crate::policy::step::ReportRefusal::label)).
pub const REFUSED_REPORTS: &str = "odc_refused_reports_total";
/// Gradient writes a shard server refused because their token is not the one of the
/// (epoch, micro-batch) they name (counted by the transport at the owner, C8).
pub const REFUSED_WRITES: &str = odc_transport::REFUSED_WRITES_METRIC;

/// Register descriptions and units with the installed recorder.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        PULLED_BYTES,
        Unit::Bytes,
        "Bytes read from published parameter regions"
    );
    describe_counter!(
        PUSHED_BYTES,
        Unit::Bytes,
        "Gradient bytes acknowledged by their receivers"
    );
    describe_histogram!(PULL_SECONDS, Unit::Seconds, "Latency of gathering one unit");
    describe_counter!(UNIT_PULLS, "Units gathered over the data plane");
    describe_gauge!(GATHERED_UNITS, "Gathered units a trainer holds");
    describe_histogram!(TRAINER_BUSY, Unit::Seconds, "Compute time per micro-batch");
    describe_histogram!(TRAINER_IDLE, Unit::Seconds, "Idle time per step");
    describe_histogram!(
        TRAINER_BARRIER_WAIT,
        Unit::Seconds,
        "Wait at the barrier per step"
    );
    describe_histogram!(
        TRAINER_PULL_WAIT,
        Unit::Seconds,
        "Compute time blocked on gathers per micro-batch"
    );
    describe_gauge!(
        TRAINER_TOKENS_PER_SECOND,
        "Tokens per second of one trainer in the last step"
    );
    describe_gauge!(
        TRAINER_UTILIZATION,
        "Busy fraction of one trainer in the last step"
    );
    describe_counter!(MICRO_BATCHES, "Micro-batches completed");
    describe_counter!(TOKENS, "Tokens trained on");
    describe_gauge!(TOKENS_PER_SECOND, "Tokens per second of the last step");
    describe_gauge!(STEP, "Optimizer steps applied");
    describe_gauge!(
        PARAMETERS,
        "Parameters of the model, trainable or frozen (pulled, never pushed or optimised)"
    );
    describe_histogram!(STEP_SECONDS, Unit::Seconds, "Wall time per step");
    describe_gauge!(LOSS, "Mean loss of the last step");
    describe_counter!(REPLAYS, "Minibatch replays after failures");
    describe_counter!(
        SPLIT_SAMPLES,
        "Samples split over a gang of trainers (sequence splitting)"
    );
    describe_histogram!(GANG_SIZE, "Trainers per gang of a split sample");
    describe_counter!(
        SKIPPED_STEPS,
        "Steps skipped for non-finite gradients or losses (gradients discarded)"
    );
    describe_counter!(TRAINER_FAILURES, "Trainer failures");
    describe_counter!(
        REBALANCES,
        "Micro-batches moved between trainers at run time"
    );
    describe_counter!(
        UNAUTHENTICATED_REFUSED,
        "Connections closed at once: too many already in the handshake"
    );
    describe_counter!(
        SILENT_RANKS,
        "Ranks lost because they answered no heartbeat in time"
    );
    describe_counter!(
        REFUSED_REPORTS,
        "Trainer reports dropped: not the assignment's token or trainer, or a duplicate"
    );
    describe_counter!(
        REFUSED_WRITES,
        "Gradient writes refused by their owner: not the assignment's token"
    );
}

/// Cached handles of one data path's transfer metrics.
#[derive(Clone)]
pub struct TransferMetrics {
    pulled: Counter,
    unit_pulls: Counter,
    pushed: Counter,
    pull_seconds: Histogram,
}

impl TransferMetrics {
    pub fn new(transport: &'static str) -> Self {
        TransferMetrics {
            pulled: metrics::counter!(PULLED_BYTES, "transport" => transport),
            unit_pulls: metrics::counter!(UNIT_PULLS, "transport" => transport),
            pushed: metrics::counter!(PUSHED_BYTES, "transport" => transport),
            pull_seconds: metrics::histogram!(PULL_SECONDS, "transport" => transport),
        }
    }

    /// A unit of `bytes` was gathered in `took`.
    pub fn pulled(&self, bytes: u64, took: Duration) {
        self.pulled.increment(bytes);
        self.unit_pulls.increment(1);
        self.pull_seconds.record(took.as_secs_f64());
    }

    /// `bytes` of gradient were acknowledged.
    pub fn pushed(&self, bytes: u64) {
        self.pushed.increment(bytes);
    }
}

/// Cached handles of one trainer slot's metrics (the supervisor records them).
#[derive(Clone)]
pub struct TrainerMetrics {
    pub busy: Histogram,
    pub idle: Histogram,
    pub barrier_wait: Histogram,
    pub pull_wait: Histogram,
    pub tokens_per_second: Gauge,
    pub utilization: Gauge,
    pub micro_batches: Counter,
}

impl TrainerMetrics {
    pub fn new(trainer: u32) -> Self {
        let label = trainer.to_string();
        TrainerMetrics {
            busy: metrics::histogram!(TRAINER_BUSY, "trainer" => label.clone()),
            idle: metrics::histogram!(TRAINER_IDLE, "trainer" => label.clone()),
            barrier_wait: metrics::histogram!(TRAINER_BARRIER_WAIT, "trainer" => label.clone()),
            pull_wait: metrics::histogram!(TRAINER_PULL_WAIT, "trainer" => label.clone()),
            tokens_per_second: metrics::gauge!(TRAINER_TOKENS_PER_SECOND, "trainer" => label.clone()),
            utilization: metrics::gauge!(TRAINER_UTILIZATION, "trainer" => label.clone()),
            micro_batches: metrics::counter!(MICRO_BATCHES, "trainer" => label),
        }
    }
}
