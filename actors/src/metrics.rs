//! Metric names (all `odc_*`), recorded through the `metrics` facade. Nothing is exported unless a
//! recorder is installed (the `odc` crate's Prometheus endpoint does that).

/// Bytes read from published regions, label `transport`.
pub const BYTES_PULLED: &str = "odc_bytes_pulled_total";
/// Bytes of gradient accumulated at owners (acknowledged), label `transport`.
pub const BYTES_PUSHED: &str = "odc_bytes_pushed_total";
/// Latency of pulling one whole unit (all shards, all chunks), seconds, label `transport`.
pub const PULL_SECONDS: &str = "odc_pull_seconds";
/// Gathered units held by a trainer (resident plus prefetching), label `trainer`.
pub const GATHERED_UNITS: &str = "odc_trainer_gathered_units";
/// Seconds a trainer spent in compute (its micro-batches), label `trainer`.
pub const TRAINER_BUSY: &str = "odc_trainer_busy_seconds_total";
/// Seconds a trainer was idle within steps (waiting for work or for the barrier), label `trainer`.
pub const TRAINER_IDLE: &str = "odc_trainer_idle_seconds_total";
/// Seconds from a trainer's last micro-batch of a step to the end of the barrier, label `trainer`.
pub const TRAINER_BARRIER_WAIT: &str = "odc_trainer_barrier_wait_seconds_total";
/// Seconds the compute was blocked in `gather`, label `trainer`.
pub const TRAINER_PULL_WAIT: &str = "odc_trainer_pull_wait_seconds_total";
/// Tokens trained on (completed steps).
pub const TOKENS: &str = "odc_tokens_total";
/// Current parameter version (optimizer steps applied).
pub const STEP: &str = "odc_step";
/// Micro-batches completed, label `trainer`.
pub const MICRO_BATCHES: &str = "odc_micro_batches_total";
/// Minibatch replays after a trainer failure.
pub const REPLAYS: &str = "odc_replays_total";
/// Trainer failures seen by the supervisor.
pub const TRAINER_FAILURES: &str = "odc_trainer_failures_total";
/// Wall time of a whole step (plan, compute, barrier), seconds.
pub const STEP_SECONDS: &str = "odc_step_seconds";
/// Mean loss of the last step.
pub const LOSS: &str = "odc_loss";

/// Register descriptions and units with the installed recorder.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        BYTES_PULLED,
        Unit::Bytes,
        "Bytes read from published parameter regions"
    );
    describe_counter!(
        BYTES_PUSHED,
        Unit::Bytes,
        "Gradient bytes accumulated at owners"
    );
    describe_histogram!(PULL_SECONDS, Unit::Seconds, "Latency of pulling one unit");
    describe_gauge!(GATHERED_UNITS, "Gathered units a trainer holds");
    describe_counter!(TRAINER_BUSY, Unit::Seconds, "Trainer compute time");
    describe_counter!(
        TRAINER_IDLE,
        Unit::Seconds,
        "Trainer idle time within steps"
    );
    describe_counter!(
        TRAINER_BARRIER_WAIT,
        Unit::Seconds,
        "Trainer wait at the barrier"
    );
    describe_counter!(
        TRAINER_PULL_WAIT,
        Unit::Seconds,
        "Compute time blocked on pulls"
    );
    describe_counter!(TOKENS, "Tokens trained on");
    describe_gauge!(STEP, "Optimizer steps applied");
    describe_counter!(MICRO_BATCHES, "Micro-batches completed");
    describe_counter!(REPLAYS, "Minibatch replays after failures");
    describe_counter!(TRAINER_FAILURES, "Trainer failures");
    describe_histogram!(STEP_SECONDS, Unit::Seconds, "Wall time per step");
    describe_gauge!(LOSS, "Mean loss of the last step");
}
