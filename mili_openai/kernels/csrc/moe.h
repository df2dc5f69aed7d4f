// Qwen3-MoE's sparse block on CPU, shared by its Python entry points and the fused decode stack.
#pragma once

#include <torch/extension.h>

namespace mili {

// x (T, H), gate_up (E, 2I, H) gate rows first, down (E, H, I): bf16, contiguous, on CPU, H and I multiples of 16.
void check_experts(const torch::Tensor& x, const torch::Tensor& gate_up, const torch::Tensor& down,
                   bool bf16_dot_products);

// (T, H) = sum over j < top_k of weights[t, j] * expert ids[t, j]'s SwiGLU of x[t] (moe_experts.cpp); ids and
// weights (T, top_k) row-major; expert_load (E,), when given, gains each expert's routed pairs.
torch::Tensor run_experts(const torch::Tensor& x, const torch::Tensor& gate_up, const torch::Tensor& down,
                          const int64_t* ids, const at::BFloat16* weights, int64_t top_k, bool bf16_dot_products,
                          int64_t* expert_load);

// A sparse layer's weights as the decode stack holds them; top_k 0: the layer is dense.
struct SparseMoeLayer {
  torch::Tensor router, gate_up, down, expert_load;
  int64_t top_k = 0;
  bool normalize = false;
};

// The router and the experts (moe_block.cpp): router (E, H) bf16; expert_load int64 (E,) or undefined.
torch::Tensor sparse_moe_block(const torch::Tensor& x, const torch::Tensor& router, const torch::Tensor& gate_up,
                               const torch::Tensor& down, int64_t top_k, bool normalize,
                               const torch::Tensor& expert_load, bool bf16_dot_products);

}  // namespace mili
