//! A gang's exchange over the job's transport: [`TransportLink`], one member's end, over its
//! trainer's [`GangChannel`] (an inbox on the transport, C7), so that any backend — in-process,
//! shm, tcp, cuda — carries it.
//!
//! - Each message is one inbox message of the attempt's epoch, its write id naming the gang, the
//!   attention call, the pass, the ring step, the sender and the receiver ([`write_id`]): every
//!   message of an attempt is unique, and C7 refuses a repeat.
//! - Tensors travel as their dtype, shape and values in that dtype ([`encode`]: a bf16 block is
//!   half the bytes of an fp32 one, and exact) and arrive on the receiver's device. Between GPUs
//!   of a host over the `cuda` transport (feature `cuda`) the values go device to device and only
//!   the head ([`encode_head`]) crosses host memory (`device`); otherwise they go through host
//!   memory, and from or onto a GPU count as host staging
//!   ([`host_staging_bytes`](super::host_staging_bytes)).
//! - A receive waits at most the link's timeout (I6) and ends at once when the attempt is
//!   discarded (the group's epoch floor, raised by the supervisor's discard on every node: I2).
//!   [`GangLink::abort`] cannot reach the other members from here; they stop at that discard.
//!
//! The link blocks its thread on the transport's futures ([`tokio::runtime::Handle::block_on`]):
//! the compute runs it inside `odc::blocking` on a multi-threaded runtime, which
//! [`TransportLink::new`] checks.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use candle_core::{DType, Device, Tensor};
use odc_actors::datapath::GangChannel;
use odc_transport::deadline_in;
use tokio::runtime::{Handle, RuntimeFlavor};

use crate::compute::host_staging;
use crate::model::error::{Error, Result};
use crate::model::gang::{GangLink, Pass, Tag};

/// The write id of gang `gang`'s message `tag` from member `from` to member `to`.
pub fn write_id(gang: u32, tag: Tag, from: u32, to: u32) -> u128 {
    let pass = match tag.pass {
        Pass::Forward => 0u128,
        Pass::Backward => 1,
    };
    (u128::from(gang) << 96)
        | (u128::from(tag.call) << 64)
        | (pass << 63)
        | (u128::from(tag.step & 0x7fff_ffff) << 32)
        | (u128::from(from & 0xffff) << 16)
        | u128::from(to & 0xffff)
}

/// One member's end of a gang over the transport (see the [module docs](self)).
pub struct TransportLink {
    channel: Arc<GangChannel>,
    runtime: Handle,
    epoch: u64,
    gang: u32,
    member: usize,
    /// Each member's trainer, in member order.
    ranks: Vec<u32>,
    timeout: Duration,
    /// Where received tensors go.
    device: Device,
    aborted: Mutex<Option<String>>,
}

impl fmt::Debug for TransportLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransportLink")
            .field("epoch", &self.epoch)
            .field("gang", &self.gang)
            .field("member", &self.member)
            .field("ranks", &self.ranks)
            .finish()
    }
}

impl TransportLink {
    /// Member `member` of gang `gang` of attempt `epoch`, whose members are the trainers `ranks`,
    /// receiving onto `device`, each wait at most `timeout`. Needs a multi-threaded tokio runtime
    /// (the link blocks inside the compute's blocking section).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        channel: Arc<GangChannel>,
        epoch: u64,
        gang: u32,
        member: usize,
        ranks: Vec<u32>,
        timeout: Duration,
        device: Device,
    ) -> Result<Self> {
        let runtime = Handle::try_current()
            .ok()
            .filter(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread)
            .ok_or_else(|| {
                Error::Gang(
                    "a gang's exchange over the transport needs a multi-threaded tokio runtime"
                        .into(),
                )
            })?;
        if member >= ranks.len() || ranks.get(member) != Some(&channel.rank()) {
            return Err(Error::Gang(format!(
                "member {member} of gang {gang} is trainer {:?}, this trainer is {}",
                ranks.get(member),
                channel.rank()
            )));
        }
        Ok(TransportLink {
            channel,
            runtime,
            epoch,
            gang,
            member,
            ranks,
            timeout,
            device,
            aborted: Mutex::new(None),
        })
    }

    fn check(&self) -> Result<()> {
        match &*self.aborted.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(reason) => Err(Error::Gang(format!("the gang was aborted: {reason}"))),
            None => Ok(()),
        }
    }

    fn rank_of(&self, member: usize) -> Result<u32> {
        self.ranks.get(member).copied().ok_or_else(|| {
            Error::Gang(format!(
                "member {} of a gang of {}: no member {member}",
                self.member,
                self.ranks.len()
            ))
        })
    }

    /// `tensors` to trainer `rank` as message `id`, their values through host memory (counted
    /// as host staging when they leave a GPU).
    fn send_host(
        &self,
        rank: u32,
        id: u128,
        tensors: &[Tensor],
        deadline: odc_transport::Deadline,
    ) -> Result<odc_actors::Result<()>> {
        let data = encode(tensors)?;
        if tensors.iter().any(|t| t.device().is_cuda()) {
            host_staging::staged("down", data.len() as u64);
        }
        Ok(self
            .runtime
            .block_on(self.channel.send(rank, self.epoch, id, data, deadline)))
    }
}

