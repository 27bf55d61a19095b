//! The decoders of peer bytes under random input: the "Hostile input" clause (no panic, no
//! unbounded allocation from a peer's length field, every bad frame a typed error, everything that
//! decodes re-encodes identically). The fuzz targets in `fuzz/` explore the same decoders with
//! coverage guidance; this file runs in every `cargo test`, 130,000 cases in all:
//!
//! | test | cases | input |
//! |------|-------|-------|
//! | `arbitrary_bytes_decode_or_fail_typed` | 40,000 | any bytes, to all three decoders |
//! | `mutated_encodings_decode_or_fail_typed` | 40,000 | a valid encoding truncated, with a byte flipped, with trailing bytes, or with its type byte replaced |
//! | `every_truncation_of_a_valid_encoding_fails_typed` | 5,000 | a valid encoding cut at every length |
//! | `frame_reader_follows_the_length_prefixes` | 15,000 | frames whose prefixes may disagree with their bodies, split across reads |
//! | `frames_taken_in_two_steps_follow_the_length_prefixes` | 15,000 | the same, each frame's head taken first and its body copied out, buffered or left to be discarded |
//! | `read_heads_agree_with_whole_responses` | 5,000 | any bytes, to the read head decoder and the response decoder |
//! | `read_heads_of_damaged_responses_agree_with_whole_responses` | 5,000 | a valid response truncated, flipped, extended or retyped, likewise |
//! | `oversized_prefixes_are_refused_without_allocating` | 5,000 | a length prefix over the cap |
//!
//! Message decoders: [`Request::decode`], [`Response::decode`] (and the reader's
//! [`Response::decode_read_head`], which must agree with it), [`HandshakeFrame::decode`]; the
//! framing layer: [`FrameReader`], whole frames and frames taken head first. A global allocator
//! records the largest allocation each test thread makes, so "no allocation from a peer's length
//! field" is measured, not assumed.

mod common;

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use odc_transport::wire::frame::{FrameError, FrameReader, PREFIX};
use odc_transport::wire::handshake::{HandshakeFrame, HANDSHAKE_FRAME_CAP};
use odc_transport::wire::{
    IpcSource, ReadOkHead, Request, Response, Target, WireError, IPC_HANDLE_BYTES, READ_OK_HEAD,
};
use odc_transport::{DestSpec, DeviceDest, Dtype, Op, RemoteConfig, TransportError, WriteTag};
use proptest::prelude::*;
use proptest::sample::Index;
use tokio::io::{AsyncRead, ReadBuf};

use common::alloc::during as largest_allocation;

// ---------------------------------------------------------------------------------------------
// Decoding with every outcome checked.

/// Type bytes of the layout (`wire::message`, `wire::handshake`).
const REQUEST_TYPES: [u8; 5] = [0x01, 0x02, 0x03, 0x04, 0x05];
const RESPONSE_TYPES: [u8; 3] = [0x81, 0x82, 0x83];
const HANDSHAKE_TYPES: [u8; 5] = [0x10, 0x11, 0x12, 0x13, 0x14];

/// Which decoder a body is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decoder {
    Request,
    Response,
    Handshake,
}

impl Decoder {
    fn types(self) -> &'static [u8] {
        match self {
            Decoder::Request => &REQUEST_TYPES,
            Decoder::Response => &RESPONSE_TYPES,
            Decoder::Handshake => &HANDSHAKE_TYPES,
        }
    }
}

fn body((head, payload): (BytesMut, Bytes)) -> Bytes {
    let mut body = head;
    body.extend_from_slice(&payload);
    body.freeze()
}

