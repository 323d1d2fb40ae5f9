// LayerNorm and RMSNorm over the last dimension, forward and backward, for f32 and bf16
// tensors with f32 arithmetic: what `fsdp_nn::ops::{layer_norm, add_layer_norm, rms_norm}`
// compute on a CUDA device. A residual pointer, where given, is added to `x` first and the
// sum rounded to the tensor's type (`add_layer_norm`). Nothing is kept from forward: the
// backward recomputes each row's mean and 1/std from its inputs, as the CPU op does.
//
// Launch geometry (`crates/fsdp-nn/src/ops/kernel_plan/` plans it; the emulator test runs
// the same plan on the CPU):
// * row kernels: one block per row (grid.x = rows), blockDim.x a multiple of 32, at most 1024;
// * parameter gradients: `partials` on grid (ceil(d / blockDim.x), chunks), one thread per
//   column summing `rows_per_chunk` rows in row order; then `totals` on grid
//   ceil(d / blockDim.x) summing the chunks in order. Every sum has a fixed order: the same
//   inputs give the same bits on every run.

#include "common.cuh"

// Element `i` of the normalised input: `x`, or `x + residual` rounded to `T`.
template <typename T>
static __device__ __forceinline__ float input(const T* x, const T* residual, long i) {
    return residual == nullptr ? load(x, i) : rounded(x, load(x, i) + load(residual, i));
}

// Row `row`'s mean (0 without `center`) and 1/sqrt(var + eps), on every thread.
template <typename T>
static __device__ float2 row_moments(const T* x, const T* residual, long row, int d, float eps,
                                     int center, float* scratch) {
    const long base = row * d;
    float mean = 0.0f;
    if (center) {
        float s = 0.0f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) s += input(x, residual, base + i);
        mean = block_sum(s, scratch) / d;
    }
    float q = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float c = input(x, residual, base + i) - mean;
        q += c * c;
    }
    return make_float2(mean, rsqrtf(block_sum(q, scratch) / d + eps));
}

template <typename T>
static __device__ void norm_forward(const T* x, const T* residual, const T* gamma, const T* beta,
                                    T* y, int d, float eps, int center) {
    __shared__ float scratch[32];
    const long row = blockIdx.x;
    const float2 m = row_moments(x, residual, row, d, eps, center, scratch);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = (input(x, residual, row * d + i) - m.x) * m.y * load(gamma, i);
        if (beta != nullptr) v += load(beta, i);
        store(y, row * d + i, v);
    }
}

// dx of one row (also the residual's gradient), and the row's (mean, 1/std) into
// `row_stats[2 * row ..]` for the parameter gradients.
template <typename T>
static __device__ void norm_backward_rows(const T* x, const T* residual, const T* gamma,
                                          const T* g, T* dx, float* row_stats, int d, float eps,
                                          int center) {
    __shared__ float scratch[32];
    const long row = blockIdx.x;
    const long base = row * d;
    const float2 m = row_moments(x, residual, row, d, eps, center, scratch);
    float s = 0.0f, sx = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float dxhat = load(g, base + i) * load(gamma, i);
        s += dxhat;
        sx += dxhat * (input(x, residual, base + i) - m.x) * m.y;
    }
    const float mean_dxhat = center ? block_sum(s, scratch) / d : 0.0f;
    const float mean_dxhat_xhat = block_sum(sx, scratch) / d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float xhat = (input(x, residual, base + i) - m.x) * m.y;
        const float dxhat = load(g, base + i) * load(gamma, i);
        store(dx, base + i, m.y * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat));
    }
    if (threadIdx.x == 0) {
        row_stats[2 * row] = m.x;
        row_stats[2 * row + 1] = m.y;
    }
}

// partials[chunk][0][col] = sum of g * xhat and partials[chunk][1][col] = sum of g over the
// chunk's rows.
template <typename T>
static __device__ void norm_param_partials(const T* x, const T* residual, const T* g,
                                           const float* row_stats, float* partials, int rows,
                                           int d, int rows_per_chunk) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= d) return;
    const long chunk = blockIdx.y;
    const long first = chunk * rows_per_chunk;
    const long end = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
    float sg = 0.0f, sb = 0.0f;
    for (long r = first; r < end; r++) {
        const float gi = load(g, r * d + col);
        sg += gi * (input(x, residual, r * d + col) - row_stats[2 * r]) * row_stats[2 * r + 1];
        sb += gi;
    }
    partials[(chunk * 2) * d + col] = sg;
    partials[(chunk * 2 + 1) * d + col] = sb;
}

// dgamma (and dbeta, where given) as the chunks' partial sums added in chunk order.
template <typename T>
static __device__ void norm_param_totals(const float* partials, T* dgamma, T* dbeta, int chunks,
                                         int d) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= d) return;
    float sg = 0.0f, sb = 0.0f;
    for (long c = 0; c < chunks; c++) {
        sg += partials[(c * 2) * d + col];
        sb += partials[(c * 2 + 1) * d + col];
    }
    store(dgamma, col, sg);
    if (dbeta != nullptr) store(dbeta, col, sb);
}

#define NORM_KERNELS(T, SUFFIX)                                                                  \
    extern "C" __global__ void fsdp_norm_forward_##SUFFIX(                                       \
        const T* x, const T* residual, const T* gamma, const T* beta, T* y, int d, float eps,    \
        int center) {                                                                            \
        norm_forward(x, residual, gamma, beta, y, d, eps, center);                               \
    }                                                                                            \
    extern "C" __global__ void fsdp_norm_backward_rows_##SUFFIX(                                 \
        const T* x, const T* residual, const T* gamma, const T* g, T* dx, float* row_stats,      \
        int d, float eps, int center) {                                                          \
        norm_backward_rows(x, residual, gamma, g, dx, row_stats, d, eps, center);                \
    }                                                                                            \
    extern "C" __global__ void fsdp_norm_param_partials_##SUFFIX(                                \
        const T* x, const T* residual, const T* g, const float* row_stats, float* partials,      \
        int rows, int d, int rows_per_chunk) {                                                   \
        norm_param_partials(x, residual, g, row_stats, partials, rows, d, rows_per_chunk);       \
    }                                                                                            \
    extern "C" __global__ void fsdp_norm_param_totals_##SUFFIX(                                  \
        const float* partials, T* dgamma, T* dbeta, int chunks, int d) {                         \
        norm_param_totals(partials, dgamma, dbeta, chunks, d);                                   \
    }

NORM_KERNELS(float, f32)
NORM_KERNELS(bf16, bf16)
