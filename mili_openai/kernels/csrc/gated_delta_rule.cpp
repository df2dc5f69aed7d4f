// The gated delta rule (Gated DeltaNet's linear attention) and its short causal conv on AVX-512 CPUs, varlen
// over state pools; the semantics and the torch reference are kernels/gated_delta_rule.py.
//
// Decode is memory-bound on the fp32 state, (Dk, Dv) per sequence and value head: torch's six ops read and
// write it several times. Here one task per (sequence, value head) walks it in blocks of 64 columns
// (Dk x 64 fp32 = 32 KB at Dk = 128, held in L1): one read pass gathers k^T S and q^T S for the block, which
// give the delta and the readout (q^T S' = decay q^T S + (q.k) delta), and a second pass over the same,
// now cached, block writes decay S + k delta^T. The state crosses memory once each way.
// Prefill runs the same step token by token, the state staying in cache for the whole segment.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

#include "simd_bf16.h"

namespace {

using mili::kLanes;
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

// One token's inputs for value head h, widened and normalised, then the step; out rows in v's dtype.
template <typename T>
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
    delta_rule_step(state, dk, dv, qf, kf, vf, decay, b, of);
    T* dst = out.data_ptr<T>() + (token * out.size(1) + h) * dv;
    for (int64_t j = 0; j < dv; ++j) dst[j] = static_cast<T>(of[j]);
  }
};

// checked here, before the parallel region (an exception must not leave a worker thread)
void check_slots_in_range(const torch::Tensor& slots, int64_t pool_slots, const char* name) {
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < pool_slots, name, ": slot out of range");
  }
}

void check_delta_rule(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
                      const torch::Tensor& beta, const torch::Tensor& state_pool, const torch::Tensor& slots) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "gated delta rule: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.sizes() == k.sizes() && v.dim() == 3 && q.size(0) == v.size(0),
              "gated delta rule: q, k (N, Hk, Dk) and v (N, Hv, Dv)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "gated delta rule: q, k and v of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "gated delta rule: head dims contiguous");
  const int64_t hk = k.size(1), hv = v.size(1), dk = k.size(2), dv = v.size(2);
  TORCH_CHECK(hv % hk == 0, "gated delta rule: value heads a multiple of key heads");
  TORCH_CHECK(dk <= kMaxHeadDim && dv <= kMaxHeadDim && dv % kLanes == 0,
              "gated delta rule: head dims up to 256, Dv a multiple of 16");
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat && g.sizes() == beta.sizes() &&
              g.dim() == 2 && g.size(0) == q.size(0) && g.size(1) == hv, "gated delta rule: g, beta float32 (N, Hv)");
  TORCH_CHECK(state_pool.scalar_type() == at::kFloat && state_pool.is_contiguous() && state_pool.dim() == 4 &&
              state_pool.size(1) == hv && state_pool.size(2) == dk && state_pool.size(3) == dv,
              "gated delta rule: state_pool float32 contiguous (slots, Hv, Dk, Dv)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "gated delta rule: slots int64");
  check_slots_in_range(slots, state_pool.size(0), "gated delta rule");
}

float* state_of(const torch::Tensor& state_pool, int64_t slot, int64_t h) {
  return state_pool.data_ptr<float>() + (slot * state_pool.size(1) + h) * state_pool.size(2) * state_pool.size(3);
}

