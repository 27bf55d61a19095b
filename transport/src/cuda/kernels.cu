// The `cuda` backend's device kernels, compiled at run time with NVRTC (`kernels.rs`).
// No headers: bf16 is widened by hand (a bf16 is the upper half of an fp32, so widening is exact),
// so NVRTC needs no include path into a CUDA toolkit.
//
// Both kernels are grid-stride loops over `n` elements, one fp32 add per element, in element
// order within a thread: the result equals `acc[i] + src[i]` in fp32 exactly (no fused multiply,
// no reassociation), as the host accumulate (`codec::add_f32_into`) computes it.

// acc[i] += src[i] for i < n (fp32 gradient chunk into the fp32 accumulator).
extern "C" __global__ void odc_add_f32(float* __restrict__ acc,
                                       const float* __restrict__ src,
                                       unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        acc[i] += src[i];
    }
}

// acc[i] += widen(src[i]) for i < n (bf16 gradient chunk into the fp32 accumulator).
extern "C" __global__ void odc_add_bf16(float* __restrict__ acc,
                                        const unsigned short* __restrict__ src,
                                        unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        acc[i] += __uint_as_float(((unsigned int)src[i]) << 16);
    }
}
