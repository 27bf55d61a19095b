//! Hostile peers against a real `TcpTransport` owner over loopback sockets: the issue's "Hostile
//! input" clause end to end. Garbage before the handshake, slow-loris peers, more idle peers than
//! a listener lets into the handshake (64: the rest are closed at once and counted), peers with the
//! wrong secret or a forged proof, and authenticated peers that send oversized, unknown or
//! truncated frames: each costs the owner a bounded buffer and at most the handshake deadline, its
//! connection is dropped with the reason logged, and the job is unaffected (a well-behaved reader
//! is served meanwhile and afterwards, and no region is touched).
//!
//! Every test runs on one current-thread runtime, so the owner's tasks run on the test's thread:
//! the log is captured per test (a thread-local `tracing` subscriber), and so is the largest
//! allocation (a global allocator that records it per thread).

mod common;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use odc_transport::tcp::{TcpConfig, TcpTransport};
use odc_transport::wire::frame::{write_frame, FrameError, FrameReader};
use odc_transport::wire::gate::{MAX_UNAUTHENTICATED, REFUSED_METRIC};
use odc_transport::wire::handshake::{self, HandshakeFrame, HANDSHAKE_FRAME_CAP, MAGIC, PROTOCOL};
use odc_transport::wire::sealed::{SealedRead, SealedWrite};
use odc_transport::wire::{read_frame, ClusterSecret};
use odc_transport::{
    deadline_in, AccumulatorRegion, Descriptor, Dest, Dtype, InboxRegion, PublishedRegion,
    RemoteConfig, Transport, TransportError, WriteTag,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// Every test as a whole.
const TEST_BOUND: Duration = Duration::from_secs(20);
/// How long an owner may take to drop a connection it has a reason to drop.
const DROP_BOUND: Duration = Duration::from_secs(3);
/// The owners' handshake deadline (short, so slow lorises are dropped quickly).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_millis(300);
const OWNER: u32 = 1;
const SECRET: &str = "hostile-peers-secret";

use common::alloc::{largest as largest_allocation, start as track_allocations};

// ---------------------------------------------------------------------------------------------
// The log, captured.

#[path = "common/log.rs"]
mod log;
use log::Log;

// ---------------------------------------------------------------------------------------------
// An owner with one region of each kind, and well-behaved readers.

fn config(secret: &str, frame_cap: usize) -> TcpConfig {
    TcpConfig {
        remote: RemoteConfig {
            frame_cap,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            ..RemoteConfig::default()
        },
        ..TcpConfig::loopback(ClusterSecret::new(secret).expect("secret"))
    }
}

struct Owner {
    transport: TcpTransport,
    published: Box<dyn PublishedRegion>,
    accumulator: Box<dyn AccumulatorRegion>,
    inbox: Box<dyn InboxRegion>,
}

/// The published region's contents: 256 f32s.
fn contents() -> Vec<u8> {
    (0..256u32).flat_map(|i| (i as f32).to_le_bytes()).collect()
}

async fn owner(frame_cap: usize) -> Owner {
    owner_with(config(SECRET, frame_cap)).await
}

async fn owner_with(config: TcpConfig) -> Owner {
    let transport = TcpTransport::bind(config).await.expect("owner binds");
    let published = transport
        .register_published(OWNER, Dtype::F32, Bytes::from(contents()), 1)
        .expect("published region");
    let accumulator = transport
        .register_accumulator(OWNER, 4, 0)
        .expect("accumulator");
    let inbox = transport.register_inbox(OWNER, 0).expect("inbox");
    Owner {
        transport,
        published,
        accumulator,
        inbox,
    }
}

async fn tcp_reader(secret: &str) -> TcpTransport {
    TcpTransport::bind(config(secret, RemoteConfig::DEFAULT_FRAME_CAP))
        .await
        .expect("reader binds")
}

/// A reader with another secret.
async fn stranger() -> TcpTransport {
    tcp_reader("not-the-secret-either").await
}

/// Read the whole published region of `owner` through `reader` into `into`.
async fn read_all(
    reader: &TcpTransport,
    owner: &Owner,
    into: &mut [u8],
) -> Result<u64, TransportError> {
    let deadline = deadline_in(Duration::from_secs(5));
    let handle = owner.published.handle();
    reader
        .read(&handle, 0..256, Dest::Bytes(into), deadline)
        .await
}

/// A well-behaved reader reads the whole published region, correctly.
async fn assert_served(reader: &TcpTransport, owner: &Owner) {
    let mut into = vec![0u8; contents().len()];
    let version = read_all(reader, owner, &mut into)
        .await
        .expect("a well-behaved reader is served");
    assert_eq!(version, 1);
    assert_eq!(into, contents());
}

fn within<F: Future>(future: F) -> tokio::time::Timeout<F> {
    tokio::time::timeout(TEST_BOUND, future)
}

/// One test against an owner with frame cap `frame_cap`, its log captured and the whole bounded:
/// `test` gets the log and the owner; afterwards the job is unaffected (a well-behaved reader is
/// served).
async fn against<F, Fut>(frame_cap: usize, test: F)
where
    F: FnOnce(Log, Arc<Owner>) -> Fut,
    Fut: Future<Output = ()>,
{
    let (log, _guard) = Log::capture();
    within(async {
        let owner = Arc::new(owner(frame_cap).await);
        test(log, Arc::clone(&owner)).await;
        assert_served(&tcp_reader(SECRET).await, &owner).await;
    })
    .await
    .expect("test bound");
}

/// A write of epoch 0, id 1.
fn first_write() -> WriteTag {
    WriteTag {
        epoch: 0,
        write_id: 1,
        token: 0,
    }
}

/// Wait until the owner drops `read`'s connection: the stream ends (EOF, or a reset when the
/// owner closed with bytes of ours unread). What the owner sent before that comes back.
async fn dropped(read: &mut (impl AsyncRead + Unpin)) -> Vec<u8> {
    let mut received = Vec::new();
    let mut buf = [0u8; 1024];
    let wait = async {
        loop {
            match read.read(&mut buf).await {
                Ok(0) => return,
                Ok(n) => received.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
                Err(e) => panic!("unexpected error while waiting for the drop: {e}"),
            }
        }
    };
    tokio::time::timeout(DROP_BOUND, wait)
        .await
        .expect("the owner drops the connection in time");
    received
}

/// A connection to `owner`, nothing sent yet.
async fn connect(owner: &Owner) -> TcpStream {
    TcpStream::connect(owner.transport.addr())
        .await
        .expect("connect")
}

/// A valid Hello with nonce `[nonce; 32]`.
fn hello(nonce: u8) -> HandshakeFrame {
    HandshakeFrame::Hello {
        magic: MAGIC,
        protocol: PROTOCOL,
        nonce: [nonce; 32],
    }
}

/// Connect and send a valid Hello by hand: the owner's Challenge has been received.
async fn challenged(owner: &Owner, nonce: u8) -> (FrameReader<OwnedReadHalf>, OwnedWriteHalf) {
    let (read, mut write) = connect(owner).await.into_split();
    write_frame(&mut write, &hello(nonce).encode(), &[])
        .await
        .expect("write");
    let mut reader = FrameReader::new(read, HANDSHAKE_FRAME_CAP);
    let challenge = reader.next().await.expect("a challenge");
    assert!(matches!(
        HandshakeFrame::decode(challenge),
        Ok(HandshakeFrame::Challenge { .. })
    ));
    (reader, write)
}

/// The halves of an authenticated connection: its frames sealed, as the owner expects them.
type Sealed = (
    FrameReader<SealedRead<OwnedReadHalf>>,
    SealedWrite<OwnedWriteHalf>,
);

/// Connect and complete the handshake by hand, as a peer that knows the secret; what it writes
/// then is sealed with the connection's keys, so the owner's decoders see every byte as sent
/// (and a write reaches the owner on `flush`).
async fn authenticated(owner: &Owner) -> Sealed {
    let (read, mut write) = connect(owner).await.into_split();
    let mut reader = FrameReader::new(read, HANDSHAKE_FRAME_CAP);
    let keys = handshake::dial(
        &mut reader,
        &mut write,
        &ClusterSecret::new(SECRET).expect("secret"),
        deadline_in(Duration::from_secs(5)),
    )
    .await
    .expect("the handshake with the right secret succeeds");
    let (read, write) = keys.seal(reader.into_inner(), write);
    (
        FrameReader::new(read, RemoteConfig::DEFAULT_FRAME_CAP),
        write,
    )
}

/// Write `bytes` and send them at once.
async fn send(write: &mut (impl AsyncWrite + Unpin), bytes: &[u8]) {
    write.write_all(bytes).await.expect("write");
    write.flush().await.expect("flush");
}

/// The owner dropped the connection of `reader` with no (further) answer, just the end of the
/// stream, and logged why in a line with every one of `parts`.
async fn assert_dropped<R: AsyncRead + Unpin>(
    reader: &mut FrameReader<R>,
    log: &Log,
    parts: &[&str],
) {
    let next = tokio::time::timeout(DROP_BOUND, reader.next())
        .await
        .expect("the owner drops the connection in time");
    match next {
        Err(FrameError::Closed) => {}
        Err(FrameError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("expected the connection dropped without an answer, got {other:?}"),
    }
    log.expect_line(parts).await;
}

// ---------------------------------------------------------------------------------------------
// (a) Garbage before the handshake.

#[tokio::test]
async fn http_request_before_the_handshake_is_dropped_and_the_job_unaffected() {
    against(RemoteConfig::DEFAULT_FRAME_CAP, |log, owner| async move {
        let mut stream = connect(&owner).await;
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: odc\r\n\r\n")
            .await
            .expect("write");
        let received = dropped(&mut stream).await;
        assert!(
            received.is_empty(),
            "nothing is sent to garbage: {received:?}"
        );
        // "GET " read as a length prefix is far over the handshake cap.
        log.expect_line(&["refused a connection", "exceeds the cap of 256 bytes"])
            .await;
    })
    .await;
}

#[tokio::test]
async fn garbage_hello_frames_are_dropped_and_the_job_unaffected() {
    against(RemoteConfig::DEFAULT_FRAME_CAP, |log, owner| async move {
        let hello = |magic, protocol| HandshakeFrame::Hello {
            magic,
            protocol,
            nonce: [7; 32],
        };
        let cases: [(Bytes, &str); 5] = [
            (Bytes::from_static(&[0x7f, 1, 2]), "unknown handshake type 0x7f"),
            (Bytes::from_static(&[0x10, b'O', b'D']), "frame truncated"),
            (hello(*b"HTTP", PROTOCOL).encode(), "bad magic"),
            (hello(MAGIC, PROTOCOL + 1).encode(), "protocol"),
            (
                HandshakeFrame::Welcome { mac: [0; 32] }.encode(),
                "expected Hello, got a Welcome",
            ),
        ];
        for (frame, reason) in cases {
            let (mut read, mut write) = connect(&owner).await.into_split();
            write_frame(&mut write, &frame, &[]).await.expect("write");
            let received = dropped(&mut read).await;
            if reason == "protocol" {
                // A version mismatch is told to the peer before the drop.
                let refused = read_frame(&received[..], HANDSHAKE_FRAME_CAP)
                    .await
                    .expect("a Refused frame");
                assert!(
                    matches!(HandshakeFrame::decode(refused), Ok(HandshakeFrame::Refused { ref reason }) if reason.contains("protocol")),
                    "{received:?}"
                );
            } else {
                assert!(received.is_empty(), "{reason}: {received:?}");
            }
            log.expect_line(&["refused a connection", reason]).await;
        }
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// (b) Slow loris.

#[tokio::test]
async fn slow_loris_peers_are_dropped_at_the_handshake_deadline_while_others_are_served() {
    against(RemoteConfig::DEFAULT_FRAME_CAP, |log, owner| async move {
        let start = Instant::now();
        // One sends nothing; one trickles a valid Hello a byte per 100 ms (4.3 s for its 43 bytes).
        let mut silent = connect(&owner).await;
        let (mut trickle_read, mut trickle_write) = connect(&owner).await.into_split();
        let body = hello(1).encode();
        let mut hello = (body.len() as u32).to_be_bytes().to_vec();
        hello.extend_from_slice(&body);
        let trickle = async move {
            for byte in hello {
                // A failed write: the owner dropped the connection already.
                if trickle_write.write_all(&[byte]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        let trickled = tokio::spawn(trickle);
        // Meanwhile, a well-behaved reader is served at once.
        let reader = tcp_reader(SECRET).await;
        assert_served(&reader, &owner).await;
        assert!(
            start.elapsed() < HANDSHAKE_TIMEOUT,
            "served while the lorises hold their connections ({:?})",
            start.elapsed()
        );
        let (silent_received, trickle_received) =
            tokio::join!(dropped(&mut silent), dropped(&mut trickle_read));
        let elapsed = start.elapsed();
        assert!(silent_received.is_empty() && trickle_received.is_empty());
        assert!(
            elapsed >= HANDSHAKE_TIMEOUT - Duration::from_millis(20),
            "dropped at the deadline, not before ({elapsed:?})"
        );
        assert!(elapsed < HANDSHAKE_TIMEOUT + DROP_BOUND, "{elapsed:?}");
        trickled.abort();
        log.expect_line(&[
            "refused a connection",
            "did not complete by its deadline (waiting for Hello)",
        ])
        .await;
        assert_served(&reader, &owner).await;
    })
    .await;
}

#[tokio::test]
async fn a_peer_that_stalls_before_its_proof_is_dropped_at_the_handshake_deadline() {
    against(RemoteConfig::DEFAULT_FRAME_CAP, |log, owner| async move {
        let (mut reader, write) = challenged(&owner, 3).await;
        let start = Instant::now();
        assert_dropped(
            &mut reader,
            &log,
            &["refused a connection", "waiting for Proof"],
        )
        .await;
        assert!(start.elapsed() < HANDSHAKE_TIMEOUT + DROP_BOUND);
        drop(write);
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// (c) The wrong secret.

fn unreachable_for_the_secret(result: Result<(), TransportError>) {
    match result {
        Err(TransportError::Unreachable { owner, reason }) => {
            assert_eq!(owner, OWNER);
            assert!(
                reason.contains("did not prove the cluster secret"),
                "the reason names the failed proof: {reason}"
            );
        }
        other => panic!("expected Unreachable, got {other:?}"),
    }
}

#[tokio::test]
async fn a_reader_with_the_wrong_secret_reads_nothing() {
    against(RemoteConfig::DEFAULT_FRAME_CAP, |log, owner| async move {
        let mut into = vec![0xAAu8; contents().len()];
        let result = read_all(&stranger().await, &owner, &mut into).await;
        unreachable_for_the_secret(result.map(|_| ()));
        assert!(into.iter().all(|&b| b == 0xAA), "not a byte of the region");
        log.expect_line(&["refused a connection"]).await;
    })
    .await;
}

#[tokio::test]
async fn a_peer_with_the_wrong_secret_cannot_accumulate() {
    against(RemoteConfig::DEFAULT_FRAME_CAP, |log, owner| async move {
        let ones: Vec<u8> = [1.0f32; 4].iter().flat_map(|v| v.to_le_bytes()).collect();
        let deadline = deadline_in(Duration::from_secs(5));
        let result = stranger()
            .await
            .accumulate(
                &owner.accumulator.handle(),
                0,
                Bytes::from(ones),
                first_write(),
                deadline,
            )
            .await;
        unreachable_for_the_secret(result);
        log.expect_line(&["refused a connection"]).await;
        assert_eq!(owner.accumulator.take(1), vec![0.0; 4], "nothing was added");
    })
    .await;
}

#[tokio::test]
async fn a_peer_with_the_wrong_secret_cannot_send() {
    against(RemoteConfig::DEFAULT_FRAME_CAP, |log, owner| async move {
        let deadline = deadline_in(Duration::from_secs(5));
        let message = Bytes::from_static(b"let me in");
        let result = stranger()
            .await
            .send(&owner.inbox.handle(), first_write(), message, deadline)
            .await;
        unreachable_for_the_secret(result);
        log.expect_line(&["refused a connection"]).await;
        let held = owner
            .inbox
            .recv(first_write(), deadline_in(Duration::from_millis(100)))
            .await;
        assert!(
            matches!(held, Err(TransportError::DeadlineExceeded { .. })),
            "no message was delivered: {held:?}"
        );
    })
    .await;
}

#[tokio::test]
async fn a_forged_proof_is_refused_with_a_reason_and_dropped() {
    against(RemoteConfig::DEFAULT_FRAME_CAP, |log, owner| async move {
        let (mut reader, mut write) = challenged(&owner, 9).await;
        // A peer that ignores the challenge's MAC and guesses a proof.
        let proof = HandshakeFrame::Proof { mac: [0; 32] };
        write_frame(&mut write, &proof.encode(), &[])
            .await
            .expect("write");
        let refused = reader.next().await.expect("a Refused frame");
        match HandshakeFrame::decode(refused) {
            Ok(HandshakeFrame::Refused { reason }) => assert!(
                reason.contains("did not prove the cluster secret"),
                "{reason}"
            ),
            other => panic!("expected Refused, got {other:?}"),
        }
        let why = ["refused a connection", "proof MAC does not match"];
        assert_dropped(&mut reader, &log, &why).await;
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// (d) Authenticated peers that break the protocol.

#[tokio::test]
async fn authenticated_peers_sending_bad_frames_are_dropped_and_the_job_unaffected() {
    against(RemoteConfig::DEFAULT_FRAME_CAP, |log, owner| async move {
        let well_behaved = tcp_reader(SECRET).await;
        let cases: [(&[u8], &str); 4] = [
            // A length prefix over the cap: refused before reading (or reserving) the body.
            (&u32::MAX.to_be_bytes(), "exceeds the cap"),
            // An unknown request type.
            (&[0, 0, 0, 3, 0x7f, 1, 2], "unknown request type 0x7f"),
            // A read request cut after its id.
            (
                &[0, 0, 0, 9, 0x01, 1, 0, 0, 0, 0, 0, 0, 0],
                "frame truncated",
            ),
            // A read request with a byte too many.
            (
                &{
                    let mut frame = [0u8; 4 + 91];
                    frame[..4].copy_from_slice(&91u32.to_be_bytes());
                    frame[4] = 0x01;
                    frame
                },
                "unexpected bytes after a read request",
            ),
        ];
        for (bytes, reason) in cases {
            let (mut reader, mut write) = authenticated(&owner).await;
            send(&mut write, bytes).await;
            assert_dropped(&mut reader, &log, &["dropped a connection", reason]).await;
            assert_served(&well_behaved, &owner).await;
        }
    })
    .await;
}

#[tokio::test]
async fn an_authenticated_peer_is_answered_until_its_first_bad_frame() {
    against(RemoteConfig::DEFAULT_FRAME_CAP, |log, owner| async move {
        let (mut reader, mut write) = authenticated(&owner).await;
        // A request for a region that does not exist is a typed answer, not a drop.
        let (head, payload) = odc_transport::wire::Request::Send {
            req: 5,
            target: odc_transport::wire::Target {
                owner: OWNER,
                instance: 0,
                region: 12345,
            },
            tag: first_write(),
            data: Bytes::from_static(b"hi"),
        }
        .encode();
        write_frame(&mut write, &head, &payload)
            .await
            .expect("write");
        let answer = reader.next().await.expect("an answer");
        assert!(
            matches!(
                odc_transport::wire::Response::decode(answer),
                Ok(odc_transport::wire::Response::Failed {
                    req: 5,
                    error: TransportError::UnknownRegion { .. }
                })
            ),
            "a typed refusal"
        );
        write_frame(&mut write, &[0x06], &[]).await.expect("write");
        assert_dropped(
            &mut reader,
            &log,
            &["dropped a connection", "unknown request type 0x06"],
        )
        .await;
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// (e) A huge length prefix, then a stall.

/// A well-behaved reader, served; then an authenticated connection that announced a 60 MiB
/// frame, allocations tracked from just before the announcement.
async fn announced_60_mib(
    owner: &Owner,
) -> (
    TcpTransport,
    FrameReader<SealedRead<OwnedReadHalf>>,
    SealedWrite<OwnedWriteHalf>,
) {
    let well_behaved = tcp_reader(SECRET).await;
    assert_served(&well_behaved, owner).await;
    let (reader, mut write) = authenticated(owner).await;
    track_allocations();
    send(&mut write, &(60u32 << 20).to_be_bytes()).await;
    (well_behaved, reader, write)
}

#[tokio::test]
async fn a_stalled_60_mib_frame_costs_at_most_the_cap_and_is_dropped_when_the_peer_closes() {
    let cap = RemoteConfig::DEFAULT_FRAME_CAP;
    against(cap, |log, owner| async move {
        let (well_behaved, mut reader, mut write) = announced_60_mib(&owner).await;
        send(&mut write, &[0x02; 100]).await;
        // The peer stalls; the owner keeps serving everyone else.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_served(&well_behaved, &owner).await;
        }
        let largest = largest_allocation();
        // The owner reserves room for the announced frame (a known cost: an authenticated
        // peer can hold up to the cap per connection), never more than the cap.
        assert!(
            largest <= cap + 4,
            "largest allocation {largest} bytes, cap {cap}"
        );
        // Closing its side mid-frame gets the connection dropped, with the reason.
        write.shutdown().await.expect("shutdown");
        assert_dropped(
            &mut reader,
            &log,
            &["dropped a connection", "stream ended inside a frame"],
        )
        .await;
    })
    .await;
}

#[tokio::test]
async fn a_60_mib_prefix_over_a_smaller_cap_allocates_nothing_and_is_dropped_at_once() {
    against(1 << 20, |log, owner| async move {
        let (_well_behaved, mut reader, _write) = announced_60_mib(&owner).await;
        // No close: the owner drops the connection on the prefix alone.
        let why = ["dropped a connection", "exceeds the cap of 1048576 bytes"];
        assert_dropped(&mut reader, &log, &why).await;
        let largest = largest_allocation();
        assert!(
            largest < 64 * 1024,
            "largest allocation {largest} bytes for a refused 60 MiB prefix"
        );
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// (f) Many idle connections at once.

/// The gate test's handshake deadline: long enough that its 64 idle connections are all still in
/// the handshake while the extra ones arrive, even on a loaded machine.
const GATE_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// Whether the owner has closed `stream` (EOF or a reset) without waiting for it.
fn closed_now(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match stream.try_read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

#[tokio::test]
async fn at_most_64_connections_per_listener_are_in_the_handshake_and_extra_ones_are_closed_at_once(
) {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let metrics = recorder.handle();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let (log, _guard) = Log::capture();
    within(async {
        let owner = owner_with(TcpConfig {
            remote: RemoteConfig {
                handshake_timeout: GATE_HANDSHAKE_TIMEOUT,
                ..RemoteConfig::default()
            },
            ..TcpConfig::loopback(ClusterSecret::new(SECRET).expect("secret"))
        })
        .await;
        let addr = owner.transport.addr().to_owned();
        // 64 peers connect and say nothing: every place in the handshake is taken. (The owner
        // accepts in the order the connections were made.)
        let mut idle = Vec::new();
        for _ in 0..MAX_UNAUTHENTICATED {
            idle.push(TcpStream::connect(&addr).await.expect("connect"));
        }
        // 8 more are closed at once: EOF before the deadline frees any of the 64.
        const EXTRA: usize = 8;
        for _ in 0..EXTRA {
            let mut extra = TcpStream::connect(&addr).await.expect("connect");
            let received = dropped(&mut extra).await;
            assert!(received.is_empty(), "nothing is sent to it: {received:?}");
        }
        assert!(
            !idle.iter().any(closed_now),
            "the extra connections were closed while all 64 idle ones were still held"
        );
        log.expect_line(&[
            "closed a connection at once",
            "64 are in the handshake already",
        ])
        .await;
        // While the 64 are held, a peer with the secret is refused too (the documented price).
        let reader = tcp_reader(SECRET).await;
        let mut into = vec![0u8; contents().len()];
        let refused = read_all(&reader, &owner, &mut into).await;
        assert!(
            matches!(refused, Err(TransportError::Unreachable { .. })),
            "{refused:?}"
        );
        // The deadline drops the 64 idle ones, which frees their places: the reader is served.
        let freed = async {
            for stream in &mut idle {
                dropped(stream).await;
            }
        };
        tokio::time::timeout(GATE_HANDSHAKE_TIMEOUT + DROP_BOUND, freed)
            .await
            .expect("the handshake deadline drops the idle connections");
        assert_served(&reader, &owner).await;
        let text = metrics.render();
        let line = format!("{REFUSED_METRIC}{{listener=\"tcp\"}} {}", EXTRA + 1);
        assert!(
            text.lines().any(|l| l == line),
            "expected the line {line:?} in\n{text}"
        );
    })
    .await
    .expect("test bound");
}

/// A device send (`Request::SendDevice`) to an owner that has no device: a typed refusal naming
/// it, the connection kept, and nothing delivered into the inbox (the write id stays free).
#[tokio::test]
async fn a_device_send_to_an_owner_without_a_device_is_refused_and_delivers_nothing() {
    against(RemoteConfig::DEFAULT_FRAME_CAP, |_log, owner| async move {
        let handle = owner.inbox.handle();
        let Descriptor::Tcp { instance, .. } = handle.descriptor else {
            panic!("a tcp handle: {:?}", handle.descriptor);
        };
        let (mut reader, mut write) = authenticated(&owner).await;
        let (head, payload) = odc_transport::wire::Request::SendDevice {
            req: 6,
            target: odc_transport::wire::Target {
                owner: handle.owner,
                instance,
                region: handle.id,
            },
            tag: first_write(),
            source: odc_transport::wire::IpcSource {
                ipc_handle: [1; odc_transport::wire::IPC_HANDLE_BYTES],
                offset: 0,
                bytes: 8,
            },
            data: Bytes::from_static(b"head"),
        }
        .encode();
        write_frame(&mut write, &head, &payload)
            .await
            .expect("write");
        let answer = reader.next().await.expect("an answer");
        match odc_transport::wire::Response::decode(answer) {
            Ok(odc_transport::wire::Response::Failed {
                req: 6,
                error: TransportError::Unsupported { what },
            }) => assert!(what.contains("has no device"), "{what}"),
            other => panic!("expected a typed refusal, got {other:?}"),
        }
        // Nothing arrived: the same write id is free for a host send, which is received.
        let reader_transport = tcp_reader(SECRET).await;
        reader_transport
            .send(
                &handle,
                first_write(),
                Bytes::from_static(b"host"),
                deadline_in(Duration::from_secs(5)),
            )
            .await
            .expect("the write id is free");
        let got = owner
            .inbox
            .recv(first_write(), deadline_in(Duration::from_secs(5)))
            .await
            .expect("received");
        assert_eq!(&got[..], b"host");
    })
    .await;
}
