//! Fuzz target: a `FrameReader` over a peer's byte stream, every frame decoded as a `Request`
//! (the issue's "Hostile input" clause: truncated frames, length prefixes that disagree with what
//! follows, oversized prefixes). The first input byte is the reader's cap (0..=255 bytes, small
//! so oversized prefixes are common), the second how many bytes the stream hands over per read
//! (1..=64, so frames arrive split); the rest is the stream. Checks: no panic, no frame over the
//! cap, an `Oversized` error only for a prefix over the cap (and the reader stops there, as the
//! owner drops the connection), a stream cut inside a frame is an I/O error, and every frame that
//! decodes re-encodes to its bytes.
//!
//! Run (from the repository root; cargo-fuzz needs a nightly toolchain):
//!
//! ```text
//! cargo install cargo-fuzz
//! cargo +nightly fuzz run frames -- -max_total_time=60
//! ```
//!
//! A crash is saved under `fuzz/artifacts/frames/`; replay it with
//! `cargo +nightly fuzz run frames fuzz/artifacts/frames/<file>`.

#![no_main]

#[path = "common/mod.rs"]
mod common;

use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use libfuzzer_sys::fuzz_target;
use odc_transport::wire::frame::{FrameError, FrameReader, PREFIX};
use odc_transport::wire::{Request, WireError};
use tokio::io::{AsyncRead, ReadBuf};

/// An in-memory stream that hands over at most `step` bytes per read.
struct Trickle<'a> {
    rest: &'a [u8],
    step: usize,
}

impl AsyncRead for Trickle<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = self.rest.len().min(self.step).min(buf.remaining());
        let (now, later) = self.rest.split_at(n);
        buf.put_slice(now);
        self.rest = later;
        Poll::Ready(Ok(()))
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime")
    })
}

fuzz_target!(|data: &[u8]| {
    let [cap, step, stream @ ..] = data else {
        return;
    };
    let cap = usize::from(*cap);
    let step = usize::from(*step % 64) + 1;
    runtime().block_on(async {
        let mut reader = FrameReader::new(Trickle { rest: stream, step }, cap);
        let mut consumed = 0usize;
        loop {
            match reader.next().await {
                Ok(frame) => {
                    assert!(
                        frame.len() <= cap,
                        "a frame of {} over the cap {cap}",
                        frame.len()
                    );
                    consumed += PREFIX + frame.len();
                    if let Ok(request) = Request::decode(frame.clone()) {
                        common::request_round_trips(&frame, &request);
                    }
                }
                Err(FrameError::Closed) => {
                    assert_eq!(consumed, stream.len(), "closed only between frames");
                    return;
                }
                Err(FrameError::Io(_)) => {
                    assert!(consumed < stream.len(), "cut inside a frame");
                    return;
                }
                Err(FrameError::Wire(WireError::Oversized { len, cap: refused })) => {
                    assert_eq!(refused, cap as u64);
                    assert!(len > refused, "refused a prefix of {len} within the cap");
                    let prefix = stream
                        .get(consumed..consumed + PREFIX)
                        .expect("an oversized prefix was read whole");
                    assert_eq!(
                        u64::from(u32::from_be_bytes(prefix.try_into().expect("4 bytes"))),
                        len
                    );
                    return;
                }
                Err(FrameError::Wire(other)) => {
                    panic!("a frame reader only refuses sizes: {other}")
                }
            }
        }
    });
});
