// The CPU decode step of a Llama-family model with 4-bit weights, as one native call (kernels/cpu_native.py
// builds and loads it; engine/models/llama_cpu_decoder.py calls it for decode-only steps).
//
// Per layer: 4 matmuls — our Q4_1 x Q8 kernel (below; float32 activations) where the CPU has AVX-512 VNNI, else
// torch's _weight_int4pack_mm_for_cpu (bfloat16 activations) — and 4 loops of ours that replace ~40 small tensor
// ops of the Python path (templated over the activation type T):
//   add_rms_norm  residual += x; xb = T(weight * (residual * rsqrt(mean(residual^2) + eps)))   (HF's order)
//   rope_store    q, k rotated (rotate_half with cos / signed sin rows) into float; k and v written into their
//                 KV cache slots (slot = block * block_size + offset)
//   attend        softmax(q k^T * scale) v over the sequence's paged KV, read through its block table in place
//                 (no gathered copy, no mask); GQA: a KV head's query heads share each key/value load
//   silu_mul      T(silu(gate) * up)
// Float32 everywhere between the matmuls; tests/test_cpu_native.py compares every step with the Python path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
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

// activations between the matmuls: bfloat16 bits (torch's int4 kernel) or float32 (the VNNI kernel)
inline float load(Bf16 v) { return to_float(v); }
inline float load(float v) { return v; }
inline void store(Bf16& out, float v) { out = to_bf16(v); }
inline void store(float& out, float v) { out = v; }
template <typename T> T* act_data(const Tensor& t);
template <> Bf16* act_data<Bf16>(const Tensor& t) { return bf16_data(t); }
template <> float* act_data<float>(const Tensor& t) { return t.data_ptr<float>(); }

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

template <typename T>
void add_rms_norm(float* residual, const T* x, const float* weight, T* out, int64_t rows,
                  int64_t hidden, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* res = residual + r * hidden;
    if (x != nullptr) {
      const T* xr = x + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) res[i] += load(xr[i]);
    }
    double squares = 0.0;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; ++i) squares += static_cast<double>(res[i]) * res[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(squares / hidden) + eps);
    T* o = out + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) store(o[i], weight[i] * (res[i] * inv));
  }
}

// rotate_half(x) * sin == cat(x2, x1) * signed_sin, signed_sin's first half negated (kernels/cpu.py)
template <typename T>
inline void rotate(const T* x, const float* cos, const float* signed_sin, float* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = load(x[i]) * cos[i] + load(x[i + half]) * signed_sin[i];
    out[i + half] = load(x[i + half]) * cos[i + half] + load(x[i]) * signed_sin[i + half];
  }
}

template <typename T>
void rope_store(const T* qkv, const float* cos, const float* signed_sin, const int64_t* slots, float* q_out,
                float* k_cache, float* v_cache, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim) {
  const int64_t width = (heads + 2 * kv_heads) * dim;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = qkv + r * width;
    const float* c = cos + r * dim;
    const float* s = signed_sin + r * dim;
    for (int64_t h = 0; h < heads; ++h) rotate(src + h * dim, c, s, q_out + (r * heads + h) * dim, dim);
    if (slots[r] < 0) continue;  // a padding row writes nowhere
    float* k_slot = k_cache + slots[r] * kv_heads * dim;
    float* v_slot = v_cache + slots[r] * kv_heads * dim;
    for (int64_t h = 0; h < kv_heads; ++h) rotate(src + (heads + h) * dim, c, s, k_slot + h * dim, dim);
    const T* v = src + (heads + kv_heads) * dim;
    for (int64_t i = 0; i < kv_heads * dim; ++i) v_slot[i] = load(v[i]);
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

// Decode attention, parallel over (row, span of kSpan positions): one long row still occupies every thread, and
// the spans of a row are merged by their maxima in order. Spans depend on the row's own length only, so a row's
// result does not depend on the batch it is in (greedy tokens must not).
constexpr int64_t kSpan = 128;

template <typename T>
void attend(const float* q, const float* k_cache, const float* v_cache, const int32_t* tables, int64_t table_width,
            const int32_t* context_lens, T* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
            int64_t block_size, float scale) {
  std::vector<int64_t> first_task(rows + 1, 0);  // row r's spans are tasks first_task[r] .. first_task[r + 1] - 1
  for (int64_t r = 0; r < rows; ++r)
    first_task[r + 1] = first_task[r] + std::max<int64_t>(1, (context_lens[r] + kSpan - 1) / kSpan);
  const int64_t part_size = heads * (dim + 2);
  std::vector<float> partial(first_task[rows] * part_size);
  at::parallel_for(0, first_task[rows], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    int64_t r = std::upper_bound(first_task.begin(), first_task.end(), begin) - first_task.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first_task[r + 1]) ++r;
      const int64_t lo = (task - first_task[r]) * kSpan, hi = std::min<int64_t>(context_lens[r], lo + kSpan);
      float* acc = partial.data() + task * part_size;
      if (lo >= hi) {  // a row without context (a padding row): no weight in the merge
        for (int64_t h = 0; h < heads; ++h) acc[h * (dim + 2) + dim] = -INFINITY;
        continue;
      }
      attend_span(q + r * heads * dim, k_cache, v_cache, tables + r * table_width, lo, hi, heads, kv_heads, dim,
                  block_size, scale, scores, acc);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      T* o = out + (r * heads + h) * dim;
      float top = -INFINITY;
      for (int64_t task = first_task[r]; task < first_task[r + 1]; ++task)
        top = std::max(top, partial[task * part_size + h * (dim + 2) + dim]);
      if (top == -INFINITY) {
        std::fill(o, o + dim, T{0});
        continue;
      }
      float merged[kMaxHeadDim] = {};
      float total = 0.0f;
      for (int64_t task = first_task[r]; task < first_task[r + 1]; ++task) {
        const float* part = partial.data() + task * part_size + h * (dim + 2);
        const float weight = std::exp(part[dim] - top);
        total += weight * part[dim + 1];
        for (int64_t i = 0; i < dim; ++i) merged[i] += weight * part[i];
      }
      for (int64_t i = 0; i < dim; ++i) store(o[i], merged[i] / total);
    }
  }
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t inner) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * inner;
      const T* up = gate + inner;
      T* o = out + r * inner;
      for (int64_t i = 0; i < inner; ++i) {
        const float g = load(gate[i]);
        store(o[i], g / (1.0f + exp_fast(-g)) * load(up[i]));
      }
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "cpu_decode: ", what); }

