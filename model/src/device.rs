//! Where and in what precision the model computes: [`DeviceSpec`] (`cpu`, `cuda`, `cuda:N`),
//! [`ComputePrecision`] (fp32, or bf16 mixed precision), and [`open_device`], which turns a spec
//! into a candle [`Device`].
//!
//! Guarantees:
//! 1. **No panic without a driver.** `open_device(cuda…)` checks for the CUDA driver library, a
//!    working `cuInit` and a device before candle or cudarc touch the device (cudarc panics on a
//!    missing library) and otherwise fails with [`Error::Device`] whose text starts
//!    `no CUDA driver:`. A build without the root crate's `cuda` feature says so, naming the
//!    feature. (A binary built with `cuda` links `libcuda.so.1` and the CUDA libraries candle
//!    uses at load time, `dynamic-linking`: where they are missing altogether, the dynamic loader
//!    refuses to start it, before any of odc's code runs.)
//! 2. **Placement.** `cuda` without an ordinal is device `local_rank mod device_count`
//!    (`ODC_LOCAL_RANK` under `odc launch`): one process per GPU, and with one GPU every process
//!    shares it. `cuda:N` is device `N`, which must exist.
//! 3. Each call opens its own candle device on its **own stream** (`new_cuda_with_stream`, not
//!    the per-thread default stream, whose meaning would change as tokio moves a task between
//!    threads), so two trainers of one process on one GPU do not serialise on one stream.
//!
//! # Mixed precision ([`ComputePrecision::Bf16`])
//! What each piece is in:
//! - **master weights, optimizer state and gradient accumulation**: fp32 at the shard servers
//!   (unchanged: the transport's accumulate payloads are fp32);
//! - **a gathered unit on the trainer**: fp32 `Var`s (one host-to-device upload per unit); every
//!   matrix (rank 2: projections, MLP, embedding, LM head) is cast to bf16 inside the unit's
//!   graph, the norm weights stay fp32;
//! - **matmuls and activations** (the residual stream between units included): bf16;
//! - **RMSNorm, rotary embedding, attention softmax (scores plus mask), log-softmax and the loss**:
//!   fp32 (`super::ops` casts up and back);
//! - **gradients**: bf16 through the matmuls, cast to fp32 by the backward of the casts, so each
//!   parameter's gradient arrives in fp32 (as FSDP's `param_dtype=bf16, reduce_dtype=fp32`) and
//!   is pushed as fp32.
//!
//! [`ComputePrecision::F32`] runs everything in fp32 (the CPU default, and the GPU's mode for the
//! I3 check against the CPU reference).

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device, Tensor, Var};

use super::error::{Error, Result};

/// Which device a model computes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// candle's CPU backend.
    #[default]
    Cpu,
    /// A CUDA device: `Some(N)` names it, `None` is `local_rank mod device_count`.
    Cuda(Option<usize>),
}

impl FromStr for DeviceSpec {
    type Err = Error;

    /// `cpu`, `cuda` or `cuda:N`.
    fn from_str(text: &str) -> Result<Self> {
        match text {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(None)),
            _ => match text.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceSpec::Cuda(Some(n))),
                _ => Err(Error::Device(format!(
                    "device {text:?}: expected cpu, cuda or cuda:N"
                ))),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(None) => write!(f, "cuda"),
            DeviceSpec::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    /// Whether this is a CUDA device.
    pub fn is_cuda(&self) -> bool {
        matches!(self, DeviceSpec::Cuda(_))
    }
}

/// The dtype a unit's matmuls and activations run in (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputePrecision {
    /// Everything in fp32.
    #[default]
    F32,
    /// bf16 matrices and activations; norms, softmax and the loss in fp32; fp32 gradients.
    Bf16,
}

impl FromStr for ComputePrecision {
    type Err = Error;

    /// `f32`/`fp32` or `bf16`.
    fn from_str(text: &str) -> Result<Self> {
        match text {
            "f32" | "fp32" => Ok(ComputePrecision::F32),
            "bf16" => Ok(ComputePrecision::Bf16),
            _ => Err(Error::Device(format!(
                "precision {text:?}: expected f32 or bf16"
            ))),
        }
    }
}

impl fmt::Display for ComputePrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ComputePrecision::F32 => "f32",
            ComputePrecision::Bf16 => "bf16",
        })
    }
}

impl ComputePrecision {
    /// The dtype of matmuls and activations.
    pub fn dtype(self) -> DType {
        match self {
            ComputePrecision::F32 => DType::F32,
            ComputePrecision::Bf16 => DType::BF16,
        }
    }

