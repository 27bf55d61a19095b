//! The conformance suite (contract C1–C7 and the handle rules) against the `shm` backend, one test
//! per check: owner and reader are two `ShmTransport`s of one job, joined only by serialized
//! handles; reads come one-sidedly out of the owner's segments in `/dev/shm`, accumulates and sends
//! cross the owner's Unix socket. (The same suite with the owner in another process:
//! `shm_process_conformance.rs`.)
#![cfg(target_os = "linux")]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use odc_transport::conformance::Pair;
use odc_transport::shm::{ShmConfig, ShmTransport};
use odc_transport::{ClusterSecret, RemoteConfig};

static NEXT: AtomicU32 = AtomicU32::new(0);

async fn make_pair() -> Pair {
    let job = format!(
        "shmconf{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let config = ShmConfig {
        // Small chunks, so reads span several seqlock chunks.
        chunk_bytes: 16 * 1024,
        remote: RemoteConfig {
            inbox_capacity: 64,
            ..RemoteConfig::default()
        },
        ..ShmConfig::new(
            job,
            ClusterSecret::new("shm-conformance-secret").expect("secret"),
        )
    };
    let owner = ShmTransport::new(config.clone()).await.expect("owner");
    let reader = ShmTransport::new(config).await.expect("reader");
    Pair {
        owner: Arc::new(owner),
        reader: Arc::new(reader),
    }
}

odc_transport::conformance_tests!(make_pair);
