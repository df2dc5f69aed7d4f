// bf16 matmul for CPUs with AVX2 and FMA but no AVX-512 (Zen 2/3, older Xeons, many cloud VMs): y = x @ w.T
// with bf16 weights, fp32 accumulation, bf16 output, for the few rows of x of a decode step.
//
// torch's own bf16 GEMM on such a CPU multiplies at a few GFLOP/s (it converts element by element), and
// oneDNN has no bf16 path there. A bf16 value is the high half of an fp32, so eight weights widen to fp32
// with a zero-extend and a shift, and the products are plain fp32 FMAs.
//
// Threads take blocks of kBlockRows weight rows; every chunk of up to kChunkRows x rows multiplies the
// block while it is in L1/L2, so the weights stream from memory once per step, whatever the batch. A tile
// holds MC x rows by R weight rows: MC * R accumulators (8 keeps both FMA pipes busy through the FMA's
// latency), R widened weights and one x vector, within AVX2's 16 registers.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "vectors_avx2.h"

namespace {

using mili_avx2::horizontal_sum;
using mili_avx2::widen_bf16;

constexpr int64_t kLanes = 8;         // fp32 per AVX2 register
constexpr int kChunkRows = 4;         // x rows per tile
constexpr int kTileWeightRows = 2;    // weight rows per tile (4 x 2 accumulators)
constexpr int kStreamRows = 8;        // weight rows per tile when x has one row (memory-bound)
constexpr int64_t kBlockRows = 16;    // weight rows a thread takes at a time

// y[m * ldy + r] for m < MC, r < R: x fp32 rows K apart, w bf16 rows K apart.
template <int MC, int R>
inline void tile(const float* x, const at::BFloat16* w, int64_t K, at::BFloat16* y, int64_t ldy) {
  __m256 acc[MC][R];
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kLanes) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = widen_bf16(w + r * K + k);
    for (int m = 0; m < MC; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = at::BFloat16(horizontal_sum(acc[m][r]));
}

// One row of x against weight rows [n0, n1): R rows at a time, each weight widened once.
template <int MC>
void rows_against_block(const float* x, const at::BFloat16* w, int64_t K, int64_t n0, int64_t n1, at::BFloat16* y,
                        int64_t ldy) {
  constexpr int R = MC == 1 ? kStreamRows : kTileWeightRows;
  int64_t n = n0;
  for (; n + R <= n1; n += R) tile<MC, R>(x, w + n * K, K, y + n, ldy);
  for (; n < n1; ++n) tile<MC, 1>(x, w + n * K, K, y + n, ldy);
}

void chunk_against_block(const float* x, int64_t rows, const at::BFloat16* w, int64_t K, int64_t n0, int64_t n1,
                         at::BFloat16* y, int64_t ldy) {
  switch (rows) {
    case 4: return rows_against_block<4>(x, w, K, n0, n1, y, ldy);
    case 3: return rows_against_block<3>(x, w, K, n0, n1, y, ldy);
    case 2: return rows_against_block<2>(x, w, K, n0, n1, y, ldy);
    default: return rows_against_block<1>(x, w, K, n0, n1, y, ldy);
  }
}

}  // namespace

torch::Tensor linear_bf16_avx2(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (M, K) and w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 x and w");
  TORCH_CHECK(w.is_contiguous() && x.size(1) % kLanes == 0, "contiguous w, K a multiple of 8");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const torch::Tensor x32 = x.to(torch::kFloat32).contiguous();  // widened once, read by every block
  const float* xp = x32.data_ptr<float>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block) {
      const int64_t n0 = block * kBlockRows, n1 = std::min(N, n0 + kBlockRows);
      for (int64_t m = 0; m < M; m += kChunkRows) {
        const int64_t rows = std::min<int64_t>(kChunkRows, M - m);
        chunk_against_block(xp + m * K, rows, wp, K, n0, n1, yp + m * N, N);
      }
    }
  });
  return y;
}

void bind_linear_attention(pybind11::module& m);  // gated_deltanet_avx2.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16_avx2", &linear_bf16_avx2, "y = x @ w.T for bf16 x (M, K) and w (N, K) on AVX2 + FMA, fp32 "
        "accumulation", pybind11::call_guard<pybind11::gil_scoped_release>());
  bind_linear_attention(m);
}
