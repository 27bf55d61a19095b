//! The conformance suite against the `cuda` backend with the owner in **another process** on the
//! same GPU: every region lives in a child `odc-conformance-owner cuda` (device 0); the reader
//! here opens the child's device allocations through CUDA IPC and copies device to device (or
//! through pinned staging into host memory), and reaches its accumulators and inboxes over its
//! Unix socket. Plus the device-destination and large-transfer checks (`cuda_common`) across the
//! process boundary, and pushes from the reader's device memory over CUDA IPC
//! (`device_pushes_over_ipc_c2_c3`). Without a CUDA driver every test prints why and passes.
#![cfg(all(feature = "cuda", target_os = "linux"))]

mod cuda_common;

use std::sync::Arc;

use odc_transport::conformance::remote_owner::RemoteOwner;
use odc_transport::conformance::{unique_job, Pair};
use odc_transport::cuda::{CudaConfig, CudaTransport};
use odc_transport::ClusterSecret;

use cuda_common::no_cuda;

const SECRET: &str = "cuda-process-conformance";

async fn pair_and_reader() -> (Pair, Arc<CudaTransport>) {
    let job = unique_job("cudaproc");
    // `ODC_CONFORMANCE_OWNER` names the owner binary where this test runs away from its build
    // tree (`benches/gpu/run.sh` on a GPU machine); cargo's path otherwise.
    let owner_exe = std::env::var_os("ODC_CONFORMANCE_OWNER")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_odc-conformance-owner").into());
    let mut command = std::process::Command::new(owner_exe);
    command
        .arg("cuda")
        .env("ODC_SECRET", SECRET)
        .env("ODC_JOB", &job);
    let owner = RemoteOwner::spawn(command, "cuda");
    let reader = Arc::new(
        CudaTransport::new(CudaConfig::new(
            0,
            job,
            ClusterSecret::new(SECRET).expect("secret"),
        ))
        .await
        .expect("reader"),
    );
    let pair = Pair {
        owner: Arc::new(owner),
        reader: Arc::clone(&reader) as Arc<dyn odc_transport::Transport>,
    };
    (pair, reader)
}

async fn make_pair() -> Pair {
    pair_and_reader().await.0
}

odc_transport::conformance_tests!(make_pair, unless = no_cuda);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_destination_reads_over_ipc_c1() {
    if cuda_common::skipped() {
        return;
    }
    let (pair, reader) = pair_and_reader().await;
    cuda_common::device_destination_reads_c1(&pair, reader.device()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_larger_than_the_staging_over_ipc_c2() {
    if cuda_common::skipped() {
        return;
    }
    cuda_common::transfers_larger_than_the_staging_c2(&make_pair().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_pushes_over_ipc_c2_c3() {
    if cuda_common::skipped() {
        return;
    }
    let (pair, reader) = pair_and_reader().await;
    cuda_common::device_pushes_c2_c3(&pair, &reader).await;
}
