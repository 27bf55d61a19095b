// FlashAttention-2's forward on tensor cores, bf16: causal attention over packed samples (varlen)
// with grouped-query heads, the output and each row's log-sum-exp, as `attention.cu`'s forward
// computes them (same layouts, same `lse`, so its backward and a gang's merge take either).
//
//   q: [tokens, heads, dim], k, v: [tokens, kv_heads, dim] bf16; cu_seqlens: [samples + 1];
//   out: [tokens, heads, dim] bf16; lse: [tokens, heads] fp32; dim 64, 96 or 128.
//
// Tiling (FlashAttention-2, Dao 2023): a block of W warps takes 16 W consecutive query rows of one
// head (a tile may hold rows of several samples: each row attends to its own sample's keys at or
// before it, the rest masked); each warp keeps its 16 rows' queries in registers as mma
// fragments and their output in fp32 accumulators. The block walks the keys its rows can see in
// tiles of 64: K is staged in shared memory as [key][dim], V transposed as [dim][key]; each warp
// computes S = Q Kᵀ by mma.sync m16n8k16 (bf16 in, fp32 accumulate), masks it, scales it, updates
// its rows' running maximum and sum (the online softmax, reduced over the 4 lanes sharing a row),
// rescales its output and adds P V, P rounded to bf16 (its accumulator layout is the next mma's
// A fragment, so P never leaves registers). Items (row tile, head) in a grid-stride loop over
// blocks: n = items * blockDim.x, items = ⌈tokens / (16 W)⌉ · heads.

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

