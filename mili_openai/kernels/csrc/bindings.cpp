// Python bindings of the CPU kernels (one extension, built once by torch's JIT builder).
#include <torch/extension.h>

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool,
                                     const torch::Tensor& v_pool, const torch::Tensor& slots,
                                     const torch::Tensor& ctx_lens, double scale);
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor qk_norm_rope_bf16(const torch::Tensor& qk, const torch::Tensor& q_weight, const torch::Tensor& k_weight,
                                int64_t num_q_heads, double eps, const torch::Tensor& cos,
                                const torch::Tensor& signed_sin);
torch::Tensor silu_mul_bf16(const torch::Tensor& gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16, "y = x @ w.T for bf16 x (M, K) and w (N, K), fp32 accumulation");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged K/V slots");
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm with transformers' bf16 rounding");
  m.def("qk_norm_rope_bf16", &qk_norm_rope_bf16, "per-head RMSNorm of q and k, then RoPE");
  m.def("silu_mul_bf16", &silu_mul_bf16, "silu(gate) * up over a fused gate/up projection's output");
}
