// A Gated DeltaNet layer's decode step between its two projections, in one call: per row, the conv window
// update with SiLU, then per value head the g and beta gates, the L2 norms of q and k, the delta-rule update of
// the fp32 state in place, and the gated RMSNorm with z. Done op by op (model/gated_deltanet.py) that is some
// thirty small torch ops a layer, each a dispatch and a buffer; here two parallel passes. The arithmetic and its
// rounding points to the activations' dtype follow the torch reference's order (kernels/linear_attention.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

#include "delta_rule_step.h"
#include "simd_bf16.h"

namespace {

using mili::kLanes;
using mili::kMaxHeadDim;
constexpr float kSoftplusThreshold = 20.f;  // torch's softplus default: x itself above it

template <typename T> inline float rounded(float x) { return static_cast<float>(static_cast<T>(x)); }

struct LayerShape {
  int64_t hk, dk, hv, dv;
  int64_t key_dim() const { return hk * dk; }
  int64_t value_dim() const { return hv * dv; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
};

// The per-head part: `projected` rows are in_proj's [conv input; z; b; a], `mixed` rows the conv's output [q; k; v]
template <typename T>
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
    mili::widen(row + kh * dk, qf, dk);
    mili::widen(row + shape.key_dim() + kh * dk, kf, dk);
    mili::widen(row + 2 * shape.key_dim() + h * dv, vf, dv);
    mili::l2_normalize(qf, dk, 1.f / std::sqrt(static_cast<float>(dk)));
    mili::l2_normalize(kf, dk, 1.f);
    const T* own = projected + b * projected_stride;
    const T* gates = own + shape.conv_dim() + shape.value_dim();  // b (Hv), then a (Hv)
    const float beta = rounded<T>(1.f / (1.f + std::exp(-static_cast<float>(gates[h]))));  // sigmoid in T
    const float x = static_cast<float>(gates[shape.hv + h]) + dt_bias[h];
    const float g = -std::exp(a_log[h]) * (x > kSoftplusThreshold ? x : std::log1p(std::exp(x)));
    mili::delta_rule_step(state, dk, dv, qf, kf, vf, std::exp(g), beta, of);
    gated_norm(of, own + shape.conv_dim() + h * dv, out + b * shape.value_dim() + h * dv);
  }

  // weight * T(x / rms(x)) in T, times silu(z) in fp32, rounded once; x is the delta rule's output rounded to T
  void gated_norm(float* x, const T* z, T* dst) const {
    const int64_t dv = shape.dv;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t j = 0; j < dv; j += kLanes) {
      const __m512 value = mili::round16<T>(_mm512_loadu_ps(x + j));
      _mm512_storeu_ps(x + j, value);
      squares = _mm512_fmadd_ps(value, value, squares);
    }
    const __m512 inverse_rms = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / dv + eps));
    for (int64_t j = 0; j < dv; j += kLanes) {
      const __m512 normed = mili::round16<T>(_mm512_mul_ps(_mm512_loadu_ps(x + j), inverse_rms));
      const __m512 weighted = mili::round16<T>(_mm512_mul_ps(mili::load16(norm_weight + j), normed));
      mili::store16(dst + j, _mm512_mul_ps(weighted, mili::silu(mili::load16(z + j))));
    }
  }
};

void check_layer(const torch::Tensor& projected, const torch::Tensor& conv_pool, const torch::Tensor& conv_weight,
                 const torch::Tensor& norm_weight, const torch::Tensor& state_pool, const torch::Tensor& slots,
                 const LayerShape& shape) {
  const auto type = projected.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
              "gated deltanet decode: float32, bfloat16 or float16 activations");
  TORCH_CHECK(projected.device().is_cpu() && projected.dim() == 2 && projected.stride(1) == 1,
              "gated deltanet decode: projected (B, N) on CPU, columns contiguous");
  TORCH_CHECK(shape.hk > 0 && shape.hv % shape.hk == 0, "gated deltanet decode: value heads a multiple of key heads");
  TORCH_CHECK(shape.dk <= kMaxHeadDim && shape.dv <= kMaxHeadDim && shape.dv % kLanes == 0 &&
              shape.conv_dim() % kLanes == 0, "gated deltanet decode: head dims up to 256, Dv and conv_dim multiples "
              "of 16");
  TORCH_CHECK(projected.size(1) == shape.conv_dim() + shape.value_dim() + 2 * shape.hv,
              "gated deltanet decode: projected has conv_dim + value_dim + 2 Hv columns");
  TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.is_contiguous() && conv_weight.size(0) == shape.conv_dim() &&
              conv_weight.size(1) >= 2 && conv_weight.size(1) <= mili::kMaxConvWidth &&
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
  mili::check_slots_in_range(slots, state_pool.size(0), "gated deltanet decode");
  mili::check_slots_in_range(slots, conv_pool.size(0), "gated deltanet decode");
}

