//! Fuzz target: `Response::decode`, the reader's decoder of an owner's frame body (the issue's
//! "Hostile input" clause; an owner is a peer too). Any bytes: it must not panic or allocate
//! beyond the body (the error of a `Failed` is JSON, parsed with serde_json's recursion limit),
//! and a body that decodes re-encodes to a body that decodes to the same response (byte for byte
//! except a `Failed`'s JSON). `Response::decode_read_head` of the body's first bytes (what the
//! reader decodes before it receives a read's payload) agrees with it.
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
use odc_transport::wire::{ReadOkHead, Response, READ_OK_HEAD};

fuzz_target!(|data: &[u8]| {
    let whole = Response::decode(Bytes::copy_from_slice(data));
    if let Ok(response) = &whole {
        common::response_round_trips(data, response);
    }
    let head = Bytes::copy_from_slice(&data[..data.len().min(READ_OK_HEAD)]);
    match Response::decode_read_head(head) {
        Ok(Some(ReadOkHead {
            req,
            version,
            dtype,
        })) => assert_eq!(
            whole,
            Ok(Response::ReadOk {
                req,
                version,
                dtype,
                data: Bytes::copy_from_slice(&data[READ_OK_HEAD..]),
            })
        ),
        Ok(None) => assert!(!matches!(whole, Ok(Response::ReadOk { .. }))),
        Err(error) => assert_eq!(whole, Err(error)),
    }
});
