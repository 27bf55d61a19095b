//! # odc-bench — the evidence for odc
//!
//! Everything that produces evidence and nothing that users embed: the on-demand vs collective A/B
//! harness ([`ab`]) and its collective baselines ([`baselines`]), the sequence-length workloads ([`workload`]), the measured cost of the
//! emulation itself ([`floor`]), the limits on user input ([`input`]) and the reports (table, JSON,
//! SVG; [`report`]), the transport pull benchmark with its owner processes ([`transport`]) and the cost of
//! running a job as several processes ([`processes`]), model checkpoints in Hugging Face layout
//! and what loading one costs ([`hf`]), and virtual time checked against wall time
//! ([`validate`]). The
//! `odc-bench` binary (`odc-bench ab …`, `odc-bench transport …`) drives them; the criterion
//! micro-benchmarks live in `benches/benches/`.
//!
//! The harness uses only `odc`'s public API (the [`odc::Job`] builder, [`odc::sim`],
//! [`odc::StepStats`]); it measures whatever the runtime does.

pub mod ab;
pub mod baselines;
pub mod calibrate;
pub mod floor;
pub mod gang;
pub mod hf;
pub mod input;
pub mod links;
pub mod memory;
pub mod processes;
pub mod report;
pub mod sft_overhead;
pub mod sim;
pub mod transport;
pub mod validate;
pub mod workload;

/// `err` and its chain of sources as one line, `outer: inner: …`, each message said once: a
/// source whose text an earlier message already contains (an error that prints its source as well
/// as returning it from [`std::error::Error::source`]) is left out.
///
/// ```
/// #[derive(Debug, thiserror::Error)]
/// #[error("reading x: {0}")]
/// struct Outer(#[source] std::io::Error);
/// let e = Outer(std::io::Error::other("disk on fire"));
/// assert_eq!(odc_bench::error_chain(&e), "reading x: disk on fire");
/// ```
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut said: Vec<String> = Vec::new();
    let mut next = Some(err);
    while let Some(e) = next {
        let text = e.to_string();
        if !text.is_empty() && !said.iter().any(|s| s.contains(&text)) {
            said.push(text);
        }
        next = e.source();
    }
    said.join(": ")
}

/// Test-only helpers shared by the crate's unit tests.
#[cfg(test)]
pub(crate) mod test_util {

    use crate::report::BenchRow;

    /// A runtime row of `workload` at `devices` whose on-demand side is `speedup` × the
    /// collective's 100 tokens/s (achievable bound 180 tokens/s, control 1.00).
    pub(crate) fn runtime_row(workload: &str, devices: usize, speedup: f64) -> BenchRow {
        BenchRow {
            workload: workload.into(),
            devices,
            minibatch_per_device: 4,
            dispatch: "dynamic".into(),
            baseline: "fsdp".into(),
            collective_tokens_per_s: 100.0,
            ondemand_tokens_per_s: 100.0 * speedup,
            speedup,
            collective_utilization: 0.5,
            ondemand_utilization: 0.9,
            bound_tokens_per_s: 200.0,
            achievable_bound_tokens_per_s: 180.0,
            ondemand_over_achievable: 100.0 * speedup / 180.0,
            control_speedup: Some(1.0),
            emulation_warning: None,
        }
    }

    pub(crate) use odc_policy::testing::temp_path;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("lengths file f.txt")]
    struct InFile(#[source] Inner);

    #[derive(Debug, thiserror::Error)]
    #[error("line 2: too long")]
    struct Inner;

    #[derive(Debug, thiserror::Error)]
    #[error("step 3 failed: {0}")]
    struct Repeats(#[source] Inner);

    #[test]
    fn error_chain_says_each_message_once() {
        assert_eq!(
            error_chain(&InFile(Inner)),
            "lengths file f.txt: line 2: too long"
        );
        assert_eq!(
            error_chain(&Repeats(Inner)),
            "step 3 failed: line 2: too long"
        );
        let any = anyhow::Error::new(Repeats(Inner)).context("running row 1");
        let text = error_chain(any.as_ref());
        assert_eq!(text, "running row 1: step 3 failed: line 2: too long");
        assert_eq!(text.matches("line 2").count(), 1);
    }
}
