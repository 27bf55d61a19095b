//! The key–value cache and the forward that feeds tokens through it.
//!
//! Guarantees (tested in `super::tests`):
//! 1. a row's logits are the training forward's of the same sequence, whether its tokens are fed
//!    at once, one at a time, or beside other rows (within 1e-4);
//! 2. **left padding is invisible**: a batch of prompts of different lengths ([`prefill`]) ends
//!    every prompt on the same column; a row's padding is masked from every query and its
//!    positions (rotary angles) start at 0 after it, so each row's logits are its own alone;
//! 3. the cache holds the columns used (the whole decode's, reserved at once by the batched
//!    decoder, or doubled as they grow; never `max_seq_len` up front), and a row's positions never
//!    pass `max_seq_len`.

use candle_core::{DType, Device, Tensor};

use super::weights::Weights;
use crate::attention::attend;
use crate::batch::MASKED;
use crate::block::{block_forward_with, BlockWeights};
use crate::config::MlpImpl;
use crate::error::{Error, Result};
use crate::ops::{fused, rms_norm, rope_cos_sin};
use crate::transformer::{head_tensors, unit_count};

/// The token that fills a row's left padding (any id in the vocabulary: it is never attended to).
const PAD: u32 = 0;

/// Keys and values of every block for the tokens fed so far: `rows` sequences, fed column by
/// column (one sequence, a group of responses to one prompt, or prompts of different lengths
/// left-padded to end on the same column). Each block's keys and values live in buffers of
/// `[rows, kv_heads, capacity, head_dim]` (capacity: the columns [reserved](KvCache::reserve),
/// or the columns fed so far rounded up to a power of two, at least 64; grown by copying when a
/// feed passes it); a feed writes its columns in
/// place and attention reads the filled prefix as a view, so a token costs no copy of the cache
/// (not `Clone`: a copy would share the buffers).
#[derive(Debug, Default)]
pub struct KvCache {
    pub(super) layers: Vec<(Tensor, Tensor)>,
    /// Columns fed so far (the same for every row).
    len: usize,
    rows: usize,
    /// Per row, the columns of left padding before its first token (empty: none).
    pads: Vec<usize>,
    /// Columns the buffers are made for when first needed ([`KvCache::reserve`]; 0: doubled
    /// as they fill).
    reserved: usize,
}

impl KvCache {
    /// Columns fed so far; row `r` holds `len() - padding(r)` tokens of its own.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Makes the buffers, when first needed, `columns` wide (the longest prompt and the most
    /// tokens a response may add: the batch's whole decode) instead of doubling them as they fill,
    /// each doubling a copy of the cache. Past `columns` they double again.
    pub fn reserve(&mut self, columns: usize) {
        self.reserved = columns;
    }

    /// Sequences in the cache (0 before the first feed).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes of device (or host) memory the cache's buffers hold: 2 × layers × rows × KV heads ×
    /// capacity × head_dim × 4 in fp32, × 2 in bf16 ([`Weights::in_precision`]).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum()
    }

    /// Row `row`'s left padding in columns (0 for rows fed alike, and for a row out of range).
    pub fn padding(&self, row: usize) -> usize {
        self.pads.get(row).copied().unwrap_or(0)
    }

    /// Keeps the rows `index` of the current ones, in that order and as often as named: a
    /// prompt repeated for its group, or the responses still going (nothing is copied when
    /// `index` is every row in order).
    pub fn keep_rows(&mut self, index: &[usize]) -> Result<()> {
        if index.is_empty() || index.iter().any(|&r| r >= self.rows) {
            return Err(Error::Batch(format!(
                "rows {index:?} to keep are not a non-empty list of the cache's {}",
                self.rows
            )));
        }
        if index.iter().copied().eq(0..self.rows) {
            return Ok(());
        }
        let device = match self.layers.first() {
            Some((k, _)) => k.device().clone(),
            None => return Err(Error::Batch("an empty cache has no rows to keep".into())),
        };
        let picks: Vec<u32> = index.iter().map(|&r| r as u32).collect();
        let picks = Tensor::from_vec(picks, index.len(), &device)?;
        for (k, v) in self.layers.iter_mut() {
            (*k, *v) = (k.index_select(&picks, 0)?, v.index_select(&picks, 0)?);
        }
        if !self.pads.is_empty() {
            self.pads = index.iter().map(|&r| self.pads[r]).collect();
        }
        self.rows = index.len();
        Ok(())
    }
}