/// A decode error is one that can come from a body of `len` bytes, and says something true.
fn check_error(decoder: Decoder, error: &WireError, len: usize) {
    match error {
        WireError::Truncated { need, have, .. } => {
            assert!(have < need, "truncated with enough bytes: {error}");
            assert!(*have < len.max(1), "more bytes left than given: {error}");
        }
        WireError::UnknownType { what, code } => {
            if ["request", "response", "handshake"].contains(what) {
                assert!(
                    !decoder.types().contains(code),
                    "refused a known type: {error}"
                );
            }
        }
        WireError::Trailing { extra, .. } => {
            assert!(*extra > 0 && *extra < len, "trailing count off: {error}");
        }
        WireError::BadField { field, .. } => {
            assert_eq!(
                (decoder, *field),
                (Decoder::Response, "error"),
                "only a response's error field is parsed: {error}"
            );
        }
        WireError::Oversized { .. } => panic!("a message decoder never checks sizes: {error}"),
    }
}

/// Decode `bytes` with `decoder`; a success must re-encode identically (byte for byte where the
/// layout is canonical: all but a `Failed`'s JSON and a `Refused` reason that is not valid UTF-8
/// or does not fit the handshake cap), and decode from that again to the same value.
fn decode(decoder: Decoder, bytes: &[u8]) -> Result<(), WireError> {
    let input = Bytes::copy_from_slice(bytes);
    let result = match decoder {
        Decoder::Request => Request::decode(input).map(|request| {
            let encoded = body(request.encode());
            assert_eq!(&encoded[..], bytes, "{request:?} re-encodes to its bytes");
            assert_eq!(Request::decode(encoded).as_ref(), Ok(&request));
        }),
        Decoder::Response => Response::decode(input).map(|response| {
            let encoded = body(response.encode());
            if !matches!(response, Response::Failed { .. }) {
                assert_eq!(&encoded[..], bytes, "{response:?} re-encodes to its bytes");
            }
            assert_eq!(Response::decode(encoded).as_ref(), Ok(&response));
        }),
        Decoder::Handshake => HandshakeFrame::decode(input).map(|frame| {
            let encoded = frame.encode();
            assert!(
                encoded.len() <= HANDSHAKE_FRAME_CAP,
                "{frame:?} fits the cap"
            );
            let canonical = match &frame {
                HandshakeFrame::Refused { .. } => {
                    bytes.len() <= HANDSHAKE_FRAME_CAP && std::str::from_utf8(&bytes[1..]).is_ok()
                }
                _ => true,
            };
            if canonical {
                assert_eq!(&encoded[..], bytes, "{frame:?} re-encodes to its bytes");
                assert_eq!(HandshakeFrame::decode(encoded).as_ref(), Ok(&frame));
            } else {
                let again = HandshakeFrame::decode(encoded);
                let (
                    HandshakeFrame::Refused { reason },
                    Ok(HandshakeFrame::Refused { reason: sent }),
                ) = (&frame, &again)
                else {
                    panic!("{frame:?} re-decodes as Refused, got {again:?}");
                };
                assert!(reason.starts_with(sent.as_str()), "only cut: {sent:?}");
            }
        }),
    };
    if let Err(error) = &result {
        check_error(decoder, error, bytes.len());
    }
    result
}

// ---------------------------------------------------------------------------------------------
// Valid messages.

fn target() -> impl Strategy<Value = Target> {
    (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(owner, instance, region)| Target {
        owner,
        instance,
        region,
    })
}

fn tag() -> impl Strategy<Value = WriteTag> {
    (any::<u64>(), any::<u128>(), any::<u128>()).prop_map(|(epoch, write_id, token)| WriteTag {
        epoch,
        write_id,
        token,
    })
}

fn payload() -> impl Strategy<Value = Bytes> {
    proptest::collection::vec(any::<u8>(), 0..48).prop_map(Bytes::from)
}

fn text(max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(any::<char>(), 0..max).prop_map(String::from_iter)
}

