//! The conformance suite (contract C1–C7 and the handle rules) against the `local` backend, one
//! test per check. Owner and reader are two `LocalTransport`s (two fabrics) joined only by
//! serialized handles.

use odc_transport::conformance::{Pair, INBOX_CAPACITY};
use odc_transport::local::LocalTransport;

async fn make_pair() -> Pair {
    Pair::new(
        LocalTransport::with_inbox_capacity(INBOX_CAPACITY),
        LocalTransport::new(),
    )
}

odc_transport::conformance_tests!(make_pair);
