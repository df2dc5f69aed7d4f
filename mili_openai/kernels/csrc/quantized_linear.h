// Matmuls over quantized weights: int8 and int4 rows dequantized in registers, bf16 activations and output.
// The layouts are kernels/quantized.py's (one weight format for these kernels, the Triton ones and the
// torch fallback); every entry point needs AVX512-BF16.
#pragma once

#include <torch/extension.h>

// One projection's weight as the decode stack holds it.
struct PackedLinear {
  int64_t bits;           // 16: bf16 (N, K); 8: int8 (N, K); 4: uint8 (N, K / 2), two values a byte
  torch::Tensor weight;
  torch::Tensor scales;   // 8: float32 (N, G); 4: float16 (N, G); 16: unused. G groups of K / G along K
  torch::Tensor zeros;    // 4: uint8 (N, G) zero points, or empty for 8 (symmetric); otherwise unused
};

// A quantized weight's rows, as the shared driver (linear_quantized.cpp) asks for them.
class QuantizedRows {
 public:
  virtual ~QuantizedRows() = default;
  virtual bool streams_fp32_x() const = 0;  // whether `stream` takes x widened to fp32 (else bf16)
  // y[n - begin] = bf16(x . dequantized row n) for n in [begin, end), x one row of K values
  virtual void stream(const void* x, int64_t begin, int64_t end, at::BFloat16* y) const = 0;
  // rows [begin, end) dequantized to bf16, K values apart
  virtual void dequantize(int64_t begin, int64_t end, at::BFloat16* out) const = 0;
};

// y (M, N) = x (M, K) @ dequantized(rows).T: one row of x streams the weight once (rows.stream); more rows
// dequantize blocks of weight rows into cache and multiply them with linear_bf16's tiles.
torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedRows& rows, int64_t N, int64_t K);
// Every row of `rows` dequantized, (N, K) bf16.
torch::Tensor quantized_dequantize(const QuantizedRows& rows, int64_t N, int64_t K);

// The format classes behind the bindings; each checks shapes and dtypes once, at construction.
std::unique_ptr<QuantizedRows> int8_rows(const torch::Tensor& weight, const torch::Tensor& scales);
std::unique_ptr<QuantizedRows> int4_rows(const torch::Tensor& weight, const torch::Tensor& scales,
                                         const torch::Tensor& zeros);
std::unique_ptr<QuantizedRows> packed_rows(const PackedLinear& w);  // bits 8 or 4

// x (M, K) bf16 @ w.T whatever the weight's format; the decode stack's one matmul.
torch::Tensor linear_packed(const torch::Tensor& x, const PackedLinear& w, bool bf16_dot_products, bool amx_tiles);

// linear_bf16's pair-product tiles over one block of bf16 weight rows already in cache: y[m, r] for m < M,
// r < rows, y rows ldy apart (in linear_bf16.cpp).
void linear_bf16_rows(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w, int64_t rows,
                      at::BFloat16* y, int64_t ldy);
