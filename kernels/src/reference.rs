//! The kernels' math on the CPU, in f64, on fp32 inputs: what each kernel is checked against.
//! The model's own ops (`odc::model::ops`: `rms_norm`, `rope`, the MLP's SwiGLU) compute the same
//! functions; the root crate's tests check these references against them.

/// RMSNorm of `rows` rows of `cols`: `x r w`, `r = 1 / sqrt(mean(x²) + eps)`.
pub fn rms_norm(x: &[f32], w: &[f32], cols: usize, eps: f64) -> Vec<f64> {
    x.chunks_exact(cols)
        .flat_map(|row| {
            let r = inverse_rms(row, eps);
            row.iter()
                .zip(w)
                .map(move |(&v, &wv)| f64::from(v) * r * f64::from(wv))
        })
        .collect()
}

/// RMSNorm's gradients for the output gradient `g`: `(dx, dw)`, with `x̂ = x r`,
/// `dx = r (g w − x̂ · mean(g w x̂))`, `dw = Σ_rows g x̂`.
pub fn rms_norm_backward(
    x: &[f32],
    w: &[f32],
    g: &[f32],
    cols: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut dx = Vec::with_capacity(x.len());
    let mut dw = vec![0.0; cols];
    for (row, grow) in x.chunks_exact(cols).zip(g.chunks_exact(cols)) {
        let r = inverse_rms(row, eps);
        let xhat: Vec<f64> = row.iter().map(|&v| f64::from(v) * r).collect();
        let gw: Vec<f64> = grow
            .iter()
            .zip(w)
            .map(|(&gv, &wv)| f64::from(gv) * f64::from(wv))
            .collect();
        let dot = gw.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / cols as f64;
        dx.extend(gw.iter().zip(&xhat).map(|(a, xh)| r * (a - xh * dot)));
        for ((d, &gv), xh) in dw.iter_mut().zip(grow).zip(&xhat) {
            *d += f64::from(gv) * xh;
        }
    }
    (dx, dw)
}

/// The residual add fused with the RMSNorm after it: `(s, out)`, `s = a + b`, `out` the norm of
/// `s` (as [`rms_norm`] computes it from `s` rounded to fp32).
pub fn add_rms_norm(
    a: &[f32],
    b: &[f32],
    w: &[f32],
    cols: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>) {
    let s: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x) + f64::from(y))
        .collect();
    let s32: Vec<f32> = s.iter().map(|&v| v as f32).collect();
    let out = rms_norm(&s32, w, cols, eps);
    (s, out)
}

/// The fused add-and-norm's gradients, from the stored sum `s`, the norm's output gradient `g`
/// and the residual stream's own gradient `g_res`: `(ds, dw)`, `ds = g_res + dx` (what `a` and
/// `b` each receive), `dx` and `dw` as [`rms_norm_backward`] gives them.
pub fn add_rms_norm_backward(
    s: &[f32],
    w: &[f32],
    g: &[f32],
    g_res: &[f32],
    cols: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>) {
    let (dx, dw) = rms_norm_backward(s, w, g, cols, eps);
    let ds = dx
        .iter()
        .zip(g_res)
        .map(|(d, &r)| d + f64::from(r))
        .collect();
    (ds, dw)
}

