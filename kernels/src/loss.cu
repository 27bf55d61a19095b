// Cross-entropy over rows of `vocab` logits, one target each, forward and backward in one pass
// over the row pair (the head's loss, a chunk of rows at a time so the logits are never whole,
// as Liger's and llm.c's fused classifiers do): fp32 or bf16 logits (`T`), fp32 arithmetic.
// One warp per row: a launch over n = rows * 32 threads, grid-stride.
//
//   lse[r]          = log Σ_c exp(x[r, c])          (natural log; online max and sum)
//   loss[r]         = weight[r] (lse[r] − x[r, target[r]])
//   dlogits[r, c]   = weight[r] (exp(x[r, c] − lse[r]) − [c = target[r]])
//
// A target below 0 (PyTorch's ignore_index, −100) gives loss 0 and a zero row of dlogits; one at
// or past `vocab` is the caller's to refuse (the kernel reads no logit for it and treats it as
// ignored). `dlogits` may be `logits` (in place): every element is read before the lane that
// reads it writes it, and the target's logit is read before any write of the row.
//
// The head's backward a block of classes at a time (its `dw` pass, where a row is never whole)
// takes each row's saved log-sum-exp instead (`odc_softmax_grad_*`, fp32 logits in, `T` out):
//   dlogits[r, c] = weight[r] (exp(x[r, c] − lse[r]) − [first + c = target[r]])
// over a block of `cols` classes starting at class `first`; n = rows * cols, one thread per
// element.

template <typename T>
__device__ void odc_cross_entropy(float* __restrict__ loss, float* __restrict__ lse,
                                  T* dlogits, const T* logits,
                                  const long long* __restrict__ targets,
                                  const float* __restrict__ weights, unsigned long long rows,
                                  unsigned long long vocab, unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += stride) {
        unsigned long long row = t >> 5;
        unsigned int lane = (unsigned int)(t & 31u);
        if (row >= rows) continue;  // a whole warp: n is rows * 32
        unsigned long long base = row * vocab;
        long long target = targets[row];
        bool counted = target >= 0 && (unsigned long long)target < vocab;
        float picked = counted ? odc_load(logits, base + (unsigned long long)target) : 0.0f;
        // Each lane's running maximum and sum of exp(x − maximum) over its columns.
        float m = -__int_as_float(0x7f800000), s = 0.0f;
        for (unsigned long long c = lane; c < vocab; c += 32) {
            float x = odc_load(logits, base + c);
            if (x > m) {
                s = s * expf(m - x) + 1.0f;
                m = x;
            } else {
                s += expf(x - m);
            }
        }
        float top = odc_warp_max(m);
        float total = odc_warp_sum(s > 0.0f ? s * expf(m - top) : 0.0f);
        float l = top + logf(total);
        float wr = counted ? weights[row] : 0.0f;
        if (lane == 0) {
            lse[row] = l;
            loss[row] = counted ? wr * (l - picked) : 0.0f;
        }
        for (unsigned long long c = lane; c < vocab; c += 32) {
            float p = expf(odc_load(logits, base + c) - l);
            float hit = counted && c == (unsigned long long)target ? 1.0f : 0.0f;
            odc_store(dlogits, base + c, wr * (p - hit));
        }
    }
}

extern "C" __global__ void odc_cross_entropy_f32(float* loss, float* lse, float* dlogits,
                                                 const float* logits, const long long* targets,
                                                 const float* weights, unsigned long long rows,
                                                 unsigned long long vocab, unsigned long long n) {
    odc_cross_entropy(loss, lse, dlogits, logits, targets, weights, rows, vocab, n);
}
extern "C" __global__ void odc_cross_entropy_bf16(float* loss, float* lse, unsigned short* dlogits,
                                                  const unsigned short* logits,
                                                  const long long* targets, const float* weights,
                                                  unsigned long long rows,
                                                  unsigned long long vocab, unsigned long long n) {
    odc_cross_entropy(loss, lse, dlogits, logits, targets, weights, rows, vocab, n);
}

template <typename T>
__device__ void odc_softmax_grad(T* __restrict__ dlogits, const float* __restrict__ logits,
                                 const float* __restrict__ lse,
                                 const long long* __restrict__ targets,
                                 const float* __restrict__ weights, unsigned long long cols,
                                 unsigned long long first, unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        unsigned long long row = i / cols;
        unsigned long long c = i - row * cols;
        long long target = targets[row];
        float hit = target >= 0 && (unsigned long long)target == first + c ? 1.0f : 0.0f;
        odc_store(dlogits, i, weights[row] * (expf(logits[i] - lse[row]) - hit));
    }
}

extern "C" __global__ void odc_softmax_grad_f32(float* dlogits, const float* logits,
                                                const float* lse, const long long* targets,
                                                const float* weights, unsigned long long cols,
                                                unsigned long long first, unsigned long long n) {
    odc_softmax_grad(dlogits, logits, lse, targets, weights, cols, first, n);
}
extern "C" __global__ void odc_softmax_grad_bf16(unsigned short* dlogits, const float* logits,
                                                 const float* lse, const long long* targets,
                                                 const float* weights, unsigned long long cols,
                                                 unsigned long long first,
                                                 unsigned long long n) {
    odc_softmax_grad(dlogits, logits, lse, targets, weights, cols, first, n);
}
