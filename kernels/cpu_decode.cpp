// The CPU step of a decoder model over GGUF-format weights, as one native call (kernels/cpu_native.py builds and
// loads it; engine/models/cpu_decoder.py calls it for every step). A row is one token with its own block table row
// and context length: a decode token, or one of a prompt's tokens (its context is its position + 1; every row's K
// and V are written before any row attends), so a token's numbers do not depend on the step.
//
// Per layer: 4 matmuls (the GGUF tile kernel, cpu_gguf_matmul.cpp: each projection one or more parts in their own
// formats) and a few loops of ours that replace ~40 small tensor ops of the Python path:
//   add_rms_norm  residual += x; xb = weight * (residual * rsqrt(mean(residual^2) + eps))   (HF's order)
//   rope_store    q, k (each head RMS-normed first where the model has q/k norms) rotated (rotate_half with cos /
//                 signed sin rows of the layer's rotary kind) into float; k and v written into their KV cache
//                 slots (slot = block * block_size + offset; a sliding-window layer's own slots and table)
//   attend        softmax(q k^T * scale) v over the sequence's paged KV (its last `window` positions for a
//                 sliding-window layer), read through its block table in place; GQA: a KV head's query heads share
//                 each key/value load; a run of one sequence's rows shares them too (cpu_attention.cpp)
//   act_mul       silu(gate) * up, or gelu_tanh(gate) * up (Gemma)
// Gemma's extra norms: the attention's and the MLP's outputs are RMS-normed before they join the residual stream.
// Float32 everywhere; tests/kernels/test_cpu_native.py compares every step with the Python path.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using at::Tensor;
using pagedchat_cpu_level::attend;
using pagedchat_cpu_level::check;
using pagedchat_cpu_level::exp_fast;
using pagedchat_cpu_level::Heads;
using pagedchat_cpu_level::kMaxHeadDim;
using pagedchat_cpu_level::kParallelRows;

// 1 / sqrt(mean(x^2) + eps), the sum of squares in double
inline float inverse_rms(const float* x, int64_t n, float eps) {
  double squares = 0.0;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += static_cast<double>(x[i]) * x[i];
  return 1.0f / std::sqrt(static_cast<float>(squares / n) + eps);
}

// residual += x (if given); out = weight * (residual * inverse_rms)
void add_rms_norm(float* residual, const float* x, const float* weight, float* out, int64_t rows, int64_t hidden,
                  float eps) {
  at::parallel_for(0, rows, kParallelRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* res = residual + r * hidden;
      if (x != nullptr) {
        const float* xr = x + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) res[i] += xr[i];
      }
      const float inv = inverse_rms(res, hidden, eps);
      float* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = weight[i] * (res[i] * inv);
    }
  });
}

// x = weight * (x * inverse_rms), each of `rows` vectors of n in place (Gemma's output norms, q/k norms)
void rms_norm_in_place(float* x, const float* weight, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, kParallelRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x + r * n;
      const float inv = inverse_rms(xr, n, eps);
      for (int64_t i = 0; i < n; ++i) xr[i] = weight[i] * (xr[i] * inv);
    }
  });
}

// rotate_half(x) * sin == cat(x2, x1) * signed_sin, signed_sin's first half negated (kernels/cpu.py)
inline void rotate(const float* x, const float* cos, const float* signed_sin, float* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = x[i] * cos[i] + x[i + half] * signed_sin[i];
    out[i + half] = x[i + half] * cos[i + half] + x[i] * signed_sin[i + half];
  }
}

