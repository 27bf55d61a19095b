// FlashAttention-2's forward on tensor cores, bf16: attention over samples of different lengths
// (varlen), causal or not, with grouped-query heads, the output and each row's log-sum-exp, as
// `attention.cu`'s forward computes them (same parameters, layouts and `lse`, so its backward and
// a gang's merge take either).
//
//   q: [q_tokens, heads, dim], k, v: [k_tokens, kv_heads, dim] bf16; cu_q, cu_k: [samples + 1];
//   causal: 0 or 1 (`common.cuh`); out: [q_tokens, heads, dim] bf16; lse: [q_tokens, heads]
//   fp32; dim 64, 96 or 128.
//
// Tiling (FlashAttention-2, Dao 2023): a block of W warps takes 16 W consecutive query rows of one
// head (a tile may hold rows of several samples: each row attends to its own keys, the rest
// masked); each warp keeps its 16 rows' queries in registers as mma
// fragments and their output in fp32 accumulators. The block walks the keys its rows can see in
// tiles of 64: K is staged in shared memory as [key][dim], V transposed as [dim][key]; each warp
// computes S = Q Kᵀ by mma.sync m16n8k16 (bf16 in, fp32 accumulate), masks it, scales it, updates
// its rows' running maximum and sum (the online softmax, reduced over the 4 lanes sharing a row),
// rescales its output and adds P V, P rounded to bf16 (its accumulator layout is the next mma's
// A fragment, so P never leaves registers). Items (row tile, head) in a grid-stride loop over
// blocks: n = items * blockDim.x, items = ⌈q_tokens / (16 W)⌉ · heads.

