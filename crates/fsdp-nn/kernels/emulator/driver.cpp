// Runs a launch plan of fsdp-nn's CUDA kernels on the CPU emulator (cuda_emulator.hpp), for
// the Rust tests that compare the kernels with the CPU ops. Usage: `driver PLAN DIR`. PLAN's
// lines: `buffer I BYTES` (DIR/bufI.bin, or zeros where it is missing), then `launch NAME GX GY
// GZ BX BY BZ ARG...` with each ARG `bI` (buffer I), `null`, `iN` (an int), `lN` (a long),
// `uN` (an unsigned long long) or `fHEX` (a float's bits). Every buffer is written back to DIR/bufI.out. Errors go to stderr
// with exit code 1. (`#pragma unroll`, CUDA's, is no pragma to the host compiler.)
#include <stdio.h>
#include <stdlib.h>

#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include "../activations.cu"
#include "../attention.cu"
#include "../cross_entropy.cu"
#include "../embedding.cu"
#include "../norm.cu"
#include "../quant.cu"
#include "../rope.cu"
#include "../softmax.cu"

struct Arg {
    void* p = nullptr;
    int i = 0;
    long l = 0;
    unsigned long long u = 0;
    float f = 0.0f;
};
using Kernel = std::function<void(const std::vector<Arg>&)>;

#define P(k, T) static_cast<T>(a.at(k).p)
#define REGISTER_NORM(T, S)                                                                    \
    table["fsdp_norm_forward_" #S] = [](const std::vector<Arg>& a) {                           \
        fsdp_norm_forward_##S(P(0, const T*), P(1, const T*), P(2, const T*), P(3, const T*),  \
                              P(4, T*), a.at(5).i, a.at(6).f, a.at(7).i);                      \
    };                                                                                         \
    table["fsdp_norm_backward_rows_" #S] = [](const std::vector<Arg>& a) {                     \
        fsdp_norm_backward_rows_##S(P(0, const T*), P(1, const T*), P(2, const T*),            \
                                    P(3, const T*), P(4, T*), P(5, float*), a.at(6).i,         \
                                    a.at(7).f, a.at(8).i);                                     \
    };                                                                                         \
    table["fsdp_norm_param_partials_" #S] = [](const std::vector<Arg>& a) {                    \
        fsdp_norm_param_partials_##S(P(0, const T*), P(1, const T*), P(2, const T*),           \
                                     P(3, const float*), P(4, float*), a.at(5).i, a.at(6).i,   \
                                     a.at(7).i);                                               \
    };                                                                                         \
    table["fsdp_norm_param_totals_" #S] = [](const std::vector<Arg>& a) {                      \
        fsdp_norm_param_totals_##S(P(0, const float*), P(1, T*), P(2, T*), a.at(3).i,          \
                                   a.at(4).i);                                                 \
    };

#define REGISTER_ACTIVATIONS(T, S)                                                             \
    table["fsdp_swiglu_forward_" #S] = [](const std::vector<Arg>& a) {                         \
        fsdp_swiglu_forward_##S(P(0, const T*), P(1, const T*), P(2, T*), a.at(3).i);          \
    };                                                                                         \
    table["fsdp_swiglu_backward_" #S] = [](const std::vector<Arg>& a) {                        \
        fsdp_swiglu_backward_##S(P(0, const T*), P(1, const T*), P(2, const T*), P(3, T*),     \
                                 P(4, T*), a.at(5).i);                                         \
    };                                                                                         \
    table["fsdp_gelu_forward_" #S] = [](const std::vector<Arg>& a) {                           \
        fsdp_gelu_forward_##S(P(0, const T*), P(1, const T*), P(2, T*), a.at(3).i, a.at(4).i,  \
                              a.at(5).i);                                                      \
    };                                                                                         \
    table["fsdp_gelu_backward_" #S] = [](const std::vector<Arg>& a) {                          \
        fsdp_gelu_backward_##S(P(0, const T*), P(1, const T*), P(2, const T*), P(3, T*),       \
                               a.at(4).i, a.at(5).i, a.at(6).i);                               \
    };                                                                                         \
    table["fsdp_dropout_" #S] = [](const std::vector<Arg>& a) {                                \
        fsdp_dropout_##S(P(0, const T*), P(1, T*), P(2, const unsigned*), a.at(3).i, a.at(4).i, \
                         a.at(5).u, a.at(6).u, a.at(7).f);                                     \
    };                                                                                         \
    table["fsdp_column_partials_" #S] = [](const std::vector<Arg>& a) {                        \
        fsdp_column_partials_##S(P(0, const T*), P(1, float*), a.at(2).i, a.at(3).i,           \
                                 a.at(4).i);                                                   \
    };                                                                                         \
    table["fsdp_column_totals_" #S] = [](const std::vector<Arg>& a) {                          \
        fsdp_column_totals_##S(P(0, const float*), P(1, T*), a.at(2).i, a.at(3).i);            \
    };

