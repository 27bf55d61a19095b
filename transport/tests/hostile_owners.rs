//! A real `TcpTransport` reader against scripted owners: the reader's side of the issue's
//! "Hostile input" clause, and of receiving a read's payload straight into the caller's
//! destination (`remote::payload`). An owner is a peer too: answers of the wrong length, payloads
//! cut off by a closed connection, frames over the cap and read data for an accumulate are clear
//! errors naming the owner, never a panic and never a byte outside the destination; a payload the
//! reader stops taking (its deadline passed mid-payload) is discarded and the connection goes on;
//! and a large read lands in the destination without a buffer of its size.
//!
//! The owner is a task on the test's own current-thread runtime that completes the real handshake
//! and then answers each request as the test's script says. Allocations are recorded per thread
//! (as in `hostile_peers`), so the reader's largest allocation during a read is known.

mod common;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use odc_transport::tcp::{TcpConfig, TcpTransport};
use odc_transport::wire::frame::{write_frame, FrameReader};
use odc_transport::wire::handshake::{self, HANDSHAKE_FRAME_CAP};
use odc_transport::wire::sealed::SealedWrite;
use odc_transport::wire::{ClusterSecret, Request, Response};
use odc_transport::{
    deadline_in, Descriptor, Dest, Dtype, RegionHandle, RegionKind, RemoteConfig, Transport,
    TransportError, WriteTag,
};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpListener;

/// Every test as a whole.
const TEST_BOUND: Duration = Duration::from_secs(20);
const SECRET: &str = "hostile-owners-secret";
const OWNER: u32 = 3;
const REGION: u64 = 7;
/// The reader's frame cap.
const CAP: usize = 8 << 20;
/// The scripted owner's region: this many f32 elements (4 MiB).
const ELEMENTS: usize = 1 << 20;

/// The largest allocation on this thread while `f` runs.
async fn largest_allocation<T>(f: impl std::future::Future<Output = T>) -> (T, usize) {
    common::alloc::start();
    let out = f.await;
    (out, common::alloc::stop())
}

// ---------------------------------------------------------------------------------------------
// A scripted owner.

/// How the owner answers one read request.
#[derive(Debug, Clone, Copy)]
enum Reply {
    /// The right bytes. The head goes first and the payload after `pause`, so a reader sees the
    /// head before its payload has arrived.
    Honest { pause: Duration },
    /// A well-framed answer whose payload is this many bytes longer (or shorter) than the part.
    WrongLength(isize),
    /// The head and half the payload, then the connection closes.
    CutOff,
    /// The head and half the payload, then a pause, then the rest.
    Stall(Duration),
    /// A length prefix over the reader's cap, then the connection closes.
    Oversized,
    /// `Done`, as if it were an accumulate.
    Done,
}

const HONEST: Reply = Reply::Honest {
    pause: Duration::ZERO,
};

/// The region's bytes: element `i` is `i` as f32, little-endian.
fn contents() -> Arc<Vec<u8>> {
    static CONTENTS: std::sync::OnceLock<Arc<Vec<u8>>> = std::sync::OnceLock::new();
    Arc::clone(CONTENTS.get_or_init(|| {
        Arc::new(
            (0..ELEMENTS as u32)
                .flat_map(|i| (i as f32).to_le_bytes())
                .collect(),
        )
    }))
}

struct Owner {
    addr: String,
    script: Arc<Mutex<VecDeque<Reply>>>,
    connections: Arc<Mutex<usize>>,
}

impl Owner {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let script = Arc::new(Mutex::new(VecDeque::new()));
        let connections = Arc::new(Mutex::new(0));
        let data = contents();
        let (s, c) = (Arc::clone(&script), Arc::clone(&connections));
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                *c.lock().expect("count") += 1;
                tokio::spawn(serve(stream, Arc::clone(&s), Arc::clone(&data)));
            }
        });
        Self {
            addr,
            script,
            connections,
        }
    }

    /// Answer the next reads so (then honestly).
    fn script(&self, replies: &[Reply]) {
        self.script.lock().expect("script").extend(replies);
    }

    fn connections(&self) -> usize {
        *self.connections.lock().expect("count")
    }

    fn handle(&self, dtype: Dtype, elements: usize) -> RegionHandle {
        RegionHandle {
            owner: OWNER,
            id: REGION,
            kind: RegionKind::Published,
            dtype,
            len: elements as u64,
            version: 1,
            descriptor: Descriptor::Tcp {
                addr: self.addr.clone(),
                instance: 42,
            },
        }
    }
}