impl GangLink for TransportLink {
    fn member(&self) -> usize {
        self.member
    }

    fn members(&self) -> usize {
        self.ranks.len()
    }

    fn send(&self, to: usize, tag: Tag, tensors: Vec<Tensor>) -> Result<()> {
        self.check()?;
        let rank = self.rank_of(to)?;
        let id = write_id(self.gang, tag, self.member as u32, to as u32);
        let deadline = deadline_in(self.timeout);
        #[cfg(feature = "cuda")]
        let sent = if self.channel.device_messages() && device::applies(&tensors) {
            device::send(self, rank, id, &tensors, deadline)?
        } else {
            self.send_host(rank, id, &tensors, deadline)?
        };
        #[cfg(not(feature = "cuda"))]
        let sent = self.send_host(rank, id, &tensors, deadline)?;
        sent.map_err(|e| {
            Error::Gang(format!(
                "member {} (trainer {}) sending {tag} to member {to} (trainer {rank}): {e}",
                self.member,
                self.channel.rank()
            ))
        })
    }

    fn recv(&self, from: usize, tag: Tag) -> Result<Vec<Tensor>> {
        self.check()?;
        let rank = self.rank_of(from)?;
        let id = write_id(self.gang, tag, from as u32, self.member as u32);
        let deadline = deadline_in(self.timeout);
        let waiting = |e: odc_actors::Error| {
            Error::Gang(format!(
                "member {} (trainer {}) waiting for member {from}'s {tag} (trainer {rank}): {e}",
                self.member,
                self.channel.rank()
            ))
        };
        let malformed = |e: Error| {
            Error::Gang(format!(
                "member {from}'s {tag} (trainer {rank}) is malformed: {e}"
            ))
        };
        #[cfg(feature = "cuda")]
        if self.channel.device_messages() && self.device.is_cuda() {
            let got = self
                .runtime
                .block_on(self.channel.recv_device(rank, self.epoch, id, deadline));
            let (header, values) = got.map_err(waiting)?;
            return match values {
                Some(values) => device::receive(self, &header, &values, deadline),
                None => {
                    host_staging::staged("up", header.len() as u64);
                    decode(&header, &self.device)
                }
            }
            .map_err(malformed);
        }
        let got = self
            .runtime
            .block_on(self.channel.recv(rank, self.epoch, id, deadline));
        let bytes = got.map_err(waiting)?;
        if self.device.is_cuda() {
            host_staging::staged("up", bytes.len() as u64);
        }
        decode(&bytes, &self.device).map_err(malformed)
    }

    fn abort(&self, reason: &str) {
        let mut aborted = self.aborted.lock().unwrap_or_else(|p| p.into_inner());
        if aborted.is_none() {
            *aborted = Some(format!("member {}: {reason}", self.member));
        }
    }
}

