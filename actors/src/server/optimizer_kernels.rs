//! The safe interface of odc-kernels' [`OPTIMIZER`] kernels, written once against the one
//! launcher ([`Launcher`]): on a GPU the shard servers' barrier (odc-transport's
//! `cuda::DeviceLauncher`, `server/device/`), on this CPU the same code through the emulation
//! (`tests/optimizer_kernels_on_cpu.rs`, in CI). [`OptimizerKernels`] checks that every buffer of
//! a launch holds the shard's elements (and the partial sums one f64 per block of the largest
//! launch) before it launches, so the kernels never index past a buffer; a launcher refuses
//! buffers it cannot address. Failures are errors naming the kernel, never panics.

use odc_kernels::launch::{Arg, Launcher};
use odc_kernels::{BLOCK, OPTIMIZER};
use odc_transport::TransportError;

use crate::error::{Error, Result};
use crate::server::optimizer::AdamScalars;

// `optimizer.cu` sizes its block reduction by its own `BLOCK`, which must be every launch's.
const _: () = assert!(BLOCK == 256, "optimizer.cu's BLOCK is 256");

/// What SGD's kernel does with the momentum buffer (torch's `momentum_buffer`).
#[derive(Debug)]
pub enum SgdMomentum<'a, B> {
    /// No momentum: no buffer.
    Off,
    /// The first step with momentum: the buffer is written with the direction.
    First(&'a B),
    /// Later steps: the buffer is `momentum · buffer + direction`.
    Next(&'a B),
}

/// `optimizer.cu` loaded on one launcher, with the partial sums of the sum-of-squares kernel.
/// Each shard holds its own (a launcher compiles the module once and shares it).
pub struct OptimizerKernels<L: Launcher> {
    launcher: L,
    module: L::Module,
    /// One f64 per block of the largest launch.
    partials: L::Buffer,
}

impl<L: Launcher> std::fmt::Debug for OptimizerKernels<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OptimizerKernels").finish_non_exhaustive()
    }
}

/// A launch refused before it ran, or a launcher's failure: `what` names it.
fn refused(what: String) -> Error {
    Error::Transport(TransportError::Unsupported {
        what: format!("cuda: optimizer kernel: {what}"),
    })
}

/// A launcher's failure as the runtime's error.
fn failed<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> Error + '_ {
    move |e| refused(format!("{what}: {e}"))
}

impl<L: Launcher> OptimizerKernels<L> {
    /// Compile (on the launcher's first call; on a GPU NVRTC, without it `no NVRTC: …`) and load
    /// the kernels, with room for the partial sums of any launch.
    pub fn new(launcher: L) -> Result<Self> {
        let module = launcher
            .module(&OPTIMIZER)
            .map_err(failed("loading optimizer.cu"))?;
        let most = launcher.blocks(&module, usize::MAX) as usize;
        let partials = launcher
            .upload(&vec![0u8; most * 8])
            .map_err(failed("the partial sums"))?;
        Ok(Self {
            launcher,
            module,
            partials,
        })
    }

    /// Elements of an fp32 buffer (its bytes must be a multiple of 4).
    fn elements(&self, what: &str, buffer: &L::Buffer) -> Result<usize> {
        let bytes = self.launcher.bytes(buffer);
        if bytes % 4 != 0 {
            return Err(refused(format!(
                "{what} of {bytes} bytes is not fp32 elements"
            )));
        }
        Ok(bytes / 4)
    }

    /// `buffer` must hold `len` fp32 elements.
    fn check(&self, what: &str, buffer: &L::Buffer, len: usize) -> Result<()> {
        let bytes = self.launcher.bytes(buffer);
        if bytes != len.saturating_mul(4) {
            return Err(refused(format!(
                "{what} is {bytes} bytes, not {len} fp32 elements"
            )));
        }
        Ok(())
    }

