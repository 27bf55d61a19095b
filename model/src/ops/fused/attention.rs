//! The attention kernels in the model: training's causal attention over packed samples
//! (forward and backward) and decoding's one query per row over the KV cache.

use candle_core::{DType, Error, Result, Tensor};
use odc_kernels::{ATTENTION, FLASH};

use super::buf::{Arg, Buf};
use super::launch::Backend;
use super::suffix;

/// The head widths the attention kernel takes (a warp holds a row in 4 registers per lane).
pub const MAX_ATTENTION_HEAD_DIM: usize = 128;

/// Whether FlashAttention-2's tensor-core kernels (`flash.cu`) take `q: [T, H, hd]`: bf16 at the
/// head widths their tiles take.
fn flash_applies(q: &Tensor) -> bool {
    q.dtype() == DType::BF16 && matches!(q.dim(2), Ok(64 | 96 | 128))
}

/// Threads of a `flash.cu` launch over `tokens` rows (or keys) of `heads` heads: a block of
/// `launch`'s 256 threads (8 warps of 16 rows) per 128 rows and head.
fn flash_threads(tokens: usize, heads: usize) -> usize {
    tokens.div_ceil(128) * heads * 256
}

/// Which keys each query sees: sample `s`'s queries are rows `cu_q[s] .. cu_q[s + 1]`, its keys
/// rows `cu_k[s] .. cu_k[s + 1]` (both i64 `[samples + 1]`, from 0; the same tensor for packed
/// self-attention); under `causal` a query sees only the keys at or before it, the sample's ends
/// aligned (`kernels/src/common.cuh`). A sequence's chunk of queries against the same chunk of
/// keys is causal, against an earlier chunk not: ring attention's two cases.
#[derive(Debug, Clone, Copy)]
pub struct Varlen<'a> {
    pub cu_q: &'a Tensor,
    pub cu_k: &'a Tensor,
    pub causal: bool,
}

impl<'a> Varlen<'a> {
    /// Causal self-attention over samples packed at offsets `cu`.
    pub fn packed(cu: &'a Tensor) -> Self {
        Varlen {
            cu_q: cu,
            cu_k: cu,
            causal: true,
        }
    }

    fn samples(&self) -> usize {
        self.cu_q.elem_count().saturating_sub(1)
    }
}

/// What every attention kernel takes after its tensors: the samples' offsets and count, causal,
/// the heads, the head width and the scale.
struct Shared {
    cu_q: Buf,
    cu_k: Buf,
    numbers: [u64; 5],
    scale: f32,
}

impl Shared {
    fn new(kn: &Backend, varlen: Varlen<'_>, q: &Tensor, k: &Tensor, scale: f32) -> Result<Self> {
        let ((_, heads, dim), kv_heads) = (q.dims3()?, k.dim(1)?);
        let (samples, causal) = (varlen.samples(), u64::from(varlen.causal));
        Ok(Shared {
            cu_q: kn.input(varlen.cu_q)?,
            cu_k: kn.input(varlen.cu_k)?,
            numbers: [
                samples as u64,
                causal,
                heads as u64,
                kv_heads as u64,
                dim as u64,
            ],
            scale,
        })
    }

    fn args(&self) -> Vec<Arg<'_>> {
        let mut args = vec![Arg::Buffer(&self.cu_q), Arg::Buffer(&self.cu_k)];
        args.extend(self.numbers.iter().map(|&n| Arg::U64(n)));
        args.push(Arg::F32(self.scale));
        args
    }
}

/// Attention over `varlen`'s samples with grouped-query heads: token-major `q: [Tq, H, hd]`,
/// `k, v: [Tk, KV, hd]` in one dtype; `(out [Tq, H, hd]` in `q`'s dtype, `lse [Tq, H]` fp32: −inf,
/// and zeros out, for a query that sees no key), scores scaled by `scale`. In bf16 with head
/// widths 64, 96 or 128 FlashAttention-2's tiled forward on tensor cores (`flash.cu`), else the
/// plain kernel; the backward takes either's output.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    varlen: Varlen<'_>,
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    let kn = Backend::of(q)?;
    let (tokens, heads, dim) = q.dims3()?;
    let (qb, kb, vb) = (
        kn.input(q)?,
        kn.input(&k.to_dtype(q.dtype())?)?,
        kn.input(&v.to_dtype(q.dtype())?)?,
    );
    let shared = Shared::new(&kn, varlen, q, k, scale)?;
    let out = kn.output(q.dtype(), &[tokens, heads, dim])?;
    let lse = kn.output(DType::F32, &[tokens, heads])?;
    let flash = flash_applies(q);
    let n = match flash {
        true => flash_threads(tokens, heads),
        false => tokens * heads * 32,
    };
    let mut args = vec![
        Arg::Buffer(&out),
        Arg::Buffer(&lse),
        Arg::Buffer(&qb),
        Arg::Buffer(&kb),
        Arg::Buffer(&vb),
    ];
    args.extend(shared.args());
    args.push(Arg::U64(n as u64));
    match flash {
        true => kn.launch(&FLASH, "odc_flash_attention_fwd_bf16", n, &args)?,
        false => {
            let function = format!("odc_attention_fwd_{}", suffix(q.dtype()));
            kn.launch(&ATTENTION, &function, n, &args)?;
        }
    }
    Ok((kn.tensor(out)?, kn.tensor(lse)?))
}

