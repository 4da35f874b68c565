// The native CPU step's paged attention (cpu_decode.cpp calls attend for every layer; the op paged_attention serves
// tests and benchmarks). A row is one query token with its own block table row and context; it attends positions
// [start, context) with start = max(0, context - window) for a sliding-window layer (window > 0), else 0.
//
// Parallel over (run of rows, span of kSpan positions), the flash-decoding split: one long row still occupies every
// thread, and the spans of a row are merged by their maxima in order. Spans depend on the row's own positions only,
// and every row's arithmetic is the one it has alone, so a row's result does not depend on the batch it is in
// (greedy tokens must not). A run is up to kRunRows consecutive rows of one sequence (the same block table, contexts
// one apart, all from position 0: a prompt's tokens, speculative decoding's verify rows); a task computes one span
// for all of its rows at once, so the span's K and V serve every row from the cache.
//
// Within a task, per KV head, the (row, query head) pairs that share it go four at a time through a span's
// positions a few at a time (kPositions): q . k is kLanes dots in vectors of kLanes floats (each lane a chain of fused
// multiply-adds over the head's dims, in order), the kLanes vectors then summed across their lanes together by one
// fixed tree (reduce): a dot's float does not depend on which dots share its vectors. The values' sums keep 4 pairs x
// kChunks chunks of dims in registers over the span's positions, each a chain of fused multiply-adds in position
// order. A head_dim that is not a multiple of kLanes takes attend_span (a row at a time, the compiler's vector
// reductions).
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace PAGEDCHAT_CPU_NS {

using at::Tensor;

namespace {

constexpr int64_t kSpan = 128;
constexpr int64_t kRunRows = 8;

// The lanes of a vector: 16 floats (one zmm) with AVX-512, 8 below it (one ymm; the generic build's two xmm), so
// that a block's accumulators fit the level's registers (16 x 16 of 32 zmm; 8 x 8 of 16 ymm): a block is kPairs
// pairs x kPositions positions (kLanes dots) for q . k, and kPairs pairs x up to kChunks chunks of kLanes dims for
// the values. GCC lowers the vector type to the level's registers. (Without AVX-512 the compiler notes that a
// 64-byte vector's calling convention differs: these functions are inline, within this file.)
#pragma GCC diagnostic ignored "-Wpsabi"
#if defined(__AVX512F__)
constexpr int kLanes = 16, kPositions = 4, kChunks = 4;
typedef float Lanes __attribute__((vector_size(64)));
#else
constexpr int kLanes = 8, kPositions = 2, kChunks = 2;
typedef float Lanes __attribute__((vector_size(32)));
#endif
constexpr int kPairs = kLanes / kPositions;  // 4 on both

inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, Lanes v) { std::memcpy(p, &v, sizeof(v)); }
inline Lanes splat(float x) {  // (a lane-by-lane loop compiled to one masked insert per lane)
#if defined(__AVX512F__)
  return reinterpret_cast<Lanes>(_mm512_set1_ps(x));
#elif defined(__AVX__)
  return reinterpret_cast<Lanes>(_mm256_set1_ps(x));
#else
  Lanes v;
  for (int i = 0; i < kLanes; ++i) v[i] = x;
  return v;
#endif
}
// a * b + c, fused where the level has the instruction (the compiler never decides: the same float everywhere)
inline Lanes fmadd(Lanes a, Lanes b, Lanes c) {
#if defined(__AVX512F__)
  return reinterpret_cast<Lanes>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                 reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  return reinterpret_cast<Lanes>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                 reinterpret_cast<__m256>(c)));
#else
  const Lanes product = a * b;  // (no fused instruction at this level)
  return product + c;
#endif
}

