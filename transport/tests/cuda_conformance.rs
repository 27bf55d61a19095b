//! The conformance suite (contract C1–C7 and the handle rules) against the `cuda` backend, one
//! test per check, owner and reader two `CudaTransport`s of this process on device 0 joined only
//! by serialized handles (a reader in the owner's process reads the device memory directly; CUDA
//! IPC across processes: `cuda_process_conformance.rs`). Plus the checks that need device memory
//! of the reader's (`cuda_common`). Without a CUDA driver every test prints why and passes.
#![cfg(all(feature = "cuda", target_os = "linux"))]

mod cuda_common;

use std::sync::Arc;

use odc_transport::conformance::{remote_config, unique_job, Pair};
use odc_transport::cuda::{CudaConfig, CudaTransport};
use odc_transport::{ClusterSecret, TransportError};

use cuda_common::no_cuda;

async fn transports() -> (CudaTransport, CudaTransport) {
    let secret = ClusterSecret::new("cuda-conformance-secret").expect("secret");
    let config = CudaConfig {
        remote: remote_config(),
        ..CudaConfig::new(0, unique_job("cudaconf"), secret)
    };
    let owner = CudaTransport::new(config.clone()).await.expect("owner");
    let reader = CudaTransport::new(config).await.expect("reader");
    (owner, reader)
}

async fn make_pair() -> Pair {
    let (owner, reader) = transports().await;
    Pair::new(owner, reader)
}

odc_transport::conformance_tests!(make_pair, unless = no_cuda);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_destination_reads_c1() {
    if cuda_common::skipped() {
        return;
    }
    let (owner, reader) = transports().await;
    let device = Arc::clone(reader.device());
    let pair = Pair::new(owner, reader);
    cuda_common::device_destination_reads_c1(&pair, &device).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_larger_than_the_staging_c2() {
    if cuda_common::skipped() {
        return;
    }
    cuda_common::transfers_larger_than_the_staging_c2(&make_pair().await).await;
}

/// Without a driver, the transport is a clear `Unsupported` error naming it, not a panic (on a
/// machine with a driver: skipped).
#[tokio::test]
async fn new_without_a_driver_is_a_clear_error() {
    if no_cuda().is_none() {
        eprintln!("not applicable: this machine has a CUDA driver");
        return;
    }
    let config = CudaConfig::new(
        0,
        "cudanodriver",
        ClusterSecret::new("cuda-conformance-secret").expect("secret"),
    );
    match CudaTransport::new(config).await {
        Err(TransportError::Unsupported { what }) => {
            assert!(what.starts_with("no CUDA driver: "), "{what}");
            eprintln!("CudaTransport::new without a driver: {what}");
        }
        Err(other) => panic!("expected Unsupported(no CUDA driver), got {other:?}"),
        Ok(transport) => panic!("CudaTransport::new succeeded without a driver: {transport:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_pushes_between_transports_of_one_process_c2_c3() {
    if cuda_common::skipped() {
        return;
    }
    let (owner, reader) = transports().await;
    let reader = Arc::new(reader);
    let pair = Pair {
        owner: Arc::new(owner),
        reader: Arc::clone(&reader) as Arc<dyn odc_transport::Transport>,
    };
    cuda_common::device_pushes_c2_c3(&pair, &reader).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_messages_between_transports_of_one_process_c7() {
    if cuda_common::skipped() {
        return;
    }
    let (owner, reader) = transports().await;
    cuda_common::device_messages_c7(&owner, &reader).await;
}
