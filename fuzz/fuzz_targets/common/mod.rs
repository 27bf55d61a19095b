//! What the targets share: the round-trip checks a successful decode is held to.

#![allow(dead_code)] // Each target uses only some of these.

use bytes::{Bytes, BytesMut};
use odc_transport::wire::handshake::{HandshakeFrame, HANDSHAKE_FRAME_CAP};
use odc_transport::wire::{Request, Response};

/// A message's head and payload as the one frame body the peer receives.
pub fn body((head, payload): (BytesMut, Bytes)) -> Bytes {
    let mut body = head;
    body.extend_from_slice(&payload);
    body.freeze()
}

/// A request that decoded from `input`: its encoding is `input` byte for byte (the layout has no
/// slack: fixed fields, then the payload as the rest), and that decodes to it again.
pub fn request_round_trips(input: &[u8], request: &Request) {
    let encoded = body(request.encode());
    assert_eq!(&encoded[..], input, "a request re-encodes to its bytes");
    assert_eq!(Request::decode(encoded).as_ref(), Ok(request));
}

/// A response that decoded from `input` decodes again from its own encoding; it is `input` byte
/// for byte except for `Failed`, whose error is JSON (key order and spacing are the encoder's).
pub fn response_round_trips(input: &[u8], response: &Response) {
    let encoded = body(response.encode());
    if !matches!(response, Response::Failed { .. }) {
        assert_eq!(&encoded[..], input, "a response re-encodes to its bytes");
    }
    assert_eq!(Response::decode(encoded).as_ref(), Ok(response));
}

/// A handshake frame that decoded from `input`: re-encoded it fits the handshake cap and decodes
/// again to itself. Byte for byte, except `Refused`, whose reason is decoded lossily (invalid
/// UTF-8 becomes U+FFFD) and cut to the cap at a character boundary by the encoder.
pub fn handshake_round_trips(input: &[u8], frame: &HandshakeFrame) {
    let encoded = frame.encode();
    assert!(
        encoded.len() <= HANDSHAKE_FRAME_CAP,
        "an encoded handshake frame fits the cap"
    );
    let again = HandshakeFrame::decode(encoded.clone());
    match frame {
        HandshakeFrame::Refused { reason } => {
            let Ok(HandshakeFrame::Refused { reason: sent }) = again else {
                panic!("a Refused frame decodes as Refused, got {again:?}");
            };
            assert!(
                reason.starts_with(&sent),
                "the encoder only cuts the reason"
            );
            if reason.len() < HANDSHAKE_FRAME_CAP {
                assert_eq!(&sent, reason, "a reason that fits is sent whole");
            }
            if input.len() <= HANDSHAKE_FRAME_CAP && std::str::from_utf8(&input[1..]).is_ok() {
                assert_eq!(
                    &encoded[..],
                    input,
                    "a valid Refused re-encodes to its bytes"
                );
            }
        }
        _ => {
            assert_eq!(
                &encoded[..],
                input,
                "a handshake frame re-encodes to its bytes"
            );
            assert_eq!(again.as_ref(), Ok(frame));
        }
    }
}
