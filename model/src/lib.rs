//! # odc-model — the causal transformers odc trains
//!
//! On candle (`odc::model` re-exports this crate under the root crate's feature `candle`): odc's
//! own small reference model ([`ModelConfig::tiny`], the zero-download default) and the layouts
//! people fine-tune — Llama 3, Qwen2/2.5, Qwen3, SmolLM2 — as configurations of one
//! implementation.
//!
//! Llama-style: token embedding, pre-RMSNorm blocks of rotary attention (grouped-query, with an
//! explicit head width, optional q/k/v biases and q/k norms, Llama 3 rope scaling) and a SwiGLU
//! MLP, final RMSNorm and an LM head, tied to the embedding or not; fp32, or bf16 mixed precision
//! ([`device`]); the device is a parameter: the CPU (the tests), or a CUDA device with the root
//! crate's `cuda` feature ([`DeviceSpec`]). One block ([`block`]) serves training,
//! cached decoding ([`mod@generate`]) and evaluation.
//!
//! **Units.** odc shards, gathers and reduces parameters unit by unit, so the model is written as
//! units ([`transformer`]): unit 0 is the embedding, units `1..=n_layers` the blocks, the last unit
//! the final norm and LM head. Each unit has a fixed parameter list ([`unit_params`], the Hugging
//! Face names such as `model.layers.3.self_attn.q_proj.weight`, which become safetensors names), a seeded initialisation of its flat `f32`
//! buffer ([`unit_init_values`]), and a forward over plain tensors ([`unit_forward`]) that can be run
//! on a detached input so that its backward is a vector–Jacobian product (candle has no per-module
//! backward hooks). [`model_forward`] chains the units.
//!
//! **Packed micro-batches** ([`PackedBatch`]): samples are concatenated into one sequence; attention
//! is block-diagonal causal and rotary positions restart at each sample ([`attention`]).
//!
//! **The candle trap.** candle 0.11.1's fused `softmax_last_dim`, `rms_norm`, `layer_norm`,
//! `rotary_emb::rope*` and `sdpa` have no backward: a graph through them silently drops gradients.
//! This module uses only the differentiable forms of [`ops`] — softmax and log-softmax from
//! `exp`/`sum_keepdim`/`broadcast_div` with a detached max, RMSNorm from
//! `sqr`/`mean_keepdim`/`sqrt`/`broadcast_div`/`broadcast_mul`, rotary embedding from
//! `narrow`/`cat`/`neg`/`broadcast_mul`/add — each tested against the fused forward and against
//! finite differences, and a test checks that the fused ones still drop gradients.
//!
//! **Layers.** Each module imports only those above it in this list, so the folder has no import
//! circle (`python3 scripts/house_figures.py circles model/src` checks it):
//! 1. [`error`], [`config`] (the model's shape, with LoRA's and the kernels' choices),
//!    [`params`], [`device`], [`shares`], [`gang`] (what a gang of trainers is: layout and links);
//! 2. [`ops`]: the differentiable CPU ops with their backward, and beside them the fused
//!    kernels' ops ([`ops::fused`]); [`batch`]: the packed micro-batch;
//! 3. the block's parts: [`attention`] (projections, the plain, blocked and ring attentions and
//!    the dispatch between them), [`mlp`], [`head`], [`lora`] (the adapters' math);
//! 4. [`block`] — the block's forward, read in one file — and [`transformer`] (the units, their
//!    names and forwards);
//! 5. what uses the model: [`hf`] (Hugging Face in and out, PEFT's adapters), [`mod@generate`],
//!    [`eval`], [`grpo`];
//! 6. [`reshard`] (what a stage keeps between its forward and its backward) and [`threads`]
//!    (each concurrently computing model's share of the host's cores).
//!
//! **A leaf.** The crate depends on candle, `odc-kernels`, `odc-text` and `odc-policy`'s layout
//! arithmetic, never on the runtime (`odc-actors`, `odc-transport`): `tests/house.rs` checks the
//! resolved dependency graph. The model meets the runtime in one place, the root crate's
//! `odc::compute` (the `Compute` that runs a micro-batch against a trainer's context, the job
//! builders, the gang's transport link, device-resident memory).

pub mod attention;
pub mod batch;
pub mod block;
pub mod config;
pub mod device;
pub mod error;
pub mod eval;
pub mod gang;
pub mod generate;
pub mod grpo;
pub mod head;
pub mod hf;
pub mod lora;
pub mod mlp;
pub mod ops;
pub mod params;
pub mod reshard;
pub mod shares;
#[cfg(test)]
pub(crate) mod test_util;
pub mod threads;
pub mod transformer;

pub use batch::{GangPiece, PackedBatch, Sample};
pub use config::{
    AttentionImpl, Blocks, HeadImpl, Implementations, LoraConfig, LoraTarget, MlpImpl, ModelConfig,
    RopeScaling,
};
pub use device::{cuda_ordinal, open_device, ComputePrecision, DeviceSpec};
pub use error::{Error, Result};
pub use eval::{eval_loss, evaluate, evaluate_prompted, EvalLoss, Evaluation, EVAL_BATCH};
pub use generate::{
    batch_log_probs, forward_cached, forward_cached_rows, generate, generate_batch,
    generate_batch_measured, generate_batch_with_log_probs, generate_group,
    generate_group_with_log_probs, prefill, sequence_log_probs, DecodeStats, Generated, KvCache,
    Prompt, Sampling, Weights,
};
pub use grpo::{group_advantages, grpo_loss_sum, rl_targets, GrpoConfig, RlSample};
pub use params::{as_tensors, unit_tensors, unit_vars, ParamInit, ParamSpec};
pub use reshard::Reshard;
pub use shares::{batch_share_range, map_batches_in_shares, map_in_shares, share_range};
pub use threads::{matmul_rate, share_cpu_threads, CpuThreads};
pub use transformer::{
    head_forward_with, head_log_probs, head_logits, head_target_log_probs,
    head_target_log_probs_with, head_tensors, layout_units, model_forward, model_loss, param_count,
    tensor_map, unit_count, unit_forward, unit_init_values, unit_name, unit_params, HeadOutput,
    Unit, UnitOutput,
};
