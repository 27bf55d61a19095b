//! Fuzz target: an owner's connection service (`serve_connection`, reached through a real
//! `TcpTransport` on loopback) fed a hostile client's bytes (the issue's "Hostile input" clause).
//! Checks: no panic anywhere in the owner (a panic in any of its tasks aborts the fuzzer), and
//! every connection ends — the owner answers what it can, drops the connection on the first bad
//! frame and closes it when the client does — within a few seconds (a hang is a crash).
//!
//! Input: the first byte picks the mode, the rest is what the client sends.
//! - even: raw bytes before any handshake (garbage, a forged or truncated `Hello`, ...);
//! - odd, bit 1 clear: the handshake done properly (`wire::handshake::dial`), then records
//!   `len u8, body[len]`, each sent as one frame; a body that decodes as a request is first
//!   re-addressed to one of the owner's regions (by `region % 4`: a published region, an
//!   accumulator guarded by an admission check that takes odd tokens only, an inbox, or left as
//!   it is), so reads, accumulates and sends reach the fabric's checks; with bit 2 set, a body too short for its request's fields is first padded
//!   with zeros until it has them;
//! - odd, bit 1 set: the handshake, then the rest as a raw stream (length prefixes of any size).
//! - After the handshake what the client sends is sealed with the connection's keys
//!   (`wire::sealed`), as the owner expects, so every byte reaches its decoders; with bit 3 set
//!   it is sent unsealed instead, and the owner's sealed reader must refuse it.
//!
//! Regions are registered afresh for every input, so inputs do not depend on each other.
//!
//! Run (from the repository root; cargo-fuzz needs a nightly toolchain):
//!
//! ```text
//! cargo install cargo-fuzz
//! cargo +nightly fuzz run serve -- -max_total_time=60
//! ```
//!
//! A crash is saved under `fuzz/artifacts/serve/`; replay it with
//! `cargo +nightly fuzz run serve fuzz/artifacts/serve/<file>`.

#![no_main]

/// A connection's halves, sealed or not.
type BoxRead = Box<dyn tokio::io::AsyncRead + Send + Unpin>;
type BoxWrite = Box<dyn tokio::io::AsyncWrite + Send + Unpin>;

#[path = "common/mod.rs"]
mod common;

use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use odc_transport::tcp::{TcpConfig, TcpTransport};
use odc_transport::wire::frame::{write_frame, FrameReader};
use odc_transport::wire::handshake::{self, HANDSHAKE_FRAME_CAP};
use odc_transport::wire::{ClusterSecret, Request, Target, WireError};
use odc_transport::{deadline_in, Descriptor, Dtype, RegionHandle, RemoteConfig, Transport};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const OWNER: u32 = 7;
/// An authenticated peer's frames are capped at this (small, so large prefixes are refused).
const FRAME_CAP: usize = 64 * 1024;

struct Owner {
    runtime: tokio::runtime::Runtime,
    transport: TcpTransport,
    secret: ClusterSecret,
}

fn owner() -> &'static Owner {
    static OWNER_CELL: OnceLock<Owner> = OnceLock::new();
    OWNER_CELL.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a current-thread runtime");
        let secret = ClusterSecret::new("fuzz-serve-secret").expect("a secret");
        let config = TcpConfig {
            remote: RemoteConfig {
                frame_cap: FRAME_CAP,
                handshake_timeout: Duration::from_millis(500),
                inbox_capacity: 8,
                ..RemoteConfig::default()
            },
            ..TcpConfig::loopback(secret.clone())
        };
        let transport = runtime
            .block_on(TcpTransport::bind(config))
            .expect("the owner binds on loopback");
        Owner {
            runtime,
            transport,
            secret,
        }
    })
}

fn instance(handle: &RegionHandle) -> u64 {
    match &handle.descriptor {
        Descriptor::Tcp { instance, .. } => *instance,
        other => panic!("a tcp handle, got {other:?}"),
    }
}

/// `request` re-addressed to the region `targets[region % 4]` (`None`: left as it is).
fn readdress(request: Request, targets: &[Option<Target>; 4]) -> Request {
    let pick = |target: Target| targets[(target.region % 4) as usize].unwrap_or(target);
    match request {
        Request::Read {
            req,
            target,
            start,
            end,
            part,
            dest,
        } => Request::Read {
            req,
            target: pick(target),
            start,
            end,
            part,
            dest,
        },
        Request::Accumulate {
            req,
            target,
            offset,
            tag,
            data,
        } => Request::Accumulate {
            req,
            target: pick(target),
            offset,
            tag,
            data,
        },
        Request::Send {
            req,
            target,
            tag,
            data,
        } => Request::Send {
            req,
            target: pick(target),
            tag,
            data,
        },
        // Device payloads: a tcp owner refuses them, wherever they are addressed.
        other @ (Request::AccumulateDevice { .. } | Request::SendDevice { .. }) => other,
    }
}