/// Feeds `tokens` after those in `cache` and returns their logits, `[tokens.len(), vocab]`.
pub fn forward_cached(w: &Weights, cache: &mut KvCache, tokens: &[u32]) -> Result<Tensor> {
    forward_cached_rows(w, cache, 1, tokens)
}

/// Feeds `rows` sequences of `tokens.len() / rows` tokens each (row-major) after those in `cache`,
/// one column per token, and returns their logits, `[tokens.len(), vocab]` (row-major). A cache
/// that already holds tokens must hold `rows` rows.
pub fn forward_cached_rows(
    w: &Weights,
    cache: &mut KvCache,
    rows: usize,
    tokens: &[u32],
) -> Result<Tensor> {
    head_logits(w, &feed(w, cache, rows, tokens, &[])?)
}

/// Feeds `prompts` (of any lengths, at least one token each) into the empty `cache` as one batch,
/// each left-padded to end on the longest one's last column, and returns each prompt's last
/// logits, `[prompts.len(), vocab]`: what the first generated token of each is drawn from.
pub fn prefill(w: &Weights, cache: &mut KvCache, prompts: &[&[u32]]) -> Result<Tensor> {
    let (hidden, width) = feed_padded(w, cache, prompts)?;
    let d = hidden.dim(1)?;
    let last = hidden
        .reshape((prompts.len(), width, d))?
        .narrow(1, width - 1, 1)?
        .reshape((prompts.len(), d))?;
    head_logits(w, &last)
}

/// `sequences` left-padded to the longest and fed into the empty `cache`: the hidden states
/// `[rows · width, d_model]` and the width.
fn feed_padded(w: &Weights, cache: &mut KvCache, sequences: &[&[u32]]) -> Result<(Tensor, usize)> {
    if !cache.is_empty() {
        return Err(Error::Batch(
            "prompts are prefilled into an empty cache".into(),
        ));
    }
    if let Some(i) = sequences.iter().position(|p| p.is_empty()) {
        return Err(Error::Batch(format!("prompt {i} of the batch is empty")));
    }
    let width = sequences.iter().map(|p| p.len()).max().unwrap_or(0);
    let pads: Vec<usize> = sequences.iter().map(|p| width - p.len()).collect();
    let tokens: Vec<u32> = sequences
        .iter()
        .flat_map(|p| std::iter::repeat_n(PAD, width - p.len()).chain(p.iter().copied()))
        .collect();
    Ok((feed(w, cache, sequences.len(), &tokens, &pads)?, width))
}

/// The final norm and the head: `[n, d_model]` → logits `[n, vocab]`.
fn head_logits(w: &Weights, hidden: &Tensor) -> Result<Tensor> {
    let c = &w.config;
    let head = head_tensors(c, &w.units[unit_count(c) - 1], &w.units[0][0]);
    let logits = rms_norm(hidden, &head[0], c.rms_eps)?.matmul(&head[1].t()?)?;
    Ok(logits.to_dtype(DType::F32)?)
}