// The cross-lane tree of reduce, one level per function: each adds lane j and lane j + w of every dot (w = 8, 4, 2,
// 1 with 16 lanes; 4, 2, 1 with 8), two vectors' dots at a time, so that a dot's sum is ((l0 + l8) + (l4 + l12))
// + ... in the same order whichever vectors it shares.
#if defined(__AVX512F__)
inline Lanes halve8(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline Lanes halve4(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
inline Lanes halve2(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
inline Lanes halve1(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
// lane i = the sum of acc[i]'s lanes
inline Lanes reduce(const Lanes (&acc)[kLanes]) {
  Lanes l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) l1[i] = halve8(acc[2 * i], acc[2 * i + 1]);
  for (int i = 0; i < 4; ++i) l2[i] = halve4(l1[2 * i], l1[2 * i + 1]);
  for (int i = 0; i < 2; ++i) l3[i] = halve2(l2[2 * i], l2[2 * i + 1]);
  return halve1(l3[0], l3[1]);
}
#else
inline Lanes halve4(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
inline Lanes halve2(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
}
inline Lanes halve1(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}
// lane i = the sum of acc[i]'s lanes
inline Lanes reduce(const Lanes (&acc)[kLanes]) {
  Lanes l1[4], l2[2];
  for (int i = 0; i < 4; ++i) l1[i] = halve4(acc[2 * i], acc[2 * i + 1]);
  for (int i = 0; i < 2; ++i) l2[i] = halve2(l1[2 * i], l1[2 * i + 1]);
  return halve1(l2[0], l2[1]);
}
#endif

// A (row, query head) of a task: its query, its partial [dim + 2] (numerator, maximum, total) and how many of the
// span's positions it attends
struct Pair {
  const float* q;
  float* acc;
  int64_t length;
};

// scores[i * kSpan + j] = (q_i . k_j) * scale for NP pairs and the block's positions j < length; key_rows[j]: position
// j's K row of the pairs' KV head
template <int NP>
void pair_scores(const Pair* pairs, const float* const* key_rows, int64_t length, int64_t dim, float scale,
                 float* scores) {
  for (int64_t j0 = 0; j0 < length; j0 += kPositions) {
    const float* key[kPositions];
    for (int j = 0; j < kPositions; ++j) key[j] = key_rows[std::min<int64_t>(j0 + j, length - 1)];  // (a repeat: unused)
    Lanes acc[kLanes] = {};
    for (int64_t c = 0; c < dim; c += kLanes) {
      Lanes k[kPositions];
      for (int j = 0; j < kPositions; ++j) k[j] = load(key[j] + c);
      for (int i = 0; i < NP; ++i) {
        const Lanes qv = load(pairs[i].q + c);
        for (int j = 0; j < kPositions; ++j) acc[kPositions * i + j] = fmadd(qv, k[j], acc[kPositions * i + j]);
      }
    }
    const Lanes sums = reduce(acc);
    for (int i = 0; i < NP; ++i)
      for (int j = 0; j < kPositions && j0 + j < length; ++j) scores[i * kSpan + j0 + j] = sums[kPositions * i + j] * scale;
  }
}

// pair i's numerator (dims c0 .. c0 + kLanes NC) = sum over its positions p of weights[i * kSpan + p] v_p, position by
// position; value_rows[p]: position p's V row of the pairs' KV head
template <int NP, int NC>
void pair_values(const Pair* pairs, const float* const* value_rows, const float* weights, int64_t c0) {
  int64_t common = pairs[0].length;
  for (int i = 1; i < NP; ++i) common = std::min(common, pairs[i].length);
  Lanes acc[NP][NC] = {};
  for (int64_t p = 0; p < common; ++p) {
    Lanes v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load(value_rows[p] + c0 + c * kLanes);
    for (int i = 0; i < NP; ++i) {
      const Lanes w = splat(weights[i * kSpan + p]);
      for (int c = 0; c < NC; ++c) acc[i][c] = fmadd(w, v[c], acc[i][c]);
    }
  }
  for (int i = 0; i < NP; ++i) {  // the longer pairs' last positions (a run's later rows), continuing their chains
    for (int64_t p = common; p < pairs[i].length; ++p) {
      const Lanes w = splat(weights[i * kSpan + p]);
      for (int c = 0; c < NC; ++c) acc[i][c] = fmadd(w, load(value_rows[p] + c0 + c * kLanes), acc[i][c]);
    }
    for (int c = 0; c < NC; ++c) store(pairs[i].acc + c0 + c * kLanes, acc[i][c]);
  }
}

using Scores = void (*)(const Pair*, const float* const*, int64_t, int64_t, float, float*);
constexpr Scores kScores[kPairs] = {pair_scores<1>, pair_scores<2>, pair_scores<3>, pair_scores<4>};
using Values = void (*)(const Pair*, const float* const*, const float*, int64_t);
#if defined(__AVX512F__)
constexpr Values kValues[kPairs][kChunks] = {
    {pair_values<1, 1>, pair_values<1, 2>, pair_values<1, 3>, pair_values<1, 4>},
    {pair_values<2, 1>, pair_values<2, 2>, pair_values<2, 3>, pair_values<2, 4>},
    {pair_values<3, 1>, pair_values<3, 2>, pair_values<3, 3>, pair_values<3, 4>},
    {pair_values<4, 1>, pair_values<4, 2>, pair_values<4, 3>, pair_values<4, 4>},
};
#else
constexpr Values kValues[kPairs][kChunks] = {
    {pair_values<1, 1>, pair_values<1, 2>},
    {pair_values<2, 1>, pair_values<2, 2>},
    {pair_values<3, 1>, pair_values<3, 2>},
    {pair_values<4, 1>, pair_values<4, 2>},
};
#endif

// scores[0 .. length) -> e^(score - maximum), with the maximum and the total into stats[0], stats[1] (one function
// for every pair: the total's vector reduction is the same for all; locals, so that no store to scores may change
// them and the loops vectorize)
void softmax_weights(float* scores, int64_t length, float* stats) {
  float top = -INFINITY;
#pragma omp simd reduction(max : top)
  for (int64_t p = 0; p < length; ++p) top = std::max(top, scores[p]);
#pragma omp simd
  for (int64_t p = 0; p < length; ++p) scores[p] = exp_fast(scores[p] - top);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t p = 0; p < length; ++p) sum += scores[p];
  stats[0] = top;
  stats[1] = sum;
}

// One task's span for the rows of a run (head_dim a multiple of kLanes): rows[i]'s query q_rows[i], partial acc_rows[i]
// [heads, dim + 2], positions lo .. lo + lengths[i] (the run's rows share the table: the last row's)
void attend_run_span(const float* const* q_rows, float* const* acc_rows, const int64_t* lengths, int64_t count,
                     const float* k_cache, const float* v_cache, const int32_t* table, int64_t lo, Heads n,
                     int64_t block_size, float scale, std::vector<float>& scores) {
  const int64_t group = n.heads / n.kv_heads, row_stride = n.kv_heads * n.dim, dim = n.dim;
  const int64_t longest = *std::max_element(lengths, lengths + count);
  const float* key_rows[kSpan];
  const float* value_rows[kSpan];
  scores.resize(kPairs * kSpan);
  std::vector<Pair> pairs;
  int64_t slots[kSpan];  // (once per task: the KV heads' rows differ by an offset)
  for (int64_t p = 0; p < longest; ++p)
    slots[p] = (table[(lo + p) / block_size] * block_size + (lo + p) % block_size) * row_stride;
  for (int64_t kh = 0; kh < n.kv_heads; ++kh) {
    for (int64_t p = 0; p < longest; ++p) {
      key_rows[p] = k_cache + slots[p] + kh * dim;
      value_rows[p] = v_cache + slots[p] + kh * dim;
    }
    pairs.clear();
    for (int64_t r = 0; r < count; ++r)
      for (int64_t h = kh * group; h < (kh + 1) * group; ++h)
        pairs.push_back({q_rows[r] + h * dim, acc_rows[r] + h * (dim + 2), lengths[r]});
    for (size_t b = 0; b < pairs.size(); b += kPairs) {
      const int np = static_cast<int>(std::min<size_t>(kPairs, pairs.size() - b));
      const Pair* block = pairs.data() + b;
      int64_t block_longest = 0;
      for (int i = 0; i < np; ++i) block_longest = std::max(block_longest, block[i].length);
      kScores[np - 1](block, key_rows, block_longest, dim, scale, scores.data());
      for (int i = 0; i < np; ++i) softmax_weights(scores.data() + i * kSpan, block[i].length, block[i].acc + dim);
      for (int64_t c0 = 0; c0 < dim; c0 += kChunks * kLanes) {
        const int nc = static_cast<int>(std::min<int64_t>(kChunks, (dim - c0) / kLanes));
        kValues[np - 1][nc - 1](block, value_rows, scores.data(), c0);
      }
    }
  }
}

// a . b (one vector accumulator, reduced at the end; callers overlap independent dots)
inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// The dots of four consecutive query rows q, q + n, q + 2n, q + 3n with four keys, each summed as dot() sums it
// (one vector accumulator, reduced at the end): the same floats as four dot() calls, with four independent chains of
// fused multiply-adds in flight instead of one.
inline void dots4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, int64_t n,
                  float* out) {
  const float *q1 = q + n, *q2 = q + 2 * n, *q3 = q + 3 * n;
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < n; ++i) {
    s0 += q[i] * k0[i];
    s1 += q1[i] * k1[i];
    s2 += q2[i] * k2[i];
    s3 += q3[i] * k3[i];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

// One (row, span of positions) task over all heads, for a head_dim that is not a multiple of kLanes: the span's softmax
// numerator, maximum and total per query head, into acc [heads, dim + 2]. A position's K (and V) of all KV heads is
// one contiguous run of kv_heads * dim floats, read once, in cache order.
void attend_span(const float* q, const float* k_cache, const float* v_cache, const int32_t* table, int64_t lo,
                 int64_t hi, Heads n, int64_t block_size, float scale, std::vector<float>& scores, float* acc) {
  const int64_t length = hi - lo, group = n.heads / n.kv_heads, row_stride = n.kv_heads * n.dim, dim = n.dim;
  scores.resize(n.heads * length);
  for (int64_t p = lo; p < hi;) {  // block by block: one table read and no division per position
    const int64_t offset = p % block_size, count = std::min(block_size - offset, hi - p);
    const float* key = k_cache + (table[p / block_size] * block_size + offset) * row_stride;
    for (int64_t j = 0; j < count; ++j, key += row_stride) {
      int64_t h = 0;
      for (; h + 4 <= n.heads; h += 4) {  // four heads' dots at once: four accumulators in flight, not one chain
        float four[4];
        dots4(q + h * dim, key + (h / group) * dim, key + ((h + 1) / group) * dim, key + ((h + 2) / group) * dim,
              key + ((h + 3) / group) * dim, dim, four);
        for (int64_t i = 0; i < 4; ++i) scores[(h + i) * length + p - lo + j] = four[i] * scale;
      }
      for (; h < n.heads; ++h) scores[h * length + p - lo + j] = dot(q + h * dim, key + (h / group) * dim, dim) * scale;
    }
    p += count;
  }
  for (int64_t h = 0; h < n.heads; ++h) {
    float* sh = scores.data() + h * length;
    float* stats = acc + h * (dim + 2) + dim;
    softmax_weights(sh, length, stats);
    std::fill(acc + h * (dim + 2), stats, 0.0f);
  }
  for (int64_t p = lo; p < hi;) {
    const int64_t offset = p % block_size, count = std::min(block_size - offset, hi - p);
    const float* value = v_cache + (table[p / block_size] * block_size + offset) * row_stride;
    int64_t j = 0;
    for (; j + 4 <= count; j += 4, value += 4 * row_stride) {  // four positions per pass over a head's numerator
      for (int64_t h = 0; h < n.heads; ++h) {
        const float* w = scores.data() + h * length + p - lo + j;
        const float* v0 = value + (h / group) * dim;
        const float *v1 = v0 + row_stride, *v2 = v1 + row_stride, *v3 = v2 + row_stride;
        float* a = acc + h * (dim + 2);
        // the same four multiply-adds in position order as four passes: only a[i]'s loads and stores are shared
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) {
          float x = a[i];
          x += w[0] * v0[i];
          x += w[1] * v1[i];
          x += w[2] * v2[i];
          x += w[3] * v3[i];
          a[i] = x;
        }
      }
    }
    for (; j < count; ++j, value += row_stride) {
      for (int64_t h = 0; h < n.heads; ++h) {
        const float w = scores[h * length + p - lo + j];
        const float* vh = value + (h / group) * dim;
        float* a = acc + h * (dim + 2);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) a[i] += w * vh[i];
      }
    }
    p += count;
  }
}

// Runs of rows (see the top): run g is rows first_row[g] .. first_row[g + 1] - 1. A row joins the one before it
// where its context is one longer, both attend from position 0 (no window, or contexts within it) and their tables
// agree over the earlier row's blocks (one sequence: two sequences sharing a prefix block differ after it).
std::vector<int64_t> row_runs(const int32_t* tables, int64_t table_width, const int32_t* context_lens,
                              int64_t window, int64_t block_size, int64_t rows) {
  std::vector<int64_t> first_row;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t before = r > 0 ? context_lens[r - 1] : 0;
    const bool joins = r > 0 && r - first_row.back() < kRunRows && before > 0 && context_lens[r] == before + 1 &&
                       (window == 0 || context_lens[r] <= window) &&
                       std::equal(tables + r * table_width, tables + r * table_width + (before + block_size - 1) / block_size,
                                  tables + (r - 1) * table_width);
    if (!joins) first_row.push_back(r);
  }
  first_row.push_back(rows);
  return first_row;
}

}  // namespace

