//! An attacker on the path between a reader and an owner over `tcp`: a proxy that passes the
//! handshake untouched, then flips a bit in, replays, drops or reorders one of the reader's sealed
//! records (`odc_transport::wire::sealed`). Each is refused at the owner with its reason logged,
//! nothing the touched record or a later one carried is applied, and the writes before it are
//! applied once. Without an attack the same writes all land: the proxy itself changes nothing.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use odc_transport::tcp::{TcpConfig, TcpTransport};
use odc_transport::wire::ClusterSecret;
use odc_transport::{deadline_in, Descriptor, RegionHandle, Transport, TransportError, WriteTag};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

const SECRET: &str = "on-path-attacker-test-secret";
const OWNER: u32 = 1;
/// Elements of the accumulator.
const LEN: usize = 4;
/// How long one write waits for its acknowledgement.
const WRITE_BOUND: Duration = Duration::from_millis(1500);

/// What the proxy does to the reader's record `at` (0: the first after the handshake).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Attack {
    None,
    Flip,
    Replay,
    Drop,
    Reorder,
}

/// This thread's `tracing` events (the owner's tasks run on the test's thread).
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log").extend_from_slice(buf);
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

impl Log {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log")).into_owned()
    }
}

/// One length-prefixed frame (the handshake's) or sealed record (`tag` more bytes), read whole.
async fn unit(read: &mut OwnedReadHalf, tag: usize) -> Option<Vec<u8>> {
    let mut prefix = [0u8; 4];
    read.read_exact(&mut prefix).await.ok()?;
    let len = u32::from_be_bytes(prefix) as usize;
    let mut out = prefix.to_vec();
    out.resize(4 + len + tag, 0);
    read.read_exact(&mut out[4..]).await.ok()?;
    Some(out)
}

/// Forward the reader's side: its two handshake frames as they are, then its records, `attack`
/// applied to record `at`.
async fn forward(mut from: OwnedReadHalf, to: &mut OwnedWriteHalf, attack: Attack, at: usize) {
    for _ in 0..2 {
        let Some(frame) = unit(&mut from, 0).await else {
            return;
        };
        if to.write_all(&frame).await.is_err() {
            return;
        }
    }
    let mut previous: Option<Vec<u8>> = None;
    let mut held: Option<Vec<u8>> = None;
    let mut n = 0;
    while let Some(mut record) = unit(&mut from, 16).await {
        let mut out = vec![];
        match attack {
            _ if n != at => out.push(record.clone()),
            Attack::None => out.push(record.clone()),
            Attack::Flip => {
                let last = record.len() - 20;
                record[4 + last / 2] ^= 0x04;
                out.push(record.clone());
            }
            Attack::Replay => out.push(previous.clone().expect("a record before")),
            Attack::Drop => {}
            Attack::Reorder => held = Some(record.clone()),
        }
        if n == at + 1 {
            out.extend(held.take());
        }
        for r in out {
            if to.write_all(&r).await.is_err() {
                return;
            }
        }
        previous = Some(record);
        n += 1;
    }
}

/// A proxy in front of `owner_addr` for one connection, attacking the reader's records as said
/// and passing the owner's; its address.
async fn proxy(owner_addr: String, attack: Attack, at: usize) -> String {
    proxy_both(owner_addr, (attack, at), (Attack::None, 0)).await
}

/// A proxy attacking the reader's records as `up` says and the owner's as `down` says.
async fn proxy_both(
    owner_addr: String,
    (attack, at): (Attack, usize),
    down: (Attack, usize),
) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    tokio::spawn(async move {
        let Ok((reader, _)) = listener.accept().await else {
            return;
        };
        let owner = TcpStream::connect(&owner_addr).await.expect("the owner");
        let (reader_read, reader_write) = reader.into_split();
        let (owner_read, mut owner_write) = owner.into_split();
        let back = tokio::spawn(async move {
            let mut reader_write = reader_write;
            forward(owner_read, &mut reader_write, down.0, down.1).await;
        });
        forward(reader_read, &mut owner_write, attack, at).await;
        let _ = owner_write.shutdown().await;
        back.abort();
    });
    addr
}

