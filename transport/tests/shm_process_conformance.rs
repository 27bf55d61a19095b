//! The conformance suite against the `shm` backend with the owner in **another process**: every
//! region lives in a child `odc-conformance-owner shm`; the reader here maps the child's segments
//! read-only (one-sided reads) and reaches its accumulators and inboxes over its Unix socket.
#![cfg(target_os = "linux")]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use odc_transport::conformance::remote_owner::RemoteOwner;
use odc_transport::conformance::Pair;
use odc_transport::shm::{ShmConfig, ShmTransport};
use odc_transport::ClusterSecret;

const SECRET: &str = "shm-process-conformance";
static NEXT: AtomicU32 = AtomicU32::new(0);

async fn make_pair() -> Pair {
    let job = format!(
        "shmproc{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_odc-conformance-owner"));
    command
        .arg("shm")
        .env("ODC_SECRET", SECRET)
        .env("ODC_JOB", &job);
    let owner = RemoteOwner::spawn(command, "shm");
    let reader = ShmTransport::new(ShmConfig::new(
        job,
        ClusterSecret::new(SECRET).expect("secret"),
    ))
    .await
    .expect("reader");
    Pair {
        owner: Arc::new(owner),
        reader: Arc::new(reader),
    }
}

odc_transport::conformance_tests!(make_pair);