void attend(const float* q, const float* k_cache, const float* v_cache, const int32_t* tables, int64_t table_width,
            const int32_t* context_lens, int64_t window, float* out, int64_t rows, Heads n, int64_t block_size,
            float scale) {
  RECORD_FUNCTION("pagedchat_cpu::attend", std::vector<c10::IValue>());
  const int64_t dim = n.dim;
  const bool lanes = dim % kLanes == 0;
  std::vector<int64_t> start(rows), first_task(rows + 1, 0);  // row r's spans: tasks first_task[r] .. [r + 1] - 1
  for (int64_t r = 0; r < rows; ++r) {
    start[r] = window > 0 ? std::max<int64_t>(0, context_lens[r] - window) : 0;
    first_task[r + 1] = first_task[r] + std::max<int64_t>(1, (context_lens[r] - start[r] + kSpan - 1) / kSpan);
  }
  const int64_t part_size = n.heads * (dim + 2);
  std::vector<float> partial(first_task[rows] * part_size);
  // run g's tasks: first_run_task[g] .. [g + 1] - 1, one per span of its longest row (its last)
  const std::vector<int64_t> first_row = row_runs(tables, table_width, context_lens, window, block_size, rows);
  const int64_t runs = static_cast<int64_t>(first_row.size()) - 1;
  std::vector<int64_t> first_run_task(runs + 1, 0);
  for (int64_t g = 0; g < runs; ++g) {
    const int64_t last = first_row[g + 1] - 1;
    first_run_task[g + 1] = first_run_task[g] + (first_task[last + 1] - first_task[last]);
  }
  at::parallel_for(0, first_run_task[runs], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    const float* q_rows[kRunRows];
    float* acc_rows[kRunRows];
    int64_t lengths[kRunRows];
    int64_t g = std::upper_bound(first_run_task.begin(), first_run_task.end(), begin) - first_run_task.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first_run_task[g + 1]) ++g;
      const int64_t span = task - first_run_task[g];
      int64_t count = 0, lo = 0;
      for (int64_t r = first_row[g]; r < first_row[g + 1]; ++r) {
        if (span >= first_task[r + 1] - first_task[r]) continue;  // (a shorter row of the run: no such span)
        lo = start[r] + span * kSpan;  // (the same for every row of a run: all start at 0)
        const int64_t hi = std::min<int64_t>(context_lens[r], lo + kSpan);
        float* acc = partial.data() + (first_task[r] + span) * part_size;
        if (lo >= hi) {  // a row without context (a padding row): no weight in the merge
          for (int64_t h = 0; h < n.heads; ++h) acc[h * (dim + 2) + dim] = -INFINITY;
        } else if (!lanes) {
          attend_span(q + r * n.heads * dim, k_cache, v_cache, tables + r * table_width, lo, hi, n, block_size,
                      scale, scores, acc);
        } else {
          q_rows[count] = q + r * n.heads * dim;
          acc_rows[count] = acc;
          lengths[count++] = hi - lo;
        }
      }
      if (count > 0)
        attend_run_span(q_rows, acc_rows, lengths, count, k_cache, v_cache,
                        tables + (first_row[g + 1] - 1) * table_width, lo, n, block_size, scale, scores);
    }
  });
  // the spans merged by their maxima, in order
  at::parallel_for(0, rows, kParallelRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = 0; h < n.heads; ++h) {
        float* o = out + (r * n.heads + h) * dim;
        float top = -INFINITY;
        for (int64_t task = first_task[r]; task < first_task[r + 1]; ++task)
          top = std::max(top, partial[task * part_size + h * (dim + 2) + dim]);
        if (top == -INFINITY) {
          std::fill(o, o + dim, 0.0f);
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
        for (int64_t i = 0; i < dim; ++i) o[i] = merged[i] / total;
      }
    }
  });
}

