// GGUF's block formats as matmuls on the CPU: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K weights times float32
// activations quantized to 8 bits per 32 inputs (llama.cpp's Q8 scheme), each weight in its file's own codes and
// scales (no re-quantization). kernels/cpu_tiles.py repacks a tensor's blocks into tiles of 16 outputs; each level
// (cpu_simd.h: AVX-512 VNNI, AVX-512, AVX2, generic) computes the same integer sums exactly and the same float
// steps per output, so every level gives the very same floats, and a row's result depends on no other row.
//
// Per output n and group g of 32 inputs, with activations x ~ s a (a in -127..127, s = max|x| / 127):
//   Q4_0, Q5_0   d (q . a - o sum(a))                      codes q in 0..15 / 0..31, o = 8 / 16
//   Q4_1         d (q . a) + m sum(a)                       (per row: times s, summed over groups)
//   Q8_0         d (w . a)                                  w in -128..127, stored w + 128
//   Q4_K, Q5_K   d sc (q . a) - dmin mn sum(a)              6-bit sc, mn per group; d, dmin per 256 inputs
//   Q6_K         d (sc0 (q . a - 32 sum(a))_0..15 + sc1 (...)_16..31)   int8 sc per 16 inputs; d per 256
// A tile holds 16 outputs x one block of inputs (32, or 256 for the K formats); the codes of a group are four
// 64-byte vectors (vector c: for each output 4 bytes, inputs 8c..8c+3 in the low nibbles, 8c+4..8c+7 in the high
// ones), Q8_0's eight (vector c: inputs 4c..4c+3 as bytes). Byte offsets: the Layout of each format below.
// A decode step's few rows unpack each group's codes into registers as they go, per block of rows; a prompt's many
// rows take a column's groups unpacked once into a scratch (many_rows, where it pays: scratch_pays), the same
// integer sums and float steps per row.
#include "cpu_kernels.h"
#include "cpu_simd.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace PAGEDCHAT_CPU_NS {

using at::Tensor;
using namespace simd;

namespace {

constexpr int kQVecs = 16 / kQLanes;  // vectors per tile of 16 outputs (AVX2, generic: outputs 0..7, then 8..15)

// ggml's type ids (the GGUF file's), the format argument of the ops
enum Format : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct Layout {
  int64_t inputs;  // per tile: 32, or 256 (8 groups) for the K formats
  int64_t bytes;   // per tile
};

constexpr Layout layout(int64_t format) {
  switch (format) {
    case kQ4_0: return {32, 288};     // codes 256 | d 16 x f16
    case kQ4_1: return {32, 320};     // codes 256 | d | m
    case kQ5_0: return {32, 352};     // codes 256 | high bits 64 | d
    case kQ8_0: return {32, 544};     // codes 8 x 64 (w + 128) | d
    case kQ4_K: return {256, 2368};   // d | dmin | sc 8 x 16 | mn 8 x 16 | codes 8 x 256
    case kQ5_K: return {256, 2880};   // as Q4_K | high bits 8 x 64
    case kQ6_K: return {256, 3360};   // d | sc 8 x 2 x 16 (int8) | codes 8 x 256 | high bits 8 x 128
    default: return {0, 0};
  }
}

}  // namespace

void quantize_activations(const float* x, int64_t rows, int64_t k, QuantizedActivations& out) {
  const int64_t groups = k / 32;
  out.rows = rows;
  out.k = k;
  out.codes.resize(rows * k);
  out.scales.resize(rows * groups);
  out.scaled_sums.resize(rows * groups);
  out.sums.resize(rows * groups);
  out.half_sums.resize(rows * groups * 2);
  // (rows are independent: a prompt's hundreds of rows are split between the threads)
  at::parallel_for(0, rows * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / groups, g = task % groups;
      const float* xg = x + r * k + g * 32;
      // (loops the compiler vectorizes: the maximum is exact in any order, a code depends on its input only)
      float top = 0.0f;
#pragma omp simd reduction(max : top)
      for (int i = 0; i < 32; ++i) top = std::max(top, std::fabs(xg[i]));
      const float scale = top / 127.0f, inverse = top > 0.0f ? 127.0f / top : 0.0f;
      int32_t codes[32];
#pragma omp simd
      for (int i = 0; i < 32; ++i) codes[i] = static_cast<int32_t>(std::nearbyint(xg[i] * inverse));
      int32_t low = 0, high = 0;  // the sums of inputs 0..15 and 16..31
#pragma omp simd reduction(+ : low, high)
      for (int i = 0; i < 16; ++i) low += codes[i], high += codes[i + 16];
      const int32_t half[2] = {low, high};
      int8_t* a = out.codes.data() + r * k + g * 32;
#pragma omp simd
      for (int i = 0; i < 32; ++i) a[i] = static_cast<int8_t>(codes[i]);
      const int64_t at = r * groups + g;
      out.scales[at] = scale;
      out.sums[at] = half[0] + half[1];
      out.scaled_sums[at] = scale * static_cast<float>(half[0] + half[1]);
      out.half_sums[2 * at] = half[0];
      out.half_sums[2 * at + 1] = half[1];
    }
  });
}

