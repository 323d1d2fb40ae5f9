// Scaled dot-product attention, forward and backward, for f32 and bf16 `[batch, seq,
// heads * head_dim]` operands with f32 scores, softmax and sums: what
// `fsdp_nn::ops::grouped_query_attention` computes on a CUDA device. Dropout on the
// probabilities draws the CPU op's masks: probability (i, j) of head (b, h) is draw
// `((b * heads + h) * seq + i) * seq + j`. One warp
// per query row (forward, dQ) or per key row (dK, dV), each lane holding head dimensions
// `lane, lane + 32, ...` (head_dim at most 256); the softmax runs online over the keys, so no
// `[seq, seq]` matrix is ever stored: forward keeps each row's log-sum-exp for backward, which
// recomputes the probabilities. Grouped-query heads read their K/V head in place; causal rows
// visit keys `0..=i` only; an additive f32 mask broadcasts by strides (0 on a broadcast
// dimension). Every output element is written by one warp, in a fixed order: the same inputs
// give the same bits.
//
// Launch geometry (`crates/fsdp-nn/src/ops/kernel_plan/`): blocks of `blockDim.x / 32` warps,
// grid (ceil(seq / warps), heads (or kv_heads for dK/dV), batch).

#include "common.cuh"

#define MAX_PER_LANE 8  // head_dim <= 32 * MAX_PER_LANE

static __device__ __forceinline__ float warp_sum(float v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffff, v, m, 32);
    return v;
}

// Where the operands are: element strides of a batch and of a row (the head's columns are
// `head * head_dim` further) for q, k and v, and the mask's strides per (batch, head, query,
// key), 0 where it broadcasts.
struct Strides {
    long q_batch, q_row, k_batch, k_row, v_batch, v_row;
    long m_batch, m_head, m_query, m_key;
};

// Dropout on the probabilities: its seed, the draws' threshold (0: none) and the survivors'
// scale.
struct Dropout {
    unsigned long long seed, threshold;
    float scale;

    // The factor probability (i, j) of head (b, h) is multiplied by: 0 or the scale.
    __device__ __forceinline__ float factor(long b, long h, long i, long j, int heads, int seq) const {
        if (threshold == 0) return 1.0f;
        const unsigned long long draw = (((unsigned long long)b * heads + h) * seq + i) * seq + j;
        return kept(seed, draw, threshold) ? scale : 0.0f;
    }
};

// A head row's elements held by this lane.
template <typename T>
static __device__ __forceinline__ void load_row(const T* row, int head_dim, float* out) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < MAX_PER_LANE; r++) {
        const int c = lane + 32 * r;
        out[r] = c < head_dim ? load(row, c) : 0.0f;
    }
}

static __device__ __forceinline__ float dot(const float* a, const float* b) {
    float s = 0.0f;
#pragma unroll
    for (int r = 0; r < MAX_PER_LANE; r++) s += a[r] * b[r];
    return warp_sum(s);
}

template <typename T>
static __device__ __forceinline__ void store_row(T* row, int head_dim, const float* v, float scale) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < MAX_PER_LANE; r++) {
        const int c = lane + 32 * r;
        if (c < head_dim) store(row, c, v[r] * scale);
    }
}

// The score of query row `i` against key row `j` given their dot product.
static __device__ __forceinline__ float score(float qk, float scale, const float* mask,
                                              const Strides& st, long b, long h, long i, long j) {
    float s = qk * scale;
    if (mask != nullptr)
        s += mask[b * st.m_batch + h * st.m_head + i * st.m_query + j * st.m_key];
    return s;
}

