//! Requests (reader → owner) and responses (owner → reader) after the handshake.
//!
//! Layout, little-endian, one message per frame body:
//!
//! | type | message | fields after the type byte |
//! |------|---------|----------------------------|
//! | 0x01 | `Read` | req u64, target, start u64, end u64, part_start u64, part_end u64, dest |
//! | 0x02 | `Accumulate` | req u64, target, offset u64, tag, payload… |
//! | 0x03 | `Send` | req u64, target, tag, payload… |
//! | 0x04 | `AccumulateDevice` | req u64, target, offset u64, tag, source offset u64, source bytes u64, IPC handle (64 bytes) |
//! | 0x05 | `SendDevice` | req u64, target, tag, source offset u64, source bytes u64, IPC handle (64 bytes), payload… |
//! | 0x81 | `ReadOk` | req u64, version u64, dtype u8 (0 f32, 1 bf16), payload… |
//! | 0x82 | `Done` | req u64 |
//! | 0x83 | `Failed` | req u64, error as JSON… |
//!
//! `target` is owner u32, instance u64, region u64; `tag` is epoch u64, write_id u128, token u128
//! (the token is the owner's admission check, C8, not the decoder's); `dest` is a kind byte (0 bytes, 1 f32,
//! 2 device) then units u64 (kinds 0, 1) or device u32, ptr u64, bytes u64 (kind 2). A payload is
//! the rest of the frame. Element ranges and offsets travel as sent: whether they fit the region is
//! the owner's check (a typed [`TransportError`], not a decode error), so the decoder refuses only
//! what cannot be a message. A read names the whole range and destination of the caller's read
//! (which the owner checks, in the contract's order) and the part of it this request returns (a
//! large read travels as several parts, in flight at once).

use bytes::{BufMut, Bytes, BytesMut};

use super::WireError;
use crate::{DestSpec, DeviceDest, Dtype, EndpointId, RegionId, TransportError, WriteTag};

const READ: u8 = 0x01;
const ACCUMULATE: u8 = 0x02;
const SEND: u8 = 0x03;
const ACCUMULATE_DEVICE: u8 = 0x04;
const SEND_DEVICE: u8 = 0x05;
const READ_OK: u8 = 0x81;
const DONE: u8 = 0x82;
const FAILED: u8 = 0x83;

/// Bytes of a `ReadOk` before its payload: type, req, version, dtype.
pub const READ_OK_HEAD: usize = 1 + 8 + 8 + 1;

/// The fields of a `ReadOk` before its payload ([`Response::decode_read_head`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOkHead {
    pub req: u64,
    pub version: u64,
    pub dtype: Dtype,
}

/// Which region of which owner a request is for. `instance` names the owner's transport instance
/// (from the handle's descriptor); a request for another instance is refused as an unknown region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    pub owner: EndpointId,
    pub instance: u64,
    pub region: RegionId,
}

/// A reader's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Read {
        req: u64,
        target: Target,
        start: u64,
        end: u64,
        part: (u64, u64),
        dest: DestSpec,
    },
    Accumulate {
        req: u64,
        target: Target,
        offset: u64,
        tag: WriteTag,
        data: Bytes,
    },
    Send {
        req: u64,
        target: Target,
        tag: WriteTag,
        data: Bytes,
    },
    /// An accumulate whose fp32 payload lies in the writer's device memory, which an owner on the
    /// same host opens through CUDA IPC (the `cuda` backend; any other owner refuses it).
    AccumulateDevice {
        req: u64,
        target: Target,
        offset: u64,
        tag: WriteTag,
        source: IpcSource,
    },
    /// An inbox send whose values lie in the writer's device memory (`source`, opened by an
    /// owner on the same host through CUDA IPC and copied into the owner's device memory) and
    /// whose `data` (host bytes) says what they are (the `cuda` backend; any other owner refuses
    /// it).
    SendDevice {
        req: u64,
        target: Target,
        tag: WriteTag,
        source: IpcSource,
        data: Bytes,
    },
}

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// Device memory of a writer's process as an owner on the same host opens it: the allocation's
/// CUDA IPC handle, and the source's byte offset in it and length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcSource {
    pub ipc_handle: [u8; IPC_HANDLE_BYTES],
    pub offset: u64,
    pub bytes: u64,
}

