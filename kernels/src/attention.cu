// Attention over samples of different lengths (varlen) with grouped-query heads, causal or not,
// forward and backward: the output and each row's log-sum-exp (the merge rule sequence splitting
// combines partial attentions with), fp32 arithmetic. A first, plain version: one warp per
// (query, head), streaming the query's keys and values from global memory with an online softmax
// (FlashAttention's recurrence, without its shared-memory tiles); head_dim at most 128. The
// backward is FlashAttention-2's split: dq per query, dk and dv per key, no atomics.
//
//   q: [q_tokens, heads, dim], k, v: [k_tokens, kv_heads, dim] (query head h reads kv head
//   h / (heads / kv_heads)); cu_q, cu_k: [samples + 1] row offsets of each sample's queries and
//   keys (first 0, last q_tokens and k_tokens; the same array for packed self-attention); causal:
//   0 or 1 (`common.cuh`: which keys a query sees); out: [q_tokens, heads, dim]; lse:
//   [q_tokens, heads] fp32 (natural log; −inf, and a zero output, for a query that sees no key).
//   out[t, h] = Σ_{j among t's keys} softmax_j(scale q_t · k_j) v_j
//   n = q_tokens * heads * 32.

// One query row of a warp under FlashAttention's online softmax: each lane holds up to 4 of its
// `dim` columns (lane, lane + 32, ...; dim at most 128) of the scaled query and of the output's
// running sum, with the running maximum `m` and normaliser `l` (every lane the same).
struct OdcOnline {
    float qv[4], acc[4], m, l;
    unsigned long long dim;
    unsigned int lane;

    template <typename T>
    __device__ OdcOnline(const T* q, unsigned long long qrow, unsigned long long dim_,
                         unsigned int lane_, float scale)
        : m(-__int_as_float(0x7f800000)), l(0.0f), dim(dim_), lane(lane_) {
        for (int r = 0; r < 4; ++r) {
            unsigned long long c = lane + 32u * r;
            qv[r] = c < dim ? odc_load(q, qrow + c) * scale : 0.0f;
            acc[r] = 0.0f;
        }
    }

    // Attend the key and value at `krow` (the whole warp: the score is a warp sum).
    template <typename T>
    __device__ void key(const T* k, const T* v, unsigned long long krow) {
        float s = 0.0f;
        for (int r = 0; r < 4; ++r) {
            unsigned long long c = lane + 32u * r;
            if (c < dim) s += qv[r] * odc_load(k, krow + c);
        }
        s = odc_warp_sum(s);
        float m2 = fmaxf(m, s);
        float corr = expf(m - m2);
        float p = expf(s - m2);
        l = l * corr + p;
        for (int r = 0; r < 4; ++r) {
            unsigned long long c = lane + 32u * r;
            if (c < dim) acc[r] = acc[r] * corr + p * odc_load(v, krow + c);
        }
        m = m2;
    }

    // The output row at `orow`: the sum over the normaliser (zeros when no key was attended).
    template <typename T>
    __device__ void store(T* out, unsigned long long orow) const {
        for (int r = 0; r < 4; ++r) {
            unsigned long long c = lane + 32u * r;
            if (c < dim) odc_store(out, orow + c, l > 0.0f ? acc[r] / l : 0.0f);
        }
    }
};

template <typename T>
__device__ void odc_attention_fwd(T* __restrict__ out, float* __restrict__ lse,
                                  const T* __restrict__ q, const T* __restrict__ k,
                                  const T* __restrict__ v,
                                  const unsigned long long* __restrict__ cu_q,
                                  const unsigned long long* __restrict__ cu_k,
                                  unsigned long long samples, unsigned long long causal,
                                  unsigned long long heads, unsigned long long kv_heads,
                                  unsigned long long dim, float scale, unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    unsigned long long group = heads / kv_heads;
    for (unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += stride) {
        unsigned long long warp = t >> 5;
        unsigned int lane = (unsigned int)(t & 31u);
        unsigned long long token = warp / heads;
        unsigned long long h = warp - token * heads;
        unsigned long long kvh = h / group;
        unsigned long long lo, hi;
        odc_query_keys(cu_q, cu_k, samples, causal, token, &lo, &hi);
        unsigned long long qrow = (token * heads + h) * dim;
        OdcOnline query(q, qrow, dim, lane, scale);
        for (unsigned long long j = lo; j < hi; ++j) {
            query.key(k, v, (j * kv_heads + kvh) * dim);
        }
        query.store(out, qrow);
        if (lane == 0) lse[token * heads + h] = query.m + logf(query.l);
    }
}

