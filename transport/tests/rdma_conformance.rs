//! The conformance suite (contract C1–C7 and the handle rules) against the `rdma` backend over its
//! emulated NIC, one test per check: owner and reader are two `RdmaTransport`s joined only by
//! serialized handles; reads go one-sidedly (by address and rkey, through a queue-pair exchange
//! over the owner's control connection) out of the owner's registered memory under the seqlock
//! protocol, accumulates and sends cross the owner's TCP control connection. Everything but the
//! verbs calls runs; a real NIC is `RdmaTransport::new` (see `rdma_no_device.rs`).
#![cfg(feature = "rdma")]

use std::sync::Arc;

use odc_transport::conformance::Pair;
use odc_transport::rdma::{RdmaConfig, RdmaTransport};
use odc_transport::{ClusterSecret, RemoteConfig};

async fn make_pair() -> Pair {
    let config = RdmaConfig {
        // Small chunks, so reads span several seqlock chunks.
        chunk_bytes: 16 * 1024,
        remote: RemoteConfig {
            inbox_capacity: 64,
            ..RemoteConfig::default()
        },
        ..RdmaConfig::loopback(ClusterSecret::new("rdma-conformance").expect("secret"))
    };
    let owner = RdmaTransport::emulated(config.clone())
        .await
        .expect("owner");
    let reader = RdmaTransport::emulated(config).await.expect("reader");
    Pair {
        owner: Arc::new(owner),
        reader: Arc::new(reader),
    }
}

odc_transport::conformance_tests!(make_pair);
