// The zero-centred RMSNorm of Qwen3.5 / Qwen3-Next (weight applied as 1 + w), optionally after the residual add,
// one pass per row. In torch it is ten small ops (widen, square, mean, add, rsqrt, two multiplies, the weight's
// widening and 1 + w, the rounding), and the decoder runs it twice a layer plus the attention layers' q/k norms:
// at decode, dispatch costs more than the arithmetic. Rounding follows model/hybrid_norms.py: h = x + residual
// rounded to x's dtype (torch's add_), then (h / rms(h)) * (1 + w) in float32, rounded once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <type_traits>

#include "vectors_avx512.h"
#include "simd_bf16.h"

namespace {

using mili::kLanes;
constexpr int64_t kRowGrain = 4;  // rows per parallel task: a decode row of 1024 values is ~1 us of work

// out = T((x / rms(x)) * scale), scale = 1 + w in fp32; with `residual`, x += residual (rounded to T) first
template <typename T>
void norm_row(T* x, const T* residual, const float* scale, int64_t dim, float eps, T* out) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += kLanes) {
    __m512 v = mili::load16(x + i);
    if (residual != nullptr) {
      v = mili::round16<T>(_mm512_add_ps(v, mili::load16(residual + i)));
      mili::store16(x + i, v);
    }
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 inverse_rms = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / dim + eps));
  for (int64_t i = 0; i < dim; i += kLanes) {
    const __m512 normed = _mm512_mul_ps(mili::load16(x + i), inverse_rms);
    mili::store16(out + i, _mm512_mul_ps(normed, _mm512_loadu_ps(scale + i)));
  }
}

}  // namespace

// x (R, D) or (R, H, D), last dim contiguous, rows anywhere (a view into a projection's output); weight (D,);
// residual: like x, both contiguous, added into x first -> (x's shape) contiguous
torch::Tensor zero_centered_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                                     const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "zero-centred RMSNorm: float32 or bfloat16 on CPU");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, "zero-centred RMSNorm: x (R, D) or (R, H, D), "
              "D contiguous");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim && dim % kLanes == 0,
              "zero-centred RMSNorm: weight (D,), D a multiple of 16");
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->sizes() == x.sizes() &&
                residual->is_contiguous() && x.is_contiguous(), "zero-centred RMSNorm: residual contiguous like x");
  }
  const torch::Tensor scale = (weight.to(at::kFloat) + 1.0).contiguous();  // (1 + w), as torch adds it
  auto out = torch::empty(x.sizes(), x.options());
  const int64_t heads = x.dim() == 3 ? x.size(1) : 1, rows = x.size(0) * heads;
  const int64_t row_stride = x.stride(0), head_stride = x.dim() == 3 ? x.stride(1) : 0;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "zero_centered_rms_norm", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      scalar_t* base = x.data_ptr<scalar_t>();
      const scalar_t* added = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
      at::parallel_for(0, rows, kRowGrain, [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; ++r) {
          const int64_t offset = (r / heads) * row_stride + (r % heads) * head_stride;
          norm_row(base + offset, added == nullptr ? nullptr : added + r * dim, scale.data_ptr<float>(), dim,
                   static_cast<float>(eps), out.data_ptr<scalar_t>() + r * dim);
        }
      });
    }
  });
  return out;
}
