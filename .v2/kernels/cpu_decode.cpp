// The CPU step of a Llama-family model with 4-bit weights, as one native call (kernels/cpu_native.py builds and
// loads it; engine/models/llama_cpu_decoder.py calls it for every step). A row is one token with its own block
// table row and context length: a decode token, or one of a prompt's tokens (its context is its position + 1;
// every row's K and V are written before any row attends), so a token's numbers do not depend on the step.
//
// Per layer: 4 matmuls — our Q4_1 x Q8 kernel (cpu_quant_matmul.cpp; float32 activations) on builds for
// AVX2 or AVX-512, else torch's _weight_int4pack_mm_for_cpu (bfloat16 activations) — and 4 loops of ours that
// replace ~40 small tensor ops of the Python path (templated over the activation type T):
//   add_rms_norm  residual += x; xb = T(weight * (residual * rsqrt(mean(residual^2) + eps)))   (HF's order)
//   rope_store    q, k rotated (rotate_half with cos / signed sin rows) into float; k and v written into their
//                 KV cache slots (slot = block * block_size + offset)
//   attend        softmax(q k^T * scale) v over the sequence's paged KV, read through its block table in place
//                 (no gathered copy, no mask); GQA: a KV head's query heads share each key/value load
//   silu_mul      T(silu(gate) * up)
// Float32 everywhere between the matmuls; tests/test_cpu_native.py compares every step with the Python path.
#include "cpu_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using at::Tensor;
using pagedchat_cpu_level::check;
using pagedchat_cpu_level::q4q8_linear;
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

// activations between the matmuls: bfloat16 bits (torch's int4 kernel) or float32 (the Q4_1 x Q8 kernel)
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
  RECORD_FUNCTION("pagedchat_cpu::attend", std::vector<c10::IValue>());
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
    RECORD_FUNCTION("pagedchat_cpu::norms_rope_silu", std::vector<c10::IValue>());  // (the profile's "rest")
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

PAGEDCHAT_LIBRARY(PAGEDCHAT_CPU_NS, m) {
  m.def("q4q8_linear(Tensor x, Tensor packed, Tensor d, Tensor m) -> Tensor");
  m.def("q8q8_linear(Tensor x, Tensor packed, Tensor d) -> Tensor");
  m.def("decode_layers_q8(Tensor(a!) residual, Tensor cos, Tensor signed_sin, Tensor slots, Tensor block_tables, "
        "Tensor context_lens, Tensor[] input_norms, Tensor[] post_norms, Tensor[] qkv, Tensor[] o, Tensor[] gate_up, "
        "Tensor[] down, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, int heads, int kv_heads, int dim, int inner, "
        "float eps, float scale) -> Tensor");
  m.def("has_q4q8() -> bool", &pagedchat_cpu_level::has_q4q8);
  m.def("isa() -> str", &pagedchat_cpu_level::isa);
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("decode_layers(Tensor(a!) residual, Tensor cos, Tensor signed_sin, Tensor slots, Tensor block_tables, "
        "Tensor context_lens, Tensor[] input_norms, Tensor[] post_norms, Tensor[] qkv, Tensor[] qkv_scales, "
        "Tensor[] o, Tensor[] o_scales, Tensor[] gate_up, Tensor[] gate_up_scales, Tensor[] down, "
        "Tensor[] down_scales, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, int heads, int kv_heads, int dim, "
        "int inner, float eps, float scale) -> Tensor");
}

PAGEDCHAT_LIBRARY_IMPL(PAGEDCHAT_CPU_NS, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("int8_linear", &pagedchat_cpu_level::int8_linear);
  m.impl("q4q8_linear", &pagedchat_cpu_level::q4q8_linear);
  m.impl("q8q8_linear", &pagedchat_cpu_level::q8q8_linear);
  m.impl("decode_layers_q8", &decode_layers_q8);
}
