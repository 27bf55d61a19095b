// Rotary embedding, Hugging Face's "rotate half" layout (Llama, Qwen): x is rows of `dim` values,
// row r at position (r / group) mod `positions` — group 1 for heads first ([.., positions, dim]),
// the heads for tokens first ([positions, heads, dim]), contiguous; cos and sin are
// [positions, dim / 2] fp32 tables (any scaling, Llama 3's included, is in the tables). One
// thread per (row, pair), n = rows * dim / 2, grid-stride, fp32 arithmetic:
//
//   out[j]        = x[j] cos − x[j + half] (sign · sin)
//   out[j + half] = x[j + half] cos + x[j] (sign · sin)
//
// sign = 1 is the forward; sign = −1 rotates by the opposite angles, which is the backward
// (a rotation's transpose) applied to the output's gradient.

template <typename T>
__device__ void odc_rope(T* __restrict__ out, const T* __restrict__ x,
                         const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                         unsigned long long positions, unsigned long long group,
                         unsigned long long dim, float sign, unsigned long long n) {
    unsigned long long half = dim / 2;
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        unsigned long long row = i / half;
        unsigned long long j = i - row * half;
        unsigned long long at = ((row / group) % positions) * half + j;
        float c = cos_t[at];
        float s = sign * sin_t[at];
        float x1 = odc_load(x, row * dim + j);
        float x2 = odc_load(x, row * dim + half + j);
        odc_store(out, row * dim + j, x1 * c - x2 * s);
        odc_store(out, row * dim + half + j, x2 * c + x1 * s);
    }
}

extern "C" __global__ void odc_rope_f32(float* out, const float* x, const float* cos_t,
                                        const float* sin_t, unsigned long long positions,
                                        unsigned long long group, unsigned long long dim,
                                        float sign, unsigned long long n) {
    odc_rope(out, x, cos_t, sin_t, positions, group, dim, sign, n);
}
extern "C" __global__ void odc_rope_bf16(unsigned short* out, const unsigned short* x,
                                         const float* cos_t, const float* sin_t,
                                         unsigned long long positions, unsigned long long group,
                                         unsigned long long dim, float sign,
                                         unsigned long long n) {
    odc_rope(out, x, cos_t, sin_t, positions, group, dim, sign, n);
}
