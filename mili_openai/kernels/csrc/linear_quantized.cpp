// The driver shared by the int8 and int4 matmuls (linear_int8.cpp, linear_int4.cpp): how threads split the
// weight rows. Each streams its own contiguous range, dequantizing in registers, and takes from the back of
// the other's range when done, as linear_bf16 does (row_ranges.h): a thread that loses its core for a
// while holds up no one.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <vector>

#include "kernels.h"
#include "quantized_linear.h"
#include "row_ranges.h"

namespace {

constexpr int64_t kBlockRows = 24;  // rows a thread steals at a time, and its range's granularity
constexpr int64_t kOwnerClaimRows = 2 * kBlockRows;  // rows a thread claims at a time from its own range
// The prefill GEMM (quantized_gemm): its slices' rows are a multiple of this (whole vectors of y)
constexpr int64_t kSliceGranule = 32;
// and it multiplies at most this many bytes of x per pass over the weight's slices, so that x stays in the
// last-level cache while every slice reads it (a larger prefill chunk dequantizes the weight once a pass)
constexpr int64_t kXBlockBytes = 4 << 20;

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

torch::Tensor quantized_gemm(const torch::Tensor& x, const QuantizedRows& rows, int64_t N, int64_t K, int64_t slice_rows,
                             bool widen_to_fp32) {
  check_x(x, K);
  TORCH_CHECK(slice_rows > 0, "quantized GEMM: slices of at least one row");
  const torch::Tensor xs = x.contiguous();
  const torch::Tensor x_gemm = widen_to_fp32 ? xs.to(at::kFloat) : xs;
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  const int64_t threads = at::get_num_threads();
  // up to `slice_rows` rows in whole granules, fewer where that gives every thread a slice
  const int64_t per_thread = ((N + threads - 1) / threads + kSliceGranule - 1) / kSliceGranule * kSliceGranule;
  const int64_t slice = std::max(kSliceGranule, std::min(slice_rows, per_thread) / kSliceGranule * kSliceGranule);
  const int64_t x_rows = std::max<int64_t>(1, kXBlockBytes / (K * x_gemm.element_size()));
  auto buffers = torch::empty({threads, std::min(slice, N), K}, xs.options());  // one slice a thread
  // the caller's torch state (inference mode: y is an inference tensor) for the ops on the other threads
  const at::ThreadLocalState caller_state;
  for (int64_t m0 = 0; m0 < M; m0 += x_rows) {
    const torch::Tensor xb = x_gemm.narrow(0, m0, std::min(x_rows, M - m0));
    const torch::Tensor yb = y.narrow(0, m0, xb.size(0));
    // A thread takes whole slices and runs each one's GEMM alone (nested in the parallel region, torch's GEMM
    // runs on one thread): one fork and join for the whole product, each slice in its thread's cache.
    mili::RowRanges ranges(N, threads, slice);
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
      const at::ThreadLocalStateGuard state_guard(caller_state);
      const torch::Tensor buffer = buffers[first];
      auto* bp = buffer.data_ptr<at::BFloat16>();
      ranges.work_through(first, last, slice, slice, [&](int64_t begin, int64_t end) {
        rows.dequantize(begin, end, bp);
        const torch::Tensor weight = buffer.narrow(0, 0, end - begin);
        torch::Tensor out = yb.narrow(1, begin, end - begin);
        if (widen_to_fp32)
          out.copy_(at::mm(xb, weight.to(at::kFloat).t()));
        else
          at::mm_out(out, xb, weight.t());
      });
    });
  }
  return y;
}

std::unique_ptr<QuantizedRows> packed_rows(const PackedLinear& w) {
  TORCH_CHECK(w.bits == 8 || w.bits == 4, "packed weight: 8 or 4 bits, got ", w.bits);
  TORCH_CHECK(!w.int8_inputs || w.bits == 8, "packed weight: int8 inputs multiply 8-bit weights");
  if (w.int8_inputs) return int8_activation_rows(w.weight, w.scales, w.input_scale);
  return w.bits == 8 ? int8_rows(w.weight, w.scales) : int4_rows(w.weight, w.scales, w.zeros);
}

torch::Tensor linear_packed(const torch::Tensor& x, const PackedLinear& w, bool bf16_dot_products, bool amx_tiles) {
  if (w.bits == 16) return linear_bf16(x, w.weight, bf16_dot_products, amx_tiles);
  const int64_t N = w.weight.size(0), K = w.bits == 8 ? w.weight.size(1) : 2 * w.weight.size(1);
  return quantized_linear(x, *packed_rows(w), N, K);
}