fn request() -> impl Strategy<Value = Request> {
    let dest = prop_oneof![
        any::<u64>().prop_map(DestSpec::Bytes),
        any::<u64>().prop_map(DestSpec::F32),
        (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(device, ptr, bytes)| {
            DestSpec::Device(DeviceDest { device, ptr, bytes })
        }),
    ];
    prop_oneof![
        (any::<u64>(), target(), any::<(u64, u64, u64, u64)>(), dest).prop_map(
            |(req, target, (start, end, part_start, part_end), dest)| Request::Read {
                req,
                target,
                start,
                end,
                part: (part_start, part_end),
                dest,
            }
        ),
        (any::<u64>(), target(), any::<u64>(), tag(), payload()).prop_map(
            |(req, target, offset, tag, data)| Request::Accumulate {
                req,
                target,
                offset,
                tag,
                data,
            }
        ),
        (any::<u64>(), target(), tag(), payload()).prop_map(|(req, target, tag, data)| {
            Request::Send {
                req,
                target,
                tag,
                data,
            }
        }),
        (
            (any::<u64>(), target(), any::<u64>(), tag()),
            (any::<[u8; 32]>(), any::<[u8; 32]>(), any::<(u64, u64)>())
        )
            .prop_map(|((req, target, offset, tag), (lo, hi, (at, bytes)))| {
                let mut ipc_handle = [0u8; IPC_HANDLE_BYTES];
                ipc_handle[..32].copy_from_slice(&lo);
                ipc_handle[32..].copy_from_slice(&hi);
                Request::AccumulateDevice {
                    req,
                    target,
                    offset,
                    tag,
                    source: IpcSource {
                        ipc_handle,
                        offset: at,
                        bytes,
                    },
                }
            }),
        (
            (any::<u64>(), target(), tag(), payload()),
            (any::<[u8; 32]>(), any::<[u8; 32]>(), any::<(u64, u64)>())
        )
            .prop_map(|((req, target, tag, data), (lo, hi, (at, bytes)))| {
                let mut ipc_handle = [0u8; IPC_HANDLE_BYTES];
                ipc_handle[..32].copy_from_slice(&lo);
                ipc_handle[32..].copy_from_slice(&hi);
                Request::SendDevice {
                    req,
                    target,
                    tag,
                    source: IpcSource {
                        ipc_handle,
                        offset: at,
                        bytes,
                    },
                    data,
                }
            }),
    ]
}

fn transport_error() -> impl Strategy<Value = TransportError> {
    prop_oneof![
        (any::<u32>(), any::<u64>())
            .prop_map(|(owner, region)| TransportError::UnknownRegion { owner, region }),
        (any::<u64>(), any::<u64>(), any::<u128>()).prop_map(|(region, epoch, write_id)| {
            TransportError::DuplicateWrite {
                region,
                epoch,
                write_id,
            }
        }),
        (any::<u32>(), any::<u64>()).prop_map(|(owner, region)| {
            TransportError::DeadlineExceeded {
                owner,
                region,
                op: Op::Send,
            }
        }),
        text(24).prop_map(|what| TransportError::Unsupported { what }),
        (any::<u32>(), text(24))
            .prop_map(|(owner, reason)| TransportError::Unreachable { owner, reason }),
    ]
}

fn response() -> impl Strategy<Value = Response> {
    prop_oneof![
        (any::<u64>(), any::<u64>(), any::<bool>(), payload()).prop_map(
            |(req, version, bf16, data)| Response::ReadOk {
                req,
                version,
                dtype: if bf16 { Dtype::Bf16 } else { Dtype::F32 },
                data,
            }
        ),
        any::<u64>().prop_map(|req| Response::Done { req }),
        (any::<u64>(), transport_error()).prop_map(|(req, error)| Response::Failed { req, error }),
    ]
}