#ifndef ODC_EMULATED
// D = A·B + C for the warp: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (lane 4 g + t
// holds A's rows g, g + 8 at columns 2t, 2t + 1 and 2t + 8, 2t + 9; B's rows 2t, 2t + 1 and
// 2t + 8, 2t + 9 at column g; C's and D's rows g, g + 8 at columns 2t, 2t + 1).
__device__ __forceinline__ void odc_mma_bf16(float d[4], const unsigned int a[4],
                                             const unsigned int b[2], const float c[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
#endif

#define ODC_FLASH_KEYS 64u
#define ODC_FLASH_MAX_DIM 128u
// A row of the transposed V tile, padded.
#define ODC_FLASH_VT (ODC_FLASH_KEYS + 8u)

// Two bf16 (low half first) as one mma operand register.
__device__ __forceinline__ unsigned int odc_pair(unsigned short lo, unsigned short hi) {
    return (unsigned int)lo | ((unsigned int)hi << 16);
}

// The warp's 16 rows `row[0..2)` of `x` (row-major, `stride` elements a row, columns `col0 ..
// col0 + D`) as mma A fragments, one per 16 columns; rows at or past `rows` are zeros.
template <int D>
__device__ __forceinline__ void odc_flash_rows_a(unsigned int a[D / 16][4],
                                                 const unsigned short* __restrict__ x,
                                                 const unsigned long long row[2],
                                                 unsigned long long rows,
                                                 unsigned long long stride, unsigned long long col0,
                                                 unsigned int t) {
    for (int kk = 0; kk < D / 16; ++kk) {
        for (int i = 0; i < 4; ++i) {
            unsigned long long r = row[i & 1];
            unsigned long long at = r * stride + col0 + 16u * kk + 2u * t + ((i & 2) ? 8u : 0u);
            a[kk][i] = r < rows ? odc_pair(x[at], x[at + 1]) : 0u;
        }
    }
}

// acc[nt] = A · Bᵀ for 8-column blocks nt < N, B's rows `nt * 8 + g` of `bs` ([n][D] in shared
// memory): the warp's 16 rows against N * 8 rows of a tile, over D.
template <int D, int N>
__device__ __forceinline__ void odc_flash_abt(float acc[N][4], const unsigned int a[D / 16][4],
                                              const unsigned short* bs, unsigned int g,
                                              unsigned int t) {
    for (int nt = 0; nt < N; ++nt) {
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
        const unsigned short* br = bs + (nt * 8u + g) * D + 2u * t;
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned int b[2] = {odc_pair(br[16 * kk], br[16 * kk + 1]),
                                 odc_pair(br[16 * kk + 8], br[16 * kk + 9])};
            odc_mma_bf16(acc[nt], a[kk], b, acc[nt]);
        }
    }
}

// out[dt] += P · X for a warp's accumulators `p` (16 rows × N * 8 columns, rounded to bf16 here)
// and X transposed in shared memory (`xt`: [D][N * 8 + 8], its columns the tile's N * 8 rows).
template <int D, int N>
__device__ __forceinline__ void odc_flash_px(float out[D / 8][4], const float p[N][4],
                                             const unsigned short* xt, unsigned int g,
                                             unsigned int t) {
    for (int kk = 0; kk < N / 2; ++kk) {
        unsigned int a[4] = {odc_pair(odc_bf16(p[2 * kk][0]), odc_bf16(p[2 * kk][1])),
                             odc_pair(odc_bf16(p[2 * kk][2]), odc_bf16(p[2 * kk][3])),
                             odc_pair(odc_bf16(p[2 * kk + 1][0]), odc_bf16(p[2 * kk + 1][1])),
                             odc_pair(odc_bf16(p[2 * kk + 1][2]), odc_bf16(p[2 * kk + 1][3]))};
        for (int dt = 0; dt < D / 8; ++dt) {
            const unsigned short* xr = xt + (8u * dt + g) * (8u * N + 8u) + 16u * kk + 2u * t;
            unsigned int b[2] = {odc_pair(xr[0], xr[1]), odc_pair(xr[8], xr[9])};
            odc_mma_bf16(out[dt], a, b, out[dt]);
        }
    }
}

// Stage rows `first .. first + TILE` (zeros at or past `last`) of `x` (`stride` elements a row,
// head offset `col0`) as [row][D] in `xs` (if not null) and transposed, [D][TILE + 8], in `xt` (if
// not null). The whole block takes part.
template <int D, unsigned int TILE>
__device__ __forceinline__ void odc_flash_stage(unsigned short* xs, unsigned short* xt,
                                                const unsigned short* __restrict__ x,
                                                unsigned long long first, unsigned long long last,
                                                unsigned long long stride,
                                                unsigned long long col0) {
    for (unsigned int idx = threadIdx.x; idx < TILE * D; idx += blockDim.x) {
        unsigned int r = idx / D, c = idx - r * D;
        unsigned long long j = first + r;
        unsigned short val = j < last ? x[j * stride + col0 + c] : (unsigned short)0;
        if (xs) xs[r * D + c] = val;
        if (xt) xt[c * (TILE + 8u) + r] = val;
    }
}

// A query tile's rows as one lane sees them: its two rows (g and g + 8 of its warp's 16), the
// keys each sees ([lo, hi)), and the keys any row of the tile sees ([kfirst, klast): a row's
// keys never start before the previous row's, nor end before them).
struct OdcFlashRows {
    unsigned long long row[2], lo[2], hi[2], kfirst, klast;

    __device__ OdcFlashRows(const unsigned long long* __restrict__ cu_q,
                            const unsigned long long* __restrict__ cu_k,
                            unsigned long long samples, unsigned long long causal,
                            unsigned long long q_tokens, unsigned long long q0,
                            unsigned long long tile_rows, unsigned int warp, unsigned int g) {
        for (int r = 0; r < 2; ++r) {
            row[r] = q0 + 16ull * warp + g + 8u * r;
            lo[r] = hi[r] = 0;
            if (row[r] < q_tokens) odc_query_keys(cu_q, cu_k, samples, causal, row[r], &lo[r], &hi[r]);
        }
        unsigned long long last = (q0 + tile_rows < q_tokens ? q0 + tile_rows : q_tokens) - 1, x;
        odc_query_keys(cu_q, cu_k, samples, causal, q0, &kfirst, &x);
        odc_query_keys(cu_q, cu_k, samples, causal, last, &x, &klast);
        if (klast < kfirst) klast = kfirst;
    }
};

template <int D>
__device__ void odc_flash_fwd(unsigned short* __restrict__ out, float* __restrict__ lse,
                              const unsigned short* __restrict__ q,
                              const unsigned short* __restrict__ k,
                              const unsigned short* __restrict__ v,
                              const unsigned long long* __restrict__ cu_q,
                              const unsigned long long* __restrict__ cu_k,
                              unsigned long long samples, unsigned long long causal,
                              unsigned long long heads, unsigned long long kv_heads, float scale,
                              unsigned short* ks, unsigned short* vt) {
    const float inf = __int_as_float(0x7f800000);
    const unsigned long long tokens = cu_q[samples];
    const unsigned int warps = blockDim.x / 32u;
    const unsigned long long tile_rows = 16ull * warps;
    const unsigned long long items = (tokens + tile_rows - 1) / tile_rows * heads;
    const unsigned long long group = heads / kv_heads;
    const unsigned int warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const unsigned int g = lane >> 2, t = lane & 3u;
    for (unsigned long long item = blockIdx.x; item < items; item += gridDim.x) {
        const unsigned long long tile = item / heads, h = item - tile * heads, kvh = h / group;
        const OdcFlashRows rows(cu_q, cu_k, samples, causal, tokens, tile * tile_rows, tile_rows,
                                warp, g);
        const unsigned long long* row = rows.row;
        const unsigned long long *lo = rows.lo, *hi = rows.hi;
        const unsigned long long kfirst = rows.kfirst, klast = rows.klast;
        // The warp's queries as A fragments, one per 16 columns.
        unsigned int qa[D / 16][4];
        odc_flash_rows_a<D>(qa, q, row, tokens, heads * D, h * D, t);
        float o[D / 8][4];
        for (int dt = 0; dt < D / 8; ++dt) {
            for (int i = 0; i < 4; ++i) o[dt][i] = 0.0f;
        }
        float m[2] = {-inf, -inf}, l[2] = {0.0f, 0.0f};
        for (unsigned long long kt = kfirst; kt < klast; kt += ODC_FLASH_KEYS) {
            __syncthreads();  // the previous tile's reads are done
            odc_flash_stage<D, ODC_FLASH_KEYS>(ks, nullptr, k, kt, klast, kv_heads * D, kvh * D);
            odc_flash_stage<D, ODC_FLASH_KEYS>(nullptr, vt, v, kt, klast, kv_heads * D, kvh * D);
            __syncthreads();
            // S = Q Kᵀ for the warp's 16 rows and the tile's 64 keys (8 blocks of 8 keys).
            float s[ODC_FLASH_KEYS / 8][4];
            odc_flash_abt<D, ODC_FLASH_KEYS / 8>(s, qa, ks, g, t);
            // Mask, scale, and each row's maximum over the tile (its 4 lanes together).
            float mx[2] = {-inf, -inf};
            for (unsigned int nt = 0; nt < ODC_FLASH_KEYS / 8; ++nt) {
                for (int i = 0; i < 4; ++i) {
                    int r = i >> 1;
                    unsigned long long key = kt + nt * 8u + 2u * t + (unsigned int)(i & 1);
                    bool seen = row[r] < tokens && key >= lo[r] && key < hi[r];
                    s[nt][i] = seen ? s[nt][i] * scale : -inf;
                    mx[r] = fmaxf(mx[r], s[nt][i]);
                }
            }
            float corr[2];
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                float next = fmaxf(m[r], mx[r]);
                corr[r] = next == -inf ? 1.0f : expf(m[r] - next);
                m[r] = next;
                l[r] *= corr[r];
            }
            for (int dt = 0; dt < D / 8; ++dt) {
                for (int i = 0; i < 4; ++i) o[dt][i] *= corr[i >> 1];
            }
            // P (the sums count it rounded to bf16, as the mma reads it), then O += P V.
            for (unsigned int nt = 0; nt < ODC_FLASH_KEYS / 8; ++nt) {
                for (int i = 0; i < 4; ++i) {
                    int r = i >> 1;
                    s[nt][i] = s[nt][i] == -inf ? 0.0f : expf(s[nt][i] - m[r]);
                    l[r] += __uint_as_float(((unsigned int)odc_bf16(s[nt][i])) << 16);
                }
            }
            odc_flash_px<D, ODC_FLASH_KEYS / 8>(o, s, vt, g, t);
        }
        for (int r = 0; r < 2; ++r) {
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        }
        for (int dt = 0; dt < D / 8; ++dt) {
            for (int i = 0; i < 4; ++i) {
                int r = i >> 1;
                if (row[r] >= tokens) continue;
                unsigned long long at = (row[r] * heads + h) * D + 8u * dt + 2u * t + (i & 1);
                odc_store(out, at, l[r] > 0.0f ? o[dt][i] / l[r] : 0.0f);
            }
        }
        if (t == 0) {
            for (int r = 0; r < 2; ++r) {
                if (row[r] < tokens) lse[row[r] * heads + h] = m[r] + logf(l[r]);
            }
        }
    }
}

