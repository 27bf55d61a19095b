// RMSNorm over the last dimension, forward and backward, for rows of `cols` values: fp32 or bf16
// activations (`T`), fp32 weights, fp32 arithmetic. One warp per row: a launch over
// n = rows * 32 threads, grid-stride, so every lane of a warp works on the same row (n, the block
// and the stride are multiples of 32) and the row's sums are warp shuffles. No headers (bf16 is
// the upper half of an fp32, rounded to nearest even as the host codec does: `common.cuh`, put
// before every source), so NVRTC needs no include path.
//
//   forward:  r = 1 / sqrt(mean(x²) + eps),  out = x r w
//   backward: x̂ = x r,  dx = r (g w − x̂ · mean(g w x̂)),  part = g x̂  (then dw = Σ_rows part,
//             odc_column_sum_f32)
//
// Fused with the residual add before it (a block's `h = h + attn(…)` then the next norm):
//   forward:  s = a + b (stored: the residual stream, rounded as T holds it), out = norm(s)
//   backward: ds = g_res + dx(s, g), the gradient of s both ways (a and b each get ds), with
//             g_res the residual stream's gradient from after it

// 1 / sqrt(mean(x²) + eps) of the row at `base`, summed by the warp (every lane gets it).
template <typename T>
__device__ float odc_row_rstd(const T* __restrict__ x, unsigned long long base,
                              unsigned long long cols, unsigned int lane, float eps) {
    float ss = 0.0f;
    for (unsigned long long c = lane; c < cols; c += 32) {
        float v = odc_load(x, base + c);
        ss += v * v;
    }
    return 1.0f / sqrtf(odc_warp_sum(ss) / (float)cols + eps);
}

template <typename T>
__device__ void odc_rms_norm_fwd(T* __restrict__ out, const T* __restrict__ x,
                                 const float* __restrict__ w, unsigned long long rows,
                                 unsigned long long cols, float eps, unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += stride) {
        unsigned long long row = t >> 5;
        unsigned int lane = (unsigned int)(t & 31u);
        if (row >= rows) continue;  // a whole warp: n is rows * 32
        unsigned long long base = row * cols;
        float r = odc_row_rstd(x, base, cols, lane, eps);
        for (unsigned long long c = lane; c < cols; c += 32) {
            odc_store(out, base + c, odc_load(x, base + c) * r * w[c]);
        }
    }
}

// The backward of both: `g_res` (the residual stream's own gradient, added to dx) may be null.
template <typename T>
__device__ void odc_rms_norm_bwd(T* __restrict__ dx, float* __restrict__ part,
                                 const T* __restrict__ x, const float* __restrict__ w,
                                 const T* __restrict__ g, const T* __restrict__ g_res,
                                 unsigned long long rows, unsigned long long cols, float eps,
                                 unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += stride) {
        unsigned long long row = t >> 5;
        unsigned int lane = (unsigned int)(t & 31u);
        if (row >= rows) continue;
        unsigned long long base = row * cols;
        float r = odc_row_rstd(x, base, cols, lane, eps);
        float dot = 0.0f;
        for (unsigned long long c = lane; c < cols; c += 32) {
            float xhat = odc_load(x, base + c) * r;
            float gv = odc_load(g, base + c);
            dot += gv * w[c] * xhat;
            part[base + c] = gv * xhat;
        }
        dot = odc_warp_sum(dot) / (float)cols;
        for (unsigned long long c = lane; c < cols; c += 32) {
            float xhat = odc_load(x, base + c) * r;
            float gw = odc_load(g, base + c) * w[c];
            float res = g_res != nullptr ? odc_load(g_res, base + c) : 0.0f;
            odc_store(dx, base + c, res + r * (gw - xhat * dot));
        }
    }
}

