// fp32 GEMM with the bias and GELU fused, for a vision tower's projections on AVX2 CPUs (where oneDNN has no bf16,
// so the tower computes in fp32): y = activation(x @ w.T + bias) over an image's hundreds of patches.
//
// The weight is packed once, at the first call, into gemm_tile_avx2.h's panels (fp32, 16 rows laid out column
// by column); each call packs x into groups of 6 rows and runs the 6 x 16 tile over each (group, panel) pair for
// the whole of K, then adds the bias, applies the tanh GELU where asked, and writes each output once. Against
// oneDNN's packed linear on a Zen 3: the same speed or ~10% faster, and the GELU layer ~30% faster (oneDNN's
// fused tanh GELU costs a third of its matmul).
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
constexpr int64_t kBlockBytes = 192 * 1024;  // a thread's panels at a time, in L2 while every group passes them

// c[i * ldc + j] = activation(sum over k of a[k * 6 + i] * b[k * 16 + j] + bias[j]), i < rows, j < cols
template <bool kGelu>
void tile(const float* a, const float* b, int64_t depth, const float* bias, float* c, int64_t ldc, int rows,
          int64_t cols) {
  alignas(32) float sums[kTileRows][kPanel];
  mili_avx2::tile_sums(a, b, depth, sums);
  for (int i = 0; i < rows; ++i) {
    for (int64_t half = 0; half < 2; ++half) {
      __m256 v = _mm256_add_ps(_mm256_load_ps(sums[i] + 8 * half), _mm256_loadu_ps(bias + 8 * half));
      if constexpr (kGelu) v = mili_avx2::gelu_tanh(v);
      _mm256_store_ps(sums[i] + 8 * half, v);
    }
    std::copy(sums[i], sums[i] + cols, c + i * ldc);
  }
}

}  // namespace

// w (N, K) fp32 -> (ceil(N / 16), K, 16): panel p's [k, j] = w[16 p + j, k] (rows past N as zeros)
torch::Tensor pack_f32_panels(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "w (N, K) fp32");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto rows = torch::zeros({panels * kPanel, K}, w.options());
  rows.narrow(0, 0, N).copy_(w);
  return rows.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

// activation(x @ w.T + bias): x (M, K) fp32, w as pack_f32_panels packed it, bias (panels * 16) fp32 (zeros past
// N), gelu_tanh: the activation (else none) -> (M, N) fp32
torch::Tensor biased_gemm_f32_avx2(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& bias,
                                   int64_t N, bool gelu_tanh) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x (M, K) fp32");
  TORCH_CHECK(panels.dim() == 3 && panels.size(1) == x.size(1) && panels.size(2) == kPanel && panels.is_contiguous()
              && panels.scalar_type() == at::kFloat, "panels (ceil(N / 16), K, 16) fp32, as pack_f32_panels");
  TORCH_CHECK(N > (panels.size(0) - 1) * kPanel && N <= panels.size(0) * kPanel, "N within the last panel");
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == panels.size(0) * kPanel && bias.is_contiguous()
              && bias.scalar_type() == at::kFloat, "bias padded to whole panels, fp32");
  const int64_t M = x.size(0), K = x.size(1), count = panels.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t groups = (M + kTileRows - 1) / kTileRows;
  std::vector<float> packed_x(groups * K * kTileRows);
  const torch::Tensor xc = x.contiguous();
  mili_avx2::pack_row_groups(xc.data_ptr<float>(), M, K, packed_x.data());
  float* yp = y.data_ptr<float>();
  const float *pp = panels.data_ptr<float>(), *bp = bias.data_ptr<float>();
  const int64_t per_block = std::max<int64_t>(1, kBlockBytes / (K * kPanel * static_cast<int64_t>(sizeof(float))));
  const int64_t blocks = (count + per_block - 1) / per_block;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block) {
      const int64_t p_end = std::min(count, (block + 1) * per_block);
      for (int64_t g = 0; g < groups; ++g) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - g * kTileRows));
        for (int64_t p = block * per_block; p < p_end; ++p) {
          const float* a = packed_x.data() + g * K * kTileRows;
          float* c = yp + g * kTileRows * N + p * kPanel;
          const int64_t cols = std::min(kPanel, N - p * kPanel);
          if (gelu_tanh) tile<true>(a, pp + p * K * kPanel, K, bp + p * kPanel, c, N, rows, cols);
          else tile<false>(a, pp + p * K * kPanel, K, bp + p * kPanel, c, N, rows, cols);
        }
      }
    }
  });
  return y;
}