/// What the client writes after the handshake, as whole frames, from `len u8, body` records;
/// with `complete`, a body too short for its request's fields is padded with zeros until it has
/// them (so short inputs reach the owner's checks).
fn frames(mut records: &[u8], targets: &[Option<Target>; 4], complete: bool) -> Vec<Bytes> {
    let mut out = Vec::new();
    while let [len, rest @ ..] = records {
        let (body, rest) = rest.split_at(usize::from(*len).min(rest.len()));
        records = rest;
        let mut body = body.to_vec();
        let decoded = loop {
            match Request::decode(Bytes::from(body.clone())) {
                // Each round adds the bytes a field lacked: at most the longest request's head.
                Err(WireError::Truncated { need, have, .. }) if complete && !body.is_empty() => {
                    body.resize(body.len() + (need - have), 0);
                }
                other => break other,
            }
        };
        out.push(match decoded {
            Ok(request) => common::body(readdress(request, targets).encode()),
            Err(_) => Bytes::from(body),
        });
    }
    out
}

async fn session(owner: &Owner, mode: u8, input: &[u8]) {
    let transport = &owner.transport;
    let published = transport
        .register_published(OWNER, Dtype::F32, Bytes::from(vec![0u8; 64]), 1)
        .expect("a published region");
    let accumulator = transport
        .register_accumulator(OWNER, 16, 0)
        .expect("an accumulator");
    // An owner's admission guard (C8): odd tokens are admitted, even ones refused, so both
    // paths are reached.
    accumulator
        .admit_only(std::sync::Arc::new(|tag: &odc_transport::WriteTag| {
            tag.token & 1 == 1
        }))
        .expect("a guard");
    let inbox = transport.register_inbox(OWNER, 0).expect("an inbox");
    let target = |handle: RegionHandle| {
        Some(Target {
            owner: handle.owner,
            instance: instance(&handle),
            region: handle.id,
        })
    };
    let targets = [
        target(published.handle()),
        target(accumulator.handle()),
        target(inbox.handle()),
        None,
    ];

    let stream = TcpStream::connect(transport.addr())
        .await
        .expect("the owner accepts");
    let (read, mut write) = stream.into_split();
    let mut reader = FrameReader::new(read, HANDSHAKE_FRAME_CAP);
    let authenticated = mode & 1 == 1;
    let (mut reader, mut write): (FrameReader<BoxRead>, BoxWrite) = if authenticated {
        let keys = handshake::dial(
            &mut reader,
            &mut write,
            &owner.secret,
            deadline_in(Duration::from_secs(5)),
        )
        .await
        .expect("the handshake with the right secret succeeds");
        if mode & 8 == 8 {
            // Unsealed bytes after the handshake: the owner's sealed reader must refuse them.
            (
                FrameReader::new(Box::new(reader.into_inner()), FRAME_CAP),
                Box::new(write),
            )
        } else {
            // The owner seals its frames; so does this client, so its bytes reach the decoders.
            let (read, write) = keys.seal(reader.into_inner(), write);
            (FrameReader::new(Box::new(read), FRAME_CAP), Box::new(write))
        }
    } else {
        let reader = FrameReader::new(
            Box::new(reader.into_inner()) as BoxRead,
            HANDSHAKE_FRAME_CAP,
        );
        (reader, Box::new(write))
    };
    let send = async {
        // A write error means the owner already dropped the connection: fine.
        if !authenticated || mode & 2 == 2 {
            let _ = write.write_all(input).await;
        } else {
            for frame in frames(input, &targets, mode & 4 == 4) {
                if write_frame(&mut write, &frame, &[]).await.is_err() {
                    break;
                }
            }
        }
        let _ = write.shutdown().await;
    };
    // Read the owner's answers until it closes (or breaks) the connection.
    let drain = async { while reader.next().await.is_ok() {} };
    tokio::join!(send, drain);
    drop((published, accumulator, inbox));
}

fuzz_target!(|data: &[u8]| {
    let [mode, input @ ..] = data else {
        return;
    };
    let owner = owner();
    owner.runtime.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), session(owner, *mode, input))
            .await
            .expect("the owner ends every connection within its handshake deadline or at EOF");
    });
});
