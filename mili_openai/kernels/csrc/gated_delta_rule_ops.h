// The gated delta rule (Gated DeltaNet's linear attention) and its short causal conv, varlen over state pools,
// written once over a vector set V and instantiated per build: csrc/vectors_avx512.h's Avx512 (16 lanes) and
// csrc_avx2/vectors_avx2.h's Avx2 (8 lanes). The semantics and the torch reference: kernels/gated_delta_rule.py.
//
// V gives: Vec, kLanes, zero, set1, load, store, add, sub, mul, fmadd (a * b + c), reduce_add, silu, and per
// activation dtype T load_as<T> (widen to fp32), store_as<T> and round_as<T> (to T and back).
//
// Decode is memory-bound on the fp32 state, (Dk, Dv) per sequence and value head: torch's six ops read and
// write it several times. Here one task per (sequence, value head) walks it in blocks of kBlockVectors registers
// of columns (Dk x 64 fp32 = 32 KB at Dk = 128 on AVX-512, half that on AVX2: in L1): one read pass gathers
// k^T S and q^T S for the block, which give the delta and the readout (q^T S' = decay q^T S + (q.k) delta),
// and a second pass over the same, now cached, block writes decay S + k delta^T. The state crosses memory once
// each way. Prefill runs the same step token by token, the state staying in cache for the whole segment.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "gated_deltanet_common.h"

namespace mili {

// columns per block: 4 registers, 8 independent FMA chains; 11 live registers, within AVX2's 16
constexpr int kBlockVectors = 4;

// Columns [j0, j0 + NV lanes) of one token's step: state (Dk rows of Dv) updated in place, out gets q^T S'.
template <typename V, int NV>
inline void step_columns(float* state, int64_t dk, int64_t dv, int64_t j0, const float* q, const float* k,
                         const float* v, float decay, float beta, float qk, float* out) {
  using Vec = typename V::Vec;
  Vec key_read[NV], query_read[NV], delta[NV];
  for (int n = 0; n < NV; ++n) key_read[n] = query_read[n] = V::zero();
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = state + i * dv + j0;
    const Vec ki = V::set1(k[i]), qi = V::set1(q[i]);
    for (int n = 0; n < NV; ++n) {
      const Vec s = V::load(row + n * V::kLanes);
      key_read[n] = V::fmadd(s, ki, key_read[n]);
      query_read[n] = V::fmadd(s, qi, query_read[n]);
    }
  }
  const Vec decay_v = V::set1(decay), beta_v = V::set1(beta), qk_v = V::set1(qk);
  for (int n = 0; n < NV; ++n) {
    const Vec known = V::mul(key_read[n], decay_v);  // what the decayed state maps k to
    delta[n] = V::mul(V::sub(V::load(v + j0 + n * V::kLanes), known), beta_v);
    V::store(out + j0 + n * V::kLanes, V::fmadd(query_read[n], decay_v, V::mul(qk_v, delta[n])));
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = state + i * dv + j0;
    const Vec ki = V::set1(k[i]);
    for (int n = 0; n < NV; ++n) {
      const Vec s = V::load(row + n * V::kLanes);
      V::store(row + n * V::kLanes, V::fmadd(ki, delta[n], V::mul(s, decay_v)));
    }
  }
}

// One token of one (sequence, value head): S = decay S; S += k beta (v - k^T S)^T; out = q^T S (q, k normalised).
template <typename V>
inline void delta_rule_step(float* state, int64_t dk, int64_t dv, const float* q, const float* k, const float* v,
                            float decay, float beta, float* out) {
  float qk = 0.f;
  for (int64_t i = 0; i < dk; ++i) qk += q[i] * k[i];
  constexpr int64_t block = kBlockVectors * V::kLanes;
  int64_t j0 = 0;
  for (; j0 + block <= dv; j0 += block) {
    step_columns<V, kBlockVectors>(state, dk, dv, j0, q, k, v, decay, beta, qk, out);
  }
  for (; j0 < dv; j0 += V::kLanes) step_columns<V, 1>(state, dk, dv, j0, q, k, v, decay, beta, qk, out);
}

