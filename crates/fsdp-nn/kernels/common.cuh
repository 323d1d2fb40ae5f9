// What every kernel file of fsdp-nn shares: the CUDA headers (or, for the tests, the CPU
// emulator's), loads and stores of f32 and bf16 elements as f32, and block-wide sums.
#pragma once

#ifdef FSDP_CUDA_EMULATOR
#include "emulator/cuda_emulator.hpp"
#else
#include <cuda_bf16.h>
#endif

typedef __nv_bfloat16 bf16;

static __device__ __forceinline__ float load(const float* p, long i) { return p[i]; }
static __device__ __forceinline__ float load(const bf16* p, long i) { return __bfloat162float(p[i]); }
static __device__ __forceinline__ void store(float* p, long i, float v) { p[i] = v; }
static __device__ __forceinline__ void store(bf16* p, long i, float v) { p[i] = __float2bfloat16(v); }

// `v` rounded to the element type of the pointer's (what an intermediate tensor of that type
// holds in the CPU op).
static __device__ __forceinline__ float rounded(const float*, float v) { return v; }
static __device__ __forceinline__ float rounded(const bf16*, float v) {
    return __bfloat162float(__float2bfloat16(v));
}

// The sum of `v` over the block's threads, returned to every thread. `scratch` holds 32
// floats of shared memory; it may be reused by the next call.
static __device__ float block_sum(float v, float* scratch) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffff, v, m, 32);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // a previous call's readers are done with `scratch`
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? scratch[lane] : 0.0f;
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffff, v, m, 32);
    return v;
}

// The largest `v` over the block's threads, returned to every thread (`scratch` as
// `block_sum`'s).
static __device__ float block_max(float v, float* scratch) {
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, m, 32));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? scratch[lane] : -INFINITY;
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, m, 32));
    return v;
}

// Element `i` over `0..n`, each thread taking the elements a whole grid apart.
#define GRID_STRIDE_LOOP(i, n)                                                                  \
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                        \
         i += (long)gridDim.x * blockDim.x)

// SplitMix64's output function (`fsdp_nn::rng::mix64`).
static __device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Whether dropout's draw `index` under `seed` survives, given the probability's threshold
// on a draw's top 53 bits: the CPU's `dropout_keep`, so both drop the same elements.
static __device__ __forceinline__ bool kept(unsigned long long seed, unsigned long long index,
                                            unsigned long long threshold) {
    return (mix64(seed ^ (index * 0x9E3779B97F4A7C15ull)) >> 11) >= threshold;
}
