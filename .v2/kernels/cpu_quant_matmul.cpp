// The weight-only quantized matmuls of the native CPU kernels: the packed int8 output layer (any x86/ARM build),
// and the Q4_1 x Q8 / Q8_0 x Q8 integer products of llama.cpp's scheme (builds for AVX2, AVX-512 and AVX-512
// VNNI; cpu_native.py builds one library per level).
#include "cpu_kernels.h"
#include "cpu_simd.h"

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

// ---------------------------------------------------------------- 4-bit weights x 8-bit activations
//
// y[r, n] = sum over groups g of 32 inputs: d[n,g] s[r,g] sum_i q[n,g,i] a[r,g,i] + m[n,g] s[r,g] sum_i a[r,g,i]
// for Q4_1 weights w = d q + m (q in 0..15, d and m float16: the GGUF's own values, exactly) and activations
// x ~ s a, a in -127..127 per 32 inputs of a row (llama.cpp's Q8_1 scheme). Weights come packed for 16 outputs
// at a time: [N / 16, K / 32, 4, 16, 4] bytes, where vector k of a group holds, for output j, inputs
// 8k .. 8k + 3 in the low nibbles and 8k + 4 .. 8k + 7 in the high nibbles; d and m as [N / 16, K / 32, 16]
// float16. The integer products, exact at every level: cpu_simd.h.
#if Q4Q8_BUILT
using namespace simd;
constexpr bool kHasQ4Q8 = true;
#else
constexpr bool kHasQ4Q8 = false;
#endif

#if Q4Q8_BUILT
constexpr int kQVecs = 16 / kQLanes;  // vectors per block of 16 outputs

struct QuantizedRows {  // activations of up to kQ4Rows rows, quantized per 32 inputs
  std::vector<int8_t> codes;  // [rows, K]
  std::vector<float> scales, scaled_sums;  // [rows, K / 32]: s, and s * sum(a) (the minimum's factor)
  std::vector<int32_t> sums;  // [rows, K / 32]: sum(a)
};

void quantize_rows(const float* x, int64_t rows, int64_t k, QuantizedRows& out) {
  const int64_t groups = k / 32;
  out.codes.resize(rows * k);
  out.scales.resize(rows * groups);
  out.scaled_sums.resize(rows * groups);
  out.sums.resize(rows * groups);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + r * k + g * 32;
      float top = 0.0f;
      for (int i = 0; i < 32; ++i) top = std::max(top, std::abs(xg[i]));
      const float scale = top / 127.0f, inverse = top > 0.0f ? 127.0f / top : 0.0f;
      int8_t* a = out.codes.data() + r * k + g * 32;
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) {
        a[i] = static_cast<int8_t>(std::nearbyint(xg[i] * inverse));
        sum += a[i];
      }
      out.scales[r * groups + g] = scale;
      out.scaled_sums[r * groups + g] = scale * static_cast<float>(sum);
      out.sums[r * groups + g] = sum;
    }
  }
}

// sum_i q[j, i] a[i] over a group's 32 inputs, for the kQLanes outputs j of q[8] (the unpacked nibbles)
inline IVec q4_dot(const IVec* q, const int8_t* a) {
  if constexpr (kVnni) {
    IVec sum = set1_32(0);
    for (int c = 0; c < 8; ++c) sum = dpbusd(sum, q[c], broadcast4(a + 4 * c));
    return sum;
  } else {
    IVec s16 = maddubs(q[0], broadcast4(a));
    for (int c = 1; c < 8; ++c) s16 = add16(s16, maddubs(q[c], broadcast4(a + 4 * c)));
    return pairs_to_32(s16);
  }
}

