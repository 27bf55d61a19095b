//! Causal self-attention of one block, shared by training over a **packed** micro-batch and by
//! cached decoding ([`mod@crate::generate`]): the projections ([`project`]) and the output
//! ([`AttentionWeights::output`]) are the same code; only what the queries attend to differs.
//!
//! The folder, in layers: [`projection`](AttentionWeights) (q, k, v and the output projection),
//! [`plain`] (the reference: each sample's scores materialised), [`blocked`] (FlashAttention-2's
//! tiling in candle ops, with the log-sum-exp merge rule), [`ring`] (a sample split over a gang,
//! merging the blocked partials), and here the dispatch between them ([`packed_attend`], by the
//! batch's [`AttentionImpl`]) and the training layer ([`causal_self_attention`]). The fused
//! kernel ([`fused`]: on CUDA opt-in with `ODC_FUSED_KERNELS=1`, on the CPU emulated for tests)
//! is one more implementation behind the same dispatch, taking the blocked path's place.
//!
//! Layout: hidden states are `[rows · n, d_model]` (a packed micro-batch is one row of `T`
//! tokens; decoding feeds `rows` sequences of `n` new tokens each); heads are
//! `[rows, heads, n, head_dim]`.
//!
//! Guarantees:
//! 1. Token `i` attends to token `j` iff `segments[i] == segments[j]` and `j <= i` (block-diagonal
//!    causal, via the batch's additive mask): no information crosses samples.
//! 2. Rotary angles come from `positions` (0 at each sample's start), so a sample's output does not
//!    depend on what is packed before it.
//! 3. Every op is differentiable (see [`crate::ops`]); the mask is finite, so no row produces NaN
//!    (each row allows at least its diagonal).
//! 4. **Grouped-query attention**: key/value head `g` serves query heads
//!    `g · n_heads / n_kv_heads ..` (consecutive groups, as `transformers`' `repeat_kv`); with as
//!    many KV heads as query heads it is multi-head attention.
//! 5. The Hugging Face layouts' options: q/k/v biases (Qwen2) are added after the projections;
//!    q/k RMSNorm (Qwen3) normalises each head over `head_dim` before the rotary embedding.
//! 6. Memory: training's attention is blocked unless the batch says otherwise
//!    ([`blocked`], [`PackedBatch::kernels`]): per layer the graph keeps q, k, v, the output
//!    and each row's log-sum-exp (O(T · head_dim)), and a step holds one
//!    `[heads, Blocks::q, Blocks::k]` tile, so memory grows linearly with the longest sample. The
//!    plain path ([`plain::attend_spans`], the reference) materialises each sample's `[heads, len, len]`
//!    scores and its graph keeps them until the backward: about 26 bytes per head per (query,
//!    key) pair under bf16 mixed precision (24 in fp32). Cached decoding
//!    ([`mod@crate::generate`]) keeps its own attention: one new token's scores per step.

pub mod blocked;
pub mod fused;
pub mod plain;
mod projection;
pub mod ring;

use candle_core::Tensor;

pub use blocked::{
    attend_partial, attend_partial_backward, blocked_packed_attend, flash_packed_attend, merge,
    Partial,
};
pub use plain::{attend, repeat_kv};
pub use projection::{project, project_tokens, AttentionWeights};
pub use ring::gang_attend;

use crate::batch::PackedBatch;
use crate::config::{AttentionImpl, Blocks, ModelConfig};
use crate::error::{Error, Result};

/// Training's attention layer over the packed micro-batch `x: [T, d_model]`: [`project`], the
/// batch's packed attention ([`PackedBatch::kernels`]: blocked unless set),
/// [`AttentionWeights::output`]; `[T, d_model]`.
pub fn causal_self_attention(
    config: &ModelConfig,
    x: &Tensor,
    w: &AttentionWeights<'_>,
    batch: &PackedBatch,
) -> Result<Tensor> {
    let (q, k, v) = project(config, w, x, 1, &batch.rope_cos, &batch.rope_sin)?;
    w.output(&packed_attend(
        batch.implementations.attention,
        config,
        &q,
        &k,
        &v,
        batch,
    )?)
}

