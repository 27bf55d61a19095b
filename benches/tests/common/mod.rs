//! Running the real `odc-bench` binary from tests, with a process-level timeout.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Longest a test lets the binary run before killing it (generous: a check that hangs or starts
/// the benchmark is a failure, a slow machine is not).
pub const KILL_AFTER: Duration = Duration::from_secs(60);

/// A path in the temporary directory unique to this process and `name`.
pub fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("odc-bench-test-{}-{name}", std::process::id()))
}

/// Runs `odc-bench` with `args`; kills it and panics if it runs longer than [`KILL_AFTER`].
pub fn odc_bench(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_odc-bench"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start odc-bench");
    // Drain both pipes on threads so a chatty child cannot block on a full pipe.
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = pipe.read_to_end(&mut buf);
            buf
        })
    };
    let stdout = drain(Box::new(child.stdout.take().expect("stdout")));
    let stderr = drain(Box::new(child.stderr.take().expect("stderr")));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for odc-bench") {
            break status;
        }
        if started.elapsed() > KILL_AFTER {
            let _ = child.kill();
            let _ = child.wait();
            panic!("odc-bench {args:?} still running after {KILL_AFTER:?}: killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
}
