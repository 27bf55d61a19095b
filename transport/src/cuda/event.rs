//! Waiting for a CUDA event from async code without holding a runtime thread: [`reached`], the
//! one poll loop of every device wait of odc's computes (the candle model's device memory and
//! the Python package's GPU path).
//!
//! Invariant: the wait is bounded (I6): past its length the error names what was waited for.

use std::future::Future;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext};

/// Polls `event` (recorded in `ctx`, which is bound on each polling thread) until it completed
/// or `wait` passed, yielding to the runtime between polls: a short spin first (an event is
/// usually microseconds away), then sleeps of 200 µs. The error is the message naming `what`.
pub fn reached<'a>(
    ctx: &'a CudaContext,
    event: sys::CUevent,
    what: &'a str,
    wait: Duration,
) -> impl Future<Output = Result<(), String>> + Send + 'a {
    let event = Event(event);
    async move {
        let started = Instant::now();
        loop {
            // Another worker thread may poll next: bind there too.
            ctx.bind_to_thread()
                .map_err(|e| format!("cuda: binding the context to wait for {what} failed: {e}"))?;
            match event.query() {
                sys::CUresult::CUDA_SUCCESS => return Ok(()),
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => {
                    return Err(format!(
                        "cuda: {what} failed: {}",
                        result::DriverError(other)
                    ))
                }
            }
            let waited = started.elapsed();
            if waited >= wait {
                return Err(format!(
                    "cuda: {what} did not complete within {} s (the device is hung or overloaded)",
                    wait.as_secs()
                ));
            }
            if waited < Duration::from_millis(2) {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        }
    }
}

/// An event handle the wait carries across threads.
struct Event(sys::CUevent);

// SAFETY: an event handle is usable from any thread of its context (bound before each query);
// the caller keeps the event alive while the wait runs.
unsafe impl Send for Event {}

impl Event {
    fn query(&self) -> sys::CUresult {
        // SAFETY: querying a live event of the bound context (no other effect).
        unsafe { sys::cuEventQuery(self.0) }
    }
}