/// Queries `[1, H, T, hd]`, keys and values `[1, KV, T, hd]` of `batch` attended with
/// `attention`, each sample causally within itself: `[1, H, T, hd]`. A gang's piece (packed last)
/// attends over its gang's ring ([`ring`]), each piece in turn, the samples before them as usual.
pub fn packed_attend(
    attention: AttentionImpl,
    config: &ModelConfig,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: &PackedBatch,
) -> Result<Tensor> {
    if batch.pieces.is_empty() {
        return attend_spans(attention, config, q, k, v, &batch.spans);
    }
    let whole = batch
        .spans
        .len()
        .checked_sub(batch.pieces.len())
        .ok_or_else(|| Error::Batch("more gang pieces than spans in a pack".into()))?;
    let (rest, pieces) = batch.spans.split_at(whole);
    let blocks = match attention {
        AttentionImpl::Blocked(blocks) => blocks,
        AttentionImpl::Plain | AttentionImpl::Auto => Blocks::for_device(q.device()),
    };
    let at = |x: &Tensor, from: usize, n: usize| x.narrow(2, from, n);
    let mut outs = Vec::with_capacity(pieces.len() + 1);
    if let Some(&(start, _)) = pieces.first().filter(|_| !rest.is_empty()) {
        outs.push(attend_spans(
            attention,
            config,
            &at(q, 0, start)?,
            &at(k, 0, start)?,
            &at(v, 0, start)?,
            rest,
        )?);
    }
    // In gang order: every member of every gang attends its pieces in the same order.
    for (&(start, len), piece) in pieces.iter().zip(&batch.pieces) {
        outs.push(gang_attend(
            &at(q, start, len)?,
            &at(k, start, len)?,
            &at(v, start, len)?,
            &piece.layout,
            piece.link.clone(),
            piece.next_call(),
            blocks,
        )?);
    }
    if outs.len() == 1 {
        return Ok(outs.remove(0));
    }
    Ok(Tensor::cat(&outs, 2)?)
}