/// Cross-entropy of rows of `vocab` logits: `(loss, lse, dlogits)` per row `r` with weight
/// `w_r`: `lse_r = log Σ_c exp(x_rc)`, `loss_r = w_r (lse_r − x_r,t)` and `dlogits_rc =
/// w_r (softmax_r(c) − [c = t])` for target `t`; a target below 0 or past the vocabulary is
/// ignored (loss 0, zero gradient; `lse` still computed).
pub fn cross_entropy(
    logits: &[f32],
    targets: &[i64],
    weights: &[f32],
    vocab: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut loss, mut lse, mut grad) = (Vec::new(), Vec::new(), Vec::with_capacity(logits.len()));
    for ((row, &target), &weight) in logits.chunks_exact(vocab).zip(targets).zip(weights) {
        let top = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let sum: f64 = row.iter().map(|&x| (f64::from(x) - top).exp()).sum();
        let l = top + sum.ln();
        let target = usize::try_from(target).ok().filter(|&t| t < vocab);
        let w = if target.is_some() {
            f64::from(weight)
        } else {
            0.0
        };
        lse.push(l);
        loss.push(target.map_or(0.0, |t| w * (l - f64::from(row[t]))));
        grad.extend(row.iter().enumerate().map(|(c, &x)| {
            let hit = if Some(c) == target { 1.0 } else { 0.0 };
            w * ((f64::from(x) - l).exp() - hit)
        }));
    }
    (loss, lse, grad)
}

/// The logit gradient of the classes `first .. first + cols` of each row from its saved
/// log-sum-exp: `w_r (exp(x_rc − lse_r) − [first + c = t_r])` (a target below 0 matches none).
pub fn softmax_grad(
    logits: &[f32],
    lse: &[f32],
    targets: &[i64],
    weights: &[f32],
    cols: usize,
    first: usize,
) -> Vec<f64> {
    logits
        .chunks_exact(cols)
        .zip(lse.iter().zip(targets).zip(weights))
        .flat_map(|(row, ((&l, &t), &w))| {
            row.iter().enumerate().map(move |(c, &x)| {
                let hit = if usize::try_from(t).ok() == Some(first + c) {
                    1.0
                } else {
                    0.0
                };
                f64::from(w) * ((f64::from(x) - f64::from(l)).exp() - hit)
            })
        })
        .collect()
}

/// Decoding's attention: each row's one query `q: [rows, heads, dim]` against the cache's
/// columns `pads[r] .. len` of `k, v: [rows, kv_heads, capacity, dim]`, query head `h` on KV head
/// `h / (heads / kv_heads)`; `[rows, heads, dim]` (zeros for a row with no column).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pads: &[usize],
    heads: usize,
    kv_heads: usize,
    capacity: usize,
    len: usize,
    dim: usize,
    scale: f64,
) -> Vec<f64> {
    let group = heads / kv_heads;
    let mut out = Vec::with_capacity(q.len());
    for (row, &pad) in pads.iter().enumerate() {
        for h in 0..heads {
            let query = &q[(row * heads + h) * dim..][..dim];
            let cache = (row * kv_heads + h / group) * capacity;
            let scores: Vec<f64> = (pad..len)
                .map(|j| {
                    let key = &k[(cache + j) * dim..][..dim];
                    scale
                        * query
                            .iter()
                            .zip(key)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum::<f64>()
                })
                .collect();
            let top = scores.iter().fold(f64::NEG_INFINITY, |m, &s| m.max(s));
            let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
            let total: f64 = weights.iter().sum();
            for c in 0..dim {
                let value: f64 = (pad..len)
                    .zip(&weights)
                    .map(|(j, w)| w * f64::from(v[(cache + j) * dim + c]))
                    .sum();
                out.push(if total > 0.0 { value / total } else { 0.0 });
            }
        }
    }
    out
}

fn inverse_rms(row: &[f32], eps: f64) -> f64 {
    let mean = row
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        / row.len() as f64;
    1.0 / (mean + eps).sqrt()
}

fn sigmoid(a: f64) -> f64 {
    1.0 / (1.0 + (-a).exp())
}

/// SwiGLU: `silu(a) b`.
pub fn swiglu(a: &[f32], b: &[f32]) -> Vec<f64> {
    a.iter()
        .zip(b)
        .map(|(&av, &bv)| {
            let av = f64::from(av);
            av * sigmoid(av) * f64::from(bv)
        })
        .collect()
}