extern "C" __global__ void odc_flash_attention_fwd_bf16(unsigned short* out, float* lse,
                                                        const unsigned short* q,
                                                        const unsigned short* k,
                                                        const unsigned short* v,
                                                        const unsigned long long* cu_q,
                                                        const unsigned long long* cu_k,
                                                        unsigned long long samples,
                                                        unsigned long long causal,
                                                        unsigned long long heads,
                                                        unsigned long long kv_heads,
                                                        unsigned long long dim, float scale,
                                                        unsigned long long n) {
    __shared__ unsigned short ks[ODC_FLASH_KEYS * ODC_FLASH_MAX_DIM];
    __shared__ unsigned short vt[ODC_FLASH_MAX_DIM * ODC_FLASH_VT];
    (void)n;
    if (dim == 64) {
        odc_flash_fwd<64>(out, lse, q, k, v, cu_q, cu_k, samples, causal, heads, kv_heads, scale, ks,
                          vt);
    } else if (dim == 96) {
        odc_flash_fwd<96>(out, lse, q, k, v, cu_q, cu_k, samples, causal, heads, kv_heads, scale, ks,
                          vt);
    } else if (dim == 128) {
        odc_flash_fwd<128>(out, lse, q, k, v, cu_q, cu_k, samples, causal, heads, kv_heads, scale, ks,
                           vt);
    }
}

