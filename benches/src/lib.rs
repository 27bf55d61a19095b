//! # odc-bench — the evidence for odc
//!
//! Everything that produces evidence and nothing that users embed: the on-demand vs collective A/B
//! harness ([`ab`]), the sequence-length workloads ([`workload`]) and the reports (table, JSON,
//! SVG; [`report`]). The `odc-bench` binary (`odc-bench ab …`) drives them; the criterion
//! micro-benchmarks live in `benches/benches/`.
//!
//! The harness uses only `odc`'s public API (the [`odc::Job`] builder, [`odc::sim`],
//! [`odc::StepStats`]); it measures whatever the runtime does.

pub mod ab;
pub mod report;
pub mod workload;

/// Test-only helpers shared by the crate's unit tests.
#[cfg(test)]
pub(crate) mod test_util {
    use std::path::PathBuf;

    /// A path in the temporary directory unique to this process, call and `name`.
    pub(crate) fn temp_path(prefix: &str, name: &str) -> PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        std::env::temp_dir().join(format!("{prefix}-{}-{nanos}-{name}", std::process::id()))
    }
}
