// 8 fp32 lanes of AVX2 (+ FMA, F16C): bf16 <-> fp32 in registers, SiLU, and the vector set the shared Gated
// DeltaNet ops are written over (../csrc/gated_delta_rule_ops.h), as csrc/vectors_avx512.h is for AVX-512.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <type_traits>

namespace mili_avx2 {

// 8 bf16 -> fp32: a bf16 is the high half of an fp32, so zero-extend to 32 bits and shift into place.
inline __m256 widen_bf16(const at::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// fp32 -> nearest bf16 (ties to even), returned as the fp32 it stands for; NaN stays a quiet NaN.
inline __m256 round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, bias), high);
  const __m256i quiet_nan = _mm256_or_si256(_mm256_and_si256(bits, high), _mm256_set1_epi32(0x00400000));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet_nan), nan);
}

// Store 8 values already rounded by round_bf16 (their low halves are zero) as bf16: the high halves packed
// (per 128-bit lane), then the two lanes' packed quadwords brought together.
inline void store_bf16(at::BFloat16* p, __m256 rounded) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

// exp(x) for x <= 0, as csrc/simd_bf16.h's exp_nonpositive: 2^(x log2 e) as 2^n times a degree-6 polynomial
// on [-0.5, 0.5] (relative error ~2e-7); 2^n built in the exponent field (n >= -126 after the clamp: normal).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

// 1 / (1 + exp(-x)) in fp32, from exp(-|x|) so the exponent never overflows.
inline __m256 sigmoid(__m256 x) {
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
  const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), magnitude));
  const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.f), e);
  const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 numerator = _mm256_blendv_ps(_mm256_set1_ps(1.f), e, negative);  // e/(1+e) below zero
  return _mm256_div_ps(numerator, denominator);
}

inline __m256 silu(__m256 x) { return _mm256_mul_ps(x, sigmoid(x)); }

// GELU's tanh form, 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), as x * sigmoid(2u): the same
// function (1 + tanh(u) = 2 sigmoid(2u)), and accurate where 1 + tanh(u) is tiny, which 1 + tanh loses.
inline __m256 gelu_tanh(__m256 x) {
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 inner = _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, x);
  return _mm256_mul_ps(x, sigmoid(_mm256_mul_ps(_mm256_set1_ps(2.f * 0.7978845608028654f), inner)));
}

constexpr int kHalfRounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

struct Avx2 {
  using Vec = __m256;
  static constexpr int64_t kLanes = 8;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce_add(Vec v) { return horizontal_sum(v); }
  static Vec silu(Vec v) { return mili_avx2::silu(v); }

  template <typename T> static Vec load_as(const T* p) {
    if constexpr (std::is_same_v<T, float>) return _mm256_loadu_ps(p);
    else if constexpr (std::is_same_v<T, at::BFloat16>) return widen_bf16(p);
    else return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  template <typename T> static void store_as(T* p, Vec v) {
    if constexpr (std::is_same_v<T, float>) _mm256_storeu_ps(p, v);
    else if constexpr (std::is_same_v<T, at::BFloat16>) store_bf16(p, round_bf16(v));
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, kHalfRounding));
  }
  // rounded to T and back: the points where the torch reference stores a tensor in T
  template <typename T> static Vec round_as(Vec v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else if constexpr (std::is_same_v<T, at::BFloat16>) return round_bf16(v);
    else return _mm256_cvtph_ps(_mm256_cvtps_ph(v, kHalfRounding));
  }
};

}  // namespace mili_avx2