/// Feeds `rows × n` tokens (row-major) after the cache's columns and returns the last block's
/// hidden states, `[rows · n, d_model]`. `pads` (only into an empty cache; empty: none) gives each
/// row's left padding.
fn feed(
    w: &Weights,
    cache: &mut KvCache,
    rows: usize,
    tokens: &[u32],
    pads: &[usize],
) -> Result<Tensor> {
    let c = &w.config;
    if tokens.is_empty() || rows == 0 || tokens.len() % rows != 0 {
        return Err(Error::Batch(format!(
            "{} tokens do not make {rows} non-empty rows",
            tokens.len()
        )));
    }
    if !cache.is_empty() && cache.rows != rows {
        return Err(Error::Batch(format!(
            "{rows} rows fed to a cache of {}",
            cache.rows
        )));
    }
    if cache.is_empty() {
        cache.pads = pads.to_vec();
    }
    if !cache.pads.is_empty() && cache.pads.len() != rows {
        return Err(Error::Batch(format!(
            "{} paddings for {rows} rows",
            cache.pads.len()
        )));
    }
    let n = tokens.len() / rows;
    let start = cache.len;
    let total = start + n;
    let least_pad = cache.pads.iter().copied().min().unwrap_or(0);
    if total - least_pad > c.max_seq_len {
        return Err(Error::Batch(format!(
            "{} positions are past max_seq_len {}",
            total - least_pad,
            c.max_seq_len
        )));
    }
    if let Some(t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
        return Err(Error::Batch(format!(
            "token {t} is past vocab_size {}",
            c.vocab_size
        )));
    }
    let device = w.units[0][0].device();
    grow(w, cache, rows, start, total)?;
    // candle's CPU matmul reads strided views; other backends want them contiguous.
    let view =
        |t: Tensor| -> Result<Tensor> { Ok(if device.is_cpu() { t } else { t.contiguous()? }) };
    let ids = Tensor::from_slice(tokens, tokens.len(), device)?;
    let (cos, sin, mask) = angles_and_mask(w, &cache.pads, rows, start, n)?;
    // Grouped-query heads without repeating the cache: each key–value head's `groups` query
    // heads become `groups × n` query rows of it (the mask repeated for each).
    let (kv_heads, groups) = (c.kv_heads(), c.n_heads / c.kv_heads());
    let mask = match mask.rank() {
        2 => mask.repeat((groups, 1))?,
        _ => mask.repeat((1, 1, groups, 1))?,
    };

    // With the fused kernels: one new token per row reads the cache's buffers in place on CUDA
    // (each row's padding as i64 offsets), where the mask path copies the filled prefix of every
    // layer's keys and values; the prompts' prefill into an empty cache is one launch of
    // training's varlen attention, each row's padding and tokens a sample of their own.
    let fused_here = fused::runs_on(device) && c.head_dim() <= fused::MAX_ATTENTION_HEAD_DIM;
    let prefill_offsets = if fused_here && start == 0 && n > 1 {
        Some(prefill_offsets(&cache.pads, rows, n, device)?)
    } else {
        None
    };
    let fused_pads = if n == 1 && fused_here {
        let pads: Vec<i64> = (0..rows).map(|r| cache.padding(r) as i64).collect();
        Some(Tensor::from_vec(pads, rows, device)?)
    } else {
        None
    };

    // Hidden states stay `[rows * n, d_model]`; only attention sees `[rows, heads, n, head_dim]`.
    let mut x = w.units[0][0].index_select(&ids, 0)?;
    for layer in 0..c.n_layers {
        let params = w.block_tensors(layer);
        let block = BlockWeights::new(c, &params)?;
        let (k_buf, v_buf) = &cache.layers[layer];
        // The block's attention: the new keys and values go into the cache in place, and the
        // queries read the filled prefix.
        let mut cached = |q: &Tensor, k_new: &Tensor, v_new: &Tensor| -> Result<Tensor> {
            k_buf.slice_set(k_new, 2, start)?;
            v_buf.slice_set(v_new, 2, start)?;
            if let Some(cu) = &prefill_offsets {
                let q = q.to_dtype(k_buf.dtype())?;
                return Ok(prefill_attention(&q, k_new, v_new, cu)?);
            }
            if let Some(pads) = &fused_pads {
                let q = q.to_dtype(k_buf.dtype())?;
                let out = fused::decode_attention(&q, k_buf, v_buf, pads, total)?;
                return Ok(out);
            }
            let k = view(k_buf.narrow(2, 0, total)?)?;
            let v = view(v_buf.narrow(2, 0, total)?)?;
            let (_, heads, _, hd) = q.dims4()?;
            let q = q.reshape((rows, kv_heads, groups * n, hd))?;
            Ok(attend(&q, &k, &v, &mask)?.reshape((rows, heads, n, hd))?)
        };
        // Decoding keeps no graph: candle's ops (the chunked MLP would copy gate and up per call).
        let mlp = MlpImpl::Full;
        x = block_forward_with(c, &block, &x, rows, (&cos, &sin), &mut cached, mlp)?;
    }
    cache.len = total;
    cache.rows = rows;
    Ok(x)
}

/// The prefill's samples for [`prefill_attention`]: each row's padding (if any) and then its
/// tokens, as offsets into the `rows × n` token-major rows (i64 `[samples + 1]`).
fn prefill_offsets(pads: &[usize], rows: usize, n: usize, device: &Device) -> Result<Tensor> {
    let mut cu = vec![0i64];
    for r in 0..rows {
        let pad = pads.get(r).copied().unwrap_or(0).min(n);
        if pad > 0 {
            cu.push((r * n + pad) as i64);
        }
        cu.push(((r + 1) * n) as i64);
    }
    let len = cu.len();
    Ok(Tensor::from_vec(cu, len, device)?)
}

