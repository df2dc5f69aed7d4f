// Gated DeltaNet's kernel parts that no vector width changes: constants, the scalar helpers (widen, L2 norm,
// the per-head gates), the dtype dispatch and the argument checks. Shared by the AVX-512 build (csrc/) and the
// AVX2 one (csrc_avx2/), so no vector intrinsics here; `lanes` is the build's fp32 values per register.
#pragma once

#include <torch/extension.h>

#include <cmath>

namespace mili {

constexpr int64_t kMaxHeadDim = 256;        // q, k and v rows are staged in fp32 on the stack
constexpr float kL2NormEps = 1e-6f;         // transformers' (and FLA's) l2norm epsilon
constexpr int64_t kMaxConvWidth = 8;        // the conv window is staged on the stack
constexpr int64_t kConvChannelGrain = 256;  // channels per conv task
constexpr float kSoftplusThreshold = 20.f;  // torch's softplus default: x itself above it

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

template <typename T> inline float rounded(float x) { return static_cast<float>(static_cast<T>(x)); }

// beta = sigmoid(b), rounded to T as the layer's torch op leaves it
template <typename T> inline float beta_gate(T b) { return rounded<T>(1.f / (1.f + std::exp(-static_cast<float>(b)))); }

// the decay exp(g), g = -exp(A_log) softplus(a + dt_bias)
inline float decay_gate(float a, float a_log, float dt_bias) {
  const float x = a + dt_bias;
  return std::exp(-std::exp(a_log) * (x > kSoftplusThreshold ? x : std::log1p(std::exp(x))));
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

inline void check_delta_rule(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& g, const torch::Tensor& beta, const torch::Tensor& state_pool,
                             const torch::Tensor& slots, int64_t lanes) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "gated delta rule: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.sizes() == k.sizes() && v.dim() == 3 && q.size(0) == v.size(0),
              "gated delta rule: q, k (N, Hk, Dk) and v (N, Hv, Dv)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "gated delta rule: q, k and v of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "gated delta rule: head dims contiguous");
  const int64_t hk = k.size(1), hv = v.size(1), dk = k.size(2), dv = v.size(2);
  TORCH_CHECK(hv % hk == 0, "gated delta rule: value heads a multiple of key heads");
  TORCH_CHECK(dk <= kMaxHeadDim && dv <= kMaxHeadDim && dv % lanes == 0,
              "gated delta rule: head dims up to 256, Dv a multiple of ", lanes);
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat && g.sizes() == beta.sizes() &&
              g.dim() == 2 && g.size(0) == q.size(0) && g.size(1) == hv, "gated delta rule: g, beta float32 (N, Hv)");
  TORCH_CHECK(state_pool.scalar_type() == at::kFloat && state_pool.is_contiguous() && state_pool.dim() == 4 &&
              state_pool.size(1) == hv && state_pool.size(2) == dk && state_pool.size(3) == dv,
              "gated delta rule: state_pool float32 contiguous (slots, Hv, Dk, Dv)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "gated delta rule: slots int64");
  check_slots_in_range(slots, state_pool.size(0), "gated delta rule");
}

inline void check_conv(const torch::Tensor& x, const torch::Tensor& conv_pool, const torch::Tensor& weight,
                       const torch::Tensor& bias, const torch::Tensor& slots, int64_t lanes) {
  TORCH_CHECK(x.device().is_cpu(), "causal conv1d: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "causal conv1d: x (N, C), channels contiguous");
  TORCH_CHECK(x.size(1) % lanes == 0, "causal conv1d: channels a multiple of ", lanes);
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

// the fused decode layer's heads and dims (gated_deltanet_layer.h)
struct LayerShape {
  int64_t hk, dk, hv, dv;
  int64_t key_dim() const { return hk * dk; }
  int64_t value_dim() const { return hv * dv; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
};

inline void check_layer(const torch::Tensor& projected, const torch::Tensor& conv_pool,
                        const torch::Tensor& conv_weight, const torch::Tensor& norm_weight,
                        const torch::Tensor& state_pool, const torch::Tensor& slots, const LayerShape& shape,
                        int64_t lanes) {
  const auto type = projected.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
              "gated deltanet decode: float32, bfloat16 or float16 activations");
  TORCH_CHECK(projected.device().is_cpu() && projected.dim() == 2 && projected.stride(1) == 1,
              "gated deltanet decode: projected (B, N) on CPU, columns contiguous");
  TORCH_CHECK(shape.hk > 0 && shape.hv % shape.hk == 0, "gated deltanet decode: value heads a multiple of key heads");
  TORCH_CHECK(shape.dk <= kMaxHeadDim && shape.dv <= kMaxHeadDim && shape.dv % lanes == 0 &&
              shape.conv_dim() % lanes == 0, "gated deltanet decode: head dims up to 256, Dv and conv_dim multiples "
              "of ", lanes);
  TORCH_CHECK(projected.size(1) == shape.conv_dim() + shape.value_dim() + 2 * shape.hv,
              "gated deltanet decode: projected has conv_dim + value_dim + 2 Hv columns");
  TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.is_contiguous() && conv_weight.size(0) == shape.conv_dim() &&
              conv_weight.size(1) >= 2 && conv_weight.size(1) <= kMaxConvWidth &&
              (conv_weight.scalar_type() == type || conv_weight.scalar_type() == at::kFloat),
              "gated deltanet decode: conv weight (conv_dim, K), K from 2 to 8, float32 or the activations' dtype");
  TORCH_CHECK(conv_pool.scalar_type() == type && conv_pool.is_contiguous() && conv_pool.dim() == 3 &&
              conv_pool.size(1) == shape.conv_dim() && conv_pool.size(2) == conv_weight.size(1) - 1,
              "gated deltanet decode: conv_pool contiguous (slots, conv_dim, K-1) in the activations' dtype");
  TORCH_CHECK(norm_weight.scalar_type() == type && norm_weight.is_contiguous() && norm_weight.numel() == shape.dv,
              "gated deltanet decode: norm weight (Dv,) in the activations' dtype");
  TORCH_CHECK(state_pool.scalar_type() == at::kFloat && state_pool.is_contiguous() && state_pool.dim() == 4 &&
              state_pool.size(1) == shape.hv && state_pool.size(2) == shape.dk && state_pool.size(3) == shape.dv,
              "gated deltanet decode: state_pool float32 contiguous (slots, Hv, Dk, Dv)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == projected.size(0),
              "gated deltanet decode: slots int64, one per row");
  check_slots_in_range(slots, state_pool.size(0), "gated deltanet decode");
  check_slots_in_range(slots, conv_pool.size(0), "gated deltanet decode");
}

}  // namespace mili
