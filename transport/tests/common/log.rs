//! This thread's `tracing` events, captured (an owner's tasks on a current-thread test runtime log
//! on the test's thread): what an owner said as it dropped a connection.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long [`Log::expect_line`] waits for its line.
pub const LOG_BOUND: Duration = Duration::from_secs(3);

#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<u8>>>);

impl Log {
    /// Capture this thread's `tracing` events until the guard is dropped.
    pub fn capture() -> (Self, tracing::subscriber::DefaultGuard) {
        let log = Log::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(log.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .finish();
        (log.clone(), tracing::subscriber::set_default(subscriber))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log lock")).into_owned()
    }

    /// Wait, at most [`LOG_BOUND`], for a line containing every one of `parts`: the owner logs as
    /// it drops a connection, which may be just after the peer notices.
    pub async fn expect_line(&self, parts: &[&str]) {
        let start = Instant::now();
        loop {
            let text = self.text();
            if text
                .lines()
                .any(|line| parts.iter().all(|part| line.contains(part)))
            {
                return;
            }
            assert!(
                start.elapsed() < LOG_BOUND,
                "no log line with {parts:?}; the log:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log lock").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Log {
    type Writer = Log;
    fn make_writer(&'a self) -> Log {
        self.clone()
    }
}