/// SwiGLU's gradients for the output gradient `g`: `(da, db)`.
pub fn swiglu_backward(a: &[f32], b: &[f32], g: &[f32]) -> (Vec<f64>, Vec<f64>) {
    a.iter()
        .zip(b)
        .zip(g)
        .map(|((&av, &bv), &gv)| {
            let (av, bv, gv) = (f64::from(av), f64::from(bv), f64::from(gv));
            let s = sigmoid(av);
            (gv * bv * s * (1.0 + av * (1.0 - s)), gv * av * s)
        })
        .unzip()
}

/// Rotary embedding ("rotate half") of rows of `dim` values, row `r` at position
/// `(r / group) mod positions` (group 1: heads first; the heads: tokens first), with
/// `[positions, dim / 2]` tables; `sign = −1` rotates back.
pub fn rope(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    (positions, group): (usize, usize),
    dim: usize,
    sign: f64,
) -> Vec<f64> {
    let half = dim / 2;
    let mut out = vec![0.0; x.len()];
    for (r, (row, dst)) in x
        .chunks_exact(dim)
        .zip(out.chunks_exact_mut(dim))
        .enumerate()
    {
        let at = ((r / group) % positions) * half;
        for j in 0..half {
            let (c, s) = (f64::from(cos[at + j]), sign * f64::from(sin[at + j]));
            let (x1, x2) = (f64::from(row[j]), f64::from(row[half + j]));
            dst[j] = x1 * c - x2 * s;
            dst[half + j] = x2 * c + x1 * s;
        }
    }
    out
}

/// Which keys each query of a varlen attention sees (`common.cuh`'s rule): sample `s`'s queries
/// are rows `cu_q[s] .. cu_q[s + 1]` and its keys rows `cu_k[s] .. cu_k[s + 1]`; a query sees its
/// sample's keys, under `causal` only those at or before it with the sample's ends aligned (the
/// i-th query sees the j-th key iff `j <= i + nk − nq`).
#[derive(Debug, Clone, Copy)]
pub struct Varlen<'a> {
    pub cu_q: &'a [usize],
    pub cu_k: &'a [usize],
    pub causal: bool,
}

impl<'a> Varlen<'a> {
    /// Causal self-attention over packed samples (`cu`: token offsets, first 0, last `tokens`).
    pub fn packed(cu: &'a [usize]) -> Self {
        Varlen {
            cu_q: cu,
            cu_k: cu,
            causal: true,
        }
    }

    /// Each query row with the key rows it sees, sample by sample.
    pub fn rows(&self) -> Vec<(usize, std::ops::Range<usize>)> {
        let mut rows = Vec::new();
        for (q, k) in self.cu_q.windows(2).zip(self.cu_k.windows(2)) {
            let (nq, nk) = ((q[1] - q[0]) as i64, (k[1] - k[0]) as i64);
            for i in q[0]..q[1] {
                let last = (i - q[0]) as i64 + nk - nq; // the last key seen, from the sample's first
                let hi = match self.causal {
                    true => (k[0] as i64 + last + 1).clamp(k[0] as i64, k[1] as i64) as usize,
                    false => k[1],
                };
                rows.push((i, k[0]..hi));
            }
        }
        rows
    }
}

