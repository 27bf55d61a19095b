//! The Prometheus endpoint: every `odc_*` metric the runtime records, served at
//! `http://ADDR/metrics` by `metrics-exporter-prometheus`.
//!
//! The recorder is process-global: install it once per process. Off unless called (tests and
//! embedders choose).

use std::net::SocketAddr;

use metrics_exporter_prometheus::PrometheusBuilder;
use odc_actors::{Error, Result};

/// Metric names the runtime records.
pub use odc_actors::metrics as names;

/// Serve Prometheus metrics on `addr` (e.g. `127.0.0.1:9464`). Must be called inside a tokio runtime.
/// Fails with a message naming the address when it cannot bind or a recorder is already installed.
pub fn serve(addr: SocketAddr) -> Result<()> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| Error::Config(format!("metrics endpoint on {addr}: {e}")))?;
    names::describe();
    Ok(())
}
