//! Hosts the owner side of the transport conformance suite in its own process, so the suite runs
//! with owner and reader in different processes (`odc_transport::conformance::remote_owner`).
//!
//! Usage: `odc-conformance-owner tcp|shm|cuda` with `ODC_SECRET` (and, for `shm` and `cuda`,
//! `ODC_JOB`; for `cuda`, `ODC_CUDA_DEVICE`, default 0) in the environment; commands arrive on
//! stdin, one JSON object per line. `cuda` exists with the feature `cuda`.

use std::sync::Arc;

use odc_transport::conformance::remote_owner::serve_stdio;
use odc_transport::tcp::{TcpConfig, TcpTransport};
use odc_transport::{ClusterSecret, RemoteConfig, Transport};

/// Matches the in-process factories.
const INBOX_CAPACITY: usize = 64;

fn main() {
    let backend = std::env::args().nth(1).unwrap_or_default();
    let secret = match ClusterSecret::new(std::env::var("ODC_SECRET").unwrap_or_default()) {
        Ok(secret) => secret,
        Err(e) => {
            eprintln!("odc-conformance-owner: ODC_SECRET: {e}");
            std::process::exit(2);
        }
    };
    let remote = RemoteConfig {
        inbox_capacity: INBOX_CAPACITY,
        ..RemoteConfig::default()
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("odc-conformance-owner: no tokio runtime: {e}");
            std::process::exit(2);
        }
    };
    runtime.block_on(async move {
        let transport: Arc<dyn Transport> = match backend.as_str() {
            "tcp" => match TcpTransport::bind(TcpConfig {
                remote,
                ..TcpConfig::loopback(secret)
            })
            .await
            {
                Ok(transport) => Arc::new(transport),
                Err(e) => {
                    eprintln!("odc-conformance-owner: {e}");
                    std::process::exit(2);
                }
            },
            #[cfg(target_os = "linux")]
            "shm" => {
                let job = std::env::var("ODC_JOB").unwrap_or_default();
                let config = odc_transport::shm::ShmConfig {
                    chunk_bytes: 16 * 1024,
                    remote,
                    ..odc_transport::shm::ShmConfig::new(job, secret)
                };
                match odc_transport::shm::ShmTransport::new(config).await {
                    Ok(transport) => Arc::new(transport),
                    Err(e) => {
                        eprintln!("odc-conformance-owner: {e}");
                        std::process::exit(2);
                    }
                }
            }
            #[cfg(all(feature = "cuda-code", target_os = "linux"))]
            "cuda" => {
                let job = std::env::var("ODC_JOB").unwrap_or_default();
                let device = std::env::var("ODC_CUDA_DEVICE")
                    .ok()
                    .and_then(|d| d.parse().ok())
                    .unwrap_or(0);
                let config = odc_transport::cuda::CudaConfig {
                    remote,
                    ..odc_transport::cuda::CudaConfig::new(device, job, secret)
                };
                match odc_transport::cuda::CudaTransport::new(config).await {
                    Ok(transport) => Arc::new(transport),
                    Err(e) => {
                        eprintln!("odc-conformance-owner: {e}");
                        std::process::exit(2);
                    }
                }
            }
            other => {
                eprintln!("odc-conformance-owner: unknown backend {other:?} (tcp, shm, cuda)");
                std::process::exit(2);
            }
        };
        serve_stdio(transport).await;
    });
}
