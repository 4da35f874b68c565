// The CPU decode step of a Llama-family model with 4-bit weights, as one native call (kernels/cpu_native.py
// builds and loads it; engine/models/llama_cpu_decoder.py calls it for decode-only steps).
//
// Per layer: 4 weight-only int4 matmuls (torch's _weight_int4pack_mm_for_cpu, bfloat16 in and out) and 4 loops
// of ours that replace ~40 small tensor ops of the Python path:
//   add_rms_norm  residual += x; xb = bf16(weight * (residual * rsqrt(mean(residual^2) + eps)))   (HF's order)
//   rope_store    q, k rotated (rotate_half with cos / signed sin rows) into float; k and v written into their
//                 KV cache slots (slot = block * block_size + offset)
//   attend        softmax(q k^T * scale) v over the sequence's paged KV, read through its block table in place
//                 (no gathered copy, no mask); GQA: a KV head's query heads share each key/value load
//   silu_mul      bf16(silu(gate) * up)
// Float32 everywhere between the matmuls; tests/test_cpu_native.py compares every step with the Python path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using at::Tensor;
using c10::BFloat16;
using Bf16 = uint16_t;  // bfloat16 bits: converted by the two helpers below, which vectorize (c10's do not)

inline float to_float(Bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// round to nearest even, as c10::BFloat16 for every finite value (NaN is not expected between layers)
inline Bf16 to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<Bf16>(bits >> 16);
}

inline Bf16* bf16_data(const Tensor& t) { return reinterpret_cast<Bf16*>(t.data_ptr<BFloat16>()); }

constexpr int64_t kMaxHeadDim = 256;

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

// a . b (one vector accumulator, reduced at the end; callers overlap independent dots)
inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void add_rms_norm(float* residual, const Bf16* x, const float* weight, Bf16* out, int64_t rows,
                  int64_t hidden, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* res = residual + r * hidden;
    if (x != nullptr) {
      const Bf16* xr = x + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) res[i] += to_float(xr[i]);
    }
    double squares = 0.0;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; ++i) squares += static_cast<double>(res[i]) * res[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(squares / hidden) + eps);
    Bf16* o = out + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) o[i] = to_bf16(weight[i] * (res[i] * inv));
  }
}

// rotate_half(x) * sin == cat(x2, x1) * signed_sin, signed_sin's first half negated (kernels/cpu.py)
inline void rotate(const Bf16* x, const float* cos, const float* signed_sin, float* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = to_float(x[i]) * cos[i] + to_float(x[i + half]) * signed_sin[i];
    out[i + half] = to_float(x[i + half]) * cos[i + half] + to_float(x[i]) * signed_sin[i + half];
  }
}

void rope_store(const Bf16* qkv, const float* cos, const float* signed_sin, const int64_t* slots, float* q_out,
                float* k_cache, float* v_cache, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim) {
  const int64_t width = (heads + 2 * kv_heads) * dim;
  for (int64_t r = 0; r < rows; ++r) {
    const Bf16* src = qkv + r * width;
    const float* c = cos + r * dim;
    const float* s = signed_sin + r * dim;
    for (int64_t h = 0; h < heads; ++h) rotate(src + h * dim, c, s, q_out + (r * heads + h) * dim, dim);
    if (slots[r] < 0) continue;  // a padding row writes nowhere
    float* k_slot = k_cache + slots[r] * kv_heads * dim;
    float* v_slot = v_cache + slots[r] * kv_heads * dim;
    for (int64_t h = 0; h < kv_heads; ++h) rotate(src + (heads + h) * dim, c, s, k_slot + h * dim, dim);
    const Bf16* v = src + (heads + kv_heads) * dim;
    for (int64_t i = 0; i < kv_heads * dim; ++i) v_slot[i] = to_float(v[i]);
  }
}