async fn serve(
    stream: tokio::net::TcpStream,
    script: Arc<Mutex<VecDeque<Reply>>>,
    data: Arc<Vec<u8>>,
) {
    stream.set_nodelay(true).expect("nodelay");
    let (read, mut write) = stream.into_split();
    let mut frames = FrameReader::new(read, HANDSHAKE_FRAME_CAP);
    let secret = ClusterSecret::new(SECRET).expect("secret");
    let Ok(keys) =
        handshake::accept(&mut frames, &mut write, &secret, deadline_in(TEST_BOUND)).await
    else {
        return;
    };
    // The reader seals its frames; so does this owner, as a real one does.
    let (read, mut write) = keys.seal(frames.into_inner(), write);
    let mut frames = FrameReader::new(read, 1 << 20);
    while let Ok(body) = frames.next().await {
        let (req, part, reply) = match Request::decode(body) {
            Ok(Request::Read { req, part, .. }) => {
                let reply = script.lock().expect("script").pop_front().unwrap_or(HONEST);
                (req, part.0 as usize..part.1 as usize, reply)
            }
            // Whatever else is asked, the answer is read data.
            Ok(other) => (other.req(), 0..4, HONEST),
            Err(_) => return,
        };
        let part = &data[part.start * 4..part.end * 4];
        if !answer(&mut write, req, part, reply).await {
            return;
        }
    }
}

/// Write `reply` to request `req` for the bytes `part`; false once the connection should end.
async fn answer(
    write: &mut SealedWrite<OwnedWriteHalf>,
    req: u64,
    part: &[u8],
    reply: Reply,
) -> bool {
    let (head, _) = Response::ReadOk {
        req,
        version: 1,
        dtype: Dtype::F32,
        data: Bytes::new(),
    }
    .encode();
    let framed = |payload_len: usize| {
        let mut out = ((head.len() + payload_len) as u32).to_be_bytes().to_vec();
        out.extend_from_slice(&head);
        out
    };
    let half = part.len() / 2;
    let sent = async {
        match reply {
            Reply::Honest { pause } => {
                write.write_all(&framed(part.len())).await?;
                write.flush().await?;
                tokio::time::sleep(pause).await;
                write.write_all(part).await?;
            }
            Reply::WrongLength(delta) => {
                let len = part.len().saturating_add_signed(delta);
                let payload: Vec<u8> = part.iter().copied().cycle().take(len).collect();
                write.write_all(&framed(len)).await?;
                write.write_all(&payload).await?;
            }
            Reply::CutOff => {
                write.write_all(&framed(part.len())).await?;
                write.write_all(&part[..half]).await?;
                write.flush().await?;
                return Ok(false);
            }
            Reply::Stall(pause) => {
                write.write_all(&framed(part.len())).await?;
                write.write_all(&part[..half]).await?;
                write.flush().await?;
                tokio::time::sleep(pause).await;
                write.write_all(&part[half..]).await?;
            }
            Reply::Oversized => {
                write.write_all(&(CAP as u32 + 1).to_be_bytes()).await?;
                write.write_all(&head).await?;
                write.flush().await?;
                return Ok(false);
            }
            Reply::Done => {
                let (head, payload) = Response::Done { req }.encode();
                write_frame(write, &head, &payload).await?;
            }
        }
        write.flush().await?;
        std::io::Result::Ok(true)
    };
    sent.await.unwrap_or(false)
}

// ---------------------------------------------------------------------------------------------
// The reader.

async fn reader(read_part_bytes: usize) -> TcpTransport {
    TcpTransport::bind(TcpConfig {
        remote: RemoteConfig {
            frame_cap: CAP,
            read_part_bytes,
            ..RemoteConfig::default()
        },
        ..TcpConfig::loopback(ClusterSecret::new(SECRET).expect("secret"))
    })
    .await
    .expect("reader binds")
}

/// Read `elements` elements from the start into a fresh byte buffer filled with 0xEE.
async fn read_bytes(
    reader: &TcpTransport,
    owner: &Owner,
    elements: usize,
    timeout: Duration,
) -> (Result<u64, TransportError>, Vec<u8>) {
    let mut into = vec![0xEEu8; elements * 4];
    let result = reader
        .read(
            &owner.handle(Dtype::F32, ELEMENTS),
            0..elements,
            Dest::Bytes(&mut into),
            deadline_in(timeout),
        )
        .await;
    (result, into)
}