/// A gang's messages as device messages (feature `cuda`, the job's transport the `cuda`
/// backend): tensors on a GPU go device to device, never through host memory.
///
/// - **Sending**: the tensors (made contiguous) are read by the transport's own stream once the
///   device finished the kernels that wrote them (the device is synchronised first); the send
///   returns once their values are copied into the receiver's memory (`CudaTransport::send_device`),
///   so they may be freed after it.
/// - **Receiving**: each tensor gets a buffer on the receiver's stream, free when handed out
///   ([`resident::Memory::tensor`]); the values are copied into them and waited for before the
///   tensors are returned, so the compute's next kernels read them whole.
#[cfg(feature = "cuda")]
mod device {
    use bytes::Bytes;
    use candle_core::{DType, Tensor};
    use odc_transport::{Deadline, Dtype};

    use super::{decode_head, encode_head, Shape, TransportLink, Values};
    use crate::compute::resident;
    use crate::model::error::{Error, Result};

    /// Whether `tensors` travel as a device message: each on a CUDA device, f32 or bf16.
    pub(super) fn applies(tensors: &[Tensor]) -> bool {
        tensors
            .iter()
            .all(|t| t.device().is_cuda() && matches!(t.dtype(), DType::F32 | DType::BF16))
    }

    /// Send `tensors` to trainer `rank` as message `id` (see the [module docs](self)).
    pub(super) fn send(
        link: &TransportLink,
        rank: u32,
        id: u128,
        tensors: &[Tensor],
        deadline: Deadline,
    ) -> Result<odc_actors::Result<()>> {
        let contiguous = tensors
            .iter()
            .map(Tensor::contiguous)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let ranges = contiguous
            .iter()
            .map(resident::device_range)
            .collect::<Result<Vec<_>>>()?;
        if let Some(first) = contiguous.first() {
            first.device().synchronize()?;
        }
        let header = encode_head(&contiguous, Values::Device)?.freeze();
        let sent = link.runtime.block_on(
            link.channel
                .send_device(rank, link.epoch, id, header, &ranges, deadline),
        );
        drop(contiguous);
        Ok(sent)
    }

    /// The tensors of a device message: `header` says what `values` hold.
    pub(super) fn receive(
        link: &TransportLink,
        header: &Bytes,
        values: &odc_transport::cuda::DeviceValues,
        deadline: Deadline,
    ) -> Result<Vec<Tensor>> {
        let (kind, shapes, used) = decode_head(header)?;
        let total: usize = shapes.iter().map(Shape::bytes).sum();
        if kind != Values::Device || used != header.len() || total != values.len() {
            return Err(Error::Gang(format!(
                "a head of {used} of {} bytes for {} tensors of {total} bytes ({kind:?}) came \
                 with {} bytes of device values",
                header.len(),
                shapes.len(),
                values.len()
            )));
        }
        let memory = resident::Memory::new(&link.device)?;
        let mut tensors = Vec::with_capacity(shapes.len());
        let mut dests = Vec::with_capacity(shapes.len());
        for shape in shapes {
            let dtype = match shape.dtype {
                DType::F32 => Dtype::F32,
                DType::BF16 => Dtype::Bf16,
                other => {
                    return Err(Error::Gang(format!(
                        "device values of {other:?}, not f32 or bf16"
                    )))
                }
            };
            let elements = shape.dims.iter().product();
            let (flat, dest) = link
                .runtime
                .block_on(memory.tensor(elements, dtype))
                .map_err(|e| Error::Device(e.to_string()))?;
            tensors.push(flat.reshape(shape.dims)?);
            dests.push(dest);
        }
        link.channel
            .copy_out(values, &dests, deadline)
            .map_err(|e| Error::Device(e.to_string()))?;
        Ok(tensors)
    }
}

/// Bytes per element of a dtype the wire carries: f32 (code 0), bf16 (1), f16 (2).
fn width(dtype: DType) -> usize {
    if dtype == DType::F32 {
        4
    } else {
        2
    }
}

/// Where a message's values are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Values {
    /// After the head, in the message's own bytes ([`encode`]).
    Inline,
    /// In device memory that came with the message, in the head's order (the `cuda` backend's
    /// device messages).
    Device,
}

/// What a message's head says of one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    pub dtype: DType,
    pub dims: Vec<usize>,
}

impl Shape {
    /// Bytes of its values.
    pub fn bytes(&self) -> usize {
        width(self.dtype) * self.dims.iter().product::<usize>()
    }
}