namespace {

// sum over chunks c in [first, first + count) of q[c] . a[4c .. 4c + 3] per lane, exactly: 16-bit partial sums
// widen to 32 bits every `per16` chunks, as many as add up without saturating (2 * max_code * 127 each)
template <int kMaxCode>
PAGEDCHAT_INLINE IVec dot_chunks(const IVec* q, const int8_t* a, int first, int count) {
  IVec sum = set1_32(0);
  if constexpr (kVnni) {
    for (int c = first; c < first + count; ++c) sum = dpbusd(sum, q[c], broadcast4(a + 4 * c));
  } else {
    constexpr int per16 = 32767 / (2 * kMaxCode * 127);
    for (int c = first; c < first + count; c += per16) {
      IVec s16 = maddubs(q[c], broadcast4(a + 4 * c));
      for (int j = c + 1; j < std::min(c + per16, first + count); ++j)
        s16 = add16(s16, maddubs(q[j], broadcast4(a + 4 * j)));
      sum = add32(sum, pairs_to_32(s16));
    }
  }
  return sum;
}

// a group's 4-bit codes (lane v's outputs): q[2c] low nibbles, q[2c + 1] high nibbles of vector c
PAGEDCHAT_INLINE void nibbles(const uint8_t* codes, int v, IVec* q) {
  for (int c = 0; c < 4; ++c) {
    const IVec packed = load_i(codes + c * 64 + v * kQLanes * 4);
    q[2 * c] = low_nibbles(packed);
    q[2 * c + 1] = high_nibbles(packed);
  }
}

// Q5: one 64-byte vector of fifth bits per group; byte (output, i): bit c = input 8c + i's, bit 4 + c = input
// 8c + 4 + i's
PAGEDCHAT_INLINE void fifth_bits(const uint8_t* high, int v, IVec* q) {
  const IVec hb = load_i(high + v * kQLanes * 4);
  for (int c = 0; c < 4; ++c) {
    q[2 * c] = or_i(q[2 * c], bits_left(hb, 4 - c, 0x10));
    q[2 * c + 1] = or_i(q[2 * c + 1], bits_right(hb, c, 0x10));
  }
}

// Q6: two 64-byte vectors of the codes' top two bits per group; vector p, byte (output, i): bits 2t, 2t + 1 for
// t = 0..3 = inputs 8c + i, 8c + 4 + i, 8c' + i, 8c' + 4 + i of chunks c = 2p, c' = 2p + 1
PAGEDCHAT_INLINE void top_bits(const uint8_t* high, int v, IVec* q) {
  for (int p = 0; p < 2; ++p) {
    const IVec hb = load_i(high + p * 64 + v * kQLanes * 4);
    q[4 * p + 0] = or_i(q[4 * p + 0], bits_left(hb, 4, 0x30));
    q[4 * p + 1] = or_i(q[4 * p + 1], bits_left(hb, 2, 0x30));
    q[4 * p + 2] = or_i(q[4 * p + 2], bits_left(hb, 0, 0x30));
    q[4 * p + 3] = or_i(q[4 * p + 3], bits_right(hb, 2, 0x30));
  }
}

const c10::Half* halves(const uint8_t* p) { return reinterpret_cast<const c10::Half*>(p); }

// What one group of 32 inputs of a tile unpacks to, for the vector v of its outputs: the codes as the dot products
// take them (q[c] . a[4c .. 4c + 3]) and the format's per-output factors. Unpacked per group into registers for a
// few rows (a decode step's), once per column into a scratch for many (a prompt's), where each group's unpacking
// (a third of the work at AVX2 for four rows) would otherwise be repeated for every block of rows.
constexpr int code_vectors(int64_t f) { return f == kQ8_0 && !kVnni ? 16 : f == kQ6_K ? 10 : 8; }
constexpr int factor_vectors(int64_t f) { return f == kQ4_1 || f == kQ4_K || f == kQ5_K ? 2 : 1; }
template <int64_t F>
struct Group {
  IVec q[code_vectors(F)];
  FVec f[factor_vectors(F)];
};

// The K formats' scales of a whole tile (d, and dmin for Q4_K / Q5_K), read once for its 8 groups
struct TileScales {
  FVec d, dmin;
};
template <int64_t F>
PAGEDCHAT_INLINE TileScales tile_scales(const uint8_t* tile, int v) {
  TileScales ts{fzero(), fzero()};
  if constexpr (F == kQ4_K || F == kQ5_K || F == kQ6_K) ts.d = half_to_float(halves(tile) + v * kQLanes);
  if constexpr (F == kQ4_K || F == kQ5_K) ts.dmin = half_to_float(halves(tile + 32) + v * kQLanes);
  return ts;
}

// group gi of the tile (0..7 for the K formats, 0 for the others)
template <int64_t F>
PAGEDCHAT_INLINE void unpack(const uint8_t* tile, int v, int gi, const TileScales& ts, Group<F>& u) {
  if constexpr (F == kQ4_0 || F == kQ5_0) {
    // q . a - o sum(a); f: d
    nibbles(tile, v, u.q);
    if constexpr (F == kQ5_0) fifth_bits(tile + 256, v, u.q);
    u.f[0] = half_to_float(halves(tile + (F == kQ4_0 ? 256 : 320)) + v * kQLanes);
  } else if constexpr (F == kQ4_1) {
    // f: d, m
    nibbles(tile, v, u.q);
    u.f[0] = half_to_float(halves(tile + 256) + v * kQLanes);
    u.f[1] = half_to_float(halves(tile + 288) + v * kQLanes);
  } else if constexpr (F == kQ8_0) {
    // the weights stored w + 128; without VNNI q[c] = |w|, q[8 + c] = w (its signs)
    for (int c = 0; c < 8; ++c) {
      const IVec biased = load_i(tile + c * 64 + v * kQLanes * 4);
      if constexpr (kVnni) {
        u.q[c] = biased;
      } else {
        u.q[8 + c] = unbias(biased);
        u.q[c] = abs8(u.q[8 + c]);
      }
    }
    u.f[0] = half_to_float(halves(tile + 512) + v * kQLanes);
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    // f: d sc, dmin mn (exact in float32: 11 x 6 bits)
    nibbles(tile + 320 + gi * 256, v, u.q);
    if constexpr (F == kQ5_K) fifth_bits(tile + 2368 + gi * 64, v, u.q);
    u.f[0] = mul(ts.d, cvt(u8_to_32(tile + 64 + gi * 16 + v * kQLanes)));
    u.f[1] = mul(ts.dmin, cvt(u8_to_32(tile + 192 + gi * 16 + v * kQLanes)));
  } else {
    // Q6_K: q[8], q[9] the int8 scales of inputs 0..15 and 16..31; f: d
    const int8_t* sc = reinterpret_cast<const int8_t*>(tile + 32);
    nibbles(tile + 288 + gi * 256, v, u.q);
    top_bits(tile + 2336 + gi * 128, v, u.q);
    u.q[8] = s8_to_32(sc + (2 * gi) * 16 + v * kQLanes);
    u.q[9] = s8_to_32(sc + (2 * gi + 1) * 16 + v * kQLanes);
    u.f[0] = ts.d;
  }
}

// Where a row's quantized activations start
struct Row {
  const int8_t* codes;  // the row's K codes
  int64_t at;           // index of its first group in scales, sums, ...
};
inline Row row_of(const QuantizedActivations& act, int64_t r) { return {act.codes.data() + r * act.k, r * (act.k / 32)}; }

// acc += the group's part of one row's dot products (group g of the row's K / 32)
template <int64_t F>
PAGEDCHAT_INLINE void accumulate(const QuantizedActivations& act, Row row, int64_t g, const Group<F>& u, FVec& acc) {
  const int64_t at = row.at + g;
  const int8_t* a = row.codes + g * 32;
  const float s = act.scales[at];
  if constexpr (F == kQ4_0 || F == kQ5_0) {
    // d (q . a - o sum(a)) s, o = 8 / 16
    constexpr int bits = F == kQ4_0 ? 4 : 5, offset = 1 << (bits - 1);
    const IVec sum = sub32(dot_chunks<(1 << bits) - 1>(u.q, a, 0, 8), set1_32(offset * act.sums[at]));
    acc = fmadd(cvt(sum), mul(u.f[0], set1(s)), acc);
  } else if constexpr (F == kQ4_1) {
    // d (q . a) s + m s sum(a)
    acc = fmadd(cvt(dot_chunks<15>(u.q, a, 0, 8)), mul(u.f[0], set1(s)), acc);
    acc = fmadd(u.f[1], set1(act.scaled_sums[at]), acc);
  } else if constexpr (F == kQ8_0) {
    // d (w . a) s: vpdpbusd takes unsigned bytes on one side (128 sum(a) is taken off again, exactly); without
    // VNNI, vpmaddubsw's pairs would saturate on 255 * 127 * 2, so the products are |w| x (a with w's sign): at
    // most 2 * 128 * 127 = 32512 per pair, exact (llama.cpp's AVX2 Q8_0 dot)
    IVec sum;
    if constexpr (kVnni) {
      sum = set1_32(-128 * act.sums[at]);
      for (int c = 0; c < 8; ++c) sum = dpbusd(sum, u.q[c], broadcast4(a + 4 * c));
    } else {
      sum = pairs_to_32(maddubs(u.q[0], sign8(broadcast4(a), u.q[8])));
      for (int c = 1; c < 8; ++c) sum = add32(sum, pairs_to_32(maddubs(u.q[c], sign8(broadcast4(a + 4 * c), u.q[8 + c]))));
    }
    acc = fmadd(cvt(sum), mul(u.f[0], set1(s)), acc);
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    // (d sc) (q . a) s - (dmin mn) s sum(a)
    acc = fmadd(cvt(dot_chunks<F == kQ4_K ? 15 : 31>(u.q, a, 0, 8)), mul(u.f[0], set1(s)), acc);
    acc = fnmadd(u.f[1], set1(act.scaled_sums[at]), acc);
  } else {
    // Q6_K: d s (sc0 (q . a - 32 sum(a)) over inputs 0..15 + sc1 (...) over 16..31), the bracket in exact integers
    const IVec low = sub32(dot_chunks<63>(u.q, a, 0, 4), set1_32(32 * act.half_sums[2 * at]));
    const IVec high = sub32(dot_chunks<63>(u.q, a, 4, 4), set1_32(32 * act.half_sums[2 * at + 1]));
    acc = fmadd(cvt(add32(mullo32(u.q[8], low), mullo32(u.q[9], high))), mul(u.f[0], set1(s)), acc);
  }
}

template <int64_t F>
constexpr int kTileGroups = static_cast<int>(layout(F).inputs / 32);

// Rows rows (from row0, Rows <= kQ4Rows) times one 16-output column of tiles (all of K), into out[row, 0..15] (row
// stride n), each group unpacked into registers. One vector of outputs at a time (AVX2's two: the other's
// accumulators and codes would not fit its 16 registers); a lane's sums are the same in either order.
template <int64_t F, int Rows>
void tile_column(const QuantizedActivations& act, int64_t row0, const uint8_t* tiles, float* out, int64_t n) {
  constexpr Layout lay = layout(F);
  const int64_t count = act.k / lay.inputs;
  for (int v = 0; v < kQVecs; ++v) {
    FVec acc[Rows];
    Row row[Rows];
    PAGEDCHAT_UNROLL for (int r = 0; r < Rows; ++r) acc[r] = fzero(), row[r] = row_of(act, row0 + r);
    for (int64_t t = 0; t < count; ++t) {
      const TileScales ts = tile_scales<F>(tiles + t * lay.bytes, v);
      for (int gi = 0; gi < kTileGroups<F>; ++gi) {
        Group<F> u;
        unpack<F>(tiles + t * lay.bytes, v, gi, ts, u);
        PAGEDCHAT_UNROLL for (int r = 0; r < Rows; ++r) accumulate<F>(act, row[r], t * kTileGroups<F> + gi, u, acc[r]);
      }
    }
    PAGEDCHAT_UNROLL for (int r = 0; r < Rows; ++r) store_f(out + r * n + v * kQLanes, acc[r]);
  }
}

// Rows rows (from row0) against groups already unpacked (one column's vector v, all of K)
template <int64_t F, int Rows>
void unpacked_rows(const QuantizedActivations& act, int64_t row0, const Group<F>* groups, float* out, int64_t n, int v) {
  FVec acc[Rows];
  Row row[Rows];
  PAGEDCHAT_UNROLL for (int r = 0; r < Rows; ++r) acc[r] = fzero(), row[r] = row_of(act, row0 + r);
  for (int64_t g = 0; g < act.k / 32; ++g)
    PAGEDCHAT_UNROLL for (int r = 0; r < Rows; ++r) accumulate<F>(act, row[r], g, groups[g], acc[r]);
  PAGEDCHAT_UNROLL for (int r = 0; r < Rows; ++r) store_f(out + r * n + v * kQLanes, acc[r]);
}

template <int64_t F, int... Rows>
constexpr auto unpacked_blocks(std::integer_sequence<int, Rows...>) {
  return std::array{unpacked_rows<F, Rows + 1>...};
}

// All of act's rows times columns [c0, c1) of one part's tiles (column c's outputs at out[:, 16 c ...]): each
// column's groups unpacked once into a scratch, then every block of kQ4Rows rows over them. The same integer sums
// and float steps per row as tile_column, so the same floats.
template <int64_t F>
void many_rows(const QuantizedActivations& act, const uint8_t* tiles, int64_t c0, int64_t c1, float* out, int64_t n) {
  constexpr Layout lay = layout(F);
  static constexpr auto blocks = unpacked_blocks<F>(std::make_integer_sequence<int, kQ4Rows>{});
  const int64_t count = act.k / lay.inputs;
  std::vector<Group<F>> groups(count * kTileGroups<F>);
  for (int64_t c = c0; c < c1; ++c) {
    const uint8_t* column = tiles + c * count * lay.bytes;
    for (int v = 0; v < kQVecs; ++v) {
      for (int64_t t = 0; t < count; ++t) {
        const TileScales ts = tile_scales<F>(column + t * lay.bytes, v);
        for (int gi = 0; gi < kTileGroups<F>; ++gi)
          unpack<F>(column + t * lay.bytes, v, gi, ts, groups[t * kTileGroups<F> + gi]);
      }
      for (int64_t r = 0; r < act.rows; r += kQ4Rows)
        blocks[std::min<int64_t>(kQ4Rows, act.rows - r) - 1](act, r, groups.data(), out + r * n + c * 16, n, v);
    }
  }
}

using Column = void (*)(const QuantizedActivations&, int64_t, const uint8_t*, float*, int64_t);
template <int64_t F, int... Rows>
constexpr std::array<Column, sizeof...(Rows)> columns(std::integer_sequence<int, Rows...>) {
  return {tile_column<F, Rows + 1>...};
}
template <int64_t F>
constexpr auto kColumns = columns<F>(std::make_integer_sequence<int, kQ4Rows>{});

Column column_for(int64_t format, int64_t rows) {
  const int64_t i = std::min<int64_t>(kQ4Rows, rows) - 1;
  switch (format) {
    case kQ4_0: return kColumns<kQ4_0>[i];
    case kQ4_1: return kColumns<kQ4_1>[i];
    case kQ5_0: return kColumns<kQ5_0>[i];
    case kQ8_0: return kColumns<kQ8_0>[i];
    case kQ4_K: return kColumns<kQ4_K>[i];
    case kQ5_K: return kColumns<kQ5_K>[i];
    case kQ6_K: return kColumns<kQ6_K>[i];
    default: return nullptr;
  }
}

// Where the scratch pays (memory-bound columns, 1-512 rows, AMD Zen 4, 2026-11-30): unpacking into it and reading it
// back costs more than unpacking again per block of rows below ~16 rows at AVX2 and ~64 at AVX-512 (Q4_1 at 16 rows
// 25% slower there); with VNNI the formats whose unpacking is a load or a nibble split (Q4_0, Q4_1, Q8_0) gain
// nothing from it at any count.
constexpr int64_t kScratchRows = kQLanes == 16 ? 64 : 16;
bool scratch_pays(int64_t format, int64_t rows) {
  const bool cheap = format == kQ4_0 || format == kQ4_1 || format == kQ8_0;
  return rows >= kScratchRows && !(kVnni && cheap);
}

using ManyRows = void (*)(const QuantizedActivations&, const uint8_t*, int64_t, int64_t, float*, int64_t);
ManyRows many_rows_for(int64_t format) {
  switch (format) {
    case kQ4_0: return many_rows<kQ4_0>;
    case kQ4_1: return many_rows<kQ4_1>;
    case kQ5_0: return many_rows<kQ5_0>;
    case kQ8_0: return many_rows<kQ8_0>;
    case kQ4_K: return many_rows<kQ4_K>;
    case kQ5_K: return many_rows<kQ5_K>;
    case kQ6_K: return many_rows<kQ6_K>;
    default: return nullptr;
  }
}

}  // namespace

