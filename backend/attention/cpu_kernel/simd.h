// Shared by the CPU kernels: bfloat16 <-> float32 (round to nearest even, as torch does), the AVX2
// helpers (loads that widen bfloat16, horizontal sums, a vectorized exp), and two vector "traits"
// (Avx2, Avx512: the same small API over 8 or 16 float lanes) that the attention kernels are
// written against once, and ``Vec``, the widest of them this build has. Which exist depends on the
// -march the library was built for.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LLM_CPU_AVX2 1
#endif
#if defined(LLM_CPU_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define LLM_CPU_AVX512 1
#endif
#if defined(LLM_CPU_AVX512) && defined(__AVX512BF16__)
#define LLM_CPU_AVX512_BF16 1
#endif

namespace llm_cpu {

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float load(float x) { return x; }
inline float load(uint16_t x) { return bf16_to_float(x); }
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) { *dst = float_to_bf16(x); }

inline float round_to(float, float x) { return x; }  // the value a float32 tensor would hold
inline float round_to(uint16_t, float x) { return bf16_to_float(float_to_bf16(x)); }

#ifdef LLM_CPU_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float horizontal_sum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// [sum(a[0]), ..., sum(a[7])]
inline __m256 horizontal_sums8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// exp(x), Cephes' polynomial: relative error ~2e-7; exactly 0 below -87 (and for -inf), clamped at 88
// (no overflow).
inline __m256 exp8(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(exponent)));
}

// float32 -> bfloat16 bits (in the low 16 bits of each 32-bit lane), rounded as float_to_bf16 does.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
  const __m256i bits = bf16_bits8(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}

// 8 float lanes (AVX2 + FMA).
struct Avx2 {
  using reg = __m256;
  static constexpr int width = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load(const uint16_t* p) { return load8(p); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static void store(uint16_t* p, reg v) { store8(p, v); }  // rounded to bfloat16
  static reg round(float, reg v) { return v; }  // the value a tensor of that dtype would hold
  static reg round(uint16_t, reg v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg exp(reg x) { return exp8(x); }
  static float reduce_add(reg v) { return horizontal_sum(v); }
  static float reduce_max(reg v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  static reg sums(const reg* a) { return horizontal_sums8(a); }  // [sum(a[0]), ..., sum(a[7])]
};

#endif  // LLM_CPU_AVX2

#ifdef LLM_CPU_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// exp(x) over 16 lanes, the same polynomial as exp8 (also exactly 0 below -87).
inline __m512 exp16(__m512 x) {
  const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(finite, y, _mm512_castsi512_ps(exponent));
}

// [sum(a[0]), ..., sum(a[15])]: four halving stages of shuffles and adds (46 instructions for 16
// horizontal sums), then one permute that puts the sums in order.
inline __m512 horizontal_sums16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // 512 -> 256 bits per token: tokens i (low half) and i + 8 (high half)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // -> 128 bits per token: lanes hold tokens i, i + 8, i + 4, i + 12
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // -> 64 bits per token
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x44), _mm512_shuffle_ps(c[i], c[i + 2], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  // e holds tokens 0 2 1 3 | 8 10 9 11 | 4 6 5 7 | 12 14 13 15 (an involution: the same index undoes it)
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, e);
}

inline __m512i bf16_bits16(__m512 v) {  // as bf16_bits8
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_srli_epi32(_mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000))), 16);
}

// 16x16 transpose of 32-bit words: rows[i] holds row i; afterwards rows[j] holds column j.
inline void transpose16(__m512i* rows) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    rows[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    rows[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    rows[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    rows[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(rows[i + j], rows[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(rows[i + j], rows[i + j + 4], 0xDD);
    }
  }
  for (int j = 0; j < 8; ++j) {
    rows[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    rows[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);
  }
}

// 16 float lanes (AVX-512 F/BW/DQ/VL).
struct Avx512 {
  using reg = __m512;
  static constexpr int width = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return load16(p); }
  static reg load(const uint16_t* p) { return load16(p); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
#ifdef LLM_CPU_AVX512_BF16
  // Rounded to bfloat16 by vcvtneps2bf16: round to nearest even as torch rounds, in one
  // instruction instead of nine (it flushes bfloat16 denormals, below 1.2e-38, to zero).
  static void store(uint16_t* p, reg v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v)); }
  static reg round(uint16_t, reg v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
  }
#else
  static void store(uint16_t* p, reg v) {  // rounded to bfloat16
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
  }
  static reg round(uint16_t, reg v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)); }
#endif
  static reg round(float, reg v) { return v; }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg exp(reg x) { return exp16(x); }
  static float reduce_add(reg v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(reg v) { return _mm512_reduce_max_ps(v); }
  static reg sums(const reg* a) { return horizontal_sums16(a); }
};
#endif  // LLM_CPU_AVX512

// The widest traits this build has: what the kernels are instantiated with.
#if defined(LLM_CPU_AVX512)
using Vec = Avx512;
#elif defined(LLM_CPU_AVX2)
using Vec = Avx2;
#endif

}  // namespace llm_cpu
