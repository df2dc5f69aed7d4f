// Python bindings of the CPU kernels (one extension, built once by torch's JIT builder).
#include <torch/extension.h>

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool,
                                     const torch::Tensor& v_pool, const torch::Tensor& slots,
                                     const torch::Tensor& ctx_lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_bf16", &gemv_bf16, "y = x @ w.T for bf16 x (M<=8, K) and w (N, K)");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged K/V slots");
}
