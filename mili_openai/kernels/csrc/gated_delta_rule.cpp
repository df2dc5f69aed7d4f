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
#include "delta_rule_step.h"

namespace {

using mili::kLanes;
using mili::kMaxHeadDim;
using mili::kMaxConvWidth;
using mili::kConvChannelGrain;
using mili::widen;
using mili::l2_normalize;
using mili::delta_rule_step;
using mili::conv_tokens;
using mili::check_slots_in_range;
using mili::state_of;
using mili::dispatch_activations;

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
  dispatch_activations(x.scalar_type(), "causal conv1d", [&](auto zero) {
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
  dispatch_activations(x.scalar_type(), "causal conv1d", [&](auto zero) {
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