    /// Runs `function` over `n` elements with `args`.
    ///
    /// # Safety
    /// `args` are `function`'s parameters in order and of their types, every buffer holding the
    /// elements the kernel indexes for `n`.
    unsafe fn run(&self, function: &str, n: usize, args: &[Arg<'_, L::Buffer>]) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.launcher.launch(&self.module, function, n, args) }.map_err(failed(function))
    }

    /// `Reduce`'s kernel: every element of `grad` times `scale` (in f64, rounded to f32), in
    /// place, and the sum of the squares of the scaled values (f64; per thread, a tree per block,
    /// the blocks in order here). NaN or infinite when an element is.
    pub fn scale_sum_sq(&mut self, grad: &L::Buffer, scale: f64) -> Result<f64> {
        let n = self.elements("the gradient", grad)?;
        if n == 0 {
            return Ok(0.0);
        }
        let blocks = self.launcher.blocks(&self.module, n) as usize;
        let args = [
            Arg::buffer(grad),
            Arg::u64(n as u64),
            Arg::f64(scale),
            Arg::buffer(&self.partials),
        ];
        // SAFETY: odc_scale_sum_sq(float*, unsigned long long, double, double*): `grad` holds `n`
        // fp32 elements and `partials` one f64 for each block of any launch.
        unsafe { self.run("odc_scale_sum_sq", n, &args) }?;
        let partials = self
            .launcher
            .download(&self.partials)
            .map_err(failed("the partial sums"))?;
        Ok(partials
            .chunks_exact(8)
            .take(blocks)
            .map(|p| f64::from_le_bytes([p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]]))
            .sum())
    }

    /// One AdamW step of the scalars `s` on `param`, `exp_avg`, `exp_avg_sq` with `grad` times
    /// `clip` (when not 1); all four of one length.
    pub fn adamw(
        &self,
        s: &AdamScalars,
        clip: f64,
        param: &L::Buffer,
        grad: &L::Buffer,
        exp_avg: &L::Buffer,
        exp_avg_sq: &L::Buffer,
    ) -> Result<()> {
        let n = self.elements("the parameters", param)?;
        self.check("the gradient", grad, n)?;
        self.check("exp_avg", exp_avg, n)?;
        self.check("exp_avg_sq", exp_avg_sq, n)?;
        let args = [
            Arg::buffer(param),
            Arg::buffer(grad),
            Arg::buffer(exp_avg),
            Arg::buffer(exp_avg_sq),
            Arg::u64(n as u64),
            Arg::f64(clip),
            Arg::f32(s.decay),
            Arg::f32(s.beta1),
            Arg::f32(s.one_minus_beta1),
            Arg::f32(s.beta2),
            Arg::f32(s.one_minus_beta2),
            Arg::f32(s.step_size),
            Arg::f32(s.bias_correction2_sqrt),
            Arg::f32(s.eps),
        ];
        // SAFETY: odc_adamw(float*, const float*, float*, float*, unsigned long long, double,
        // float × 8); the four buffers hold `n` fp32 elements (checked above).
        unsafe { self.run("odc_adamw", n, &args) }
    }

    /// One SGD step (torch's, see `OptimizerConfig::Sgd`) on `param` with `grad` times `clip`
    /// (when not 1) and the momentum buffer as `buffer` says; all of one length.
    #[allow(clippy::too_many_arguments)]
    pub fn sgd(
        &self,
        lr: f32,
        momentum: f32,
        weight_decay: f32,
        clip: f64,
        param: &L::Buffer,
        grad: &L::Buffer,
        buffer: SgdMomentum<'_, L::Buffer>,
    ) -> Result<()> {
        let n = self.elements("the parameters", param)?;
        self.check("the gradient", grad, n)?;
        let (mode, buf) = match buffer {
            // The kernel does not touch the buffer in mode 0: the gradient stands in.
            SgdMomentum::Off => (0, grad),
            SgdMomentum::First(buf) => (1, buf),
            SgdMomentum::Next(buf) => (2, buf),
        };
        self.check("the momentum buffer", buf, n)?;
        let args = [
            Arg::buffer(param),
            Arg::buffer(grad),
            Arg::buffer(buf),
            Arg::u64(n as u64),
            Arg::f64(clip),
            Arg::f32(lr),
            Arg::f32(momentum),
            Arg::f32(weight_decay),
            Arg::i32(mode),
        ];
        // SAFETY: odc_sgd(float*, const float*, float*, unsigned long long, double, float × 3,
        // int); the three buffers hold `n` fp32 elements (checked above).
        unsafe { self.run("odc_sgd", n, &args) }
    }
}
