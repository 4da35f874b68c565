// The packed int8 output layer of the native CPU kernels (``--cpu-weights int8`` on any build; the GGUF block
// formats are cpu_gguf_matmul.cpp's), and the level the library was built for.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace PAGEDCHAT_CPU_NS {

using at::Tensor;

namespace {

// The output layer's weights are packed in groups of 16 outputs ([N / 16, K, 16]): one AVX-512 vector, two
// AVX2 vectors (GCC/Clang vector extensions; the int8 -> float widening by intrinsics, which GCC does not
// derive from __builtin_convertvector).
constexpr int64_t kInt8Outputs = 16;
#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int64_t kInt8Rows = 8;  // 8 rows x 2 chains: 16 of the 32 vector registers
typedef float FloatVec __attribute__((vector_size(64)));
inline FloatVec widen(const int8_t* w) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return reinterpret_cast<FloatVec>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
}
#else
constexpr int kLanes = 8;
constexpr int64_t kInt8Rows = 3;  // 3 rows x 2 chains x 2 vectors: 12 of the 16 vector registers
typedef float FloatVec __attribute__((vector_size(32)));
inline FloatVec widen(const int8_t* w) {
#ifdef __AVX2__
  return reinterpret_cast<FloatVec>(
      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)))));
#else
  FloatVec out;
  for (int l = 0; l < kLanes; ++l) out[l] = static_cast<float>(w[l]);
  return out;
#endif
}
#endif
constexpr int kVecs = kInt8Outputs / kLanes;

// Rows input rows x 16 outputs; two accumulator sets over alternating columns, so that one row still keeps
// the FMA units busy rather than waiting on one chain's latency. Every variant sums a row's products in the
// same order, so a row's logits do not depend on how many rows share the call (greedy tokens must not depend
// on the batch).
constexpr int kInt8Chains = 2;

template <int Rows>
void int8_block(const float* x, int64_t k, const int8_t* w, const float* scales, float* out, int64_t n) {
  FloatVec acc[kInt8Chains][Rows][kVecs];
  for (int c = 0; c < kInt8Chains; ++c)
    for (int r = 0; r < Rows; ++r)
      for (int v = 0; v < kVecs; ++v) acc[c][r][v] = FloatVec{};
  int64_t i = 0;
  for (; i + kInt8Chains <= k; i += kInt8Chains) {
    for (int c = 0; c < kInt8Chains; ++c) {
      FloatVec wf[kVecs];
      for (int v = 0; v < kVecs; ++v) wf[v] = widen(w + (i + c) * kInt8Outputs + v * kLanes);
      for (int r = 0; r < Rows; ++r) {
        const float xv = x[r * k + i + c];
        for (int v = 0; v < kVecs; ++v) acc[c][r][v] += xv * wf[v];
      }
    }
  }
  for (; i < k; ++i) {
    for (int v = 0; v < kVecs; ++v) {
      const FloatVec wf = widen(w + i * kInt8Outputs + v * kLanes);
      for (int r = 0; r < Rows; ++r) acc[0][r][v] += x[r * k + i] * wf;
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      FloatVec scale, sum = acc[0][r][v];
      for (int c = 1; c < kInt8Chains; ++c) sum += acc[c][r][v];
      std::memcpy(&scale, scales + v * kLanes, sizeof(scale));
      sum *= scale;
      std::memcpy(out + r * n + v * kLanes, &sum, sizeof(sum));
    }
  }
}

using Int8Block = void (*)(const float*, int64_t, const int8_t*, const float*, float*, int64_t);
template <int... Rows>
constexpr std::array<Int8Block, sizeof...(Rows)> int8_blocks(std::integer_sequence<int, Rows...>) {
  return {int8_block<Rows + 1>...};
}
constexpr auto kInt8Blocks = int8_blocks(std::make_integer_sequence<int, kInt8Rows>{});

}  // namespace

Tensor int8_linear(Tensor x, Tensor packed, Tensor scales) {
  check(x.scalar_type() == at::kFloat && x.dim() == 2 && packed.scalar_type() == at::kChar && packed.dim() == 3 &&
            packed.size(2) == kInt8Outputs && scales.scalar_type() == at::kFloat && x.size(1) == packed.size(1) &&
            scales.size(0) == packed.size(0) * kInt8Outputs && packed.is_contiguous() && scales.is_contiguous(),
        "int8_linear: x [M, K] float32, packed [N / 16, K, 16] int8, scales [N] float32");
  Tensor rows = x.contiguous();
  const int64_t m = rows.size(0), groups = packed.size(0), k = packed.size(1), n = groups * kInt8Outputs;
  Tensor out = at::empty({m, n}, rows.options());
  const float* xs = rows.data_ptr<float>();
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t r = 0; r < m; r += kInt8Rows)  // (the group's 9 KiB of weights stay in L1 between passes)
        kInt8Blocks[std::min<int64_t>(kInt8Rows, m - r) - 1](xs + r * k, k, w + g * k * kInt8Outputs,
                                                             sc + g * kInt8Outputs, o + r * n + g * kInt8Outputs, n);
  });
  return out;
}


// the instruction-set level this library was compiled for, as the compiler saw it (cpu_native.py checks it)
std::string isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return "avx512_vnni";
#elif defined(__AVX512F__) && defined(__AVX512BW__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace PAGEDCHAT_CPU_NS
