//! The conformance suite (contract C1–C7 and the handle rules) against the `rdma` backend over its
//! emulated NIC, one test per check: owner and reader are two `RdmaTransport`s joined only by
//! serialized handles; reads go one-sidedly (by address and rkey, through a queue-pair exchange
//! over the owner's control connection) out of the owner's registered memory under the seqlock
//! protocol, accumulates and sends cross the owner's TCP control connection. Everything but the
//! verbs calls runs; a real NIC is `RdmaTransport::new` (see `rdma_no_device.rs`).
#![cfg(feature = "rdma")]

use odc_transport::conformance::{remote_config, Pair};
use odc_transport::rdma::{RdmaConfig, RdmaTransport};
use odc_transport::ClusterSecret;

async fn make_pair() -> Pair {
    let config = RdmaConfig {
        // Small chunks, so reads span several seqlock chunks.
        chunk_bytes: 16 * 1024,
        remote: remote_config(),
        ..RdmaConfig::loopback(ClusterSecret::new("rdma-conformance").expect("secret"))
    };
    Pair::open_two(config, RdmaTransport::emulated).await
}

odc_transport::conformance_tests!(make_pair);
