//! Element encodings of region bytes.
//!
//! Every region holds little-endian elements of its [`Dtype`]: `f32` as IEEE-754 binary32, `bf16` as
//! the upper half of a binary32 rounded to nearest, ties to even ([`half::bf16::from_f32`]).
//! Accumulate payloads are always `f32`. Decoding `bf16` is exact (it widens bit for bit), so
//! [`round_trip`] is exactly what a reader of a region sees for a value its owner published.
//!
//! Guarantees:
//! - `decode(dtype, &encode(dtype, x))` equals `x.map(|v| round_trip(dtype, v))` bit for bit
//!   (NaNs stay NaN).
//! - The `f32` round trip is the identity on bits; the `bf16` round trip of a normal number within
//!   `bf16`'s range has a relative error of at most 2⁻⁸.
//! - Decoders never panic on bytes from a peer: a length that is not a whole number of elements, or
//!   not exactly the number of output elements, is a [`CodecError`], and nothing is written.

use bytes::Bytes;
use half::bf16;

use crate::error::wide;
use crate::{Dtype, RegionId, TransportError};

/// Bytes that do not fit the element count they were decoded for. Backends attach the region with
/// [`CodecError::for_region`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The byte count is not a multiple of the element size.
    #[error("{bytes} bytes are not a whole number of {dtype:?} elements")]
    NotWholeElements { dtype: Dtype, bytes: usize },
    /// Whole elements, but not as many as the output holds.
    #[error("{elements} {dtype:?} elements do not fit an output of {expected} elements")]
    LengthMismatch {
        dtype: Dtype,
        elements: usize,
        expected: usize,
    },
}

impl CodecError {
    /// The data-plane error for this failure in `region`: [`TransportError::BadPayload`] for a
    /// partial element, [`TransportError::LengthMismatch`] for a wrong element count.
    pub fn for_region(self, region: RegionId) -> TransportError {
        match self {
            CodecError::NotWholeElements { dtype, bytes } => TransportError::BadPayload {
                region,
                bytes: wide(bytes),
                dtype,
            },
            CodecError::LengthMismatch {
                elements, expected, ..
            } => TransportError::LengthMismatch {
                region,
                elements: wide(elements),
                len: wide(expected),
            },
        }
    }
}

/// Number of `dtype` elements in `bytes` bytes, or [`CodecError::NotWholeElements`].
///
/// ```
/// use odc_transport::{codec, Dtype};
/// assert_eq!(codec::element_count(Dtype::Bf16, 8), Ok(4));
/// assert!(codec::element_count(Dtype::F32, 6).is_err());
/// ```
pub fn element_count(dtype: Dtype, bytes: usize) -> Result<usize, CodecError> {
    if bytes % dtype.size() == 0 {
        Ok(bytes / dtype.size())
    } else {
        Err(CodecError::NotWholeElements { dtype, bytes })
    }
}