/// A message's head: its tensor count, where the values are, then each tensor's dtype code,
/// rank and dimensions, little-endian.
pub fn encode_head(tensors: &[Tensor], values: Values) -> Result<BytesMut> {
    let mut out = BytesMut::new();
    out.put_u32_le(tensors.len() as u32);
    out.put_u8(match values {
        Values::Inline => 0,
        Values::Device => 1,
    });
    for t in tensors {
        let code = match t.dtype() {
            DType::F32 => 0u8,
            DType::BF16 => 1,
            DType::F16 => 2,
            other => {
                return Err(Error::Gang(format!(
                    "a gang exchanges f32, bf16 or f16 tensors, not {other:?}"
                )))
            }
        };
        out.put_u8(code);
        out.put_u8(t.rank() as u8);
        for &d in t.dims() {
            out.put_u64_le(d as u64);
        }
    }
    Ok(out)
}

/// Tensors as one message: the head ([`encode_head`], [`Values::Inline`]), then each tensor's
/// values in its dtype, little-endian.
pub fn encode(tensors: &[Tensor]) -> Result<Bytes> {
    let mut out = encode_head(tensors, Values::Inline)?;
    for t in tensors {
        let flat = t.flatten_all()?.to_device(&Device::Cpu)?;
        out.reserve(width(t.dtype()) * flat.elem_count());
        match t.dtype() {
            DType::BF16 => {
                for v in flat.to_vec1::<half::bf16>()? {
                    out.put_u16_le(v.to_bits());
                }
            }
            DType::F16 => {
                for v in flat.to_vec1::<half::f16>()? {
                    out.put_u16_le(v.to_bits());
                }
            }
            _ => {
                for v in flat.to_vec1::<f32>()? {
                    out.put_f32_le(v);
                }
            }
        }
    }
    Ok(out.freeze())
}

/// A message's head: where its values are, each tensor's shape, and the head's length in
/// bytes. A malformed head (or one whose inline values could not fit the message) is an error
/// naming what was wrong.
pub fn decode_head(bytes: &[u8]) -> Result<(Values, Vec<Shape>, usize)> {
    let bad = |what: String| Error::Gang(what);
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8]> {
        let end = at
            .checked_add(n)
            .filter(|&e| e <= bytes.len())
            .ok_or_else(|| bad(format!("{} bytes end inside a field at {at}", bytes.len())))?;
        let s = &bytes[at..end];
        at = end;
        Ok(s)
    };
    let count = u32::from_le_bytes(take(4)?.try_into().unwrap_or_default()) as usize;
    if count > 64 {
        return Err(bad(format!("{count} tensors in one message")));
    }
    let values = match take(1)?[0] {
        0 => Values::Inline,
        1 => Values::Device,
        c => return Err(bad(format!("values flag {c}"))),
    };
    let mut shapes = Vec::with_capacity(count);
    for i in 0..count {
        let head = take(2)?;
        let dtype = match head[0] {
            0 => DType::F32,
            1 => DType::BF16,
            2 => DType::F16,
            c => return Err(bad(format!("tensor {i} has dtype code {c}"))),
        };
        let rank = head[1] as usize;
        if rank > 8 {
            return Err(bad(format!("tensor {i} has {rank} dimensions")));
        }
        let mut dims = Vec::with_capacity(rank);
        for _ in 0..rank {
            let d = u64::from_le_bytes(take(8)?.try_into().unwrap_or_default());
            dims.push(usize::try_from(d).map_err(|_| bad(format!("tensor {i}: dimension {d}")))?);
        }
        // Inline values must fit the message; device values are bounded the same way, so that
        // a header cannot ask the receiver for more memory than any sender could send inline.
        dims.iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|&n| {
                n.checked_mul(width(dtype))
                    .is_some_and(|b| values == Values::Device || b <= bytes.len())
            })
            .filter(|&n| n <= 1 << 40)
            .ok_or_else(|| bad(format!("tensor {i} of shape {dims:?} exceeds the message")))?;
        shapes.push(Shape { dtype, dims });
    }
    Ok((values, shapes, at))
}

