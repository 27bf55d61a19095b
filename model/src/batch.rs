//! A packed micro-batch: several samples concatenated into one sequence of `T` tokens, with the
//! per-token metadata the model needs.
//!
//! Conventions (the guarantees the forward relies on, each checked by [`PackedBatch::new`] or a test):
//! - `segments[t]` is the index of the sample token `t` belongs to; samples are contiguous runs.
//! - `positions[t]` is the token's position within its sample (0 at each sample's first token);
//!   it drives the rotary embedding, so a sample's result does not depend on where it is packed.
//! - Next-token targets stay within a sample: token `t` predicts token `t + 1` only if both are in
//!   the same sample; a sample's last token predicts nothing.
//! - `loss_mask[t]` marks token `t` as a **target** that carries loss (e.g. the response tokens of
//!   an SFT sample); a sample's first token is never a target. The loss is the mean over targets.
//! - Attention runs per sample: `spans[s]` is sample `s`'s `(start, len)` in the pack, so a pack
//!   of `T` tokens costs the sum of its samples' squared lengths, not `T²`, and no sample can see
//!   another. The blocked attention masks only the tiles that cross the diagonal; the plain one
//!   asks [`PackedBatch::causal_mask`] for a sample's additive `[len, len]` mask (0 where query
//!   `i` may attend to key `j <= i`, [`MASKED`] elsewhere), made then: a pack holds no `len²`
//!   tensor, which would cap a sample's length (4 GiB at 32K tokens).
//! - A **gang's piece** ([`PackedBatch::pack_with_pieces`], sequence splitting) is packed last (a
//!   context-parallel round's several pieces, in gang order, after the whole samples): one
//!   member's tokens of a sample split over a gang, in the member's order ([`GangLayout`]), at
//!   their positions in the whole sample; each predicts the sample's next token (its target is
//!   taken from the whole sample, so a chunk's last token predicts the first of the next chunk,
//!   held by another member). Its attention runs over the gang's ring ([`super::attention::ring`]); summed
//!   over the gang's members, the losses and gradients are the unsplit sample's.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::gang::{GangLayout, GangLink};

use super::config::{Implementations, ModelConfig};
use super::error::{Error, Result};
use super::ops::rope_cos_sin;

/// The additive mask value of a forbidden (query, key) pair: finite, so no `inf - inf` can make a
/// NaN, and low enough that `exp` underflows to exactly 0 in fp32.
pub const MASKED: f32 = -1e9;

/// One sample of a pack: its tokens and which of them carry loss.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Token ids, each `< vocab_size`.
    pub tokens: Vec<u32>,
    /// Per token: whether it is a target that carries loss (same length as `tokens`).
    pub loss_mask: Vec<bool>,
}

impl Sample {
    /// A sample whose every token (but the first, which nothing predicts) carries loss.
    pub fn all_loss(tokens: Vec<u32>) -> Self {
        let loss_mask = vec![true; tokens.len()];
        Sample { tokens, loss_mask }
    }
}

impl From<&odc_text::Sample> for Sample {
    /// A tokenized text sample (loss on its response).
    fn from(s: &odc_text::Sample) -> Self {
        Sample {
            tokens: s.tokens().to_vec(),
            loss_mask: s.loss_mask().to_vec(),
        }
    }
}

/// A packed micro-batch on a device (see the module docs for the conventions).
#[derive(Debug, Clone)]
pub struct PackedBatch {
    /// `[T]` u32 token ids.
    pub tokens: Tensor,
    /// `[T]` u32 position within the sample.
    pub positions: Tensor,
    /// `[T]` u32 sample index.
    pub segments: Tensor,
    /// `[T]` u32: the token each position predicts (0 where it predicts nothing).
    pub targets: Tensor,
    /// `[T]` f32: 1 where position `t`'s prediction counts in the loss, else 0.
    pub target_weights: Tensor,
    /// Number of predictions that count (the loss's denominator).
    pub loss_tokens: usize,
    /// Each sample's `(start, len)` in the pack, in order.
    pub spans: Vec<(usize, usize)>,
    /// The attention and head implementations (the lean ones unless set).
    pub implementations: Implementations,
    /// `[T, head_dim / 2]` rotary cosines at each token's position.
    pub rope_cos: Tensor,
    /// `[T, head_dim / 2]` rotary sines at each token's position.
    pub rope_sin: Tensor,
    /// Gangs' pieces, packed last in this order ([`PackedBatch::pack_with_pieces`]): the last
    /// `pieces.len()` spans.
    pub pieces: Vec<GangPiece>,
    len: usize,
}

