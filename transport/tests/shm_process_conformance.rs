//! The conformance suite against the `shm` backend with the owner in **another process**: every
//! region lives in a child `odc-conformance-owner shm`; the reader here maps the child's segments
//! read-only (one-sided reads) and reaches its accumulators and inboxes over its Unix socket.
#![cfg(target_os = "linux")]

use odc_transport::conformance::remote_owner::RemoteOwner;
use odc_transport::conformance::{unique_job, Pair};
use odc_transport::shm::{ShmConfig, ShmTransport};
use odc_transport::ClusterSecret;

const SECRET: &str = "shm-process-conformance";

async fn make_pair() -> Pair {
    let job = unique_job("shmproc");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_odc-conformance-owner"));
    command
        .arg("shm")
        .env("ODC_SECRET", SECRET)
        .env("ODC_JOB", &job);
    let owner = RemoteOwner::spawn(command, "shm");
    let secret = ClusterSecret::new(SECRET).expect("secret");
    let reader = ShmTransport::new(ShmConfig::new(job, secret))
        .await
        .expect("reader");
    Pair::new(owner, reader)
}

odc_transport::conformance_tests!(make_pair);