// q, k normed (if q_norm / k_norm) and rotated, q into q_out and k, v into their slots; qkv [rows, (h + 2 kv) dim]
// is normed in place
void rope_store(float* qkv, const float* cos, const float* signed_sin, const int64_t* slots, const float* q_norm,
                const float* k_norm, float eps, float* q_out, float* k_cache, float* v_cache, int64_t rows, Heads n) {
  const int64_t width = (n.heads + 2 * n.kv_heads) * n.dim;
  at::parallel_for(0, rows, kParallelRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* src = qkv + r * width;
      if (q_norm != nullptr) rms_norm_in_place(src, q_norm, n.heads, n.dim, eps);
      if (k_norm != nullptr) rms_norm_in_place(src + n.heads * n.dim, k_norm, n.kv_heads, n.dim, eps);
      const float* c = cos + r * n.dim;
      const float* s = signed_sin + r * n.dim;
      for (int64_t h = 0; h < n.heads; ++h) rotate(src + h * n.dim, c, s, q_out + (r * n.heads + h) * n.dim, n.dim);
      if (slots[r] < 0) continue;  // a padding row writes nowhere
      float* k_slot = k_cache + slots[r] * n.kv_heads * n.dim;
      float* v_slot = v_cache + slots[r] * n.kv_heads * n.dim;
      for (int64_t h = 0; h < n.kv_heads; ++h) rotate(src + (n.heads + h) * n.dim, c, s, k_slot + h * n.dim, n.dim);
      std::memcpy(v_slot, src + (n.heads + n.kv_heads) * n.dim, n.kv_heads * n.dim * sizeof(float));
    }
  });
}

// Gated MLP activation: out = act(gate) * up; act 0: silu (x / (1 + e^-x)), 1: gelu with tanh (0.5 x (1 +
// tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3): torch's approximate="tanh"), computed as x / (1 + e^-2u) (the same
// function: 0.5 (1 + tanh(u)) is the logistic of 2u), so that it vectorizes like silu (libm's tanhf, one call per
// element, was a quarter of Gemma's prefill). Parallel over chunks of 256 of a row's elements, so that one decode
// row's are split between the threads too.
void act_mul(const float* gate_up, float* out, int64_t rows, int64_t inner, int64_t activation) {
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (inner + kChunk - 1) / kChunk;
  at::parallel_for(0, rows * chunks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / chunks, lo = (task % chunks) * kChunk, hi = std::min(inner, lo + kChunk);
      const float* gate = gate_up + r * 2 * inner;
      const float* up = gate + inner;
      float* o = out + r * inner;
      if (activation == 0) {
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i) o[i] = gate[i] / (1.0f + exp_fast(-gate[i])) * up[i];
      } else {
        constexpr float kMinusTwoAlpha = -2.0f * 0.7978845608028654f;  // -2 sqrt(2 / pi)
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i) {
          const float g = gate[i];
          o[i] = g / (1.0f + exp_fast(kMinusTwoAlpha * (g + 0.044715f * g * g * g))) * up[i];
        }
      }
    }
  });
}

// One step's inputs. A list of per-layer tensors may be empty where the model has no such part (q/k norms,
// Gemma's output norms); layer l's rotary rows are cos[rotary[l]], its window window[l] (0: all of the context),
// its table and slots the window group's (window_tables, window_slots) where window[l] > 0.
struct StepArgs {
  Tensor residual, slots, block_tables, window_slots, window_tables, context_lens;
  at::TensorList cos, signed_sin;
  at::IntArrayRef rotary, window;
  at::TensorList input_norms, post_norms, q_norms, k_norms, attn_out_norms, mlp_out_norms, k_caches, v_caches;
  at::TensorList tiles;
  at::IntArrayRef formats, parts;  // per layer and projection (qkv, o, gate_up, down): how many tiles
  Heads n;
  int64_t inner, activation;
  double eps, scale;
};

const float* optional(at::TensorList list, int64_t l) { return list.empty() ? nullptr : list[l].data_ptr<float>(); }

