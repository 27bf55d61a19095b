// What every kernel source of odc-kernels starts with (prepended by `lib.rs`): loads and stores
// of fp32 and bf16 (`unsigned short`, the upper half of an fp32; stored rounded to nearest, ties
// to even, a NaN kept a NaN: the host codec's `half::bf16::from_f32`), a value as a store of it
// reads back, a warp's sum and maximum, and the bounds of a packed sample.

__device__ __forceinline__ float odc_load(const float* p, unsigned long long i) { return p[i]; }
__device__ __forceinline__ float odc_load(const unsigned short* p, unsigned long long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ unsigned short odc_bf16(float v) {
    unsigned int x = __float_as_uint(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x0040u);
    if ((x & 0x8000u) != 0u && (x & 0x17fffu) != 0u) return (unsigned short)((x >> 16) + 1u);
    return (unsigned short)(x >> 16);
}
__device__ __forceinline__ void odc_store(float* p, unsigned long long i, float v) { p[i] = v; }
__device__ __forceinline__ void odc_store(unsigned short* p, unsigned long long i, float v) {
    p[i] = odc_bf16(v);
}
// `v` as a store into a `T` array would read back (bf16: rounded).
__device__ __forceinline__ float odc_rounded(const float*, float v) { return v; }
__device__ __forceinline__ float odc_rounded(const unsigned short*, float v) {
    return __uint_as_float(((unsigned int)odc_bf16(v)) << 16);
}
__device__ __forceinline__ float odc_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float odc_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Attention's varlen layout: sample s's queries are rows cu_q[s] .. cu_q[s + 1] and its keys rows
// cu_k[s] .. cu_k[s + 1] (cu_k = cu_q for packed self-attention). A query sees its own sample's
// keys; under `causal` only those at or before it, aligned at the sample's ends as FlashAttention
// aligns them (the i-th query sees the j-th key iff j <= i + nk - nq; with nk = nq, j <= i), so
// a sequence's chunk of queries against the same chunk of keys is causal and against an earlier
// chunk (non-causal) sees it all: ring attention's two cases.

// The sample holding row `row` under offsets `cu` (the last s with cu[s] <= row; empty samples
// are skipped over).
__device__ __forceinline__ unsigned long long odc_sample_of(const unsigned long long* __restrict__ cu,
                                                            unsigned long long samples,
                                                            unsigned long long row) {
    unsigned long long lo = 0, hi = samples;
    while (lo + 1 < hi) {
        unsigned long long mid = (lo + hi) / 2;
        if (cu[mid] <= row) lo = mid; else hi = mid;
    }
    return lo;
}

// Query `i`'s keys: rows [*lo, *hi) of k (*hi = *lo when it sees none).
__device__ __forceinline__ void odc_query_keys(const unsigned long long* __restrict__ cu_q,
                                               const unsigned long long* __restrict__ cu_k,
                                               unsigned long long samples, unsigned long long causal,
                                               unsigned long long i, unsigned long long* lo,
                                               unsigned long long* hi) {
    unsigned long long s = odc_sample_of(cu_q, samples, i);
    unsigned long long qs = cu_q[s], qe = cu_q[s + 1], ks = cu_k[s], ke = cu_k[s + 1];
    *lo = ks;
    *hi = ke;
    if (causal) {
        long long last = (long long)(i - qs) + (long long)(ke - ks) - (long long)(qe - qs);
        long long stop = (long long)ks + last + 1;
        if (stop < (long long)ke) *hi = stop > (long long)ks ? (unsigned long long)stop : ks;
    }
}

// Key `j`'s queries: rows [*lo, *hi) of q (the transpose of `odc_query_keys`).
__device__ __forceinline__ void odc_key_queries(const unsigned long long* __restrict__ cu_q,
                                                const unsigned long long* __restrict__ cu_k,
                                                unsigned long long samples, unsigned long long causal,
                                                unsigned long long j, unsigned long long* lo,
                                                unsigned long long* hi) {
    unsigned long long s = odc_sample_of(cu_k, samples, j);
    unsigned long long qs = cu_q[s], qe = cu_q[s + 1], ks = cu_k[s], ke = cu_k[s + 1];
    *lo = qs;
    *hi = qe;
    if (causal) {
        long long first =
            (long long)qs + (long long)(j - ks) - ((long long)(ke - ks) - (long long)(qe - qs));
        if (first > (long long)qs) *lo = first < (long long)qe ? (unsigned long long)first : qe;
    }
}
