//! The conformance suite (contract C1–C7 and the handle rules) against the `shm` backend, one test
//! per check: owner and reader are two `ShmTransport`s of one job, joined only by serialized
//! handles; reads come one-sidedly out of the owner's segments in `/dev/shm`, accumulates and sends
//! cross the owner's Unix socket. (The same suite with the owner in another process:
//! `shm_process_conformance.rs`.)
#![cfg(target_os = "linux")]

use odc_transport::conformance::{remote_config, unique_job, Pair};
use odc_transport::shm::{ShmConfig, ShmTransport};
use odc_transport::ClusterSecret;

async fn make_pair() -> Pair {
    let secret = ClusterSecret::new("shm-conformance-secret").expect("secret");
    let config = ShmConfig {
        // Small chunks, so reads span several seqlock chunks.
        chunk_bytes: 16 * 1024,
        remote: remote_config(),
        ..ShmConfig::new(unique_job("shmconf"), secret)
    };
    Pair::open_two(config, ShmTransport::new).await
}

odc_transport::conformance_tests!(make_pair);
