// The instruction-set layer of the quantized matmuls (cpu_quant_matmul.cpp, cpu_gguf_matmul.cpp): the few integer
// and float vector operations they need, as AVX-512 (16 outputs per vector), AVX2 (8) or plain C++ over 8 lanes
// (the generic build: other CPUs, x86 before AVX2). The build's flags pick one (kernels/cpu_native.py compiles a
// library per level).
//
// The integer sums are exact on every level and the float steps are the same per lane (fused multiply-adds:
// std::fma in the generic build), so every level gives the very same floats:
//   AVX-512 VNNI  vpdpbusd: 4 u8 x s8 products per 32-bit lane, added to it
//   AVX-512 BW    vpmaddubsw (2 products per 16-bit lane) then vpmaddwd by ones (pairs to 32 bits), as
//   AVX2          llama.cpp's AVX2 path does; 16 outputs are one 512-bit or two 256-bit vectors.
//   generic       the same operations lane by lane
// Q4_1: each 16-bit lane of one vpmaddubsw is at most 2 * 15 * 127 = 3810, so the 8 of a group add up in 16
// bits without saturating (30480 < 32767) before one vpmaddwd; wider codes widen to 32 bits sooner.
#pragma once

#include "cpu_kernels.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define Q4Q8_BUILT 1

// The tile kernels' loops over rows unrolled and their helpers inlined, so that the accumulators and a
// group's codes stay in registers (a loop over rows kept them on the stack: a store and a load per multiply-add)
#define PAGEDCHAT_UNROLL _Pragma("GCC unroll 16")
#define PAGEDCHAT_INLINE inline __attribute__((always_inline))