// One (row, span of positions) task over all heads: the span's softmax numerator, maximum and total (the
// flash-decoding split) per query head. A position's K (and V) of all KV heads is one contiguous run of
// kv_heads * dim floats, read once, in cache order: the KV cache is read from memory at full speed (a task per
// KV head would read a third of each run and leave the rest to the prefetcher). acc [heads, dim + 2]: the
// numerator, then the maximum and the total.
void attend_span(const float* q, const float* k_cache, const float* v_cache, const int32_t* table, int64_t lo,
                 int64_t hi, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                 std::vector<float>& scores, float* acc) {
  const int64_t length = hi - lo, group = heads / kv_heads, row_stride = kv_heads * dim;
  scores.resize(heads * length);
  for (int64_t p = lo; p < hi;) {  // block by block: one table read and no division per position
    const int64_t offset = p % block_size, n = std::min(block_size - offset, hi - p);
    const float* key = k_cache + (table[p / block_size] * block_size + offset) * row_stride;
    for (int64_t j = 0; j < n; ++j, key += row_stride) {
      for (int64_t h = 0; h < heads; ++h) {
        scores[h * length + p - lo + j] = dot(q + h * dim, key + (h / group) * dim, dim) * scale;
      }
    }
    p += n;
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = scores.data() + h * length;
    float* stats = acc + h * (dim + 2) + dim;
    stats[0] = *std::max_element(sh, sh + length);
    for (int64_t p = 0; p < length; ++p) sh[p] = exp_fast(sh[p] - stats[0]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t p = 0; p < length; ++p) sum += sh[p];
    stats[1] = sum;
    std::fill(acc + h * (dim + 2), stats, 0.0f);
  }
  for (int64_t p = lo; p < hi;) {
    const int64_t offset = p % block_size, n = std::min(block_size - offset, hi - p);
    const float* value = v_cache + (table[p / block_size] * block_size + offset) * row_stride;
    for (int64_t j = 0; j < n; ++j, value += row_stride) {
      for (int64_t h = 0; h < heads; ++h) {
        const float w = scores[h * length + p - lo + j];
        const float* vh = value + (h / group) * dim;
        float* a = acc + h * (dim + 2);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) a[i] += w * vh[i];
      }
    }
    p += n;
  }
}

// Decode attention, parallel over (row, span): a row's positions are cut into spans of at least kMinSpan so
// that one long row still occupies every thread; the spans of a row are merged by their maxima.
constexpr int64_t kMinSpan = 64;

void attend(const float* q, const float* k_cache, const float* v_cache, const int32_t* tables, int64_t table_width,
            const int32_t* context_lens, Bf16* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
            int64_t block_size, float scale) {
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) longest = std::max<int64_t>(longest, context_lens[r]);
  const int64_t wanted = 2 * at::get_num_threads();
  const int64_t spans = std::max<int64_t>(1, std::min((wanted + rows - 1) / rows, (longest + kMinSpan - 1) / kMinSpan));
  const int64_t span_len = std::max<int64_t>(1, (longest + spans - 1) / spans);
  const int64_t part_size = heads * (dim + 2);
  std::vector<float> partial(rows * spans * part_size);
  at::parallel_for(0, rows * spans, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / spans, lo = task % spans * span_len;
      const int64_t hi = std::min<int64_t>(context_lens[r], lo + span_len);
      float* acc = partial.data() + task * part_size;
      if (lo >= hi) {  // an empty span (a short row, or a padding row): no weight in the merge
        for (int64_t h = 0; h < heads; ++h) acc[h * (dim + 2) + dim] = -INFINITY;
        continue;
      }
      attend_span(q + r * heads * dim, k_cache, v_cache, tables + r * table_width, lo, hi, heads, kv_heads, dim,
                  block_size, scale, scores, acc);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      Bf16* o = out + (r * heads + h) * dim;
      const float* first = partial.data() + r * spans * part_size + h * (dim + 2);
      float top = -INFINITY;
      for (int64_t span = 0; span < spans; ++span) top = std::max(top, first[span * part_size + dim]);
      if (top == -INFINITY) {  // no context at all (a padding row)
        std::fill(o, o + dim, Bf16{0});
        continue;
      }
      float merged[kMaxHeadDim] = {};
      float total = 0.0f;
      for (int64_t span = 0; span < spans; ++span) {
        const float* part = first + span * part_size;
        if (part[dim] == -INFINITY) continue;
        const float weight = std::exp(part[dim] - top);
        total += weight * part[dim + 1];
        for (int64_t i = 0; i < dim; ++i) merged[i] += weight * part[i];
      }
      for (int64_t i = 0; i < dim; ++i) o[i] = to_bf16(merged[i] / total);
    }
  }
}

void silu_mul(const Bf16* gate_up, Bf16* out, int64_t rows, int64_t inner) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Bf16* gate = gate_up + r * 2 * inner;
      const Bf16* up = gate + inner;
      Bf16* o = out + r * inner;
      for (int64_t i = 0; i < inner; ++i) {
        const float g = to_float(gate[i]);
        o[i] = to_bf16(g / (1.0f + exp_fast(-g)) * to_float(up[i]));
      }
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "cpu_decode: ", what); }