#define REGISTER_ROPE(T, S)                                                                    \
    table["fsdp_rope_" #S] = [](const std::vector<Arg>& a) {                                   \
        fsdp_rope_##S(P(0, const T*), P(1, const float*), P(2, const float*), P(3, T*),        \
                      a.at(4).i, a.at(5).i, a.at(6).i, a.at(7).i, a.at(8).i, a.at(9).i,        \
                      a.at(10).f);                                                             \
    };

#define L(k) a.at(k).l
#define STRIDE_ARGS(k) L(k), L(k + 1), L(k + 2), L(k + 3), L(k + 4), L(k + 5), L(k + 6), L(k + 7), \
                       L(k + 8), L(k + 9)
// Dropout's arguments, then the packed sequences' starts.
#define TAIL_ARGS(k) a.at(k).u, a.at(k + 1).u, a.at(k + 2).f, P(k + 3, const unsigned*)
#define REGISTER_ATTENTION(T, S)                                                               \
    table["fsdp_attention_forward_" #S] = [](const std::vector<Arg>& a) {                      \
        fsdp_attention_forward_##S(P(0, const T*), P(1, const T*), P(2, const T*),             \
                                   P(3, const float*), P(4, T*), P(5, float*), a.at(6).i,      \
                                   a.at(7).i, a.at(8).i, a.at(9).i, a.at(10).i, a.at(11).f,    \
                                   STRIDE_ARGS(12), TAIL_ARGS(22));                            \
    };                                                                                         \
    table["fsdp_attention_backward_queries_" #S] = [](const std::vector<Arg>& a) {             \
        fsdp_attention_backward_queries_##S(                                                   \
            P(0, const T*), P(1, const T*), P(2, const T*), P(3, const float*), P(4, const T*), \
            P(5, const T*), P(6, const float*), P(7, float*), P(8, T*), L(9), L(10), a.at(11).i, \
            a.at(12).i, a.at(13).i, a.at(14).i, a.at(15).i, a.at(16).f, STRIDE_ARGS(17),       \
            TAIL_ARGS(27));                                                                    \
    };                                                                                         \
    table["fsdp_attention_backward_keys_" #S] = [](const std::vector<Arg>& a) {                \
        fsdp_attention_backward_keys_##S(                                                      \
            P(0, const T*), P(1, const T*), P(2, const T*), P(3, const float*), P(4, const T*), \
            P(5, const float*), P(6, const float*), P(7, T*), P(8, T*), L(9), L(10), a.at(11).i, \
            a.at(12).i, a.at(13).i, a.at(14).i, a.at(15).i, a.at(16).f, STRIDE_ARGS(17),       \
            TAIL_ARGS(27));                                                                    \
    };

#define REGISTER_CROSS_ENTROPY(T, S)                                                           \
    table["fsdp_cross_entropy_forward_" #S] = [](const std::vector<Arg>& a) {                  \
        fsdp_cross_entropy_forward_##S(P(0, const T*), P(1, const long*), P(2, float*),        \
                                       P(3, float*), a.at(4).i, L(5), a.at(6).f);              \
    };                                                                                         \
    table["fsdp_cross_entropy_backward_" #S] = [](const std::vector<Arg>& a) {                 \
        fsdp_cross_entropy_backward_##S(P(0, const T*), P(1, const long*), P(2, const float*), \
                                        P(3, T*), L(4), a.at(5).i, L(6), a.at(7).f,            \
                                        a.at(8).f);                                            \
    };

#define REGISTER_EMBEDDING(T, S)                                                               \
    table["fsdp_embedding_backward_" #S] = [](const std::vector<Arg>& a) {                     \
        fsdp_embedding_backward_##S(P(0, const T*), P(1, const int*), P(2, const int*),         \
                                    P(3, T*), a.at(4).i, a.at(5).i);                           \
    };

#define REGISTER_SOFTMAX(T, S)                                                                 \
    table["fsdp_softmax_forward_" #S] = [](const std::vector<Arg>& a) {                        \
        fsdp_softmax_forward_##S(P(0, const T*), P(1, T*), a.at(2).i);                         \
    };                                                                                         \
    table["fsdp_softmax_backward_" #S] = [](const std::vector<Arg>& a) {                       \
        fsdp_softmax_backward_##S(P(0, const T*), P(1, const T*), P(2, T*), a.at(3).i);        \
    };

