// The instruction-set layer of the Q4_1 x Q8 and Q8_0 x Q8 matmuls (cpu_quant_matmul.cpp): the few integer and
// float vector operations they need, as AVX-512 (16 outputs per vector) or AVX2 (8) intrinsics. The build's
// flags pick one (kernels/cpu_native.py compiles a library per level); Q4Q8_BUILT says whether any applies.
//
// The integer sums are exact on every instruction-set level, so every level gives the very same floats:
//   AVX-512 VNNI  vpdpbusd: 4 u8 x s8 products per 32-bit lane, added to it
//   AVX-512 BW    vpmaddubsw (2 products per 16-bit lane) then vpmaddwd by ones (pairs to 32 bits), as
//   AVX2          llama.cpp's AVX2 path does; 16 outputs are one 512-bit or two 256-bit vectors.
// Q4_1: each 16-bit lane of one vpmaddubsw is at most 2 * 15 * 127 = 3810, so the 8 of a group add up in 16
// bits without saturating (30480 < 32767) before one vpmaddwd.
#pragma once

#include "cpu_kernels.h"

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define Q4Q8_BUILT 1
#else
#define Q4Q8_BUILT 0
#endif

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
inline FVec half_to_float(const c10::Half* h) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}
inline FVec cvt(IVec v) { return _mm512_cvtepi32_ps(v); }
inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
inline FVec mul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
inline FVec set1(float v) { return _mm512_set1_ps(v); }
inline FVec fzero() { return _mm512_setzero_ps(); }
inline void store_f(float* p, FVec v) { _mm512_storeu_ps(p, v); }
inline IVec add32(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
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
inline FVec half_to_float(const c10::Half* h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}
inline FVec cvt(IVec v) { return _mm256_cvtepi32_ps(v); }
inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
inline FVec mul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline FVec set1(float v) { return _mm256_set1_ps(v); }
inline FVec fzero() { return _mm256_setzero_ps(); }
inline void store_f(float* p, FVec v) { _mm256_storeu_ps(p, v); }
inline IVec add32(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec set1_32(int32_t v) { return _mm256_set1_epi32(v); }
inline IVec pairs_to_32(IVec s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }
inline IVec maddubs(IVec u, IVec s) { return _mm256_maddubs_epi16(u, s); }
inline IVec add16(IVec a, IVec b) { return _mm256_add_epi16(a, b); }
inline IVec unbias(IVec v) { return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))); }
inline IVec abs8(IVec v) { return _mm256_abs_epi8(v); }
inline IVec sign8(IVec a, IVec w) { return _mm256_sign_epi8(a, w); }
inline IVec dpbusd(IVec acc, IVec, IVec) { return acc; }  // (never called)
#endif

}  // namespace PAGEDCHAT_CPU_NS::simd