// residual [M, hidden] float32 (the embeddings; updated in place); returns the last layer's MLP output
// [M, hidden] bfloat16, which the caller adds to the residual before the final norm.
Tensor decode_layers(Tensor residual, Tensor cos, Tensor signed_sin, Tensor slots, Tensor block_tables,
                     Tensor context_lens, at::TensorList input_norms, at::TensorList post_norms,
                     at::TensorList qkv, at::TensorList qkv_scales, at::TensorList o, at::TensorList o_scales,
                     at::TensorList gate_up, at::TensorList gate_up_scales, at::TensorList down,
                     at::TensorList down_scales, at::TensorList k_caches, at::TensorList v_caches, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t inner, double eps, double scale) {
  const int64_t rows = residual.size(0), hidden = residual.size(1), layers = input_norms.size();
  check(residual.scalar_type() == at::kFloat && residual.is_contiguous(), "residual must be contiguous float32");
  check(cos.is_contiguous() && signed_sin.is_contiguous() && cos.numel() == rows * dim, "cos/sin rows");
  check(slots.scalar_type() == at::kLong && block_tables.scalar_type() == at::kInt &&
            context_lens.scalar_type() == at::kInt && block_tables.is_contiguous(), "metadata dtypes");
  check(block_tables.size(0) == rows && context_lens.size(0) == rows, "one block table row per decode row");
  check(dim <= kMaxHeadDim && heads % kv_heads == 0, "head_dim <= 256 and whole query groups");
  const int64_t block_size = k_caches[0].size(1);
  auto bf16 = residual.options().dtype(at::kBFloat16);
  Tensor xb = at::empty({rows, hidden}, bf16);
  Tensor q = at::empty({rows, heads, dim}, residual.options());
  Tensor attn = at::empty({rows, heads * dim}, bf16);
  Tensor act = at::empty({rows, inner}, bf16);
  Tensor x;
  float* res = residual.data_ptr<float>();
  for (int64_t l = 0; l < layers; ++l) {
    add_rms_norm(res, x.defined() ? bf16_data(x) : nullptr, input_norms[l].data_ptr<float>(), bf16_data(xb), rows,
                 hidden, static_cast<float>(eps));
    Tensor qkv_out = at::_weight_int4pack_mm_for_cpu(xb, qkv[l], 32, qkv_scales[l]).contiguous();
    rope_store(bf16_data(qkv_out), cos.data_ptr<float>(), signed_sin.data_ptr<float>(),
               slots.data_ptr<int64_t>(), q.data_ptr<float>(), k_caches[l].data_ptr<float>(),
               v_caches[l].data_ptr<float>(), rows, heads, kv_heads, dim);
    attend(q.data_ptr<float>(), k_caches[l].data_ptr<float>(), v_caches[l].data_ptr<float>(),
           block_tables.data_ptr<int32_t>(), block_tables.size(1), context_lens.data_ptr<int32_t>(),
           bf16_data(attn), rows, heads, kv_heads, dim, block_size, static_cast<float>(scale));
    Tensor o_out = at::_weight_int4pack_mm_for_cpu(attn, o[l], 32, o_scales[l]).contiguous();
    add_rms_norm(res, bf16_data(o_out), post_norms[l].data_ptr<float>(), bf16_data(xb), rows,
                 hidden, static_cast<float>(eps));
    Tensor gate_up_out = at::_weight_int4pack_mm_for_cpu(xb, gate_up[l], 32, gate_up_scales[l]).contiguous();
    silu_mul(bf16_data(gate_up_out), bf16_data(act), rows, inner);
    x = at::_weight_int4pack_mm_for_cpu(act, down[l], 32, down_scales[l]).contiguous();
  }
  return x;
}

// logits [M, N] float32 = x [M, K] float32 times int8 weights with one scale per output, transposed: the
// output layer. The weights come packed as [N / 16, K, 16] (16 outputs' column k side by side), so 16 outputs
// are computed at once as vectors, for up to 8 (AVX-512) or 3 (AVX2) input rows per pass, with no horizontal sums; a group's weights
// are read from memory once for all rows (torch's weight-only int8 kernel is ~3x slower at 8 rows than at one).
// The output layer's weights are packed in groups of 16 outputs ([N / 16, K, 16]): one AVX-512 vector, two
// AVX2 vectors (GCC/Clang vector extensions; the int8 -> float widening by intrinsics, which GCC does not
// derive from __builtin_convertvector).
constexpr int64_t kInt8Outputs = 16;
#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int64_t kInt8Rows = 8;  // 8 rows x 2 chains: 16 of the 32 vector registers
typedef float FloatVec __attribute__((vector_size(64)));
inline FloatVec widen(const int8_t* w) {
  return reinterpret_cast<FloatVec>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)))));
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
        kInt8Blocks[std::min<int64_t>(kInt8Rows, m - r) - 1](xs + r * k, k, w + g * k * kInt8Outputs, sc + g * kInt8Outputs,
                                                     o + r * n + g * kInt8Outputs, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedchat_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("decode_layers(Tensor(a!) residual, Tensor cos, Tensor signed_sin, Tensor slots, Tensor block_tables, "
        "Tensor context_lens, Tensor[] input_norms, Tensor[] post_norms, Tensor[] qkv, Tensor[] qkv_scales, "
        "Tensor[] o, Tensor[] o_scales, Tensor[] gate_up, Tensor[] gate_up_scales, Tensor[] down, "
        "Tensor[] down_scales, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, int heads, int kv_heads, int dim, "
        "int inner, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedchat_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("int8_linear", &int8_linear);
}
