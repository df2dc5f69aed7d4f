// SwiGLU's activation for bf16 on AVX512 CPUs: silu(gate) * up in one pass over the fused gate/up
// projection's output.
//
// In torch it is a split, silu and an in-place multiply: at decode each is a few thousand values and
// costs more in dispatch than in arithmetic. The kernel keeps transformers' bf16
// rounding points: silu computed in fp32 and rounded to bf16, then the product rounded again.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd_bf16.h"

namespace {

using mili::kLanes;

// x * sigmoid(x) in fp32, with sigmoid from exp(-|x|) so the exponent never overflows.
inline __m512 silu(__m512 x) {
  const __m512 magnitude = _mm512_abs_ps(x);
  const __m512 e = mili::exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), magnitude));
  const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 numerator = _mm512_mask_blend_ps(negative, _mm512_set1_ps(1.f), e);  // e/(1+e) below zero
  return _mm512_mul_ps(x, _mm512_div_ps(numerator, denominator));
}

}  // namespace

// gate_up (..., 2 I) with gate in the first half of each row -> (..., I) = bf16(bf16(silu(gate)) * up)
torch::Tensor silu_mul_bf16(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.device().is_cpu(), "silu_mul_bf16: bf16 CPU input");
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() >= 1, "silu_mul_bf16: contiguous input");
  const int64_t width = gate_up.size(-1) / 2, rows = width ? gate_up.numel() / (2 * width) : 0;
  TORCH_CHECK(width % kLanes == 0, "silu_mul_bf16: the half width must be a multiple of 16");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = width;
  auto out = torch::empty(sizes, gate_up.options());
  const auto* in = gate_up.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  // one row is a few microseconds of work: split rows, not a row, across threads
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* gate = in + r * 2 * width;
      const at::BFloat16* up = gate + width;
      for (int64_t i = 0; i < width; i += kLanes) {
        const __m512 activated = mili::round_bf16(silu(mili::widen_bf16(gate + i)));
        mili::store_bf16(op + r * width + i, mili::round_bf16(_mm512_mul_ps(activated, mili::widen_bf16(up + i))));
      }
    }
  });
  return out;
}
