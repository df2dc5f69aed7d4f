// The driver shared by the int8 and int4 matmuls (linear_int8.cpp, linear_int4.cpp): how threads split the
// weight rows. Each streams its own contiguous range, dequantizing in registers, and takes from the back of
// the other's range when done, as linear_bf16 does (row_ranges.h): a thread that loses its core for a
// while holds up no one.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "kernels.h"
#include "quantized_linear.h"
#include "row_ranges.h"

namespace {

constexpr int64_t kBlockRows = 24;  // rows a thread steals at a time, and its range's granularity
constexpr int64_t kOwnerClaimRows = 2 * kBlockRows;  // rows a thread claims at a time from its own range

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.dim() == 2 && x.size(1) == K,
              "quantized linear: x (M, K) bf16 on CPU");
  TORCH_CHECK(cpu_has_bf16_dot_products(), "quantized linear: this CPU has no AVX512-BF16");
}

// Each thread's share of weight rows [0, N): `work(begin, end)` over claims of up to `claim` rows, first from
// the thread's own range, then from the back of the others'.
template <typename Work>
void split_rows(int64_t N, int64_t granule, int64_t claim, Work&& work) {
  const int64_t threads = at::get_num_threads();
  mili::RowRanges ranges(N, threads, granule);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) { ranges.work_through(first, last, claim, granule, work); });
}

}  // namespace

torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedRows& rows, int64_t N, int64_t K) {
  check_x(x, K);
  const torch::Tensor xs = x.contiguous();
  auto y = torch::empty({x.size(0), N}, x.options());
  auto* yp = y.data_ptr<at::BFloat16>();
  const std::vector<torch::Tensor> prepared = rows.prepare(xs);
  split_rows(N, kBlockRows, kOwnerClaimRows,
             [&](int64_t begin, int64_t end) { rows.multiply(xs, prepared, begin, end, yp + begin, N); });
  return y;
}

torch::Tensor quantized_dequantize(const QuantizedRows& rows, int64_t N, int64_t K) {
  TORCH_CHECK(cpu_has_bf16_dot_products(), "quantized dequantize: this CPU has no AVX512-BF16");
  auto out = torch::empty({N, K}, torch::dtype(at::kBFloat16));
  auto* op = out.data_ptr<at::BFloat16>();
  split_rows(N, kBlockRows, kOwnerClaimRows, [&](int64_t begin, int64_t end) { rows.dequantize(begin, end, op + begin * K); });
  return out;
}

std::unique_ptr<QuantizedRows> packed_rows(const PackedLinear& w) {
  TORCH_CHECK(w.bits == 8 || w.bits == 4, "packed weight: 8 or 4 bits, got ", w.bits);
  return w.bits == 8 ? int8_rows(w.weight, w.scales) : int4_rows(w.weight, w.scales, w.zeros);
}

torch::Tensor linear_packed(const torch::Tensor& x, const PackedLinear& w, bool bf16_dot_products, bool amx_tiles) {
  if (w.bits == 16) return linear_bf16(x, w.weight, bf16_dot_products, amx_tiles);
  const int64_t N = w.weight.size(0), K = w.bits == 8 ? w.weight.size(1) : 2 * w.weight.size(1);
  return quantized_linear(x, *packed_rows(w), N, K);
}