// Tokens of one sequence over channels [c0, c1) (whole vectors): inputs before the segment come from the window
// (oldest first), which is left holding the last K-1 inputs. Token-major, channels in vectors: x's rows are read
// once, contiguously; the taps (W: float32, or the activations' dtype) and the last K-1 inputs stay in fp32 on
// the stack.
template <typename V, typename T, typename W>
void conv_tokens(const T* x, int64_t x_stride, T* window, const W* weight, const float* bias, int64_t width,
                 int64_t tokens, int64_t c0, int64_t c1, T* out, int64_t out_stride) {
  using Vec = typename V::Vec;
  const int64_t history = width - 1, n = c1 - c0;
  float taps[kMaxConvWidth][kConvChannelGrain];      // taps[j][c - c0] = weight[c, j]
  float past[kMaxConvWidth - 1][kConvChannelGrain];  // the last K-1 inputs, oldest first
  for (int64_t c = 0; c < n; ++c) {
    for (int64_t j = 0; j < width; ++j) taps[j][c] = static_cast<float>(weight[(c0 + c) * width + j]);
    for (int64_t j = 0; j < history; ++j) past[j][c] = static_cast<float>(window[(c0 + c) * history + j]);
  }
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < n; i += V::kLanes) {
      const Vec newest = V::template load_as<T>(x + t * x_stride + c0 + i);
      Vec acc = bias ? V::load(bias + c0 + i) : V::zero();
      for (int64_t j = 0; j < history; ++j) acc = V::fmadd(V::load(&taps[j][i]), V::load(&past[j][i]), acc);
      acc = V::fmadd(V::load(&taps[history][i]), newest, acc);
      V::template store_as<T>(out + t * out_stride + c0 + i, V::silu(acc));
      for (int64_t j = 0; j + 1 < history; ++j) V::store(&past[j][i], V::load(&past[j + 1][i]));
      V::store(&past[history - 1][i], newest);
    }
  }
  // exact: every value came from the activations' dtype
  for (int64_t c = 0; c < n; ++c)
    for (int64_t j = 0; j < history; ++j) window[(c0 + c) * history + j] = static_cast<T>(past[j][c]);
}

// One token's inputs for value head h, widened and normalised, then the step; out rows in v's dtype.
template <typename V, typename T>
struct TokenRows {
  const torch::Tensor &q, &k, &v, &g, &beta;
  torch::Tensor& out;
  int64_t group, dk, dv;

  void step(int64_t token, int64_t h, float* state) const {
    float qf[kMaxHeadDim], kf[kMaxHeadDim], vf[kMaxHeadDim], of[kMaxHeadDim];
    const int64_t kh = h / group;
    widen(q.data_ptr<T>() + token * q.stride(0) + kh * q.stride(1), qf, dk);
    widen(k.data_ptr<T>() + token * k.stride(0) + kh * k.stride(1), kf, dk);
    widen(v.data_ptr<T>() + token * v.stride(0) + h * v.stride(1), vf, dv);
    l2_normalize(qf, dk, 1.f / std::sqrt(static_cast<float>(dk)));
    l2_normalize(kf, dk, 1.f);
    const float decay = std::exp(g.data_ptr<float>()[token * g.stride(0) + h * g.stride(1)]);
    const float b = beta.data_ptr<float>()[token * beta.stride(0) + h * beta.stride(1)];
    delta_rule_step<V>(state, dk, dv, qf, kf, vf, decay, b, of);
    T* dst = out.data_ptr<T>() + (token * out.size(1) + h) * dv;
    for (int64_t j = 0; j < dv; ++j) dst[j] = static_cast<T>(of[j]);
  }
};

// q, k (B, Hk, Dk); v (B, Hv, Dv); g, beta (B, Hv) float32; state_pool (slots, Hv, Dk, Dv) float32 updated at
// state_slots (B,) -> (B, Hv, Dv) in v's dtype
template <typename V>
torch::Tensor gated_delta_rule_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                      const torch::Tensor& g, const torch::Tensor& beta,
                                      const torch::Tensor& state_pool, const torch::Tensor& state_slots) {
  check_delta_rule(q, k, v, g, beta, state_pool, state_slots, V::kLanes);
  TORCH_CHECK(state_slots.numel() == q.size(0), "gated delta rule: one state slot per row");
  const int64_t hv = v.size(1);
  auto out = torch::empty({v.size(0), hv, v.size(2)}, v.options());
  const int64_t* slots = state_slots.data_ptr<int64_t>();
  dispatch_activations(v.scalar_type(), "gated delta rule", [&](auto zero) {
    const TokenRows<V, decltype(zero)> rows{q, k, v, g, beta, out, hv / k.size(1), k.size(2), v.size(2)};
    at::parallel_for(0, v.size(0) * hv, 1, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t b = task / hv, h = task % hv;
        rows.step(b, h, state_of(state_pool, slots[b], h));
      }
    });
  });
  return out;
}