fn handshake_frame() -> impl Strategy<Value = HandshakeFrame> {
    prop_oneof![
        (any::<[u8; 4]>(), any::<u16>(), any::<[u8; 32]>()).prop_map(|(magic, protocol, nonce)| {
            HandshakeFrame::Hello {
                magic,
                protocol,
                nonce,
            }
        }),
        any::<[u8; 32]>().prop_map(|nonce| HandshakeFrame::Challenge { nonce }),
        any::<[u8; 32]>().prop_map(|mac| HandshakeFrame::Proof { mac }),
        any::<[u8; 32]>().prop_map(|mac| HandshakeFrame::Welcome { mac }),
        // Up to 4 bytes a character: some reasons are cut to the cap by the encoder.
        text(80).prop_map(|reason| HandshakeFrame::Refused { reason }),
    ]
}

/// A valid message's encoding, with what decodes it and how much of it is fixed fields (`head`);
/// `free` when the rest is a payload any bytes make (not a `Failed`'s JSON).
#[derive(Debug, Clone)]
struct Encoded {
    decoder: Decoder,
    bytes: Vec<u8>,
    head: usize,
    free: bool,
}

fn encoded() -> impl Strategy<Value = Encoded> {
    prop_oneof![
        request().prop_map(|request| {
            let (head, payload) = request.encode();
            Encoded {
                decoder: Decoder::Request,
                head: head.len(),
                free: !matches!(
                    request,
                    Request::Read { .. } | Request::AccumulateDevice { .. }
                ),
                bytes: body((head, payload)).to_vec(),
            }
        }),
        response().prop_map(|response| {
            let (head, payload) = response.encode();
            Encoded {
                decoder: Decoder::Response,
                head: head.len(),
                free: matches!(response, Response::ReadOk { .. }),
                bytes: body((head, payload)).to_vec(),
            }
        }),
        handshake_frame().prop_map(|frame| {
            let bytes = frame.encode().to_vec();
            let refused = matches!(frame, HandshakeFrame::Refused { .. });
            Encoded {
                decoder: Decoder::Handshake,
                head: if refused { 1 } else { bytes.len() },
                free: refused,
                bytes,
            }
        }),
    ]
}

/// What is done to a valid encoding.
#[derive(Debug, Clone)]
enum Mutation {
    /// Cut at a length below the whole.
    Truncate(Index),
    /// One byte XORed with a non-zero mask.
    Flip(Index, u8),
    /// Bytes appended.
    Trail(Vec<u8>),
    /// The type byte replaced.
    Retype(u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<Index>().prop_map(Mutation::Truncate),
        (any::<Index>(), 1..=u8::MAX).prop_map(|(at, mask)| Mutation::Flip(at, mask)),
        proptest::collection::vec(any::<u8>(), 1..16).prop_map(Mutation::Trail),
        any::<u8>().prop_map(Mutation::Retype),
    ]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime")
}

/// An in-memory stream that hands over at most `step` bytes per read, so frames arrive split.
struct Trickle {
    rest: Bytes,
    step: usize,
}

impl AsyncRead for Trickle {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = self.rest.len().min(self.step).min(buf.remaining());
        let now = self.rest.split_to(n);
        buf.put_slice(&now);
        Poll::Ready(Ok(()))
    }
}

/// How a stream of frames ends, by a reader's rules.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// After a whole frame.
    Closed,
    /// Inside a frame (or its prefix).
    Cut,
    /// At a prefix over the cap.
    Oversized(u64),
}

/// The frames a reader with `cap` must hand out of `stream`, and how it must end.
fn frames_by_the_book(stream: &[u8], cap: usize) -> (Vec<&[u8]>, End) {
    let mut frames = Vec::new();
    let mut rest = stream;
    loop {
        let Some((prefix, after)) = rest.split_first_chunk::<PREFIX>() else {
            return (
                frames,
                if rest.is_empty() {
                    End::Closed
                } else {
                    End::Cut
                },
            );
        };
        let len = u32::from_be_bytes(*prefix) as usize;
        if len > cap {
            return (frames, End::Oversized(len as u64));
        }
        let Some((frame, after)) = after.split_at_checked(len) else {
            return (frames, End::Cut);
        };
        frames.push(frame);
        rest = after;
    }
}

