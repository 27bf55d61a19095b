// SwiGLU, the gated MLP's activation, elementwise over n values (grid-stride), fp32 arithmetic:
//
//   forward:  out = silu(a) b,  silu(a) = a s,  s = 1 / (1 + exp(−a))
//   backward: da = g b s (1 + a (1 − s)),  db = g silu(a)
//
// `a` is the gate projection, `b` the up projection, `g` the output's gradient.

template <typename T>
__device__ void odc_swiglu_fwd(T* __restrict__ out, const T* __restrict__ a,
                               const T* __restrict__ b, unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float av = odc_load(a, i);
        float s = 1.0f / (1.0f + expf(-av));
        odc_store(out, i, av * s * odc_load(b, i));
    }
}

template <typename T>
__device__ void odc_swiglu_bwd(T* __restrict__ da, T* __restrict__ db, const T* __restrict__ a,
                               const T* __restrict__ b, const T* __restrict__ g,
                               unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float av = odc_load(a, i);
        float bv = odc_load(b, i);
        float gv = odc_load(g, i);
        float s = 1.0f / (1.0f + expf(-av));
        odc_store(da, i, gv * bv * s * (1.0f + av * (1.0f - s)));
        odc_store(db, i, gv * av * s);
    }
}

extern "C" __global__ void odc_swiglu_fwd_f32(float* out, const float* a, const float* b,
                                              unsigned long long n) {
    odc_swiglu_fwd(out, a, b, n);
}
extern "C" __global__ void odc_swiglu_fwd_bf16(unsigned short* out, const unsigned short* a,
                                               const unsigned short* b, unsigned long long n) {
    odc_swiglu_fwd(out, a, b, n);
}
extern "C" __global__ void odc_swiglu_bwd_f32(float* da, float* db, const float* a,
                                              const float* b, const float* g,
                                              unsigned long long n) {
    odc_swiglu_bwd(da, db, a, b, g, n);
}
extern "C" __global__ void odc_swiglu_bwd_bf16(unsigned short* da, unsigned short* db,
                                               const unsigned short* a, const unsigned short* b,
                                               const unsigned short* g, unsigned long long n) {
    odc_swiglu_bwd(da, db, a, b, g, n);
}