// The layers of one decode step. residual [M, hidden] float32 (the embeddings; updated in place); returns the last
// layer's MLP output [M, hidden], which the caller adds to the residual before the final norm. T: the activation
// type the matmuls take and give; matmul(projection, layer, input [M, K]) -> [M, N].
struct StepArgs {
  Tensor residual, cos, signed_sin, slots, block_tables, context_lens;
  at::TensorList input_norms, post_norms, k_caches, v_caches;
  int64_t heads, kv_heads, dim, inner;
  double eps, scale;
};

template <typename T, typename MatMul>
Tensor run_layers(const StepArgs& a, at::ScalarType act_type, MatMul matmul) {
  const int64_t rows = a.residual.size(0), hidden = a.residual.size(1), layers = a.input_norms.size();
  check(a.residual.scalar_type() == at::kFloat && a.residual.is_contiguous(), "residual must be contiguous float32");
  check(a.cos.is_contiguous() && a.signed_sin.is_contiguous() && a.cos.numel() == rows * a.dim, "cos/sin rows");
  check(a.slots.scalar_type() == at::kLong && a.block_tables.scalar_type() == at::kInt &&
            a.context_lens.scalar_type() == at::kInt && a.block_tables.is_contiguous(), "metadata dtypes");
  check(a.block_tables.size(0) == rows && a.context_lens.size(0) == rows, "one block table row per decode row");
  check(a.dim <= kMaxHeadDim && a.heads % a.kv_heads == 0, "head_dim <= 256 and whole query groups");
  const int64_t block_size = a.k_caches[0].size(1);
  auto act = a.residual.options().dtype(act_type);
  Tensor xb = at::empty({rows, hidden}, act);
  Tensor q = at::empty({rows, a.heads, a.dim}, a.residual.options());
  Tensor attn = at::empty({rows, a.heads * a.dim}, act);
  Tensor hidden_act = at::empty({rows, a.inner}, act);
  Tensor x;
  float* res = a.residual.data_ptr<float>();
  const float eps = static_cast<float>(a.eps);
  for (int64_t l = 0; l < layers; ++l) {
    add_rms_norm<T>(res, x.defined() ? act_data<T>(x) : nullptr, a.input_norms[l].data_ptr<float>(), act_data<T>(xb),
                    rows, hidden, eps);
    Tensor qkv = matmul(0, l, xb);
    rope_store<T>(act_data<T>(qkv), a.cos.data_ptr<float>(), a.signed_sin.data_ptr<float>(),
                  a.slots.data_ptr<int64_t>(), q.data_ptr<float>(), a.k_caches[l].data_ptr<float>(),
                  a.v_caches[l].data_ptr<float>(), rows, a.heads, a.kv_heads, a.dim);
    attend<T>(q.data_ptr<float>(), a.k_caches[l].data_ptr<float>(), a.v_caches[l].data_ptr<float>(),
              a.block_tables.data_ptr<int32_t>(), a.block_tables.size(1), a.context_lens.data_ptr<int32_t>(),
              act_data<T>(attn), rows, a.heads, a.kv_heads, a.dim, block_size, static_cast<float>(a.scale));
    Tensor o = matmul(1, l, attn);
    add_rms_norm<T>(res, act_data<T>(o), a.post_norms[l].data_ptr<float>(), act_data<T>(xb), rows, hidden, eps);
    Tensor gate_up = matmul(2, l, xb);
    silu_mul<T>(act_data<T>(gate_up), act_data<T>(hidden_act), rows, a.inner);
    x = matmul(3, l, hidden_act);
  }
  return x;
}

