//! The conformance suite (contract C1–C7 and the handle rules) against the `tcp` backend, one
//! test per check: owner and reader are two `TcpTransport`s on loopback, joined only by serialized
//! handles, every operation crossing a real socket after the handshake. (The same suite with the
//! owner in another process: `cross_process_conformance.rs`.)

use odc_transport::conformance::{remote_config, Pair};
use odc_transport::tcp::{TcpConfig, TcpTransport};
use odc_transport::{ClusterSecret, RemoteConfig};

async fn make_pair() -> Pair {
    let secret = ClusterSecret::new("tcp-conformance-secret").expect("secret");
    let config = TcpConfig {
        remote: RemoteConfig {
            // Small parts, so multi-part reads (and their version check) are exercised.
            read_part_bytes: 64 * 1024,
            ..remote_config()
        },
        ..TcpConfig::loopback(secret)
    };
    Pair::open_two(config, TcpTransport::bind).await
}

odc_transport::conformance_tests!(make_pair);

/// The whole suite once more with owner and reader the same instance: requests for a transport's
/// own regions go straight to its fabric (no socket), and must behave exactly the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_instance_run_all() {
    let pair = make_pair().await;
    let same = Pair {
        owner: pair.owner.clone(),
        reader: pair.owner,
    };
    let outcome = tokio::time::timeout(
        std::time::Duration::from_secs(600),
        odc_transport::conformance::run_all(same),
    )
    .await;
    assert!(outcome.is_ok(), "run_all on one instance timed out");
}
