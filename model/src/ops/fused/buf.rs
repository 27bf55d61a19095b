//! The memory a fused kernel addresses and the parameters of a launch: [`Buf`] (a contiguous
//! CUDA tensor, a fresh CUDA output, or a host copy for the emulation) and [`Arg`]. Both
//! backends ([`super::cuda`], [`super::emulated`]) read these; [`super::launch`] makes them.

#[cfg(any(feature = "cuda", feature = "emulate"))]
use candle_core::Tensor;
#[cfg(feature = "emulate")]
use candle_core::{CpuStorage, DType, Error, Result, Shape, Storage};
#[cfg(feature = "emulate")]
use odc_kernels::emulate::HostBuffer;

/// A tensor's memory as a kernel addresses it: contiguous, `shape` elements of `dtype`.
pub(super) enum Buf {
    /// A contiguous CUDA tensor (an input).
    #[cfg(feature = "cuda")]
    Cuda(Tensor),
    /// A fresh CUDA allocation of `shape` elements the kernel fills (an output: it becomes a
    /// tensor, or a graph node's output, without a copy).
    #[cfg(feature = "cuda")]
    CudaOut(candle_core::CudaStorage, Vec<usize>),
    /// A copy of a CPU tensor, or an output poisoned with NaNs until a kernel writes it.
    #[cfg(feature = "emulate")]
    Host(HostTensor),
}

/// One parameter of a launch: odc-kernels' one [`launch::Arg`](odc_kernels::launch::Arg), over
/// [`Buf`]s.
pub(super) type Arg<'a> = odc_kernels::launch::Arg<'a, Buf>;

/// A CPU tensor's elements in a buffer a kernel addresses.
#[cfg(feature = "emulate")]
pub(super) struct HostTensor {
    pub(super) buffer: HostBuffer,
    dtype: DType,
    shape: Vec<usize>,
}

#[cfg(feature = "emulate")]
impl HostTensor {
    /// A copy of `t` (fp32, bf16 or i64).
    pub(super) fn of(t: &Tensor) -> Result<HostTensor> {
        let flat = t.flatten_all()?;
        let bytes: Vec<u8> = match t.dtype() {
            DType::F32 => flat
                .to_vec1::<f32>()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            DType::BF16 => flat
                .to_vec1::<half::bf16>()?
                .iter()
                .flat_map(|v| v.to_bits().to_le_bytes())
                .collect(),
            DType::I64 => flat
                .to_vec1::<i64>()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            other => return Err(Error::Msg(format!("fused kernels: dtype {other:?}"))),
        };
        Ok(HostTensor {
            buffer: HostBuffer::from_bytes(&bytes),
            dtype: t.dtype(),
            shape: t.dims().to_vec(),
        })
    }

    /// `shape` elements of `dtype`, every byte 0xff (a NaN in fp32 and bf16).
    pub(super) fn poisoned(dtype: DType, shape: &[usize]) -> Result<HostTensor> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(Error::Msg(format!("fused kernels: an output of {dtype:?}")));
        }
        let n: usize = shape.iter().product();
        Ok(HostTensor {
            buffer: HostBuffer::from_bytes(&vec![0xff; n * dtype.size_in_bytes()]),
            dtype,
            shape: shape.to_vec(),
        })
    }

    /// Its elements now, as an owned CPU storage of its shape.
    pub(super) fn owned(&self) -> Result<(Storage, Shape)> {
        let bytes = self.buffer.to_bytes();
        let storage = match self.dtype {
            DType::F32 => CpuStorage::F32(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            DType::BF16 => CpuStorage::BF16(
                bytes
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                    .collect(),
            ),
            other => return Err(Error::Msg(format!("fused kernels: an output of {other:?}"))),
        };
        Ok((Storage::Cpu(storage), Shape::from(self.shape.clone())))
    }
}