// torch's weight-only int4 matmuls (bfloat16 activations); weights[2p], weights[2p + 1]: projection p's packed
// int4 weights and scales/zeros per layer (qkv, o, gate_up, down)
Tensor decode_layers(Tensor residual, Tensor cos, Tensor signed_sin, Tensor slots, Tensor block_tables,
                     Tensor context_lens, at::TensorList input_norms, at::TensorList post_norms,
                     at::TensorList qkv, at::TensorList qkv_scales, at::TensorList o, at::TensorList o_scales,
                     at::TensorList gate_up, at::TensorList gate_up_scales, at::TensorList down,
                     at::TensorList down_scales, at::TensorList k_caches, at::TensorList v_caches, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t inner, double eps, double scale) {
  const StepArgs args{residual, cos, signed_sin, slots, block_tables, context_lens, input_norms, post_norms,
                      k_caches, v_caches, heads, kv_heads, dim, inner, eps, scale};
  const at::TensorList weights[4] = {qkv, o, gate_up, down}, scales[4] = {qkv_scales, o_scales, gate_up_scales,
                                                                          down_scales};
  return run_layers<Bf16>(args, at::kBFloat16, [&](int p, int64_t l, const Tensor& in) {
    return at::_weight_int4pack_mm_for_cpu(in, weights[p][l], 32, scales[p][l]).contiguous();
  });
}

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


// ---------------------------------------------------------------- 4-bit weights x 8-bit activations (VNNI)
//
// y[r, n] = sum over groups g of 32 inputs: d[n,g] s[r,g] sum_i q[n,g,i] a[r,g,i] + m[n,g] s[r,g] sum_i a[r,g,i]
// for Q4_1 weights w = d q + m (q in 0..15, d and m float16: the GGUF's own values, exactly) and activations
// x ~ s a, a in -127..127 per 32 inputs of a row (llama.cpp's Q8_1 scheme). The integer sums are exact
// (vpdpbusd: 4 u8 x s8 products per 32-bit lane). Weights come packed for 16 outputs at a time:
// [N / 16, K / 32, 4, 16, 4] bytes, where vector k of a group holds, for output j, inputs 8k .. 8k + 3 in the
// low nibbles and 8k + 4 .. 8k + 7 in the high nibbles; d and m as [N / 16, K / 32, 16] float16.
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHasQ4Q8 = true;
constexpr int64_t kQ4Rows = 8;

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

template <int Rows>
void q4q8_block(const QuantizedRows& act, int64_t row0, int64_t k, const uint8_t* w, const c10::Half* d,
                const c10::Half* m, float* out, int64_t n) {
  const int64_t groups = k / 32;
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i q[8];
    for (int v = 0; v < 4; ++v) {
      const __m512i packed = _mm512_loadu_si512(w + (g * 4 + v) * 64);
      q[2 * v] = _mm512_and_si512(packed, low_nibbles);
      q[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
    }
    const __m512 dg = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * 16)));
    const __m512 mg = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + g * 16)));
    for (int r = 0; r < Rows; ++r) {
      const int8_t* a = act.codes.data() + (row0 + r) * k + g * 32;
      __m512i sum = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        int32_t four;
        std::memcpy(&four, a + 4 * c, sizeof(four));
        sum = _mm512_dpbusd_epi32(sum, q[c], _mm512_set1_epi32(four));
      }
      const float scale = act.scales[(row0 + r) * groups + g];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dg, _mm512_set1_ps(scale)), acc[r]);
      acc[r] = _mm512_fmadd_ps(mg, _mm512_set1_ps(act.scaled_sums[(row0 + r) * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(out + r * n, acc[r]);
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
// times the activations quantized as above: y[r, n] = sum over groups of d[n,g] s[r,g] (w . a). vpdpbusd takes
// unsigned bytes on one side, so the weights come biased, w + 128, and 128 sum(a) is taken off again (exact).
// Layout: [N / 16, K / 32, 8, 16, 4] uint8 (vector c of a group: inputs 4c .. 4c + 3 of 16 outputs), d as
// [N / 16, K / 32, 16] float16.
template <int Rows>
void q8q8_block(const QuantizedRows& act, int64_t row0, int64_t k, const uint8_t* w, const c10::Half* d, float* out,
                int64_t n) {
  const int64_t groups = k / 32;
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i wv[8];
    for (int c = 0; c < 8; ++c) wv[c] = _mm512_loadu_si512(w + (g * 8 + c) * 64);
    const __m512 dg = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * 16)));
    for (int r = 0; r < Rows; ++r) {
      const int8_t* a = act.codes.data() + (row0 + r) * k + g * 32;
      __m512i sum = _mm512_set1_epi32(-128 * act.sums[(row0 + r) * groups + g]);
      for (int c = 0; c < 8; ++c) {
        int32_t four;
        std::memcpy(&four, a + 4 * c, sizeof(four));
        sum = _mm512_dpbusd_epi32(sum, wv[c], _mm512_set1_epi32(four));
      }
      const float scale = act.scales[(row0 + r) * groups + g];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dg, _mm512_set1_ps(scale)), acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(out + r * n, acc[r]);
}

