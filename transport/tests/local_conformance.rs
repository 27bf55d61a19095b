//! The conformance suite (contract C1–C5) against the `local` backend, one test per check.

use std::sync::Arc;

use odc_transport::local::LocalTransport;
use odc_transport::Transport;

async fn make_transport() -> Arc<dyn Transport> {
    Arc::new(LocalTransport::new())
}

odc_transport::conformance_tests!(make_transport);
