// cudaemu: what nvcc gives device code, for kernels compiled by the host
// C++ compiler. Force-included (-include) into every translated .cu file;
// tests/cudaemu/translate.py has already rewritten kernel launches
// (k<<<grid, block, smem, stream>>>(args) -> cudaemu::launch(...)) and
// dynamic shared memory declarations.
#ifndef CUDAEMU_DEVICE_H
#define CUDAEMU_DEVICE_H

#ifndef __cplusplus
#error "cudaemu_device.h is for C++ translation units"
#endif

#define __CUDACC__ 1
#define __CUDAEMU__ 1

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#include "cuda_runtime.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
// One block runs at a time on each OS thread, so a block's static shared
// memory is a thread-local static.
#define __shared__ static thread_local
#define __constant__ static

namespace cudaemu {

struct thread_state;
struct block_state {
    uint3 idx;
    uint3 dim;
    uint3 grid;
    void *dynamic_smem;
};
struct thread_state {
    uint3 idx;
};
extern thread_local block_state *cur_block;
extern thread_local thread_state *cur_thread;

struct launch_cfg {
    dim3 grid, block;
    size_t smem;
    cudaStream_t stream;
};
static inline launch_cfg cfg(dim3 grid, dim3 block, size_t smem = 0, cudaStream_t stream = 0) {
    return launch_cfg{grid, block, smem, stream};
}

// Runs body once per GPU thread of the grid (fibers; blocks one after another).
void run_grid(const launch_cfg &c, const char *kernel, const void *fn, const std::function<void()> &body);

// Aborts with a message when a pointer argument is neither device memory
// nor pinned host memory (a kernel handed a pageable host pointer).
void check_kernel_pointer(const char *kernel, int index, const void *p);

template <typename A> static inline void check_arg(const char *kernel, int index, const A &a) {
    if constexpr (std::is_pointer<A>::value) check_kernel_pointer(kernel, index, (const void *)a);
}

template <typename K, typename... A> static inline void launch_named(const launch_cfg &c, const char *name, K *k, A... a) {
    int index = 0;
    (check_arg(name, index++, a), ...);
    run_grid(c, name, (const void *)k, [=]() { k(a...); });
}

void *dynamic_smem();
void syncthreads();
// Exchange v across the warp: returns the value lane `src` gave (-1: own).
// orders_memory: a __syncwarp (shuffles do not order memory accesses).
uint64_t warp_exchange(uint32_t mask, uint64_t v, int src, bool orders_memory = false);
int lane_id();

template <typename T> static inline T shfl_from(uint32_t mask, T v, int src) {
    static_assert(sizeof(T) <= 8, "shuffle of more than 8 bytes");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof(T));
    u = warp_exchange(mask, u, src);
    T r;
    memcpy(&r, &u, sizeof(T));
    return r;
}

} // namespace cudaemu

#define threadIdx (cudaemu::cur_thread->idx)
#define blockIdx (cudaemu::cur_block->idx)
#define blockDim (cudaemu::cur_block->dim)
#define gridDim (cudaemu::cur_block->grid)
static constexpr int warpSize = 32;

// CUDA's min/max overloads for mixed integer and floating types.
template <typename A, typename B> static inline typename std::common_type<A, B>::type min(A a, B b) {
    typedef typename std::common_type<A, B>::type T;
    return (T)a < (T)b ? (T)a : (T)b;
}
template <typename A, typename B> static inline typename std::common_type<A, B>::type max(A a, B b) {
    typedef typename std::common_type<A, B>::type T;
    return (T)a > (T)b ? (T)a : (T)b;
}

static inline void __syncthreads() { cudaemu::syncthreads(); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)cudaemu::warp_exchange(mask, 0, -1, true); }

template <typename T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    const int lane = cudaemu::lane_id();
    int src = lane ^ lane_mask;
    if (src / width != lane / width) src = lane; // outside the segment: own value
    return cudaemu::shfl_from(mask, v, src);
}
template <typename T> static inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    const int lane = cudaemu::lane_id();
    const int src = (lane / width) * width + (src_lane % width);
    return cudaemu::shfl_from(mask, v, src);
}
template <typename T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = cudaemu::lane_id();
    int src = lane + (int)delta;
    if (src / width != lane / width) src = lane;
    return cudaemu::shfl_from(mask, v, src);
}

// Blocks run on several OS threads: atomics on global memory are real ones.
template <typename T, typename F> static inline T cudaemu_atomic_update(T *p, F f) {
    T old;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    for (;;) {
        T want = f(old);
        if (__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return old;
    }
}
template <typename T> static inline T atomicAdd(T *p, T v) { return cudaemu_atomic_update(p, [v](T o) { return o + v; }); }
template <typename T> static inline T atomicMax(T *p, T v) { return cudaemu_atomic_update(p, [v](T o) { return v > o ? v : o; }); }
template <typename T> static inline T atomicMin(T *p, T v) { return cudaemu_atomic_update(p, [v](T o) { return v < o ? v : o; }); }

template <typename T> static inline T __ldg(const T *p) { return *p; }
template <typename T> static inline T __ldcs(const T *p) { return *p; }
template <typename T> static inline void __stcs(T *p, T v) { *p = v; }

static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }

// The _rn intrinsics exist so nvcc cannot contract them into FMAs; the
// emulated build is compiled with -ffp-contract=off.
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return std::sqrt(a); }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline float __double2float_rn(double d) { return (float)d; }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
static inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
using std::isfinite;
using std::isinf;
using std::isnan;

#endif