/// The prompts' causal attention in one launch of training's varlen kernel: `q: [rows, H, n,
/// hd]`, `k, v: [rows, KV, n, hd]` (an empty cache's first `n` columns), every row's padding a
/// sample of its own (its output is never read: no query of the row's tokens sees it).
fn prefill_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu: &Tensor,
) -> candle_core::Result<Tensor> {
    let (rows, heads, n, hd) = q.dims4()?;
    let tokens = |x: &Tensor| -> candle_core::Result<Tensor> {
        let (rows, h, n, hd) = x.dims4()?;
        x.transpose(1, 2)?.contiguous()?.reshape((rows * n, h, hd))
    };
    let dtype = q.dtype();
    let (kt, vt) = (tokens(&k.to_dtype(dtype)?)?, tokens(&v.to_dtype(dtype)?)?);
    let scale = 1.0 / (hd as f32).sqrt();
    let (out, _) = fused::attention(&tokens(q)?, &kt, &vt, fused::Varlen::packed(cu), scale)?;
    out.reshape((rows, n, heads, hd))?
        .transpose(1, 2)?
        .contiguous()
}

/// Grows the cache's buffers to hold `total` columns (to the columns reserved, else doubling; at
/// least 64), keeping the `start` columns it holds.
fn grow(w: &Weights, cache: &mut KvCache, rows: usize, start: usize, total: usize) -> Result<()> {
    let c = &w.config;
    let capacity = cache
        .layers
        .first()
        .map_or(0, |(k, _)| k.dim(2).unwrap_or(0));
    if total <= capacity {
        return Ok(());
    }
    // A model whose config allows 128K positions does not allocate them for a 300-token answer.
    let grown = match cache.reserved >= total {
        true => cache.reserved,
        false => total.next_power_of_two().max(64),
    };
    let grown = grown.min(c.max_seq_len.max(total));
    let device = w.units[0][0].device();
    let buffer = || Tensor::zeros((rows, c.kv_heads(), grown, c.head_dim()), w.dtype(), device);
    let mut layers = Vec::with_capacity(c.n_layers);
    for layer in 0..c.n_layers {
        let (k, v) = (buffer()?, buffer()?);
        if let (Some((old_k, old_v)), true) = (cache.layers.get(layer), start > 0) {
            k.slice_set(&old_k.narrow(2, 0, start)?.contiguous()?, 2, 0)?;
            v.slice_set(&old_v.narrow(2, 0, start)?.contiguous()?, 2, 0)?;
        }
        layers.push((k, v));
    }
    cache.layers = layers;
    Ok(())
}

/// The rotary angles and the attention mask of `n` new columns after `start` (for one query head
/// of each key–value head; the caller repeats it for the group): shared by every
/// row (`cos, sin: [n, head_dim / 2]`, mask `[n, start + n]`) when no row is padded, else per row
/// (`[rows, 1, n, head_dim / 2]` and `[rows, 1, n, start + n]`): a row's positions count from its
/// first token, and its padding columns are masked from every query (a padding column's own query
/// sees nothing: its output is never read).
fn angles_and_mask(
    w: &Weights,
    pads: &[usize],
    rows: usize,
    start: usize,
    n: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let device = w.units[0][0].device();
    let inv_freq = w.config.rope_inv_freq();
    let total = start + n;
    if pads.iter().all(|&p| p == 0) {
        let positions: Vec<u32> = (start as u32..total as u32).collect();
        let (cos, sin) = rope_cos_sin(&Tensor::from_vec(positions, n, device)?, &inv_freq)?;
        // New token i (column start + i) sees columns 0..=start + i.
        let mask: Vec<f32> = (0..n)
            .flat_map(|i| (0..total).map(move |j| if j <= start + i { 0.0 } else { MASKED }))
            .collect();
        return Ok((cos, sin, Tensor::from_vec(mask, (n, total), device)?));
    }
    let positions: Vec<u32> = pads
        .iter()
        .flat_map(|&pad| (start..total).map(move |col| col.saturating_sub(pad) as u32))
        .collect();
    let (cos, sin) = rope_cos_sin(&Tensor::from_vec(positions, rows * n, device)?, &inv_freq)?;
    let half = inv_freq.len();
    let (cos, sin) = (
        cos.reshape((rows, 1, n, half))?,
        sin.reshape((rows, 1, n, half))?,
    );
    let mask: Vec<f32> = pads
        .iter()
        .flat_map(|&pad| {
            (0..n).flat_map(move |i| {
                (0..total).map(move |j| {
                    if pad <= j && j <= start + i {
                        0.0
                    } else {
                        MASKED
                    }
                })
            })
        })
        .collect();
    Ok((
        cos,
        sin,
        Tensor::from_vec(mask, (rows, 1, n, total), device)?,
    ))
}