/// [`attention`]'s gradients from its output `out`, `lse` and the output's gradient `dout`
/// (token-major as there): `dq` in `q`'s dtype, `dk` and `dv` fp32. Three launches (each row's
/// `dout · out`, then `dq` per query and `dk`, `dv` per key: `flash.cu`'s tiles where
/// [`attention`] takes them, `attention.cu`'s warps otherwise), no atomic adds: the same inputs
/// give the same bits.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    dout: &Tensor,
    lse: &Tensor,
    varlen: Varlen<'_>,
    scale: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    let kn = Backend::of(q)?;
    let (tokens, heads, dim) = q.dims3()?;
    let dtype = q.dtype();
    let (ob, db) = (
        kn.input(&out.to_dtype(dtype)?)?,
        kn.input(&dout.to_dtype(dtype)?)?,
    );
    let delta = kn.output(DType::F32, &[tokens, heads])?;
    let rows = tokens * heads * 32;
    let prep = [
        Arg::Buffer(&delta),
        Arg::Buffer(&ob),
        Arg::Buffer(&db),
        Arg::U64(dim as u64),
        Arg::U64(rows as u64),
    ];
    let function = format!("odc_attention_bwd_prep_{}", suffix(dtype));
    kn.launch(&ATTENTION, &function, rows, &prep)?;
    let delta = kn.tensor(delta)?;
    attention_backward_from(q, k, v, dout, lse, &delta, varlen, scale)
}

/// [`attention_backward`] given each row's `delta = dout · out` (fp32 `[Tq, H]`) instead of the
/// output. For one part of a split attention (ring attention) `lse` and `delta` are the whole
/// attention's (merged) rows: the gradients are then this part's share.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_from(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    lse: &Tensor,
    delta: &Tensor,
    varlen: Varlen<'_>,
    scale: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    let kn = Backend::of(q)?;
    let (tokens, heads, dim) = q.dims3()?;
    let (key_tokens, kv_heads, _) = k.dims3()?;
    let dtype = q.dtype();
    let (qb, kb, vb, db) = (
        kn.input(q)?,
        kn.input(&k.to_dtype(dtype)?)?,
        kn.input(&v.to_dtype(dtype)?)?,
        kn.input(&dout.to_dtype(dtype)?)?,
    );
    let (lb, eb) = (
        kn.input(&lse.to_dtype(DType::F32)?)?,
        kn.input(&delta.to_dtype(DType::F32)?)?,
    );
    let tail = Shared::new(&kn, varlen, q, k, scale)?;
    // The arguments both passes share after their outputs.
    let mut shared = vec![
        Arg::Buffer(&qb),
        Arg::Buffer(&kb),
        Arg::Buffer(&vb),
        Arg::Buffer(&db),
        Arg::Buffer(&lb),
        Arg::Buffer(&eb),
    ];
    shared.extend(tail.args());
    // The dq and dk/dv passes: FlashAttention-2's tiles where they apply, else the plain ones.
    let (source, prefix, queries, keys) = match flash_applies(q) {
        true => (
            &FLASH,
            "odc_flash_attention_bwd",
            flash_threads(tokens, heads),
            flash_threads(key_tokens, kv_heads),
        ),
        false => (
            &ATTENTION,
            "odc_attention_bwd",
            tokens * heads * 32,
            key_tokens * kv_heads * 32,
        ),
    };
    let dq = kn.output(dtype, &[tokens, heads, dim])?;
    let mut args = vec![Arg::Buffer(&dq)];
    args.extend_from_slice(&shared);
    args.push(Arg::U64(queries as u64));
    let function = format!("{prefix}_dq_{}", suffix(dtype));
    kn.launch(source, &function, queries, &args)?;
    let dk = kn.output(DType::F32, &[key_tokens, kv_heads, dim])?;
    let dv = kn.output(DType::F32, &[key_tokens, kv_heads, dim])?;
    let mut args = vec![Arg::Buffer(&dk), Arg::Buffer(&dv)];
    args.extend_from_slice(&shared);
    args.push(Arg::U64(keys as u64));
    let function = format!("{prefix}_dkdv_{}", suffix(dtype));
    kn.launch(source, &function, keys, &args)?;
    Ok((kn.tensor(dq)?, kn.tensor(dk)?, kn.tensor(dv)?))
}

/// Decoding's attention: each row's one new query `q: [rows, H, 1, hd]` against columns
/// `pads[r] .. len` of the cache's buffers `k, v: [rows, KV, capacity, hd]` (read in place on
/// CUDA, no copy of the filled prefix), i64 `pads: [rows]`; `[rows, H, 1, hd]` in `q`'s dtype.
pub fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pads: &Tensor,
    len: usize,
) -> Result<Tensor> {
    let kn = Backend::of(q)?;
    let (rows, heads, one, dim) = q.dims4()?;
    let (_, kv_heads, capacity, _) = k.dims4()?;
    if one != 1 || len > capacity || v.dims() != k.dims() || k.dtype() != q.dtype() {
        return Err(Error::Msg(format!(
            "fused decoding attention: q {:?}, k {:?}, v {:?}, {len} columns",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let (qb, kb, vb, pb) = (kn.input(q)?, kn.input(k)?, kn.input(v)?, kn.input(pads)?);
    let out = kn.output(q.dtype(), &[rows, heads, 1, dim])?;
    let n = rows * heads * 32;
    let args = [
        Arg::Buffer(&out),
        Arg::Buffer(&qb),
        Arg::Buffer(&kb),
        Arg::Buffer(&vb),
        Arg::Buffer(&pb),
        Arg::U64(heads as u64),
        Arg::U64(kv_heads as u64),
        Arg::U64(capacity as u64),
        Arg::U64(len as u64),
        Arg::U64(dim as u64),
        Arg::F32(1.0 / (dim as f32).sqrt()),
        Arg::U64(n as u64),
    ];
    let function = format!("odc_decode_attention_{}", suffix(q.dtype()));
    kn.launch(&ATTENTION, &function, n, &args)?;
    kn.tensor(out)
}