// out[b][i][h] = softmax(q k^T * scale + mask) v over the visible keys; lse[b][h][i] saved.
template <typename T>
static __device__ void attention_forward(const T* q, const T* k, const T* v, const float* mask,
                                         T* out, float* lse, int seq, int heads, int kv_heads,
                                         int head_dim, int causal, float scale, Strides st,
                                         Dropout drop) {
    const long i = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const long h = blockIdx.y, b = blockIdx.z;
    if (i >= seq) return;  // the whole warp
    const long g = h / (heads / kv_heads);
    float qi[MAX_PER_LANE], kj[MAX_PER_LANE], vj[MAX_PER_LANE], acc[MAX_PER_LANE];
    load_row(q + b * st.q_batch + i * st.q_row + h * head_dim, head_dim, qi);
#pragma unroll
    for (int r = 0; r < MAX_PER_LANE; r++) acc[r] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const long keys = causal ? i + 1 : seq;
    for (long j = 0; j < keys; j++) {
        load_row(k + b * st.k_batch + j * st.k_row + g * head_dim, head_dim, kj);
        const float s = score(dot(qi, kj), scale, mask, st, b, h, i, j);
        const float m_new = fmaxf(m, s);
        if (m_new == -INFINITY) continue;  // every key so far masked out entirely
        const float correction = expf(m - m_new), p = expf(s - m_new);
        load_row(v + b * st.v_batch + j * st.v_row + g * head_dim, head_dim, vj);
        l = l * correction + p;
        const float kept_p = p * drop.factor(b, h, i, j, heads, seq);
#pragma unroll
        for (int r = 0; r < MAX_PER_LANE; r++) acc[r] = acc[r] * correction + kept_p * vj[r];
        m = m_new;
    }
    store_row(out + (b * seq + i) * (long)heads * head_dim + h * head_dim, head_dim, acc, 1.0f / l);
    if (threadIdx.x % 32 == 0) lse[(b * heads + h) * seq + i] = m + logf(l);
}

// Backward, first pass, a warp per query row: dQ_i = scale * sum_j dS_ij K_j with
// dS_ij = P_ij (d_ij dO_i . V_j - D_i), d_ij the dropout factor, and D_i = dO_i . O_i, which it keeps in `delta` for the
// second pass. `out` and `dout` are contiguous `[batch, seq, heads * head_dim]`; dQ is written
// with q's strides `dq_batch`, `dq_row`.
template <typename T>
static __device__ void attention_backward_queries(const T* q, const T* k, const T* v,
                                                  const float* mask, const T* out, const T* dout,
                                                  const float* lse, float* delta, T* dq,
                                                  long dq_batch, long dq_row, int seq, int heads,
                                                  int kv_heads, int head_dim, int causal,
                                                  float scale, Strides st, Dropout drop) {
    const long i = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const long h = blockIdx.y, b = blockIdx.z;
    if (i >= seq) return;
    const long g = h / (heads / kv_heads);
    float qi[MAX_PER_LANE], doi[MAX_PER_LANE], kj[MAX_PER_LANE], vj[MAX_PER_LANE];
    float acc[MAX_PER_LANE];
    load_row(q + b * st.q_batch + i * st.q_row + h * head_dim, head_dim, qi);
    const long o_at = (b * seq + i) * (long)heads * head_dim + h * head_dim;
    load_row(dout + o_at, head_dim, doi);
    load_row(out + o_at, head_dim, acc);  // O_i, only for D_i
    const float d_i = dot(doi, acc);
    const float lse_i = lse[(b * heads + h) * seq + i];
#pragma unroll
    for (int r = 0; r < MAX_PER_LANE; r++) acc[r] = 0.0f;
    const long keys = causal ? i + 1 : seq;
    for (long j = 0; j < keys; j++) {
        load_row(k + b * st.k_batch + j * st.k_row + g * head_dim, head_dim, kj);
        load_row(v + b * st.v_batch + j * st.v_row + g * head_dim, head_dim, vj);
        const float p = expf(score(dot(qi, kj), scale, mask, st, b, h, i, j) - lse_i);
        const float ds = p * (dot(doi, vj) * drop.factor(b, h, i, j, heads, seq) - d_i);
#pragma unroll
        for (int r = 0; r < MAX_PER_LANE; r++) acc[r] += ds * kj[r];
    }
    store_row(dq + b * dq_batch + i * dq_row + h * head_dim, head_dim, acc, scale);
    if (threadIdx.x % 32 == 0) delta[(b * heads + h) * seq + i] = d_i;
}