/// The samples at `spans` (tiling the `T` positions of `q`), each causally within itself.
fn attend_spans(
    attention: AttentionImpl,
    config: &ModelConfig,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &[(usize, usize)],
) -> Result<Tensor> {
    if attention != AttentionImpl::Plain && fused::applies(q) {
        return fused::packed_attend(q, k, v, spans);
    }
    match attention {
        AttentionImpl::Plain => plain::attend_spans(config, q, k, v, spans),
        AttentionImpl::Blocked(blocks) => blocked_packed_attend(q, k, v, spans, blocks),
        AttentionImpl::Auto => {
            blocked_packed_attend(q, k, v, spans, Blocks::for_device(q.device()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Sample;
    use crate::test_util::{max_abs_diff, random};
    use crate::ModelConfig;
    use candle_core::Device;

    /// 4 query heads of 4 over 2 KV heads, width 16.
    fn config() -> ModelConfig {
        ModelConfig {
            vocab_size: 16,
            d_model: 16,
            n_heads: 4,
            n_kv_heads: Some(2),
            max_seq_len: 16,
            ..ModelConfig::tiny()
        }
    }

    /// wq, wk, wv, wo for `c`.
    fn weights(c: &ModelConfig) -> Vec<Tensor> {
        let (d, q, kv) = (
            c.d_model,
            c.n_heads * c.head_dim(),
            c.kv_heads() * c.head_dim(),
        );
        [[q, d], [kv, d], [kv, d], [d, q]]
            .iter()
            .enumerate()
            .map(|(i, shape)| (random(shape, 100 + i as u64) * 0.3).unwrap())
            .collect()
    }

    fn aw(w: &[Tensor]) -> AttentionWeights<'_> {
        AttentionWeights {
            wq: &w[0],
            wk: &w[1],
            wv: &w[2],
            wo: &w[3],
            bias: None,
            qk_norm: None,
            adapters: None,
        }
    }

    fn pack(c: &ModelConfig, lens: &[usize]) -> PackedBatch {
        let samples: Vec<Sample> = lens
            .iter()
            .map(|&n| Sample::all_loss((0..n as u32).collect()))
            .collect();
        PackedBatch::pack(c, &samples, &Device::Cpu).unwrap()
    }

    #[test]
    fn attention_does_not_cross_samples_and_positions_reset() {
        let c = config();
        let w = weights(&c);
        // Sample A (5 tokens) alone, and packed after sample B (3 tokens).
        let xa = random(&[5, 16], 1);
        let xb = random(&[3, 16], 2);
        let alone = causal_self_attention(&c, &xa, &aw(&w), &pack(&c, &[5])).unwrap();
        let packed_x = Tensor::cat(&[&xb, &xa], 0).unwrap();
        let packed = causal_self_attention(&c, &packed_x, &aw(&w), &pack(&c, &[3, 5])).unwrap();
        assert!(max_abs_diff(&alone, &packed.narrow(0, 3, 5).unwrap()) < 1e-5);
        // A different sample B changes nothing for A.
        let other_x = Tensor::cat(&[&random(&[3, 16], 3), &xa], 0).unwrap();
        let other = causal_self_attention(&c, &other_x, &aw(&w), &pack(&c, &[3, 5])).unwrap();
        assert!(
            max_abs_diff(
                &packed.narrow(0, 3, 5).unwrap(),
                &other.narrow(0, 3, 5).unwrap()
            ) < 1e-5
        );
    }

    #[test]
    fn grouped_query_attention_is_multi_head_with_repeated_kv_heads() {
        let gqa = config();
        let w = weights(&gqa);
        // The same layer as multi-head attention: KV head g's rows repeated for query heads
        // 2g and 2g + 1.
        let mha = ModelConfig {
            n_kv_heads: None,
            ..gqa.clone()
        };
        let hd = gqa.head_dim();
        let repeat = |m: &Tensor| {
            let heads: Vec<Tensor> = (0..gqa.kv_heads())
                .flat_map(|g| {
                    let rows = m.narrow(0, g * hd, hd).unwrap();
                    [rows.clone(), rows]
                })
                .collect();
            Tensor::cat(&heads, 0).unwrap()
        };
        let wide = [w[0].clone(), repeat(&w[1]), repeat(&w[2]), w[3].clone()];
        let x = random(&[7, 16], 4);
        let b = pack(&gqa, &[3, 4]);
        let grouped = causal_self_attention(&gqa, &x, &aw(&w), &b).unwrap();
        let multi = causal_self_attention(&mha, &x, &aw(&wide), &b).unwrap();
        assert!(max_abs_diff(&grouped, &multi) < 1e-5);
    }

    #[test]
    fn attention_is_finite_on_large_inputs_and_later_tokens_do_not_matter() {
        let c = config();
        let w = weights(&c);
        let x = (random(&[7, 16], 4) * 50.0).unwrap();
        let b = pack(&c, &[1, 4, 2]);
        let out = causal_self_attention(&c, &x, &aw(&w), &b).unwrap();
        assert!(out
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|v| v.is_finite()));
        // Changing the last token of the middle sample leaves its earlier tokens alone.
        let mut rows: Vec<Vec<f32>> = x.to_vec2().unwrap();
        rows[4] = vec![3.0; 16];
        let changed = Tensor::new(rows, &Device::Cpu).unwrap();
        let out2 = causal_self_attention(&c, &changed, &aw(&w), &b).unwrap();
        assert!(
            max_abs_diff(
                &out.narrow(0, 0, 4).unwrap(),
                &out2.narrow(0, 0, 4).unwrap()
            ) < 1e-5
        );
        assert!(
            max_abs_diff(
                &out.narrow(0, 5, 2).unwrap(),
                &out2.narrow(0, 5, 2).unwrap()
            ) < 1e-5
        );
        assert!(
            max_abs_diff(
                &out.narrow(0, 4, 1).unwrap(),
                &out2.narrow(0, 4, 1).unwrap()
            ) > 1e-3
        );
    }
}
