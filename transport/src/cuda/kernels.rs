//! Device kernels: the backend's own (`kernels.cu`, next to this file) and, through the same
//! machinery, an owner's ([`Module`], e.g. a shard server's optimizer kernels kept next to the
//! server's code), compiled at run time with NVRTC for the device's compute capability, loaded into
//! its context and launched on its stream.
//!
//! The backend's kernels:
//! - `odc_add_f32(acc, src, n)`: `acc[i] += src[i]`, fp32 into fp32 — the accumulate of the
//!   transport contract (C2), bit for bit what the host accumulate computes.
//! - `odc_add_bf16(acc, src, n)`: `acc[i] += widen(src[i])`, bf16 into fp32 (widening is exact) —
//!   for gradients pushed in bf16 (the benchmark's `acc-bf16` row; the contract's payloads are
//!   fp32 today).
//! - `odc_encode_bf16(dst, src, n)`: fp32 → bf16, bit for bit the host codec's rounding — a
//!   published bf16 copy written from fp32 values in device memory
//!   ([`DevicePublished::publish_from`](super::DevicePublished::publish_from)).
//!
//! Every source is compiled with `--fmad=false` (and NVRTC's IEEE defaults: `--prec-div=true`,
//! `--prec-sqrt=true`, `--ftz=false`), so a kernel that writes the host's arithmetic in the host's
//! order computes bitwise the host's fp32 results. Kernels are grid-stride loops: [`BLOCK`]
//! threads a block, at most 16 blocks per multiprocessor ([`Module::blocks`]), so one launch covers
//! any `n`.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

use super::library::{check_nvrtc, failed};
use crate::TransportError;

/// The backend kernels' source.
pub(crate) const SOURCE: &str = include_str!("kernels.cu");

/// The backend's kernels, each elementwise over `n` elements: `(T* dst, const U* src, unsigned
/// long long n)`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Elementwise {
    /// `acc[i] += src[i]`, fp32 into fp32.
    AddF32,
    /// `acc[i] += widen(src[i])`, bf16 into fp32.
    AddBf16,
    /// `dst[i] = bf16(src[i])`, fp32 into bf16.
    EncodeBf16,
}

impl Elementwise {
    /// The kernel's function in [`SOURCE`].
    const fn function(self) -> &'static str {
        match self {
            Elementwise::AddF32 => "odc_add_f32",
            Elementwise::AddBf16 => "odc_add_bf16",
            Elementwise::EncodeBf16 => "odc_encode_bf16",
        }
    }
}

/// The backend kernels' functions.
const FUNCTIONS: [&str; 3] = [
    Elementwise::AddF32.function(),
    Elementwise::AddBf16.function(),
    Elementwise::EncodeBf16.function(),
];

/// Threads per block of every launch (a kernel that reduces within a block may size its shared
/// memory by it).
pub const BLOCK: u32 = 256;
/// Blocks per multiprocessor at most (a grid-stride loop needs no more to fill the device).
const BLOCKS_PER_SM: u32 = 16;

/// NVRTC's complaint about `name`, with its log.
fn compile_failed(name: &str, error: CompileError) -> TransportError {
    let detail = match &error {
        CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}: {}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    };
    TransportError::Unsupported {
        what: format!("cuda: NVRTC could not compile {name}: {detail}"),
    }
}

/// `source` (named `name` in messages) compiled with NVRTC to PTX for compute capability
/// `(major, minor)`, with the options of every kernel here (`--fmad=false`). Needs NVRTC only
/// (no driver, no device).
fn compile(name: &str, source: &str, (major, minor): (i32, i32)) -> Result<Ptx, TransportError> {
    check_nvrtc()?;
    let options = CompileOptions {
        options: vec![
            format!("--gpu-architecture=compute_{major}{minor}"),
            "--fmad=false".into(),
        ],
        name: Some(name.into()),
        ..CompileOptions::default()
    };
    compile_ptx_with_opts(source, options).map_err(|e| compile_failed(name, e))
}

/// The backend kernels' PTX for compute capability `capability` (NVRTC only).
#[cfg(test)]
pub(crate) fn ptx(capability: (i32, i32)) -> Result<Ptx, TransportError> {
    compile("kernels.cu", SOURCE, capability)
}

/// The PTX text of `source` (named `name` in messages) for compute capability `capability`,
/// compiled as [`Module`]s are: a check that an owner's kernel source compiles, which needs NVRTC
/// (`libnvrtc.so`) but no driver and no device. Without NVRTC: [`TransportError::Unsupported`]
/// starting `no NVRTC:`.
pub fn ptx_of(name: &str, source: &str, capability: (i32, i32)) -> Result<String, TransportError> {
    compile(name, source, capability).map(|ptx| ptx.to_src())
}