template <int D>
__device__ void odc_flash_fwd(unsigned short* __restrict__ out, float* __restrict__ lse,
                              const unsigned short* __restrict__ q,
                              const unsigned short* __restrict__ k,
                              const unsigned short* __restrict__ v,
                              const unsigned long long* __restrict__ cu_seqlens,
                              unsigned long long samples, unsigned long long heads,
                              unsigned long long kv_heads, float scale, unsigned short* ks,
                              unsigned short* vt) {
    const float inf = __int_as_float(0x7f800000);
    const unsigned long long tokens = cu_seqlens[samples];
    const unsigned int warps = blockDim.x / 32u;
    const unsigned long long tile_rows = 16ull * warps;
    const unsigned long long items = (tokens + tile_rows - 1) / tile_rows * heads;
    const unsigned long long group = heads / kv_heads;
    const unsigned int warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const unsigned int g = lane >> 2, t = lane & 3u;
    for (unsigned long long item = blockIdx.x; item < items; item += gridDim.x) {
        const unsigned long long tile = item / heads, h = item - tile * heads, kvh = h / group;
        const unsigned long long q0 = tile * tile_rows;
        // This lane's two rows, and the first key each may see.
        const unsigned long long row[2] = {q0 + 16ull * warp + g, q0 + 16ull * warp + g + 8};
        unsigned long long first[2] = {0, 0}, end;
        for (int r = 0; r < 2; ++r) {
            if (row[r] < tokens) odc_sample_bounds(cu_seqlens, samples, row[r], &first[r], &end);
        }
        // The keys any row of the tile sees: from its first row's sample start to its last row.
        unsigned long long kfirst;
        odc_sample_bounds(cu_seqlens, samples, q0 < tokens ? q0 : tokens - 1, &kfirst, &end);
        const unsigned long long klast = q0 + tile_rows < tokens ? q0 + tile_rows : tokens;
        // The warp's queries as A fragments, one per 16 columns.
        unsigned int qa[D / 16][4];
        for (int kk = 0; kk < D / 16; ++kk) {
            for (int i = 0; i < 4; ++i) {
                unsigned long long r = row[i & 1];
                unsigned long long at = (r * heads + h) * D + 16u * kk + 2u * t + ((i & 2) ? 8u : 0u);
                qa[kk][i] = r < tokens ? odc_pair(q[at], q[at + 1]) : 0u;
            }
        }
        float o[D / 8][4];
        for (int dt = 0; dt < D / 8; ++dt) {
            for (int i = 0; i < 4; ++i) o[dt][i] = 0.0f;
        }
        float m[2] = {-inf, -inf}, l[2] = {0.0f, 0.0f};
        for (unsigned long long kt = kfirst; kt < klast; kt += ODC_FLASH_KEYS) {
            __syncthreads();  // the previous tile's reads are done
            for (unsigned int idx = threadIdx.x; idx < ODC_FLASH_KEYS * D; idx += blockDim.x) {
                unsigned int key = idx / D, c = idx - key * D;
                unsigned long long j = kt + key;
                unsigned short kv = 0, vv = 0;
                if (j < klast) {
                    unsigned long long at = (j * kv_heads + kvh) * D + c;
                    kv = k[at];
                    vv = v[at];
                }
                ks[key * D + c] = kv;
                vt[c * ODC_FLASH_VT + key] = vv;
            }
            __syncthreads();
            // S = Q Kᵀ for the warp's 16 rows and the tile's 64 keys (8 blocks of 8 keys).
            float s[ODC_FLASH_KEYS / 8][4];
            for (unsigned int nt = 0; nt < ODC_FLASH_KEYS / 8; ++nt) {
                for (int i = 0; i < 4; ++i) s[nt][i] = 0.0f;
                const unsigned short* kr = ks + (nt * 8u + g) * D + 2u * t;
                for (int kk = 0; kk < D / 16; ++kk) {
                    unsigned int b[2] = {odc_pair(kr[16 * kk], kr[16 * kk + 1]),
                                         odc_pair(kr[16 * kk + 8], kr[16 * kk + 9])};
                    odc_mma_bf16(s[nt], qa[kk], b, s[nt]);
                }
            }
            // Mask, scale, and each row's maximum over the tile (its 4 lanes together).
            float mx[2] = {-inf, -inf};
            for (unsigned int nt = 0; nt < ODC_FLASH_KEYS / 8; ++nt) {
                for (int i = 0; i < 4; ++i) {
                    int r = i >> 1;
                    unsigned long long key = kt + nt * 8u + 2u * t + (unsigned int)(i & 1);
                    bool seen = row[r] < tokens && key < klast && key >= first[r] && key <= row[r];
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
            // P, rounded to bf16 as the mma reads it (the sums count what the mma adds).
            unsigned short p[ODC_FLASH_KEYS / 8][4];
            for (unsigned int nt = 0; nt < ODC_FLASH_KEYS / 8; ++nt) {
                for (int i = 0; i < 4; ++i) {
                    int r = i >> 1;
                    float e = s[nt][i] == -inf ? 0.0f : expf(s[nt][i] - m[r]);
                    p[nt][i] = odc_bf16(e);
                    l[r] += __uint_as_float(((unsigned int)p[nt][i]) << 16);
                }
            }
            // O += P V, 16 keys at a time: blocks 2kk and 2kk + 1 of P are the A fragment.
            for (unsigned int kk = 0; kk < ODC_FLASH_KEYS / 16; ++kk) {
                unsigned int a[4] = {odc_pair(p[2 * kk][0], p[2 * kk][1]),
                                     odc_pair(p[2 * kk][2], p[2 * kk][3]),
                                     odc_pair(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                                     odc_pair(p[2 * kk + 1][2], p[2 * kk + 1][3])};
                for (int dt = 0; dt < D / 8; ++dt) {
                    const unsigned short* vr = vt + (8u * dt + g) * ODC_FLASH_VT + 16u * kk + 2u * t;
                    unsigned int b[2] = {odc_pair(vr[0], vr[1]), odc_pair(vr[8], vr[9])};
                    odc_mma_bf16(o[dt], a, b, o[dt]);
                }
            }
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
                                                        const unsigned long long* cu_seqlens,
                                                        unsigned long long samples,
                                                        unsigned long long heads,
                                                        unsigned long long kv_heads,
                                                        unsigned long long dim, float scale,
                                                        unsigned long long n) {
    __shared__ unsigned short ks[ODC_FLASH_KEYS * ODC_FLASH_MAX_DIM];
    __shared__ unsigned short vt[ODC_FLASH_MAX_DIM * ODC_FLASH_VT];
    (void)n;
    if (dim == 64) {
        odc_flash_fwd<64>(out, lse, q, k, v, cu_seqlens, samples, heads, kv_heads, scale, ks, vt);
    } else if (dim == 96) {
        odc_flash_fwd<96>(out, lse, q, k, v, cu_seqlens, samples, heads, kv_heads, scale, ks, vt);
    } else if (dim == 128) {
        odc_flash_fwd<128>(out, lse, q, k, v, cu_seqlens, samples, heads, kv_heads, scale, ks, vt);
    }
}
