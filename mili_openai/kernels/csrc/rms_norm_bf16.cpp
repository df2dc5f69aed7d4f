// RMSNorm, and RMSNorm of q/k heads followed by RoPE, for bf16 on AVX512 CPUs, in one pass per row.
//
// In torch each is 7-12 small ops (widen, square, mean, add, rsqrt, multiply, narrow, weight multiply,
// then roll and three ops of RoPE); at decode a row is 1024 values and every op costs more in dispatch
// than in arithmetic, three times per layer. The kernel reproduces transformers' bf16 rounding points
// exactly: normalise in fp32, round to bf16, multiply by the bf16 weight and round; for RoPE round
// x * cos and rotate_half(x) * sin each to bf16, then their sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "simd_bf16.h"

namespace {

using mili::kLanes;
using mili::round_bf16;
using mili::store_bf16;
constexpr int64_t kMaxHeadDim = 256;  // the rotated row is staged on the stack

inline __m512 load_bf16(const at::BFloat16* p) { return mili::widen_bf16(p); }

// 1 / sqrt(mean(x^2) + eps) of one row, in fp32 as transformers computes it.
inline float inverse_rms(const at::BFloat16* x, int64_t dim, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += kLanes) {
    const __m512 v = load_bf16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(dim) + eps);
}

// out = bf16(weight * bf16(x * inv_rms)), 16 lanes at a time, kept in fp32 in `normed`.
inline void normalize_row(const at::BFloat16* x, const at::BFloat16* weight, int64_t dim, float eps, float* normed) {
  const __m512 inv = _mm512_set1_ps(inverse_rms(x, dim, eps));
  for (int64_t i = 0; i < dim; i += kLanes) {
    const __m512 n = round_bf16(_mm512_mul_ps(load_bf16(x + i), inv));
    _mm512_storeu_ps(normed + i, round_bf16(_mm512_mul_ps(n, load_bf16(weight + i))));
  }
}

// rows_contiguous: x's rows may lie apart (only its last dim need be contiguous) where the caller says so
void check_rows(const torch::Tensor& x, const torch::Tensor& weight, const char* name, bool rows_contiguous = true) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, name, ": bf16 only");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK((rows_contiguous ? x.is_contiguous() : x.stride(-1) == 1) && weight.is_contiguous(), name,
              ": contiguous inputs only");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), name, ": weight (D,) over x (..., D)");
  TORCH_CHECK(weight.size(0) % kLanes == 0, name, ": D must be a multiple of 16");
}

}  // namespace

// x (..., D), weight (D,) -> bf16(weight * bf16(x / rms(x)))
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm_bf16");
  const int64_t dim = weight.size(0), rows = x.numel() / dim;
  auto out = torch::empty_like(x);
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = weight.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  // a decode step's handful of rows is not worth waking a second thread for
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> normed(dim);
    for (int64_t r = begin; r < end; ++r) {
      normalize_row(xp + r * dim, wp, dim, static_cast<float>(eps), normed.data());
      for (int64_t i = 0; i < dim; i += kLanes) store_bf16(op + r * dim + i, _mm512_loadu_ps(normed.data() + i));
    }
  });
  return out;
}

// qk (T, Hq + Hk, D): heads [0, Hq) normalised with q_weight, the rest with k_weight, then each rotated
// by its token's cos and signed_sin (T, D), where signed_sin = [-sin, sin] over the two halves. qk's
// tokens may lie apart (the q/k columns of the fused projection's output, read in place: copying them
// first cost a fifth of the kernel's time at 512 tokens); each token's heads are contiguous.
torch::Tensor qk_norm_rope_bf16(const torch::Tensor& qk, const torch::Tensor& q_weight, const torch::Tensor& k_weight,
                                int64_t num_q_heads, double eps, const torch::Tensor& cos,
                                const torch::Tensor& signed_sin) {
  check_rows(qk, q_weight, "qk_norm_rope_bf16", false);
  check_rows(qk, k_weight, "qk_norm_rope_bf16", false);
  TORCH_CHECK(qk.dim() == 3 && num_q_heads < qk.size(1), "qk_norm_rope_bf16: qk (T, Hq + Hk, D)");
  TORCH_CHECK(qk.stride(1) == qk.size(2), "qk_norm_rope_bf16: each token's heads contiguous");
  const int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2), half = dim / 2;
  TORCH_CHECK(dim <= kMaxHeadDim && half % kLanes == 0, "qk_norm_rope_bf16: D a multiple of 32, at most 256");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && signed_sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() &&
              signed_sin.is_contiguous() && cos.numel() == tokens * dim && signed_sin.numel() == tokens * dim,
              "qk_norm_rope_bf16: contiguous bf16 cos and signed_sin of (T, D)");
  auto out = torch::empty({tokens, heads, dim}, qk.options());
  const int64_t token_stride = qk.stride(0);
  const auto* xp = qk.data_ptr<at::BFloat16>();
  const auto* qw = q_weight.data_ptr<at::BFloat16>();
  const auto* kw = k_weight.data_ptr<at::BFloat16>();
  const auto* cp = cos.data_ptr<at::BFloat16>();
  const auto* sp = signed_sin.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, tokens * heads, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float normed[kMaxHeadDim];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t token = r / heads, head = r % heads;
      normalize_row(xp + token * token_stride + head * dim, head < num_q_heads ? qw : kw, dim, static_cast<float>(eps),
                    normed);
      for (int64_t i = 0; i < dim; i += kLanes) {
        const int64_t partner = i < half ? i + half : i - half;  // rotate_half pairs the two halves
        const __m512 a = round_bf16(_mm512_mul_ps(_mm512_load_ps(normed + i), load_bf16(cp + token * dim + i)));
        const __m512 b = round_bf16(_mm512_mul_ps(_mm512_load_ps(normed + partner), load_bf16(sp + token * dim + i)));
        store_bf16(op + r * dim + i, round_bf16(_mm512_add_ps(a, b)));
      }
    }
  });
  return out;
}