// The same over segments of tokens: q, k (T, Hk, Dk), ...; cu_seqlens (S + 1,) int64; segment s continues
// state_pool[state_slots[s]] and leaves its final state there
template <typename V>
torch::Tensor gated_delta_rule_prefill(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       const torch::Tensor& g, const torch::Tensor& beta,
                                       const torch::Tensor& cu_seqlens, const torch::Tensor& state_pool,
                                       const torch::Tensor& state_slots) {
  check_delta_rule(q, k, v, g, beta, state_pool, state_slots, V::kLanes);
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() &&
              cu_seqlens.numel() == state_slots.numel() + 1, "gated delta rule: cu_seqlens int64 (S + 1,)");
  const int64_t hv = v.size(1);
  auto out = torch::empty({v.size(0), hv, v.size(2)}, v.options());
  const int64_t* slots = state_slots.data_ptr<int64_t>();
  const int64_t* bounds = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] == 0 && bounds[state_slots.numel()] == q.size(0), "gated delta rule: cu_seqlens bounds");
  dispatch_activations(v.scalar_type(), "gated delta rule", [&](auto zero) {
    const TokenRows<V, decltype(zero)> rows{q, k, v, g, beta, out, hv / k.size(1), k.size(2), v.size(2)};
    at::parallel_for(0, state_slots.numel() * hv, 1, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t s = task / hv, h = task % hv;
        float* state = state_of(state_pool, slots[s], h);
        for (int64_t t = bounds[s]; t < bounds[s + 1]; ++t) rows.step(t, h, state);
      }
    });
  });
  return out;
}

// The conv over segments: cu_seqlens (S + 1,) int64, segment s continues conv_pool[slots[s]] and leaves its
// window there (decode: one token per row, cu_seqlens 0, 1, ..., B)
template <typename V>
torch::Tensor conv_segments(const torch::Tensor& x, const int64_t* bounds, const torch::Tensor& conv_pool,
                            const torch::Tensor& weight, const torch::Tensor& bias, const torch::Tensor& slots) {
  const int64_t channels = x.size(1), width = weight.size(1);
  const int64_t blocks = (channels + kConvChannelGrain - 1) / kConvChannelGrain;
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* bias_data = bias.defined() ? bias.data_ptr<float>() : nullptr;
  dispatch_activations(x.scalar_type(), "causal conv1d", [&](auto zero) {
    using T = decltype(zero);
    at::parallel_for(0, slots.numel() * blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t s = task / blocks, c0 = (task % blocks) * kConvChannelGrain;
        conv_tokens<V>(x.data_ptr<T>() + bounds[s] * x.stride(0), x.stride(0),
                       conv_pool.data_ptr<T>() + slot[s] * channels * (width - 1), weight.data_ptr<float>(),
                       bias_data, width, bounds[s + 1] - bounds[s], c0, std::min(channels, c0 + kConvChannelGrain),
                       out.data_ptr<T>() + bounds[s] * channels, channels);
      }
    });
  });
  return out;
}

// x (B, C), conv_pool (slots, C, K-1) shifted in place at slots (B,), weight (C, K) float32 -> silu(conv) (B, C)
template <typename V>
torch::Tensor causal_conv1d_decode(const torch::Tensor& x, const torch::Tensor& conv_pool, const torch::Tensor& weight,
                                   const c10::optional<torch::Tensor>& bias, const torch::Tensor& slots) {
  const torch::Tensor bias_tensor = bias.has_value() ? bias->contiguous() : torch::Tensor();
  check_conv(x, conv_pool, weight, bias_tensor, slots, V::kLanes);
  TORCH_CHECK(slots.numel() == x.size(0), "causal conv1d: one slot per row");
  const torch::Tensor bounds = torch::arange(x.size(0) + 1, torch::kLong);
  return conv_segments<V>(x, bounds.data_ptr<int64_t>(), conv_pool, weight, bias_tensor, slots);
}

// x (T, C) in segments cu_seqlens (S + 1,); segment s continues conv_pool[slots[s]] and leaves its window there
template <typename V>
torch::Tensor causal_conv1d_prefill(const torch::Tensor& x, const torch::Tensor& cu_seqlens,
                                    const torch::Tensor& conv_pool, const torch::Tensor& weight,
                                    const c10::optional<torch::Tensor>& bias, const torch::Tensor& slots) {
  const torch::Tensor bias_tensor = bias.has_value() ? bias->contiguous() : torch::Tensor();
  check_conv(x, conv_pool, weight, bias_tensor, slots, V::kLanes);
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() &&
              cu_seqlens.numel() == slots.numel() + 1, "causal conv1d: cu_seqlens int64 (S + 1,)");
  const int64_t* bounds = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] == 0 && bounds[slots.numel()] == x.size(0), "causal conv1d: cu_seqlens bounds");
  return conv_segments<V>(x, bounds, conv_pool, weight, bias_tensor, slots);
}

}  // namespace mili
