// Shared by the native CPU kernels (kernels/cpu_native.py builds them into one library): the quantized matmuls
// (cpu_quant_matmul.cpp) that the decode step (cpu_decode.cpp) calls, and the registration of every op there.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// e^x without a library call, so that loops over it vectorize: x = n ln2 + r (Cody-Waite), e^r by Cephes' expf
// polynomial (relative error ~1e-7 on |r| <= ln2 / 2), times 2^n built in the exponent bits. x is clamped to
// [-87, 88] (e^-87 ~ 1.6e-38: a softmax weight that small is 0 next to the maximum's 1).
inline float exp_fast(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

constexpr int64_t kMaxHeadDim = 256;
// The step's per-row loops (norms, rotary, the attention spans' merge) are split between the threads from this many
// rows on (a prompt's; a decode step's few rows stay on the calling thread: a parallel region costs more)
constexpr int64_t kParallelRows = 16;
struct Heads {
  int64_t heads, kv_heads, dim;
};
// The native step's paged attention (cpu_attention.cpp): out [rows, heads * dim] = softmax(q k^T * scale) v per row
// and query head over its sequence's K and V (q [rows, heads, dim]; the caches [blocks, block_size, kv_heads, dim],
// read through the row's block table; positions [max(0, context - window), context) with window > 0, else all)
void attend(const float* q, const float* k_cache, const float* v_cache, const int32_t* tables, int64_t table_width,
            const int32_t* context_lens, int64_t window, float* out, int64_t rows, Heads n, int64_t block_size,
            float scale);
// the same as an op over tensors (tests, benchmarks): q [rows, heads, dim], caches as above, tables [rows, width]
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                           at::Tensor context_lens, int64_t window, double scale);

}  // namespace PAGEDCHAT_CPU_NS

namespace pagedchat_cpu_level = PAGEDCHAT_CPU_NS;