/// Up to `max - 1` arbitrary bytes, the first one replaced by one of `types` where it was even:
/// half of the inputs then reach the decoders past the type byte.
fn half_typed(max: usize, types: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    (
        proptest::collection::vec(any::<u8>(), 0..max),
        any::<Index>(),
    )
        .prop_map(move |(mut bytes, typed)| {
            if let Some(first) = bytes.first_mut() {
                if *first & 1 == 0 {
                    *first = *typed.get(&types);
                }
            }
            bytes
        })
}

/// What the frame reader's properties read: frames whose length prefixes may disagree with their
/// bodies, then garbage, through a reader with cap `cap` that gets `step` bytes per read.
#[derive(Debug, Clone)]
struct FrameStream {
    frames: Vec<(u32, Vec<u8>)>,
    garbage: Vec<u8>,
    cap: usize,
    step: usize,
}

impl FrameStream {
    /// The stream: each frame's claimed length prefix and its body, then the garbage.
    fn bytes(&self) -> Vec<u8> {
        let mut stream = Vec::new();
        for (claimed, body) in &self.frames {
            stream.extend_from_slice(&claimed.to_be_bytes());
            stream.extend_from_slice(body);
        }
        stream.extend_from_slice(&self.garbage);
        stream
    }

    /// A reader of `stream` (these bytes) with this cap, `step` bytes per read.
    fn reader(&self, stream: &[u8]) -> FrameReader<Trickle> {
        let rest = Bytes::copy_from_slice(stream);
        FrameReader::new(
            Trickle {
                rest,
                step: self.step,
            },
            self.cap,
        )
    }
}

/// Up to 5 frames of up to 47 bytes (see [`claimed_frame`]), up to 7 bytes of garbage, caps up to
/// 400 bytes, 1 to 63 bytes per read.
fn frame_stream() -> impl Strategy<Value = FrameStream> {
    (
        proptest::collection::vec(claimed_frame(), 0..6),
        proptest::collection::vec(any::<u8>(), 0..8),
        0..400usize,
        1..64usize,
    )
        .prop_map(|(frames, garbage, cap, step)| FrameStream {
            frames,
            garbage,
            cap,
            step,
        })
}

/// One frame for a stream: its body, and the length its prefix claims.
fn claimed_frame() -> impl Strategy<Value = (u32, Vec<u8>)> {
    (
        proptest::collection::vec(any::<u8>(), 0..48),
        0..4u8,
        0..600u32,
    )
        .prop_map(|(body, how, any_len)| {
            let len = body.len() as u32;
            let claimed = match how {
                0 | 1 => len,
                2 => any_len,
                _ => len + any_len % 8,
            };
            (claimed, body)
        })
}

// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40_000))]

    /// Any bytes: each decoder returns a typed error that fits them, or a message that re-encodes
    /// to them.
    #[test]
    fn arbitrary_bytes_decode_or_fail_typed(
        // Half the inputs start with a known type byte, so the field decoders are reached.
        bytes in half_typed(160, [REQUEST_TYPES.as_slice(), &RESPONSE_TYPES, &HANDSHAKE_TYPES].concat()),
    ) {
        for decoder in [Decoder::Request, Decoder::Response, Decoder::Handshake] {
            let _ = decode(decoder, &bytes);
        }
    }

    /// A valid encoding, damaged: truncated inside its fixed fields is `Truncated`; a payload
    /// cut, extended or flipped decodes to what the bytes say; bytes after fixed-size messages are
    /// `Trailing`; an unknown type byte is `UnknownType`; every other outcome is typed or
    /// round-trips.
    #[test]
    fn mutated_encodings_decode_or_fail_typed(encoded in encoded(), mutation in mutation()) {
        let Encoded { decoder, mut bytes, head, free } = encoded;
        let fixed_size = head == bytes.len() && !free;
        match &mutation {
            Mutation::Truncate(at) => {
                let cut = at.index(bytes.len());
                bytes.truncate(cut);
                let result = decode(decoder, &bytes);
                if cut < head {
                    prop_assert!(matches!(result, Err(WireError::Truncated { .. })), "{result:?}");
                } else if free {
                    prop_assert!(result.is_ok(), "a cut payload is a shorter payload: {result:?}");
                } else {
                    prop_assert!(
                        matches!(result, Err(WireError::BadField { field: "error", .. })),
                        "a cut JSON error: {result:?}"
                    );
                }
            }
            Mutation::Flip(at, mask) => {
                let at = at.index(bytes.len());
                bytes[at] ^= mask;
                let result = decode(decoder, &bytes);
                if at >= head && free {
                    prop_assert!(result.is_ok(), "payload bytes are any bytes: {result:?}");
                }
            }
            Mutation::Trail(extra) => {
                bytes.extend_from_slice(extra);
                let result = decode(decoder, &bytes);
                if fixed_size {
                    prop_assert_eq!(
                        result.map_err(|e| match e {
                            WireError::Trailing { extra, .. } => extra,
                            other => panic!("expected Trailing, got {other}"),
                        }),
                        Err(extra.len())
                    );
                } else if free {
                    prop_assert!(result.is_ok(), "a longer payload: {result:?}");
                }
            }
            Mutation::Retype(code) => {
                bytes[0] = *code;
                let result = decode(decoder, &bytes);
                if !decoder.types().contains(code) {
                    prop_assert!(
                        matches!(result, Err(WireError::UnknownType { code: c, .. }) if c == *code),
                        "{result:?}"
                    );
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5_000))]

    /// A valid encoding cut at every length below the whole: never a panic; inside the fixed
    /// fields always `Truncated`.
    #[test]
    fn every_truncation_of_a_valid_encoding_fails_typed(encoded in encoded()) {
        for cut in 0..encoded.bytes.len() {
            let result = decode(encoded.decoder, &encoded.bytes[..cut]);
            if cut < encoded.head {
                prop_assert!(
                    matches!(result, Err(WireError::Truncated { .. })),
                    "cut at {cut} of {encoded:?}: {result:?}"
                );
            } else {
                prop_assert_eq!(result.is_ok(), encoded.free, "cut at {} of {:?}", cut, encoded);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(15_000))]

    /// Frames whose length prefixes may disagree with their bodies (shorter, longer, anything up
    /// to a few hundred bytes), with trailing garbage, delivered a few bytes per read: the reader
    /// hands out exactly the frames the prefixes describe, none over the cap, and ends the way
    /// the bytes say (closed between frames, cut inside one, or refused at an oversized prefix).
    /// Every frame is also decoded as a request.
    #[test]
    fn frame_reader_follows_the_length_prefixes(
        case in frame_stream(),
    ) {
        let FrameStream { cap, .. } = case;
        let stream = case.bytes();
        let (expected, end) = frames_by_the_book(&stream, cap);
        let (got, ended) = runtime().block_on(async {
            let mut reader = case.reader(&stream);
            let mut got = Vec::new();
            loop {
                match reader.next().await {
                    Ok(frame) => {
                        assert!(frame.len() <= cap, "a frame of {} over the cap {cap}", frame.len());
                        let _ = decode(Decoder::Request, &frame);
                        got.push(frame);
                    }
                    Err(FrameError::Closed) => return (got, End::Closed),
                    Err(FrameError::Io(e)) => {
                        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
                        return (got, End::Cut);
                    }
                    Err(FrameError::Wire(WireError::Oversized { len, cap: refused })) => {
                        assert_eq!(refused, cap as u64);
                        return (got, End::Oversized(len));
                    }
                    Err(FrameError::Wire(other)) => panic!("a reader refuses only sizes: {other}"),
                }
            }
        });
        prop_assert_eq!(got.iter().map(|f| &f[..]).collect::<Vec<_>>(), expected);
        prop_assert_eq!(ended, end);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5_000))]

    /// A length prefix over the cap (up to 4 GiB, against caps from 0 to the default 64 MiB),
    /// whatever follows it, is `Oversized` at once, and the reader never allocates more than its
    /// initial buffer: the peer's length field reserves nothing.
    #[test]
    fn oversized_prefixes_are_refused_without_allocating(
        cap in prop_oneof![Just(0usize), Just(HANDSHAKE_FRAME_CAP), 0..(1usize << 20),
            Just(RemoteConfig::DEFAULT_FRAME_CAP)],
        over in any::<u32>(),
        after in proptest::collection::vec(any::<u8>(), 0..64),
        step in 1..64usize,
    ) {
        let span = u64::from(u32::MAX) - cap as u64;
        let len = cap as u64 + 1 + u64::from(over) % span;
        let mut stream = (len as u32).to_be_bytes().to_vec();
        stream.extend_from_slice(&after);
        let rt = runtime();
        let (result, largest) = largest_allocation(|| {
            rt.block_on(async {
                let rest = Bytes::from(stream);
                FrameReader::new(Trickle { rest, step }, cap).next().await
            })
        });
        prop_assert!(
            matches!(result, Err(FrameError::Wire(WireError::Oversized { len: l, cap: c }))
                if l == len && c == cap as u64),
            "{result:?}"
        );
        // The reader's initial buffer is 8 KiB; the stream and the runtime allocate a little.
        prop_assert!(largest <= 16 * 1024, "largest allocation {largest} bytes for a {len}-byte prefix");
    }
}

