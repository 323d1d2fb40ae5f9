// Dequantizing a frozen weight held in QLoRA's 4-bit NormalFloat (NF4) blocks into f32: what
// `fsdp_nn::quant::Packing::dequantize_into` gives for `nf4`, on a CUDA device, for
// `fsdp_nn::ops::quantized_linear` (which multiplies by the result and drops it). A row is
// `row_words` 32-bit words holding its blocks back to back, each block a little-endian f32
// absmax then 32 bytes of two 4-bit level indices (high nibble first) for 64 elements.
//
// Launch geometry (`crates/fsdp-nn/src/ops/kernel_plan/`): a loop over every pair of
// elements with a stride of the whole grid.

#include "common.cuh"

// NF4's 16 levels (`quant/format.rs`'s NF4_LEVELS).
__constant__ float NF4_LEVELS[16] = {
    -1.0f,        -0.6961928f,  -0.52507305f, -0.3949175f, -0.28444138f, -0.18477343f,
    -0.091050036f, 0.0f,        0.0795803f,   0.1609302f,  0.2461123f,   0.33791524f,
    0.44070983f,  0.562617f,    0.72295684f,  1.0f};

extern "C" __global__ void fsdp_nf4_dequantize_f32(const unsigned char* words, float* out,
                                                   int rows, int cols, int row_words) {
    const int half = cols / 2;
    GRID_STRIDE_LOOP(p, (long)rows * half) {
        const long row = p / half;
        const int pair = p % half;
        const unsigned char* block = words + row * row_words * 4L + (pair / 32) * 36;
        float absmax;
        memcpy(&absmax, block, 4);
        const unsigned char b = block[4 + pair % 32];
        out[row * cols + 2 * pair] = NF4_LEVELS[b >> 4] * absmax;
        out[row * cols + 2 * pair + 1] = NF4_LEVELS[b & 15] * absmax;
    }
}
