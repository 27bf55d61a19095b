//! The conformance suite (contract C1–C7 and the handle rules) against the `local` backend, one
//! test per check. Owner and reader are two `LocalTransport`s (two fabrics) joined only by
//! serialized handles.

use std::sync::Arc;

use odc_transport::conformance::Pair;
use odc_transport::local::LocalTransport;

/// Small, so the inbox capacity checks fill an inbox quickly.
const INBOX_CAPACITY: usize = 64;

async fn make_pair() -> Pair {
    Pair {
        owner: Arc::new(LocalTransport::with_inbox_capacity(INBOX_CAPACITY)),
        reader: Arc::new(LocalTransport::new()),
    }
}

odc_transport::conformance_tests!(make_pair);
