// The register tile the AVX2 GEMMs share (gemm_bf16_avx2.cpp, gemm_f32_avx2.cpp), as in BLIS: x packed into groups
// of 6 rows laid out column by column, weights into panels of 16 rows laid out the same way (fp32), and a 6 x 16
// tile (12 accumulators, two panel vectors, one broadcast of x) over the whole of K: 12 FMAs per 8 loads. On a
// Zen 3 this runs at ~65% of the FMA peak, as OpenBLAS's SGEMM does there: its loads, not its FMAs, bound it.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace mili_avx2 {

constexpr int kTileRows = 6;    // x rows per register tile
constexpr int64_t kPanel = 16;  // weight rows per panel: two fp32 vectors

// sums[i][j] = sum over k of a[k * 6 + i] * b[k * 16 + j]. Not inlined, and not unrolled: in a caller's loop, or
// unrolled, GCC runs out of the 16 registers and keeps an accumulator in memory, which halves the speed.
[[gnu::noinline]] static void tile_sums(const float* a, const float* b, int64_t depth, float (&sums)[kTileRows][kPanel]) {
  // twelve named accumulators: GCC keeps an __m256 array of them in memory, storing it at every step
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < depth; ++k, a += kTileRows, b += kPanel) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    __m256 ai = _mm256_broadcast_ss(a);
    c00 = _mm256_fmadd_ps(ai, b0, c00), c01 = _mm256_fmadd_ps(ai, b1, c01);
    ai = _mm256_broadcast_ss(a + 1);
    c10 = _mm256_fmadd_ps(ai, b0, c10), c11 = _mm256_fmadd_ps(ai, b1, c11);
    ai = _mm256_broadcast_ss(a + 2);
    c20 = _mm256_fmadd_ps(ai, b0, c20), c21 = _mm256_fmadd_ps(ai, b1, c21);
    ai = _mm256_broadcast_ss(a + 3);
    c30 = _mm256_fmadd_ps(ai, b0, c30), c31 = _mm256_fmadd_ps(ai, b1, c31);
    ai = _mm256_broadcast_ss(a + 4);
    c40 = _mm256_fmadd_ps(ai, b0, c40), c41 = _mm256_fmadd_ps(ai, b1, c41);
    ai = _mm256_broadcast_ss(a + 5);
    c50 = _mm256_fmadd_ps(ai, b0, c50), c51 = _mm256_fmadd_ps(ai, b1, c51);
  }
  const __m256 rows_of_sums[kTileRows][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int i = 0; i < kTileRows; ++i) {
    _mm256_storeu_ps(sums[i], rows_of_sums[i][0]);
    _mm256_storeu_ps(sums[i] + 8, rows_of_sums[i][1]);
  }
}

// x (M, K) in groups of 6 rows, column by column, as fp32: out[(g * K + k) * 6 + i] = x[6 g + i, k]; rows past M
// are zeros. `out` holds ceil(M / 6) * K * 6 floats.
template <typename T>
void pack_row_groups(const T* x, int64_t M, int64_t K, float* out) {
  const int64_t groups = (M + kTileRows - 1) / kTileRows;
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      const int64_t rows = std::min<int64_t>(kTileRows, M - g * kTileRows);
      float* group = out + g * K * kTileRows;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t i = 0; i < kTileRows; ++i)
          group[k * kTileRows + i] = i < rows ? static_cast<float>(x[(g * kTileRows + i) * K + k]) : 0.f;
    }
  });
}

}  // namespace mili_avx2