// FlashAttention-2's backward on tensor cores, bf16, deterministic: the same three passes as
// `attention.cu`'s backward (its `prep` gives D_i = dout_i · out_i), the dq and the dk/dv passes
// tiled. Both recompute P = exp(scale S − lse) per tile; dS = P (dP − D) is rounded to bf16 for
// its mma as P is. Same parameters and outputs as the plain passes (dq in bf16, dk and dv fp32
// written, not added), so a caller switches per head width.
//
//   dq pass: as the forward, a block of W warps per 16 W query rows of one head, walking key tiles
//     of 32 (K as [key][dim] and transposed, V as [key][dim] in shared memory): S = Q Kᵀ,
//     dP = dO Vᵀ (Q and dO as A fragments in registers), dQ += dS K. n = ⌈q_tokens / 16 W⌉ ·
//     heads · blockDim.x.
//   dk/dv pass: a block of W warps per 16 W keys of one KV head, walking, for each query head of
//     its group, the query tiles of 32 that see its keys (Q and dO as [query][dim] and transposed):
//     Sᵀ = K Qᵀ, dV += Pᵀ dO, dPᵀ = V dOᵀ (K and V as A fragments in registers), dK += dSᵀ Q.
//     n = ⌈k_tokens / 16 W⌉ · kv_heads · blockDim.x.

#define ODC_FLASH_BWD_TILE 32u
// A row of a transposed tile, padded.
#define ODC_FLASH_BWD_T (ODC_FLASH_BWD_TILE + 8u)

