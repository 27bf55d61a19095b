//! The three peer operations as requests over [`Peers`]: what every process-crossing backend's
//! `read`, `accumulate` and `send` do once they know the owner's address.

use std::ops::Range;

use bytes::Bytes;

use super::client::{About, Peers};
use super::payload::{Answer, Payload};
use crate::error::wide;
use crate::wire::{IpcSource, Request, Response, Target};
use crate::{Deadline, Dest, Op, RegionHandle, Transport, TransportError, WriteTag};

fn protocol(about: About, addr: &str, what: String) -> TransportError {
    TransportError::Unreachable {
        owner: about.owner,
        reason: format!("{addr}: protocol violation: {what}"),
    }
}

/// Read `range` of the region `target` at `addr` into `into` (a region of the reader's own
/// transport straight from its fabric, without a socket). A range of more than
/// `read_part_bytes` travels as parts in flight at once, each received straight into its own
/// slice of the destination; parts that saw different publications are read again (C1), until
/// the deadline. A read that fails after its first part arrived may leave the destination partly
/// written.
pub(crate) async fn read(
    peers: &Peers,
    addr: &str,
    target: Target,
    handle: &RegionHandle,
    range: Range<usize>,
    mut into: Dest<'_>,
    deadline: Deadline,
) -> Result<u64, TransportError> {
    if peers.local().owns(&target) {
        let fabric = &peers.local().fabric;
        return fabric
            .read(&fabric.local_handle(handle), range, into, deadline)
            .await;
    }
    let about = About::at(&target, Op::Read);
    let size = handle.dtype.size();
    let per_part = (peers.config().read_part_bytes / size).max(1);
    let spec = into.spec();
    // Parts only for a read the owner will accept as far as the caller can tell (within the
    // handle's length, a destination of the right size): anything else goes as one request, which
    // the owner refuses with the right error, and a bogus range never makes a bogus part count.
    let plausible = range.start < range.end
        && wide(range.end) <= handle.len
        && match spec {
            crate::DestSpec::Bytes(n) => n == wide(range.len() * size),
            crate::DestSpec::F32(n) => n == wide(range.len()),
            crate::DestSpec::Device(_) => false,
        };
    let parts: Vec<Range<usize>> = if plausible {
        crate::chunk_ranges(range.clone(), per_part).collect()
    } else {
        vec![range.clone()]
    };
    let mut slots = Slot::split(&mut into, &parts, size);
    loop {
        let calls = parts.iter().zip(slots.iter_mut()).map(|(part, slot)| {
            let request = |req| Request::Read {
                req,
                target,
                start: wide(range.start),
                end: wide(range.end),
                part: (wide(part.start), wide(part.end)),
                dest: spec,
            };
            read_part(peers, addr, about, deadline, part.len(), slot, request)
        });
        let mut versions = Vec::with_capacity(parts.len());
        for answer in futures::future::join_all(calls).await {
            versions.push(answer?);
        }
        let version = versions.first().copied().unwrap_or_default();
        if versions.iter().any(|&v| v != version) {
            // Parts of two publications: read again (a publication is rare, once per step).
            if crate::now() >= deadline {
                return Err(about.deadline_error());
            }
            continue;
        }
        return Ok(version);
    }
}

/// Where one part of a read lands: its slice of the caller's destination.
enum Slot<'a> {
    Bytes(&'a mut [u8]),
    F32(&'a mut [f32]),
    /// A device destination (which the owner refuses: no host bytes may land there).
    Device,
}

impl<'a> Slot<'a> {
    /// One slot per part, in order: consecutive slices of `into`, `part.len()` elements each. A
    /// read in parts has a destination of exactly the range's size (see `plausible`); a single
    /// part gets the whole destination, whatever its size.
    fn split(into: &'a mut Dest<'_>, parts: &[Range<usize>], size: usize) -> Vec<Slot<'a>> {
        fn consecutive<'a, T>(mut rest: &'a mut [T], lens: &[usize]) -> Vec<&'a mut [T]> {
            lens.iter()
                .map(|&n| {
                    let all = std::mem::take(&mut rest);
                    let (slot, after) = all.split_at_mut(n.min(all.len()));
                    rest = after;
                    slot
                })
                .collect()
        }
        let elements: Vec<usize> = parts.iter().map(|part| part.len()).collect();
        if parts.len() <= 1 {
            return vec![match into {
                Dest::Bytes(buf) => Slot::Bytes(buf),
                Dest::F32(out) => Slot::F32(out),
                Dest::Device(_) => Slot::Device,
            }];
        }
        match into {
            Dest::Bytes(buf) => {
                let bytes: Vec<usize> = elements.iter().map(|n| n * size).collect();
                consecutive(buf, &bytes)
                    .into_iter()
                    .map(Slot::Bytes)
                    .collect()
            }
            Dest::F32(out) => consecutive(out, &elements)
                .into_iter()
                .map(Slot::F32)
                .collect(),
            Dest::Device(_) => parts.iter().map(|_| Slot::Device).collect(),
        }
    }

    /// Whether a payload of `bytes` bytes, `elements` elements, fits this slot exactly.
    fn fits(&self, elements: usize, bytes: usize) -> bool {
        match self {
            Slot::Bytes(out) => out.len() == bytes,
            Slot::F32(out) => out.len() == elements,
            Slot::Device => false,
        }
    }

    /// Receive `payload` (little-endian `dtype` elements, checked to fit) into this slot.
    async fn receive(&mut self, payload: &mut Payload, dtype: crate::Dtype) -> Result<(), String> {
        match self {
            Slot::Bytes(out) => payload.read_into(out).await,
            Slot::F32(out) => payload.decode_into(dtype, out).await,
            Slot::Device => Err("a device destination takes no bytes from a host peer".into()),
        }
    }
}