Tensor paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens,
                       int64_t window, double scale) {
  check(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(), "paged_attention: q must be contiguous float32 [rows, heads, dim]");
  check(k_cache.scalar_type() == at::kFloat && k_cache.dim() == 4 && k_cache.is_contiguous() &&
            v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
        "paged_attention: caches must be contiguous float32 [blocks, block_size, kv_heads, dim], K and V alike");
  const int64_t rows = q.size(0);
  const Heads n{q.size(1), k_cache.size(2), q.size(2)};
  check(k_cache.size(3) == n.dim && n.dim <= kMaxHeadDim && n.heads % n.kv_heads == 0,
        "paged_attention: head_dim <= 256, the caches' like q's, and whole query groups");
  check(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous() &&
            block_tables.size(0) == rows && context_lens.scalar_type() == at::kInt && context_lens.dim() == 1 &&
            context_lens.size(0) == rows,
        "paged_attention: int32 block_tables [rows, width] and context_lens [rows]");
  const int64_t block_size = k_cache.size(1);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    check(lens[r] >= 0 && lens[r] <= block_tables.size(1) * block_size, "paged_attention: a context beyond its table");
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b)
      check(tables[r * block_tables.size(1) + b] >= 0 && tables[r * block_tables.size(1) + b] < k_cache.size(0),
            "paged_attention: a block id outside the cache");
  }
  check(window >= 0, "paged_attention: window >= 0");
  Tensor out = at::empty({rows, n.heads * n.dim}, q.options());
  attend(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables, block_tables.size(1), lens,
         window, out.data_ptr<float>(), rows, n, block_size, static_cast<float>(scale));
  return out;
}

}  // namespace PAGEDCHAT_CPU_NS