template <int Rows>
void q4q8_block(const QuantizedRows& act, int64_t row0, int64_t k, const uint8_t* w, const c10::Half* d,
                const c10::Half* m, float* out, int64_t n) {
  const int64_t groups = k / 32;
  FVec acc[Rows][kQVecs];
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < kQVecs; ++v) acc[r][v] = fzero();
  for (int64_t g = 0; g < groups; ++g) {
    for (int v = 0; v < kQVecs; ++v) {  // (AVX2: outputs 0..7, then 8..15)
      IVec q[8];
      for (int c = 0; c < 4; ++c) {
        const IVec packed = load_i(w + (g * 4 + c) * 64 + v * kQLanes * 4);
        q[2 * c] = low_nibbles(packed);
        q[2 * c + 1] = high_nibbles(packed);
      }
      const FVec dg = half_to_float(d + g * 16 + v * kQLanes), mg = half_to_float(m + g * 16 + v * kQLanes);
      for (int r = 0; r < Rows; ++r) {
        const IVec sum = q4_dot(q, act.codes.data() + (row0 + r) * k + g * 32);
        const float scale = act.scales[(row0 + r) * groups + g];
        acc[r][v] = fmadd(cvt(sum), mul(dg, set1(scale)), acc[r][v]);
        acc[r][v] = fmadd(mg, set1(act.scaled_sums[(row0 + r) * groups + g]), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < kQVecs; ++v) store_f(out + r * n + v * kQLanes, acc[r][v]);
}

using Q4Block = void (*)(const QuantizedRows&, int64_t, int64_t, const uint8_t*, const c10::Half*,
                         const c10::Half*, float*, int64_t);
template <int... Rows>
constexpr std::array<Q4Block, sizeof...(Rows)> q4_blocks(std::integer_sequence<int, Rows...>) {
  return {q4q8_block<Rows + 1>...};
}
constexpr auto kQ4Blocks = q4_blocks(std::make_integer_sequence<int, kQ4Rows>{});

// out [M, N] float32 = x [M, K] float32 (quantized here) times the packed Q4_1 weights
void q4q8_matmul(const float* x, int64_t rows, int64_t k, const uint8_t* w, const c10::Half* d, const c10::Half* m,
                 float* out, int64_t n, QuantizedRows& act) {
  quantize_rows(x, rows, k, act);
  const int64_t groups = k / 32;
  at::parallel_for(0, n / 16, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r = 0; r < rows; r += kQ4Rows)
        kQ4Blocks[std::min<int64_t>(kQ4Rows, rows - r) - 1](act, r, k, w + b * groups * 256, d + b * groups * 16,
                                                           m + b * groups * 16, out + r * n + b * 16, n);
  });
}

// The output layer as llama.cpp computes a Q8_0 tensor: int8 weights w with a float16 scale d per 32 inputs,
// times the activations quantized as above: y[r, n] = sum over groups of d[n,g] s[r,g] (w . a). The weights
// come biased, w + 128 (vpdpbusd takes unsigned bytes on one side; 128 sum(a) is taken off again, exactly).
// Without VNNI, vpmaddubsw's 16-bit pairs would saturate on 255 * 127 * 2, so the products are formed as
// |w| x (a with w's sign): at most 2 * 127 * 127 = 32258 per pair, exact (llama.cpp's AVX2 Q8_0 dot).
// Layout: [N / 16, K / 32, 8, 16, 4] uint8 (vector c of a group: inputs 4c .. 4c + 3 of 16 outputs), d as
// [N / 16, K / 32, 16] float16.
inline IVec q8_dot(const IVec* biased, const IVec* magnitude, const IVec* signs, const int8_t* a, int32_t a_sum) {
  if constexpr (kVnni) {
    IVec sum = set1_32(-128 * a_sum);
    for (int c = 0; c < 8; ++c) sum = dpbusd(sum, biased[c], broadcast4(a + 4 * c));
    return sum;
  } else {
    IVec sum = pairs_to_32(maddubs(magnitude[0], sign8(broadcast4(a), signs[0])));
    for (int c = 1; c < 8; ++c)
      sum = add32(sum, pairs_to_32(maddubs(magnitude[c], sign8(broadcast4(a + 4 * c), signs[c]))));
    return sum;
  }
}