extern "C" __global__ void odc_rms_norm_fwd_f32(float* out, const float* x, const float* w,
                                                unsigned long long rows, unsigned long long cols,
                                                float eps, unsigned long long n) {
    odc_rms_norm_fwd(out, x, w, rows, cols, eps, n);
}
extern "C" __global__ void odc_rms_norm_fwd_bf16(unsigned short* out, const unsigned short* x,
                                                 const float* w, unsigned long long rows,
                                                 unsigned long long cols, float eps,
                                                 unsigned long long n) {
    odc_rms_norm_fwd(out, x, w, rows, cols, eps, n);
}
extern "C" __global__ void odc_rms_norm_bwd_f32(float* dx, float* part, const float* x,
                                                const float* w, const float* g,
                                                unsigned long long rows, unsigned long long cols,
                                                float eps, unsigned long long n) {
    odc_rms_norm_bwd(dx, part, x, w, g, (const float*)nullptr, rows, cols, eps, n);
}
extern "C" __global__ void odc_rms_norm_bwd_bf16(unsigned short* dx, float* part,
                                                 const unsigned short* x, const float* w,
                                                 const unsigned short* g, unsigned long long rows,
                                                 unsigned long long cols, float eps,
                                                 unsigned long long n) {
    odc_rms_norm_bwd(dx, part, x, w, g, (const unsigned short*)nullptr, rows, cols, eps, n);
}

template <typename T>
__device__ void odc_add_rms_norm_fwd(T* __restrict__ sum, T* __restrict__ out,
                                     const T* __restrict__ a, const T* __restrict__ b,
                                     const float* __restrict__ w, unsigned long long rows,
                                     unsigned long long cols, float eps, unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += stride) {
        unsigned long long row = t >> 5;
        unsigned int lane = (unsigned int)(t & 31u);
        if (row >= rows) continue;  // a whole warp: n is rows * 32
        unsigned long long base = row * cols;
        // Each lane stores and squares its own columns: the norm sees the stream as stored.
        float ss = 0.0f;
        for (unsigned long long c = lane; c < cols; c += 32) {
            float v = odc_rounded(sum, odc_load(a, base + c) + odc_load(b, base + c));
            odc_store(sum, base + c, v);
            ss += v * v;
        }
        float r = 1.0f / sqrtf(odc_warp_sum(ss) / (float)cols + eps);
        for (unsigned long long c = lane; c < cols; c += 32) {
            odc_store(out, base + c, odc_load(sum, base + c) * r * w[c]);
        }
    }
}

extern "C" __global__ void odc_add_rms_norm_fwd_f32(float* sum, float* out, const float* a,
                                                    const float* b, const float* w,
                                                    unsigned long long rows,
                                                    unsigned long long cols, float eps,
                                                    unsigned long long n) {
    odc_add_rms_norm_fwd(sum, out, a, b, w, rows, cols, eps, n);
}
extern "C" __global__ void odc_add_rms_norm_fwd_bf16(unsigned short* sum, unsigned short* out,
                                                     const unsigned short* a,
                                                     const unsigned short* b, const float* w,
                                                     unsigned long long rows,
                                                     unsigned long long cols, float eps,
                                                     unsigned long long n) {
    odc_add_rms_norm_fwd(sum, out, a, b, w, rows, cols, eps, n);
}
extern "C" __global__ void odc_add_rms_norm_bwd_f32(float* ds, float* part, const float* s,
                                                    const float* w, const float* g,
                                                    const float* g_res, unsigned long long rows,
                                                    unsigned long long cols, float eps,
                                                    unsigned long long n) {
    odc_rms_norm_bwd(ds, part, s, w, g, g_res, rows, cols, eps, n);
}
extern "C" __global__ void odc_add_rms_norm_bwd_bf16(unsigned short* ds, float* part,
                                                     const unsigned short* s, const float* w,
                                                     const unsigned short* g,
                                                     const unsigned short* g_res,
                                                     unsigned long long rows,
                                                     unsigned long long cols, float eps,
                                                     unsigned long long n) {
    odc_rms_norm_bwd(ds, part, s, w, g, g_res, rows, cols, eps, n);
}

// out[c] = Σ_r part[r, c] for c < n (= cols), summed in fp64 in row order (deterministic): the
// weight gradient of a norm from the backward's per-row parts.
extern "C" __global__ void odc_column_sum_f32(float* __restrict__ out,
                                              const float* __restrict__ part,
                                              unsigned long long rows, unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long c = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; c < n;
         c += stride) {
        double sum = 0.0;
        for (unsigned long long r = 0; r < rows; ++r) sum += (double)part[r * n + c];
        out[c] = (float)sum;
    }
}