void check_conv(const torch::Tensor& x, const torch::Tensor& conv_pool, const torch::Tensor& weight,
                const torch::Tensor& bias, const torch::Tensor& slots) {
  TORCH_CHECK(x.device().is_cpu(), "causal conv1d: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "causal conv1d: x (N, C), channels contiguous");
  TORCH_CHECK(x.size(1) % kLanes == 0, "causal conv1d: channels a multiple of 16");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2 &&
              weight.size(0) == x.size(1) && weight.size(1) >= 2 && weight.size(1) <= kMaxConvWidth,
              "causal conv1d: weight float32 (C, K), K from 2 to 8");
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.numel() == x.size(1)),
              "causal conv1d: bias float32 (C,)");
  TORCH_CHECK(conv_pool.scalar_type() == x.scalar_type() && conv_pool.is_contiguous() && conv_pool.dim() == 3 &&
              conv_pool.size(1) == x.size(1) && conv_pool.size(2) == weight.size(1) - 1,
              "causal conv1d: conv_pool contiguous (slots, C, K-1) in x's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "causal conv1d: slots int64");
  check_slots_in_range(slots, conv_pool.size(0), "causal conv1d");
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

// Tokens of one sequence over channels [c0, c1) (whole vectors): inputs before the segment come from the window
// (oldest first), which is left holding the last K-1 inputs. Token-major, channels in vectors: x's rows are read
// once, contiguously; the taps and the last K-1 inputs stay in fp32 on the stack.
template <typename T>
void conv_tokens(const T* x, int64_t x_stride, T* window, const float* weight, const float* bias, int64_t width,
                 int64_t tokens, int64_t c0, int64_t c1, T* out, int64_t out_stride) {
  const int64_t history = width - 1, n = c1 - c0;
  float taps[kMaxConvWidth][kConvChannelGrain];      // taps[j][c - c0] = weight[c, j]
  float past[kMaxConvWidth - 1][kConvChannelGrain];  // the last K-1 inputs, oldest first
  for (int64_t c = 0; c < n; ++c) {
    for (int64_t j = 0; j < width; ++j) taps[j][c] = weight[(c0 + c) * width + j];
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

// The conv's dtypes: fp32, bf16, fp16 activations
template <typename Body>
void dispatch_conv_dtype(at::ScalarType type, Body body) {
  switch (type) {
    case at::kFloat: return body(float());
    case at::kBFloat16: return body(at::BFloat16());
    case at::kHalf: return body(at::Half());
    default: TORCH_CHECK(false, "causal conv1d: float32, bfloat16 or float16 only");
  }
}

}  // namespace

// q, k (B, Hk, Dk); v (B, Hv, Dv); g, beta (B, Hv) float32; state_pool (slots, Hv, Dk, Dv) float32 updated at
// state_slots (B,) -> (B, Hv, Dv) in v's dtype
torch::Tensor gated_delta_rule_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                      const torch::Tensor& g, const torch::Tensor& beta,
                                      const torch::Tensor& state_pool, const torch::Tensor& state_slots) {
  check_delta_rule(q, k, v, g, beta, state_pool, state_slots);
  TORCH_CHECK(state_slots.numel() == q.size(0), "gated delta rule: one state slot per row");
  const int64_t hv = v.size(1);
  auto out = torch::empty({v.size(0), hv, v.size(2)}, v.options());
  const int64_t* slots = state_slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "gated_delta_rule_decode", [&] {
    const TokenRows<scalar_t> rows{q, k, v, g, beta, out, hv / k.size(1), k.size(2), v.size(2)};
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
torch::Tensor gated_delta_rule_prefill(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       const torch::Tensor& g, const torch::Tensor& beta,
                                       const torch::Tensor& cu_seqlens, const torch::Tensor& state_pool,
                                       const torch::Tensor& state_slots) {
  check_delta_rule(q, k, v, g, beta, state_pool, state_slots);
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() &&
              cu_seqlens.numel() == state_slots.numel() + 1, "gated delta rule: cu_seqlens int64 (S + 1,)");
  const int64_t hv = v.size(1);
  auto out = torch::empty({v.size(0), hv, v.size(2)}, v.options());
  const int64_t* slots = state_slots.data_ptr<int64_t>();
  const int64_t* bounds = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] == 0 && bounds[state_slots.numel()] == q.size(0), "gated delta rule: cu_seqlens bounds");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "gated_delta_rule_prefill", [&] {
    const TokenRows<scalar_t> rows{q, k, v, g, beta, out, hv / k.size(1), k.size(2), v.size(2)};
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

// x (B, C), conv_pool (slots, C, K-1) shifted in place at slots (B,), weight (C, K) float32 -> silu(conv) (B, C)
torch::Tensor causal_conv1d_decode(const torch::Tensor& x, const torch::Tensor& conv_pool, const torch::Tensor& weight,
                                   const c10::optional<torch::Tensor>& bias, const torch::Tensor& slots) {
  const torch::Tensor bias_tensor = bias.has_value() ? bias->contiguous() : torch::Tensor();
  check_conv(x, conv_pool, weight, bias_tensor, slots);
  TORCH_CHECK(slots.numel() == x.size(0), "causal conv1d: one slot per row");
  const int64_t channels = x.size(1), width = weight.size(1);
  const int64_t blocks = (channels + kConvChannelGrain - 1) / kConvChannelGrain;
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* bias_data = bias_tensor.defined() ? bias_tensor.data_ptr<float>() : nullptr;
  dispatch_conv_dtype(x.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    at::parallel_for(0, x.size(0) * blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t b = task / blocks, c0 = (task % blocks) * kConvChannelGrain;
        conv_tokens(x.data_ptr<scalar_t>() + b * x.stride(0), x.stride(0),
                    conv_pool.data_ptr<scalar_t>() + slot[b] * channels * (width - 1), weight.data_ptr<float>(),
                    bias_data, width, 1, c0, std::min(channels, c0 + kConvChannelGrain),
                    out.data_ptr<scalar_t>() + b * channels, channels);
      }
    });
  });
  return out;
}

// x (T, C) in segments cu_seqlens (S + 1,); segment s continues conv_pool[slots[s]] and leaves its window there
torch::Tensor causal_conv1d_prefill(const torch::Tensor& x, const torch::Tensor& cu_seqlens,
                                    const torch::Tensor& conv_pool, const torch::Tensor& weight,
                                    const c10::optional<torch::Tensor>& bias, const torch::Tensor& slots) {
  const torch::Tensor bias_tensor = bias.has_value() ? bias->contiguous() : torch::Tensor();
  check_conv(x, conv_pool, weight, bias_tensor, slots);
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() &&
              cu_seqlens.numel() == slots.numel() + 1, "causal conv1d: cu_seqlens int64 (S + 1,)");
  const int64_t channels = x.size(1), width = weight.size(1);
  const int64_t blocks = (channels + kConvChannelGrain - 1) / kConvChannelGrain;
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* bounds = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] == 0 && bounds[slots.numel()] == x.size(0), "causal conv1d: cu_seqlens bounds");
  const float* bias_data = bias_tensor.defined() ? bias_tensor.data_ptr<float>() : nullptr;
  dispatch_conv_dtype(x.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    at::parallel_for(0, slots.numel() * blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t s = task / blocks, c0 = (task % blocks) * kConvChannelGrain;
        conv_tokens(x.data_ptr<scalar_t>() + bounds[s] * x.stride(0), x.stride(0),
                    conv_pool.data_ptr<scalar_t>() + slot[s] * channels * (width - 1), weight.data_ptr<float>(),
                    bias_data, width, bounds[s + 1] - bounds[s], c0, std::min(channels, c0 + kConvChannelGrain),
                    out.data_ptr<scalar_t>() + bounds[s] * channels, channels);
      }
    });
  });
  return out;
}
