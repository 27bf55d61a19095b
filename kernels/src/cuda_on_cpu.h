// What odc's CUDA C uses of CUDA, for the host's C++ compiler (`odc_kernels::emulate`): one block of
// `blockDim.x` threads (a grid-stride loop covers the grid), every thread a fiber on one thread of
// the host. A fiber runs until it reaches a warp collective (`__shfl_xor_sync`, `odc_mma_bf16`:
// it deposits its operands) or `__syncthreads()`, and yields; it is resumed once every lane of its
// warp (or every thread of the block) has arrived there, and reads what the others deposited.
// Deposits are kept per phase parity, so a lane that goes on to its next collective never
// overwrites what another lane has still to read. `__shared__` memory is one block's statics.
//
// What this checks: a kernel's arithmetic, its indexing, which elements it writes, that the lanes
// of a warp meet at every collective and the threads of a block at every barrier (a thread that
// leaves while others wait, or a barrier never reached, is reported). The fibers run in a given
// order (`odc_emu_launch`'s `reverse`): a kernel that reads shared memory another thread writes
// without a barrier between gets different results in the two orders. What it cannot see: the
// GPU's memory model beyond that, the device's own float functions (the host's libm is within an
// ulp of them), the tensor cores' own accumulation order, atomics (the kernels use none).

#include <math.h>
#include <string.h>
#include <ucontext.h>

#include <cstdint>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline

struct odc_emu_dim3 {
    unsigned int x, y, z;
};
static odc_emu_dim3 threadIdx = {0, 0, 0};
static const odc_emu_dim3 blockIdx = {0, 0, 0};
static odc_emu_dim3 blockDim = {32, 1, 1};
static const odc_emu_dim3 gridDim = {1, 1, 1};

static inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}

// Switching between the launcher and a lane: on x86-64 a few instructions (the callee-saved
// registers and the stack pointer), elsewhere ucontext (whose every switch is a system call).
#if defined(__x86_64__)
struct odc_emu_context {
    void* sp;
};
extern "C" void odc_emu_switch(void** save, void* load);
asm(R"(
    .text
    .globl odc_emu_switch
    .type odc_emu_switch, @function
odc_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size odc_emu_switch, .-odc_emu_switch
)");
static inline void odc_emu_swap(odc_emu_context* save, odc_emu_context* load) {
    odc_emu_switch(&save->sp, load->sp);
}
#else
typedef ucontext_t odc_emu_context;
static inline void odc_emu_swap(odc_emu_context* save, odc_emu_context* load) {
    swapcontext(save, load);
}
#endif

#define __shared__ static
#define ODC_EMULATED 1
#define ODC_EMU_MAX_THREADS 1024u

static odc_emu_context odc_emu_main;
static odc_emu_context odc_emu_fibers[ODC_EMU_MAX_THREADS];
static unsigned int odc_emu_threads = 32;
static unsigned int odc_emu_current = 0;
// Collectives of each thread's warp, and barriers of the block, each thread has arrived at.
static unsigned long long odc_emu_warp_phase[ODC_EMU_MAX_THREADS];
static unsigned long long odc_emu_sync_phase[ODC_EMU_MAX_THREADS];
// What a thread waits for: 0 nothing (runnable), 1 its warp, 2 the block.
static int odc_emu_wait[ODC_EMU_MAX_THREADS];
static bool odc_emu_done[ODC_EMU_MAX_THREADS];
// Deposits by phase parity and thread: a shuffle's value, an mma's operands.
static float odc_emu_values[2][ODC_EMU_MAX_THREADS];
static unsigned int odc_emu_mma_a[2][ODC_EMU_MAX_THREADS][4];
static unsigned int odc_emu_mma_b[2][ODC_EMU_MAX_THREADS][2];
static void (*odc_emu_call)(const unsigned long long*) = nullptr;
static const unsigned long long* odc_emu_args = nullptr;

// Arrive at the current thread's next warp collective and wait for the warp; its parity.
static inline unsigned long long odc_emu_warp_arrive() {
    unsigned int me = odc_emu_current;
    unsigned long long parity = odc_emu_warp_phase[me]++ & 1u;
    odc_emu_wait[me] = 1;
    odc_emu_swap(&odc_emu_fibers[me], &odc_emu_main);
    return parity;
}

static inline float __shfl_xor_sync(unsigned int, float v, int mask) {
    unsigned int me = odc_emu_current;
    unsigned long long parity = odc_emu_warp_phase[me] & 1u;
    odc_emu_values[parity][me] = v;
    odc_emu_warp_arrive();
    return odc_emu_values[parity][me ^ (unsigned int)mask];
}

static inline void __syncthreads() {
    unsigned int me = odc_emu_current;
    odc_emu_sync_phase[me]++;
    odc_emu_wait[me] = 2;
    odc_emu_swap(&odc_emu_fibers[me], &odc_emu_main);
}

