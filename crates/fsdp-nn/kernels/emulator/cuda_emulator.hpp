// A CPU emulation of the part of CUDA that fsdp-nn's kernels use, so their logic (indexing,
// reductions, barriers, rounding) is tested on machines without a GPU: each thread of a block
// is an OS thread, `__syncthreads` a barrier of the block, warp shuffles an exchange through
// memory between two barriers of the warp, and `__shared__` memory a static variable (blocks
// run one after another, so one block's threads share it alone). It checks what a kernel
// computes, not how fast, nor CUDA-only faults (launch limits, alignment, races the hardware
// would order differently): a kernel is verified only once it has run on a GPU.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <barrier>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct float2 {
    float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }

namespace fsdp_emulator {
inline dim3 grid_dim, block_dim;
inline thread_local dim3 thread_idx, block_idx;
inline thread_local unsigned linear_tid;
inline std::barrier<>* block_barrier = nullptr;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline std::vector<uint64_t> exchange;

// Runs `kernel()` once per thread of every block of `grid`, blocks in order: one OS thread per
// thread of a block, each running its part of every block in turn, a barrier between blocks
// (so one block's shared memory is done with before the next one's starts).
template <typename F>
void launch(dim3 grid, dim3 block, F kernel) {
    const unsigned threads = block.x * block.y * block.z;
    if (threads == 0 || threads > 1024 || threads % 32 != 0)
        throw std::invalid_argument("block size must be a multiple of 32, at most 1024");
    grid_dim = grid;
    block_dim = block;
    exchange.assign(threads, 0);
    std::barrier<> bar(threads), between_blocks(threads);
    block_barrier = &bar;
    warp_barriers.clear();
    for (unsigned w = 0; w < threads / 32; w++)
        warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; t++)
        pool.emplace_back([&, t] {
            linear_tid = t;
            thread_idx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
            for (unsigned bz = 0; bz < grid.z; bz++)
                for (unsigned by = 0; by < grid.y; by++)
                    for (unsigned bx = 0; bx < grid.x; bx++) {
                        block_idx = dim3(bx, by, bz);
                        kernel();
                        between_blocks.arrive_and_wait();
                    }
        });
    for (auto& th : pool) th.join();
}

template <typename T>
T shfl_xor(T v, int lane_mask, int width) {
    static_assert(sizeof(T) <= sizeof(uint64_t));
    if (width != 32) throw std::invalid_argument("the emulator shuffles whole warps only");
    const unsigned warp = linear_tid / 32, lane = linear_tid % 32;
    memcpy(&exchange[linear_tid], &v, sizeof(T));
    warp_barriers[warp]->arrive_and_wait();
    T out;
    memcpy(&out, &exchange[warp * 32 + (lane ^ (unsigned)lane_mask)], sizeof(T));
    warp_barriers[warp]->arrive_and_wait();
    return out;
}
}  // namespace fsdp_emulator

#define threadIdx fsdp_emulator::thread_idx
#define blockIdx fsdp_emulator::block_idx
#define blockDim fsdp_emulator::block_dim
#define gridDim fsdp_emulator::grid_dim
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
#define __constant__

inline void __syncthreads() { fsdp_emulator::block_barrier->arrive_and_wait(); }

template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
    return fsdp_emulator::shfl_xor(v, lane_mask, width);
}

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

// bfloat16 as CUDA's conversions define it: to float exactly, from float rounded to nearest
// even (NaNs stay NaNs).
struct __nv_bfloat16 {
    uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = (uint32_t)h.bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return __nv_bfloat16{(uint16_t)(u >> 16)};
}
