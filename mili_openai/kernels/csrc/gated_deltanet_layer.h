// A Gated DeltaNet layer's decode step between its two projections, in one call: per row, the conv window
// update with SiLU, then per value head the g and beta gates, the L2 norms of q and k, the delta-rule update of
// the fp32 state in place, and the gated RMSNorm with z. Done op by op (model/gated_deltanet.py) that is some
// thirty small torch ops a layer, each a dispatch and a buffer; here two parallel passes. The arithmetic and its
// rounding points to the activations' dtype follow the torch reference's order (kernels/linear_attention.py).
// Written over a vector set V as gated_delta_rule_ops.h; bind_linear_attention<V> binds all five ops.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "gated_delta_rule_ops.h"
#include "gated_deltanet_common.h"

namespace mili {

// The per-head part: `projected` rows are in_proj's [conv input; z; b; a], `mixed` rows the conv's output [q; k; v]
template <typename V, typename T>
struct HeadStep {
  const T* projected;
  int64_t projected_stride;
  const T* mixed;
  const float* a_log;
  const float* dt_bias;
  const T* norm_weight;
  float eps;
  LayerShape shape;
  T* out;

  void run(int64_t b, int64_t h, float* state) const {
    const int64_t dk = shape.dk, dv = shape.dv, kh = h / (shape.hv / shape.hk);
    float qf[kMaxHeadDim], kf[kMaxHeadDim], vf[kMaxHeadDim], of[kMaxHeadDim];
    const T* row = mixed + b * shape.conv_dim();
    widen(row + kh * dk, qf, dk);
    widen(row + shape.key_dim() + kh * dk, kf, dk);
    widen(row + 2 * shape.key_dim() + h * dv, vf, dv);
    l2_normalize(qf, dk, 1.f / std::sqrt(static_cast<float>(dk)));
    l2_normalize(kf, dk, 1.f);
    const T* own = projected + b * projected_stride;
    const T* gates = own + shape.conv_dim() + shape.value_dim();  // b (Hv), then a (Hv)
    const float decay = decay_gate(static_cast<float>(gates[shape.hv + h]), a_log[h], dt_bias[h]);
    delta_rule_step<V>(state, dk, dv, qf, kf, vf, decay, beta_gate(gates[h]), of);
    gated_norm(of, own + shape.conv_dim() + h * dv, out + b * shape.value_dim() + h * dv);
  }

  // weight * T(x / rms(x)) in T, times silu(z) in fp32, rounded once; x is the delta rule's output rounded to T
  void gated_norm(float* x, const T* z, T* dst) const {
    using Vec = typename V::Vec;
    const int64_t dv = shape.dv;
    Vec squares = V::zero();
    for (int64_t j = 0; j < dv; j += V::kLanes) {
      const Vec value = V::template round_as<T>(V::load(x + j));
      V::store(x + j, value);
      squares = V::fmadd(value, value, squares);
    }
    const Vec inverse_rms = V::set1(1.f / std::sqrt(V::reduce_add(squares) / dv + eps));
    for (int64_t j = 0; j < dv; j += V::kLanes) {
      const Vec normed = V::template round_as<T>(V::mul(V::load(x + j), inverse_rms));
      const Vec weighted = V::template round_as<T>(V::mul(V::template load_as<T>(norm_weight + j), normed));
      V::template store_as<T>(dst + j, V::mul(weighted, V::silu(V::template load_as<T>(z + j))));
    }
  }
};

template <typename V, typename T, typename W>
void decode_rows(const torch::Tensor& projected, const torch::Tensor& conv_pool, const W* conv_weight, int64_t width,
                 const HeadStep<V, T>& heads, const torch::Tensor& state_pool, const int64_t* slots, T* mixed) {
  const int64_t rows = projected.size(0), channels = heads.shape.conv_dim();
  const int64_t blocks = (channels + kConvChannelGrain - 1) / kConvChannelGrain;
  const T* x = projected.data_ptr<T>();
  T* windows = conv_pool.data_ptr<T>();
  at::parallel_for(0, rows * blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / blocks, c0 = (task % blocks) * kConvChannelGrain;
      conv_tokens<V>(x + b * projected.stride(0), projected.stride(0), windows + slots[b] * channels * (width - 1),
                     conv_weight, static_cast<const float*>(nullptr), width, 1, c0,
                     std::min(channels, c0 + kConvChannelGrain), mixed + b * channels, channels);
    }
  });
  const int64_t hv = heads.shape.hv;
  at::parallel_for(0, rows * hv, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / hv, h = task % hv;
      heads.run(b, h, state_of(state_pool, slots[b], h));
    }
  });
}