using Q8Block = void (*)(const QuantizedRows&, int64_t, int64_t, const uint8_t*, const c10::Half*, float*, int64_t);
template <int... Rows>
constexpr std::array<Q8Block, sizeof...(Rows)> q8_blocks(std::integer_sequence<int, Rows...>) {
  return {q8q8_block<Rows + 1>...};
}
constexpr auto kQ8Blocks = q8_blocks(std::make_integer_sequence<int, kQ4Rows>{});
#else
constexpr bool kHasQ4Q8 = false;
#endif

Tensor q8q8_linear(Tensor x, Tensor packed, Tensor d) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
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
  TORCH_CHECK(false, "q8q8_linear: built without AVX-512 VNNI");
#endif
}

Tensor q4q8_linear(Tensor x, Tensor packed, Tensor d, Tensor m) {
  RECORD_FUNCTION("pagedchat_cpu::q4q8_linear", std::vector<c10::IValue>());  // (also when called from the step)
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
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
  TORCH_CHECK(false, "q4q8_linear: built without AVX-512 VNNI");
#endif
}

bool has_q4q8() { return kHasQ4Q8; }

// The same step on the Q4_1 x Q8 kernel (float32 activations); per projection p, a list of 3 tensors per layer:
// packed weights, d, m (q4q8_linear's layout)
Tensor decode_layers_q8(Tensor residual, Tensor cos, Tensor signed_sin, Tensor slots, Tensor block_tables,
                        Tensor context_lens, at::TensorList input_norms, at::TensorList post_norms, at::TensorList qkv,
                        at::TensorList o, at::TensorList gate_up, at::TensorList down, at::TensorList k_caches,
                        at::TensorList v_caches, int64_t heads, int64_t kv_heads, int64_t dim, int64_t inner,
                        double eps, double scale) {
  const StepArgs args{residual, cos, signed_sin, slots, block_tables, context_lens, input_norms, post_norms,
                      k_caches, v_caches, heads, kv_heads, dim, inner, eps, scale};
  const at::TensorList weights[4] = {qkv, o, gate_up, down};
  return run_layers<float>(args, at::kFloat, [&](int p, int64_t l, const Tensor& in) {
    return q4q8_linear(in, weights[p][3 * l], weights[p][3 * l + 1], weights[p][3 * l + 2]);
  });
}

}  // namespace

TORCH_LIBRARY(pagedchat_cpu, m) {
  m.def("q4q8_linear(Tensor x, Tensor packed, Tensor d, Tensor m) -> Tensor");
  m.def("q8q8_linear(Tensor x, Tensor packed, Tensor d) -> Tensor");
  m.def("decode_layers_q8(Tensor(a!) residual, Tensor cos, Tensor signed_sin, Tensor slots, Tensor block_tables, "
        "Tensor context_lens, Tensor[] input_norms, Tensor[] post_norms, Tensor[] qkv, Tensor[] o, Tensor[] gate_up, "
        "Tensor[] down, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, int heads, int kv_heads, int dim, int inner, "
        "float eps, float scale) -> Tensor");
  m.def("has_q4q8() -> bool", &has_q4q8);
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
  m.impl("q4q8_linear", &q4q8_linear);
  m.impl("q8q8_linear", &q8q8_linear);
  m.impl("decode_layers_q8", &decode_layers_q8);
}
