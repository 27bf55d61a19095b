//! The conformance suite (contract C1–C7 and the handle rules) against the bandwidth-throttled
//! wrapper of `local`, each side wrapped: the wrapper changes timing only.

use std::sync::Arc;

use odc_transport::conformance::{Pair, INBOX_CAPACITY};
use odc_transport::local::LocalTransport;
use odc_transport::throttle::Throttled;

/// Fast enough that the suite's largest transfers take well under a millisecond each.
const BYTES_PER_SEC: f64 = 4e9;

async fn make_pair() -> Pair {
    Pair::new(
        Throttled::per_endpoint(
            Arc::new(LocalTransport::with_inbox_capacity(INBOX_CAPACITY)),
            BYTES_PER_SEC,
        ),
        Throttled::per_endpoint(Arc::new(LocalTransport::new()), BYTES_PER_SEC),
    )
}

odc_transport::conformance_tests!(make_pair);