/// An owner's answer to the request with the same `req`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    ReadOk {
        req: u64,
        version: u64,
        dtype: Dtype,
        data: Bytes,
    },
    Done {
        req: u64,
    },
    Failed {
        req: u64,
        error: TransportError,
    },
}

impl Request {
    pub fn req(&self) -> u64 {
        match self {
            Request::Read { req, .. }
            | Request::Accumulate { req, .. }
            | Request::Send { req, .. }
            | Request::AccumulateDevice { req, .. }
            | Request::SendDevice { req, .. } => *req,
        }
    }

    /// The message as a head and a payload to write after it (not copied into the head).
    pub fn encode(&self) -> (BytesMut, Bytes) {
        let mut head = BytesMut::with_capacity(64);
        match self {
            Request::Read {
                req,
                target,
                start,
                end,
                part,
                dest,
            } => {
                head.put_u8(READ);
                head.put_u64_le(*req);
                put_target(&mut head, target);
                head.put_u64_le(*start);
                head.put_u64_le(*end);
                head.put_u64_le(part.0);
                head.put_u64_le(part.1);
                match dest {
                    DestSpec::Bytes(units) => {
                        head.put_u8(0);
                        head.put_u64_le(*units);
                    }
                    DestSpec::F32(units) => {
                        head.put_u8(1);
                        head.put_u64_le(*units);
                    }
                    DestSpec::Device(device) => {
                        head.put_u8(2);
                        head.put_u32_le(device.device);
                        head.put_u64_le(device.ptr);
                        head.put_u64_le(device.bytes);
                    }
                }
                (head, Bytes::new())
            }
            Request::Accumulate {
                req,
                target,
                offset,
                tag,
                data,
            } => {
                head.put_u8(ACCUMULATE);
                head.put_u64_le(*req);
                put_target(&mut head, target);
                head.put_u64_le(*offset);
                put_tag(&mut head, tag);
                (head, data.clone())
            }
            Request::Send {
                req,
                target,
                tag,
                data,
            } => {
                head.put_u8(SEND);
                head.put_u64_le(*req);
                put_target(&mut head, target);
                put_tag(&mut head, tag);
                (head, data.clone())
            }
            Request::AccumulateDevice {
                req,
                target,
                offset,
                tag,
                source,
            } => {
                head.put_u8(ACCUMULATE_DEVICE);
                head.put_u64_le(*req);
                put_target(&mut head, target);
                head.put_u64_le(*offset);
                put_tag(&mut head, tag);
                put_source(&mut head, source);
                (head, Bytes::new())
            }
            Request::SendDevice {
                req,
                target,
                tag,
                source,
                data,
            } => {
                head.put_u8(SEND_DEVICE);
                head.put_u64_le(*req);
                put_target(&mut head, target);
                put_tag(&mut head, tag);
                put_source(&mut head, source);
                (head, data.clone())
            }
        }
    }

