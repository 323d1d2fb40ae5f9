// Softmax over the last dimension and its backward, as `fsdp_nn::ops::softmax_last_dim`
// computes them on the CPU: f32 arithmetic (bf16 widened), the row's largest element
// subtracted before `exp`, the output rounded once; backward `dx = y (g - sum(g y))` from the
// forward's output.
//
// Launch geometry (`crates/fsdp-nn/src/ops/kernel_plan/`): one block per row, whole warps.

#include "common.cuh"

#define SOFTMAX_KERNELS(T, SUFFIX)                                                              \
    extern "C" __global__ void fsdp_softmax_forward_##SUFFIX(const T* x, T* y, int d) {         \
        __shared__ float scratch[32];                                                           \
        const long base = (long)blockIdx.x * d;                                                 \
        float m = -INFINITY;                                                                    \
        for (int j = threadIdx.x; j < d; j += blockDim.x) m = fmaxf(m, load(x, base + j));      \
        m = block_max(m, scratch);                                                              \
        float s = 0.0f;                                                                         \
        for (int j = threadIdx.x; j < d; j += blockDim.x) s += expf(load(x, base + j) - m);     \
        const float inv = 1.0f / block_sum(s, scratch);                                         \
        for (int j = threadIdx.x; j < d; j += blockDim.x)                                       \
            store(y, base + j, expf(load(x, base + j) - m) * inv);                              \
    }                                                                                           \
    extern "C" __global__ void fsdp_softmax_backward_##SUFFIX(const T* y, const T* g, T* dx,    \
                                                              int d) {                          \
        __shared__ float scratch[32];                                                           \
        const long base = (long)blockIdx.x * d;                                                 \
        float s = 0.0f;                                                                         \
        for (int j = threadIdx.x; j < d; j += blockDim.x)                                       \
            s += load(y, base + j) * load(g, base + j);                                         \
        s = block_sum(s, scratch);                                                              \
        for (int j = threadIdx.x; j < d; j += blockDim.x)                                       \
            store(dx, base + j, load(y, base + j) * (load(g, base + j) - s));                   \
    }

SOFTMAX_KERNELS(float, f32)
SOFTMAX_KERNELS(bf16, bf16)
