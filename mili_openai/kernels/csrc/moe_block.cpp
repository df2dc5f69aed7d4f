// Qwen3-MoE's sparse block for bf16 on AVX512 CPUs in one call: the router picks each token's top-k experts
// and moe_experts.cpp runs them. One call per layer rather than a dozen torch ops, each of which wakes the
// other threads and hands the GIL to the event loop.
//
// Routing as transformers' Qwen3MoeTopKRouter: logits in bf16 (the matmul rounded once), softmax over the
// experts in fp32, the top k (equal logits: the lower expert id first), optionally renormalised to sum to
// one, rounded to bf16. Every tensor-parallel rank routes its replicated activations through the same code,
// so all pick the same experts.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "kernels.h"
#include "moe.h"

namespace {

using BF16 = at::BFloat16;

constexpr int64_t kTokensPerTask = 64;  // router rows per task: a decode step's routing runs on the caller

// One token's choice from its logits (E,): ids and weights (top_k,). scratch: 2E floats.
void choose_experts(const BF16* logits, int64_t experts, int64_t top_k, bool normalize, int64_t* ids,
                    BF16* weights, std::vector<float>& scratch) {
  float* probs = scratch.data();
  float* chosen = scratch.data() + experts;  // the chosen probabilities, in order (top_k <= E)
  float max_logit = -INFINITY;
  for (int64_t e = 0; e < experts; ++e) max_logit = std::max(max_logit, static_cast<float>(logits[e]));
  float total = 0.f;
  for (int64_t e = 0; e < experts; ++e) total += probs[e] = std::exp(static_cast<float>(logits[e]) - max_logit);
  float chosen_total = 0.f;
  for (int64_t j = 0; j < top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken |= ids[i] == e;
      if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
    }
    ids[j] = best;
    chosen[j] = probs[best] / total;
    chosen_total += chosen[j];
  }
  for (int64_t j = 0; j < top_k; ++j) weights[j] = BF16(normalize ? chosen[j] / chosen_total : chosen[j]);
}

}  // namespace

namespace mili {

torch::Tensor sparse_moe_block(const torch::Tensor& x, const torch::Tensor& router, const torch::Tensor& gate_up,
                               const torch::Tensor& down, int64_t top_k, bool normalize,
                               const torch::Tensor& expert_load, bool bf16_dot_products) {
  check_experts(x, gate_up, down, bf16_dot_products);
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = gate_up.size(0);
  TORCH_CHECK(router.scalar_type() == at::kBFloat16 && router.is_contiguous() && router.dim() == 2 &&
                  router.size(0) == experts && router.size(1) == hidden,
              "moe: router (E, H) bf16, contiguous");
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe: top_k must be in [1, experts]");
  TORCH_CHECK(!expert_load.defined() || (expert_load.scalar_type() == at::kLong && expert_load.is_contiguous() &&
                                         expert_load.numel() == experts),
              "moe: expert_load int64 (E,)");
  const torch::Tensor xf = bf16_dot_products ? torch::Tensor() : x.to(at::kFloat);
  auto logits = torch::empty({tokens, experts}, x.options());
  std::vector<int64_t> ids(tokens * top_k);
  std::vector<BF16> weights(tokens * top_k);
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    BF16* rows = logits.data_ptr<BF16>() + begin * experts;
    multiply_weight_rows(bf16_dot_products ? x.data_ptr<BF16>() + begin * hidden : nullptr,
                         bf16_dot_products ? nullptr : xf.data_ptr<float>() + begin * hidden, end - begin, hidden,
                         router.data_ptr<BF16>(), rows, experts, 0, experts);
    std::vector<float> scratch(2 * experts);
    for (int64_t t = begin; t < end; ++t)
      choose_experts(rows + (t - begin) * experts, experts, top_k, normalize, ids.data() + t * top_k,
                     weights.data() + t * top_k, scratch);
  });
  return run_experts(x, gate_up, down, ids.data(), weights.data(), top_k, bf16_dot_products,
                     expert_load.defined() ? expert_load.data_ptr<int64_t>() : nullptr);
}

}  // namespace mili

torch::Tensor sparse_moe_bf16(const torch::Tensor& x, const torch::Tensor& router, const torch::Tensor& gate_up,
                              const torch::Tensor& down, int64_t top_k, bool normalize,
                              const torch::Tensor& expert_load, bool bf16_dot_products) {
  return mili::sparse_moe_block(x.contiguous(), router, gate_up, down, top_k, normalize, expert_load,
                                bf16_dot_products);
}