/// Attention over `varlen`'s samples with grouped-query heads: `q: [q_tokens, heads, dim]`,
/// `k, v: [k_tokens, kv_heads, dim]`. Returns the output `[q_tokens, heads, dim]` and each row's
/// log-sum-exp `[q_tokens, heads]` of the scaled scores over the keys it sees (−inf and a zero
/// output for a row that sees none).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    varlen: Varlen<'_>,
    heads: usize,
    kv_heads: usize,
    dim: usize,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let tokens = varlen.cu_q.last().copied().unwrap_or(0);
    let group = heads / kv_heads;
    let (mut out, mut lse) = (vec![0.0; tokens * heads * dim], vec![0.0; tokens * heads]);
    for (t, keys) in varlen.rows() {
        for h in 0..heads {
            let qrow = &q[(t * heads + h) * dim..][..dim];
            let kvh = h / group;
            let scores: Vec<f64> = keys
                .clone()
                .map(|j| {
                    let krow = &k[(j * kv_heads + kvh) * dim..][..dim];
                    scale
                        * qrow
                            .iter()
                            .zip(krow)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum::<f64>()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            if scores.is_empty() {
                lse[t * heads + h] = f64::NEG_INFINITY;
                continue;
            }
            let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
            lse[t * heads + h] = max + sum.ln();
            let dst = &mut out[(t * heads + h) * dim..][..dim];
            for (j, s) in keys.clone().zip(&scores) {
                let p = (s - max).exp() / sum;
                let vrow = &v[(j * kv_heads + kvh) * dim..][..dim];
                for (o, &x) in dst.iter_mut().zip(vrow) {
                    *o += p * f64::from(x);
                }
            }
        }
    }
    (out, lse)
}

/// [`attention`]'s gradients `(dq, dk, dv)` for the output gradient `dout` (same layouts as
/// `q`, `k`, `v`).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    varlen: Varlen<'_>,
    heads: usize,
    kv_heads: usize,
    dim: usize,
    scale: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (out, lse) = attention(q, k, v, varlen, heads, kv_heads, dim, scale);
    let group = heads / kv_heads;
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    let at = |x: &[f32], i: usize| f64::from(x[i]);
    for (t, keys) in varlen.rows() {
        for h in 0..heads {
            let (row, kvh) = ((t * heads + h) * dim, h / group);
            let d: f64 = (0..dim).map(|c| at(dout, row + c) * out[row + c]).sum();
            for j in keys.clone() {
                let krow = (j * kv_heads + kvh) * dim;
                let s = scale
                    * (0..dim)
                        .map(|c| at(q, row + c) * at(k, krow + c))
                        .sum::<f64>();
                let p = (s - lse[t * heads + h]).exp();
                let dp: f64 = (0..dim).map(|c| at(dout, row + c) * at(v, krow + c)).sum();
                let ds = p * (dp - d);
                for c in 0..dim {
                    dq[row + c] += scale * ds * at(k, krow + c);
                    dk[krow + c] += scale * ds * at(q, row + c);
                    dv[krow + c] += p * at(dout, row + c);
                }
            }
        }
    }
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Central differences of `f` at `x` along `dir`, against the analytic directional
    /// derivative `grad · dir`.
    fn check(f: impl Fn(&[f32]) -> f64, x: &[f32], grad: &[f64]) {
        let h = 1e-3f32;
        for k in 0..x.len().min(12) {
            let (mut plus, mut minus) = (x.to_vec(), x.to_vec());
            plus[k] += h;
            minus[k] -= h;
            let numeric = (f(&plus) - f(&minus)) / (2.0 * f64::from(h));
            assert!(
                (numeric - grad[k]).abs() < 1e-3 * (1.0 + grad[k].abs()),
                "element {k}: numeric {numeric}, analytic {}",
                grad[k]
            );
        }
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn backward_references_match_central_differences() {
        let (cols, eps) = (7, 1e-6);
        let (x, w, g) = (values(21, 1), values(7, 2), values(21, 3));
        let loss = |x: &[f32], w: &[f32]| -> f64 {
            rms_norm(x, w, cols, eps)
                .iter()
                .zip(&g)
                .map(|(o, &gv)| o * f64::from(gv))
                .sum()
        };
        let (dx, dw) = rms_norm_backward(&x, &w, &g, cols, eps);
        check(|x| loss(x, &w), &x, &dx);
        check(|w| loss(&x, w), &w, &dw);

        let (a, b) = (values(30, 4), values(30, 5));
        let g = values(30, 6);
        let dot = |o: Vec<f64>| -> f64 { o.iter().zip(&g).map(|(o, &gv)| o * f64::from(gv)).sum() };
        let (da, db) = swiglu_backward(&a, &b, &g);
        check(|a| dot(swiglu(a, &b)), &a, &da);
        check(|b| dot(swiglu(&a, b)), &b, &db);
    }

    #[test]
    fn the_fused_add_norm_is_the_norm_of_the_sum_and_its_backward_matches_differences() {
        let (cols, eps) = (5, 1e-6);
        let (a, b, w) = (values(15, 20), values(15, 21), values(5, 22));
        let (g, g_res) = (values(15, 23), values(15, 24));
        let (s, out) = add_rms_norm(&a, &b, &w, cols, eps);
        let s32: Vec<f32> = s.iter().map(|&v| v as f32).collect();
        assert_eq!(out, rms_norm(&s32, &w, cols, eps));
        // The loss both outputs feed: g · norm(a + b) + g_res · (a + b).
        let loss = |a: &[f32], w: &[f32]| -> f64 {
            let (s, out) = add_rms_norm(a, &b, w, cols, eps);
            let norm: f64 = out.iter().zip(&g).map(|(o, &gv)| o * f64::from(gv)).sum();
            norm + s
                .iter()
                .zip(&g_res)
                .map(|(v, &r)| v * f64::from(r))
                .sum::<f64>()
        };
        let (ds, dw) = add_rms_norm_backward(&s32, &w, &g, &g_res, cols, eps);
        check(|a| loss(a, &w), &a, &ds);
        check(|w| loss(&a, w), &w, &dw);
    }

    #[test]
    fn cross_entropy_is_the_negative_log_softmax_and_its_gradient_matches_differences() {
        let vocab = 6;
        let logits: Vec<f32> = values(3 * vocab, 30).iter().map(|v| v * 4.0).collect();
        let (targets, weights) = ([2i64, -100, 5], [0.5f32, 1.0, 2.0]);
        let (loss, lse, grad) = cross_entropy(&logits, &targets, &weights, vocab);
        // Row 0 by hand: −w log softmax(x)_t.
        let row = &logits[..vocab];
        let z: f64 = row.iter().map(|&x| f64::from(x).exp()).sum();
        let want = -0.5 * (f64::from(row[2]).exp() / z).ln();
        assert!((loss[0] - want).abs() < 1e-12, "{} vs {want}", loss[0]);
        assert!((lse[0] - z.ln()).abs() < 1e-12);
        // The ignored row: no loss, no gradient; a gradient row sums to 0 (softmax − one-hot).
        assert_eq!(loss[1], 0.0);
        assert!(grad[vocab..2 * vocab].iter().all(|&d| d == 0.0));
        assert!(grad[..vocab].iter().sum::<f64>().abs() < 1e-12);
        let total = |x: &[f32]| {
            cross_entropy(x, &targets, &weights, vocab)
                .0
                .iter()
                .sum::<f64>()
        };
        check(total, &logits, &grad);
        let tail: Vec<f64> = grad[2 * vocab..].to_vec();
        check(
            |x| {
                let mut all = logits.clone();
                all[2 * vocab..].copy_from_slice(x);
                total(&all)
            },
            &logits[2 * vocab..],
            &tail,
        );
    }

    #[test]
    fn a_block_of_classes_from_the_saved_lse_is_that_block_of_the_whole_gradient() {
        let vocab = 7;
        let logits = values(2 * vocab, 40);
        let (targets, weights) = ([4i64, 1], [1.5f32, -0.5]);
        let (_, lse, whole) = cross_entropy(&logits, &targets, &weights, vocab);
        let lse: Vec<f32> = lse.iter().map(|&v| v as f32).collect();
        let (first, cols) = (3, 3);
        let block: Vec<f32> = logits
            .chunks_exact(vocab)
            .flat_map(|row| row[first..first + cols].to_vec())
            .collect();
        let got = softmax_grad(&block, &lse, &targets, &weights, cols, first);
        for r in 0..2 {
            for c in 0..cols {
                let want = whole[r * vocab + first + c];
                assert!((got[r * cols + c] - want).abs() < 1e-6, "{r},{c}");
            }
        }
    }

    #[test]
    fn decoding_attends_as_the_training_attention_does_for_a_samples_last_token() {
        // Two rows of a cache with capacity 6 and 5 columns filled, row 1 padded by 2: each
        // row's query attends as the last token of its sample does in training's attention.
        let (heads, kv_heads, dim, capacity, len) = (4, 2, 3, 6, 5);
        let pads = [0usize, 2];
        let k = values(2 * kv_heads * capacity * dim, 50);
        let v = values(2 * kv_heads * capacity * dim, 51);
        let q = values(2 * heads * dim, 52);
        let got = decode_attention(&q, &k, &v, &pads, heads, kv_heads, capacity, len, dim, 0.6);
        for (row, &pad) in pads.iter().enumerate() {
            let n = len - pad;
            // The row's sample, token-major, its last query the decoding one.
            let mut tq = vec![0f32; n * heads * dim];
            let (mut tk, mut tv) = (
                vec![0f32; n * kv_heads * dim],
                vec![0f32; n * kv_heads * dim],
            );
            for t in 0..n {
                for g in 0..kv_heads {
                    let from = ((row * kv_heads + g) * capacity + pad + t) * dim;
                    let to = (t * kv_heads + g) * dim;
                    tk[to..to + dim].copy_from_slice(&k[from..from + dim]);
                    tv[to..to + dim].copy_from_slice(&v[from..from + dim]);
                }
            }
            let last = (n - 1) * heads * dim;
            tq[last..].copy_from_slice(&q[row * heads * dim..(row + 1) * heads * dim]);
            let (want, _) = attention(
                &tq,
                &tk,
                &tv,
                Varlen::packed(&[0, n]),
                heads,
                kv_heads,
                dim,
                0.6,
            );
            for (a, b) in got[row * heads * dim..(row + 1) * heads * dim]
                .iter()
                .zip(&want[last..])
            {
                assert!((a - b).abs() < 1e-12, "row {row}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn attention_of_one_key_is_its_value_and_samples_do_not_mix() {
        // Two samples of 1 and 2 tokens, 2 query heads sharing 1 kv head, dim 2.
        let q = values(3 * 2 * 2, 8);
        let k = values(3 * 2, 9);
        let v = values(3 * 2, 10);
        let (out, lse) = attention(&q, &k, &v, Varlen::packed(&[0, 1, 3]), 2, 1, 2, 0.5);
        // Token 0 and token 1 each see one key (their sample's first): the output is its value,
        // the log-sum-exp its one score.
        for (t, key) in [(0usize, 0usize), (1, 1)] {
            for h in 0..2 {
                let o = &out[(t * 2 + h) * 2..][..2];
                assert!((o[0] - f64::from(v[key * 2])).abs() < 1e-12);
                assert!((o[1] - f64::from(v[key * 2 + 1])).abs() < 1e-12);
                let s = 0.5
                    * (f64::from(q[(t * 2 + h) * 2]) * f64::from(k[key * 2])
                        + f64::from(q[(t * 2 + h) * 2 + 1]) * f64::from(k[key * 2 + 1]));
                assert!((lse[t * 2 + h] - s).abs() < 1e-12);
            }
        }
    }

    /// Ring attention's two cases and the end alignment: the last 4 queries of a 7-token sample
    /// against all its keys (causal, nk > nq) are the whole sample's rows 3..7; and so is the
    /// merge (log-sum-exp rule) of those queries against their own chunk (causal, nk = nq) and
    /// against the earlier chunk (not causal).
    #[test]
    fn a_suffix_of_queries_and_merged_chunks_equal_the_whole_sample() {
        let (heads, kv_heads, dim, scale) = (2, 1, 3, 0.7);
        let (q, k, v) = (values(7 * 2 * 3, 21), values(7 * 3, 22), values(7 * 3, 23));
        let (whole, whole_lse) = attention(
            &q,
            &k,
            &v,
            Varlen::packed(&[0, 7]),
            heads,
            kv_heads,
            dim,
            scale,
        );
        let (q_late, k_early, v_early) = (&q[3 * 6..], &k[..3 * 3], &v[..3 * 3]);
        let close = |got: &[f64], want: &[f64]| {
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() < 1e-12, "{g} vs {w}");
            }
        };
        let suffix = Varlen {
            cu_q: &[0, 4],
            cu_k: &[0, 7],
            causal: true,
        };
        let (out, lse) = attention(q_late, &k, &v, suffix, heads, kv_heads, dim, scale);
        close(&out, &whole[3 * 6..]);
        close(&lse, &whole_lse[3 * 2..]);
        let (diag, diag_lse) = attention(
            q_late,
            &k[3 * 3..],
            &v[3 * 3..],
            Varlen::packed(&[0, 4]),
            heads,
            kv_heads,
            dim,
            scale,
        );
        let earlier = Varlen {
            cu_q: &[0, 4],
            cu_k: &[0, 3],
            causal: false,
        };
        let (full, full_lse) = attention(
            q_late, k_early, v_early, earlier, heads, kv_heads, dim, scale,
        );
        let lse: Vec<f64> = diag_lse
            .iter()
            .zip(&full_lse)
            .map(|(a, b)| a.max(*b) + ((a - a.max(*b)).exp() + (b - a.max(*b)).exp()).ln())
            .collect();
        let out: Vec<f64> = (0..diag.len())
            .map(|i| {
                let row = i / dim;
                (diag_lse[row] - lse[row]).exp() * diag[i]
                    + (full_lse[row] - lse[row]).exp() * full[i]
            })
            .collect();
        close(&out, &whole[3 * 6..]);
        close(&lse, &whole_lse[3 * 2..]);
        // A query before its keys' end alignment sees none: 4 queries against 2 keys, causal.
        let short = Varlen {
            cu_q: &[0, 4],
            cu_k: &[0, 2],
            causal: true,
        };
        let (out, lse) = attention(q_late, k_early, v_early, short, heads, kv_heads, dim, scale);
        assert!(
            lse[..2 * 2].iter().all(|l| *l == f64::NEG_INFINITY),
            "{lse:?}"
        );
        assert!(out[..2 * 2 * dim].iter().all(|o| *o == 0.0));
        assert!(lse[2 * 2..].iter().all(|l| l.is_finite()));
    }

    #[test]
    fn the_attention_backward_matches_central_differences() {
        let (cu, heads, kv_heads, dim, scale) = ([0usize, 2, 5], 2, 1, 3, 0.7);
        let (q, k, v) = (values(5 * 2 * 3, 11), values(5 * 3, 12), values(5 * 3, 13));
        let g = values(5 * 2 * 3, 14);
        let loss = |q: &[f32], k: &[f32], v: &[f32]| -> f64 {
            let (out, _) = attention(q, k, v, Varlen::packed(&cu), heads, kv_heads, dim, scale);
            out.iter().zip(&g).map(|(o, &gv)| o * f64::from(gv)).sum()
        };
        let (dq, dk, dv) = attention_backward(
            &q,
            &k,
            &v,
            &g,
            Varlen::packed(&cu),
            heads,
            kv_heads,
            dim,
            scale,
        );
        check(|q| loss(q, &k, &v), &q, &dq);
        check(|k| loss(&q, k, &v), &k, &dk);
        check(|v| loss(&q, &k, v), &v, &dv);
    }

    #[test]
    fn rotating_back_undoes_the_rotation() {
        let (positions, dim) = (3, 8);
        let x = values(6 * dim, 7);
        let angles: Vec<f32> = (0..positions * dim / 2).map(|i| i as f32 * 0.37).collect();
        let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
        let there = rope(&x, &cos, &sin, (positions, 1), dim, 1.0);
        let there32: Vec<f32> = there.iter().map(|&v| v as f32).collect();
        let back = rope(&there32, &cos, &sin, (positions, 1), dim, -1.0);
        for (b, &v) in back.iter().zip(&x) {
            assert!((b - f64::from(v)).abs() < 1e-5, "{b} vs {v}");
        }
    }
}