/// One part of a read: request it and receive its payload into `slot`, by `deadline`; its
/// version. A payload whose length is not the part's (in the answered dtype), or does not fit the
/// slot, is a protocol violation and is not received (the connection discards it).
async fn read_part(
    peers: &Peers,
    addr: &str,
    about: About,
    deadline: Deadline,
    elements: usize,
    slot: &mut Slot<'_>,
    request: impl FnOnce(u64) -> Request,
) -> Result<u64, TransportError> {
    match peers.call(addr, about, deadline, request).await? {
        Answer::Read {
            version,
            dtype,
            mut payload,
        } => {
            let bytes = payload.len();
            if elements.checked_mul(dtype.size()) != Some(bytes) {
                return Err(protocol(
                    about,
                    addr,
                    format!("{bytes} bytes for a part of {elements} {dtype:?} elements"),
                ));
            }
            if !slot.fits(elements, bytes) {
                return Err(protocol(
                    about,
                    addr,
                    "an answer that does not fit the destination the owner accepted".into(),
                ));
            }
            match tokio::time::timeout_at(deadline.into(), slot.receive(&mut payload, dtype)).await
            {
                Ok(Ok(())) => Ok(version),
                Ok(Err(reason)) => Err(about.unreachable(addr, reason)),
                Err(_) => Err(about.deadline_error()),
            }
        }
        Answer::Whole(Response::Failed { error, .. }) => Err(error),
        Answer::Whole(_) => Err(protocol(about, addr, "a read answered with Done".into())),
    }
}

/// Add `data` into the accumulator `target` at `addr` (or of the reader's own transport);
/// resolves once applied. The caller checked the deadline.
pub(crate) async fn accumulate(
    peers: &Peers,
    addr: &str,
    target: Target,
    offset: usize,
    data: Bytes,
    tag: WriteTag,
    deadline: Deadline,
) -> Result<(), TransportError> {
    if peers.local().owns(&target) {
        return peers.local().fabric.serve_accumulate(
            target.owner,
            target.region,
            wide(offset),
            &data,
            tag,
        );
    }
    let about = About::at(&target, Op::Accumulate);
    acknowledged(peers, addr, about, data.len(), deadline, |req| {
        Request::Accumulate {
            req,
            target,
            offset: wide(offset),
            tag,
            data,
        }
    })
    .await
}

/// Add `source` (the writer's device memory, opened by the owner through CUDA IPC) into the
/// accumulator `target` at `addr`, another process of this host; resolves once applied. The
/// caller checked the deadline and that the owner is not this transport.
#[cfg_attr(not(feature = "cuda-code"), allow(dead_code))]
pub(crate) async fn accumulate_device(
    peers: &Peers,
    addr: &str,
    target: Target,
    offset: usize,
    tag: WriteTag,
    source: IpcSource,
    deadline: Deadline,
) -> Result<(), TransportError> {
    let about = About::at(&target, Op::Accumulate);
    acknowledged(peers, addr, about, 0, deadline, |req| {
        Request::AccumulateDevice {
            req,
            target,
            offset: wide(offset),
            tag,
            source,
        }
    })
    .await
}

/// Put `data` into the inbox `target` at `addr`, another process of this host, with its values
/// in `source` (the writer's device memory, which the owner copies through CUDA IPC into its own
/// before it delivers `data`); resolves once held. The caller checked the deadline and that the
/// owner is not this transport.
#[cfg_attr(not(feature = "cuda-code"), allow(dead_code))]
pub(crate) async fn send_device(
    peers: &Peers,
    addr: &str,
    target: Target,
    tag: WriteTag,
    source: IpcSource,
    data: Bytes,
    deadline: Deadline,
) -> Result<(), TransportError> {
    let about = About::at(&target, Op::Send);
    acknowledged(peers, addr, about, data.len(), deadline, |req| {
        Request::SendDevice {
            req,
            target,
            tag,
            source,
            data,
        }
    })
    .await
}

/// Put `data` into the inbox `target` at `addr` (or of the reader's own transport); resolves
/// once held. The caller checked the deadline.
pub(crate) async fn send(
    peers: &Peers,
    addr: &str,
    target: Target,
    tag: WriteTag,
    data: Bytes,
    deadline: Deadline,
) -> Result<(), TransportError> {
    if peers.local().owns(&target) {
        return peers
            .local()
            .fabric
            .serve_send(target.owner, target.region, tag, data);
    }
    let about = About::at(&target, Op::Send);
    acknowledged(peers, addr, about, data.len(), deadline, |req| {
        Request::Send {
            req,
            target,
            tag,
            data,
        }
    })
    .await
}

async fn acknowledged(
    peers: &Peers,
    addr: &str,
    about: About,
    bytes: usize,
    deadline: Deadline,
    make: impl FnOnce(u64) -> Request,
) -> Result<(), TransportError> {
    let cap = peers.config().frame_cap;
    if bytes > cap.saturating_sub(128) {
        return Err(super::too_large("a payload", bytes, cap));
    }
    match peers.call(addr, about, deadline, make).await? {
        Answer::Whole(Response::Done { .. }) => Ok(()),
        Answer::Whole(Response::Failed { error, .. }) => Err(error),
        // A read's payload, dropped here, is discarded by the connection.
        Answer::Whole(Response::ReadOk { .. }) | Answer::Read { .. } => Err(protocol(
            about,
            addr,
            format!("a {:?} answered with read data", about.op),
        )),
    }
}