    /// The tensors a unit's forward takes, from its fp32 `Var`s: matrices (rank ≥ 2) cast to
    /// [`Self::dtype`] inside the graph (so their gradients come back in fp32), vectors (norm
    /// weights) as they are. In fp32 these are the `Var`s' own tensors.
    pub fn unit_inputs(self, vars: &[Var]) -> Result<Vec<Tensor>> {
        self.cast(&super::params::as_tensors(vars))
    }

    /// [`Self::unit_inputs`] of a unit's tensors, `Var`s or not (a frozen unit's constants); a
    /// vector in another dtype (a unit read in bf16) is widened to fp32. A tensor already in its
    /// dtype is itself, not a copy.
    pub fn cast(self, params: &[Tensor]) -> Result<Vec<Tensor>> {
        params
            .iter()
            .map(|t| {
                let dtype = if t.rank() >= 2 {
                    self.dtype()
                } else {
                    DType::F32
                };
                Ok(t.to_dtype(dtype)?)
            })
            .collect()
    }
}

/// The CUDA device `spec` names for a process of local rank `local_rank` (see the
/// [module docs](self)), or the CPU.
pub fn open_device(spec: DeviceSpec, local_rank: u32) -> Result<Device> {
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(ordinal) => open_cuda(ordinal, local_rank),
    }
}

/// The ordinal of a device's location (0 for the CPU).
pub fn location_ordinal(device: &Device) -> usize {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id,
        candle_core::DeviceLocation::Metal { gpu_id } => gpu_id,
        candle_core::DeviceLocation::Cpu => 0,
    }
}