    /// Decode one frame body. Payloads are slices of `body`.
    pub fn decode(body: Bytes) -> Result<Self, WireError> {
        let mut cur = Cursor::new(body);
        let code = cur.u8("request type")?;
        let request = match code {
            READ => {
                let req = cur.u64("request id")?;
                let target = cur.target()?;
                let start = cur.u64("range start")?;
                let end = cur.u64("range end")?;
                let part = (cur.u64("part start")?, cur.u64("part end")?);
                let dest = match cur.u8("destination kind")? {
                    0 => DestSpec::Bytes(cur.u64("destination size")?),
                    1 => DestSpec::F32(cur.u64("destination size")?),
                    2 => DestSpec::Device(DeviceDest {
                        device: cur.u32("device ordinal")?,
                        ptr: cur.u64("device address")?,
                        bytes: cur.u64("device bytes")?,
                    }),
                    code => {
                        return Err(WireError::UnknownType {
                            what: "destination",
                            code,
                        })
                    }
                };
                cur.finish("read request")?;
                Request::Read {
                    req,
                    target,
                    start,
                    end,
                    part,
                    dest,
                }
            }
            ACCUMULATE => Request::Accumulate {
                req: cur.u64("request id")?,
                target: cur.target()?,
                offset: cur.u64("offset")?,
                tag: cur.tag()?,
                data: cur.rest(),
            },
            SEND => Request::Send {
                req: cur.u64("request id")?,
                target: cur.target()?,
                tag: cur.tag()?,
                data: cur.rest(),
            },
            ACCUMULATE_DEVICE => {
                let (req, target) = (cur.u64("request id")?, cur.target()?);
                let (offset, tag) = (cur.u64("offset")?, cur.tag()?);
                let source = cur.source()?;
                cur.finish("device accumulate request")?;
                Request::AccumulateDevice {
                    req,
                    target,
                    offset,
                    tag,
                    source,
                }
            }
            SEND_DEVICE => Request::SendDevice {
                req: cur.u64("request id")?,
                target: cur.target()?,
                tag: cur.tag()?,
                source: cur.source()?,
                data: cur.rest(),
            },
            code => {
                return Err(WireError::UnknownType {
                    what: "request",
                    code,
                })
            }
        };
        Ok(request)
    }
}

impl Response {
    pub fn req(&self) -> u64 {
        match self {
            Response::ReadOk { req, .. }
            | Response::Done { req }
            | Response::Failed { req, .. } => *req,
        }
    }

    /// The message as a head and a payload to write after it (not copied into the head).
    pub fn encode(&self) -> (BytesMut, Bytes) {
        let mut head = BytesMut::with_capacity(32);
        match self {
            Response::ReadOk {
                req,
                version,
                dtype,
                data,
            } => {
                head.put_u8(READ_OK);
                head.put_u64_le(*req);
                head.put_u64_le(*version);
                head.put_u8(match dtype {
                    Dtype::F32 => 0,
                    Dtype::Bf16 => 1,
                });
                (head, data.clone())
            }
            Response::Done { req } => {
                head.put_u8(DONE);
                head.put_u64_le(*req);
                (head, Bytes::new())
            }
            Response::Failed { req, error } => {
                head.put_u8(FAILED);
                head.put_u64_le(*req);
                // Serializing a plain-data enum cannot fail; an empty payload would be refused by
                // the peer's decoder, never misread.
                let json = serde_json::to_vec(error).unwrap_or_default();
                (head, Bytes::from(json))
            }
        }
    }

    /// Decode one frame body. A read's payload is a slice of `body`.
    pub fn decode(body: Bytes) -> Result<Self, WireError> {
        let mut cur = Cursor::new(body);
        let code = cur.u8("response type")?;
        let response = match code {
            READ_OK => {
                let ReadOkHead {
                    req,
                    version,
                    dtype,
                } = cur.read_ok_head()?;
                Response::ReadOk {
                    req,
                    version,
                    dtype,
                    data: cur.rest(),
                }
            }
            DONE => {
                let req = cur.u64("request id")?;
                cur.finish("done response")?;
                Response::Done { req }
            }
            FAILED => {
                let req = cur.u64("request id")?;
                let json = cur.rest();
                let error = serde_json::from_slice(&json).map_err(|e| WireError::BadField {
                    field: "error",
                    reason: e.to_string(),
                })?;
                Response::Failed { req, error }
            }
            code => {
                return Err(WireError::UnknownType {
                    what: "response",
                    code,
                })
            }
        };
        Ok(response)
    }

    /// The first bytes of a response frame body ([`READ_OK_HEAD`] of them, or the whole body if
    /// it is shorter), for a reader that receives a read's payload straight into its destination:
    /// `Some` fields if they begin a `ReadOk` (whose payload is the rest of the body), `None` for
    /// any other response type (decode the whole body with [`Response::decode`]). Agrees with
    /// [`Response::decode`]: a `ReadOk` head that is cut short or names an unknown dtype is the
    /// same error.
    pub fn decode_read_head(head: Bytes) -> Result<Option<ReadOkHead>, WireError> {
        let mut cur = Cursor::new(head);
        if cur.u8("response type")? != READ_OK {
            return Ok(None);
        }
        let head = cur.read_ok_head()?;
        cur.finish("read response head")?;
        Ok(Some(head))
    }
}