/// Encode `values` as little-endian `dtype` elements (`bf16`: round to nearest, ties to even).
///
/// ```
/// use odc_transport::{codec, Dtype};
/// let bytes = codec::encode(Dtype::Bf16, &[1.0, -2.5]);
/// assert_eq!(bytes.len(), 4);
/// assert_eq!(codec::decode(Dtype::Bf16, &bytes), Ok(vec![1.0, -2.5]));
/// ```
pub fn encode(dtype: Dtype, values: &[f32]) -> Bytes {
    let mut buf = vec![0u8; values.len() * dtype.size()];
    match dtype {
        Dtype::F32 => {
            for (dst, v) in buf.chunks_exact_mut(4).zip(values) {
                dst.copy_from_slice(&v.to_le_bytes());
            }
        }
        Dtype::Bf16 => {
            for (dst, v) in buf.chunks_exact_mut(2).zip(values) {
                dst.copy_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
    }
    Bytes::from(buf)
}

/// Encode `values` as little-endian `f32`, the accumulate payload format.
pub fn encode_f32(values: &[f32]) -> Bytes {
    encode(Dtype::F32, values)
}

/// The first element of a slice that is not finite (NaN or ±inf): its index and value.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("element {index} is {value}")]
pub struct NonFiniteElement {
    pub index: usize,
    pub value: f32,
}

/// Encode `values` as little-endian `f32` (the bytes of [`encode_f32`]) in the same pass that
/// checks every element is finite; the first NaN or ±inf is an error and nothing is returned.
/// One pass over the values when they are finite: about 1.3× the time of [`encode_f32`]
/// (measured on 16 MiB in 1 MiB chunks; `encode_f32` compiles to a plain copy).
///
/// ```
/// use odc_transport::codec;
/// assert_eq!(codec::encode_f32_finite(&[0.5, -3.0]).unwrap(), codec::encode_f32(&[0.5, -3.0]));
/// let bad = codec::encode_f32_finite(&[1.0, f32::INFINITY, f32::NAN]).unwrap_err();
/// assert_eq!((bad.index, bad.value), (1, f32::INFINITY));
/// ```
// Inlined: compiled out of line in this crate, the same loop measured 1.7–2× `encode_f32`.
#[inline]
pub fn encode_f32_finite(values: &[f32]) -> Result<Bytes, NonFiniteElement> {
    // The exponent field: all ones exactly for NaN and ±inf.
    const EXPONENT: u32 = 0x7f80_0000;
    let mut buf = vec![0u8; values.len() * 4];
    // The largest exponent field seen: a maximum over integers, which vectorises with the copy.
    let mut largest = 0u32;
    for (dst, v) in buf.chunks_exact_mut(4).zip(values) {
        let bits = v.to_bits();
        dst.copy_from_slice(&bits.to_le_bytes());
        largest = largest.max(bits & EXPONENT);
    }
    if largest != EXPONENT {
        return Ok(Bytes::from(buf));
    }
    // Only on failure: find which one.
    let index = values.iter().position(|v| !v.is_finite()).unwrap_or(0);
    Err(NonFiniteElement {
        index,
        value: values.get(index).copied().unwrap_or(f32::NAN),
    })
}

/// Decode little-endian `dtype` elements into `out`, which must hold exactly as many elements as
/// `bytes` (`out.len() * dtype.size() == bytes.len()`); on error `out` is untouched.
///
/// ```
/// use odc_transport::{codec, Dtype};
/// let mut out = [0.0f32; 2];
/// codec::decode_into(Dtype::F32, &codec::encode_f32(&[0.5, 3.0]), &mut out).unwrap();
/// assert_eq!(out, [0.5, 3.0]);
/// assert!(codec::decode_into(Dtype::F32, &[0u8; 4], &mut out).is_err());
/// ```
pub fn decode_into(dtype: Dtype, bytes: &[u8], out: &mut [f32]) -> Result<(), CodecError> {
    check_exact(dtype, bytes, out.len())?;
    match dtype {
        Dtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::Bf16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
    }
    Ok(())
}

/// Decode little-endian `dtype` elements into a new vector.
pub fn decode(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>, CodecError> {
    let mut out = vec![0.0; element_count(dtype, bytes.len())?];
    decode_into(dtype, bytes, &mut out)?;
    Ok(out)
}

/// Decode little-endian `f32` elements (an accumulate payload) into a new vector.
pub fn decode_f32(bytes: &[u8]) -> Result<Vec<f32>, CodecError> {
    decode(Dtype::F32, bytes)
}

/// The accumulate kernel: add little-endian `f32` elements from `bytes` into `out`, element by
/// element, in fp32. `bytes` must hold exactly `out.len()` elements; on error `out` is untouched.
///
/// ```
/// use odc_transport::codec;
/// let mut acc = [1.0f32, 2.0];
/// codec::add_f32_into(&codec::encode_f32(&[0.5, 0.25]), &mut acc).unwrap();
/// assert_eq!(acc, [1.5, 2.25]);
/// ```
pub fn add_f32_into(bytes: &[u8], out: &mut [f32]) -> Result<(), CodecError> {
    check_exact(Dtype::F32, bytes, out.len())?;
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o += f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Ok(())
}

/// What a reader sees for `x` after it is encoded as `dtype` and decoded again; use it to compute
/// reference results.
///
/// ```
/// use odc_transport::{codec, Dtype};
/// assert_eq!(codec::round_trip(Dtype::F32, 0.1), 0.1);
/// // 1 + 2⁻⁸ lies halfway between two bf16 values; ties go to the even one.
/// assert_eq!(codec::round_trip(Dtype::Bf16, 1.0 + 2f32.powi(-8)), 1.0);
/// ```
pub fn round_trip(dtype: Dtype, x: f32) -> f32 {
    match dtype {
        Dtype::F32 => x,
        Dtype::Bf16 => bf16_bits_to_f32(bf16::from_f32(x).to_bits()),
    }
}

/// Widen a bf16 to f32: exact, bit for bit (a bf16 is the upper half of an f32). Branch-free, so
/// the decode loop vectorises.
fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Whether `bytes` are exactly `expected` whole `dtype` elements (a publication of a region of
/// that length; [`CodecError::for_region`] makes the contract's error of it).
pub(crate) fn check_exact(dtype: Dtype, bytes: &[u8], expected: usize) -> Result<(), CodecError> {
    let elements = element_count(dtype, bytes.len())?;
    if elements == expected {
        Ok(())
    } else {
        Err(CodecError::LengthMismatch {
            dtype,
            elements,
            expected,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const DTYPES: [Dtype; 2] = [Dtype::F32, Dtype::Bf16];

    #[test]
    fn f32_is_little_endian() {
        assert_eq!(&encode_f32(&[1.0])[..], &[0x00, 0x00, 0x80, 0x3f]);
    }

    #[test]
    fn bf16_is_upper_half_little_endian() {
        // 1.0f32 = 0x3f80_0000 → bf16 0x3f80.
        assert_eq!(&encode(Dtype::Bf16, &[1.0])[..], &[0x80, 0x3f]);
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        let ulp = 2f32.powi(-7); // bf16 spacing in [1, 2)
        let half = ulp / 2.0;
        let cases = [
            (1.0 + half, 1.0),                        // tie, 1.0 is even
            (1.0 + 3.0 * half, 1.0 + 2.0 * ulp),      // tie, rounds up to even
            (1.0 + half + 2f32.powi(-20), 1.0 + ulp), // above the tie
            (1.0 + half - 2f32.powi(-20), 1.0),       // below the tie
            (-(1.0 + half), -1.0),                    // symmetric
            (f32::MAX, f32::INFINITY),                // overflows bf16's range
            (f32::INFINITY, f32::INFINITY),
            (-0.0, -0.0),
        ];
        for (x, expected) in cases {
            let got = round_trip(Dtype::Bf16, x);
            assert_eq!(got.to_bits(), expected.to_bits(), "round_trip({x:e})");
            assert_eq!(
                decode(Dtype::Bf16, &encode(Dtype::Bf16, &[x])),
                Ok(vec![got])
            );
        }
        assert!(round_trip(Dtype::Bf16, f32::NAN).is_nan());
    }

    #[test]
    fn partial_elements_are_refused() {
        for dtype in DTYPES {
            let bytes = vec![0u8; dtype.size() * 3 + 1];
            let expected = CodecError::NotWholeElements {
                dtype,
                bytes: bytes.len(),
            };
            assert_eq!(decode(dtype, &bytes), Err(expected));
            let mut out = [7.0f32; 3];
            assert_eq!(decode_into(dtype, &bytes, &mut out), Err(expected));
            assert_eq!(out, [7.0; 3], "output untouched on error");
        }
        assert_eq!(
            element_count(Dtype::F32, 5),
            Err(CodecError::NotWholeElements {
                dtype: Dtype::F32,
                bytes: 5
            })
        );
    }

    #[test]
    fn wrong_element_count_is_refused() {
        for dtype in DTYPES {
            let bytes = encode(dtype, &[1.0, 2.0]);
            let mut out = [7.0f32; 3];
            let expected = CodecError::LengthMismatch {
                dtype,
                elements: 2,
                expected: 3,
            };
            assert_eq!(decode_into(dtype, &bytes, &mut out), Err(expected));
            assert_eq!(out, [7.0; 3], "output untouched on error");
        }
        let mut acc = [1.0f32; 3];
        assert!(add_f32_into(&encode_f32(&[1.0; 2]), &mut acc).is_err());
        assert_eq!(acc, [1.0; 3], "accumulator untouched on error");
    }

    #[test]
    fn codec_errors_map_to_transport_errors() {
        let partial = CodecError::NotWholeElements {
            dtype: Dtype::Bf16,
            bytes: 3,
        };
        assert_eq!(
            partial.for_region(9),
            TransportError::BadPayload {
                region: 9,
                bytes: 3,
                dtype: Dtype::Bf16
            }
        );
        let count = CodecError::LengthMismatch {
            dtype: Dtype::F32,
            elements: 2,
            expected: 5,
        };
        assert_eq!(
            count.for_region(9),
            TransportError::LengthMismatch {
                region: 9,
                elements: 2,
                len: 5
            }
        );
    }

    #[test]
    fn empty_round_trips() {
        for dtype in DTYPES {
            assert!(encode(dtype, &[]).is_empty());
            assert_eq!(decode(dtype, &[]), Ok(vec![]));
        }
    }

    #[test]
    fn add_accumulates_in_fp32() {
        // 2⁻²⁰ is below bf16 resolution at 1.0 but exact in fp32.
        let tiny = 2f32.powi(-20);
        let mut acc = [1.0f32, -3.0];
        add_f32_into(&encode_f32(&[tiny, 0.5]), &mut acc).unwrap();
        assert_eq!(acc, [1.0 + tiny, -2.5]);
    }

    proptest! {
        #[test]
        fn encode_f32_finite_is_encode_f32_or_names_the_first_non_finite(
            bits in proptest::collection::vec(any::<u32>(), 0..64),
        ) {
            let values: Vec<f32> = bits.iter().map(|b| f32::from_bits(*b)).collect();
            let first = values.iter().position(|v| !v.is_finite());
            match (encode_f32_finite(&values), first) {
                (Ok(bytes), None) => prop_assert_eq!(bytes, encode_f32(&values)),
                (Err(e), Some(i)) => {
                    prop_assert_eq!(e.index, i);
                    prop_assert_eq!(e.value.to_bits(), values[i].to_bits());
                }
                (got, want) => prop_assert!(false, "{got:?} for first non-finite {want:?}"),
            }
        }

        #[test]
        fn f32_round_trip_is_bit_exact(bits in proptest::collection::vec(any::<u32>(), 0..64)) {
            let values: Vec<f32> = bits.iter().map(|b| f32::from_bits(*b)).collect();
            let decoded = decode_f32(&encode_f32(&values)).unwrap();
            let decoded_bits: Vec<u32> = decoded.iter().map(|v| v.to_bits()).collect();
            prop_assert_eq!(decoded_bits, bits);
        }

        #[test]
        fn bf16_relative_error_is_at_most_2_pow_minus_8(
            values in proptest::collection::vec(proptest::num::f32::NORMAL, 0..64),
        ) {
            let max = bf16::MAX.to_f32();
            let values: Vec<f32> = values.into_iter().filter(|v| v.abs() <= max).collect();
            let decoded = decode(Dtype::Bf16, &encode(Dtype::Bf16, &values)).unwrap();
            prop_assert_eq!(decoded.len(), values.len());
            for (x, y) in values.iter().zip(&decoded) {
                prop_assert_eq!(*y, round_trip(Dtype::Bf16, *x));
                let rel = ((f64::from(*y) - f64::from(*x)) / f64::from(*x)).abs();
                prop_assert!(rel <= 2f64.powi(-8), "x = {x:e}, bf16 = {y:e}, rel = {rel:e}");
            }
        }

        #[test]
        fn bf16_decode_widens_bit_for_bit(bits in proptest::collection::vec(any::<u16>(), 0..64)) {
            let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
            let decoded = decode(Dtype::Bf16, &bytes).unwrap();
            for (b, v) in bits.iter().zip(&decoded) {
                prop_assert_eq!(v.to_bits(), u32::from(*b) << 16);
            }
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64), n in 0usize..40) {
            for dtype in DTYPES {
                let mut out = vec![0.0f32; n];
                let ok = decode_into(dtype, &bytes, &mut out).is_ok();
                prop_assert_eq!(ok, bytes.len() == n * dtype.size());
            }
        }
    }
}
