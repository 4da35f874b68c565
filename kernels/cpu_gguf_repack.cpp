// A GGUF tensor's raw blocks straight into the tile layout of the native GGUF matmul (cpu_gguf_matmul.cpp), at
// load: each output row's blocks decoded to their codes and scales (ggml's layouts, ggml-common.h) and written in
// place in their tile, in parallel over the 16-output columns. kernels/cpu_tiles.py is the same layout in torch (the
// reference: tests/kernels/test_gguf_kernels.py holds the two equal); this one is what loading takes, at memory
// speed, without the intermediate one-byte-per-weight codes.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace PAGEDCHAT_CPU_NS {

using at::Tensor;

namespace {

struct Geometry {
  int64_t block_inputs, block_bytes, tile_inputs, tile_bytes;
};

Geometry geometry(int64_t format) {
  switch (format) {
    case 2: return {32, 18, 32, 288};       // Q4_0
    case 3: return {32, 20, 32, 320};       // Q4_1
    case 6: return {32, 22, 32, 352};       // Q5_0
    case 8: return {32, 34, 32, 544};       // Q8_0
    case 12: return {256, 144, 256, 2368};  // Q4_K
    case 13: return {256, 176, 256, 2880};  // Q5_K
    case 14: return {256, 210, 256, 3360};  // Q6_K
    default: return {0, 0, 0, 0};
  }
}

// One group of 32 codes of output j into its tile: four 64-byte vectors of nibbles (vector c, output j, byte k: low
// nibble code 8c + k, high nibble code 8c + 4 + k)
void put_nibbles(uint8_t* codes, int j, const uint8_t* q) {
  for (int c = 0; c < 4; ++c)
    for (int k = 0; k < 4; ++k)
      codes[c * 64 + j * 4 + k] = static_cast<uint8_t>((q[8 * c + k] & 0x0F) | ((q[8 * c + 4 + k] & 0x0F) << 4));
}

// fifth bits: byte (j, k): bit c = code 8c + k's, bit 4 + c = code 8c + 4 + k's
void put_fifth_bits(uint8_t* high, int j, const uint8_t* q) {
  for (int k = 0; k < 4; ++k) {
    uint8_t byte = 0;
    for (int c = 0; c < 4; ++c)
      byte |= static_cast<uint8_t>((((q[8 * c + k] >> 4) & 1) << c) | (((q[8 * c + 4 + k] >> 4) & 1) << (4 + c)));
    high[j * 4 + k] = byte;
  }
}

// top two bits: vector p, byte (j, k): bits 2t, 2t + 1 for t = 2 (c mod 2) + nibble of chunk c = 2p + (c mod 2)
void put_top_bits(uint8_t* high, int j, const uint8_t* q) {
  for (int p = 0; p < 2; ++p)
    for (int k = 0; k < 4; ++k) {
      uint8_t byte = 0;
      for (int cc = 0; cc < 2; ++cc)
        for (int nib = 0; nib < 2; ++nib)
          byte |= static_cast<uint8_t>(((q[8 * (2 * p + cc) + 4 * nib + k] >> 4) & 3) << (2 * (2 * cc + nib)));
      high[p * 64 + j * 4 + k] = byte;
    }
}

void put_half(uint8_t* tile, int64_t at, int j, const uint8_t* half) { std::memcpy(tile + at + 2 * j, half, 2); }

// the 32 codes of a Q4_0 / Q4_1 / Q5_0 block: byte i's low nibble is code i, its high nibble code i + 16
void legacy_codes(const uint8_t* qs, const uint8_t* qh, uint8_t* q) {
  uint32_t high = 0;
  if (qh != nullptr) std::memcpy(&high, qh, 4);
  for (int i = 0; i < 16; ++i) {
    q[i] = static_cast<uint8_t>((qs[i] & 0x0F) | (((high >> i) & 1) << 4));
    q[i + 16] = static_cast<uint8_t>((qs[i] >> 4) | (((high >> (i + 16)) & 1) << 4));
  }
}

// Q4_K / Q5_K's 6-bit scale and minimum of sub-block s (ggml's get_scale_min_k4)
void scale_min_k4(int s, const uint8_t* scales, uint8_t* sc, uint8_t* mn) {
  if (s < 4) {
    *sc = scales[s] & 63;
    *mn = scales[s + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((scales[s + 4] & 0x0F) | ((scales[s - 4] >> 6) << 4));
    *mn = static_cast<uint8_t>((scales[s + 4] >> 4) | ((scales[s] >> 6) << 4));
  }
}

// one output row j's block (the tile's inputs) into the tile
void repack_block(int64_t format, const uint8_t* b, uint8_t* tile, int j) {
  uint8_t q[256];
  switch (format) {
    case 2:  // Q4_0: d | qs
      legacy_codes(b + 2, nullptr, q);
      put_nibbles(tile, j, q);
      put_half(tile, 256, j, b);
      break;
    case 3:  // Q4_1: d | m | qs
      legacy_codes(b + 4, nullptr, q);
      put_nibbles(tile, j, q);
      put_half(tile, 256, j, b);
      put_half(tile, 288, j, b + 2);
      break;
    case 6:  // Q5_0: d | qh | qs
      legacy_codes(b + 6, b + 2, q);
      put_nibbles(tile, j, q);
      put_fifth_bits(tile + 256, j, q);
      put_half(tile, 320, j, b);
      break;
    case 8:  // Q8_0: d | 32 int8, stored + 128
      for (int c = 0; c < 8; ++c)
        for (int k = 0; k < 4; ++k) tile[c * 64 + j * 4 + k] = static_cast<uint8_t>(b[2 + 4 * c + k] ^ 0x80);
      put_half(tile, 512, j, b);
      break;
    case 12:
    case 13: {  // Q4_K: d | dmin | scales 12 | qs 128; Q5_K: ... | qh 32 | qs 128
      const bool five = format == 13;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int e = 0; e < 256; ++e) {
        const int chunk = e / 64, at = e % 64;
        const uint8_t byte = qs[32 * chunk + at % 32];
        q[e] = at < 32 ? (byte & 0x0F) : (byte >> 4);
        if (five) q[e] = static_cast<uint8_t>(q[e] | (((b[16 + e % 32] >> (e / 32)) & 1) << 4));
      }
      put_half(tile, 0, j, b);
      put_half(tile, 32, j, b + 2);
      for (int g = 0; g < 8; ++g) {
        scale_min_k4(g, b + 4, tile + 64 + g * 16 + j, tile + 192 + g * 16 + j);
        put_nibbles(tile + 320 + g * 256, j, q + 32 * g);
        if (five) put_fifth_bits(tile + 2368 + g * 64, j, q + 32 * g);
      }
      break;
    }
    case 14: {  // Q6_K: ql 128 | qh 64 | scales 16 (int8) | d
      for (int e = 0; e < 256; ++e) {
        const int half = e / 128, r = e % 128, kk = r / 32, l = r % 32;
        const uint8_t low = b[64 * half + l + 32 * (kk % 2)];
        const uint8_t top = (b[128 + 32 * half + l] >> (2 * kk)) & 3;
        q[e] = static_cast<uint8_t>((kk < 2 ? (low & 0x0F) : (low >> 4)) | (top << 4));
      }
      put_half(tile, 0, j, b + 208);
      for (int s = 0; s < 16; ++s) tile[32 + s * 16 + j] = b[192 + s];
      for (int g = 0; g < 8; ++g) {
        put_nibbles(tile + 288 + g * 256, j, q + 32 * g);
        put_top_bits(tile + 2336 + g * 128, j, q + 32 * g);
      }
      break;
    }
  }
}

}  // namespace

