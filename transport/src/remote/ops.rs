//! The three peer operations as requests over [`Peers`]: what every process-crossing backend's
//! `read`, `accumulate` and `send` do once they know the owner's address.

use std::ops::Range;

use bytes::Bytes;

use super::client::{About, Peers};
use crate::error::wide;
use crate::wire::{Request, Response, Target};
use crate::{codec, Deadline, Dest, Op, RegionHandle, Transport, TransportError, WriteTag};

fn protocol(about: About, addr: &str, what: String) -> TransportError {
    TransportError::Unreachable {
        owner: about.owner,
        reason: format!("{addr}: protocol violation: {what}"),
    }
}

/// Read `range` of the region `target` at `addr` into `into` (a region of the reader's own
/// transport straight from its fabric, without a socket). A range of more than
/// `read_part_bytes` travels as parts in flight at once; parts that saw different publications are
/// read again (C1), until the deadline.
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
    let about = About {
        owner: target.owner,
        region: target.region,
        op: Op::Read,
    };
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
    loop {
        let calls = parts.iter().map(|part| {
            peers.call(addr, about, deadline, |req| Request::Read {
                req,
                target,
                start: wide(range.start),
                end: wide(range.end),
                part: (wide(part.start), wide(part.end)),
                dest: spec,
            })
        });
        let mut answers = Vec::with_capacity(parts.len());
        for answer in futures::future::join_all(calls).await {
            match answer? {
                Response::ReadOk {
                    version,
                    dtype,
                    data,
                    ..
                } => answers.push((version, dtype, data)),
                Response::Failed { error, .. } => return Err(error),
                Response::Done { .. } => {
                    return Err(protocol(about, addr, "a read answered with Done".into()))
                }
            }
        }
        let version = answers.first().map(|a| a.0).unwrap_or_default();
        if answers.iter().any(|a| a.0 != version) {
            // Parts of two publications: read again (a publication is rare, once per step).
            if crate::now() >= deadline {
                return Err(about.deadline_error());
            }
            continue;
        }
        fill(&mut into, &parts, range.start, &answers, about, addr)?;
        return Ok(version);
    }
}

/// Write the parts' bytes into the destination, each at its place.
fn fill(
    into: &mut Dest<'_>,
    parts: &[Range<usize>],
    start: usize,
    answers: &[(u64, crate::Dtype, Bytes)],
    about: About,
    addr: &str,
) -> Result<(), TransportError> {
    for (part, (_, dtype, data)) in parts.iter().zip(answers) {
        let size = dtype.size();
        if data.len() != part.len() * size {
            return Err(protocol(
                about,
                addr,
                format!(
                    "{} bytes for a part of {} {dtype:?} elements",
                    data.len(),
                    part.len()
                ),
            ));
        }
        let at = part.start - start;
        let written = match into {
            Dest::Bytes(buf) => buf
                .get_mut(at * size..(at + part.len()) * size)
                .map(|out| out.copy_from_slice(data))
                .ok_or(()),
            Dest::F32(out) => match out.get_mut(at..at + part.len()) {
                Some(out) => codec::decode_into(*dtype, data, out).map_err(|_| ()),
                None => Err(()),
            },
            // The owner refuses device destinations before answering.
            Dest::Device(_) => Err(()),
        };
        written.map_err(|()| {
            protocol(
                about,
                addr,
                "an answer that does not fit the destination the owner accepted".into(),
            )
        })?;
    }
    Ok(())
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
    let about = About {
        owner: target.owner,
        region: target.region,
        op: Op::Accumulate,
    };
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
    let about = About {
        owner: target.owner,
        region: target.region,
        op: Op::Send,
    };
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
        Response::Done { .. } => Ok(()),
        Response::Failed { error, .. } => Err(error),
        Response::ReadOk { .. } => Err(protocol(
            about,
            addr,
            format!("a {:?} answered with read data", about.op),
        )),
    }
}