/// The ordinal of `cuda` (`None`: `local_rank mod count`) or `cuda:N` among `count` devices.
pub fn cuda_ordinal(ordinal: Option<usize>, local_rank: u32, count: usize) -> Result<usize> {
    if count == 0 {
        return Err(Error::Device(
            "no CUDA driver: the driver sees no CUDA device".into(),
        ));
    }
    match ordinal {
        None => Ok(local_rank as usize % count),
        Some(n) if n < count => Ok(n),
        Some(n) => Err(Error::Device(format!(
            "cuda:{n}: this machine has {count} CUDA device(s) (0..{count})"
        ))),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: Option<usize>, local_rank: u32) -> Result<Device> {
    use candle_core::cuda_backend::cudarc::driver::result;
    // candle links libcuda (`dynamic-linking`): a binary without it never started.
    let no_driver = |call: &str, e| Error::Device(format!("no CUDA driver: {call} failed: {e}"));
    result::init().map_err(|e| no_driver("cuInit", e))?;
    let count = result::device::get_count().map_err(|e| no_driver("cuDeviceGetCount", e))?;
    let ordinal = cuda_ordinal(ordinal, local_rank, usize::try_from(count).unwrap_or(0))?;
    Device::new_cuda_with_stream(ordinal)
        .map_err(|e| Error::Device(format!("opening CUDA device {ordinal}: {e}")))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: Option<usize>, _local_rank: u32) -> Result<Device> {
    Err(Error::Device(format!(
        "device {}: this build of odc has no CUDA support: rebuild with the root crate's `cuda` \
         feature (`cargo build --release --features cuda`, with the CUDA toolchain of \
         benches/gpu/build.sh)",
        DeviceSpec::Cuda(ordinal)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse_and_print() {
        for (text, spec) in [
            ("cpu", DeviceSpec::Cpu),
            ("cuda", DeviceSpec::Cuda(None)),
            ("cuda:3", DeviceSpec::Cuda(Some(3))),
        ] {
            assert_eq!(text.parse::<DeviceSpec>().unwrap(), spec);
            assert_eq!(spec.to_string(), text);
        }
        for bad in ["gpu", "cuda:", "cuda:-1", "cuda:x", ""] {
            let e = bad.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(e.contains("expected cpu, cuda or cuda:N"), "{bad}: {e}");
        }
        assert_eq!(
            "bf16".parse::<ComputePrecision>().unwrap(),
            ComputePrecision::Bf16
        );
        assert!("f16".parse::<ComputePrecision>().is_err());
    }

    #[test]
    fn local_rank_picks_a_device_modulo_the_count() {
        assert_eq!(cuda_ordinal(None, 5, 8).unwrap(), 5);
        assert_eq!(cuda_ordinal(None, 9, 8).unwrap(), 1);
        // One GPU: every process shares it.
        assert_eq!(cuda_ordinal(None, 3, 1).unwrap(), 0);
        assert_eq!(cuda_ordinal(Some(1), 0, 2).unwrap(), 1);
        let e = cuda_ordinal(Some(2), 0, 2).unwrap_err().to_string();
        assert!(e.contains("cuda:2") && e.contains("2 CUDA device"), "{e}");
        let e = cuda_ordinal(None, 0, 0).unwrap_err().to_string();
        assert!(e.starts_with("no CUDA driver"), "{e}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_build_without_cuda_names_the_feature() {
        let e = open_device(DeviceSpec::Cuda(None), 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`cuda` feature"), "{e}");
        assert!(matches!(open_device(DeviceSpec::Cpu, 0), Ok(Device::Cpu)));
    }

    /// Mixed precision, stated tolerance: on the same batch, the bf16 forward's loss is within 2%
    /// of fp32's, every parameter's gradient arrives in fp32, finite, with a cosine similarity
    /// above 0.99 to the fp32 gradient of the same parameter (run on the CPU: candle's CPU
    /// backend has bf16 matmuls, so CI checks the casts the GPU runs).
    #[test]
    fn bf16_mixed_precision_tracks_fp32_within_tolerance() {
        use crate::{model_forward, PackedBatch, Sample};
        let c = crate::ModelConfig {
            vocab_size: 32,
            d_model: 64,
            n_layers: 2,
            n_heads: 4,
            d_ff: 128,
            max_seq_len: 64,
            init_std: 0.05,
            seed: 5,
            ..crate::ModelConfig::tiny()
        };
        let samples: Vec<Sample> = [
            (0..40).map(|i| (i * 7 % 31) as u32).collect::<Vec<_>>(),
            (0..23).map(|i| (i * 5 % 29) as u32).collect(),
        ]
        .into_iter()
        .map(Sample::all_loss)
        .collect();
        let batch = PackedBatch::pack(&c, &samples, &Device::Cpu).unwrap();
        let run = |precision: ComputePrecision| {
            let vars = crate::test_util::init_vars(&c);
            let inputs: Vec<Vec<Tensor>> = vars
                .iter()
                .map(|v| precision.unit_inputs(v).unwrap())
                .collect();
            let out = model_forward(&c, &inputs, &batch).unwrap();
            assert_eq!(out.loss.dtype(), DType::F32, "the loss is fp32");
            let grads = out.loss.backward().unwrap();
            let flat: Vec<Vec<f32>> = vars
                .iter()
                .flatten()
                .map(|v| {
                    let g = grads
                        .get(v.as_tensor())
                        .expect("every parameter has a gradient");
                    assert_eq!(g.dtype(), DType::F32, "gradients arrive in fp32");
                    g.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                })
                .collect();
            (out.loss.to_scalar::<f32>().unwrap() as f64, flat)
        };
        let (loss32, grads32) = run(ComputePrecision::F32);
        let (loss16, grads16) = run(ComputePrecision::Bf16);
        assert!(
            loss32.is_finite() && loss16.is_finite(),
            "{loss32} {loss16}"
        );
        let rel = ((loss16 - loss32) / loss32).abs();
        assert!(rel < 2e-2, "bf16 loss {loss16} vs fp32 {loss32}: {rel}");
        assert_eq!(grads32.len(), grads16.len());
        for (p, (a, b)) in grads32.iter().zip(&grads16).enumerate() {
            assert_eq!(a.len(), b.len(), "parameter {p}");
            assert!(b.iter().all(|v| v.is_finite()), "parameter {p}: non-finite");
            let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
            let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
            let cosine = dot / (na * nb).max(f64::MIN_POSITIVE);
            assert!(cosine > 0.99, "parameter {p}: cosine {cosine}");
        }
    }

    #[test]
    fn fp32_unit_inputs_are_the_vars_and_bf16_casts_only_matrices() {
        let m = Var::from_tensor(&Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap()).unwrap();
        let v = Var::from_tensor(&Tensor::ones(3, DType::F32, &Device::Cpu).unwrap()).unwrap();
        let vars = [m, v];
        let f32s = ComputePrecision::F32.unit_inputs(&vars).unwrap();
        assert_eq!(f32s[0].id(), vars[0].as_tensor().id());
        let bf16 = ComputePrecision::Bf16.unit_inputs(&vars).unwrap();
        assert_eq!(
            (bf16[0].dtype(), bf16[1].dtype()),
            (DType::BF16, DType::F32)
        );
    }
}
