//! The suite with the owner in **another OS process**: [`RemoteOwner`] is a [`Transport`] whose
//! owner side (registering regions, publishing, taking, receiving, advancing, dropping guards)
//! runs in a child process that hosts the real backend, driven over the child's stdin and stdout
//! with one JSON command per line. Its peer side is not used: a [`Pair`](super::Pair) of a
//! `RemoteOwner` and a backend instance in the test process has every region in the child and
//! every read, accumulate and send crossing the process boundary through the backend.
//!
//! The child runs [`serve_stdio`] over the backend it was asked for (see the crate's
//! `odc-conformance-owner` binary). Commands and replies carry a sequence number; the child answers
//! each as soon as it completes (a `recv` may wait while later commands are answered).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

use super::PATIENCE;
use crate::{
    AccumulatorRegion, Deadline, Dest, Dtype, EndpointId, InboxRegion, PublishedRegion,
    RegionHandle, Transport, TransportError, WriteTag,
};

/// An owner-side operation, sent to the child.
#[derive(Debug, Serialize, Deserialize)]
enum Cmd {
    RegisterPublished {
        owner: EndpointId,
        dtype: Dtype,
        #[serde(with = "hex")]
        initial: Vec<u8>,
        version: u64,
    },
    RegisterAccumulator {
        owner: EndpointId,
        len: u64,
        epoch: u64,
    },
    RegisterInbox {
        owner: EndpointId,
        epoch: u64,
    },
    Publish {
        guard: u64,
        version: u64,
        #[serde(with = "hex")]
        data: Vec<u8>,
    },
    Republish {
        guard: u64,
        version: u64,
    },
    Version {
        guard: u64,
    },
    /// Returns the values as bits (NaN payloads survive JSON that way).
    Take {
        guard: u64,
        next_epoch: u64,
    },
    Epoch {
        guard: u64,
    },
    Capacity {
        guard: u64,
    },
    Advance {
        guard: u64,
        epoch: u64,
    },
    Recv {
        guard: u64,
        tag: WriteTag,
        timeout_ms: u64,
    },
    Drop {
        guard: u64,
    },
}