// projected (B, conv_dim + value_dim + 2 Hv): in_proj's output for B decode rows; conv_pool (slots, conv_dim, K-1)
// and state_pool (slots, Hv, Dk, Dv) float32 updated in place at slots (B,) -> (B, value_dim) for out_proj
template <typename V>
torch::Tensor gated_deltanet_decode(const torch::Tensor& projected, const torch::Tensor& conv_pool,
                                    const torch::Tensor& conv_weight, const torch::Tensor& a_log,
                                    const torch::Tensor& dt_bias, const torch::Tensor& norm_weight, double eps,
                                    int64_t num_k_heads, int64_t head_k_dim, const torch::Tensor& state_pool,
                                    const torch::Tensor& slots) {
  const LayerShape shape{num_k_heads, head_k_dim, a_log.numel(), norm_weight.numel()};
  TORCH_CHECK(dt_bias.numel() == shape.hv, "gated deltanet decode: A_log and dt_bias (Hv,)");
  check_layer(projected, conv_pool, conv_weight, norm_weight, state_pool, slots, shape, V::kLanes);
  const torch::Tensor a_log_f = a_log.to(at::kFloat).contiguous(), dt_bias_f = dt_bias.to(at::kFloat).contiguous();
  auto out = torch::empty({projected.size(0), shape.value_dim()}, projected.options());
  auto mixed = torch::empty({projected.size(0), shape.conv_dim()}, projected.options());
  const int64_t* slot = slots.data_ptr<int64_t>();
  dispatch_activations(projected.scalar_type(), "gated deltanet decode", [&](auto zero) {
    using T = decltype(zero);
    const HeadStep<V, T> heads{projected.data_ptr<T>(), projected.stride(0), mixed.data_ptr<T>(),
                               a_log_f.data_ptr<float>(), dt_bias_f.data_ptr<float>(), norm_weight.data_ptr<T>(),
                               static_cast<float>(eps), shape, out.data_ptr<T>()};
    const int64_t width = conv_weight.size(1);
    if (conv_weight.scalar_type() == at::kFloat) {
      decode_rows(projected, conv_pool, conv_weight.data_ptr<float>(), width, heads, state_pool, slot,
                  mixed.data_ptr<T>());
    } else {
      decode_rows(projected, conv_pool, conv_weight.data_ptr<T>(), width, heads, state_pool, slot, mixed.data_ptr<T>());
    }
  });
  return out;
}

// The five ops as kernels/cpu_linear_attention.py calls them, the same names in every build. None touches a
// Python object, so each releases the GIL.
template <typename V>
void bind_linear_attention(pybind11::module& m) {
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("gated_delta_rule_decode", &gated_delta_rule_decode<V>, "one token per row: the gated delta-rule step over "
        "state_pool rows at state_slots, updated in place; q, k L2-normalised inside", release_gil());
  m.def("gated_delta_rule_prefill", &gated_delta_rule_prefill<V>, "the gated delta rule over segments "
        "(cu_seqlens), each continuing its state_pool row and leaving its final state there", release_gil());
  m.def("causal_conv1d_decode", &causal_conv1d_decode<V>, "silu(depthwise causal conv) of one token per row, its "
        "conv window shifted in place", release_gil());
  m.def("causal_conv1d_prefill", &causal_conv1d_prefill<V>, "silu(depthwise causal conv) over segments, each "
        "continuing its conv window and leaving its last K-1 inputs there", release_gil());
  m.def("gated_deltanet_decode", &gated_deltanet_decode<V>, "a Gated DeltaNet layer's decode rows from in_proj's "
        "output to out_proj's input (conv, gates, q/k L2 norms, delta rule, gated RMSNorm), both pools updated in "
        "place", release_gil());
}

}  // namespace mili
