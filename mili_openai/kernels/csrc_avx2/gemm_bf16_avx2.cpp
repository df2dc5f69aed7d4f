// bf16 GEMM for AVX2 CPUs, for prefill's many rows of x: y = x @ w.T with bf16 x and w, fp32 products.
//
// torch's fp32 GEMM on the widened operands (the fallback) pays for widening every weight to a fresh fp32 copy
// at each call and reaches ~55% of a Zen 3 core's FMA peak. Here, as in BLIS: each thread widens a block of
// kBlockRows weight rows into panels of 16 rows laid out column by column (fp32, in L2), x is widened once into
// groups of 6 rows laid out the same way, and the 6 x 16 register tile of gemm_tile_avx2.h runs over each
// (group, panel) pair for the whole of K; each output is written once, as bf16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "gemm_tile_avx2.h"
#include "vectors_avx2.h"

namespace {

using mili_avx2::kPanel;
using mili_avx2::kTileRows;
constexpr int64_t kBlockRows = 64;    // weight rows a thread packs at a time: 256 KB of panels at K = 1024

// 8 x 8 fp32 transpose in registers: rows r[0..7] -> columns.
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      u[4 * i + j] = _mm256_shuffle_ps(t[4 * i + j], t[4 * i + j + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * i + j + 2] = _mm256_shuffle_ps(t[4 * i + j], t[4 * i + j + 2], _MM_SHUFFLE(3, 2, 3, 2));
    }
  // u[0]: columns 0 of rows 0-3 and 4 of rows 0-3; u[4]: the same of rows 4-7 (likewise 1/5, 2/6, 3/7)
  const int order[4] = {0, 2, 1, 3};
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[order[c]], u[4 + order[c]], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[order[c]], u[4 + order[c]], 0x31);
  }
}

// The panel of weight rows [n0, n0 + 16) (rows past N as zeros), widened: out[k * 16 + j] = w[n0 + j, k].
void pack_panel(const at::BFloat16* w, int64_t N, int64_t K, int64_t n0, float* out) {
  for (int64_t half = 0; half < 2; ++half) {  // rows n0 + 8 half + [0, 8)
    const int64_t first = n0 + 8 * half;
    for (int64_t k = 0; k < K; k += 8) {
      __m256 rows[8];
      for (int j = 0; j < 8; ++j)
        rows[j] = first + j < N ? mili_avx2::widen_bf16(w + (first + j) * K + k) : _mm256_setzero_ps();
      transpose8(rows);
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + (k + c) * kPanel + 8 * half, rows[c]);
    }
  }
}

// c[i * ldc + j] = bf16(sum over k of a[k * 6 + i] * b[k * 16 + j]), i < rows, j < cols
void tile(const float* a, const float* b, int64_t depth, at::BFloat16* c, int64_t ldc, int rows, int64_t cols) {
  alignas(32) float sums[kTileRows][kPanel];
  mili_avx2::tile_sums(a, b, depth, sums);
  for (int i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) c[i * ldc + j] = at::BFloat16(sums[i][j]);
}

}  // namespace

torch::Tensor gemm_bf16_avx2(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (M, K) and w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 x and w");
  TORCH_CHECK(w.is_contiguous() && x.size(1) % 8 == 0, "contiguous w, K a multiple of 8");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (M == 0 || N == 0) return torch::empty({M, N}, x.options());
  // x widened once into groups of 6 rows, column by column (rows past M as zeros)
  const int64_t groups = (M + kTileRows - 1) / kTileRows;
  std::vector<float> packed_x(groups * K * kTileRows);
  const torch::Tensor xc = x.contiguous();
  mili_avx2::pack_row_groups(xc.data_ptr<at::BFloat16>(), M, K, packed_x.data());
  auto y = torch::empty({M, N}, x.options());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    std::vector<float> panels(kBlockRows * K);
    for (int64_t block = first; block < last; ++block) {
      const int64_t n_begin = block * kBlockRows, n_end = std::min(N, n_begin + kBlockRows);
      for (int64_t n0 = n_begin; n0 < n_end; n0 += kPanel)
        pack_panel(wp, N, K, n0, panels.data() + (n0 - n_begin) * K);
      for (int64_t g = 0; g < groups; ++g) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - g * kTileRows));
        for (int64_t n0 = n_begin; n0 < n_end; n0 += kPanel)
          tile(packed_x.data() + g * K * kTileRows, panels.data() + (n0 - n_begin) * K, K,
               yp + g * kTileRows * N + n0, N, rows, std::min(kPanel, n_end - n0));
      }
    }
  });
  return y;
}