Tensor gguf_tiles(Tensor raw, int64_t format, int64_t rows, int64_t cols) {
  const Geometry geo = geometry(format);
  check(geo.tile_inputs > 0, "gguf_tiles: format must be a ggml type id of Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K");
  check(raw.scalar_type() == at::kByte && raw.is_contiguous() && cols % geo.tile_inputs == 0 &&
            raw.numel() == rows * (cols / geo.block_inputs) * geo.block_bytes,
        "gguf_tiles: raw must be the tensor's contiguous uint8 bytes, [rows, cols / block * block bytes]");
  const int64_t columns = (rows + 15) / 16, tiles_per_row = cols / geo.tile_inputs;
  const int64_t row_bytes = (cols / geo.block_inputs) * geo.block_bytes;
  Tensor out = at::zeros({columns, tiles_per_row, geo.tile_bytes}, raw.options());  // (padding rows: zeros)
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, columns, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      for (int j = 0; j < 16 && c * 16 + j < rows; ++j)
        for (int64_t t = 0; t < tiles_per_row; ++t)
          repack_block(format, src + (c * 16 + j) * row_bytes + t * geo.block_bytes,
                       dst + (c * tiles_per_row + t) * geo.tile_bytes, j);
  });
  return out;
}

}  // namespace PAGEDCHAT_CPU_NS