/// A kernel parameter as a launch passes it: by value, as the kernel's parameter of that type
/// (`unsigned long long` for an address, `int`, `float`, `double`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Param {
    U64(u64),
    I32(i32),
    F32(f32),
    F64(f64),
}

/// Compiled kernels of one source, loaded into one device's context: get one with
/// [`Device::module`](super::Device::module), launch with
/// [`Device::launch`](super::Device::launch).
pub struct Module {
    name: String,
    functions: Vec<(String, CudaFunction)>,
    /// Most blocks a launch uses.
    max_blocks: u32,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module")
            .field("name", &self.name)
            .field("max_blocks", &self.max_blocks)
            .finish()
    }
}

impl Module {
    /// Compile `source` for `ctx`'s device (which must be bound), load it and find `functions`.
    pub(crate) fn compile(
        ctx: &Arc<CudaContext>,
        name: &str,
        source: &str,
        functions: &[&str],
    ) -> Result<Self, TransportError> {
        let capability = ctx
            .compute_capability()
            .map_err(|e| failed("reading the compute capability", e))?;
        let module = ctx
            .load_module(compile(name, source, capability)?)
            .map_err(|e| failed(&format!("loading {name} (cuModuleLoadData)"), e))?;
        let functions = functions
            .iter()
            .map(|function| {
                module
                    .load_function(function)
                    .map(|f| (function.to_string(), f))
                    .map_err(|e| failed(&format!("finding kernel {function} of {name}"), e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| failed("reading the multiprocessor count", e))?;
        Ok(Self {
            name: name.to_owned(),
            functions,
            max_blocks: u32::try_from(sms).unwrap_or(1).max(1) * BLOCKS_PER_SM,
        })
    }

    /// The number of blocks a launch over `n` elements uses (at least 1): a kernel that writes one
    /// partial result per block needs room for this many.
    pub fn blocks(&self, n: usize) -> u32 {
        let blocks = n.div_ceil(BLOCK as usize).min(self.max_blocks as usize);
        u32::try_from(blocks).unwrap_or(1).max(1)
    }

    /// The most blocks any launch uses.
    pub fn max_blocks(&self) -> u32 {
        self.max_blocks
    }

    /// Enqueue `function` over `n` elements ([`Module::blocks`] × [`BLOCK`] threads) with `params`
    /// on `stream` (not waited for). `n == 0` launches nothing.
    ///
    /// # Safety
    /// `function`'s parameters are exactly `params`, in order and of their types; every address it
    /// is given is device memory of the stream's context, and the kernel touches only what the
    /// arguments allow it to (no index at or past the lengths the caller passes).
    pub(crate) unsafe fn enqueue(
        &self,
        stream: &CudaStream,
        function: &str,
        n: usize,
        params: &[Param],
    ) -> Result<(), TransportError> {
        if n == 0 {
            return Ok(());
        }
        let (_, kernel) = self
            .functions
            .iter()
            .find(|(name, _)| name == function)
            .ok_or_else(|| TransportError::Unsupported {
                what: format!("cuda: {} has no kernel {function}", self.name),
            })?;
        let mut launch = stream.launch_builder(kernel);
        for param in params {
            match param {
                Param::U64(v) => launch.arg(v),
                Param::I32(v) => launch.arg(v),
                Param::F32(v) => launch.arg(v),
                Param::F64(v) => launch.arg(v),
            };
        }
        let config = LaunchConfig {
            grid_dim: (self.blocks(n), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the caller guarantees the parameters match `params` and the memory they address;
        // every value pushed above lives until the launch returns.
        unsafe { launch.launch(config) }
            .map(|_| ())
            .map_err(|e| failed(&format!("launching {function} of {}", self.name), e))
    }
}

/// The backend's kernels, compiled for one context.
pub(crate) struct Kernels {
    module: Module,
}

impl Kernels {
    /// Compile [`SOURCE`] for `ctx`'s device (which must be bound) and load it.
    pub(crate) fn compile(ctx: &Arc<CudaContext>) -> Result<Self, TransportError> {
        Module::compile(ctx, "kernels.cu", SOURCE, &FUNCTIONS).map(|module| Self { module })
    }

    /// Enqueue `kernel` over `n` elements on `stream` (not waited for). The caller guarantees
    /// that `dst` and `src` are device memory of the stream's context holding `n` elements each
    /// of the kernel's types.
    pub(crate) fn enqueue(
        &self,
        stream: &CudaStream,
        kernel: Elementwise,
        dst: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        n: usize,
    ) -> Result<(), TransportError> {
        let params = [Param::U64(dst), Param::U64(src), Param::U64(n as u64)];
        // SAFETY: every backend kernel takes (T* dst, const U* src, unsigned long long n); the
        // caller guarantees `n` elements at both addresses.
        unsafe { self.module.enqueue(stream, kernel.function(), n, &params) }
    }
}