// The backward from the forward's output and log-sum-exp (FlashAttention-2's recomputation),
// deterministic: every gradient element is written by one warp, summed in one order (no atomic
// adds). With s_ij = scale q_i · k_j, p_ij = exp(s_ij − lse_i), D_i = dout_i · out_i and
// dS_ij = p_ij (dout_i · v_j − D_i), three kernels, launched in this order:
//   prep:  D_i for every (token, head) into delta: [tokens, heads] fp32; n = tokens * heads * 32
//   dq:    dq_i = scale Σ_{j among i's keys} dS_ij k_j, in T; n = q_tokens * heads * 32
//   dkdv:  dk_j = scale Σ_{i among j's queries, h in j's group} dS_ij q_i,
//          dv_j = Σ_{same i, h} p_ij dout_i, fp32 [k_tokens, kv_heads, dim], written (not added);
//          one warp per (key, kv head); n = k_tokens * kv_heads * 32.
// A query that sees no key (lse −inf) gets a zero dq and adds to no dk, dv.

// A warp's row of `dim` columns (at most 128), four per lane (lane, lane + 32, ...).
struct OdcRow {
    float v[4];

    template <typename T>
    __device__ void load(const T* p, unsigned long long row, unsigned long long dim,
                         unsigned int lane) {
        for (int r = 0; r < 4; ++r) {
            unsigned long long c = lane + 32u * r;
            v[r] = c < dim ? odc_load(p, row + c) : 0.0f;
        }
    }

    // The warp's dot product with the row at `row` of `p` (every lane gets it).
    template <typename T>
    __device__ float dot(const T* p, unsigned long long row, unsigned long long dim,
                         unsigned int lane) const {
        float s = 0.0f;
        for (int r = 0; r < 4; ++r) {
            unsigned long long c = lane + 32u * r;
            if (c < dim) s += v[r] * odc_load(p, row + c);
        }
        return odc_warp_sum(s);
    }

    template <typename T>
    __device__ void store(T* p, unsigned long long row, unsigned long long dim,
                          unsigned int lane) const {
        for (int r = 0; r < 4; ++r) {
            unsigned long long c = lane + 32u * r;
            if (c < dim) odc_store(p, row + c, v[r]);
        }
    }
};

template <typename T>
__device__ void odc_attention_bwd_prep(float* __restrict__ delta, const T* __restrict__ out,
                                       const T* __restrict__ dout, unsigned long long dim,
                                       unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += stride) {
        unsigned long long row = t >> 5;
        unsigned int lane = (unsigned int)(t & 31u);
        OdcRow g;
        g.load(dout, row * dim, dim, lane);
        float d = g.dot(out, row * dim, dim, lane);
        if (lane == 0) delta[row] = d;
    }
}

template <typename T>
__device__ void odc_attention_bwd_dq(T* __restrict__ dq, const T* __restrict__ q,
                                     const T* __restrict__ k, const T* __restrict__ v,
                                     const T* __restrict__ dout, const float* __restrict__ lse,
                                     const float* __restrict__ delta,
                                     const unsigned long long* __restrict__ cu_q,
                                     const unsigned long long* __restrict__ cu_k,
                                     unsigned long long samples, unsigned long long causal,
                                     unsigned long long heads, unsigned long long kv_heads,
                                     unsigned long long dim, float scale, unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    unsigned long long group = heads / kv_heads;
    for (unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += stride) {
        unsigned long long warp = t >> 5;
        unsigned int lane = (unsigned int)(t & 31u);
        unsigned long long token = warp / heads;
        unsigned long long h = warp - token * heads;
        unsigned long long kvh = h / group;
        unsigned long long lo, hi;
        odc_query_keys(cu_q, cu_k, samples, causal, token, &lo, &hi);
        unsigned long long qrow = (token * heads + h) * dim;
        OdcRow qi, gi, acc;
        qi.load(q, qrow, dim, lane);
        gi.load(dout, qrow, dim, lane);
        for (int r = 0; r < 4; ++r) acc.v[r] = 0.0f;
        float row_lse = lse[token * heads + h];
        float d = delta[token * heads + h];
        for (unsigned long long j = lo; j < hi; ++j) {
            unsigned long long krow = (j * kv_heads + kvh) * dim;
            float p = expf(qi.dot(k, krow, dim, lane) * scale - row_lse);
            float ds = p * (gi.dot(v, krow, dim, lane) - d);
            for (int r = 0; r < 4; ++r) {
                unsigned long long c = lane + 32u * r;
                if (c < dim) acc.v[r] += scale * ds * odc_load(k, krow + c);
            }
        }
        acc.store(dq, qrow, dim, lane);
    }
}

