//! Starting `examples/embed` as a single process, under `odc launch`, or rank by rank.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

/// The `embed` example (cargo builds examples before it runs integration tests).
pub fn embed() -> PathBuf {
    example("embed")
}

/// The example `name`, built by cargo beside this test binary.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    // target/<profile>/deps/<test> -> target/<profile>/examples/<name>
    let path = exe
        .parent()
        .and_then(Path::parent)
        .map(|p| p.join("examples").join(name))
        .expect("a target directory");
    assert!(
        path.exists(),
        "{} is missing: run through `cargo test`, which builds the examples",
        path.display()
    );
    path
}

pub fn odc() -> Command {
    Command::new(env!("CARGO_BIN_EXE_odc"))
}

/// The flags every run here shares: a short, seeded job.
pub const STEPS: &str = "6";
pub fn common_args() -> Vec<String> {
    [
        "--steps",
        STEPS,
        "--minibatch",
        "32",
        "--no-metrics",
        "--seed",
        "7",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// A file in the temporary directory unique to this test run.
pub fn temp(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!("odc-mp-{}-{nanos}-{name}", std::process::id()))
}

/// Run to completion within `limit` (killed past it, which fails the test).
pub fn run(mut command: Command, limit: Duration) -> Output {
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = command.spawn().expect("the command starts");
    wait(child, limit)
}

pub fn wait(child: Child, limit: Duration) -> Output {
    Draining::start(child).wait(limit)
}

/// A child whose stdout and stderr are read by threads of their own from the moment it is
/// handed over: a rank under attack logs a line per refused connection, far more than a pipe
/// holds, and would block on a full one (its runtime with it, and its heartbeats).
pub struct Draining {
    child: Child,
    stdout: Option<JoinHandle<Vec<u8>>>,
    stderr: Option<JoinHandle<Vec<u8>>>,
    started: Instant,
}

impl Draining {
    pub fn start(mut child: Child) -> Self {
        fn drain(pipe: Option<impl Read + Send + 'static>) -> Option<JoinHandle<Vec<u8>>> {
            pipe.map(|mut pipe| {
                std::thread::spawn(move || {
                    let mut bytes = Vec::new();
                    let _ = pipe.read_to_end(&mut bytes);
                    bytes
                })
            })
        }
        let (stdout, stderr) = (drain(child.stdout.take()), drain(child.stderr.take()));
        Draining {
            child,
            stdout,
            stderr,
            started: Instant::now(),
        }
    }

    /// Its output once it exits, at most `limit` after draining started (killed past it, which
    /// fails the test: I6).
    pub fn wait(mut self, limit: Duration) -> Output {
        fn collect(reader: Option<JoinHandle<Vec<u8>>>) -> Vec<u8> {
            reader
                .map(|r| r.join().unwrap_or_default())
                .unwrap_or_default()
        }
        loop {
            match self.child.try_wait().expect("waiting on a child") {
                Some(status) => {
                    return Output {
                        status,
                        stdout: collect(self.stdout),
                        stderr: collect(self.stderr),
                    }
                }
                None if self.started.elapsed() > limit => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    panic!(
                        "still running after {limit:?} (I6: no hang)\nstdout:\n{}\nstderr:\n{}",
                        String::from_utf8_lossy(&collect(self.stdout)),
                        String::from_utf8_lossy(&collect(self.stderr))
                    );
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// Every `final loss=… params_l2=…` line of `stdout`, parsed.
pub fn finals(stdout: &str) -> Vec<(f64, f64)> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("final loss="))
        .map(|rest| {
            let (loss, l2) = rest
                .split_once(" params_l2=")
                .unwrap_or_else(|| panic!("a malformed final line: {rest}"));
            let loss: f64 = loss.parse().expect("loss is a number");
            let l2: f64 = l2.parse().expect("params_l2 is a number");
            assert!(loss.is_finite() && l2.is_finite(), "finite: {rest}");
            (loss, l2)
        })
        .collect()
}

/// The parameters `--save-params` wrote.
pub fn params(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(bytes.len() % 4, 0, "whole f32s");
    let _ = std::fs::remove_file(path);
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// I3 within the stated tolerance: same length, no NaN, every element within 1e-5.
pub fn assert_same_params(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: parameter count");
    assert!(!want.is_empty(), "{what}: some parameters");
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.is_finite() && w.is_finite(),
            "{what}: parameter {i} is {g} / {w}"
        );
        worst = worst.max((g - w).abs());
    }
    assert!(worst <= 1e-5, "{what}: largest difference {worst} > 1e-5");
    // The run trained: parameters moved away from their initial values is checked by the
    // caller's loss; here, that the two runs are not trivially both zero.
    assert!(
        want.iter().any(|w| w.abs() > 1e-3),
        "{what}: non-trivial parameters"
    );
}

/// The single-process reference: `embed` with the given counts and extra flags; its parameters
/// and final loss.
/// `out`'s stdout, after asserting that it exited successfully (else both streams, with `what`).
pub fn succeeded(out: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what}:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

pub fn single(trainers: usize, servers: usize, extra: &[&str]) -> (Vec<f32>, f64) {
    let path = temp("single.params");
    let mut cmd = Command::new(embed());
    cmd.args(common_args())
        .args(["--trainers", &trainers.to_string()])
        .args(["--servers", &servers.to_string()])
        .args(extra)
        .arg("--save-params")
        .arg(&path);
    let stdout = succeeded(&run(cmd, Duration::from_secs(120)), "single process");
    let finals = finals(&stdout);
    assert_eq!(finals.len(), 1, "{stdout}");
    (params(&path), finals[0].0)
}

/// The environment `odc launch` gives rank `rank` of `world` (tests that start ranks by hand).
pub fn rank_env(
    cmd: &mut Command,
    rank: u32,
    world: u32,
    coordinator: &str,
    secret: &str,
    job: &str,
    transport: &str,
) {
    cmd.env("ODC_RANK", rank.to_string())
        .env("ODC_WORLD_SIZE", world.to_string())
        .env("ODC_LOCAL_RANK", rank.to_string())
        .env("ODC_COORDINATOR", coordinator)
        .env("ODC_SECRET", secret)
        .env("ODC_JOB", job)
        .env("ODC_TRANSPORT", transport);
}

/// A port free right now on loopback, for a rank to bind a moment later. Taken below the kernel's
/// ephemeral range (Linux's default starts at 32768), where the outgoing connections of the tests
/// running beside this one take their local ports: a port the kernel handed out here (port 0)
/// could be taken by one of them before the rank binds it. Each call of this process tries the
/// next port (from an offset of the process id), so parallel tests never get the same one.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let offset = std::process::id() % SPAN;
    for _ in 0..SPAN {
        let port = (FIRST + (offset + NEXT.fetch_add(1, Ordering::Relaxed)) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Ranks started by hand, so one can be killed or stopped.
pub struct Ranks {
    children: Vec<Option<Child>>,
    /// The job's name (`ODC_JOB`).
    pub job: String,
}

impl Ranks {
    /// Start `world` ranks of `embed` with `args`; rank `r` gets `secrets[r]`.
    pub fn start(world: u32, transport: &str, secrets: &[&str], args: &[String]) -> Self {
        Self::start_program(&embed(), world, transport, secrets, args)
    }

    /// [`Ranks::start`] of `program` (an example).
    pub fn start_program(
        program: &Path,
        world: u32,
        transport: &str,
        secrets: &[&str],
        args: &[String],
    ) -> Self {
        let coordinator = format!("127.0.0.1:{}", free_port());
        let job = format!("t{}x{}", std::process::id(), free_port());
        let children = (0..world)
            .map(|rank| {
                let mut cmd = Command::new(program);
                rank_env(
                    &mut cmd,
                    rank,
                    world,
                    &coordinator,
                    secrets[rank as usize],
                    &job,
                    transport,
                );
                cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
                Some(cmd.spawn().expect("a rank starts"))
            })
            .collect();
        Ranks { children, job }
    }

    /// Rank 0's stdout, line by line, as it comes (the rest is collected at the end).
    pub fn take_stdout(&mut self, rank: usize) -> std::process::ChildStdout {
        self.children[rank]
            .as_mut()
            .and_then(|c| c.stdout.take())
            .expect("piped stdout")
    }

    pub fn kill(&mut self, rank: usize) -> SystemTime {
        self.signal(rank, libc::SIGKILL)
    }

    /// Send `signal` to rank `rank`; when it was sent.
    pub fn signal(&mut self, rank: usize, signal: i32) -> SystemTime {
        let pid = self.pid(rank);
        // SAFETY: plain FFI call on a pid we own.
        let rc = unsafe { libc::kill(pid as i32, signal) };
        assert_eq!(rc, 0, "signal {signal} to rank {rank}");
        SystemTime::now()
    }

    /// Rank `rank`'s process id.
    pub fn pid(&self, rank: usize) -> u32 {
        self.children[rank].as_ref().expect("running").id()
    }

    /// Once rank 0 has printed a line starting with `after`, wait `delay` (into the work that
    /// follows it) and SIGKILL rank `victim`; then [`Ranks::wait`] for every rank, rank 0's stdout
    /// whole (the lines before the kill too). When the kill was sent, and the ranks' results.
    pub fn kill_during(
        mut self,
        after: &str,
        delay: Duration,
        victim: usize,
        limit: Duration,
    ) -> (SystemTime, Vec<(Option<i32>, String, String)>) {
        let (lines, reader) = read_until(self.take_stdout(0), after);
        std::thread::sleep(delay);
        let killed_at = self.kill(victim);
        let mut results = self.wait(limit);
        results[0].1 = rest(reader, lines);
        (killed_at, results)
    }

    /// Wait for every rank, all of them drained at once (one rank's full pipe would otherwise
    /// stall it while another is waited on); (status, stdout, stderr) per rank.
    pub fn wait(mut self, limit: Duration) -> Vec<(Option<i32>, String, String)> {
        let draining: Vec<Draining> = self
            .children
            .iter_mut()
            .map(|c| Draining::start(c.take().expect("a child")))
            .collect();
        draining
            .into_iter()
            .map(|d| {
                let out = d.wait(limit);
                (
                    out.status.code(),
                    String::from_utf8_lossy(&out.stdout).into_owned(),
                    String::from_utf8_lossy(&out.stderr).into_owned(),
                )
            })
            .collect()
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for child in self.children.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Read `stdout` until a line starting with `prefix`; every line read.
pub fn read_until(
    stdout: std::process::ChildStdout,
    prefix: &str,
) -> (Vec<String>, BufReader<std::process::ChildStdout>) {
    let mut reader = BufReader::new(stdout);
    let mut lines = Vec::new();
    read_more(&mut reader, &mut lines, prefix);
    (lines, reader)
}

/// Go on reading until a line starting with `prefix`, adding every line to `lines`.
pub fn read_more(
    reader: &mut BufReader<std::process::ChildStdout>,
    lines: &mut Vec<String>,
    prefix: &str,
) {
    loop {
        let mut line = String::new();
        let n = reader
            .read_line(&mut line)
            .expect("reading rank 0's stdout");
        assert!(n > 0, "rank 0 ended before printing {prefix:?}: {lines:?}");
        let done = line.starts_with(prefix);
        lines.push(line);
        if done {
            return;
        }
    }
}

pub fn rest(mut reader: BufReader<std::process::ChildStdout>, mut lines: Vec<String>) -> String {
    let mut tail = String::new();
    std::io::Read::read_to_string(&mut reader, &mut tail).expect("rank 0's stdout");
    lines.push(tail);
    lines.concat()
}
