// The shard server's barrier on the GPU (odc-actors' `server/optimizer_kernels.rs` launches them),
// compiled at run time with NVRTC (`--fmad=false`, IEEE division and square root, no flush to
// zero). Each kernel is the host's code of odc-actors' `server/shard.rs` and odc-policy's
// `optimizer.rs` written in the same order of fp32 operations, so each element comes out
// bitwise as on the host; only the sum of squares is added in another order (per thread, then a
// tree per block, then the blocks in order on the host). Grid-stride loops over `n` elements;
// 256 threads a block (`odc_kernels::BLOCK`, which `BLOCK` below must equal).

#define BLOCK 256

// Barrier phase 1 (`Reduce`): grad[i] = (float)((double)grad[i] * scale), the host's
// `(g as f64 * scale) as f32`, and the sum over the block of the squares of the scaled values in
// double (`(g as f64) * (g as f64)`, exact) into partials[blockIdx.x]. A NaN or an infinity
// anywhere makes its block's partial, and so the server's sum, NaN or infinite.
extern "C" __global__ void odc_scale_sum_sq(float* __restrict__ grad,
                                            unsigned long long n,
                                            double scale,
                                            double* __restrict__ partials) {
    __shared__ double block_sums[BLOCK];
    double sum = 0.0;
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float g = (float)((double)grad[i] * scale);
        grad[i] = g;
        double d = (double)g;
        sum += d * d;
    }
    block_sums[threadIdx.x] = sum;
    __syncthreads();
    for (unsigned int half = blockDim.x / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            block_sums[threadIdx.x] += block_sums[threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = block_sums[0];
    }
}

// The gradient as `Apply` uses it: times `clip` (in double, rounded to float) unless clip is 1.
__device__ __forceinline__ float clipped(float g, double clip) {
    return clip != 1.0 ? (float)((double)g * clip) : g;
}

// Barrier phase 2 (`Apply`), AdamW (`optimizer::AdamScalars`, `adamw_step`):
// p *= decay; m = beta1·m + (1 − beta1)·g; v = beta2·v + (1 − beta2)·g·g;
// p += −step_size · (m / (√v / √(1 − beta2^t) + eps)).
extern "C" __global__ void odc_adamw(float* __restrict__ param,
                                     const float* __restrict__ grad,
                                     float* __restrict__ exp_avg,
                                     float* __restrict__ exp_avg_sq,
                                     unsigned long long n,
                                     double clip,
                                     float decay,
                                     float beta1,
                                     float one_minus_beta1,
                                     float beta2,
                                     float one_minus_beta2,
                                     float step_size,
                                     float bias_correction2_sqrt,
                                     float eps) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float g = clipped(grad[i], clip);
        float p = param[i];
        p *= decay;
        float m = beta1 * exp_avg[i] + one_minus_beta1 * g;
        float v = beta2 * exp_avg_sq[i] + one_minus_beta2 * g * g;
        float denom = sqrtf(v) / bias_correction2_sqrt + eps;
        p += -step_size * (m / denom);
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
}

// Barrier phase 2 (`Apply`), SGD (`optimizer::sgd_step`): d = g + weight_decay·p (or g when the
// decay is 0); mode 0 (no momentum): p += −lr·d; mode 1 (the momentum buffer's first step):
// buf = d, p += −lr·d; mode 2: buf = momentum·buf + d, p += −lr·buf. `buf` is not touched in
// mode 0.
extern "C" __global__ void odc_sgd(float* __restrict__ param,
                                   const float* __restrict__ grad,
                                   float* __restrict__ buf,
                                   unsigned long long n,
                                   double clip,
                                   float lr,
                                   float momentum,
                                   float weight_decay,
                                   int mode) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float g = clipped(grad[i], clip);
        float p = param[i];
        float d = weight_decay != 0.0f ? g + weight_decay * p : g;
        if (mode == 0) {
            p += -lr * d;
        } else if (mode == 1) {
            buf[i] = d;
            p += -lr * d;
        } else {
            float b = momentum * buf[i] + d;
            buf[i] = b;
            p += -lr * b;
        }
        param[i] = p;
    }
}
