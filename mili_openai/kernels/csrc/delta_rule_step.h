// The gated delta rule's step, the short causal conv over one sequence and their dtype dispatch, shared by the
// per-op kernels (gated_delta_rule.cpp) and the fused Gated DeltaNet decode layer (gated_deltanet_decode.cpp).
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cmath>

#include "simd_bf16.h"

namespace mili {

constexpr int kBlockVectors = 4;         // columns per block: 4 registers, 8 independent FMA chains
constexpr int64_t kMaxHeadDim = 256;     // q, k and v rows are staged in fp32 on the stack
constexpr float kL2NormEps = 1e-6f;      // transformers' (and FLA's) l2norm epsilon
constexpr int64_t kMaxConvWidth = 8;     // the conv window is staged on the stack
constexpr int64_t kConvChannelGrain = 256;  // channels per conv task

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// x * scale / sqrt(sum(x^2) + eps), in place
inline void l2_normalize(float* x, int64_t n, float scale) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float factor = scale / std::sqrt(sum + kL2NormEps);
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

// Columns [j0, j0 + 16 NV) of one token's step: state (Dk rows of Dv) updated in place, out gets q^T S'.
template <int NV>
inline void step_columns(float* state, int64_t dk, int64_t dv, int64_t j0, const float* q, const float* k,
                         const float* v, float decay, float beta, float qk, float* out) {
  __m512 key_read[NV], query_read[NV], delta[NV];
  for (int n = 0; n < NV; ++n) key_read[n] = query_read[n] = _mm512_setzero_ps();
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = state + i * dv + j0;
    const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
    for (int n = 0; n < NV; ++n) {
      const __m512 s = _mm512_loadu_ps(row + n * kLanes);
      key_read[n] = _mm512_fmadd_ps(s, ki, key_read[n]);
      query_read[n] = _mm512_fmadd_ps(s, qi, query_read[n]);
    }
  }
  const __m512 decay_v = _mm512_set1_ps(decay), beta_v = _mm512_set1_ps(beta), qk_v = _mm512_set1_ps(qk);
  for (int n = 0; n < NV; ++n) {
    const __m512 known = _mm512_mul_ps(key_read[n], decay_v);  // what the decayed state maps k to
    delta[n] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + j0 + n * kLanes), known), beta_v);
    _mm512_storeu_ps(out + j0 + n * kLanes, _mm512_fmadd_ps(query_read[n], decay_v, _mm512_mul_ps(qk_v, delta[n])));
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = state + i * dv + j0;
    const __m512 ki = _mm512_set1_ps(k[i]);
    for (int n = 0; n < NV; ++n) {
      const __m512 s = _mm512_loadu_ps(row + n * kLanes);
      _mm512_storeu_ps(row + n * kLanes, _mm512_fmadd_ps(ki, delta[n], _mm512_mul_ps(s, decay_v)));
    }
  }
}

// One token of one (sequence, value head): S = decay S; S += k beta (v - k^T S)^T; out = q^T S (q, k normalised).
inline void delta_rule_step(float* state, int64_t dk, int64_t dv, const float* q, const float* k, const float* v,
                            float decay, float beta, float* out) {
  float qk = 0.f;
  for (int64_t i = 0; i < dk; ++i) qk += q[i] * k[i];
  constexpr int64_t block = kBlockVectors * kLanes;
  int64_t j0 = 0;
  for (; j0 + block <= dv; j0 += block) step_columns<kBlockVectors>(state, dk, dv, j0, q, k, v, decay, beta, qk, out);
  for (; j0 < dv; j0 += kLanes) step_columns<1>(state, dk, dv, j0, q, k, v, decay, beta, qk, out);
}

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

// Tokens of one sequence over channels [c0, c1) (whole vectors): inputs before the segment come from the window
// (oldest first), which is left holding the last K-1 inputs. Token-major, channels in vectors: x's rows are read
// once, contiguously; the taps (W: float32, or the activations' dtype) and the last K-1 inputs stay in fp32 on
// the stack.
template <typename T, typename W>
void conv_tokens(const T* x, int64_t x_stride, T* window, const W* weight, const float* bias, int64_t width,
                 int64_t tokens, int64_t c0, int64_t c1, T* out, int64_t out_stride) {
  const int64_t history = width - 1, n = c1 - c0;
  float taps[kMaxConvWidth][kConvChannelGrain];      // taps[j][c - c0] = weight[c, j]
  float past[kMaxConvWidth - 1][kConvChannelGrain];  // the last K-1 inputs, oldest first
  for (int64_t c = 0; c < n; ++c) {
    for (int64_t j = 0; j < width; ++j) taps[j][c] = static_cast<float>(weight[(c0 + c) * width + j]);
    for (int64_t j = 0; j < history; ++j) past[j][c] = static_cast<float>(window[(c0 + c) * history + j]);
  }
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < n; i += kLanes) {
      const __m512 newest = load16(x + t * x_stride + c0 + i);
      __m512 acc = bias ? _mm512_loadu_ps(bias + c0 + i) : _mm512_setzero_ps();
      for (int64_t j = 0; j < history; ++j) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(&taps[j][i]), _mm512_loadu_ps(&past[j][i]), acc);
      }
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(&taps[history][i]), newest, acc);
      store16(out + t * out_stride + c0 + i, mili::silu(acc));
      for (int64_t j = 0; j + 1 < history; ++j) _mm512_storeu_ps(&past[j][i], _mm512_loadu_ps(&past[j + 1][i]));
      _mm512_storeu_ps(&past[history - 1][i], newest);
    }
  }
  // exact: every value came from the activations' dtype
  for (int64_t c = 0; c < n; ++c)
    for (int64_t j = 0; j < history; ++j) window[(c0 + c) * history + j] = static_cast<T>(past[j][c]);
}

// checked here, before the parallel region (an exception must not leave a worker thread)
inline void check_slots_in_range(const torch::Tensor& slots, int64_t pool_slots, const char* name) {
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < pool_slots, name, ": slot out of range");
  }
}

// body(T()) for the activations' dtype T (float, bf16 or fp16), the dtypes the Gated DeltaNet kernels take; `op`
// names the kernel in the error for any other
template <typename Body>
void dispatch_activations(at::ScalarType type, const char* op, Body body) {
  switch (type) {
    case at::kFloat: return body(float());
    case at::kBFloat16: return body(at::BFloat16());
    case at::kHalf: return body(at::Half());
    default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16 only");
  }
}

// value head h's (Dk, Dv) state in the pool's row `slot`
inline float* state_of(const torch::Tensor& state_pool, int64_t slot, int64_t h) {
  return state_pool.data_ptr<float>() + (slot * state_pool.size(1) + h) * state_pool.size(2) * state_pool.size(3);
}

}  // namespace mili
