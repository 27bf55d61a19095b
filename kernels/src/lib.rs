//! Every CUDA C kernel of odc, compiled at run time by NVRTC for the device at hand, and the one
//! way to launch them ([`launch::Launcher`]): the fused training kernels (issue 41) with their CPU
//! references, the transport's accumulate ([`ACCUMULATE`]) and the shard servers' optimizer step
//! ([`OPTIMIZER`]).
//!
//! - [`SOURCES`]: one [`Source`] per kernel family — RMSNorm, also fused with the residual add
//!   before it ([`NORM`]), SwiGLU ([`SWIGLU`]), rotary embedding ([`ROTARY`]) — each forward and
//!   backward, attention over samples of different lengths with grouped-query heads ([`ATTENTION`]:
//!   forward and backward, a plain first version; [`FLASH`]: FlashAttention-2's tiles on tensor
//!   cores, forward and backward, bf16; both varlen as FlashAttention's interface is, queries and
//!   keys of their own lengths, causal or not), and cross-entropy with its gradient in one
//!   kernel for a chunk of the head's rows ([`LOSS`]), in fp32 and bf16, fp32 arithmetic; and the
//!   runtime's: the transport's accumulate ([`ACCUMULATE`]) and the shard servers' optimizer
//!   ([`OPTIMIZER`]). Every training source starts with `common.cuh` (bf16 loads and stores
//!   rounded as the host codec rounds, a warp's sum); no source needs a header of a CUDA toolkit,
//!   so NVRTC alone compiles it (no driver, no device).
//! - [`reference`]: the same math on the CPU in f64, what every kernel is checked against.
//! - `tests/cases/`: every kernel on fresh random inputs into poisoned outputs against
//!   [`reference`], run by two backends. `tests/emulated.rs` runs them on the CPU through
//!   `emulate` (feature `emulate`: each source compiled as C++ by the host's compiler with
//!   `cuda_on_cpu.h`, a block's threads as fibers that meet at every shuffle, `mma.sync` and
//!   barrier, each launch in two thread orders), so CI checks a kernel's arithmetic, indexing and
//!   written elements where no GPU is (`ODC_REQUIRE_EMULATION=1`: a missing C++ compiler fails).
//! - [`launch`]: the one way to run a kernel ([`launch::Launcher`]: modules, buffers, launches),
//!   implemented by the emulation (`emulate::Emulator`) and by a CUDA device (odc-transport's
//!   `cuda::DeviceLauncher`); the checks, the shard servers' optimizer step and the transport's
//!   accumulate are written once against it.
//! - Feature `nvrtc` (`nvrtc`: NVRTC and the driver loaded at run time through cudarc; no CUDA
//!   install to build): `nvrtc::ptx` compiles a source, `nvrtc::Module` loads and launches it.
//!   `tests/device.rs` compiles every source for compute capabilities 8.0 and 9.0 — CI runs it
//!   with NVRTC from NVIDIA's wheel and `ODC_REQUIRE_NVRTC=1`, so a kernel that does not compile
//!   fails CI — and, where a GPU is, runs the same checks on it.
//!
//! Launch contract (each kernel's comment says which `n`): a grid-stride loop over `n` work items
//! with blocks of a multiple of 32 threads, as odc-transport's `Device::launch` and candle's
//! launches make them; the norm kernels give each row a warp (`n = rows × 32`).
//!
//! Not yet here: tensor-core tiles for fp32 (fp32 takes the plain kernels), and Hopper's
//! asynchronous copies and `wgmma`. The model uses NORM's plain RMSNorm, SWIGLU, ROTARY, ATTENTION
//! and FLASH (the packed attention, decoding's) and LOSS (the chunked head) on CUDA only when asked
//! (`ODC_FUSED_KERNELS=1`), and on the CPU through `emulate` in its own tests
//! (`odc::model::ops::fused`).

#[cfg(feature = "emulate")]
pub mod emulate;
pub mod launch;
#[cfg(feature = "nvrtc-code")]
pub mod nvrtc;
pub mod reference;

/// One kernel source: its name (NVRTC's and a module's), its CUDA C, and its kernels.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    pub name: &'static str,
    pub code: &'static str,
    pub functions: &'static [&'static str],
}

/// RMSNorm forward and backward, alone and fused with the residual add before it, and the column
/// sum that makes the weight's gradient.
pub const NORM: Source = Source {
    name: "norm.cu",
    code: concat!(include_str!("common.cuh"), include_str!("norm.cu")),
    functions: &[
        "odc_rms_norm_fwd_f32",
        "odc_rms_norm_fwd_bf16",
        "odc_rms_norm_bwd_f32",
        "odc_rms_norm_bwd_bf16",
        "odc_add_rms_norm_fwd_f32",
        "odc_add_rms_norm_fwd_bf16",
        "odc_add_rms_norm_bwd_f32",
        "odc_add_rms_norm_bwd_bf16",
        "odc_column_sum_f32",
    ],
};