fn expected(elements: usize) -> Vec<u8> {
    contents()[..elements * 4].to_vec()
}

/// A read of the first `elements` elements is served whole, at version 1.
async fn assert_read_whole(reader: &TcpTransport, owner: &Owner, elements: usize) {
    let (result, into) = read_bytes(reader, owner, elements, TEST_BOUND).await;
    assert_eq!(result, Ok(1));
    assert!(into == expected(elements), "a read of {elements} elements");
}

/// An `Unreachable` naming the owner, whose reason contains every one of `parts`.
fn assert_unreachable(result: Result<u64, TransportError>, parts: &[&str]) {
    match result {
        Err(TransportError::Unreachable { owner, reason }) => {
            assert_eq!(owner, OWNER);
            for part in parts {
                assert!(
                    reason.contains(part),
                    "{reason:?} does not mention {part:?}"
                );
            }
        }
        other => panic!("expected Unreachable mentioning {parts:?}, got {other:?}"),
    }
}

fn run(test: impl std::future::Future<Output = ()>) {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(async {
            tokio::time::timeout(TEST_BOUND, test)
                .await
                .expect("the test finishes in time")
        });
}

// ---------------------------------------------------------------------------------------------

#[test]
fn reads_in_parts_land_in_bytes_and_f32_destinations() {
    run(async {
        let owner = Owner::start().await;
        let reader = reader(512 * 1024).await;
        // Payloads that arrive after their heads, and ones already there: the two parts of
        // 512 KiB are lent to their requests, the last one (151,424 bytes) and the 16 small reads
        // below are received into the connection's buffer.
        for pause in [Duration::from_millis(5), Duration::ZERO] {
            owner.script(&[Reply::Honest { pause }; 3]);
            let (result, into) = read_bytes(&reader, &owner, 300_000, TEST_BOUND).await;
            assert_eq!(result, Ok(1));
            assert!(
                into == expected(300_000),
                "bytes after a pause of {pause:?}"
            );

            owner.script(&[Reply::Honest { pause }; 3]);
            let mut values = vec![-1.0f32; 300_000];
            let version = reader
                .read(
                    &owner.handle(Dtype::F32, ELEMENTS),
                    0..300_000,
                    Dest::F32(&mut values),
                    deadline_in(TEST_BOUND),
                )
                .await;
            assert_eq!(version, Ok(1));
            assert!(values.iter().enumerate().all(|(i, &v)| v == i as f32));
        }
        // Small reads, several in flight from several callers on the one connection.
        let reads = (0..16).map(|i| {
            let reader = &reader;
            let owner = &owner;
            async move {
                assert_read_whole(reader, owner, 100 + i).await;
            }
        });
        futures::future::join_all(reads).await;
        assert_eq!(owner.connections(), 1);
    });
}

#[test]
fn a_large_read_lands_in_the_destination_without_a_buffer_of_its_size() {
    run(async {
        let owner = Owner::start().await;
        let reader = reader(4 << 20).await;
        let elements = ELEMENTS; // 4 MiB in one part
        let mut into = vec![0u8; elements * 4];
        let handle = owner.handle(Dtype::F32, ELEMENTS);
        // Warm: the connection and its buffers.
        let warm = reader
            .read(
                &handle,
                0..elements,
                Dest::Bytes(&mut into),
                deadline_in(TEST_BOUND),
            )
            .await;
        assert_eq!(warm, Ok(1));
        for _ in 0..3 {
            into.fill(0);
            owner.script(&[Reply::Honest {
                pause: Duration::from_millis(5),
            }]);
            let (result, largest) = largest_allocation(reader.read(
                &handle,
                0..elements,
                Dest::Bytes(&mut into),
                deadline_in(TEST_BOUND),
            ))
            .await;
            assert_eq!(result, Ok(1));
            assert!(into == expected(elements));
            assert!(
                largest < 256 * 1024,
                "a read of {} bytes allocated {largest} bytes at once",
                elements * 4
            );
        }
    });
}