/// The child's answer.
#[derive(Debug, Serialize, Deserialize)]
enum Reply {
    Registered { guard: u64, handle: RegionHandle },
    Number(u64),
    Bits(Vec<u32>),
    Message(#[serde(with = "hex")] Vec<u8>),
    Done,
    Failed(TransportError),
}

#[derive(Debug, Serialize, Deserialize)]
struct Envelope<T> {
    seq: u64,
    body: T,
}

enum Guard {
    Published(Box<dyn PublishedRegion>),
    Accumulator(Box<dyn AccumulatorRegion>),
    Inbox(Arc<dyn InboxRegion>),
}

/// The child's loop: run owner-side commands from stdin against `transport`, answer on stdout,
/// until stdin closes.
pub async fn serve_stdio(transport: Arc<dyn Transport>) {
    let guards: Arc<Mutex<HashMap<u64, Guard>>> = Arc::default();
    let (out_tx, mut out_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let writer = tokio::spawn(async move {
        let mut stdout = tokio::io::stdout();
        while let Some(line) = out_rx.recv().await {
            if stdout.write_all(line.as_bytes()).await.is_err() || stdout.flush().await.is_err() {
                return;
            }
        }
    });
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let mut next_guard = 0u64;
    while let Ok(Some(line)) = lines.next_line().await {
        let Ok(Envelope { seq, body }) = serde_json::from_str::<Envelope<Cmd>>(&line) else {
            eprintln!("conformance owner: cannot parse command {line:?}");
            return;
        };
        let reply = |body: Reply| {
            let line = serde_json::to_string(&Envelope { seq, body }).unwrap_or_default() + "\n";
            let _ = out_tx.send(line);
        };
        let registered = |guards: &Mutex<HashMap<u64, Guard>>, id: u64, guard: Guard| {
            let handle = match &guard {
                Guard::Published(g) => g.handle(),
                Guard::Accumulator(g) => g.handle(),
                Guard::Inbox(g) => g.handle(),
            };
            guards.lock().insert(id, guard);
            Reply::Registered { guard: id, handle }
        };
        next_guard += 1;
        let id = next_guard;
        let answer = match body {
            Cmd::RegisterPublished {
                owner,
                dtype,
                initial,
                version,
            } => transport
                .register_published(owner, dtype, Bytes::from(initial), version)
                .map(|g| registered(&guards, id, Guard::Published(g))),
            Cmd::RegisterAccumulator { owner, len, epoch } => transport
                .register_accumulator(owner, usize::try_from(len).unwrap_or(usize::MAX), epoch)
                .map(|g| registered(&guards, id, Guard::Accumulator(g))),
            Cmd::RegisterInbox { owner, epoch } => transport
                .register_inbox(owner, epoch)
                .map(|g| registered(&guards, id, Guard::Inbox(Arc::from(g)))),
            Cmd::Publish {
                guard,
                version,
                data,
            } => match guards.lock().get(&guard) {
                Some(Guard::Published(g)) => {
                    g.publish(version, Bytes::from(data)).map(|()| Reply::Done)
                }
                _ => Ok(Reply::Done),
            },
            Cmd::Republish { guard, version } => match guards.lock().get(&guard) {
                Some(Guard::Published(g)) => g.republish(version).map(|()| Reply::Done),
                _ => Ok(Reply::Done),
            },
            Cmd::Version { guard } => Ok(match guards.lock().get(&guard) {
                Some(Guard::Published(g)) => Reply::Number(g.version()),
                _ => Reply::Number(0),
            }),
            Cmd::Take { guard, next_epoch } => Ok(match guards.lock().get(&guard) {
                Some(Guard::Accumulator(g)) => {
                    Reply::Bits(g.take(next_epoch).iter().map(|v| v.to_bits()).collect())
                }
                _ => Reply::Bits(Vec::new()),
            }),
            Cmd::Epoch { guard } => Ok(match guards.lock().get(&guard) {
                Some(Guard::Accumulator(g)) => Reply::Number(g.epoch()),
                Some(Guard::Inbox(g)) => Reply::Number(g.epoch()),
                _ => Reply::Number(0),
            }),
            Cmd::Capacity { guard } => Ok(match guards.lock().get(&guard) {
                Some(Guard::Inbox(g)) => Reply::Number(g.capacity() as u64),
                _ => Reply::Number(0),
            }),
            Cmd::Advance { guard, epoch } => {
                if let Some(Guard::Inbox(g)) = guards.lock().get(&guard) {
                    g.advance(epoch);
                }
                Ok(Reply::Done)
            }
            Cmd::Recv {
                guard,
                tag,
                timeout_ms,
            } => {
                let inbox = match guards.lock().get(&guard) {
                    Some(Guard::Inbox(g)) => Some(Arc::clone(g)),
                    _ => None,
                };
                if let Some(inbox) = inbox {
                    let out_tx = out_tx.clone();
                    tokio::spawn(async move {
                        let deadline = crate::deadline_in(Duration::from_millis(timeout_ms));
                        let body = match inbox.recv(tag, deadline).await {
                            Ok(data) => Reply::Message(data.to_vec()),
                            Err(e) => Reply::Failed(e),
                        };
                        let line =
                            serde_json::to_string(&Envelope { seq, body }).unwrap_or_default();
                        let _ = out_tx.send(line + "\n");
                    });
                    continue;
                }
                Ok(Reply::Done)
            }
            Cmd::Drop { guard } => {
                guards.lock().remove(&guard);
                Ok(Reply::Done)
            }
        };
        reply(answer.unwrap_or_else(Reply::Failed));
    }
    drop(out_tx);
    let _ = writer.await;
}

/// Byte payloads as hex strings: far quicker through JSON than arrays of numbers.
mod hex {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(bytes.len() * 2);
        for b in bytes {
            out.push(DIGITS[usize::from(b >> 4)] as char);
            out.push(DIGITS[usize::from(b & 15)] as char);
        }
        s.serialize_str(&out)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        let digit = |c: u8| match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            _ => Err(serde::de::Error::custom("not a hex digit")),
        };
        text.as_bytes()
            .chunks(2)
            .map(|pair| match pair {
                [hi, lo] => Ok(digit(*hi)? << 4 | digit(*lo)?),
                _ => Err(serde::de::Error::custom("odd number of hex digits")),
            })
            .collect()
    }
}

type Waiters = Arc<Mutex<HashMap<u64, mpsc::Sender<Reply>>>>;

struct Channel {
    child: Mutex<Child>,
    stdin: Mutex<Option<ChildStdin>>,
    waiters: Waiters,
    seq: AtomicU64,
    backend: &'static str,
}