/// One member's piece of a sample split over a gang: where its tokens sit, its end of the gang's
/// links, and the count of its attention calls (each call's ring messages carry its number).
#[derive(Debug, Clone)]
pub struct GangPiece {
    pub layout: GangLayout,
    pub link: Arc<dyn GangLink>,
    calls: Arc<AtomicU32>,
}

impl GangPiece {
    pub fn new(layout: GangLayout, link: Arc<dyn GangLink>) -> Self {
        GangPiece {
            layout,
            link,
            calls: Arc::new(AtomicU32::new(0)),
        }
    }

    /// The number of the next attention call (0, 1, …).
    pub fn next_call(&self) -> u32 {
        self.calls.fetch_add(1, Ordering::Relaxed)
    }
}

impl PackedBatch {
    /// Sample `s`'s `[len, len]` f32 additive causal mask, made now (the plain attention's).
    pub fn causal_mask(&self, s: usize) -> Result<Tensor> {
        let (_, len) = self.spans.get(s).ok_or_else(|| {
            Error::Batch(format!("no sample {s} in a pack of {}", self.spans.len()))
        })?;
        causal_mask(*len, self.tokens.device())
    }

    /// Packs `samples` in order (positions restart at 0 for each).
    pub fn pack(config: &ModelConfig, samples: &[Sample], device: &Device) -> Result<Self> {
        let c = Columns::of(samples)?;
        Self::new(
            config,
            &c.tokens,
            &c.positions,
            &c.segments,
            &c.loss_mask,
            device,
        )
    }

    /// Packs `samples` in order, then `piece`'s tokens of the split sample `whole` (see the
    /// module docs): what one member of a gang trains on.
    pub fn pack_with_piece(
        config: &ModelConfig,
        samples: &[Sample],
        whole: &Sample,
        piece: GangPiece,
        device: &Device,
    ) -> Result<Self> {
        Self::pack_with_pieces(config, samples, vec![(whole, piece)], device)
    }

    /// Packs `samples` in order, then each piece's tokens of its split sample, in order: what one
    /// member of one or more gangs trains on (a context-parallel round holds several).
    pub fn pack_with_pieces(
        config: &ModelConfig,
        samples: &[Sample],
        pieces: Vec<(&Sample, GangPiece)>,
        device: &Device,
    ) -> Result<Self> {
        config.validate()?;
        let mut c = Columns::of(samples)?;
        let (mut targets, mut weights) = next_token_targets(&c.tokens, &c.segments, &c.loss_mask);
        for (n, (whole, piece)) in pieces.iter().enumerate() {
            let segment = (samples.len() + n) as u32;
            append_piece(
                config,
                &mut c,
                &mut targets,
                &mut weights,
                whole,
                piece,
                segment,
            )?;
        }
        let mut batch = Self::from_columns(
            config,
            &c.tokens,
            &c.positions,
            &c.segments,
            targets,
            weights,
            device,
        )?;
        batch.pieces = pieces.into_iter().map(|(_, p)| p).collect();
        Ok(batch)
    }

    /// A packed batch from per-token columns (all of length `T > 0`).
    pub fn new(
        config: &ModelConfig,
        tokens: &[u32],
        positions: &[u32],
        segments: &[u32],
        loss_mask: &[bool],
        device: &Device,
    ) -> Result<Self> {
        config.validate()?;
        let t = tokens.len();
        if t == 0 {
            return Err(Error::Batch("no tokens".into()));
        }
        if positions.len() != t || segments.len() != t || loss_mask.len() != t {
            return Err(Error::Batch(format!(
                "{t} tokens, {} positions, {} segments, {} loss-mask entries",
                positions.len(),
                segments.len(),
                loss_mask.len()
            )));
        }
        let (targets, weights) = next_token_targets(tokens, segments, loss_mask);
        Self::from_columns(
            config, tokens, positions, segments, targets, weights, device,
        )
    }

