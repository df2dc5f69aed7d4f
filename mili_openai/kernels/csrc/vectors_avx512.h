// 16 fp32 lanes of AVX-512 as the vector set the Gated DeltaNet ops are written over (gated_delta_rule_ops.h),
// and the per-dtype loads, stores and roundings the other kernels use too (zero_centered_norm.cpp).
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <type_traits>

#include "simd_bf16.h"

namespace mili {

// 16 channels in fp32 registers, from and to the activations' dtype
template <typename T> inline __m512 load16(const T* p);
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<at::BFloat16>(const at::BFloat16* p) { return mili::widen_bf16(p); }
template <> inline __m512 load16<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <typename T> inline void store16(T* p, __m512 v);
template <> inline void store16<float>(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
template <> inline void store16<at::BFloat16>(at::BFloat16* p, __m512 v) { mili::store_bf16(p, mili::round_bf16(v)); }
template <> inline void store16<at::Half>(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// 16 fp32 values rounded to T and back: the points where the torch reference stores a tensor in T
template <typename T> inline __m512 round16(__m512 v);
template <> inline __m512 round16<float>(__m512 v) { return v; }
template <> inline __m512 round16<at::BFloat16>(__m512 v) { return round_bf16(v); }
template <> inline __m512 round16<at::Half>(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

struct Avx512 {
  using Vec = __m512;
  static constexpr int64_t kLanes = 16;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce_add(Vec v) { return _mm512_reduce_add_ps(v); }
  static Vec silu(Vec v) { return mili::silu(v); }
  template <typename T> static Vec load_as(const T* p) { return load16(p); }
  template <typename T> static void store_as(T* p, Vec v) { store16(p, v); }
  template <typename T> static Vec round_as(Vec v) { return round16<T>(v); }
};

}  // namespace mili