void check_step(const StepArgs& a) {
  const int64_t rows = a.residual.size(0), layers = a.input_norms.size();
  check(a.residual.scalar_type() == at::kFloat && a.residual.is_contiguous(), "residual must be contiguous float32");
  check(!a.cos.empty() && a.cos.size() == a.signed_sin.size(), "cos/sin rows: one pair per rotary kind");
  for (size_t i = 0; i < a.cos.size(); ++i)
    check(a.cos[i].is_contiguous() && a.signed_sin[i].is_contiguous() && a.cos[i].numel() == rows * a.n.dim,
          "cos/sin rows [M, head_dim]");
  check(a.slots.scalar_type() == at::kLong && a.block_tables.scalar_type() == at::kInt &&
            a.context_lens.scalar_type() == at::kInt && a.block_tables.is_contiguous() &&
            a.window_slots.scalar_type() == at::kLong && a.window_tables.scalar_type() == at::kInt &&
            a.window_tables.is_contiguous(),
        "metadata dtypes");
  check(a.block_tables.size(0) == rows && a.context_lens.size(0) == rows && a.window_tables.size(0) == rows,
        "one block table row per row");
  check(a.n.dim <= kMaxHeadDim && a.n.heads % a.n.kv_heads == 0, "head_dim <= 256 and whole query groups");
  check(static_cast<int64_t>(a.rotary.size()) == layers && static_cast<int64_t>(a.window.size()) == layers &&
            static_cast<int64_t>(a.parts.size()) == 4 * layers && a.tiles.size() == a.formats.size(),
        "per-layer rotary kinds, windows and 4 projections' part counts");
  for (int64_t l = 0; l < layers; ++l) check(a.rotary[l] >= 0 && a.rotary[l] < static_cast<int64_t>(a.cos.size()), "rotary kind");
}

// The layers of one step. residual [M, hidden] float32 (the embeddings; updated in place); returns the last
// layer's MLP output [M, hidden] (normed, for Gemma), which the caller adds to the residual before the final norm.
Tensor run_layers(const StepArgs& a) {
  check_step(a);
  const int64_t rows = a.residual.size(0), hidden = a.residual.size(1), layers = a.input_norms.size();
  const Heads n = a.n;
  std::vector<int64_t> first_part(a.parts.size() + 1, 0);
  for (size_t i = 0; i < a.parts.size(); ++i) first_part[i + 1] = first_part[i] + a.parts[i];
  auto options = a.residual.options();
  Tensor xb = at::empty({rows, hidden}, options);
  Tensor q = at::empty({rows, n.heads, n.dim}, options);
  Tensor attn = at::empty({rows, n.heads * n.dim}, options);
  Tensor hidden_act = at::empty({rows, a.inner}, options);
  Tensor x;
  pagedchat_cpu_level::QuantizedActivations act;
  // each projection's output, allocated once per step and written again by every layer (a layer's is read before
  // the next layer's same projection: a prompt's step otherwise allocated and freed ~70 buffers of megabytes)
  Tensor outs[4];
  auto matmul = [&](int p, int64_t l, const Tensor& in) {
    const int64_t at = 4 * l + p, first = first_part[at], count = a.parts[at];
    const at::TensorList tiles = a.tiles.slice(first, count);
    const at::IntArrayRef formats = a.formats.slice(first, count);
    int64_t width = 0;
    for (const Tensor& t : tiles) width += t.size(0) * 16;
    Tensor& out = outs[p];
    if (!out.defined() || out.size(1) != width) out = at::empty({rows, width}, options);
    pagedchat_cpu_level::quantize_activations(in.data_ptr<float>(), rows, in.size(1), act);
    pagedchat_cpu_level::gguf_matmul(act, tiles, formats, out.data_ptr<float>(), width);
    return out;
  };
  float* res = a.residual.data_ptr<float>();
  const float eps = static_cast<float>(a.eps);
  const int64_t block_size = a.k_caches[0].size(1);
  for (int64_t l = 0; l < layers; ++l) {
    RECORD_FUNCTION("pagedchat_cpu::norms_rope_act", std::vector<c10::IValue>());  // (the profile's "rest")
    add_rms_norm(res, x.defined() ? x.data_ptr<float>() : nullptr, a.input_norms[l].data_ptr<float>(),
                 xb.data_ptr<float>(), rows, hidden, eps);
    Tensor qkv = matmul(0, l, xb);
    const bool windowed = a.window[l] > 0;
    const Tensor& tables = windowed ? a.window_tables : a.block_tables;
    const Tensor& slots = windowed ? a.window_slots : a.slots;
    check(qkv.size(1) == (n.heads + 2 * n.kv_heads) * n.dim, "qkv width");
    rope_store(qkv.data_ptr<float>(), a.cos[a.rotary[l]].data_ptr<float>(), a.signed_sin[a.rotary[l]].data_ptr<float>(),
               slots.data_ptr<int64_t>(), optional(a.q_norms, l), optional(a.k_norms, l), eps, q.data_ptr<float>(),
               a.k_caches[l].data_ptr<float>(), a.v_caches[l].data_ptr<float>(), rows, n);
    attend(q.data_ptr<float>(), a.k_caches[l].data_ptr<float>(), a.v_caches[l].data_ptr<float>(),
           tables.data_ptr<int32_t>(), tables.size(1), a.context_lens.data_ptr<int32_t>(), a.window[l],
           attn.data_ptr<float>(), rows, n, block_size, static_cast<float>(a.scale));
    Tensor o = matmul(1, l, attn);
    if (!a.attn_out_norms.empty()) rms_norm_in_place(o.data_ptr<float>(), optional(a.attn_out_norms, l), rows, hidden, eps);
    add_rms_norm(res, o.data_ptr<float>(), a.post_norms[l].data_ptr<float>(), xb.data_ptr<float>(), rows, hidden, eps);
    Tensor gate_up = matmul(2, l, xb);
    act_mul(gate_up.data_ptr<float>(), hidden_act.data_ptr<float>(), rows, a.inner, a.activation);
    x = matmul(3, l, hidden_act);
    if (!a.mlp_out_norms.empty()) rms_norm_in_place(x.data_ptr<float>(), optional(a.mlp_out_norms, l), rows, hidden, eps);
  }
  return x;
}

