// Shared by the native CPU kernels (kernels/cpu_native.py builds them into one library): the quantized matmuls
// (cpu_quant_matmul.cpp) that the decode step (cpu_decode.cpp) calls, and the registration of every op there.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <string>
#include <vector>

// One library per instruction-set level, each with its own op namespace (torch.ops.pagedchat_cpu_avx2, ...) and
// C++ namespace, so that one process can load several levels side by side (the tests compare them).
#ifndef PAGEDCHAT_CPU_NS
#define PAGEDCHAT_CPU_NS pagedchat_cpu
#endif
// (through a second macro, so that the namespace argument is expanded before TORCH_LIBRARY pastes it)
#define PAGEDCHAT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define PAGEDCHAT_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

namespace PAGEDCHAT_CPU_NS {

inline void check(bool ok, const char* what) { TORCH_CHECK(ok, "pagedchat_cpu: ", what); }

// logits [M, N] = x [M, K] float32 times int8 weights packed [N / 16, K, 16] with a scale per output
at::Tensor int8_linear(at::Tensor x, at::Tensor packed, at::Tensor scales);

// activations of a matmul, quantized per 32 inputs (and their sums per 16, for Q6_K's scales): cpu_gguf_matmul.cpp
struct QuantizedActivations {
  std::vector<int8_t> codes;               // [rows, K]
  std::vector<float> scales, scaled_sums;  // [rows, K / 32]: s, and s * sum(a)
  std::vector<int32_t> sums;               // [rows, K / 32]: sum(a)
  std::vector<int32_t> half_sums;          // [rows, K / 16]
  int64_t rows = 0, k = 0;
};
void quantize_activations(const float* x, int64_t rows, int64_t k, QuantizedActivations& out);
// out [rows, n] (row stride n) = the activations times each part's tiles, the parts' outputs side by side
void gguf_matmul(const QuantizedActivations& act, at::TensorList tiles, at::IntArrayRef formats, float* out, int64_t n);
void check_tiles(const at::Tensor& tiles, int64_t format, int64_t k);
// [M, sum of the parts' N] = x [M, K] float32 times GGUF-format weights repacked into tiles (kernels/cpu_tiles.py)
at::Tensor gguf_linear(at::Tensor x, at::TensorList tiles, at::IntArrayRef formats);
// a GGUF tensor's raw bytes [rows, cols / block * block bytes] -> its tiles (cpu_gguf_repack.cpp)
at::Tensor gguf_tiles(at::Tensor raw, int64_t format, int64_t rows, int64_t cols);
std::string isa();

}  // namespace PAGEDCHAT_CPU_NS

namespace pagedchat_cpu_level = PAGEDCHAT_CPU_NS;
