// Embedding backward: each table row's gradient is the sum of the output gradients of the
// positions that looked it up, added in position order and rounded to the element type after
// each addition, as `fsdp_nn::ops::embedding`'s CPU backward adds them (so a GPU run gives
// the CPU's bits). The positions of each row come from the host, grouped by row
// (`starts[row]..starts[row + 1]` of `positions`, in increasing order; positions of the
// padding row left out); every row is written, zero where no position looked it up. No
// atomics: each element of the table is one thread's.
//
// Launch geometry (`crates/fsdp-nn/src/ops/kernel_plan/`): x over the columns, a thread a
// column; y over the rows, each block taking the rows a whole grid apart.

#include "common.cuh"

#define EMBEDDING_KERNELS(T, SUFFIX)                                                            \
    extern "C" __global__ void fsdp_embedding_backward_##SUFFIX(                                \
        const T* grad, const int* starts, const int* positions, T* dw, int rows, int d) {       \
        const int col = blockIdx.x * blockDim.x + threadIdx.x;                                  \
        if (col >= d) return;                                                                   \
        for (int row = blockIdx.y; row < rows; row += gridDim.y) {                              \
            float acc = 0.0f;                                                                   \
            for (int p = starts[row]; p < starts[row + 1]; ++p)                                 \
                acc = rounded(dw, acc + load(grad, (long)positions[p] * d + col));              \
            store(dw, (long)row * d + col, acc);                                                \
        }                                                                                       \
    }

EMBEDDING_KERNELS(float, f32)
EMBEDDING_KERNELS(bf16, bf16)
