//! Read destinations: memory the caller owns, which a read fills in place (no hidden copy).

use crate::codec;
use crate::{Dtype, RegionId, TransportError};

/// Where a [`Transport::read`](crate::Transport::read) writes the elements it reads. The caller
/// owns the memory; a read fills exactly `range.len()` elements of it or, on any refusal before
/// the transfer, leaves it untouched.
pub enum Dest<'a> {
    /// Raw little-endian elements of the region's dtype: `range.len() * dtype.size()` bytes.
    Bytes(&'a mut [u8]),
    /// Decoded to `f32` (bf16 widened exactly): `range.len()` values.
    F32(&'a mut [f32]),
    /// Device memory, for the `cuda` backend's device-to-device copies. Host backends refuse it
    /// with [`TransportError::Unsupported`].
    Device(DeviceDest),
}

/// A range of device memory a read may write: `bytes` bytes at device address `ptr` on CUDA device
/// ordinal `device`. Plain data; only a backend that owns a device context dereferences it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceDest {
    pub device: u32,
    pub ptr: u64,
    pub bytes: u64,
}

impl std::fmt::Debug for Dest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dest::Bytes(buf) => write!(f, "Dest::Bytes({} bytes)", buf.len()),
            Dest::F32(out) => write!(f, "Dest::F32({} values)", out.len()),
            Dest::Device(device) => write!(f, "Dest::{device:?}"),
        }
    }
}

/// The shape of a [`Dest`] without its memory: what a process-crossing backend tells the owner so
/// the owner refuses a wrong destination in the contract's order (C4), before any bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DestSpec {
    /// Raw bytes: this many.
    Bytes(u64),
    /// Decoded `f32`s: this many.
    F32(u64),
    /// Device memory (host backends refuse it).
    Device(DeviceDest),
}

impl DestSpec {
    /// Host backends: refuse a destination that cannot take `elements` elements of `dtype` of
    /// `region` exactly as [`Dest`] filling would ([`TransportError::BadDestination`],
    /// [`TransportError::Unsupported`]).
    pub(crate) fn check_host(
        self,
        region: RegionId,
        dtype: Dtype,
        elements: usize,
    ) -> Result<(), TransportError> {
        let (expected, got) = match self {
            DestSpec::Bytes(got) => (elements.saturating_mul(dtype.size()), got),
            DestSpec::F32(got) => (elements, got),
            DestSpec::Device(device) => return Err(device_unsupported(region, device)),
        };
        if crate::error::wide(expected) != got {
            return Err(TransportError::BadDestination {
                region,
                expected: crate::error::wide(expected),
                got,
            });
        }
        Ok(())
    }
}

fn device_unsupported(region: RegionId, device: DeviceDest) -> TransportError {
    TransportError::Unsupported {
        what: format!(
            "read of region {region} into device memory ({} bytes at {:#x} on device {}): \
             this backend writes host memory only",
            device.bytes, device.ptr, device.device
        ),
    }
}

impl Dest<'_> {
    /// This destination's shape.
    pub fn spec(&self) -> DestSpec {
        match self {
            Dest::Bytes(buf) => DestSpec::Bytes(crate::error::wide(buf.len())),
            Dest::F32(out) => DestSpec::F32(crate::error::wide(out.len())),
            Dest::Device(device) => DestSpec::Device(*device),
        }
    }

    /// Host backends: write the elements `src` (little-endian `dtype`, whole elements) of `region`
    /// into this destination in one pass, decoding for [`Dest::F32`]. A destination of the wrong
    /// size is [`TransportError::BadDestination`], a device one [`TransportError::Unsupported`];
    /// either way nothing is written.
    pub(crate) fn fill_from_host(
        self,
        region: RegionId,
        dtype: Dtype,
        src: &[u8],
    ) -> Result<(), TransportError> {
        match self {
            Dest::Bytes(buf) => {
                if buf.len() != src.len() {
                    return Err(TransportError::BadDestination {
                        region,
                        expected: crate::error::wide(src.len()),
                        got: crate::error::wide(buf.len()),
                    });
                }
                buf.copy_from_slice(src);
                Ok(())
            }
            Dest::F32(out) => {
                let elements = src.len() / dtype.size();
                if out.len() != elements {
                    return Err(TransportError::BadDestination {
                        region,
                        expected: crate::error::wide(elements),
                        got: crate::error::wide(out.len()),
                    });
                }
                codec::decode_into(dtype, src, out).map_err(|e| e.for_region(region))
            }
            Dest::Device(device) => Err(device_unsupported(region, device)),
        }
    }
}
