// Cross-entropy of logit rows against integer targets (PyTorch's `F.cross_entropy`:
// `ignore_index`, label smoothing), for f32 and bf16 logits with f32 arithmetic: what
// `fsdp_nn::ops::{cross_entropy, linear_cross_entropy}` compute on a CUDA device. Forward
// writes each row's loss and log-sum-exp; backward forms the logits' gradient from the
// log-sum-exps (one exponential per logit); `sum` adds the rows' losses in a fixed order.
//
// Launch geometry (`crates/fsdp-nn/src/ops/kernel_plan/`): forward one block per row
// (blockDim.x a multiple of 32); backward a loop over the elements with a stride of the whole
// grid; `sum` one block.

#include "common.cuh"

// loss_rows[row] = (1 - eps) (lse - z[t]) + eps (lse - mean(z)), lse[row] its log-sum-exp;
// an ignored row's loss is 0 (and its lse NaN).
template <typename T>
static __device__ void cross_entropy_forward(const T* logits, const long* targets,
                                             float* loss_rows, float* lse, int classes,
                                             long ignore_index, float eps) {
    __shared__ float scratch[32];
    const long row = blockIdx.x;
    const long target = targets[row];
    if (target == ignore_index) {  // the whole block
        if (threadIdx.x == 0) {
            loss_rows[row] = 0.0f;
            lse[row] = NAN;
        }
        return;
    }
    const T* z = logits + row * classes;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < classes; j += blockDim.x) m = fmaxf(m, load(z, j));
    m = block_max(m, scratch);
    float e = 0.0f, s = 0.0f;
    for (int j = threadIdx.x; j < classes; j += blockDim.x) {
        const float zj = load(z, j);
        e += expf(zj - m);
        s += zj;
    }
    const float l = m + logf(block_sum(e, scratch));
    const float mean = eps > 0.0f ? block_sum(s, scratch) / classes : 0.0f;
    if (threadIdx.x == 0) {
        loss_rows[row] = (1.0f - eps) * (l - load(z, target)) + eps * (l - mean);
        lse[row] = l;
    }
}

// dlogits = (softmax(z) - (1 - eps) onehot(t) - eps / classes) * scale; 0 on ignored rows.
template <typename T>
static __device__ void cross_entropy_backward(const T* logits, const long* targets,
                                              const float* lse, T* dlogits, long n, int classes,
                                              long ignore_index, float eps, float scale) {
    GRID_STRIDE_LOOP(i, n) {
        const long row = i / classes, j = i % classes;
        const long target = targets[row];
        float g = 0.0f;
        if (target != ignore_index) {
            g = expf(load(logits, i) - lse[row]) - eps / classes;
            if (j == target) g -= 1.0f - eps;
            g *= scale;
        }
        store(dlogits, i, g);
    }
}

// out[0] = scale * the sum of x[0..n], one block, in a fixed order.
static __device__ void sum_rows(const float* x, float* out, int n, float scale) {
    __shared__ float scratch[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) out[0] = s * scale;
}

#define CROSS_ENTROPY_KERNELS(T, SUFFIX)                                                         \
    extern "C" __global__ void fsdp_cross_entropy_forward_##SUFFIX(                              \
        const T* logits, const long* targets, float* loss_rows, float* lse, int classes,         \
        long ignore_index, float eps) {                                                          \
        cross_entropy_forward(logits, targets, loss_rows, lse, classes, ignore_index, eps);      \
    }                                                                                            \
    extern "C" __global__ void fsdp_cross_entropy_backward_##SUFFIX(                             \
        const T* logits, const long* targets, const float* lse, T* dlogits, long n, int classes, \
        long ignore_index, float eps, float scale) {                                             \
        cross_entropy_backward(logits, targets, lse, dlogits, n, classes, ignore_index, eps,     \
                               scale);                                                           \
    }

CROSS_ENTROPY_KERNELS(float, f32)
CROSS_ENTROPY_KERNELS(bf16, bf16)

extern "C" __global__ void fsdp_sum_rows_f32(const float* x, float* out, int n, float scale) {
    sum_rows(x, out, n, scale);
}