/// SwiGLU forward and backward.
pub const SWIGLU: Source = Source {
    name: "swiglu.cu",
    code: concat!(include_str!("common.cuh"), include_str!("swiglu.cu")),
    functions: &[
        "odc_swiglu_fwd_f32",
        "odc_swiglu_fwd_bf16",
        "odc_swiglu_bwd_f32",
        "odc_swiglu_bwd_bf16",
    ],
};

/// Rotary embedding (its backward is the rotation by the opposite angles: `sign = −1`).
pub const ROTARY: Source = Source {
    name: "rotary.cu",
    code: concat!(include_str!("common.cuh"), include_str!("rotary.cu")),
    functions: &["odc_rope_f32", "odc_rope_bf16"],
};

/// Causal attention over packed samples, grouped-query heads: the output and the log-sum-exp,
/// and the backward from them; and decoding's attention, one new query per sequence against the
/// KV cache's filled, left-padded columns.
pub const ATTENTION: Source = Source {
    name: "attention.cu",
    code: concat!(include_str!("common.cuh"), include_str!("attention.cu")),
    functions: &[
        "odc_attention_fwd_f32",
        "odc_attention_fwd_bf16",
        "odc_attention_bwd_prep_f32",
        "odc_attention_bwd_prep_bf16",
        "odc_attention_bwd_dq_f32",
        "odc_attention_bwd_dq_bf16",
        "odc_attention_bwd_dkdv_f32",
        "odc_attention_bwd_dkdv_bf16",
        "odc_decode_attention_f32",
        "odc_decode_attention_bf16",
    ],
};

/// Cross-entropy of a chunk of the head's rows, each row's loss, log-sum-exp and logit gradient
/// in one kernel (in place if asked), targets below 0 ignored; and the logit gradient of a block
/// of classes from saved log-sum-exps (the head's `dw` pass).
pub const LOSS: Source = Source {
    name: "loss.cu",
    code: concat!(include_str!("common.cuh"), include_str!("loss.cu")),
    functions: &[
        "odc_cross_entropy_f32",
        "odc_cross_entropy_bf16",
        "odc_softmax_grad_f32",
        "odc_softmax_grad_bf16",
    ],
};

/// Every kernel source.
/// FlashAttention-2 on tensor cores (bf16, head widths 64, 96 and 128): the forward, with the same
/// output and log-sum-exp as [`ATTENTION`]'s, and the backward's dq and dk/dv passes (after
/// [`ATTENTION`]'s `prep`), tiled through shared memory, `mma.sync` for every product (compute
/// capability 8.0 and up).
pub const FLASH: Source = Source {
    name: "flash.cu",
    code: concat!(include_str!("common.cuh"), include_str!("flash.cu")),
    functions: &[
        "odc_flash_attention_fwd_bf16",
        "odc_flash_attention_bwd_dq_bf16",
        "odc_flash_attention_bwd_dkdv_bf16",
    ],
};

/// The `cuda` transport backend's elementwise kernels (odc-transport launches them): the
/// accumulate of the transport contract (C2), `acc[i] += src[i]` fp32 into fp32 and
/// `acc[i] += widen(src[i])` bf16 into fp32, and the fp32 → bf16 encode of a published copy, each
/// bit for bit the host codec's.
pub const ACCUMULATE: Source = Source {
    name: "accumulate.cu",
    code: include_str!("accumulate.cu"),
    functions: &["odc_add_f32", "odc_add_bf16", "odc_encode_bf16"],
};

/// The shard servers' barrier on the GPU (odc-actors launches them): the gradient scaled with
/// the sum of its squares per block, AdamW and SGD, each the host's fp32 operations in the
/// host's order.
pub const OPTIMIZER: Source = Source {
    name: "optimizer.cu",
    code: include_str!("optimizer.cu"),
    functions: &["odc_scale_sum_sq", "odc_adamw", "odc_sgd"],
};

/// Threads per block of every launch (`optimizer.cu` sizes its block reduction by it).
pub const BLOCK: u32 = 256;

/// Every source, the training kernels' and the runtime's.
pub const SOURCES: [Source; 8] = [
    NORM, SWIGLU, ROTARY, ATTENTION, FLASH, LOSS, ACCUMULATE, OPTIMIZER,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_kernel_is_defined_once_in_its_source() {
        for source in SOURCES {
            for function in source.functions {
                let definition = format!("__global__ void {function}(");
                assert_eq!(
                    source.code.matches(&definition).count(),
                    1,
                    "{}: {function}",
                    source.name
                );
            }
            let defined = source.code.matches("__global__ void").count();
            assert_eq!(
                defined,
                source.functions.len(),
                "{}: a kernel that is not listed",
                source.name
            );
            assert!(
                !source.code.contains("#include"),
                "{}: NVRTC alone must compile it",
                source.name
            );
        }
    }
}
