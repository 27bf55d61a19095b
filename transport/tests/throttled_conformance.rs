//! The conformance suite (contract C1–C5) against the bandwidth-throttled wrapper of `local`: the
//! wrapper changes timing only.

use std::sync::Arc;

use odc_transport::local::LocalTransport;
use odc_transport::throttle::Throttled;
use odc_transport::Transport;

async fn make_transport() -> Arc<dyn Transport> {
    Arc::new(Throttled::per_endpoint(
        Arc::new(LocalTransport::new()),
        4e9,
    ))
}

odc_transport::conformance_tests!(make_transport);