template <int D>
__device__ void odc_flash_bwd_dq(unsigned short* __restrict__ dq,
                                 const unsigned short* __restrict__ q,
                                 const unsigned short* __restrict__ k,
                                 const unsigned short* __restrict__ v,
                                 const unsigned short* __restrict__ dout,
                                 const float* __restrict__ lse, const float* __restrict__ delta,
                                 const unsigned long long* __restrict__ cu_q,
                                 const unsigned long long* __restrict__ cu_k,
                                 unsigned long long samples, unsigned long long causal,
                                 unsigned long long heads, unsigned long long kv_heads,
                                 float scale, unsigned short* ks, unsigned short* kt_,
                                 unsigned short* vs) {
    const unsigned long long tokens = cu_q[samples];
    const unsigned int warps = blockDim.x / 32u;
    const unsigned long long tile_rows = 16ull * warps;
    const unsigned long long items = (tokens + tile_rows - 1) / tile_rows * heads;
    const unsigned long long group = heads / kv_heads;
    const unsigned int warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const unsigned int g = lane >> 2, t = lane & 3u;
    const int N = ODC_FLASH_BWD_TILE / 8;
    for (unsigned long long item = blockIdx.x; item < items; item += gridDim.x) {
        const unsigned long long tile = item / heads, h = item - tile * heads, kvh = h / group;
        const OdcFlashRows rows(cu_q, cu_k, samples, causal, tokens, tile * tile_rows, tile_rows,
                                warp, g);
        const unsigned long long* row = rows.row;
        const unsigned long long *lo = rows.lo, *hi = rows.hi;
        const unsigned long long kfirst = rows.kfirst, klast = rows.klast;
        float row_lse[2] = {0.0f, 0.0f}, row_d[2] = {0.0f, 0.0f};
        for (int r = 0; r < 2; ++r) {
            if (row[r] >= tokens) continue;
            row_lse[r] = lse[row[r] * heads + h];
            row_d[r] = delta[row[r] * heads + h];
        }
        unsigned int qa[D / 16][4], ga[D / 16][4];
        odc_flash_rows_a<D>(qa, q, row, tokens, heads * D, h * D, t);
        odc_flash_rows_a<D>(ga, dout, row, tokens, heads * D, h * D, t);
        float acc[D / 8][4];
        for (int dt = 0; dt < D / 8; ++dt) {
            for (int i = 0; i < 4; ++i) acc[dt][i] = 0.0f;
        }
        for (unsigned long long kt = kfirst; kt < klast; kt += ODC_FLASH_BWD_TILE) {
            __syncthreads();
            odc_flash_stage<D, ODC_FLASH_BWD_TILE>(ks, kt_, k, kt, klast, kv_heads * D, kvh * D);
            odc_flash_stage<D, ODC_FLASH_BWD_TILE>(vs, nullptr, v, kt, klast, kv_heads * D, kvh * D);
            __syncthreads();
            float s[N][4], dp[N][4];
            odc_flash_abt<D, N>(s, qa, ks, g, t);
            odc_flash_abt<D, N>(dp, ga, vs, g, t);
            for (int nt = 0; nt < N; ++nt) {
                for (int i = 0; i < 4; ++i) {
                    int r = i >> 1;
                    unsigned long long key = kt + nt * 8u + 2u * t + (unsigned int)(i & 1);
                    bool seen = row[r] < tokens && key >= lo[r] && key < hi[r];
                    float p = seen ? expf(s[nt][i] * scale - row_lse[r]) : 0.0f;
                    s[nt][i] = p * (dp[nt][i] - row_d[r]);  // dS
                }
            }
            odc_flash_px<D, N>(acc, s, kt_, g, t);
        }
        for (int dt = 0; dt < D / 8; ++dt) {
            for (int i = 0; i < 4; ++i) {
                int r = i >> 1;
                if (row[r] >= tokens) continue;
                unsigned long long at = (row[r] * heads + h) * D + 8u * dt + 2u * t + (i & 1);
                odc_store(dq, at, scale * acc[dt][i]);
            }
        }
    }
}

