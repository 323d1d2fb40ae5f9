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
// Packed sequences (`fsdp_nn::ops::varlen_attention`: `starts` given, sequences laid end to
// end, batch strides 0): sequence b is rows starts[b]..starts[b + 1] of every operand and of
// the output and attends within itself; `seq` is then the padded batch's length, which the
// saved log-sum-exps and the dropout draws follow, as on the CPU.
//
// Launch geometry (`crates/fsdp-nn/src/ops/kernel_plan/`): blocks of `blockDim.x / 32` warps,
// grid (ceil(seq / warps), heads (or kv_heads for dK/dV), batch); rows past a packed
// sequence's end do nothing.

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

// Where sequence b lies: its tokens, its first row in the operands (after their batch
// stride) and in the output; padded operands hold `seq` rows each.
struct Extent {
    long len, row, out;
};

static __device__ __forceinline__ Extent extent(const unsigned* starts, long b, int seq) {
    if (starts == nullptr) return Extent{seq, 0, b * seq};
    return Extent{(long)starts[b + 1] - (long)starts[b], (long)starts[b], (long)starts[b]};
}

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
                                         Dropout drop, const unsigned* starts) {
    const long i = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const long h = blockIdx.y, b = blockIdx.z;
    const Extent e = extent(starts, b, seq);
    if (i >= e.len) return;  // the whole warp
    const long g = h / (heads / kv_heads);
    float qi[MAX_PER_LANE], kj[MAX_PER_LANE], vj[MAX_PER_LANE], acc[MAX_PER_LANE];
    load_row(q + b * st.q_batch + (e.row + i) * st.q_row + h * head_dim, head_dim, qi);
#pragma unroll
    for (int r = 0; r < MAX_PER_LANE; r++) acc[r] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const long keys = causal ? i + 1 : e.len;
    for (long j = 0; j < keys; j++) {
        load_row(k + b * st.k_batch + (e.row + j) * st.k_row + g * head_dim, head_dim, kj);
        const float s = score(dot(qi, kj), scale, mask, st, b, h, i, j);
        const float m_new = fmaxf(m, s);
        if (m_new == -INFINITY) continue;  // every key so far masked out entirely
        const float correction = expf(m - m_new), p = expf(s - m_new);
        load_row(v + b * st.v_batch + (e.row + j) * st.v_row + g * head_dim, head_dim, vj);
        l = l * correction + p;
        const float kept_p = p * drop.factor(b, h, i, j, heads, seq);
#pragma unroll
        for (int r = 0; r < MAX_PER_LANE; r++) acc[r] = acc[r] * correction + kept_p * vj[r];
        m = m_new;
    }
    store_row(out + (e.out + i) * (long)heads * head_dim + h * head_dim, head_dim, acc, 1.0f / l);
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
                                                  float scale, Strides st, Dropout drop,
                                                  const unsigned* starts) {
    const long i = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const long h = blockIdx.y, b = blockIdx.z;
    const Extent e = extent(starts, b, seq);
    if (i >= e.len) return;
    const long g = h / (heads / kv_heads);
    float qi[MAX_PER_LANE], doi[MAX_PER_LANE], kj[MAX_PER_LANE], vj[MAX_PER_LANE];
    float acc[MAX_PER_LANE];
    load_row(q + b * st.q_batch + (e.row + i) * st.q_row + h * head_dim, head_dim, qi);
    const long o_at = (e.out + i) * (long)heads * head_dim + h * head_dim;
    load_row(dout + o_at, head_dim, doi);
    load_row(out + o_at, head_dim, acc);  // O_i, only for D_i
    const float d_i = dot(doi, acc);
    const float lse_i = lse[(b * heads + h) * seq + i];
#pragma unroll
    for (int r = 0; r < MAX_PER_LANE; r++) acc[r] = 0.0f;
    const long keys = causal ? i + 1 : e.len;
    for (long j = 0; j < keys; j++) {
        load_row(k + b * st.k_batch + (e.row + j) * st.k_row + g * head_dim, head_dim, kj);
        load_row(v + b * st.v_batch + (e.row + j) * st.v_row + g * head_dim, head_dim, vj);
        const float p = expf(score(dot(qi, kj), scale, mask, st, b, h, i, j) - lse_i);
        const float ds = p * (dot(doi, vj) * drop.factor(b, h, i, j, heads, seq) - d_i);
#pragma unroll
        for (int r = 0; r < MAX_PER_LANE; r++) acc[r] += ds * kj[r];
    }
    store_row(dq + b * dq_batch + (e.row + i) * dq_row + h * head_dim, head_dim, acc, scale);
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
                                               Strides st, Dropout drop, const unsigned* starts) {
    const long j = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const long g = blockIdx.y, b = blockIdx.z;
    const Extent e = extent(starts, b, seq);
    if (j >= e.len) return;
    const int group = heads / kv_heads;
    float kj[MAX_PER_LANE], vj[MAX_PER_LANE], qi[MAX_PER_LANE], doi[MAX_PER_LANE];
    float dk_acc[MAX_PER_LANE], dv_acc[MAX_PER_LANE];
    load_row(k + b * st.k_batch + (e.row + j) * st.k_row + g * head_dim, head_dim, kj);
    load_row(v + b * st.v_batch + (e.row + j) * st.v_row + g * head_dim, head_dim, vj);
#pragma unroll
    for (int r = 0; r < MAX_PER_LANE; r++) dk_acc[r] = dv_acc[r] = 0.0f;
    for (long h = g * group; h < (g + 1) * group; h++) {
        for (long i = causal ? j : 0; i < e.len; i++) {
            load_row(q + b * st.q_batch + (e.row + i) * st.q_row + h * head_dim, head_dim, qi);
            load_row(dout + (e.out + i) * (long)heads * head_dim + h * head_dim, head_dim, doi);
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
    store_row(dk + b * dkv_batch + (e.row + j) * dkv_row + g * head_dim, head_dim, dk_acc, scale);
    store_row(dv + b * dkv_batch + (e.row + j) * dkv_row + g * head_dim, head_dim, dv_acc, 1.0f);
}

// ---- Heads of 64: a thread per row, the other operand's rows in shared-memory tiles ----
// Each thread keeps its row's vectors in registers (fully unrolled loops over the 64
// dimensions) and reads the tile's rows as broadcasts (every thread the same element), so a
// score costs 64 multiply-adds and no shuffles. Rows of a tile are padded to 65 floats: the
// cooperative loads (and a thread reading its own row) hit distinct banks.
#define HD 64
#define PAD 65

// Rows `first..first + count` of one head (`head_at` elements into each row) of `src`, rows
// `row_stride` apart, into `tile` as f32, the block's threads loading consecutive elements.
template <typename T>
static __device__ __forceinline__ void load_tile(float (*tile)[PAD], const T* src, long row_stride,
                                                 long first, int count) {
    for (int e = threadIdx.x; e < count * HD; e += blockDim.x) {
        const int r = e / HD, d = e % HD;
        tile[r][d] = load(src + (first + r) * row_stride, d);
    }
}

// Forward: a block of 64 query rows of head (b, h), key tiles of 64.
template <typename T>
static __device__ void attention_forward_64(const T* q, const T* k, const T* v, const float* mask,
                                            T* out, float* lse, int seq, int heads, int kv_heads,
                                            int causal, float scale, Strides st, Dropout drop,
                                            const unsigned* starts) {
    __shared__ float ks[64][PAD];
    __shared__ float vs[64][PAD];
    const long h = blockIdx.y, b = blockIdx.z, g = h / (heads / kv_heads);
    const Extent e = extent(starts, b, seq);
    const long first = (long)blockIdx.x * 64, i = first + threadIdx.x;
    if (first >= e.len) return;  // the whole block: past a packed sequence's end
    const bool active = i < e.len;
    float qi[HD], acc[HD];
#pragma unroll
    for (int d = 0; d < HD; d++) {
        qi[d] = active ? load(q + b * st.q_batch + (e.row + i) * st.q_row + h * HD, d) : 0.0f;
        acc[d] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    const long last = causal ? (first + 64 < e.len ? first + 64 : e.len) : e.len;
    for (long j0 = 0; j0 < last; j0 += 64) {
        const int count = last - j0 < 64 ? (int)(last - j0) : 64;
        __syncthreads();  // the previous tile's readers are done
        load_tile(ks, k + b * st.k_batch + e.row * st.k_row + g * HD, st.k_row, j0, count);
        load_tile(vs, v + b * st.v_batch + e.row * st.v_row + g * HD, st.v_row, j0, count);
        __syncthreads();
        if (!active) continue;
        const long visible = causal ? i + 1 - j0 : count;
        const int end = visible < count ? (int)visible : count;
        for (int jj = 0; jj < end; jj++) {
            float s = 0.0f;
#pragma unroll
            for (int d = 0; d < HD; d++) s += qi[d] * ks[jj][d];
            s = score(s, scale, mask, st, b, h, i, j0 + jj);
            const float m_new = fmaxf(m, s);
            if (m_new == -INFINITY) continue;  // every key so far masked out entirely
            if (m_new > m) {
                const float correction = expf(m - m_new);
                l *= correction;
#pragma unroll
                for (int d = 0; d < HD; d++) acc[d] *= correction;
                m = m_new;
            }
            const float p = expf(s - m);
            l += p;
            const float kept_p = p * drop.factor(b, h, i, j0 + jj, heads, seq);
#pragma unroll
            for (int d = 0; d < HD; d++) acc[d] += kept_p * vs[jj][d];
        }
    }
    if (!active) return;
    T* o = out + (e.out + i) * (long)heads * HD + h * HD;
#pragma unroll
    for (int d = 0; d < HD; d++) store(o, d, acc[d] / l);
    lse[(b * heads + h) * seq + i] = m + logf(l);
}

// Backward, first pass: a block of 64 query rows of head (b, h) (their q in shared memory),
// key tiles of 32; as `attention_backward_queries`.
template <typename T>
static __device__ void attention_backward_queries_64(
    const T* q, const T* k, const T* v, const float* mask, const T* out, const T* dout,
    const float* lse, float* delta, T* dq, long dq_batch, long dq_row, int seq, int heads,
    int kv_heads, int causal, float scale, Strides st, Dropout drop, const unsigned* starts) {
    __shared__ float qs[64][PAD];
    __shared__ float ks[32][PAD];
    __shared__ float vs[32][PAD];
    const long h = blockIdx.y, b = blockIdx.z, g = h / (heads / kv_heads);
    const Extent e = extent(starts, b, seq);
    const long first = (long)blockIdx.x * 64, i = first + threadIdx.x;
    if (first >= e.len) return;  // the whole block
    const bool active = i < e.len;
    const int rows = e.len - first < 64 ? (int)(e.len - first) : 64;
    load_tile(qs, q + b * st.q_batch + e.row * st.q_row + h * HD, st.q_row, first, rows);
    float doi[HD], acc[HD];
    float d_i = 0.0f;
    const long o_at = (e.out + i) * (long)heads * HD + h * HD;
#pragma unroll
    for (int d = 0; d < HD; d++) {
        doi[d] = active ? load(dout + o_at, d) : 0.0f;
        d_i += active ? doi[d] * load(out + o_at, d) : 0.0f;
        acc[d] = 0.0f;
    }
    const float lse_i = active ? lse[(b * heads + h) * seq + i] : 0.0f;
    const long last = causal ? (first + 64 < e.len ? first + 64 : e.len) : e.len;
    for (long j0 = 0; j0 < last; j0 += 32) {
        const int count = last - j0 < 32 ? (int)(last - j0) : 32;
        __syncthreads();
        load_tile(ks, k + b * st.k_batch + e.row * st.k_row + g * HD, st.k_row, j0, count);
        load_tile(vs, v + b * st.v_batch + e.row * st.v_row + g * HD, st.v_row, j0, count);
        __syncthreads();
        if (!active) continue;
        const long visible = causal ? i + 1 - j0 : count;
        const int end = visible < count ? (int)visible : count;
        const int t = threadIdx.x;
        for (int jj = 0; jj < end; jj++) {
            float s = 0.0f, dp = 0.0f;
#pragma unroll
            for (int d = 0; d < HD; d++) {
                s += qs[t][d] * ks[jj][d];
                dp += doi[d] * vs[jj][d];
            }
            const float p = expf(score(s, scale, mask, st, b, h, i, j0 + jj) - lse_i);
            const float ds = p * (dp * drop.factor(b, h, i, j0 + jj, heads, seq) - d_i);
#pragma unroll
            for (int d = 0; d < HD; d++) acc[d] += ds * ks[jj][d];
        }
    }
    if (!active) return;
    T* row = dq + b * dq_batch + (e.row + i) * dq_row + h * HD;
#pragma unroll
    for (int d = 0; d < HD; d++) store(row, d, acc[d] * scale);
    delta[(b * heads + h) * seq + i] = d_i;
}

// Backward, second pass: a block of 32 key rows of K/V head (b, g) (their k and v in shared
// memory), query tiles of 32 of every head g serves; as `attention_backward_keys`.
template <typename T>
static __device__ void attention_backward_keys_64(
    const T* q, const T* k, const T* v, const float* mask, const T* dout, const float* lse,
    const float* delta, T* dk, T* dv, long dkv_batch, long dkv_row, int seq, int heads,
    int kv_heads, int causal, float scale, Strides st, Dropout drop, const unsigned* starts) {
    __shared__ float kjs[32][PAD];
    __shared__ float vjs[32][PAD];
    __shared__ float qs[32][PAD];
    __shared__ float dos[32][PAD];
    __shared__ float lses[32];
    __shared__ float deltas[32];
    const long g = blockIdx.y, b = blockIdx.z;
    const Extent e = extent(starts, b, seq);
    const long first = (long)blockIdx.x * 32, j = first + threadIdx.x;
    if (first >= e.len) return;  // the whole block
    const bool active = j < e.len;
    const int rows = e.len - first < 32 ? (int)(e.len - first) : 32;
    load_tile(kjs, k + b * st.k_batch + e.row * st.k_row + g * HD, st.k_row, first, rows);
    load_tile(vjs, v + b * st.v_batch + e.row * st.v_row + g * HD, st.v_row, first, rows);
    float dk_acc[HD], dv_acc[HD];
#pragma unroll
    for (int d = 0; d < HD; d++) dk_acc[d] = dv_acc[d] = 0.0f;
    const int group = heads / kv_heads;
    const int t = threadIdx.x;
    for (long h = g * group; h < (g + 1) * group; h++) {
        for (long i0 = causal ? first : 0; i0 < e.len; i0 += 32) {
            const int count = e.len - i0 < 32 ? (int)(e.len - i0) : 32;
            __syncthreads();
            load_tile(qs, q + b * st.q_batch + e.row * st.q_row + h * HD, st.q_row, i0, count);
            load_tile(dos, dout + e.out * (long)heads * HD + h * HD, (long)heads * HD, i0, count);
            for (int r = threadIdx.x; r < count; r += blockDim.x) {
                lses[r] = lse[(b * heads + h) * seq + i0 + r];
                deltas[r] = delta[(b * heads + h) * seq + i0 + r];
            }
            __syncthreads();
            if (!active) continue;
            for (int ii = 0; ii < count; ii++) {
                const long i = i0 + ii;
                if (causal && i < j) continue;
                float s = 0.0f, dp = 0.0f;
#pragma unroll
                for (int d = 0; d < HD; d++) {
                    s += qs[ii][d] * kjs[t][d];
                    dp += dos[ii][d] * vjs[t][d];
                }
                const float p = expf(score(s, scale, mask, st, b, h, i, j) - lses[ii]);
                const float factor = drop.factor(b, h, i, j, heads, seq);
                const float ds = p * (dp * factor - deltas[ii]);
#pragma unroll
                for (int d = 0; d < HD; d++) {
                    dv_acc[d] += p * factor * dos[ii][d];
                    dk_acc[d] += ds * qs[ii][d];
                }
            }
        }
    }
    if (!active) return;
#pragma unroll
    for (int d = 0; d < HD; d++) {
        store(dk + b * dkv_batch + (e.row + j) * dkv_row + g * HD, d, dk_acc[d] * scale);
        store(dv + b * dkv_batch + (e.row + j) * dkv_row + g * HD, d, dv_acc[d]);
    }
}

#define STRIDE_PARAMS                                                                            \
    long q_batch, long q_row, long k_batch, long k_row, long v_batch, long v_row, long m_batch,  \
        long m_head, long m_query, long m_key
#define STRIDES                                                                                  \
    Strides { q_batch, q_row, k_batch, k_row, v_batch, v_row, m_batch, m_head, m_query, m_key }
// Dropout's, then the packed sequences' starts (null for a padded batch).
#define TAIL_PARAMS                                                                              \
    unsigned long long seed, unsigned long long threshold, float keep_scale,                     \
        const unsigned* starts
#define DROPOUT                                                                                  \
    Dropout { seed, threshold, keep_scale }

#define ATTENTION_KERNELS(T, SUFFIX)                                                             \
    extern "C" __global__ void fsdp_attention_forward_##SUFFIX(                                  \
        const T* q, const T* k, const T* v, const float* mask, T* out, float* lse, int seq,      \
        int heads, int kv_heads, int head_dim, int causal, float scale, STRIDE_PARAMS,           \
        TAIL_PARAMS) {                                                                           \
        attention_forward(q, k, v, mask, out, lse, seq, heads, kv_heads, head_dim, causal,       \
                          scale, STRIDES, DROPOUT, starts);                                      \
    }                                                                                            \
    extern "C" __global__ void fsdp_attention_backward_queries_##SUFFIX(                         \
        const T* q, const T* k, const T* v, const float* mask, const T* out, const T* dout,      \
        const float* lse, float* delta, T* dq, long dq_batch, long dq_row, int seq, int heads,   \
        int kv_heads, int head_dim, int causal, float scale, STRIDE_PARAMS, TAIL_PARAMS) {       \
        attention_backward_queries(q, k, v, mask, out, dout, lse, delta, dq, dq_batch, dq_row,   \
                                   seq, heads, kv_heads, head_dim, causal, scale, STRIDES,       \
                                   DROPOUT, starts);                                             \
    }                                                                                            \
    extern "C" __global__ void fsdp_attention_backward_keys_##SUFFIX(                            \
        const T* q, const T* k, const T* v, const float* mask, const T* dout, const float* lse,  \
        const float* delta, T* dk, T* dv, long dkv_batch, long dkv_row, int seq, int heads,      \
        int kv_heads, int head_dim, int causal, float scale, STRIDE_PARAMS, TAIL_PARAMS) {       \
        attention_backward_keys(q, k, v, mask, dout, lse, delta, dk, dv, dkv_batch, dkv_row,     \
                                seq, heads, kv_heads, head_dim, causal, scale, STRIDES,          \
                                DROPOUT, starts);                                                \
    }

