//! The safe interface of `optimizer.cu`'s kernels: [`OptimizerKernels`] checks that every buffer
//! of a launch holds the shard's elements (and the partial sums one f64 per block of the largest
//! launch) before it launches, so the kernels never index past a buffer; odc-transport's
//! [`Device::launch`] refuses buffers of another device. Failures are errors, never panics.

use std::sync::Arc;

use odc_transport::cuda::{Device, DeviceBuffer, KernelArg, Module, BLOCK};
use odc_transport::TransportError;

use crate::error::{Error, Result};
use crate::server::optimizer::AdamScalars;

/// The name NVRTC and the device's module cache know `optimizer.cu` by.
pub(super) const MODULE: &str = "odc_actors_optimizer.cu";
/// The kernels' source.
pub(super) const SOURCE: &str = include_str!("optimizer.cu");
/// The kernels of [`SOURCE`].
pub(super) const FUNCTIONS: [&str; 3] = ["odc_scale_sum_sq", "odc_adamw", "odc_sgd"];

// `optimizer.cu` sizes its block reduction by its own `BLOCK`, which must be every launch's.
const _: () = assert!(BLOCK == 256, "optimizer.cu's BLOCK is 256");

/// What SGD's kernel does with the momentum buffer (torch's `momentum_buffer`).
#[derive(Debug, Clone, Copy)]
pub enum SgdMomentum<'a> {
    /// No momentum: no buffer.
    Off,
    /// The first step with momentum: the buffer is written with the direction.
    First(&'a DeviceBuffer),
    /// Later steps: the buffer is `momentum · buffer + direction`.
    Next(&'a DeviceBuffer),
}

/// `optimizer.cu` compiled for one device, with the partial sums of the sum-of-squares kernel.
/// Each shard holds its own (the module is compiled once per device and shared).
pub struct OptimizerKernels {
    device: Arc<Device>,
    module: Arc<Module>,
    /// One f64 per block of the largest launch.
    partials: DeviceBuffer,
}

impl std::fmt::Debug for OptimizerKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OptimizerKernels")
            .field("device", &self.device.ordinal())
            .field("module", &self.module)
            .finish()
    }
}

/// A launch refused before it ran: `what` is not what the kernel needs.
fn refused(what: String) -> Error {
    Error::Transport(TransportError::Unsupported {
        what: format!("cuda: optimizer kernel: {what}"),
    })
}

/// `buffer` must hold `len` fp32 elements.
fn check(what: &str, buffer: &DeviceBuffer, len: usize) -> Result<()> {
    if buffer.len() != len.saturating_mul(4) {
        return Err(refused(format!(
            "{what} is {} bytes, not {len} fp32 elements",
            buffer.len()
        )));
    }
    Ok(())
}

impl OptimizerKernels {
    /// Compile (on the device's first call; NVRTC, without it `no NVRTC: …`) and load the kernels
    /// for `device`, with room for the partial sums of any launch.
    pub fn new(device: &Arc<Device>) -> Result<Self> {
        let module = device.module(MODULE, SOURCE, &FUNCTIONS)?;
        let partials = device.alloc(module.max_blocks() as usize * 8)?;
        Ok(Self {
            device: Arc::clone(device),
            module,
            partials,
        })
    }

    /// Elements of an fp32 buffer (its bytes must be a multiple of 4).
    fn elements(what: &str, buffer: &DeviceBuffer) -> Result<usize> {
        if buffer.len() % 4 != 0 {
            return Err(refused(format!(
                "{what} of {} bytes is not fp32 elements",
                buffer.len()
            )));
        }
        Ok(buffer.len() / 4)
    }

    /// `Reduce`'s kernel: every element of `grad` times `scale` (in f64, rounded to f32), in
    /// place, and the sum of the squares of the scaled values (f64; per thread, a tree per block,
    /// the blocks in order here). NaN or infinite when an element is.
    pub fn scale_sum_sq(&mut self, grad: &DeviceBuffer, scale: f64) -> Result<f64> {
        let n = Self::elements("the gradient", grad)?;
        if n == 0 {
            return Ok(0.0);
        }
        let blocks = self.module.blocks(n) as usize;
        let args = [
            KernelArg::buffer(grad),
            KernelArg::u64(n as u64),
            KernelArg::f64(scale),
            KernelArg::buffer(&self.partials),
        ];
        // SAFETY: odc_scale_sum_sq(float*, unsigned long long, double, double*): `grad` holds `n`
        // fp32 elements and `partials` one f64 for each block of any launch (`max_blocks`).
        unsafe { self.device.launch(&self.module, FUNCTIONS[0], n, &args) }?;
        let partials = self.device.download(&self.partials)?;
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
        param: &DeviceBuffer,
        grad: &DeviceBuffer,
        exp_avg: &DeviceBuffer,
        exp_avg_sq: &DeviceBuffer,
    ) -> Result<()> {
        let n = Self::elements("the parameters", param)?;
        check("the gradient", grad, n)?;
        check("exp_avg", exp_avg, n)?;
        check("exp_avg_sq", exp_avg_sq, n)?;
        let args = [
            KernelArg::buffer(param),
            KernelArg::buffer(grad),
            KernelArg::buffer(exp_avg),
            KernelArg::buffer(exp_avg_sq),
            KernelArg::u64(n as u64),
            KernelArg::f64(clip),
            KernelArg::f32(s.decay),
            KernelArg::f32(s.beta1),
            KernelArg::f32(s.one_minus_beta1),
            KernelArg::f32(s.beta2),
            KernelArg::f32(s.one_minus_beta2),
            KernelArg::f32(s.step_size),
            KernelArg::f32(s.bias_correction2_sqrt),
            KernelArg::f32(s.eps),
        ];
        // SAFETY: odc_adamw(float*, const float*, float*, float*, unsigned long long, double,
        // float × 8); the four buffers hold `n` fp32 elements (checked above).
        unsafe { self.device.launch(&self.module, FUNCTIONS[1], n, &args) }?;
        Ok(())
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
        param: &DeviceBuffer,
        grad: &DeviceBuffer,
        buffer: SgdMomentum<'_>,
    ) -> Result<()> {
        let n = Self::elements("the parameters", param)?;
        check("the gradient", grad, n)?;
        let (mode, buf) = match buffer {
            // The kernel does not touch the buffer in mode 0: the gradient stands in.
            SgdMomentum::Off => (0, grad),
            SgdMomentum::First(buf) => (1, buf),
            SgdMomentum::Next(buf) => (2, buf),
        };
        check("the momentum buffer", buf, n)?;
        let args = [
            KernelArg::buffer(param),
            KernelArg::buffer(grad),
            KernelArg::buffer(buf),
            KernelArg::u64(n as u64),
            KernelArg::f64(clip),
            KernelArg::f32(lr),
            KernelArg::f32(momentum),
            KernelArg::f32(weight_decay),
            KernelArg::i32(mode),
        ];
        // SAFETY: odc_sgd(float*, const float*, float*, unsigned long long, double, float × 3,
        // int); the three buffers hold `n` fp32 elements (checked above).
        unsafe { self.device.launch(&self.module, FUNCTIONS[2], n, &args) }?;
        Ok(())
    }
}
