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

// gate_up (..., 2 I) with gate in the first half of each row -> (..., I) = bf16(bf16(silu(gate)) * up)
torch::Tensor silu_mul_bf16(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.device().is_cpu(), "silu_mul_bf16: bf16 CPU input");
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() >= 1, "silu_mul_bf16: contiguous input");
  const int64_t width = gate_up.size(-1) / 2, rows = width ? gate_up.numel() / (2 * width) : 0;
  TORCH_CHECK(width % mili::kLanes == 0, "silu_mul_bf16: the half width must be a multiple of 16");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = width;
  auto out = torch::empty(sizes, gate_up.options());
  const auto* in = gate_up.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  // one row is a few microseconds of work: split rows, not a row, across threads
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) mili::silu_mul_row(in + r * 2 * width, in + r * 2 * width + width,
                                                            op + r * width, width);
  });
  return out;
}
