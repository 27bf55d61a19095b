//! The element types of tensors on disk that odc reads (F32, BF16, F16) and writes (BF16, F32),
//! and their conversions: to f32 exact (bf16 and f16 values are f32 values), from f32 to bf16 or
//! f16 rounded to nearest even (`half`).

use half::{bf16, f16};
use safetensors::Dtype;

/// An element type odc accepts in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskDtype {
    F32,
    Bf16,
    F16,
}

impl DiskDtype {
    /// The accepted element type for a safetensors dtype; `None` for every other (integers,
    /// f64, fp8, ...).
    pub fn from_safetensors(dtype: Dtype) -> Option<Self> {
        match dtype {
            Dtype::F32 => Some(DiskDtype::F32),
            Dtype::BF16 => Some(DiskDtype::Bf16),
            Dtype::F16 => Some(DiskDtype::F16),
            _ => None,
        }
    }

    /// The safetensors dtype.
    pub fn safetensors(self) -> Dtype {
        match self {
            DiskDtype::F32 => Dtype::F32,
            DiskDtype::Bf16 => Dtype::BF16,
            DiskDtype::F16 => Dtype::F16,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DiskDtype::F32 => 4,
            DiskDtype::Bf16 | DiskDtype::F16 => 2,
        }
    }

    /// Appends the f32 values of `bytes` (little-endian elements; a trailing partial element is
    /// ignored, which a checked header rules out).
    pub fn decode_into(self, bytes: &[u8], out: &mut Vec<f32>) {
        match self {
            DiskDtype::F32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
            DiskDtype::Bf16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()),
            ),
            DiskDtype::F16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()),
            ),
        }
    }

    /// The little-endian bytes of `values` in this type, rounded to nearest even.
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            DiskDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DiskDtype::Bf16 => values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
            DiskDtype::F16 => values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
        }
    }

    /// `values` as this type would store them: the f32 values a load of an encoded tensor gives.
    pub fn round(self, values: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(values.len());
        self.decode_into(&self.encode(values), &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversion_to_f32_is_exact_and_from_f32_rounds_to_nearest_even() {
        for dtype in [DiskDtype::F32, DiskDtype::Bf16, DiskDtype::F16] {
            let values = [
                0.0f32,
                -0.0,
                1.0,
                -2.5,
                0.099_609_375,
                57344.0,
                f32::INFINITY,
            ];
            // These are representable in all three types: the round trip is the identity.
            let mut back = Vec::new();
            dtype.decode_into(&dtype.encode(&values), &mut back);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&back), bits(&values), "{dtype:?}");
            assert_eq!(dtype.encode(&values).len(), values.len() * dtype.size());
            assert_eq!(
                DiskDtype::from_safetensors(dtype.safetensors()),
                Some(dtype)
            );
        }
        // 1 + 2^-8 lies halfway between two bf16 values (1 and 1 + 2^-7): ties go to even (1).
        let halfway = 1.0 + 2f32.powi(-8);
        assert_eq!(DiskDtype::Bf16.round(&[halfway]), vec![1.0]);
        let above = 1.0 + 2f32.powi(-8) + 2f32.powi(-12);
        assert_eq!(DiskDtype::Bf16.round(&[above]), vec![1.0 + 2f32.powi(-7)]);
        assert_eq!(DiskDtype::from_safetensors(Dtype::I32), None);
    }
}
