//! Moving one unit's elements between a trainer and the shard servers (contract C5: every chunk of
//! every overlapping shard at once, as one batch with one deadline): reads of the published copy
//! into a destination the caller owns, and tagged fp32 gradient writes into the accumulators.

use std::ops::Range;
use std::time::Instant;

use bytes::Bytes;
use odc_transport::{
    chunk_ranges, AccumulateOp, Dest, Dtype, EndpointId, ReadOp, Transport, WriteTag,
};

use crate::directory::ShardRoute;
use crate::error::{Error, Result};
use crate::layout::UnitId;

/// The intersection of two ranges (empty when disjoint).
pub(crate) fn overlap(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    let start = a.start.max(b.start);
    start..a.end.min(b.end).max(start)
}

/// Where pulled elements go: decoded fp32 values, or the raw bytes of the published dtype.
pub(crate) enum Out<'a> {
    F32(&'a mut [f32]),
    Bytes(&'a mut [u8]),
    /// Device memory of the published dtype (a transport that reaches it copies device to
    /// device).
    #[cfg_attr(not(feature = "cuda-code"), allow(dead_code))]
    Device(odc_transport::DeviceDest),
}

/// The dtype every shard of a unit publishes in; a directory mixing dtypes is refused.
pub(crate) fn published_dtype(routes: &[ShardRoute], unit: UnitId) -> Result<Dtype> {
    let Some(first) = routes.first() else {
        return Err(Error::Layout(format!("unit {unit} has no shard routes")));
    };
    let dtype = first.published.dtype;
    if let Some(other) = routes.iter().find(|r| r.published.dtype != dtype) {
        return Err(Error::Layout(format!(
            "unit {unit}: server {} publishes {:?} but server {} publishes {dtype:?}",
            other.owner, other.published.dtype, first.owner
        )));
    }
    Ok(dtype)
}

/// Read elements `range` of `unit` at `version` from the shards overlapping it, every chunk of
/// every shard in one batch, straight into `out` (`range.len()` elements). Returns the bytes moved.
///
/// Errors name the unit and the owner: a failed read is [`Error::Pull`], a chunk of another
/// version [`Error::VersionMismatch`] (I1), routes that do not cover `range` [`Error::Layout`].
#[allow(clippy::too_many_arguments)]
pub(crate) async fn pull(
    transport: &dyn Transport,
    routes: &[ShardRoute],
    unit: UnitId,
    range: Range<usize>,
    version: u64,
    chunk_elems: usize,
    out: Out<'_>,
    deadline: Instant,
) -> Result<u64> {
    let dtype = published_dtype(routes, unit)?;
    let mut plan: Vec<(usize, Range<usize>)> = Vec::new();
    let mut cursor = range.start;
    for (index, route) in routes.iter().enumerate() {
        for chunk in chunk_ranges(overlap(&route.range(), &range), chunk_elems) {
            if chunk.start != cursor {
                return Err(gap(unit, cursor, chunk.start));
            }
            cursor = chunk.end;
            plan.push((index, chunk));
        }
    }
    if cursor != range.end {
        return Err(gap(unit, cursor, range.end));
    }
    let mut ops = Vec::with_capacity(plan.len());
    match out {
        Out::F32(mut rest) => {
            if rest.len() != range.len() {
                return Err(out_size(unit, range.len(), rest.len()));
            }
            for (index, chunk) in &plan {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(chunk.len());
                rest = tail;
                ops.push(read_op(&routes[*index], chunk, Dest::F32(head)));
            }
        }
        Out::Bytes(mut rest) => {
            let size = dtype.size();
            if rest.len() != range.len() * size {
                return Err(out_size(unit, range.len() * size, rest.len()));
            }
            for (index, chunk) in &plan {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(chunk.len() * size);
                rest = tail;
                ops.push(read_op(&routes[*index], chunk, Dest::Bytes(head)));
            }
        }
        Out::Device(dest) => {
            let size = dtype.size() as u64;
            if dest.bytes != range.len() as u64 * size {
                return Err(out_size(
                    unit,
                    range.len() * dtype.size(),
                    dest.bytes as usize,
                ));
            }
            for (index, chunk) in &plan {
                let at = (chunk.start - range.start) as u64 * size;
                let piece = odc_transport::DeviceDest {
                    device: dest.device,
                    ptr: dest.ptr + at,
                    bytes: chunk.len() as u64 * size,
                };
                ops.push(read_op(&routes[*index], chunk, Dest::Device(piece)));
            }
        }
    }
    let results = transport.read_batch(ops, deadline).await;
    for ((index, _), result) in plan.iter().zip(results) {
        let owner = routes[*index].owner;
        let got = result.map_err(|source| Error::Pull {
            unit,
            owner,
            source,
        })?;
        if got != version {
            return Err(Error::VersionMismatch {
                unit,
                owner,
                expected: version,
                got,
            });
        }
    }
    Ok((range.len() * dtype.size()) as u64)
}

fn read_op<'a>(route: &'a ShardRoute, chunk: &Range<usize>, into: Dest<'a>) -> ReadOp<'a> {
    // `chunk` is in unit coordinates; the region starts at the shard's start.
    let start = route.range().start;
    ReadOp {
        handle: &route.published,
        range: chunk.start - start..chunk.end - start,
        into,
    }
}

fn gap(unit: UnitId, from: usize, to: usize) -> Error {
    Error::Layout(format!(
        "the shard routes of unit {unit} do not cover elements {from}..{to}"
    ))
}

fn out_size(unit: UnitId, expected: usize, got: usize) -> Error {
    Error::Internal(format!(
        "pull of unit {unit}: destination holds {got} elements or bytes, {expected} expected"
    ))
}

/// One encoded gradient chunk bound for one shard's accumulator.
pub(crate) struct Write {
    pub owner: EndpointId,
    pub op: AccumulateOp,
}

/// Every shard of `unit` has an accumulator to push into; a frozen unit's have none
/// ([`Error::FrozenUnit`]: the trainer context refuses its push before a data path sees it).
pub(crate) fn check_pushable(routes: &[ShardRoute], unit: UnitId) -> Result<()> {
    match routes.iter().find(|r| r.accumulator.is_none()) {
        None => Ok(()),
        Some(route) => Err(Error::FrozenUnit {
            unit,
            name: format!("no accumulator at server {}", route.owner),
        }),
    }
}

/// Encode `values` (elements `range` of a unit's gradient) with `encode` (fp32 bytes) as chunks for
/// the shards overlapping it, tagged by `tag(shard index, chunk index)`: the one copy of the
/// gradient's bytes. An encoder that checks what it encodes stops the whole push at its first
/// error, returned with the unit index its chunk starts at. Shards without an accumulator (a
/// frozen unit's) get no write: callers refuse such a unit first ([`check_pushable`]).
pub(crate) fn encode_writes<E>(
    routes: &[ShardRoute],
    range: Range<usize>,
    values: &[f32],
    tag: impl Fn(u32, u32) -> WriteTag,
    chunk_elems: usize,
    encode: impl Fn(&[f32]) -> std::result::Result<Bytes, E>,
) -> std::result::Result<Vec<Write>, (usize, E)> {
    let mut writes = Vec::new();
    for (shard, route) in routes.iter().enumerate() {
        let Some(accumulator) = &route.accumulator else {
            continue;
        };
        let shard_range = route.range();
        for (chunk, r) in chunk_ranges(overlap(&shard_range, &range), chunk_elems).enumerate() {
            let data = encode(&values[r.start - range.start..r.end - range.start])
                .map_err(|e| (r.start, e))?;
            writes.push(Write {
                owner: route.owner,
                op: AccumulateOp {
                    handle: accumulator.clone(),
                    offset: r.start - shard_range.start,
                    data,
                    tag: tag(shard as u32, chunk as u32),
                },
            });
        }
    }
    Ok(writes)
}

/// Accumulate every write in one batch; resolves when all are acknowledged. Returns the bytes sent.
pub(crate) async fn send_writes(
    transport: &dyn Transport,
    unit: UnitId,
    writes: Vec<Write>,
    deadline: Instant,
) -> Result<u64> {
    let bytes: u64 = writes.iter().map(|w| w.op.data.len() as u64).sum();
    let owners: Vec<EndpointId> = writes.iter().map(|w| w.owner).collect();
    let results = transport
        .accumulate_batch(writes.into_iter().map(|w| w.op).collect(), deadline)
        .await;
    for (owner, result) in owners.into_iter().zip(results) {
        result.map_err(|source| Error::Push {
            unit,
            owner,
            source,
        })?;
    }
    Ok(bytes)
}

/// Write id unique per (micro-batch, unit, shard, chunk) within one epoch: each field in its own
/// 32 bits, the micro-batch in the top ones.
///
/// ```
/// use odc_actors::datapath::{micro_batch_of, write_id};
/// assert_eq!(micro_batch_of(write_id(7, 1, 2, 3)), 7);
/// ```
pub fn write_id(micro_batch: u32, unit: UnitId, shard: u32, chunk: u32) -> u128 {
    (u128::from(micro_batch) << 96)
        | (u128::from(unit) << 64)
        | (u128::from(shard) << 32)
        | u128::from(chunk)
}

/// The micro-batch a [`write_id`] names (its top 32 bits): whose token the write must carry.
pub fn micro_batch_of(write_id: u128) -> u32 {
    (write_id >> 96) as u32
}

/// Add the fp32 gradient of `op`'s unit's elements `range`, in device memory at `src`, into the
/// accumulators of the shards overlapping it, device to device (the `cuda` backend's
/// `accumulate_device`: one add per shard, acknowledged, under write id (`op`'s micro-batch,
/// unit, shard, 0) and `op`'s epoch and token). Returns the bytes moved.
#[cfg(feature = "cuda-code")]
pub(crate) async fn push_device(
    cuda: &odc_transport::cuda::CudaTransport,
    routes: &[ShardRoute],
    op: &super::Op,
    range: Range<usize>,
    src: odc_transport::DeviceDest,
) -> Result<u64> {
    let unit = op.key.unit;
    let mut bytes = 0;
    for (shard, route) in routes.iter().enumerate() {
        let Some(accumulator) = &route.accumulator else {
            continue;
        };
        let shard_range = route.range();
        let both = overlap(&shard_range, &range);
        if both.is_empty() {
            continue;
        }
        let piece = odc_transport::DeviceDest {
            device: src.device,
            ptr: src.ptr + (both.start - range.start) as u64 * 4,
            bytes: both.len() as u64 * 4,
        };
        let tag = WriteTag {
            epoch: op.key.epoch,
            write_id: write_id(op.micro_batch, unit, shard as u32, 0),
            token: op.token,
        };
        cuda.accumulate_device(
            accumulator,
            both.start - shard_range.start,
            piece,
            tag,
            op.deadline,
        )
        .await
        .map_err(|source| Error::Push {
            unit,
            owner: route.owner,
            source,
        })?;
        bytes += piece.bytes;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_ids_are_distinct_per_field() {
        let base = write_id(1, 2, 3, 4);
        for other in [
            write_id(2, 2, 3, 4),
            write_id(1, 3, 3, 4),
            write_id(1, 2, 4, 4),
            write_id(1, 2, 3, 5),
        ] {
            assert_ne!(base, other);
        }
        assert_eq!(
            write_id(u32::MAX, u32::MAX, u32::MAX, u32::MAX),
            u128::MAX,
            "every field has its own 32 bits"
        );
    }

    #[test]
    fn the_micro_batch_is_read_back_from_any_write_id() {
        for mb in [0, 1, 77, u32::MAX] {
            for (unit, shard, chunk) in [(0, 0, 0), (u32::MAX, u32::MAX, u32::MAX), (3, 1, 9)] {
                assert_eq!(micro_batch_of(write_id(mb, unit, shard, chunk)), mb);
            }
        }
    }

    #[test]
    fn overlap_of_disjoint_ranges_is_empty() {
        assert!(overlap(&(0..4), &(6..9)).is_empty());
        assert_eq!(overlap(&(0..7), &(5..9)), 5..7);
    }
}