#define ATTENTION_64_KERNELS(T, SUFFIX)                                                          \
    extern "C" __global__ void fsdp_attention_forward64_##SUFFIX(                                \
        const T* q, const T* k, const T* v, const float* mask, T* out, float* lse, int seq,      \
        int heads, int kv_heads, int head_dim, int causal, float scale, STRIDE_PARAMS,           \
        TAIL_PARAMS) {                                                                           \
        attention_forward_64(q, k, v, mask, out, lse, seq, heads, kv_heads, causal, scale,       \
                             STRIDES, DROPOUT, starts);                                          \
    }                                                                                            \
    extern "C" __global__ void fsdp_attention_backward_queries64_##SUFFIX(                       \
        const T* q, const T* k, const T* v, const float* mask, const T* out, const T* dout,      \
        const float* lse, float* delta, T* dq, long dq_batch, long dq_row, int seq, int heads,   \
        int kv_heads, int head_dim, int causal, float scale, STRIDE_PARAMS, TAIL_PARAMS) {       \
        attention_backward_queries_64(q, k, v, mask, out, dout, lse, delta, dq, dq_batch,        \
                                      dq_row, seq, heads, kv_heads, causal, scale, STRIDES,      \
                                      DROPOUT, starts);                                          \
    }                                                                                            \
    extern "C" __global__ void fsdp_attention_backward_keys64_##SUFFIX(                          \
        const T* q, const T* k, const T* v, const float* mask, const T* dout, const float* lse,  \
        const float* delta, T* dk, T* dv, long dkv_batch, long dkv_row, int seq, int heads,      \
        int kv_heads, int head_dim, int causal, float scale, STRIDE_PARAMS, TAIL_PARAMS) {       \
        attention_backward_keys_64(q, k, v, mask, dout, lse, delta, dk, dv, dkv_batch, dkv_row,  \
                                   seq, heads, kv_heads, causal, scale, STRIDES, DROPOUT,        \
                                   starts);                                                      \
    }

ATTENTION_KERNELS(float, f32)
ATTENTION_KERNELS(bf16, bf16)
ATTENTION_64_KERNELS(float, f32)
ATTENTION_64_KERNELS(bf16, bf16)
