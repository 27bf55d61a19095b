//! Fuzz target: `Response::decode`, the reader's decoder of an owner's frame body (the issue's
//! "Hostile input" clause; an owner is a peer too). Any bytes: it must not panic or allocate
//! beyond the body (the error of a `Failed` is JSON, parsed with serde_json's recursion limit),
//! and a body that decodes re-encodes to a body that decodes to the same response (byte for byte
//! except a `Failed`'s JSON).
//!
//! Run (from the repository root; cargo-fuzz needs a nightly toolchain):
//!
//! ```text
//! cargo install cargo-fuzz
//! cargo +nightly fuzz run response -- -max_total_time=60
//! ```
//!
//! A crash is saved under `fuzz/artifacts/response/`; replay it with
//! `cargo +nightly fuzz run response fuzz/artifacts/response/<file>`.

#![no_main]

#[path = "common/mod.rs"]
mod common;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use odc_transport::wire::Response;

fuzz_target!(|data: &[u8]| {
    if let Ok(response) = Response::decode(Bytes::copy_from_slice(data)) {
        common::response_round_trips(data, &response);
    }
});
