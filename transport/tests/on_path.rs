//! An attacker on the path between a reader and an owner over `tcp`: a proxy that passes the
//! handshake untouched, then flips a bit in, replays, drops or reorders one of the reader's sealed
//! records (`odc_transport::wire::sealed`). Each is refused at the owner with its reason logged,
//! nothing the touched record or a later one carried is applied, and the writes before it are
//! applied once. Without an attack the same writes all land: the proxy itself changes nothing.

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

#[path = "common/log.rs"]
mod log;
use log::Log;

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

/// An owner and a reader over `tcp` on loopback, both sealing their frames (the default).
async fn owner_and_reader() -> (TcpTransport, TcpTransport) {
    let bind = || async {
        let secret = ClusterSecret::new(SECRET).expect("secret");
        TcpTransport::bind(TcpConfig::loopback(secret))
            .await
            .expect("binds on loopback")
    };
    (bind().await, bind().await)
}

/// Three writes (1, 2, 4 in every element) through a proxy that attacks record `at`: what each
/// write returned and what the accumulator holds after. With `forged`, the owner must have
/// logged that it dropped the connection for a forged frame.
async fn three_writes(
    attack: Attack,
    at: usize,
    forged: bool,
) -> (Vec<Result<(), TransportError>>, Vec<f32>) {
    let (log, _guard) = Log::capture();
    let (owner, reader) = owner_and_reader().await;
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
    if forged {
        log.expect_line(&["dropped a connection", "forged frame"])
            .await;
    }
    (results, accumulator.take(1))
}

/// Read the whole published region `handle` into `into`: the version read.
async fn read_into(
    reader: &TcpTransport,
    handle: &RegionHandle,
    into: &mut [u8],
) -> Result<u64, TransportError> {
    let range = 0..into.len() / 4;
    let dest = odc_transport::Dest::Bytes(into);
    reader
        .read(handle, range, dest, deadline_in(WRITE_BOUND))
        .await
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
    let (results, values) = three_writes(Attack::None, 1, false).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(values, vec![7.0; LEN]);
}

#[tokio::test]
async fn each_on_path_change_is_refused_and_nothing_it_carried_is_applied() {
    for attack in [Attack::Flip, Attack::Replay, Attack::Drop, Attack::Reorder] {
        let (results, values) = three_writes(attack, 1, true).await;
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
    }
}

/// The owner's answer changed on the path: the reader refuses it, naming the owner and the
/// forgery, and the next read (a new connection, untouched) reads the region as published.
#[tokio::test]
async fn a_forged_answer_fails_the_read_naming_the_owner() {
    let (owner, reader) = owner_and_reader().await;
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
    let read = read_into(&reader, &through(published.handle(), &via), &mut into).await;
    match read {
        Err(TransportError::Unreachable { owner: o, reason }) => {
            assert_eq!(o, OWNER);
            assert!(reason.contains("forged frame"), "{reason}");
        }
        other => panic!("expected the forged answer refused, got {other:?}"),
    }
    let direct = read_into(&reader, &published.handle(), &mut into).await;
    assert_eq!(direct.expect("an untouched read"), 1);
    assert_eq!(into, values);
}
