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

// The first and one-past-last token of the sample holding `token` (binary search for the last
// sample s with cu_seqlens[s] <= token; empty samples are skipped over).
__device__ __forceinline__ void odc_sample_bounds(const unsigned long long* __restrict__ cu_seqlens,
                                                  unsigned long long samples,
                                                  unsigned long long token,
                                                  unsigned long long* start,
                                                  unsigned long long* end) {
    unsigned long long lo = 0, hi = samples;
    while (lo + 1 < hi) {
        unsigned long long mid = (lo + hi) / 2;
        if (cu_seqlens[mid] <= token) lo = mid; else hi = mid;
    }
    *start = cu_seqlens[lo];
    *end = cu_seqlens[lo + 1];
}
