//! Causal self-attention over one **packed** micro-batch.
//!
//! Layout: no batch dimension — the pack is one sequence, `x: [T, d_model]`; per-token metadata comes
//! from the [`PackedBatch`] (`positions`, `segments`, and what is derived from them).
//!
//! Guarantees:
//! 1. Token `i` attends to token `j` iff `segments[i] == segments[j]` and `j <= i` (block-diagonal
//!    causal, via the batch's additive mask): no information crosses samples.
//! 2. Rotary angles come from `positions` (0 at each sample's start), so a sample's output does not
//!    depend on what is packed before it.
//! 3. Every op is differentiable (see [`super::ops`]); the mask is finite, so no row produces NaN
//!    (each row allows at least its diagonal).
//! 4. Memory: each sample's scores are materialised (`[heads, len, len]`, in fp32 for the mask and
//!    the softmax), and a unit's graph keeps them until its backward: about 26 bytes per head per
//!    (query, key) pair under bf16 mixed precision (24 in fp32). That bounds the longest sample
//!    a device can train; a blocked, recomputing attention would lift it (see the README).

use candle_core::{DType, Tensor};

use super::batch::PackedBatch;
use super::error::Result;
use super::ops::{rope, softmax_last_dim};

/// The four projections of one attention layer, each `[d_model, d_model]` (`[out, in]`).
#[derive(Debug, Clone, Copy)]
pub struct AttentionWeights<'a> {
    /// Query projection.
    pub wq: &'a Tensor,
    /// Key projection.
    pub wk: &'a Tensor,
    /// Value projection.
    pub wv: &'a Tensor,
    /// Output projection.
    pub wo: &'a Tensor,
}

/// `x: [T, d_model]` -> `[T, d_model]`: multi-head attention with rotary positions, each sample of
/// the pack attending causally within itself only.
pub fn causal_self_attention(
    x: &Tensor,
    w: AttentionWeights<'_>,
    n_heads: usize,
    batch: &PackedBatch,
) -> Result<Tensor> {
    let (t, d) = x.dims2()?;
    let (probs, v) = probs_and_values(x, w, n_heads, batch)?;
    let outs = probs
        .iter()
        .zip(&batch.spans)
        .map(|(p, &(start, len))| p.matmul(&v.narrow(1, start, len)?))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let out = Tensor::cat(&outs, 1)?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((t, d))?;
    Ok(out.matmul(&w.wo.t()?)?)
}

/// Per sample, the attention probabilities `[H, len, len]`; and the values `[H, T, head_dim]` of
/// the whole pack. The projections run over the whole pack at once; scores only within a sample.
fn probs_and_values(
    x: &Tensor,
    w: AttentionWeights<'_>,
    n_heads: usize,
    batch: &PackedBatch,
) -> Result<(Vec<Tensor>, Tensor)> {
    let (t, d) = x.dims2()?;
    let head_dim = d / n_heads;
    // [T, d] -> [H, T, head_dim]
    let heads = |w: &Tensor| -> Result<Tensor> {
        Ok(x.matmul(&w.t()?)?
            .reshape((t, n_heads, head_dim))?
            .transpose(0, 1)?
            .contiguous()?)
    };
    let q = rope(&heads(w.wq)?, &batch.rope_cos, &batch.rope_sin)?;
    let k = rope(&heads(w.wk)?, &batch.rope_cos, &batch.rope_sin)?;
    let v = heads(w.wv)?;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let probs = batch
        .spans
        .iter()
        .zip(&batch.causal_masks)
        .map(|(&(start, len), mask)| -> Result<Tensor> {
            let q = q.narrow(1, start, len)?;
            let k = k.narrow(1, start, len)?;
            // Scores in the activations' dtype (a bf16 matmul under mixed precision), the mask
            // and the softmax in fp32, the probabilities back in the values' dtype.
            let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?
                .to_dtype(DType::F32)?
                .broadcast_add(mask)?;
            Ok(softmax_last_dim(&scores)?.to_dtype(v.dtype())?)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((probs, v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::batch::Sample;
    use crate::model::ops::tests::random;
    use crate::model::ModelConfig;
    use candle_core::Device;

    fn config() -> ModelConfig {
        ModelConfig {
            vocab_size: 16,
            d_model: 16,
            n_heads: 2,
            max_seq_len: 16,
            ..ModelConfig::tiny()
        }
    }

    fn weights() -> Vec<Tensor> {
        (0..4)
            .map(|i| (random(&[16, 16], 100 + i) * 0.3).unwrap())
            .collect()
    }

    fn aw(w: &[Tensor]) -> AttentionWeights<'_> {
        AttentionWeights {
            wq: &w[0],
            wk: &w[1],
            wv: &w[2],
            wo: &w[3],
        }
    }

    fn pack(lens: &[usize]) -> PackedBatch {
        let samples: Vec<Sample> = lens
            .iter()
            .map(|&n| Sample::all_loss((0..n as u32).collect()))
            .collect();
        PackedBatch::pack(&config(), &samples, &Device::Cpu).unwrap()
    }

    #[test]
    fn attention_does_not_cross_samples_and_positions_reset() {
        let w = weights();
        // Sample A (5 tokens) alone, and packed after sample B (3 tokens).
        let xa = random(&[5, 16], 1);
        let xb = random(&[3, 16], 2);
        let alone = causal_self_attention(&xa, aw(&w), 2, &pack(&[5])).unwrap();
        let packed_x = Tensor::cat(&[&xb, &xa], 0).unwrap();
        let packed = causal_self_attention(&packed_x, aw(&w), 2, &pack(&[3, 5])).unwrap();
        let a_in_pack = packed.narrow(0, 3, 5).unwrap();
        let diff = (alone - a_in_pack)
            .unwrap()
            .abs()
            .unwrap()
            .max_keepdim(0)
            .unwrap()
            .max(1)
            .unwrap();
        assert!(diff.to_vec1::<f32>().unwrap()[0] < 1e-5);
        // A different sample B changes nothing for A.
        let other_x = Tensor::cat(&[&random(&[3, 16], 3), &xa], 0).unwrap();
        let other = causal_self_attention(&other_x, aw(&w), 2, &pack(&[3, 5])).unwrap();
        let same = (packed.narrow(0, 3, 5).unwrap() - other.narrow(0, 3, 5).unwrap()).unwrap();
        assert!(
            same.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                < 1e-5
        );
    }

    #[test]
    fn attention_rows_are_finite_distributions() {
        let w = weights();
        let x = (random(&[7, 16], 4) * 50.0).unwrap();
        let (probs, _) = probs_and_values(&x, aw(&w), 2, &pack(&[1, 4, 2])).unwrap();
        assert_eq!(probs.len(), 3, "one block per sample");
        for (sample, p) in probs.iter().enumerate() {
            let sums = p.sum_keepdim(candle_core::D::Minus1).unwrap();
            for v in sums.flatten_all().unwrap().to_vec1::<f32>().unwrap() {
                assert!((v - 1.0).abs() < 1e-5, "sample {sample}: a row sums to {v}");
            }
            // Later tokens of the sample get exactly zero probability.
            for head in p.to_vec3::<f32>().unwrap() {
                for (i, row) in head.iter().enumerate() {
                    for (j, p) in row.iter().enumerate() {
                        if j > i {
                            assert_eq!(*p, 0.0, "sample {sample} ({i}, {j})");
                        }
                    }
                }
            }
        }
        let out = causal_self_attention(&x, aw(&w), 2, &pack(&[1, 4, 2])).unwrap();
        assert!(out
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|v| v.is_finite()));
    }
}