Tensor decode_layers(Tensor residual, Tensor slots, Tensor block_tables, Tensor window_slots, Tensor window_tables,
                     Tensor context_lens, at::TensorList cos, at::TensorList signed_sin, at::IntArrayRef rotary,
                     at::IntArrayRef window, at::TensorList input_norms, at::TensorList post_norms,
                     at::TensorList q_norms, at::TensorList k_norms, at::TensorList attn_out_norms,
                     at::TensorList mlp_out_norms, at::TensorList tiles, at::IntArrayRef formats, at::IntArrayRef parts,
                     at::TensorList k_caches, at::TensorList v_caches, int64_t heads, int64_t kv_heads, int64_t dim,
                     int64_t inner, int64_t activation, double eps, double scale) {
  const StepArgs args{residual,  slots,     block_tables, window_slots,   window_tables, context_lens,
                      cos,       signed_sin, rotary,      window,         input_norms,   post_norms,
                      q_norms,   k_norms,   attn_out_norms, mlp_out_norms, k_caches,     v_caches,
                      tiles,     formats,   parts,        Heads{heads, kv_heads, dim}, inner, activation,
                      eps,       scale};
  return run_layers(args);
}

}  // namespace

PAGEDCHAT_LIBRARY(PAGEDCHAT_CPU_NS, m) {
  m.def("gguf_linear(Tensor x, Tensor[] tiles, int[] formats) -> Tensor");
  m.def("gguf_tiles(Tensor raw, int format, int rows, int cols) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("isa() -> str", &pagedchat_cpu_level::isa);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "int window, float scale) -> Tensor");
  m.def("decode_layers(Tensor(a!) residual, Tensor slots, Tensor block_tables, Tensor window_slots, "
        "Tensor window_tables, Tensor context_lens, Tensor[] cos, Tensor[] signed_sin, int[] rotary, int[] window, "
        "Tensor[] input_norms, Tensor[] post_norms, Tensor[] q_norms, Tensor[] k_norms, Tensor[] attn_out_norms, "
        "Tensor[] mlp_out_norms, Tensor[] tiles, int[] formats, int[] parts, Tensor(b!)[] k_caches, "
        "Tensor(c!)[] v_caches, int heads, int kv_heads, int dim, int inner, int activation, float eps, "
        "float scale) -> Tensor");
}

PAGEDCHAT_LIBRARY_IMPL(PAGEDCHAT_CPU_NS, CPU, m) {
  m.impl("gguf_linear", &pagedchat_cpu_level::gguf_linear);
  m.impl("gguf_tiles", &pagedchat_cpu_level::gguf_tiles);
  m.impl("int8_linear", &pagedchat_cpu_level::int8_linear);
  m.impl("decode_layers", &decode_layers);
  m.impl("paged_attention", &pagedchat_cpu_level::paged_attention);
}
