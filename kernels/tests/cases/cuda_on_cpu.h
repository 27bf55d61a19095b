// What odc-kernels' CUDA C uses of CUDA, for the host's C++ compiler (`emulated.rs`): one block of
// one warp, its 32 lanes run as fibers on one thread. A lane runs until it reaches a
// shuffle, stores its value and yields; once every lane still running has reached that shuffle,
// each is resumed in turn and reads its partner's value. Values are kept per phase parity, so a
// lane that goes on to its next shuffle never overwrites a value another lane has still to read.
//
// What this checks: a kernel's arithmetic, its indexing, which elements it writes, and that the
// lanes of a warp meet at every shuffle (a lane that leaves while others wait is reported). What
// it cannot: the GPU's memory model, other block shapes, the device's own float functions (the
// host's libm is within an ulp of them), shared memory and atomics (the kernels use neither).

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
static const odc_emu_dim3 blockDim = {32, 1, 1};
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

static odc_emu_context odc_emu_main;
static odc_emu_context odc_emu_lanes[32];
static unsigned int odc_emu_current = 0;
static unsigned long long odc_emu_phase[32];
static float odc_emu_values[2][32];
static bool odc_emu_done[32];
static void (*odc_emu_call)(const unsigned long long*) = nullptr;
static const unsigned long long* odc_emu_args = nullptr;

static inline float __shfl_xor_sync(unsigned int, float v, int mask) {
    unsigned int lane = odc_emu_current;
    unsigned long long parity = odc_emu_phase[lane]++ & 1u;
    odc_emu_values[parity][lane] = v;
    odc_emu_swap(&odc_emu_lanes[lane], &odc_emu_main);
    return odc_emu_values[parity][lane ^ (unsigned int)mask];
}

static void odc_emu_lane_main() {
    odc_emu_call(odc_emu_args);
    odc_emu_done[odc_emu_current] = true;
#if defined(__x86_64__)
    odc_emu_swap(&odc_emu_lanes[odc_emu_current], &odc_emu_main);  // never resumed
    __builtin_trap();
#endif
}

// A lane's context that starts `odc_emu_lane_main` on `stack` of `size` bytes.
static void odc_emu_start(odc_emu_context* lane, char* stack, size_t size) {
#if defined(__x86_64__)
    uintptr_t top = ((uintptr_t)(stack + size)) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;                          // the entry's return address (it never returns)
    *--sp = (void*)&odc_emu_lane_main;        // where the first switch's `ret` goes
    for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp, rbx, r12-r15
    lane->sp = sp;
#else
    getcontext(lane);
    lane->uc_stack.ss_sp = stack;
    lane->uc_stack.ss_size = size;
    lane->uc_link = &odc_emu_main;
    makecontext(lane, odc_emu_lane_main, 0);
#endif
}

// Run `call(args)` as one warp of 32 lanes. 0 when every lane ended; 1 when lanes parted at a
// shuffle (some ended or reached a different shuffle while others waited: undefined on a GPU).
extern "C" int odc_emu_launch(void (*call)(const unsigned long long*),
                              const unsigned long long* args) {
    const size_t size = 256u * 1024u;
    static std::vector<char> stacks(32u * size);
    odc_emu_call = call;
    odc_emu_args = args;
    for (unsigned int lane = 0; lane < 32; ++lane) {
        odc_emu_start(&odc_emu_lanes[lane], stacks.data() + lane * size, size);
        odc_emu_phase[lane] = 0;
        odc_emu_done[lane] = false;
    }
    for (;;) {
        unsigned int running = 0;
        for (unsigned int lane = 0; lane < 32; ++lane) {
            if (odc_emu_done[lane]) continue;
            odc_emu_current = lane;
            threadIdx.x = lane;
            odc_emu_swap(&odc_emu_main, &odc_emu_lanes[lane]);
            if (!odc_emu_done[lane]) ++running;
        }
        if (running == 0) return 0;
        // Every lane is still running and waits at the same shuffle (the same count of them).
        for (unsigned int lane = 0; lane < 32; ++lane) {
            if (odc_emu_done[lane] || odc_emu_phase[lane] != odc_emu_phase[0]) return 1;
        }
    }
}

static inline float odc_emu_f32(unsigned long long word) {
    return __uint_as_float((unsigned int)word);
}
