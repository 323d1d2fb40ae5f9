// Element-wise ops, forward and backward, for f32 and bf16 tensors with f32 arithmetic: what
// `fsdp_nn::ops::{swiglu, gelu, bias_gelu, dropout, dropout_packed}` compute on a CUDA device
// (dropout's masks are the CPU's draws).
// Intermediate values the CPU op rounds to the tensor's type (the biased input of
// `bias_gelu`) are rounded here too.
//
// Launch geometry (`crates/fsdp-nn/src/ops/kernel_plan/`): element kernels loop over the
// elements with a stride of the whole grid (any grid and block size); the bias gradient's
// column sums run as `column_partials` on grid (ceil(d / blockDim.x), chunks) and
// `column_totals` on grid ceil(d / blockDim.x), in a fixed order.

#include "common.cuh"

static __device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename T>
static __device__ void swiglu_forward(const T* gate, const T* up, T* y, int n) {
    GRID_STRIDE_LOOP(i, n) {
        const float g = load(gate, i);
        store(y, i, g * sigmoid(g) * load(up, i));
    }
}

// dgate = dy * up * silu'(gate), dup = dy * silu(gate).
template <typename T>
static __device__ void swiglu_backward(const T* gate, const T* up, const T* dy, T* dgate, T* dup,
                                       int n) {
    GRID_STRIDE_LOOP(i, n) {
        const float g = load(gate, i), s = sigmoid(g), d = load(dy, i);
        store(dgate, i, d * load(up, i) * s * (1.0f + g * (1.0f - s)));
        store(dup, i, d * g * s);
    }
}

// gelu(x) and gelu'(x): the erf form, or (`tanh`) the tanh form.
static __device__ __forceinline__ float2 gelu_and_grad(float x, int tanh_form) {
    if (tanh_form) {
        const float k = 0.7978845608028654f;  // sqrt(2 / pi)
        const float t = tanhf(k * (x + 0.044715f * x * x * x));
        const float dinner = k * (1.0f + 3.0f * 0.044715f * x * x);
        return make_float2(0.5f * x * (1.0f + t), 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner);
    }
    const float cdf = 0.5f * (1.0f + erff(x * 0.7071067811865476f));
    const float pdf = 0.3989422804014327f * expf(-0.5f * x * x);
    return make_float2(x * cdf, cdf + x * pdf);
}

// The GELU input of element `i`: `x`, or `x + bias` (broadcast over rows of `d`) rounded.
template <typename T>
static __device__ __forceinline__ float gelu_input(const T* x, const T* bias, long i, int d) {
    return bias == nullptr ? load(x, i) : rounded(x, load(x, i) + load(bias, i % d));
}

template <typename T>
static __device__ void gelu_forward(const T* x, const T* bias, T* y, int n, int d, int tanh_form) {
    GRID_STRIDE_LOOP(i, n) { store(y, i, gelu_and_grad(gelu_input(x, bias, i, d), tanh_form).x); }
}

template <typename T>
static __device__ void gelu_backward(const T* x, const T* bias, const T* g, T* dx, int n, int d,
                                     int tanh_form) {
    GRID_STRIDE_LOOP(i, n) {
        store(dx, i, gelu_and_grad(gelu_input(x, bias, i, d), tanh_form).y * load(g, i));
    }
}

// y = x * scale where element i's draw survives, else 0 (its own backward, on the output's
// gradient). Element i draws i; with `padded_rows` (packed rows of `width` elements), the
// element of row r at column c draws what element (padded_rows[r], c) of the padded batch
// would.
template <typename T>
static __device__ void dropout(const T* x, T* y, const unsigned* padded_rows, int n, int width,
                               unsigned long long seed, unsigned long long threshold,
                               float scale) {
    GRID_STRIDE_LOOP(i, n) {
        const unsigned long long draw =
            padded_rows == nullptr
                ? (unsigned long long)i
                : (unsigned long long)padded_rows[i / width] * width + i % width;
        store(y, i, kept(seed, draw, threshold) ? load(x, i) * scale : 0.0f);
    }
}

// partials[chunk][col] = the sum of m[row][col] over the chunk's rows, in row order.
template <typename T>
static __device__ void column_partials(const T* m, float* partials, int rows, int d,
                                       int rows_per_chunk) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= d) return;
    const long chunk = blockIdx.y;
    const long first = chunk * rows_per_chunk;
    const long end = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
    float s = 0.0f;
    for (long r = first; r < end; r++) s += load(m, r * d + col);
    partials[chunk * d + col] = s;
}

// out[col] = the chunks' partial sums added in chunk order.
template <typename T>
static __device__ void column_totals(const float* partials, T* out, int chunks, int d) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= d) return;
    float s = 0.0f;
    for (long c = 0; c < chunks; c++) s += partials[c * d + col];
    store(out, col, s);
}

#define ACTIVATION_KERNELS(T, SUFFIX)                                                            \
    extern "C" __global__ void fsdp_swiglu_forward_##SUFFIX(const T* gate, const T* up, T* y,    \
                                                            int n) {                             \
        swiglu_forward(gate, up, y, n);                                                          \
    }                                                                                            \
    extern "C" __global__ void fsdp_swiglu_backward_##SUFFIX(                                    \
        const T* gate, const T* up, const T* dy, T* dgate, T* dup, int n) {                      \
        swiglu_backward(gate, up, dy, dgate, dup, n);                                            \
    }                                                                                            \
    extern "C" __global__ void fsdp_gelu_forward_##SUFFIX(const T* x, const T* bias, T* y,       \
                                                          int n, int d, int tanh_form) {         \
        gelu_forward(x, bias, y, n, d, tanh_form);                                               \
    }                                                                                            \
    extern "C" __global__ void fsdp_gelu_backward_##SUFFIX(                                      \
        const T* x, const T* bias, const T* g, T* dx, int n, int d, int tanh_form) {             \
        gelu_backward(x, bias, g, dx, n, d, tanh_form);                                          \
    }                                                                                            \
    extern "C" __global__ void fsdp_dropout_##SUFFIX(                                           \
        const T* x, T* y, const unsigned* padded_rows, int n, int width,                         \
        unsigned long long seed, unsigned long long threshold, float scale) {                    \
        dropout(x, y, padded_rows, n, width, seed, threshold, scale);                            \
    }                                                                                            \
    extern "C" __global__ void fsdp_column_partials_##SUFFIX(const T* m, float* partials,        \
                                                             int rows, int d,                    \
                                                             int rows_per_chunk) {               \
        column_partials(m, partials, rows, d, rows_per_chunk);                                   \
    }                                                                                            \
    extern "C" __global__ void fsdp_column_totals_##SUFFIX(const float* partials, T* out,        \
                                                           int chunks, int d) {                  \
        column_totals(partials, out, chunks, d);                                                 \
    }

ACTIVATION_KERNELS(float, f32)
ACTIVATION_KERNELS(bf16, bf16)
