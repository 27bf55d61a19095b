//! Without an RDMA device, `RdmaTransport::new` fails cleanly: `Unsupported`, with a message that
//! starts `no RDMA device:` and says which case it is (rdma-core not installed, no kernel RDMA
//! stack, or no NIC). On a host that has a device the test says so and checks nothing.
#![cfg(feature = "rdma")]

use odc_transport::rdma::{RdmaConfig, RdmaTransport};
use odc_transport::{ClusterSecret, TransportError};

/// Whether this host shows an RDMA device to the kernel.
fn host_has_rdma_device() -> bool {
    std::fs::read_dir("/sys/class/infiniband")
        .map(|mut entries| entries.next().is_some())
        .unwrap_or(false)
}

#[tokio::test]
async fn new_without_a_device_is_a_clear_unsupported_error() {
    let secret = ClusterSecret::new("rdma-no-device-secret").expect("secret");
    let result = RdmaTransport::new(RdmaConfig::loopback(secret)).await;
    if host_has_rdma_device() {
        eprintln!(
            "skipped: this host has an RDMA device (/sys/class/infiniband is not empty); \
             RdmaTransport::new gave {:?}",
            result.as_ref().map(|t| t.addr().to_owned())
        );
        return;
    }
    match result {
        Ok(transport) => {
            panic!("RdmaTransport::new succeeded without an RDMA device: {transport:?}")
        }
        Err(TransportError::Unsupported { what }) => {
            assert!(
                what.starts_with("no RDMA device: "),
                "the error does not say `no RDMA device`: {what}"
            );
            let cases = ["EOPNOTSUPP", "ENOSYS", "empty list"];
            assert!(
                cases.iter().any(|case| what.contains(case)),
                "the error names none of the cases {cases:?}: {what}"
            );
            eprintln!("RdmaTransport::new without a device: {what}");
        }
        Err(other) => panic!("expected Unsupported(no RDMA device), got {other:?}"),
    }
}

#[tokio::test]
async fn a_named_device_that_is_absent_is_the_same_error() {
    if host_has_rdma_device() {
        eprintln!("skipped: this host has an RDMA device");
        return;
    }
    let config = RdmaConfig {
        device: Some("mlx5_9".into()),
        ..RdmaConfig::loopback(ClusterSecret::new("rdma-no-device-secret").expect("secret"))
    };
    match RdmaTransport::new(config).await {
        Err(TransportError::Unsupported { what }) => {
            assert!(what.starts_with("no RDMA device: "), "{what}")
        }
        other => panic!(
            "expected Unsupported(no RDMA device), got {:?}",
            other.map(|t| t.addr().to_owned())
        ),
    }
}