namespace PAGEDCHAT_CPU_NS::simd {

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kQLanes = 16;  // int32 lanes (outputs) per vector
constexpr int64_t kQ4Rows = 8;
using IVec = __m512i;
using FVec = __m512;
inline IVec load_i(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IVec broadcast4(const int8_t* a) {
  int32_t four;
  std::memcpy(&four, a, sizeof(four));
  return _mm512_set1_epi32(four);
}
inline IVec low_nibbles(IVec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline IVec high_nibbles(IVec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
// bits `mask` of each byte of v shifted left / right by s (16-bit shifts: callers keep the bits inside the byte)
inline IVec bits_left(IVec v, int s, uint8_t mask) {
  return _mm512_and_si512(_mm512_slli_epi16(v, s), _mm512_set1_epi8(static_cast<char>(mask)));
}
inline IVec bits_right(IVec v, int s, uint8_t mask) {
  return _mm512_and_si512(_mm512_srli_epi16(v, s), _mm512_set1_epi8(static_cast<char>(mask)));
}
inline IVec or_i(IVec a, IVec b) { return _mm512_or_si512(a, b); }
inline FVec half_to_float(const c10::Half* h) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}
inline IVec u8_to_32(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline IVec s8_to_32(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline FVec cvt(IVec v) { return _mm512_cvtepi32_ps(v); }
inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
inline FVec fnmadd(FVec a, FVec b, FVec c) { return _mm512_fnmadd_ps(a, b, c); }
inline FVec mul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
inline FVec set1(float v) { return _mm512_set1_ps(v); }
inline FVec fzero() { return _mm512_setzero_ps(); }
inline void store_f(float* p, FVec v) { _mm512_storeu_ps(p, v); }
inline IVec add32(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec sub32(IVec a, IVec b) { return _mm512_sub_epi32(a, b); }
inline IVec mullo32(IVec a, IVec b) { return _mm512_mullo_epi32(a, b); }
inline IVec set1_32(int32_t v) { return _mm512_set1_epi32(v); }
inline IVec pairs_to_32(IVec s16) { return _mm512_madd_epi16(s16, _mm512_set1_epi16(1)); }
inline IVec maddubs(IVec u, IVec s) { return _mm512_maddubs_epi16(u, s); }
inline IVec add16(IVec a, IVec b) { return _mm512_add_epi16(a, b); }
// the biased Q8_0 byte w + 128 back to w, its |w|, and a with w's sign (AVX-512 has no vpsignb: a mask)
inline IVec unbias(IVec v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline IVec abs8(IVec v) { return _mm512_abs_epi8(v); }
inline IVec sign8(IVec a, IVec w) { return _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), _mm512_setzero_si512(), a); }
#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
inline IVec dpbusd(IVec acc, IVec u, IVec s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
constexpr bool kVnni = false;
inline IVec dpbusd(IVec acc, IVec, IVec) { return acc; }  // (never called)
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kVnni = false;
constexpr int kQLanes = 8;
constexpr int64_t kQ4Rows = 4;  // 16 vector registers: fewer rows in flight than AVX-512's 32
using IVec = __m256i;
using FVec = __m256;
inline IVec load_i(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IVec broadcast4(const int8_t* a) {
  int32_t four;
  std::memcpy(&four, a, sizeof(four));
  return _mm256_set1_epi32(four);
}
inline IVec low_nibbles(IVec v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline IVec high_nibbles(IVec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline IVec bits_left(IVec v, int s, uint8_t mask) {
  return _mm256_and_si256(_mm256_sll_epi16(v, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(static_cast<char>(mask)));
}
inline IVec bits_right(IVec v, int s, uint8_t mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(static_cast<char>(mask)));
}
inline IVec or_i(IVec a, IVec b) { return _mm256_or_si256(a, b); }
inline FVec half_to_float(const c10::Half* h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}
inline IVec u8_to_32(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline IVec s8_to_32(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline FVec cvt(IVec v) { return _mm256_cvtepi32_ps(v); }
inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
inline FVec fnmadd(FVec a, FVec b, FVec c) { return _mm256_fnmadd_ps(a, b, c); }
inline FVec mul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline FVec set1(float v) { return _mm256_set1_ps(v); }
inline FVec fzero() { return _mm256_setzero_ps(); }
inline void store_f(float* p, FVec v) { _mm256_storeu_ps(p, v); }
inline IVec add32(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec sub32(IVec a, IVec b) { return _mm256_sub_epi32(a, b); }
inline IVec mullo32(IVec a, IVec b) { return _mm256_mullo_epi32(a, b); }
inline IVec set1_32(int32_t v) { return _mm256_set1_epi32(v); }
inline IVec pairs_to_32(IVec s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }
inline IVec maddubs(IVec u, IVec s) { return _mm256_maddubs_epi16(u, s); }
inline IVec add16(IVec a, IVec b) { return _mm256_add_epi16(a, b); }
inline IVec unbias(IVec v) { return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))); }
inline IVec abs8(IVec v) { return _mm256_abs_epi8(v); }
inline IVec sign8(IVec a, IVec w) { return _mm256_sign_epi8(a, w); }
inline IVec dpbusd(IVec acc, IVec, IVec) { return acc; }  // (never called)
#else
// Plain C++ over 8 lanes of 4 bytes, the AVX2 layout: the compiler vectorizes what its target allows. std::fma is
// the fused multiply-add of the vector levels (one rounding), so the generic build gives their floats too.
constexpr bool kVnni = false;
constexpr int kQLanes = 8;
constexpr int64_t kQ4Rows = 4;
struct IVec {
  union {
    uint8_t u8[32];
    int8_t s8[32];
    int16_t s16[16];
    int32_t s32[8];
  };
};
struct FVec {
  float f[8];
};
inline IVec load_i(const uint8_t* p) {
  IVec v;
  std::memcpy(v.u8, p, 32);
  return v;
}
inline IVec broadcast4(const int8_t* a) {
  IVec v;
  for (int l = 0; l < 8; ++l) std::memcpy(v.u8 + 4 * l, a, 4);
  return v;
}
inline IVec low_nibbles(IVec v) {
  for (auto& b : v.u8) b &= 0x0F;
  return v;
}
inline IVec high_nibbles(IVec v) {
  for (auto& b : v.u8) b = static_cast<uint8_t>(b >> 4);
  return v;
}
inline IVec bits_left(IVec v, int s, uint8_t mask) {
  for (auto& b : v.u8) b = static_cast<uint8_t>((b << s) & mask);
  return v;
}
inline IVec bits_right(IVec v, int s, uint8_t mask) {
  for (auto& b : v.u8) b = static_cast<uint8_t>((b >> s) & mask);
  return v;
}
inline IVec or_i(IVec a, IVec b) {
  for (int i = 0; i < 32; ++i) a.u8[i] |= b.u8[i];
  return a;
}
inline FVec half_to_float(const c10::Half* h) {
  FVec v;
  for (int l = 0; l < 8; ++l) v.f[l] = static_cast<float>(h[l]);
  return v;
}
inline IVec u8_to_32(const uint8_t* p) {
  IVec v;
  for (int l = 0; l < 8; ++l) v.s32[l] = p[l];
  return v;
}
inline IVec s8_to_32(const int8_t* p) {
  IVec v;
  for (int l = 0; l < 8; ++l) v.s32[l] = p[l];
  return v;
}
inline FVec cvt(IVec v) {
  FVec f;
  for (int l = 0; l < 8; ++l) f.f[l] = static_cast<float>(v.s32[l]);
  return f;
}
inline FVec fmadd(FVec a, FVec b, FVec c) {
  for (int l = 0; l < 8; ++l) c.f[l] = std::fma(a.f[l], b.f[l], c.f[l]);
  return c;
}
inline FVec fnmadd(FVec a, FVec b, FVec c) {
  for (int l = 0; l < 8; ++l) c.f[l] = std::fma(-a.f[l], b.f[l], c.f[l]);
  return c;
}
inline FVec mul(FVec a, FVec b) {
  for (int l = 0; l < 8; ++l) a.f[l] *= b.f[l];
  return a;
}
inline FVec set1(float v) {
  FVec f;
  for (auto& x : f.f) x = v;
  return f;
}
inline FVec fzero() { return set1(0.0f); }
inline void store_f(float* p, FVec v) { std::memcpy(p, v.f, sizeof(v.f)); }
inline IVec add32(IVec a, IVec b) {
  for (int l = 0; l < 8; ++l) a.s32[l] += b.s32[l];
  return a;
}
inline IVec sub32(IVec a, IVec b) {
  for (int l = 0; l < 8; ++l) a.s32[l] -= b.s32[l];
  return a;
}
inline IVec mullo32(IVec a, IVec b) {
  for (int l = 0; l < 8; ++l) a.s32[l] *= b.s32[l];
  return a;
}
inline IVec set1_32(int32_t v) {
  IVec out;
  for (auto& x : out.s32) x = v;
  return out;
}
inline IVec pairs_to_32(IVec s16) {
  IVec out;
  for (int l = 0; l < 8; ++l) out.s32[l] = int32_t{s16.s16[2 * l]} + s16.s16[2 * l + 1];
  return out;
}
inline int16_t saturate16(int32_t v) { return static_cast<int16_t>(std::clamp(v, -32768, 32767)); }
inline IVec maddubs(IVec u, IVec s) {
  IVec out;
  for (int i = 0; i < 16; ++i)
    out.s16[i] = saturate16(int32_t{u.u8[2 * i]} * s.s8[2 * i] + int32_t{u.u8[2 * i + 1]} * s.s8[2 * i + 1]);
  return out;
}
inline IVec add16(IVec a, IVec b) {
  for (int i = 0; i < 16; ++i) a.s16[i] = static_cast<int16_t>(a.s16[i] + b.s16[i]);
  return a;
}
inline IVec unbias(IVec v) {
  for (auto& b : v.u8) b ^= 0x80;
  return v;
}
inline IVec abs8(IVec v) {
  for (auto& b : v.s8) b = static_cast<int8_t>(b < 0 ? -b : b);  // (-128 stays -128, i.e. 128 unsigned, as vpabsb)
  return v;
}
inline IVec sign8(IVec a, IVec w) {
  for (int i = 0; i < 32; ++i) a.s8[i] = w.s8[i] < 0 ? static_cast<int8_t>(-a.s8[i]) : w.s8[i] == 0 ? 0 : a.s8[i];
  return a;
}
inline IVec dpbusd(IVec acc, IVec, IVec) { return acc; }  // (never called)
#endif

}  // namespace PAGEDCHAT_CPU_NS::simd