void check_tiles(const Tensor& tiles, int64_t format, int64_t k) {
  const Layout lay = layout(format);
  check(lay.inputs > 0, "gguf_linear: format must be a ggml type id of Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K");
  check(tiles.scalar_type() == at::kByte && tiles.dim() == 3 && tiles.is_contiguous() && tiles.size(2) == lay.bytes &&
            tiles.size(1) * lay.inputs == k,
        "gguf_linear: tiles must be uint8 [N / 16, K / tile inputs, tile bytes] for the format (kernels/cpu_tiles.py)");
}

// out[:, column offset of part p ...] = act times part p's tiles, for every part, the parts' 16-output columns
// shared out between the threads
void gguf_matmul(const QuantizedActivations& act, at::TensorList tiles, at::IntArrayRef formats, float* out, int64_t n) {
  std::vector<int64_t> first_column(tiles.size() + 1, 0);
  for (size_t p = 0; p < tiles.size(); ++p) first_column[p + 1] = first_column[p] + tiles[p].size(0);
  const int64_t rows = act.rows;
  at::parallel_for(0, first_column.back(), 2, [&](int64_t begin, int64_t end) {
    size_t p = std::upper_bound(first_column.begin(), first_column.end(), begin) - first_column.begin() - 1;
    for (int64_t c = begin; c < end; ++p) {
      // columns [c, stop) of part p
      const int64_t stop = std::min(end, first_column[p + 1]);
      const Tensor& part = tiles[p];
      if (scratch_pays(formats[p], rows)) {
        many_rows_for(formats[p])(act, part.data_ptr<uint8_t>(), c - first_column[p], stop - first_column[p],
                                  out + first_column[p] * 16, n);
      } else {
        for (; c < stop; ++c) {
          const uint8_t* column = part.data_ptr<uint8_t>() + (c - first_column[p]) * part.size(1) * part.size(2);
          for (int64_t r = 0; r < rows; r += kQ4Rows)
            column_for(formats[p], rows - r)(act, r, column, out + r * n + c * 16, n);
        }
      }
      c = stop;
    }
  });
}

Tensor gguf_linear(Tensor x, at::TensorList tiles, at::IntArrayRef formats) {
  RECORD_FUNCTION("pagedchat_cpu::gguf_linear", std::vector<c10::IValue>());
  check(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % 32 == 0, "gguf_linear: x must be float32 [M, K], K a multiple of 32");
  check(!tiles.empty() && tiles.size() == formats.size(), "gguf_linear: one format per part");
  Tensor rows = x.contiguous();
  int64_t n = 0;
  for (size_t p = 0; p < tiles.size(); ++p) {
    check_tiles(tiles[p], formats[p], rows.size(1));
    n += tiles[p].size(0) * 16;
  }
  Tensor out = at::empty({rows.size(0), n}, rows.options());
  QuantizedActivations act;
  quantize_activations(rows.data_ptr<float>(), rows.size(0), rows.size(1), act);
  gguf_matmul(act, tiles, formats, out.data_ptr<float>(), n);
  return out;
}

}  // namespace PAGEDCHAT_CPU_NS
