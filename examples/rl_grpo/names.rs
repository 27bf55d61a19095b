//! The example's metrics (besides the runtime's `odc_*`), set after every RL step.

/// Mean reward of the step's responses.
pub const REWARD: &str = "odc_grpo_reward";
/// Fraction of the step's responses whose final number is right.
pub const ACCURACY: &str = "odc_grpo_accuracy_ratio";
/// Mean and longest response length of the step, in tokens.
pub const RESPONSE_TOKENS: &str = "odc_grpo_response_tokens";
pub const RESPONSE_TOKENS_MAX: &str = "odc_grpo_response_tokens_max";
/// KL to the reference per response token (k3) over the step's trained groups (NaN when
/// none was trained on).
pub const KL: &str = "odc_grpo_kl";
/// Response tokens sampled per second of the sampling phase.
pub const SAMPLING_TOKENS_PER_SECOND: &str = "odc_grpo_sampling_tokens_per_second";
/// Groups sampled, and those trained on (responses not all scored alike).
pub const GROUPS: &str = "odc_grpo_groups_total";
pub const GROUPS_TRAINED: &str = "odc_grpo_groups_trained_total";
/// Wall seconds of each stage of the last RL step on this rank, label `stage` (verl's
/// `timing_s/<stage>`): `gen` (reading the policy at the step's version, decoding), `reward`,
/// `ref` (reading the reference, its log-probs),
/// `gather` (waiting for the other ranks' groups) and `update_actor` (the odc step).
pub const TIMING: &str = "odc_grpo_timing_seconds";

pub fn describe() {
    use metrics::{describe_counter, describe_gauge};
    describe_gauge!(REWARD, "Mean reward of the last RL step's responses");
    describe_gauge!(
        ACCURACY,
        "Fraction of the last RL step's responses that are right"
    );
    describe_gauge!(
        RESPONSE_TOKENS,
        "Mean response length of the last RL step, in tokens"
    );
    describe_gauge!(
        RESPONSE_TOKENS_MAX,
        "Longest response of the last RL step, in tokens"
    );
    describe_gauge!(
        KL,
        "KL to the reference per response token (k3), trained groups"
    );
    describe_gauge!(
        SAMPLING_TOKENS_PER_SECOND,
        "Response tokens sampled per second in the last RL step"
    );
    describe_gauge!(
        TIMING,
        "Wall seconds of each stage of the last RL step (label stage)"
    );
    describe_counter!(GROUPS, "Groups of responses sampled");
    describe_counter!(GROUPS_TRAINED, "Groups trained on (their rewards differ)");
}
