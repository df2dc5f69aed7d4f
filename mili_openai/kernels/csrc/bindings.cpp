// Python bindings of the CPU kernels (one extension, built once by torch's JIT builder). None touches a
// Python object, so each releases the GIL: the event loop keeps streaming while the forward computes.
#include <torch/extension.h>

#include "kernels.h"
#include "quantized_linear.h"

void bind_decode_stack(pybind11::module& m);

void bind_linear_attention(pybind11::module& m);  // gated_deltanet.cpp

// The quantized matmuls and the weight record the decode stack takes.
void bind_quantized(pybind11::module& m) {
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("linear_int8", &linear_int8, "y = x @ dequantized(w).T for bf16 x (M, K), int8 w (N, K), float32 scales (N, G)",
        release_gil());
  m.def("linear_int4", &linear_int4, "y = x @ dequantized(w).T for bf16 x (M, K), packed int4 w (N, K / 2), float16 "
        "scales (N, G), uint8 zeros (N, G) or empty", release_gil());
  m.def("dequantize_int8", &dequantize_int8, "int8 weight -> bf16 (N, K)", release_gil());
  m.def("dequantize_int4", &dequantize_int4, "packed int4 weight -> bf16 (N, K)", release_gil());
  m.def("gemm_int8", &gemm_int8, "linear_int8 for many rows of x: slices of weight rows dequantized into torch's "
        "GEMM (widen_to_fp32: on float32 operands)", release_gil());
  m.def("gemm_int4", &gemm_int4, "linear_int4 for many rows of x: slices of weight rows dequantized into torch's "
        "GEMM (widen_to_fp32: on float32 operands)", release_gil());
  m.def("cpu_has_int8_dot_products", &cpu_has_int8_dot_products, "whether the CPU has AVX512-VNNI");
  m.def("linear_w8a8", &linear_w8a8, "W8A8: bf16 x (M, K) quantized to int8 (per token, or with a static float32 "
        "scale (1,)), times int8 w (N, K) as integers, scaled by x's and w's float32 scales (N, G)", release_gil());
  m.def("quantize_int8_activations", &quantize_int8_activations, "bf16 x (M, K) -> int8 levels (M, K), float32 "
        "scales (M,): per token (empty static_scale) or with a static scale (1,)", release_gil());
  pybind11::class_<PackedLinear>(m, "PackedLinear")
      .def(pybind11::init([](int64_t bits, torch::Tensor weight, torch::Tensor scales, torch::Tensor zeros,
                             bool int8_inputs, torch::Tensor input_scale) {
        return PackedLinear{bits, weight, scales, zeros, int8_inputs, input_scale};
      }))
      .def_readonly("bits", &PackedLinear::bits);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("linear_bf16", &linear_bf16, "y = x @ w.T for bf16 x (M, K) and w (N, K), fp32 accumulation; "
        "bf16_dot_products: several rows of x multiply bf16 pairs (AVX512-BF16); amx_tiles: up to 16 rows on "
        "AMX tiles", release_gil());
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention through page tables into out; "
        "amx_tiles: prefixes several sequences share on AMX tiles, once for all of them", release_gil());
  m.def("paged_prefill_attention", &paged_prefill_attention, "causal attention of every prefill chunk through "
        "page tables into out; amx_tiles: bf16 on AMX tiles", release_gil());
  m.def("cpu_has_bf16_dot_products", &cpu_has_bf16_dot_products, "whether the CPU has AVX512-BF16");
  m.def("cpu_has_amx_tiles", &cpu_has_amx_tiles, "whether the CPU has AMX-BF16 tiles that Linux lets us use");
  m.def("add_lora_bf16", [](torch::Tensor out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b_t,
                            const torch::Tensor& row_slots, const std::vector<int64_t>& offsets) {
    add_lora_bf16(out, x, LoraProjection{a, b_t, offsets}, row_slots);
  }, "out (T, O) += x A[s]^T B^T[s] for each row's slot s (-1: none), in place, bf16 (lora_bf16.cpp)", release_gil());
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm with transformers' bf16 rounding", release_gil());
  m.def("zero_centered_rms_norm", &zero_centered_rms_norm, "RMSNorm with the weight applied as 1 + w (Qwen3.5), "
        "after adding residual into x where given", release_gil());
  m.def("qk_norm_rope_bf16", &qk_norm_rope_bf16, "per-head RMSNorm of q and k, then RoPE", release_gil());
  m.def("silu_mul_bf16", &silu_mul_bf16, "silu(gate) * up over a fused gate/up projection's output", release_gil());
  m.def("moe_experts_bf16", &moe_experts_bf16, "Qwen3-MoE's routed SwiGLU experts, weighted and summed per token, "
        "each routed expert's weights read once; bf16_dot_products: multiply bf16 pairs (AVX512-BF16)", release_gil());
  m.def("sparse_moe_bf16", &sparse_moe_bf16, "Qwen3-MoE's router and experts in one call; expert_load (E,) int64 "
        "gains each expert's routed pairs", pybind11::arg("x"), pybind11::arg("router"), pybind11::arg("gate_up"),
        pybind11::arg("down"), pybind11::arg("top_k"), pybind11::arg("normalize"), pybind11::arg("expert_load"),
        pybind11::arg("bf16_dot_products"), release_gil());
  m.def("sample_rows", &sample_rows, "temperature, top-k/top-p/min-p and one inverse-CDF draw per row of logits",
        release_gil());
  m.def("truncation_thresholds", &truncation_thresholds, "each row's lowest kept value after temperature and "
        "top-k/top-p/min-p", release_gil());
  bind_decode_stack(m);
  bind_quantized(m);
  bind_linear_attention(m);
}