template <int D>
__device__ void odc_flash_bwd_dkdv(float* __restrict__ dk, float* __restrict__ dv,
                                   const unsigned short* __restrict__ q,
                                   const unsigned short* __restrict__ k,
                                   const unsigned short* __restrict__ v,
                                   const unsigned short* __restrict__ dout,
                                   const float* __restrict__ lse,
                                   const float* __restrict__ delta,
                                   const unsigned long long* __restrict__ cu_q,
                                   const unsigned long long* __restrict__ cu_k,
                                   unsigned long long samples, unsigned long long causal,
                                   unsigned long long heads, unsigned long long kv_heads,
                                   float scale, unsigned short* qs, unsigned short* qt,
                                   unsigned short* gs, unsigned short* gt) {
    const unsigned long long tokens = cu_k[samples];
    const unsigned int warps = blockDim.x / 32u;
    const unsigned long long tile_keys = 16ull * warps;
    const unsigned long long items = (tokens + tile_keys - 1) / tile_keys * kv_heads;
    const unsigned long long group = heads / kv_heads;
    const unsigned int warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const unsigned int g = lane >> 2, t = lane & 3u;
    const int N = ODC_FLASH_BWD_TILE / 8;
    for (unsigned long long item = blockIdx.x; item < items; item += gridDim.x) {
        const unsigned long long tile = item / kv_heads, kvh = item - tile * kv_heads;
        const unsigned long long k0 = tile * tile_keys;
        const unsigned long long key[2] = {k0 + 16ull * warp + g, k0 + 16ull * warp + g + 8};
        unsigned long long qlo[2] = {0, 0}, qhi[2] = {0, 0}, x;
        for (int r = 0; r < 2; ++r) {
            if (key[r] < tokens) odc_key_queries(cu_q, cu_k, samples, causal, key[r], &qlo[r], &qhi[r]);
        }
        // The queries any key of the tile is seen by: from its first key's first query to its
        // last key's last (a key's queries never start before the previous key's, nor end before
        // them).
        const unsigned long long kend = k0 + tile_keys < tokens ? k0 + tile_keys : tokens;
        unsigned long long qfirst, qend;
        odc_key_queries(cu_q, cu_k, samples, causal, k0, &qfirst, &x);
        odc_key_queries(cu_q, cu_k, samples, causal, kend - 1, &x, &qend);
        unsigned int ka[D / 16][4];
        odc_flash_rows_a<D>(ka, k, key, tokens, kv_heads * D, kvh * D, t);
        float dka[D / 8][4], dva[D / 8][4];
        for (int dt = 0; dt < D / 8; ++dt) {
            for (int i = 0; i < 4; ++i) dka[dt][i] = dva[dt][i] = 0.0f;
        }
        for (unsigned long long h = kvh * group; h < (kvh + 1) * group; ++h) {
            for (unsigned long long qt0 = qfirst; qt0 < qend; qt0 += ODC_FLASH_BWD_TILE) {
                __syncthreads();
                odc_flash_stage<D, ODC_FLASH_BWD_TILE>(qs, qt, q, qt0, qend, heads * D, h * D);
                odc_flash_stage<D, ODC_FLASH_BWD_TILE>(gs, gt, dout, qt0, qend, heads * D, h * D);
                __syncthreads();
                float s[N][4], dp[N][4];
                odc_flash_abt<D, N>(s, ka, qs, g, t);   // Sᵀ: keys × queries
                {
                    // V's fragments are read again for each tile (from L2) rather than held:
                    // held with K's and both accumulators they spill.
                    unsigned int va[D / 16][4];
                    odc_flash_rows_a<D>(va, v, key, tokens, kv_heads * D, kvh * D, t);
                    odc_flash_abt<D, N>(dp, va, gs, g, t);  // dPᵀ
                }
                float p[N][4];
                for (int nt = 0; nt < N; ++nt) {
                    for (int i = 0; i < 4; ++i) {
                        int r = i >> 1;
                        unsigned long long query = qt0 + nt * 8u + 2u * t + (unsigned int)(i & 1);
                        bool seen = key[r] < tokens && query >= qlo[r] && query < qhi[r];
                        float e = seen ? expf(s[nt][i] * scale - lse[query * heads + h]) : 0.0f;
                        p[nt][i] = e;
                        s[nt][i] = seen ? e * (dp[nt][i] - delta[query * heads + h]) : 0.0f;
                    }
                }
                odc_flash_px<D, N>(dva, p, gt, g, t);
                odc_flash_px<D, N>(dka, s, qt, g, t);
            }
        }
        for (int dt = 0; dt < D / 8; ++dt) {
            for (int i = 0; i < 4; ++i) {
                int r = i >> 1;
                if (key[r] >= tokens) continue;
                unsigned long long at = (key[r] * kv_heads + kvh) * D + 8u * dt + 2u * t + (i & 1);
                dk[at] = scale * dka[dt][i];
                dv[at] = dva[dt][i];
            }
        }
    }
}