    /// The batch of columns of equal length and their targets (checked here: tokens in the
    /// vocabulary, positions within `max_seq_len`, samples contiguous).
    fn from_columns(
        config: &ModelConfig,
        tokens: &[u32],
        positions: &[u32],
        segments: &[u32],
        targets: Vec<u32>,
        weights: Vec<f32>,
        device: &Device,
    ) -> Result<Self> {
        let t = tokens.len();
        if t == 0 {
            return Err(Error::Batch("no tokens".into()));
        }
        if let Some(i) = tokens.iter().position(|&x| x as usize >= config.vocab_size) {
            return Err(Error::Batch(format!(
                "token {i} is {} but vocab_size is {}",
                tokens[i], config.vocab_size
            )));
        }
        if let Some(i) = positions
            .iter()
            .position(|&p| p as usize >= config.max_seq_len)
        {
            return Err(Error::Batch(format!(
                "position {} at token {i} is past max_seq_len {}",
                positions[i], config.max_seq_len
            )));
        }
        let loss_tokens = weights.iter().filter(|w| **w > 0.0).count();
        let mut spans: Vec<(usize, usize)> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (i, &segment) in segments.iter().enumerate() {
            if i > 0 && segments[i - 1] == segment {
                if let Some(last) = spans.last_mut() {
                    last.1 += 1;
                }
                continue;
            }
            if !seen.insert(segment) {
                return Err(Error::Batch(format!(
                    "sample {segment} is not contiguous (it resumes at token {i})"
                )));
            }
            spans.push((i, 1));
        }
        let positions = Tensor::from_slice(positions, t, device)?;
        let segments = Tensor::from_slice(segments, t, device)?;
        let (rope_cos, rope_sin) = rope_cos_sin(&positions, &config.rope_inv_freq())?;
        Ok(PackedBatch {
            tokens: Tensor::from_slice(tokens, t, device)?,
            spans,
            positions,
            segments,
            targets: Tensor::from_vec(targets, t, device)?,
            target_weights: Tensor::from_vec(weights, t, device)?,
            loss_tokens,
            implementations: Implementations::default(),
            rope_cos,
            rope_sin,
            pieces: Vec::new(),
            len: t,
        })
    }

