// host_shim.h -- lets the plain CUDA C in cuda_src/*.cu compile with g++ for the CPU.
//
// sokpy's kernels are flat: rows (bags, keys) over the grid, the embedding dimension as a
// strided loop over threadIdx.x, no cooperation between threads except through atomics.
// Such a kernel runs unchanged on the host when every emulated thread of every block runs
// the kernel body once, which is what sokpy_host_launch() below does (OpenMP across blocks).
// Anything that needs real cooperating threads is rejected at compile time.
#pragma once

#define SOKPY_HOST 1

#include <cmath>
#include <cstdint>
#include <cstring>

// ---- qualifiers -----------------------------------------------------------------------
// A kernel is inlined into its generated launcher, so the block loop runs the kernel body
// directly (no call per block).
#define __global__ __attribute__((always_inline)) inline
#define __device__ static inline
#define __host__
#define __forceinline__ __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)

// ---- what a flat kernel may not use ----------------------------------------------------
// Each use fails to compile with a message that names the construct.
#define SOKPY_REJECT(what)                                                                    \
    ([] {                                                                                     \
        static_assert(sizeof(what) == 0,                                                      \
                      "sokpy host shim: " what " is not allowed in a sokpy kernel: kernels " \
                      "must be flat (no shared memory, barriers or warp intrinsics)");        \
        return 0;                                                                             \
    }())
#define __shared__ static_assert(false, "sokpy host shim: __shared__ is not allowed in a sokpy kernel: kernels must be flat");
#define __syncthreads() SOKPY_REJECT("__syncthreads")
#define __syncwarp(...) SOKPY_REJECT("__syncwarp")
#define __threadfence() SOKPY_REJECT("__threadfence")
#define __shfl_sync(...) SOKPY_REJECT("__shfl_sync")
#define __shfl_up_sync(...) SOKPY_REJECT("__shfl_up_sync")
#define __shfl_down_sync(...) SOKPY_REJECT("__shfl_down_sync")
#define __shfl_xor_sync(...) SOKPY_REJECT("__shfl_xor_sync")
#define __ballot_sync(...) SOKPY_REJECT("__ballot_sync")
#define __any_sync(...) SOKPY_REJECT("__any_sync")
#define __all_sync(...) SOKPY_REJECT("__all_sync")
#define __activemask() SOKPY_REJECT("__activemask")
#define warpSize SOKPY_REJECT("warpSize")

// ---- thread and block coordinates -----------------------------------------------------
// The host backend launches one emulated thread per block (blockDim = 1): each thread walks
// a whole row, and because blockDim.x and threadIdx.x are compile-time constants here, g++
// turns `for (d = threadIdx.x; d < dim; d += blockDim.x)` into a unit-stride, vectorised loop.
// With SOKPY_EMULATE_BLOCKS (sokpy/backends/kernels/host.py, SOKPY_EMULATE_DEVICE_SHAPES=1) they are
// variables instead, and each block runs the device launch shape's threads one by one.
struct dim3 {
    unsigned int x, y, z;
};
#ifdef SOKPY_EMULATE_BLOCKS
static thread_local dim3 threadIdx __attribute__((tls_model("initial-exec")));
static thread_local dim3 blockDim __attribute__((tls_model("initial-exec")));
#else
static constexpr dim3 threadIdx{0, 0, 0};
static constexpr dim3 blockDim{1, 1, 1};
#endif
// initial-exec: a thread-local access is one register-relative load, not a call to
// __tls_get_addr (which a shared library's default model costs on every access).
static thread_local dim3 blockIdx __attribute__((tls_model("initial-exec")));
static thread_local dim3 gridDim __attribute__((tls_model("initial-exec")));
// ---- atomics (GCC __atomic builtins) ----------------------------------------------------
template <class T>
static inline T sokpy_atomic_add_int(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline int atomicAdd(int* p, int v) { return sokpy_atomic_add_int(p, v); }
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return sokpy_atomic_add_int(p, v); }
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return sokpy_atomic_add_int(p, v);
}
template <class T>
static inline T sokpy_atomic_add_float(T* p, T v) {
    T old, sum;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    do {
        sum = old + v;
    } while (!__atomic_compare_exchange(p, &old, &sum, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
}
static inline float atomicAdd(float* p, float v) { return sokpy_atomic_add_float(p, v); }
static inline double atomicAdd(double* p, double v) { return sokpy_atomic_add_float(p, v); }
template <class T>
static inline T atomicCAS(T* p, T expected, T desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;  // the value seen, as CUDA returns it
}
template <class T>
static inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
template <class T>
static inline T atomicMax(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
template <class T>
static inline T atomicMin(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old > v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}

// ---- device math that g++ lacks ---------------------------------------------------------
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
template <class T>
static inline T min(T a, T b) { return b < a ? b : a; }
template <class T>
static inline T max(T a, T b) { return a < b ? b : a; }

// ---- the launcher ------------------------------------------------------------------------
// Runs body() once per block of the grid, blocks in parallel (OpenMP). Each OpenMP thread
// sets gridDim once and walks its share of the blocks; a 1-D grid (what the host backend
// launches) needs no divisions to find a block's coordinates. `block` is (1, 1, 1) except
// with SOKPY_EMULATE_BLOCKS, where every block runs its threads in order.
template <class Body>
static void sokpy_host_launch(dim3 grid, dim3 block, Body body) {
    const long long nblocks = (long long)grid.x * grid.y * grid.z;
    const bool flat = grid.y == 1 && grid.z == 1;
#pragma omp parallel if (nblocks > 16)
    {
        gridDim = grid;
#ifdef SOKPY_EMULATE_BLOCKS
        blockDim = block;
#else
        (void)block;
#endif
#pragma omp for schedule(static)
        for (long long b = 0; b < nblocks; ++b) {
            blockIdx = flat ? dim3{(unsigned)b, 0, 0}
                            : dim3{(unsigned)(b % grid.x), (unsigned)((b / grid.x) % grid.y),
                                   (unsigned)(b / ((long long)grid.x * grid.y))};
#ifdef SOKPY_EMULATE_BLOCKS
            for (unsigned tz = 0; tz < block.z; ++tz)
                for (unsigned ty = 0; ty < block.y; ++ty)
                    for (unsigned tx = 0; tx < block.x; ++tx) {
                        threadIdx = dim3{tx, ty, tz};
                        body();
                    }
#else
            body();
#endif
        }
    }
}