/// A prefix within the cap reserves room for the frame it announces, and never more than the
/// cap: with the default cap (64 MiB + 4 KiB), a peer that announces 60 MiB and sends 3 bytes
/// holds a 60 MiB buffer until its connection ends (only an authenticated peer gets this cap).
#[test]
fn prefix_within_the_cap_reserves_at_most_the_cap() {
    let cap = RemoteConfig::DEFAULT_FRAME_CAP;
    let len = 60u32 << 20;
    let mut stream = len.to_be_bytes().to_vec();
    stream.extend_from_slice(b"abc");
    let rt = runtime();
    let (result, largest) = largest_allocation(|| {
        rt.block_on(async {
            let rest = Bytes::from(stream);
            FrameReader::new(Trickle { rest, step: 64 }, cap)
                .next()
                .await
        })
    });
    assert!(
        matches!(&result, Err(FrameError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof),
        "{result:?}"
    );
    assert!(
        largest <= cap + PREFIX,
        "largest allocation {largest} over the cap {cap}"
    );
}

/// How the body of one frame is taken after its head.
#[derive(Debug, Clone, Copy)]
enum Take {
    /// Copied out with `read_body`, at most this many bytes (1..) per call.
    Copy(usize),
    /// Buffered whole with `rest_of_body`.
    Buffer,
    /// Left for the next frame's read to discard.
    Leave,
}

fn take() -> impl Strategy<Value = Take> {
    prop_oneof![
        (1..40usize).prop_map(Take::Copy),
        Just(Take::Buffer),
        Just(Take::Leave),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(15_000))]

    /// As `frame_reader_follows_the_length_prefixes`, with each frame taken head first
    /// (`next_head`, a head of 0 to 24 bytes) and its body copied out in pieces, buffered or left
    /// to be discarded: the bytes taken are exactly the frames' (never a byte of the next frame),
    /// and the stream ends the way the bytes say.
    #[test]
    fn frames_taken_in_two_steps_follow_the_length_prefixes(
        case in frame_stream(),
        want in 0..24usize,
        takes in proptest::collection::vec(take(), 6),
    ) {
        let FrameStream { cap, .. } = case;
        let stream = case.bytes();
        let (expected, end) = frames_by_the_book(&stream, cap);
        let (got, ended) = runtime().block_on(async {
            let mut reader = case.reader(&stream);
            let mut got: Vec<(Vec<u8>, Take)> = Vec::new();
            let ended = loop {
                let (len, head) = match reader.next_head(want).await {
                    Ok(frame) => frame,
                    Err(FrameError::Closed) => break End::Closed,
                    Err(FrameError::Io(e)) => {
                        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
                        break End::Cut;
                    }
                    Err(FrameError::Wire(WireError::Oversized { len, cap: refused })) => {
                        assert_eq!(refused, cap as u64);
                        break End::Oversized(len);
                    }
                    Err(FrameError::Wire(other)) => panic!("a reader refuses only sizes: {other}"),
                };
                assert!(len <= cap, "a frame of {len} over the cap {cap}");
                assert_eq!(head.len(), want.min(len));
                assert_eq!(reader.body_left(), len - head.len());
                let how = takes[got.len() % takes.len()];
                let mut frame = head.to_vec();
                let taken = match how {
                    Take::Copy(piece) => {
                        let mut out = vec![0u8; piece];
                        loop {
                            match reader.read_body(&mut out).await {
                                Ok(0) => break Ok(()),
                                Ok(n) => frame.extend_from_slice(&out[..n]),
                                Err(e) => break Err(e),
                            }
                        }
                    }
                    Take::Buffer => {
                        reader.rest_of_body().await.map(|rest| frame.extend_from_slice(&rest))
                    }
                    Take::Leave => Ok(()),
                };
                match taken {
                    Ok(()) => got.push((frame, how)),
                    Err(FrameError::Io(e)) => {
                        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
                        break End::Cut;
                    }
                    Err(other) => panic!("taking a body fails only by the stream ending: {other}"),
                }
            };
            (got, ended)
        });
        // A frame whose body was left may turn out cut only when the next read discards it.
        let left_cut = got.len() == expected.len() + 1
            && matches!(got.last(), Some((_, Take::Leave)))
            && end == End::Cut;
        prop_assert!(
            got.len() == expected.len() || left_cut,
            "{} frames, {} by the book",
            got.len(),
            expected.len()
        );
        for ((frame, how), want_frame) in got.iter().zip(&expected) {
            match how {
                Take::Leave => prop_assert!(want_frame.starts_with(frame)),
                _ => prop_assert_eq!(&frame[..], *want_frame),
            }
        }
        prop_assert_eq!(ended, end);
    }
}

