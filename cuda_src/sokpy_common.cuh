// sokpy_common.cuh -- shared by every kernel in cuda_src/. NVRTC has no system headers, so
// this file includes nothing and uses only built-in types.
#pragma once

typedef long long i64;
typedef unsigned long long u64;

// The launch convention of every kernel: rows (bags, keys, slots) over the grid and over
// threadIdx.y, the embedding dimension over threadIdx.x. A GPU launch packs several rows into a
// block when the dimension is small (kernels.launch_shape); the host launches one emulated
// thread per block, so there both loops reduce to `for (i = blockIdx.x; ...)` and a unit-stride
// dimension loop that g++ vectorises.
#define SOKPY_FOR_ROWS(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.y + threadIdx.y; i < (i64)(n); i += (i64)gridDim.x * blockDim.y)
#define SOKPY_FOR_COLS(d, dim) for (int d = threadIdx.x; d < (dim); d += blockDim.x)

// Combiner codes, as sokpy/lookup.py passes them.
#define SOKPY_SUM 0
#define SOKPY_MEAN 1
#define SOKPY_SQRTN 2

// A hint that a row will be read soon. The host has few threads to hide memory latency with,
// so there it issues a prefetch per cache line; a GPU hides latency with other warps, so
// there it does nothing.
__device__ __forceinline__ void sokpy_prefetch_row(const float* row, int dim) {
#ifdef SOKPY_HOST
    for (int d = 0; d < dim; d += 16) __builtin_prefetch(row + d);
#endif
}

// How many rows ahead a kernel prefetches.
#define SOKPY_PREFETCH_DISTANCE 4

// splitmix64's finalizer: a fixed 64-bit mixing hash (dynamic-table placement, initializers).
__device__ __forceinline__ u64 sokpy_mix64(u64 x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

// Counter-based random numbers: a pure function of (seed, key, stream, column), the same on
// host and device and for every world size. sokpy_row_hash mixes the per-row part once;
// sokpy_uniform01 then costs one mix per column and returns a double in (0, 1) with 53
// random bits.
__device__ __forceinline__ u64 sokpy_row_hash(u64 seed, u64 key, u64 stream) {
    return sokpy_mix64(sokpy_mix64(seed * 0x9e3779b97f4a7c15ULL + stream) ^ key);
}
__device__ __forceinline__ double sokpy_uniform01(u64 row_hash, u64 col) {
    const u64 h = sokpy_mix64(row_hash ^ (col * 0xd1b54a32d192ed03ULL));
    return ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