template <typename T>
__device__ void odc_attention_bwd_dkdv(float* __restrict__ dk, float* __restrict__ dv,
                                       const T* __restrict__ q, const T* __restrict__ k,
                                       const T* __restrict__ v, const T* __restrict__ dout,
                                       const float* __restrict__ lse,
                                       const float* __restrict__ delta,
                                       const unsigned long long* __restrict__ cu_q,
                                       const unsigned long long* __restrict__ cu_k,
                                       unsigned long long samples, unsigned long long causal,
                                       unsigned long long heads, unsigned long long kv_heads,
                                       unsigned long long dim, float scale,
                                       unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    unsigned long long group = heads / kv_heads;
    for (unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += stride) {
        unsigned long long warp = t >> 5;
        unsigned int lane = (unsigned int)(t & 31u);
        unsigned long long token = warp / kv_heads;
        unsigned long long g = warp - token * kv_heads;
        unsigned long long lo, hi;
        odc_key_queries(cu_q, cu_k, samples, causal, token, &lo, &hi);
        unsigned long long krow = (token * kv_heads + g) * dim;
        OdcRow kj, vj, dka, dva;
        kj.load(k, krow, dim, lane);
        vj.load(v, krow, dim, lane);
        for (int r = 0; r < 4; ++r) dka.v[r] = dva.v[r] = 0.0f;
        for (unsigned long long h = g * group; h < (g + 1) * group; ++h) {
            for (unsigned long long i = lo; i < hi; ++i) {
                unsigned long long qrow = (i * heads + h) * dim;
                float p = expf(kj.dot(q, qrow, dim, lane) * scale - lse[i * heads + h]);
                float ds = p * (vj.dot(dout, qrow, dim, lane) - delta[i * heads + h]);
                for (int r = 0; r < 4; ++r) {
                    unsigned long long c = lane + 32u * r;
                    if (c < dim) {
                        dka.v[r] += scale * ds * odc_load(q, qrow + c);
                        dva.v[r] += p * odc_load(dout, qrow + c);
                    }
                }
            }
        }
        dka.store(dk, krow, dim, lane);
        dva.store(dv, krow, dim, lane);
    }
}

extern "C" __global__ void odc_attention_fwd_f32(
    float* out, float* lse, const float* q, const float* k, const float* v,
    const unsigned long long* cu_q, const unsigned long long* cu_k, unsigned long long samples,
    unsigned long long causal, unsigned long long heads, unsigned long long kv_heads,
    unsigned long long dim, float scale, unsigned long long n) {
    odc_attention_fwd(out, lse, q, k, v, cu_q, cu_k, samples, causal, heads, kv_heads, dim, scale,
                      n);
}
extern "C" __global__ void odc_attention_bwd_prep_f32(float* delta, const float* out,
                                                      const float* dout, unsigned long long dim,
                                                      unsigned long long n) {
    odc_attention_bwd_prep(delta, out, dout, dim, n);
}
extern "C" __global__ void odc_attention_bwd_dq_f32(
    float* dq, const float* q, const float* k, const float* v, const float* dout,
    const float* lse, const float* delta, const unsigned long long* cu_q,
    const unsigned long long* cu_k, unsigned long long samples, unsigned long long causal,
    unsigned long long heads, unsigned long long kv_heads, unsigned long long dim, float scale,
    unsigned long long n) {
    odc_attention_bwd_dq(dq, q, k, v, dout, lse, delta, cu_q, cu_k, samples, causal, heads,
                         kv_heads, dim, scale, n);
}
extern "C" __global__ void odc_attention_bwd_dkdv_f32(
    float* dk, float* dv, const float* q, const float* k, const float* v, const float* dout,
    const float* lse, const float* delta, const unsigned long long* cu_q,
    const unsigned long long* cu_k, unsigned long long samples, unsigned long long causal,
    unsigned long long heads, unsigned long long kv_heads, unsigned long long dim, float scale,
    unsigned long long n) {
    odc_attention_bwd_dkdv(dk, dv, q, k, v, dout, lse, delta, cu_q, cu_k, samples, causal, heads,
                           kv_heads, dim, scale, n);
}
extern "C" __global__ void odc_attention_fwd_bf16(
    unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v,
    const unsigned long long* cu_q, const unsigned long long* cu_k, unsigned long long samples,
    unsigned long long causal, unsigned long long heads, unsigned long long kv_heads,
    unsigned long long dim, float scale, unsigned long long n) {
    odc_attention_fwd(out, lse, q, k, v, cu_q, cu_k, samples, causal, heads, kv_heads, dim, scale,
                      n);
}
extern "C" __global__ void odc_attention_bwd_prep_bf16(float* delta, const unsigned short* out,
                                                       const unsigned short* dout, unsigned long long dim,
                                                       unsigned long long n) {
    odc_attention_bwd_prep(delta, out, dout, dim, n);
}
extern "C" __global__ void odc_attention_bwd_dq_bf16(
    unsigned short* dq, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout,
    const float* lse, const float* delta, const unsigned long long* cu_q,
    const unsigned long long* cu_k, unsigned long long samples, unsigned long long causal,
    unsigned long long heads, unsigned long long kv_heads, unsigned long long dim, float scale,
    unsigned long long n) {
    odc_attention_bwd_dq(dq, q, k, v, dout, lse, delta, cu_q, cu_k, samples, causal, heads,
                         kv_heads, dim, scale, n);
}
extern "C" __global__ void odc_attention_bwd_dkdv_bf16(
    float* dk, float* dv, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout,
    const float* lse, const float* delta, const unsigned long long* cu_q,
    const unsigned long long* cu_k, unsigned long long samples, unsigned long long causal,
    unsigned long long heads, unsigned long long kv_heads, unsigned long long dim, float scale,
    unsigned long long n) {
    odc_attention_bwd_dkdv(dk, dv, q, k, v, dout, lse, delta, cu_q, cu_k, samples, causal, heads,
                           kv_heads, dim, scale, n);
}

