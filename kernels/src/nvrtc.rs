//! The kernels on a CUDA device (feature `nvrtc-code`; `nvrtc` with cudarc's `dynamic-loading`,
//! which needs no CUDA install to build): a [`Source`] compiled at run time by NVRTC for the
//! device's compute capability ([`ptx`]), loaded into its context and launched on a stream
//! ([`Module`]). odc-transport's `cuda::Device` holds the context, the stream and the memory, and
//! is the [`Launcher`](crate::launch::Launcher) built on this.
//!
//! Guarantees:
//! - Nothing calls into NVRTC before [`check_nvrtc`] found `libnvrtc` (cudarc panics on a
//!   missing library): without it the error's text starts `no NVRTC:`.
//! - Every source is compiled with `--fmad=false` (and NVRTC's IEEE defaults: `--prec-div=true`,
//!   `--prec-sqrt=true`, `--ftz=false`), so a kernel that writes the host's arithmetic in the
//!   host's order computes bitwise the host's fp32 results.
//! - Launches are grid-stride loops: [`BLOCK`] threads a block, at most 16 blocks per
//!   multiprocessor ([`Module::blocks`]), so one launch covers any `n`.
//! - A source that does not compile, a function a module lacks or a failed driver call is a
//!   [`KernelError`] naming it, never a panic.

use std::ffi::CStr;
use std::sync::Arc;

use cudarc::driver::PushKernelArg;
use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaStream, LaunchConfig};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

use crate::Source;
pub use crate::BLOCK;

/// Blocks per multiprocessor at most (a grid-stride loop needs no more to fill the device).
const BLOCKS_PER_SM: u32 = 16;

/// Why a kernel could not be compiled, loaded or launched; the text names what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct KernelError(pub String);

/// A driver call that failed: `what` it was, and the driver's error.
pub fn failed(what: &str, error: result::DriverError) -> KernelError {
    KernelError(format!("cuda: {what} failed: {error}"))
}

/// Whether a shared library named one of `names` loads in this process.
pub fn library_loads(names: &[&CStr]) -> bool {
    names.iter().any(|name| {
        // SAFETY: `name` is a NUL-terminated string; dlopen with RTLD_LAZY | RTLD_LOCAL runs the
        // library's initialisers (the CUDA driver and NVRTC have no harmful ones) and the handle
        // is closed at once. cudarc opens its own handle later.
        unsafe {
            let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            if handle.is_null() {
                false
            } else {
                libc::dlclose(handle);
                true
            }
        }
    })
}

/// Whether NVRTC (`libnvrtc.so`, from the CUDA toolkit) loads; every kernel is compiled with it.
pub fn check_nvrtc() -> Result<(), KernelError> {
    if library_loads(&[c"libnvrtc.so.13", c"libnvrtc.so", c"libnvrtc.so.12"]) {
        Ok(())
    } else {
        Err(KernelError(
            "no NVRTC: libnvrtc.so does not load (the CUDA toolkit's lib64, e.g. \
             /usr/local/cuda/lib64, is not on LD_LIBRARY_PATH); the kernels are compiled with it"
                .into(),
        ))
    }
}

/// NVRTC's complaint about `name`, with its log.
fn compile_failed(name: &str, error: CompileError) -> KernelError {
    let detail = match &error {
        CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}: {}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    };
    KernelError(format!("cuda: NVRTC could not compile {name}: {detail}"))
}

/// `source` compiled by NVRTC to PTX for compute capability `(major, minor)`, with the options of
/// every kernel here (`--fmad=false`). Needs NVRTC only (no driver, no device).
pub fn compile(source: &Source, (major, minor): (i32, i32)) -> Result<Ptx, KernelError> {
    check_nvrtc()?;
    let options = CompileOptions {
        options: vec![
            format!("--gpu-architecture=compute_{major}{minor}"),
            "--fmad=false".into(),
        ],
        name: Some(source.name.into()),
        ..CompileOptions::default()
    };
    compile_ptx_with_opts(source.code, options).map_err(|e| compile_failed(source.name, e))
}

/// The PTX text of `source` for compute capability `capability`: the check that a source
/// compiles, which needs NVRTC (`libnvrtc.so`) but no driver and no device.
pub fn ptx(source: &Source, capability: (i32, i32)) -> Result<String, KernelError> {
    compile(source, capability).map(|ptx| ptx.to_src())
}

/// A kernel parameter as a launch passes it: by value, as the kernel's parameter of that type
/// (`unsigned long long` for an address, `int`, `float`, `double`).
#[derive(Debug, Clone, Copy)]
pub enum Param {
    U64(u64),
    I32(i32),
    F32(f32),
    F64(f64),
}

/// Compiled kernels of one source, loaded into one device's context.
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
    /// `source` compiled for `ctx`'s device (which must be bound) and loaded, its functions found.
    pub fn compile(ctx: &Arc<CudaContext>, source: &Source) -> Result<Self, KernelError> {
        let name = source.name;
        let capability = ctx
            .compute_capability()
            .map_err(|e| failed("reading the compute capability", e))?;
        let module = ctx
            .load_module(compile(source, capability)?)
            .map_err(|e| failed(&format!("loading {name} (cuModuleLoadData)"), e))?;
        let functions = source
            .functions
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
    pub unsafe fn enqueue(
        &self,
        stream: &CudaStream,
        function: &str,
        n: usize,
        params: &[Param],
    ) -> Result<(), KernelError> {
        if n == 0 {
            return Ok(());
        }
        let (_, kernel) = self
            .functions
            .iter()
            .find(|(name, _)| name == function)
            .ok_or_else(|| KernelError(format!("cuda: {} has no kernel {function}", self.name)))?;
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