static inline float odc_emu_bf16_at(unsigned int pair, unsigned int high) {
    unsigned int bits = high ? (pair >> 16) : (pair & 0xffffu);
    unsigned int u = bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// The warp's D = A·B + C as PTX's mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 defines
// its fragments (lane = 4 g + t): A's registers 0-3 hold rows g, g + 8, g, g + 8 at columns
// 2t, 2t + 1 (+ 8 for registers 2, 3), low half first; B's registers 0, 1 rows 2t, 2t + 1
// (+ 8 for register 1) at column g; C's and D's elements 0-3 rows g, g, g + 8, g + 8 at columns
// 2t, 2t + 1, 2t, 2t + 1.
static inline void odc_mma_bf16(float d[4], const unsigned int a[4], const unsigned int b[2],
                                const float c[4]) {
    unsigned int me = odc_emu_current;
    unsigned int warp = me & ~31u;
    unsigned long long parity = odc_emu_warp_phase[me] & 1u;
    for (int i = 0; i < 4; ++i) odc_emu_mma_a[parity][me][i] = a[i];
    for (int i = 0; i < 2; ++i) odc_emu_mma_b[parity][me][i] = b[i];
    float cc[4] = {c[0], c[1], c[2], c[3]};
    odc_emu_warp_arrive();
    unsigned int lane = me & 31u, g = lane >> 2, t = lane & 3u;
    for (int i = 0; i < 4; ++i) {
        unsigned int row = g + (i >= 2 ? 8u : 0u);
        unsigned int col = 2u * t + (unsigned int)(i & 1);
        float sum = cc[i];
        for (unsigned int k = 0; k < 16; ++k) {
            unsigned int kt = (k % 8u) / 2u, hi = k / 8u, half = k & 1u;
            unsigned int a_lane = (row % 8u) * 4u + kt;
            unsigned int a_reg = (row / 8u) + 2u * hi;
            unsigned int b_lane = col * 4u + kt;
            float av = odc_emu_bf16_at(odc_emu_mma_a[parity][warp + a_lane][a_reg], half);
            float bv = odc_emu_bf16_at(odc_emu_mma_b[parity][warp + b_lane][hi], half);
            sum += av * bv;
        }
        d[i] = sum;
    }
}

static void odc_emu_lane_main() {
    odc_emu_call(odc_emu_args);
    odc_emu_done[odc_emu_current] = true;
#if defined(__x86_64__)
    odc_emu_swap(&odc_emu_fibers[odc_emu_current], &odc_emu_main);  // never resumed
    __builtin_trap();
#endif
}

// A thread's context that starts `odc_emu_lane_main` on `stack` of `size` bytes.
static void odc_emu_start(odc_emu_context* fiber, char* stack, size_t size) {
#if defined(__x86_64__)
    uintptr_t top = ((uintptr_t)(stack + size)) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;                          // the entry's return address (it never returns)
    *--sp = (void*)&odc_emu_lane_main;        // where the first switch's `ret` goes
    for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp, rbx, r12-r15
    fiber->sp = sp;
#else
    getcontext(fiber);
    fiber->uc_stack.ss_sp = stack;
    fiber->uc_stack.ss_size = size;
    fiber->uc_link = &odc_emu_main;
    makecontext(fiber, odc_emu_lane_main, 0);
#endif
}

// Whether thread `i` may run: nothing to wait for, or everyone it waits for has arrived.
static bool odc_emu_ready(unsigned int i) {
    if (odc_emu_wait[i] == 0) return true;
    unsigned int first = odc_emu_wait[i] == 1 ? (i & ~31u) : 0u;
    unsigned int last = odc_emu_wait[i] == 1 ? first + 32u : odc_emu_threads;
    // A thread that has arrived may since have gone on, even ended; one that ended before arriving
    // never will (then nobody runs: `odc_emu_launch` reports it).
    for (unsigned int j = first; j < last && j < odc_emu_threads; ++j) {
        if (odc_emu_wait[i] == 1 && odc_emu_warp_phase[j] < odc_emu_warp_phase[i]) return false;
        if (odc_emu_wait[i] == 2 && odc_emu_sync_phase[j] < odc_emu_sync_phase[i]) return false;
    }
    return true;
}

// Run `call(args)` as one block of `threads` (a multiple of 32, at most 1024), resuming the
// runnable threads in ascending order, or descending if `reverse`. 0 when every thread ended; 1
// when threads wait for one another forever (a warp's lanes parted at a collective, or a barrier
// some thread left without reaching).
extern "C" int odc_emu_launch(void (*call)(const unsigned long long*),
                              const unsigned long long* args, unsigned int threads, int reverse) {
    const size_t size = 64u * 1024u;
    static std::vector<char> stacks(ODC_EMU_MAX_THREADS * size);
    if (threads == 0 || threads % 32u != 0 || threads > ODC_EMU_MAX_THREADS) return 1;
    odc_emu_call = call;
    odc_emu_args = args;
    odc_emu_threads = threads;
    blockDim.x = threads;
    for (unsigned int i = 0; i < threads; ++i) {
        odc_emu_start(&odc_emu_fibers[i], stacks.data() + i * size, size);
        odc_emu_warp_phase[i] = 0;
        odc_emu_sync_phase[i] = 0;
        odc_emu_wait[i] = 0;
        odc_emu_done[i] = false;
    }
    for (;;) {
        bool ran = false, live = false;
        for (unsigned int k = 0; k < threads; ++k) {
            unsigned int i = reverse ? threads - 1u - k : k;
            if (odc_emu_done[i]) continue;
            live = true;
            if (!odc_emu_ready(i)) continue;
            odc_emu_wait[i] = 0;
            odc_emu_current = i;
            threadIdx.x = i;
            odc_emu_swap(&odc_emu_main, &odc_emu_fibers[i]);
            ran = true;
        }
        if (!live) return 0;
        if (!ran) return 1;
    }
}

static inline float odc_emu_f32(unsigned long long word) {
    return __uint_as_float((unsigned int)word);
}
static inline double odc_emu_f64(unsigned long long word) {
    double d;
    memcpy(&d, &word, sizeof d);
    return d;
}
