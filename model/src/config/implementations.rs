//! Which implementation each part of a block runs: the attention ([`AttentionImpl`], with its
//! tiles [`Blocks`]), the MLP ([`MlpImpl`]) and the head ([`HeadImpl`]), together a pack's
//! [`Implementations`]. The defaults are the memory-lean ones; the plain ones are the references
//! every other implementation is tested against. (A fused CUDA kernel is one more variant here.)

/// Which implementations a pack's attention, MLP and head run: by default the memory-lean ones
/// (blocked attention, chunked MLP, chunked head); the plain ones materialise `[heads, len, len]`
/// scores, `[tokens, d_ff]` intermediates and `[tokens, vocab]` logits (the references, and the
/// old path of `odc-bench memory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Implementations {
    pub attention: AttentionImpl,
    pub mlp: MlpImpl,
    pub head: HeadImpl,
}

/// How the head computes the targets' log-probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeadImpl {
    /// In chunks of positions ([`crate::head`]): never the whole `[tokens, vocab]` logits.
    #[default]
    Chunked,
    /// All logits at once, log-softmax by candle (the reference).
    Full,
}

/// Which attention training uses over a packed micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionImpl {
    /// [`crate::attention::plain::attend_spans`]: each sample's `[H, len, len]` scores materialised
    /// and differentiated by candle (the reference; quadratic memory).
    Plain,
    /// [`crate::attention::blocked_packed_attend`] with these tiles (linear memory).
    Blocked(Blocks),
    /// [`crate::attention::blocked_packed_attend`] with the device's tiles
    /// ([`Blocks::for_device`]): the default.
    #[default]
    Auto,
}

/// Tile sizes: queries per block and keys per block (each clamped to the sample's length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blocks {
    /// Query rows per block.
    pub q: usize,
    /// Keys per block.
    pub k: usize,
}

impl Default for Blocks {
    /// 256 queries × 512 keys: a 14-head tile is 7 MiB in fp32, and tiles are large enough that
    /// candle's per-op overhead stays small next to the matmuls on a CPU.
    fn default() -> Self {
        Blocks { q: 256, k: 512 }
    }
}

impl Blocks {
    /// Tiles for CUDA devices: 1,024 queries × 2,048 keys (a 14-head tile's fp32 temporaries are
    /// ~120 MiB each). Every candle op is a kernel launch of a few microseconds of host time, and
    /// a tile is about fifteen of them: with the CPU's tiles the GPU waits on launches (on an
    /// H200, one `gpu-100m` block's forward and backward over 4 × 4,096 tokens took 209 ms with
    /// 256 × 512 tiles, for ~1 ms of matmuls).
    pub const CUDA: Blocks = Blocks { q: 1024, k: 2048 };

    /// The tiles for `device`: [`Blocks::CUDA`] on a CUDA device, [`Blocks::default`] elsewhere.
    pub fn for_device(device: &candle_core::Device) -> Blocks {
        if device.is_cuda() {
            Blocks::CUDA
        } else {
            Blocks::default()
        }
    }
}

/// How a block computes its MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MlpImpl {
    /// In chunks of tokens ([`crate::mlp::swiglu`]): no `[tokens, d_ff]` tensor in the graph.
    #[default]
    Chunked,
    /// With candle's ops ([`crate::mlp::swiglu_reference`]): the reference, and what LoRA on the
    /// MLP uses.
    Full,
}