// Backward, second pass, a warp per key row j of K/V head g: over every query row that sees
// it, of every query head g serves, dV_j = sum d_ij P_ij dO_i and dK_j = scale * sum dS_ij Q_i.
// dK and dV are written with strides `dkv_batch`, `dkv_row`.
template <typename T>
static __device__ void attention_backward_keys(const T* q, const T* k, const T* v,
                                               const float* mask, const T* dout, const float* lse,
                                               const float* delta, T* dk, T* dv, long dkv_batch,
                                               long dkv_row, int seq, int heads, int kv_heads,
                                               int head_dim, int causal, float scale,
                                               Strides st, Dropout drop) {
    const long j = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const long g = blockIdx.y, b = blockIdx.z;
    if (j >= seq) return;
    const int group = heads / kv_heads;
    float kj[MAX_PER_LANE], vj[MAX_PER_LANE], qi[MAX_PER_LANE], doi[MAX_PER_LANE];
    float dk_acc[MAX_PER_LANE], dv_acc[MAX_PER_LANE];
    load_row(k + b * st.k_batch + j * st.k_row + g * head_dim, head_dim, kj);
    load_row(v + b * st.v_batch + j * st.v_row + g * head_dim, head_dim, vj);
#pragma unroll
    for (int r = 0; r < MAX_PER_LANE; r++) dk_acc[r] = dv_acc[r] = 0.0f;
    for (long h = g * group; h < (g + 1) * group; h++) {
        for (long i = causal ? j : 0; i < seq; i++) {
            load_row(q + b * st.q_batch + i * st.q_row + h * head_dim, head_dim, qi);
            load_row(dout + (b * seq + i) * (long)heads * head_dim + h * head_dim, head_dim, doi);
            const long row = (b * heads + h) * seq + i;
            const float p = expf(score(dot(qi, kj), scale, mask, st, b, h, i, j) - lse[row]);
            const float factor = drop.factor(b, h, i, j, heads, seq);
            const float ds = p * (dot(doi, vj) * factor - delta[row]);
#pragma unroll
            for (int r = 0; r < MAX_PER_LANE; r++) {
                dv_acc[r] += p * factor * doi[r];
                dk_acc[r] += ds * qi[r];
            }
        }
    }
    store_row(dk + b * dkv_batch + j * dkv_row + g * head_dim, head_dim, dk_acc, scale);
    store_row(dv + b * dkv_batch + j * dkv_row + g * head_dim, head_dim, dv_acc, 1.0f);
}

#define STRIDE_PARAMS                                                                            \
    long q_batch, long q_row, long k_batch, long k_row, long v_batch, long v_row, long m_batch,  \
        long m_head, long m_query, long m_key
#define STRIDES                                                                                  \
    Strides { q_batch, q_row, k_batch, k_row, v_batch, v_row, m_batch, m_head, m_query, m_key }
#define DROPOUT_PARAMS unsigned long long seed, unsigned long long threshold, float keep_scale
#define DROPOUT                                                                                  \
    Dropout { seed, threshold, keep_scale }

#define ATTENTION_KERNELS(T, SUFFIX)                                                             \
    extern "C" __global__ void fsdp_attention_forward_##SUFFIX(                                  \
        const T* q, const T* k, const T* v, const float* mask, T* out, float* lse, int seq,      \
        int heads, int kv_heads, int head_dim, int causal, float scale, STRIDE_PARAMS,           \
        DROPOUT_PARAMS) {                                                                        \
        attention_forward(q, k, v, mask, out, lse, seq, heads, kv_heads, head_dim, causal,       \
                          scale, STRIDES, DROPOUT);                                              \
    }                                                                                            \
    extern "C" __global__ void fsdp_attention_backward_queries_##SUFFIX(                         \
        const T* q, const T* k, const T* v, const float* mask, const T* out, const T* dout,      \
        const float* lse, float* delta, T* dq, long dq_batch, long dq_row, int seq, int heads,   \
        int kv_heads, int head_dim, int causal, float scale, STRIDE_PARAMS, DROPOUT_PARAMS) {    \
        attention_backward_queries(q, k, v, mask, out, dout, lse, delta, dq, dq_batch, dq_row,   \
                                   seq, heads, kv_heads, head_dim, causal, scale, STRIDES,       \
                                   DROPOUT);                                                     \
    }                                                                                            \
    extern "C" __global__ void fsdp_attention_backward_keys_##SUFFIX(                            \
        const T* q, const T* k, const T* v, const float* mask, const T* dout, const float* lse,  \
        const float* delta, T* dk, T* dv, long dkv_batch, long dkv_row, int seq, int heads,      \
        int kv_heads, int head_dim, int causal, float scale, STRIDE_PARAMS, DROPOUT_PARAMS) {    \
        attention_backward_keys(q, k, v, mask, dout, lse, delta, dk, dv, dkv_batch, dkv_row,     \
                                seq, heads, kv_heads, head_dim, causal, scale, STRIDES,          \
                                DROPOUT);                                                        \
    }

ATTENTION_KERNELS(float, f32)
ATTENTION_KERNELS(bf16, bf16)