fn put_target(head: &mut BytesMut, target: &Target) {
    head.put_u32_le(target.owner);
    head.put_u64_le(target.instance);
    head.put_u64_le(target.region);
}

fn put_tag(head: &mut BytesMut, tag: &WriteTag) {
    head.put_u64_le(tag.epoch);
    head.put_u128_le(tag.write_id);
    head.put_u128_le(tag.token);
}

fn put_source(head: &mut BytesMut, source: &IpcSource) {
    head.put_u64_le(source.offset);
    head.put_u64_le(source.bytes);
    head.put_slice(&source.ipc_handle);
}

/// Reads fields off a frame body, every read checked against what is left.
pub(crate) struct Cursor {
    body: Bytes,
    pos: usize,
}

impl Cursor {
    pub(crate) fn new(body: Bytes) -> Self {
        Self { body, pos: 0 }
    }

    fn take<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], WireError> {
        let have = self.body.len().saturating_sub(self.pos);
        let bytes = self
            .body
            .get(self.pos..self.pos.saturating_add(N))
            .and_then(|slice| <[u8; N]>::try_from(slice).ok())
            .ok_or(WireError::Truncated {
                what,
                need: N,
                have,
            })?;
        self.pos += N;
        Ok(bytes)
    }

    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take::<1>(what)?[0])
    }

    pub(crate) fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.take(what)?))
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(what)?))
    }

    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(what)?))
    }

    pub(crate) fn u128(&mut self, what: &'static str) -> Result<u128, WireError> {
        Ok(u128::from_le_bytes(self.take(what)?))
    }

    pub(crate) fn array<const N: usize>(
        &mut self,
        what: &'static str,
    ) -> Result<[u8; N], WireError> {
        self.take(what)
    }

    fn target(&mut self) -> Result<Target, WireError> {
        Ok(Target {
            owner: self.u32("owner")?,
            instance: self.u64("instance")?,
            region: self.u64("region")?,
        })
    }

    fn source(&mut self) -> Result<IpcSource, WireError> {
        let (offset, bytes) = (self.u64("source offset")?, self.u64("source bytes")?);
        Ok(IpcSource {
            offset,
            bytes,
            ipc_handle: self.take::<IPC_HANDLE_BYTES>("IPC handle")?,
        })
    }

    /// A `ReadOk`'s fields after its type byte.
    fn read_ok_head(&mut self) -> Result<ReadOkHead, WireError> {
        Ok(ReadOkHead {
            req: self.u64("request id")?,
            version: self.u64("version")?,
            dtype: match self.u8("dtype")? {
                0 => Dtype::F32,
                1 => Dtype::Bf16,
                code => {
                    return Err(WireError::UnknownType {
                        what: "dtype",
                        code,
                    })
                }
            },
        })
    }

    fn tag(&mut self) -> Result<WriteTag, WireError> {
        Ok(WriteTag {
            epoch: self.u64("epoch")?,
            write_id: self.u128("write id")?,
            token: self.u128("token")?,
        })
    }

    /// Everything left, as a slice of the body (no copy).
    pub(crate) fn rest(&mut self) -> Bytes {
        let start = self.pos.min(self.body.len());
        self.pos = self.body.len();
        self.body.slice(start..)
    }

    /// Refuse bytes after the last field.
    pub(crate) fn finish(&self, what: &'static str) -> Result<(), WireError> {
        match self.body.len().saturating_sub(self.pos) {
            0 => Ok(()),
            extra => Err(WireError::Trailing { what, extra }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Op;

    fn frame((head, payload): (BytesMut, Bytes)) -> Bytes {
        let mut body = head;
        body.extend_from_slice(&payload);
        body.freeze()
    }

    fn target() -> Target {
        Target {
            owner: 3,
            instance: u64::MAX,
            region: 7,
        }
    }

    #[test]
    fn every_request_round_trips() {
        let tag = WriteTag {
            epoch: 9,
            write_id: u128::MAX - 5,
            token: 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
        };
        let requests = [
            Request::Read {
                req: 1,
                target: target(),
                start: 5,
                end: 2,
                part: (5, 2),
                dest: DestSpec::Bytes(12),
            },
            Request::Read {
                req: 2,
                target: target(),
                start: 0,
                end: u64::MAX,
                part: (1, 2),
                dest: DestSpec::Device(DeviceDest {
                    device: 1,
                    ptr: 0xdead,
                    bytes: 64,
                }),
            },
            Request::Accumulate {
                req: 3,
                target: target(),
                offset: 4,
                tag,
                data: Bytes::from_static(&[1, 2, 3, 4, 5]),
            },
            Request::Send {
                req: 4,
                target: target(),
                tag,
                data: Bytes::new(),
            },
            Request::AccumulateDevice {
                req: 5,
                target: target(),
                offset: 7,
                tag,
                source: IpcSource {
                    ipc_handle: [3; IPC_HANDLE_BYTES],
                    offset: 64,
                    bytes: 4096,
                },
            },
            Request::SendDevice {
                req: 6,
                target: target(),
                tag,
                source: IpcSource {
                    ipc_handle: [7; IPC_HANDLE_BYTES],
                    offset: 0,
                    bytes: 12,
                },
                data: Bytes::from_static(b"shapes"),
            },
        ];
        for request in requests {
            assert_eq!(Request::decode(frame(request.encode())), Ok(request));
        }
    }

    #[test]
    fn every_response_round_trips() {
        let responses = [
            Response::ReadOk {
                req: 1,
                version: 4,
                dtype: Dtype::Bf16,
                data: Bytes::from_static(b"abcd"),
            },
            Response::Done { req: 2 },
            Response::Failed {
                req: 3,
                error: TransportError::DeadlineExceeded {
                    owner: 1,
                    region: 2,
                    op: Op::Send,
                },
            },
        ];
        for response in responses {
            assert_eq!(Response::decode(frame(response.encode())), Ok(response));
        }
    }

    #[test]
    fn payload_is_a_slice_of_the_frame() {
        let body = frame(
            Request::Send {
                req: 4,
                target: target(),
                tag: WriteTag {
                    epoch: 0,
                    write_id: 1,
                    token: 2,
                },
                data: Bytes::from(vec![9u8; 100]),
            }
            .encode(),
        );
        let base = body.as_ptr() as usize;
        let Ok(Request::Send { data, .. }) = Request::decode(body.clone()) else {
            panic!("send decodes");
        };
        assert_eq!(data.as_ptr() as usize, base + body.len() - 100, "no copy");
    }

    #[test]
    fn truncated_unknown_and_trailing_frames_are_errors() {
        let read = frame(
            Request::Read {
                req: 1,
                target: target(),
                start: 0,
                end: 1,
                part: (0, 1),
                dest: DestSpec::F32(1),
            }
            .encode(),
        );
        for cut in 0..read.len() {
            assert!(
                matches!(
                    Request::decode(read.slice(..cut)),
                    Err(WireError::Truncated { .. })
                ),
                "cut at {cut}"
            );
        }
        let mut long = read.to_vec();
        long.push(0);
        assert_eq!(
            Request::decode(Bytes::from(long)),
            Err(WireError::Trailing {
                what: "read request",
                extra: 1
            })
        );
        assert_eq!(
            Request::decode(Bytes::from_static(&[0x7f])),
            Err(WireError::UnknownType {
                what: "request",
                code: 0x7f
            })
        );
        assert!(matches!(
            Response::decode(Bytes::from_static(&[FAILED, 0, 0, 0, 0, 0, 0, 0, 0, b'{'])),
            Err(WireError::BadField { field: "error", .. })
        ));
    }
}