#[test]
fn answers_of_the_wrong_length_are_protocol_errors_and_the_connection_goes_on() {
    run(async {
        let owner = Owner::start().await;
        let reader = reader(64 * 1024).await;
        for delta in [-4, -1, 1, 4, 4096, -(64 * 1024)] {
            // One part of 16 KiB: the payload is refused before a byte is taken, the
            // destination is untouched.
            owner.script(&[Reply::WrongLength(delta)]);
            let (result, into) = read_bytes(&reader, &owner, 4096, TEST_BOUND).await;
            assert_unreachable(result, &["protocol violation", "bytes for a part of 4096"]);
            assert!(into.iter().all(|&b| b == 0xEE), "written despite {delta}");
            // The payload was discarded: the same connection answers the next read.
            assert_read_whole(&reader, &owner, 4096).await;
        }
        // A wrong part among parts in flight: the read fails, the other parts are received or
        // discarded, and the connection goes on.
        owner.script(&[HONEST, Reply::WrongLength(8), HONEST, HONEST]);
        let (result, _) = read_bytes(&reader, &owner, 64 * 1024, TEST_BOUND).await;
        assert_unreachable(result, &["protocol violation"]);
        assert_read_whole(&reader, &owner, 64 * 1024).await;
        // `Done` for a read.
        owner.script(&[Reply::Done]);
        let (result, _) = read_bytes(&reader, &owner, 16, TEST_BOUND).await;
        assert_unreachable(result, &["protocol violation", "Done"]);
        assert_eq!(owner.connections(), 1);
    });
}

#[test]
fn read_data_for_an_accumulate_is_a_protocol_error() {
    run(async {
        let owner = Owner::start().await;
        let reader = reader(64 * 1024).await;
        let mut handle = owner.handle(Dtype::F32, 4);
        handle.kind = RegionKind::Accumulator;
        let result = reader
            .accumulate(
                &handle,
                0,
                Bytes::from(vec![0u8; 16]),
                WriteTag {
                    epoch: 0,
                    write_id: 1,
                    token: 0,
                },
                deadline_in(TEST_BOUND),
            )
            .await;
        match result {
            Err(TransportError::Unreachable { owner, reason }) => {
                assert_eq!(owner, OWNER);
                assert!(reason.contains("answered with read data"), "{reason}");
            }
            other => panic!("expected a protocol violation, got {other:?}"),
        }
        // The unread payload was discarded: the same connection serves the next read.
        assert_read_whole(&reader, &owner, 16).await;
        assert_eq!(owner.connections(), 1);
    });
}

#[test]
fn a_payload_cut_off_by_a_closed_connection_fails_the_read_and_the_next_one_dials_again() {
    run(async {
        let owner = Owner::start().await;
        let reader = reader(4 << 20).await;
        for elements in [1 << 20, 1000] {
            owner.script(&[Reply::CutOff]);
            let (result, _) = read_bytes(&reader, &owner, elements, TEST_BOUND).await;
            assert_unreachable(result, &["stream ended inside a frame"]);
            assert_read_whole(&reader, &owner, elements).await;
        }
        assert_eq!(owner.connections(), 3);
    });
}

#[test]
fn a_frame_over_the_cap_fails_the_read_without_reserving_it() {
    run(async {
        let owner = Owner::start().await;
        let reader = reader(64 * 1024).await;
        owner.script(&[Reply::Oversized]);
        let ((result, _), largest) =
            largest_allocation(read_bytes(&reader, &owner, 16, TEST_BOUND)).await;
        assert_unreachable(result, &["exceeds the cap"]);
        assert!(
            largest < 1 << 20,
            "allocated {largest} bytes for a refused frame"
        );
        assert_read_whole(&reader, &owner, 16).await;
    });
}

#[test]
fn a_read_whose_deadline_passes_mid_payload_gives_the_stream_back() {
    run(async {
        let owner = Owner::start().await;
        let reader = reader(4 << 20).await;
        let elements = 1 << 20;
        owner.script(&[Reply::Stall(Duration::from_millis(600))]);
        let started = tokio::time::Instant::now();
        let (result, _) = read_bytes(&reader, &owner, elements, Duration::from_millis(200)).await;
        assert!(
            matches!(
                result,
                Err(TransportError::DeadlineExceeded { owner: OWNER, .. })
            ),
            "{result:?}"
        );
        assert!(
            started.elapsed() < Duration::from_millis(550),
            "{:?}",
            started.elapsed()
        );
        // The rest of that payload arrives later and is discarded; the connection serves the
        // next reads, large and small.
        for elements in [elements, 10] {
            assert_read_whole(&reader, &owner, elements).await;
        }
        assert_eq!(owner.connections(), 1);
    });
}