extern "C" __global__ void odc_flash_attention_bwd_dq_bf16(
    unsigned short* dq, const unsigned short* q, const unsigned short* k, const unsigned short* v,
    const unsigned short* dout, const float* lse, const float* delta, const unsigned long long* cu_q,
    const unsigned long long* cu_k, unsigned long long samples, unsigned long long causal,
    unsigned long long heads, unsigned long long kv_heads, unsigned long long dim, float scale,
    unsigned long long n) {
    __shared__ unsigned short ks[ODC_FLASH_BWD_TILE * ODC_FLASH_MAX_DIM];
    __shared__ unsigned short kt[ODC_FLASH_MAX_DIM * ODC_FLASH_BWD_T];
    __shared__ unsigned short vs[ODC_FLASH_BWD_TILE * ODC_FLASH_MAX_DIM];
    (void)n;
    if (dim == 64) {
        odc_flash_bwd_dq<64>(dq, q, k, v, dout, lse, delta, cu_q, cu_k, samples, causal,
                             heads, kv_heads, scale, ks, kt, vs);
    } else if (dim == 96) {
        odc_flash_bwd_dq<96>(dq, q, k, v, dout, lse, delta, cu_q, cu_k, samples, causal,
                             heads, kv_heads, scale, ks, kt, vs);
    } else if (dim == 128) {
        odc_flash_bwd_dq<128>(dq, q, k, v, dout, lse, delta, cu_q, cu_k, samples, causal,
                              heads, kv_heads, scale, ks, kt, vs);
    }
}

extern "C" __global__ void odc_flash_attention_bwd_dkdv_bf16(
    float* dk, float* dv, const unsigned short* q, const unsigned short* k,
    const unsigned short* v, const unsigned short* dout, const float* lse, const float* delta,
    const unsigned long long* cu_q, const unsigned long long* cu_k, unsigned long long samples,
    unsigned long long causal, unsigned long long heads, unsigned long long kv_heads,
    unsigned long long dim, float scale, unsigned long long n) {
    __shared__ unsigned short qs[ODC_FLASH_BWD_TILE * ODC_FLASH_MAX_DIM];
    __shared__ unsigned short qt[ODC_FLASH_MAX_DIM * ODC_FLASH_BWD_T];
    __shared__ unsigned short gs[ODC_FLASH_BWD_TILE * ODC_FLASH_MAX_DIM];
    __shared__ unsigned short gt[ODC_FLASH_MAX_DIM * ODC_FLASH_BWD_T];
    (void)n;
    if (dim == 64) {
        odc_flash_bwd_dkdv<64>(dk, dv, q, k, v, dout, lse, delta, cu_q, cu_k, samples,
                               causal, heads, kv_heads, scale, qs, qt, gs, gt);
    } else if (dim == 96) {
        odc_flash_bwd_dkdv<96>(dk, dv, q, k, v, dout, lse, delta, cu_q, cu_k, samples,
                               causal, heads, kv_heads, scale, qs, qt, gs, gt);
    } else if (dim == 128) {
        odc_flash_bwd_dkdv<128>(dk, dv, q, k, v, dout, lse, delta, cu_q, cu_k, samples,
                                causal, heads, kv_heads, scale, qs, qt, gs, gt);
    }
}