impl Channel {
    /// Send `command`; the receiver of its reply.
    fn submit(&self, command: Cmd) -> mpsc::Receiver<Reply> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        self.waiters.lock().insert(seq, tx);
        let line = serde_json::to_string(&Envelope { seq, body: command })
            .unwrap_or_else(|e| panic!("{}: command does not serialize: {e}", self.backend));
        let mut stdin = self.stdin.lock();
        let Some(stdin) = stdin.as_mut() else {
            panic!("{}: the owner process was shut down", self.backend);
        };
        if let Err(e) = writeln!(stdin, "{line}").and_then(|()| stdin.flush()) {
            panic!("{}: the owner process is gone: {e}", self.backend);
        }
        rx
    }

    /// Run `command` in the child and wait for its reply (blocking; owner-side calls are quick).
    fn call(&self, command: Cmd) -> Reply {
        let rx = self.submit(command);
        match rx.recv_timeout(PATIENCE) {
            Ok(reply) => reply,
            Err(e) => panic!("{}: the owner process did not answer: {e}", self.backend),
        }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // Closing stdin ends the child's loop: it drops its transport (removing its files) and
        // exits. Killed only if it does not within a few seconds.
        self.stdin.lock().take();
        let mut child = self.child.lock();
        let give_up = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < give_up {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// The owner side of the suite, in a child process started with `command` (which must run
/// [`serve_stdio`] over the backend named `backend`).
pub struct RemoteOwner {
    channel: Arc<Channel>,
}

impl RemoteOwner {
    /// Start the child. Panics (this is a test harness) if it cannot be started.
    pub fn spawn(mut command: Command, backend: &'static str) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("{backend}: cannot start the owner process: {e}"));
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            panic!("{backend}: the owner process has no pipes");
        };
        let waiters: Waiters = Arc::default();
        let reader_waiters = Arc::clone(&waiters);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                let Ok(Envelope { seq, body }) = serde_json::from_str::<Envelope<Reply>>(&line)
                else {
                    eprintln!("{backend}: unreadable reply from the owner process: {line:?}");
                    return;
                };
                if let Some(waiter) = reader_waiters.lock().remove(&seq) {
                    let _ = waiter.send(body);
                }
            }
        });
        Self {
            channel: Arc::new(Channel {
                child: Mutex::new(child),
                stdin: Mutex::new(Some(stdin)),
                waiters,
                seq: AtomicU64::new(0),
                backend,
            }),
        }
    }
}

struct RemoteGuard {
    channel: Arc<Channel>,
    guard: u64,
    handle: RegionHandle,
}

impl RemoteGuard {
    fn number(&self, command: Cmd) -> u64 {
        match self.channel.call(command) {
            Reply::Number(n) => n,
            other => panic!("{}: unexpected reply {other:?}", self.channel.backend),
        }
    }
}

impl Drop for RemoteGuard {
    fn drop(&mut self) {
        self.channel.call(Cmd::Drop { guard: self.guard });
    }
}

impl Channel {
    /// Have the owner process register a region (`command`): its guard here.
    fn register(self: &Arc<Self>, command: Cmd) -> Result<RemoteGuard, TransportError> {
        match self.call(command) {
            Reply::Registered { guard, handle } => Ok(RemoteGuard {
                channel: Arc::clone(self),
                guard,
                handle,
            }),
            Reply::Failed(e) => Err(e),
            other => panic!("{}: unexpected reply {other:?}", self.backend),
        }
    }
}

impl PublishedRegion for RemoteGuard {
    fn handle(&self) -> RegionHandle {
        let mut handle = self.handle.clone();
        handle.version = self.version();
        handle
    }
    fn publish(&self, version: u64, data: Bytes) -> Result<(), TransportError> {
        match self.channel.call(Cmd::Publish {
            guard: self.guard,
            version,
            data: data.to_vec(),
        }) {
            Reply::Done => Ok(()),
            Reply::Failed(e) => Err(e),
            other => panic!("{}: unexpected reply {other:?}", self.channel.backend),
        }
    }
    fn republish(&self, version: u64) -> Result<(), TransportError> {
        match self.channel.call(Cmd::Republish {
            guard: self.guard,
            version,
        }) {
            Reply::Done => Ok(()),
            Reply::Failed(e) => Err(e),
            other => panic!("{}: unexpected reply {other:?}", self.channel.backend),
        }
    }
    fn version(&self) -> u64 {
        self.number(Cmd::Version { guard: self.guard })
    }
}