/// `decode_read_head` of a body's first bytes agrees with `decode` of the whole body.
fn check_read_head(bytes: &[u8]) {
    let head = Bytes::copy_from_slice(&bytes[..bytes.len().min(READ_OK_HEAD)]);
    let whole = Response::decode(Bytes::copy_from_slice(bytes));
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
                data: Bytes::copy_from_slice(&bytes[READ_OK_HEAD..]),
            })
        ),
        Ok(None) => assert!(
            !matches!(whole, Ok(Response::ReadOk { .. })),
            "{whole:?} has no read head"
        ),
        Err(error) => assert_eq!(whole, Err(error)),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5_000))]

    /// Any bytes (half of them starting with a response type byte): the read head agrees with
    /// the whole response.
    #[test]
    fn read_heads_agree_with_whole_responses(bytes in half_typed(48, RESPONSE_TYPES.to_vec())) {
        check_read_head(&bytes);
    }

    /// Valid responses, cut, flipped or extended: the read head agrees with the whole response.
    #[test]
    fn read_heads_of_damaged_responses_agree_with_whole_responses(
        response in response(),
        mutation in mutation(),
    ) {
        let mut bytes = body(response.encode()).to_vec();
        match mutation {
            Mutation::Truncate(at) => bytes.truncate(at.index(bytes.len())),
            Mutation::Flip(at, mask) => {
                let at = at.index(bytes.len());
                bytes[at] ^= mask;
            }
            Mutation::Trail(extra) => bytes.extend_from_slice(&extra),
            Mutation::Retype(code) => bytes[0] = code,
        }
        check_read_head(&bytes);
    }
}
