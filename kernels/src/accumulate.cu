// The `cuda` transport backend's device kernels (odc-transport's `cuda/kernels.rs` launches them),
// compiled at run time with NVRTC.
// No headers: bf16 is widened and narrowed by hand (a bf16 is the upper half of an fp32), so NVRTC
// needs no include path into a CUDA toolkit.
//
// Every kernel is a grid-stride loop over `n` elements. The adds are one fp32 add per element: the
// result equals `acc[i] + src[i]` in fp32 exactly (no fused multiply, no reassociation), as the host
// accumulate (`codec::add_f32_into`) computes it. The encode is bit for bit the host's
// (`codec::encode`, `half::bf16::from_f32`).

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

// dst[i] = bf16(src[i]) for i < n: round to nearest, ties to even; a NaN stays a NaN (quiet bit
// set); exactly half 2.x's `f32_to_bf16`, which the host codec uses (the published bf16 copy of
// master weights kept in device memory).
extern "C" __global__ void odc_encode_bf16(unsigned short* __restrict__ dst,
                                           const float* __restrict__ src,
                                           unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        unsigned int x = __float_as_uint(src[i]);
        unsigned short out;
        if ((x & 0x7fffffffu) > 0x7f800000u) {
            out = (unsigned short)((x >> 16) | 0x0040u);
        } else if ((x & 0x8000u) != 0u && (x & 0x17fffu) != 0u) {
            out = (unsigned short)((x >> 16) + 1u);
        } else {
            out = (unsigned short)(x >> 16);
        }
        dst[i] = out;
    }
}
