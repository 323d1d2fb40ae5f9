// Rotary position embedding in the rotate-half layout, forward (`sign` 1) and backward (the
// transposed rotation, `sign` -1), for f32 and bf16 tensors with f32 arithmetic: what
// `fsdp_nn::ops::rope_with` computes on a CUDA device. The angles' cos and sin are f32
// `[positions, head_dim / 2]` tables, one position per sequence position (shared by the
// batch) or per (batch, position).
//
// Launch geometry (`crates/fsdp-nn/src/ops/kernel_plan/`): a loop over every (head row,
// pair) with a stride of the whole grid (any grid and block size).

#include "common.cuh"

template <typename T>
static __device__ void rope(const T* x, const float* cos, const float* sin, T* out, int batch,
                            int heads, int seq, int d, int per_batch, int seq_first, float sign) {
    const int half = d / 2;
    const long pairs = (long)batch * heads * seq * half;
    GRID_STRIDE_LOOP(p, pairs) {
        const int i = p % half;
        const long row = p / half;  // the head row's index in memory order
        const long s = seq_first ? (row / heads) % seq : row % seq;
        const long b = row / ((long)heads * seq);
        const long t = (per_batch ? b * seq + s : s) * half + i;
        const float c = cos[t], sn = sign * sin[t];
        const long at = row * d + i;
        const float a = load(x, at), z = load(x, at + half);
        store(out, at, a * c - z * sn);
        store(out, at + half, z * c + a * sn);
    }
}

#define ROPE_KERNELS(T, SUFFIX)                                                                  \
    extern "C" __global__ void fsdp_rope_##SUFFIX(const T* x, const float* cos, const float* sin, \
                                                  T* out, int batch, int heads, int seq, int d,  \
                                                  int per_batch, int seq_first, float sign) {    \
        rope(x, cos, sin, out, batch, heads, seq, d, per_batch, seq_first, sign);                \
    }

ROPE_KERNELS(float, f32)
ROPE_KERNELS(bf16, bf16)