template <int Rows>
void q8q8_block(const QuantizedRows& act, int64_t row0, int64_t k, const uint8_t* w, const c10::Half* d, float* out,
                int64_t n) {
  const int64_t groups = k / 32;
  FVec acc[Rows][kQVecs];
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < kQVecs; ++v) acc[r][v] = fzero();
  for (int64_t g = 0; g < groups; ++g) {
    for (int v = 0; v < kQVecs; ++v) {
      IVec biased[8], magnitude[8], signs[8];
      for (int c = 0; c < 8; ++c) {
        biased[c] = load_i(w + (g * 8 + c) * 64 + v * kQLanes * 4);
        if constexpr (!kVnni) {
          signs[c] = unbias(biased[c]);
          magnitude[c] = abs8(signs[c]);
        }
      }
      const FVec dg = half_to_float(d + g * 16 + v * kQLanes);
      for (int r = 0; r < Rows; ++r) {
        const IVec sum = q8_dot(biased, magnitude, signs, act.codes.data() + (row0 + r) * k + g * 32,
                                act.sums[(row0 + r) * groups + g]);
        const float scale = act.scales[(row0 + r) * groups + g];
        acc[r][v] = fmadd(cvt(sum), mul(dg, set1(scale)), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < kQVecs; ++v) store_f(out + r * n + v * kQLanes, acc[r][v]);
}

using Q8Block = void (*)(const QuantizedRows&, int64_t, int64_t, const uint8_t*, const c10::Half*, float*, int64_t);
template <int... Rows>
constexpr std::array<Q8Block, sizeof...(Rows)> q8_blocks(std::integer_sequence<int, Rows...>) {
  return {q8q8_block<Rows + 1>...};
}
constexpr auto kQ8Blocks = q8_blocks(std::make_integer_sequence<int, kQ4Rows>{});
#endif

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


Tensor q8q8_linear(Tensor x, Tensor packed, Tensor d) {
#if Q4Q8_BUILT
  check(x.scalar_type() == at::kFloat && x.dim() == 2 && packed.scalar_type() == at::kByte && packed.dim() == 5 &&
            d.scalar_type() == at::kHalf && packed.is_contiguous() && d.is_contiguous() &&
            packed.size(1) * 32 == x.size(1),
        "q8q8_linear: x [M, K] float32, packed [N / 16, K / 32, 8, 16, 4] uint8, d [N / 16, K / 32, 16] float16");
  Tensor rows = x.contiguous();
  const int64_t m = rows.size(0), k = rows.size(1), n = packed.size(0) * 16, groups = k / 32;
  Tensor out = at::empty({m, n}, rows.options());
  QuantizedRows act;
  quantize_rows(rows.data_ptr<float>(), m, k, act);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const c10::Half* dd = d.data_ptr<c10::Half>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n / 16, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r = 0; r < m; r += kQ4Rows)
        kQ8Blocks[std::min<int64_t>(kQ4Rows, m - r) - 1](act, r, k, w + b * groups * 512, dd + b * groups * 16,
                                                         o + r * n + b * 16, n);
  });
  return out;
#else
  TORCH_CHECK(false, "q8q8_linear: built without AVX2 or AVX-512");
#endif
}

Tensor q4q8_linear(Tensor x, Tensor packed, Tensor d, Tensor m) {
  RECORD_FUNCTION("pagedchat_cpu::q4q8_linear", std::vector<c10::IValue>());  // (also when called from the step)
#if Q4Q8_BUILT
  check(x.scalar_type() == at::kFloat && x.dim() == 2 && packed.scalar_type() == at::kByte && packed.dim() == 5 &&
            d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && packed.is_contiguous() &&
            d.is_contiguous() && m.is_contiguous() && packed.size(1) * 32 == x.size(1),
        "q4q8_linear: x [M, K] float32, packed [N / 16, K / 32, 4, 16, 4] uint8, d and m [N / 16, K / 32, 16] float16");
  Tensor rows = x.contiguous();
  const int64_t n = packed.size(0) * 16;
  Tensor out = at::empty({rows.size(0), n}, rows.options());
  QuantizedRows act;
  q4q8_matmul(rows.data_ptr<float>(), rows.size(0), rows.size(1), packed.data_ptr<uint8_t>(),
              d.data_ptr<c10::Half>(), m.data_ptr<c10::Half>(), out.data_ptr<float>(), n, act);
  return out;
#else
  TORCH_CHECK(false, "q4q8_linear: built without AVX2 or AVX-512");
#endif
}

bool has_q4q8() { return kHasQ4Q8; }

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