#define REGISTER_ATTENTION_64(T, S)                                                            \
    table["fsdp_attention_forward64_" #S] = [](const std::vector<Arg>& a) {                    \
        fsdp_attention_forward64_##S(P(0, const T*), P(1, const T*), P(2, const T*),           \
                                     P(3, const float*), P(4, T*), P(5, float*), a.at(6).i,    \
                                     a.at(7).i, a.at(8).i, a.at(9).i, a.at(10).i, a.at(11).f,  \
                                     STRIDE_ARGS(12), TAIL_ARGS(22));                          \
    };                                                                                         \
    table["fsdp_attention_backward_queries64_" #S] = [](const std::vector<Arg>& a) {           \
        fsdp_attention_backward_queries64_##S(                                                 \
            P(0, const T*), P(1, const T*), P(2, const T*), P(3, const float*), P(4, const T*), \
            P(5, const T*), P(6, const float*), P(7, float*), P(8, T*), L(9), L(10), a.at(11).i, \
            a.at(12).i, a.at(13).i, a.at(14).i, a.at(15).i, a.at(16).f, STRIDE_ARGS(17),       \
            TAIL_ARGS(27));                                                                    \
    };                                                                                         \
    table["fsdp_attention_backward_keys64_" #S] = [](const std::vector<Arg>& a) {              \
        fsdp_attention_backward_keys64_##S(                                                    \
            P(0, const T*), P(1, const T*), P(2, const T*), P(3, const float*), P(4, const T*), \
            P(5, const float*), P(6, const float*), P(7, T*), P(8, T*), L(9), L(10), a.at(11).i, \
            a.at(12).i, a.at(13).i, a.at(14).i, a.at(15).i, a.at(16).f, STRIDE_ARGS(17),       \
            TAIL_ARGS(27));                                                                    \
    };

static std::map<std::string, Kernel> kernels() {
    std::map<std::string, Kernel> table;
    REGISTER_NORM(float, f32)
    REGISTER_NORM(bf16, bf16)
    REGISTER_ACTIVATIONS(float, f32)
    REGISTER_ACTIVATIONS(bf16, bf16)
    REGISTER_ROPE(float, f32)
    REGISTER_ROPE(bf16, bf16)
    REGISTER_ATTENTION(float, f32)
    REGISTER_ATTENTION(bf16, bf16)
    REGISTER_ATTENTION_64(float, f32)
    REGISTER_ATTENTION_64(bf16, bf16)
    REGISTER_SOFTMAX(float, f32)
    REGISTER_SOFTMAX(bf16, bf16)
    REGISTER_EMBEDDING(float, f32)
    REGISTER_EMBEDDING(bf16, bf16)
    REGISTER_CROSS_ENTROPY(float, f32)
    REGISTER_CROSS_ENTROPY(bf16, bf16)
    table["fsdp_nf4_dequantize_f32"] = [](const std::vector<Arg>& a) {
        fsdp_nf4_dequantize_f32(P(0, const unsigned char*), P(1, float*), a.at(2).i, a.at(3).i,
                                a.at(4).i);
    };
    table["fsdp_sum_rows_f32"] = [](const std::vector<Arg>& a) {
        fsdp_sum_rows_f32(P(0, const float*), P(1, float*), a.at(2).i, a.at(3).f);
    };
    return table;
}

static void fail(const std::string& what) {
    std::cerr << "kernel emulator: " << what << "\n";
    exit(1);
}

int main(int argc, char** argv) {
    if (argc != 3) fail("usage: driver PLAN DIR");
    const std::string dir = argv[2];
    std::ifstream plan(argv[1]);
    if (!plan) fail(std::string("cannot read ") + argv[1]);
    const auto table = kernels();
    std::map<int, std::vector<char>> buffers;
    std::string line;
    while (std::getline(plan, line)) {
        std::istringstream in(line);
        std::string word;
        if (!(in >> word)) continue;
        if (word == "buffer") {
            int index;
            size_t bytes;
            if (!(in >> index >> bytes)) fail("bad line: " + line);
            std::vector<char> data(bytes, 0);
            std::ifstream file(dir + "/buf" + std::to_string(index) + ".bin", std::ios::binary);
            if (file && !file.read(data.data(), bytes)) fail("short buffer file for " + line);
            buffers[index] = std::move(data);
        } else if (word == "launch") {
            std::string name;
            dim3 grid, block;
            if (!(in >> name >> grid.x >> grid.y >> grid.z >> block.x >> block.y >> block.z))
                fail("bad line: " + line);
            auto kernel = table.find(name);
            if (kernel == table.end()) fail("no kernel " + name);
            std::vector<Arg> args;
            while (in >> word) {
                Arg arg;
                if (word == "null") {
                } else if (word[0] == 'b') {
                    auto b = buffers.find(std::stoi(word.substr(1)));
                    if (b == buffers.end()) fail("no buffer " + word);
                    arg.p = b->second.data();
                } else if (word[0] == 'i') {
                    arg.i = std::stoi(word.substr(1));
                } else if (word[0] == 'l') {
                    arg.l = std::stol(word.substr(1));
                } else if (word[0] == 'u') {
                    arg.u = std::stoull(word.substr(1));
                } else if (word[0] == 'f') {
                    uint32_t bits = (uint32_t)std::stoul(word.substr(1), nullptr, 16);
                    memcpy(&arg.f, &bits, 4);
                } else {
                    fail("bad argument " + word);
                }
                args.push_back(arg);
            }
            fsdp_emulator::launch(grid, block, [&] { kernel->second(args); });
        } else {
            fail("bad line: " + line);
        }
    }
    for (auto& [index, data] : buffers) {
        std::ofstream out(dir + "/buf" + std::to_string(index) + ".out", std::ios::binary);
        if (!out.write(data.data(), data.size())) fail("cannot write buffer " + std::to_string(index));
    }
    return 0;
}
