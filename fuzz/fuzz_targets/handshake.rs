//! Fuzz target: `HandshakeFrame::decode`, the first decoder an unauthenticated peer's bytes reach
//! on either side of a connection (the issue's "Hostile input" clause). Any bytes: it must not
//! panic, and a frame that decodes re-encodes within the handshake cap and decodes to itself
//! (byte for byte, except a `Refused` reason, which is decoded lossily and cut to the cap).
//!
//! Run (from the repository root; cargo-fuzz needs a nightly toolchain):
//!
//! ```text
//! cargo install cargo-fuzz
//! cargo +nightly fuzz run handshake -- -max_total_time=60
//! ```
//!
//! A crash is saved under `fuzz/artifacts/handshake/`; replay it with
//! `cargo +nightly fuzz run handshake fuzz/artifacts/handshake/<file>`.

#![no_main]

#[path = "common/mod.rs"]
mod common;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use odc_transport::wire::handshake::HandshakeFrame;

fuzz_target!(|data: &[u8]| {
    if let Ok(frame) = HandshakeFrame::decode(Bytes::copy_from_slice(data)) {
        common::handshake_round_trips(data, &frame);
    }
});