impl AccumulatorRegion for RemoteGuard {
    fn handle(&self) -> RegionHandle {
        let mut handle = self.handle.clone();
        handle.version = AccumulatorRegion::epoch(self);
        handle
    }
    fn take(&self, next_epoch: u64) -> Vec<f32> {
        match self.channel.call(Cmd::Take {
            guard: self.guard,
            next_epoch,
        }) {
            Reply::Bits(bits) => bits.into_iter().map(f32::from_bits).collect(),
            other => panic!("{}: unexpected reply {other:?}", self.channel.backend),
        }
    }
    /// The child answers takes with values only: the process-crossing suite skips the write
    /// ids (the in-process one of the same backend checks them).
    fn take_applied(&self, _next_epoch: u64) -> Result<crate::Applied, TransportError> {
        Err(TransportError::Unsupported {
            what: format!(
                "the write ids of a region owned by another process ({} owner child)",
                self.channel.backend
            ),
        })
    }
    fn epoch(&self) -> u64 {
        self.number(Cmd::Epoch { guard: self.guard })
    }
    /// A closure does not cross to the child process: the admission check (C8) is skipped for
    /// the process-crossing suite and runs in the in-process one of the same backend.
    fn admit_only(&self, _guard: crate::WriteGuard) -> Result<(), TransportError> {
        Err(TransportError::Unsupported {
            what: format!(
                "a write guard for a region owned by another process ({} owner child)",
                self.channel.backend
            ),
        })
    }
}

#[async_trait::async_trait]
impl InboxRegion for RemoteGuard {
    fn handle(&self) -> RegionHandle {
        let mut handle = self.handle.clone();
        handle.version = InboxRegion::epoch(self);
        handle
    }
    fn epoch(&self) -> u64 {
        self.number(Cmd::Epoch { guard: self.guard })
    }
    fn capacity(&self) -> usize {
        usize::try_from(self.number(Cmd::Capacity { guard: self.guard })).unwrap_or(0)
    }
    fn advance(&self, epoch: u64) {
        self.channel.call(Cmd::Advance {
            guard: self.guard,
            epoch,
        });
    }
    async fn recv(&self, tag: WriteTag, deadline: Deadline) -> Result<Bytes, TransportError> {
        let timeout_ms = deadline
            .saturating_duration_since(crate::now())
            .as_millis()
            .try_into()
            .unwrap_or(u64::MAX);
        let rx = self.channel.submit(Cmd::Recv {
            guard: self.guard,
            tag,
            timeout_ms,
        });
        let backend = self.channel.backend;
        let reply = tokio::task::spawn_blocking(move || rx.recv_timeout(PATIENCE * 2))
            .await
            .unwrap_or_else(|e| panic!("{backend}: recv waiter failed: {e}"))
            .unwrap_or_else(|e| panic!("{backend}: the owner process did not answer a recv: {e}"));
        match reply {
            Reply::Message(data) => Ok(Bytes::from(data)),
            Reply::Failed(e) => Err(e),
            other => panic!("{backend}: unexpected reply {other:?}"),
        }
    }
}

#[async_trait::async_trait]
impl Transport for RemoteOwner {
    fn backend(&self) -> &'static str {
        self.channel.backend
    }

    fn register_published(
        &self,
        owner: EndpointId,
        dtype: Dtype,
        initial: Bytes,
        version: u64,
    ) -> Result<Box<dyn PublishedRegion>, TransportError> {
        let guard = self.channel.register(Cmd::RegisterPublished {
            owner,
            dtype,
            initial: initial.to_vec(),
            version,
        })?;
        Ok(Box::new(guard))
    }

    fn register_accumulator(
        &self,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<Box<dyn AccumulatorRegion>, TransportError> {
        let guard = self.channel.register(Cmd::RegisterAccumulator {
            owner,
            len: len as u64,
            epoch,
        })?;
        Ok(Box::new(guard))
    }

    fn register_inbox(
        &self,
        owner: EndpointId,
        epoch: u64,
    ) -> Result<Box<dyn InboxRegion>, TransportError> {
        let guard = self.channel.register(Cmd::RegisterInbox { owner, epoch })?;
        Ok(Box::new(guard))
    }

    async fn read(
        &self,
        _: &RegionHandle,
        _: std::ops::Range<usize>,
        _: Dest<'_>,
        _: Deadline,
    ) -> Result<u64, TransportError> {
        Err(unused())
    }

    async fn accumulate(
        &self,
        _: &RegionHandle,
        _: usize,
        _: Bytes,
        _: WriteTag,
        _: Deadline,
    ) -> Result<(), TransportError> {
        Err(unused())
    }

    async fn send(
        &self,
        _: &RegionHandle,
        _: WriteTag,
        _: Bytes,
        _: Deadline,
    ) -> Result<(), TransportError> {
        Err(unused())
    }
}

fn unused() -> TransportError {
    TransportError::Unsupported {
        what: "peer operations of the suite's remote owner (the reader does them)".into(),
    }
}