template <typename T, typename W>
void decode_rows(const torch::Tensor& projected, const torch::Tensor& conv_pool, const W* conv_weight, int64_t width,
                 const HeadStep<T>& heads, const torch::Tensor& state_pool, const int64_t* slots, T* mixed) {
  const int64_t rows = projected.size(0), channels = heads.shape.conv_dim();
  const int64_t blocks = (channels + mili::kConvChannelGrain - 1) / mili::kConvChannelGrain;
  const T* x = projected.data_ptr<T>();
  T* windows = conv_pool.data_ptr<T>();
  at::parallel_for(0, rows * blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / blocks, c0 = (task % blocks) * mili::kConvChannelGrain;
      mili::conv_tokens(x + b * projected.stride(0), projected.stride(0), windows + slots[b] * channels * (width - 1),
                        conv_weight, static_cast<const float*>(nullptr), width, 1, c0,
                        std::min(channels, c0 + mili::kConvChannelGrain), mixed + b * channels, channels);
    }
  });
  const int64_t hv = heads.shape.hv;
  at::parallel_for(0, rows * hv, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / hv, h = task % hv;
      heads.run(b, h, mili::state_of(state_pool, slots[b], h));
    }
  });
}

}  // namespace

// projected (B, conv_dim + value_dim + 2 Hv): in_proj's output for B decode rows; conv_pool (slots, conv_dim, K-1)
// and state_pool (slots, Hv, Dk, Dv) float32 updated in place at slots (B,) -> (B, value_dim) for out_proj
torch::Tensor gated_deltanet_decode(const torch::Tensor& projected, const torch::Tensor& conv_pool,
                                    const torch::Tensor& conv_weight, const torch::Tensor& a_log,
                                    const torch::Tensor& dt_bias, const torch::Tensor& norm_weight, double eps,
                                    int64_t num_k_heads, int64_t head_k_dim, const torch::Tensor& state_pool,
                                    const torch::Tensor& slots) {
  const LayerShape shape{num_k_heads, head_k_dim, a_log.numel(), norm_weight.numel()};
  TORCH_CHECK(dt_bias.numel() == shape.hv, "gated deltanet decode: A_log and dt_bias (Hv,)");
  check_layer(projected, conv_pool, conv_weight, norm_weight, state_pool, slots, shape);
  const torch::Tensor a_log_f = a_log.to(at::kFloat).contiguous(), dt_bias_f = dt_bias.to(at::kFloat).contiguous();
  auto out = torch::empty({projected.size(0), shape.value_dim()}, projected.options());
  auto mixed = torch::empty({projected.size(0), shape.conv_dim()}, projected.options());
  const int64_t* slot = slots.data_ptr<int64_t>();
  mili::dispatch_activations(projected.scalar_type(), "gated deltanet decode", [&](auto zero) {
    using scalar_t = decltype(zero);
    const HeadStep<scalar_t> heads{projected.data_ptr<scalar_t>(), projected.stride(0), mixed.data_ptr<scalar_t>(),
                                   a_log_f.data_ptr<float>(), dt_bias_f.data_ptr<float>(),
                                   norm_weight.data_ptr<scalar_t>(), static_cast<float>(eps), shape,
                                   out.data_ptr<scalar_t>()};
    const int64_t width = conv_weight.size(1);
    if (conv_weight.scalar_type() == at::kFloat) {
      decode_rows(projected, conv_pool, conv_weight.data_ptr<float>(), width, heads, state_pool, slot,
                  mixed.data_ptr<scalar_t>());
    } else {
      decode_rows(projected, conv_pool, conv_weight.data_ptr<scalar_t>(), width, heads, state_pool, slot,
                  mixed.data_ptr<scalar_t>());
    }
  });
  return out;
}