    /// `T`, the packed length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a pack has at least one token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A pack's per-token columns, before they go to the device.
#[derive(Debug, Default)]
struct Columns {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    segments: Vec<u32>,
    loss_mask: Vec<bool>,
}

impl Columns {
    /// `samples` in order, positions restarting at 0 for each.
    fn of(samples: &[Sample]) -> Result<Self> {
        let mut c = Columns::default();
        for (s, sample) in samples.iter().enumerate() {
            if sample.loss_mask.len() != sample.tokens.len() {
                return Err(Error::Batch(format!(
                    "sample {s}: {} tokens but a loss mask of {}",
                    sample.tokens.len(),
                    sample.loss_mask.len()
                )));
            }
            c.tokens.extend_from_slice(&sample.tokens);
            c.loss_mask.extend_from_slice(&sample.loss_mask);
            c.positions.extend(0..sample.tokens.len() as u32);
            c.segments
                .extend(std::iter::repeat_n(s as u32, sample.tokens.len()));
        }
        Ok(c)
    }
}

/// Per token: the next token of its sample and whether that prediction carries loss (see the
/// module docs).
fn next_token_targets(
    tokens: &[u32],
    segments: &[u32],
    loss_mask: &[bool],
) -> (Vec<u32>, Vec<f32>) {
    let t = tokens.len();
    let mut targets = vec![0u32; t];
    let mut weights = vec![0f32; t];
    for i in 0..t.saturating_sub(1) {
        if segments[i + 1] == segments[i] {
            targets[i] = tokens[i + 1];
            weights[i] = if loss_mask[i + 1] { 1.0 } else { 0.0 };
        }
    }
    (targets, weights)
}

/// The causal mask of one sample of `len` tokens: `[len, len]` f32, 0 where `j <= i`, [`MASKED`]
/// elsewhere. Every row allows its diagonal. Built on `device` from two index vectors (a 4K-token
/// sample's mask is 64 MiB, which a GPU should not receive from the host).
pub fn causal_mask(len: usize, device: &Device) -> Result<Tensor> {
    let n = u32::try_from(len).map_err(|_| Error::Batch(format!("a sample of {len} tokens")))?;
    let query = Tensor::arange(0u32, n, device)?.reshape((len, 1))?;
    let key = Tensor::arange(0u32, n, device)?.reshape((1, len))?;
    let allowed = key.broadcast_le(&query)?;
    let zeros = Tensor::zeros((len, len), DType::F32, device)?;
    let masked = Tensor::full(MASKED, (len, len), device)?;
    Ok(allowed.where_cond(&zeros, &masked)?)
}

/// Appends `piece`'s tokens of the split sample `whole` to the columns as sample `segment`, each
/// with the whole sample's next token as its target (see the module docs).
fn append_piece(
    config: &ModelConfig,
    c: &mut Columns,
    targets: &mut Vec<u32>,
    weights: &mut Vec<f32>,
    whole: &Sample,
    piece: &GangPiece,
    segment: u32,
) -> Result<()> {
    let t_whole = whole.tokens.len();
    if whole.loss_mask.len() != t_whole {
        return Err(Error::Batch(format!(
            "the split sample: {t_whole} tokens but a loss mask of {}",
            whole.loss_mask.len()
        )));
    }
    // Every token of the sample: a member's targets come from other members' chunks too.
    if let Some(i) = whole
        .tokens
        .iter()
        .position(|&x| x as usize >= config.vocab_size)
    {
        return Err(Error::Batch(format!(
            "token {i} of the split sample is {} but vocab_size is {}",
            whole.tokens[i], config.vocab_size
        )));
    }
    let expected: usize = (0..piece.layout.members())
        .map(|m| piece.layout.len_of(m))
        .sum();
    if expected != t_whole {
        return Err(Error::Batch(format!(
            "the split sample has {t_whole} tokens, its gang's layout cuts {expected}"
        )));
    }
    for p in piece.layout.positions() {
        c.tokens.push(whole.tokens[p]);
        c.positions.push(p as u32);
        c.segments.push(segment);
        let next = p + 1;
        targets.push(if next < t_whole {
            whole.tokens[next]
        } else {
            0
        });
        weights.push(if next < t_whole && whole.loss_mask[next] {
            1.0
        } else {
            0.0
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ModelConfig {
        ModelConfig {
            vocab_size: 16,
            d_model: 8,
            n_heads: 2,
            max_seq_len: 8,
            ..ModelConfig::tiny()
        }
    }

    #[test]
    fn spans_are_the_samples_and_masks_are_causal() {
        let c = config();
        let b = PackedBatch::new(
            &c,
            &[1, 2, 3, 4, 5],
            &[0, 1, 0, 1, 2],
            &[0, 0, 1, 1, 1],
            &[true; 5],
            &Device::Cpu,
        )
        .unwrap();
        assert_eq!(b.spans, vec![(0, 2), (2, 3)]);
        let mask = b.causal_mask(1).unwrap().to_vec2::<f32>().unwrap();
        for (i, row) in mask.iter().enumerate() {
            for (j, &m) in row.iter().enumerate() {
                assert_eq!(m, if j <= i { 0.0 } else { MASKED }, "({i}, {j})");
            }
        }
        // A sample that resumes after another is not a pack.
        let split = PackedBatch::new(
            &c,
            &[1, 2, 3],
            &[0, 0, 1],
            &[0, 1, 0],
            &[true; 3],
            &Device::Cpu,
        );
        assert!(split.unwrap_err().to_string().contains("not contiguous"));
    }

    #[test]
    fn targets_stay_within_samples_and_positions_reset() {
        let samples = [
            Sample {
                tokens: vec![1, 2, 3],
                loss_mask: vec![true, true, false],
            },
            Sample::all_loss(vec![4, 5]),
        ];
        let b = PackedBatch::pack(&config(), &samples, &Device::Cpu).unwrap();
        assert_eq!(b.positions.to_vec1::<u32>().unwrap(), vec![0, 1, 2, 0, 1]);
        assert_eq!(b.segments.to_vec1::<u32>().unwrap(), vec![0, 0, 0, 1, 1]);
        assert_eq!(b.targets.to_vec1::<u32>().unwrap(), vec![2, 3, 0, 5, 0]);
        // 1 -> 2 counts, 2 -> 3 is masked, 3 predicts nothing (next sample), 4 -> 5 counts.
        assert_eq!(
            b.target_weights.to_vec1::<f32>().unwrap(),
            vec![1., 0., 0., 1., 0.]
        );
        assert_eq!(b.loss_tokens, 2);
    }

    #[test]
    fn malformed_batches_are_rejected() {
        let c = config();
        let cpu = &Device::Cpu;
        assert!(PackedBatch::new(&c, &[], &[], &[], &[], cpu).is_err());
        assert!(PackedBatch::new(&c, &[1, 2], &[0], &[0, 0], &[true, true], cpu).is_err());
        assert!(PackedBatch::new(&c, &[16], &[0], &[0], &[true], cpu).is_err());
        assert!(PackedBatch::new(&c, &[1], &[8], &[0], &[true], cpu).is_err());
        let bad_mask = Sample {
            tokens: vec![1, 2],
            loss_mask: vec![true],
        };
        assert!(PackedBatch::pack(&c, &[bad_mask], cpu).is_err());
    }
}