/// The tensors of an [`encode`]d message, on `device`; a malformed message is an error naming
/// what was wrong.
pub fn decode(bytes: &[u8], device: &Device) -> Result<Vec<Tensor>> {
    let bad = |what: String| Error::Gang(what);
    let (values, shapes, mut at) = decode_head(bytes)?;
    if values == Values::Device {
        return Err(bad(format!(
            "a message of {} tensors whose values are in device memory came without them",
            shapes.len()
        )));
    }
    let mut tensors = Vec::with_capacity(shapes.len());
    for (i, shape) in shapes.into_iter().enumerate() {
        let raw = at
            .checked_add(shape.bytes())
            .and_then(|end| bytes.get(at..end))
            .ok_or_else(|| {
                bad(format!(
                    "tensor {i} of shape {:?} exceeds the message",
                    shape.dims
                ))
            })?;
        at += raw.len();
        let bits = || {
            raw.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
        };
        let dims = shape.dims;
        let host = match shape.dtype {
            DType::BF16 => {
                let values: Vec<half::bf16> = bits().map(half::bf16::from_bits).collect();
                Tensor::from_vec(values, dims, &Device::Cpu)?
            }
            DType::F16 => {
                let values: Vec<half::f16> = bits().map(half::f16::from_bits).collect();
                Tensor::from_vec(values, dims, &Device::Cpu)?
            }
            _ => {
                let values: Vec<f32> = raw
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                Tensor::from_vec(values, dims, &Device::Cpu)?
            }
        };
        tensors.push(host.to_device(device)?);
    }
    if at != bytes.len() {
        return Err(bad(format!(
            "{} bytes after the last of {} tensors",
            bytes.len() - at,
            tensors.len()
        )));
    }
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_cross_the_wire_exactly_in_their_own_dtype() {
        let cpu = Device::Cpu;
        let base = Tensor::arange(0f32, 24.0, &cpu)
            .unwrap()
            .affine(0.37, -1.1)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap();
        let all = [
            base.clone(),
            base.to_dtype(DType::BF16).unwrap(),
            base.to_dtype(DType::F16).unwrap(),
        ];
        let bytes = encode(&all).unwrap();
        // Count 4, flag 1; each tensor 2 + 3 × 8; then 24 values of 4, 2 and 2 bytes.
        assert_eq!(bytes.len(), 4 + 1 + 3 * 26 + 24 * (4 + 2 + 2));
        let back = decode(&bytes, &cpu).unwrap();
        assert_eq!(back.len(), 3);
        for (got, want) in back.iter().zip(&all) {
            assert_eq!(got.dtype(), want.dtype());
            assert_eq!(got.dims(), want.dims());
            let bits = |t: &Tensor| {
                t.to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(got), bits(want));
        }
    }

    #[test]
    fn a_malformed_message_is_an_error_naming_what_was_wrong() {
        let cpu = Device::Cpu;
        let t = Tensor::ones((2, 2), DType::BF16, &cpu).unwrap();
        let good = encode(std::slice::from_ref(&t)).unwrap();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (good[..good.len() - 1].to_vec(), "exceeds the message"),
            (good[..8].to_vec(), "end inside a field"),
            (
                {
                    let mut b = good.to_vec();
                    b[7..15].copy_from_slice(&(1u64 << 40).to_le_bytes());
                    b
                },
                "exceeds the message",
            ),
            ([&good[..], &[0u8][..]].concat(), "bytes after the last"),
            (
                {
                    let mut b = good.to_vec();
                    b[5] = 9;
                    b
                },
                "dtype code 9",
            ),
            (
                {
                    let mut b = good.to_vec();
                    b[6] = 200;
                    b
                },
                "200 dimensions",
            ),
            (vec![1, 2], "end inside a field"),
            (
                {
                    let mut b = good.to_vec();
                    b[4] = 7;
                    b
                },
                "values flag 7",
            ),
            (
                {
                    let mut b = good.to_vec();
                    b[4] = 1;
                    b
                },
                "came without them",
            ),
            (100u32.to_le_bytes().to_vec(), "100 tensors"),
        ];
        for (bytes, wanted) in cases {
            let e = decode(&bytes, &cpu).unwrap_err().to_string();
            assert!(e.contains(wanted), "{wanted}: {e}");
        }
        let ints = Tensor::new(&[1u32, 2], &cpu).unwrap();
        assert!(encode(&[ints]).unwrap_err().to_string().contains("not U32"));
    }
}
