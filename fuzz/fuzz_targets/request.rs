//! Fuzz target: `Request::decode`, the owner's decoder of a reader's frame body (the issue's
//! "Hostile input" clause). Any bytes: it must not panic or allocate beyond the body, and a body
//! that decodes re-encodes to exactly those bytes (and decodes again to the same request).
//!
//! Run (from the repository root; cargo-fuzz needs a nightly toolchain):
//!
//! ```text
//! cargo install cargo-fuzz
//! cargo +nightly fuzz run request -- -max_total_time=60
//! ```
//!
//! A crash is saved under `fuzz/artifacts/request/`; replay it with
//! `cargo +nightly fuzz run request fuzz/artifacts/request/<file>`.

#![no_main]

#[path = "common/mod.rs"]
mod common;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use odc_transport::wire::Request;

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = Request::decode(Bytes::copy_from_slice(data)) {
        common::request_round_trips(data, &request);
    }
});