/// Three writes (1, 2, 4 in every element) through a proxy that attacks record `at`: what each
/// write returned, what the accumulator holds after, and the owner's log.
async fn three_writes(
    attack: Attack,
    at: usize,
) -> (Vec<Result<(), TransportError>>, Vec<f32>, String) {
    let log = Log::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(log.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let secret = || ClusterSecret::new(SECRET).expect("secret");
    let owner = TcpTransport::bind(TcpConfig::loopback(secret()))
        .await
        .expect("owner");
    let reader = TcpTransport::bind(TcpConfig::loopback(secret()))
        .await
        .expect("reader");
    let accumulator = owner
        .register_accumulator(OWNER, LEN, 0)
        .expect("accumulator");
    let via = proxy(owner.addr().to_string(), attack, at).await;
    let handle = through(accumulator.handle(), &via);
    let mut results = Vec::new();
    for i in 0..3u32 {
        let value = f32::from(1u8 << i);
        let data: Vec<u8> = (0..LEN).flat_map(|_| value.to_le_bytes()).collect();
        let tag = WriteTag {
            epoch: 0,
            write_id: u128::from(i) + 1,
            token: 0,
        };
        let written = reader
            .accumulate(&handle, 0, Bytes::from(data), tag, deadline_in(WRITE_BOUND))
            .await;
        results.push(written);
    }
    // Let the owner log what it dropped before the log is read.
    tokio::time::sleep(Duration::from_millis(100)).await;
    (results, accumulator.take(1), log.text())
}

/// `handle` reached through the proxy at `addr`.
fn through(mut handle: RegionHandle, addr: &str) -> RegionHandle {
    match &mut handle.descriptor {
        Descriptor::Tcp { addr: a, .. } => *a = addr.to_string(),
        other => panic!("a tcp handle, got {other:?}"),
    }
    handle
}

#[tokio::test]
async fn a_proxy_that_changes_nothing_changes_nothing() {
    let (results, values, _) = three_writes(Attack::None, 1).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(values, vec![7.0; LEN]);
}

#[tokio::test]
async fn each_on_path_change_is_refused_and_nothing_it_carried_is_applied() {
    for attack in [Attack::Flip, Attack::Replay, Attack::Drop, Attack::Reorder] {
        let (results, values, log) = three_writes(attack, 1).await;
        assert!(
            results[0].is_ok(),
            "{attack:?}: the first write is genuine: {results:?}"
        );
        assert!(
            results[1].is_err() && results[2].is_err(),
            "{attack:?}: the touched write and the next fail: {results:?}"
        );
        assert_eq!(
            values,
            vec![1.0; LEN],
            "{attack:?}: only the first write applied"
        );
        assert!(
            log.lines()
                .any(|l| l.contains("dropped a connection") && l.contains("forged frame")),
            "{attack:?}: the owner names the forgery; its log:\n{log}"
        );
    }
}

/// The owner's answer changed on the path: the reader refuses it, naming the owner and the
/// forgery, and the next read (a new connection, untouched) reads the region as published.
#[tokio::test]
async fn a_forged_answer_fails_the_read_naming_the_owner() {
    let secret = || ClusterSecret::new(SECRET).expect("secret");
    let owner = TcpTransport::bind(TcpConfig::loopback(secret()))
        .await
        .expect("owner");
    let reader = TcpTransport::bind(TcpConfig::loopback(secret()))
        .await
        .expect("reader");
    let values: Vec<u8> = (0..LEN as u32)
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect();
    let published = owner
        .register_published(
            OWNER,
            odc_transport::Dtype::F32,
            Bytes::from(values.clone()),
            1,
        )
        .expect("published");
    let via = proxy_both(
        owner.addr().to_string(),
        (Attack::None, 0),
        (Attack::Flip, 0),
    )
    .await;
    let mut into = vec![0u8; LEN * 4];
    let read = reader
        .read(
            &through(published.handle(), &via),
            0..LEN,
            odc_transport::Dest::Bytes(&mut into),
            deadline_in(WRITE_BOUND),
        )
        .await;
    match read {
        Err(TransportError::Unreachable { owner: o, reason }) => {
            assert_eq!(o, OWNER);
            assert!(reason.contains("forged frame"), "{reason}");
        }
        other => panic!("expected the forged answer refused, got {other:?}"),
    }
    let direct = reader
        .read(
            &published.handle(),
            0..LEN,
            odc_transport::Dest::Bytes(&mut into),
            deadline_in(WRITE_BOUND),
        )
        .await;
    assert_eq!(direct.expect("an untouched read"), 1);
    assert_eq!(into, values);
}
