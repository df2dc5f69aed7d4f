// Matmuls over quantized weights: int8 and int4 rows dequantized in registers, bf16 activations and output.
// The layouts are kernels/quantized.py's (one weight format for these kernels, the Triton ones and the
// torch fallback); every entry point needs AVX512-BF16.
#pragma once

#include <torch/extension.h>

#include <memory>
#include <vector>

// One projection's weight as the decode stack holds it.
struct PackedLinear {
  int64_t bits;           // 16: bf16 (N, K); 8: int8 (N, K); 4: uint8 (N, K / 2), two values a byte
  torch::Tensor weight;
  torch::Tensor scales;   // 8: float32 (N, G); 4: float16 (N, G); 16: unused. G groups of K / G along K
  torch::Tensor zeros;    // 4: uint8 (N, G) zero points, or empty for 8 (symmetric); otherwise unused
  bool int8_inputs = false;  // 8 only (W8A8): x quantized to int8 first (linear_w8a8.cpp)
  torch::Tensor input_scale;  // where int8_inputs: float32 (1,) static scale, or empty for per token, dynamic
};

// A quantized weight's rows, as the shared driver (linear_quantized.cpp) asks for them.
class QuantizedRows {
 public:
  virtual ~QuantizedRows() = default;
  // What `multiply` needs from x (M, K) bf16, computed once per call.
  virtual std::vector<torch::Tensor> prepare(const torch::Tensor& x) const = 0;
  // y[m * ldy + n - begin] = bf16(x[m] . dequantized row n) for n in [begin, end) and every row m of x.
  virtual void multiply(const torch::Tensor& x, const std::vector<torch::Tensor>& prepared, int64_t begin,
                        int64_t end, at::BFloat16* y, int64_t ldy) const = 0;
  // rows [begin, end) dequantized to bf16, K values apart
  virtual void dequantize(int64_t begin, int64_t end, at::BFloat16* out) const = 0;
};

// y (M, N) = x (M, K) @ dequantized(rows).T, each weight row read once for all rows of x.
torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedRows& rows, int64_t N, int64_t K);
// Every row of `rows` dequantized, (N, K) bf16.
torch::Tensor quantized_dequantize(const QuantizedRows& rows, int64_t N, int64_t K);

// The same product for many rows of x (a prefill chunk): each thread dequantizes up to `slice_rows` weight rows
// (a multiple of 32, at least 32) at a time into its own bf16 buffer, small enough to stay in its cache, and multiplies x by them right away
// with torch's GEMM (bf16, or fp32 on widened operands where `widen_to_fp32`), into their columns of y; the
// dequantized weight never goes to memory. The values are that GEMM's on the whole dequantized weight where
// its sums over K do not depend on N (oneDNN's bf16 GEMM: tests/test_quantized_kernels.py).
torch::Tensor quantized_gemm(const torch::Tensor& x, const QuantizedRows& rows, int64_t N, int64_t K, int64_t slice_rows,
                             bool widen_to_fp32);

// The format classes behind the bindings; each checks shapes and dtypes once, at construction.
std::unique_ptr<QuantizedRows> int8_rows(const torch::Tensor& weight, const torch::Tensor& scales);
std::unique_ptr<QuantizedRows> int4_rows(const torch::Tensor& weight, const torch::Tensor& scales,
                                         const torch::Tensor& zeros);
// W8A8: x quantized to int8 (`static_scale` float32 (1,), or empty: per token, dynamic), int8 products (VNNI)
std::unique_ptr<QuantizedRows> int8_activation_rows(const torch::Tensor& weight, const torch::Tensor& scales,
                                                    const torch::Tensor& static_scale);
std::unique_ptr<QuantizedRows> packed_rows(const PackedLinear& w);  // bits 8 or 4

// x (M, K) bf16 @ w.T whatever the weight's format; the decode stack's one matmul.
torch::Tensor linear_packed(const torch::Tensor& x, const PackedLinear& w, bool bf16_dot_products, bool amx_tiles);