// Decoding's attention: one new query per sequence against its cached keys and values (a batch of
// sequences left-padded to end on the same column), fp32 arithmetic, one warp per (sequence,
// query head), the online softmax over the filled columns; no backward (sampling keeps no graph).
//
//   q: [rows, heads, dim]; k, v: [rows, kv_heads, capacity, dim] (the cache's buffers, filled up
//   to column len); pads: [rows] i64, the columns of left padding before each row's first token;
//   out: [rows, heads, dim].
//   out[r, h] = Σ_{pads[r] <= j < len} softmax_j(scale q_rh · k_r,g,j) v_r,g,j   (g = h / group)
//   n = rows * heads * 32. A row with nothing to attend (pads[r] >= len) gets zeros.
template <typename T>
__device__ void odc_decode_attention(T* __restrict__ out, const T* __restrict__ q,
                                     const T* __restrict__ k, const T* __restrict__ v,
                                     const long long* __restrict__ pads, unsigned long long heads,
                                     unsigned long long kv_heads, unsigned long long capacity,
                                     unsigned long long len, unsigned long long dim, float scale,
                                     unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    unsigned long long group = heads / kv_heads;
    for (unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += stride) {
        unsigned long long warp = t >> 5;
        unsigned int lane = (unsigned int)(t & 31u);
        unsigned long long row = warp / heads;
        unsigned long long h = warp - row * heads;
        unsigned long long kvh = h / group;
        unsigned long long qrow = (row * heads + h) * dim;
        unsigned long long cache = (row * kv_heads + kvh) * capacity;
        long long pad = pads[row];
        unsigned long long first = pad > 0 ? (unsigned long long)pad : 0ull;
        OdcOnline query(q, qrow, dim, lane, scale);
        for (unsigned long long j = first; j < len; ++j) query.key(k, v, (cache + j) * dim);
        query.store(out, qrow);
    }
}

extern "C" __global__ void odc_decode_attention_f32(float* out, const float* q, const float* k,
                                                    const float* v, const long long* pads,
                                                    unsigned long long heads,
                                                    unsigned long long kv_heads,
                                                    unsigned long long capacity,
                                                    unsigned long long len,
                                                    unsigned long long dim, float scale,
                                                    unsigned long long n) {
    odc_decode_attention(out, q, k, v, pads, heads, kv_heads, capacity, len, dim, scale, n);
}
extern "C" __global__ void odc_decode_attention_bf16(unsigned short* out, const unsigned short* q,
                                                     const unsigned short* k,
                                                     const unsigned short* v,
                                                     const long long* pads,
                                                     unsigned long long heads,
                                                     unsigned long long kv_heads,
                                                     unsigned long long capacity,
                                                     unsigned long long len,
                                                     unsigned long long dim, float scale,
                                                     unsigned long long n) {
    odc_decode_attention(out, q, k, v, pads, heads, kv_heads, capacity, len, dim, scale, n);
}
