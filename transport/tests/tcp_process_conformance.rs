//! The conformance suite against the `tcp` backend with the owner in **another process**: every
//! region lives in a child `odc-conformance-owner tcp`; the reader here reaches it through
//! serialized handles over loopback TCP, after the handshake on the shared secret.

use odc_transport::conformance::remote_owner::RemoteOwner;
use odc_transport::conformance::Pair;
use odc_transport::tcp::{TcpConfig, TcpTransport};
use odc_transport::{ClusterSecret, RemoteConfig};

const SECRET: &str = "tcp-process-conformance";

async fn make_pair() -> Pair {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_odc-conformance-owner"));
    command.arg("tcp").env("ODC_SECRET", SECRET);
    let owner = RemoteOwner::spawn(command, "tcp");
    let reader = TcpTransport::bind(TcpConfig {
        remote: RemoteConfig {
            read_part_bytes: 64 * 1024,
            ..RemoteConfig::default()
        },
        ..TcpConfig::loopback(ClusterSecret::new(SECRET).expect("secret"))
    })
    .await
    .expect("reader binds");
    Pair::new(owner, reader)
}

odc_transport::conformance_tests!(make_pair);
