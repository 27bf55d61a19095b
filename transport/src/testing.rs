//! What the crate's unit tests share.

use std::future::Future;
use std::time::Duration;

/// Run a test's future on its own current-thread runtime, bounded (every async test has a
/// timeout): 20 s, far above what any of them needs.
pub(crate) fn block_on<F: Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(async {
            tokio::time::timeout(Duration::from_secs(20), future)
                .await
                .expect("the test finishes within its bound")
        })
}
