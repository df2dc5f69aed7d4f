// bf16 matmul for CPUs with AVX2 and FMA but no AVX-512 (Zen 2/3, older Xeons, many cloud VMs): y = x @ w.T
// with bf16 weights, fp32 accumulation, bf16 output, for the few rows of x of a decode step.
//
// torch's own bf16 GEMM on such a CPU multiplies at a few GFLOP/s (it converts element by element), and
// oneDNN has no bf16 path there. A bf16 value is the high half of an fp32, so one 256-bit load of 16 weights
// gives two fp32 vectors with a shift (the even elements) and a mask (the odd ones): two bitwise ops, which
// any vector port runs, rather than two zero-extends on the shuffle port the FMAs share. x is widened once
// per call into the same order (each 16-element block's even elements, then its odd ones), so the products
// pair up as they are.
//
// Threads take blocks of kBlockRows weight rows. A tile holds MC x rows by R weight rows: MC * R accumulators
// (8: both FMA pipes busy through the FMA's latency), 2 R widened weights and one x vector, within AVX2's 16
// registers; every chunk of up to kChunkRows x rows multiplies the tile's rows while they are in L1, so the
// weights stream from memory once per call. The hardware prefetchers lose track of the interleaved row
// streams: each tile asks for the next tile's rows into L1 and the two after into L2 as it goes.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

#include "vectors_avx2.h"

namespace {

using mili_avx2::horizontal_sum;

constexpr int64_t kLanes = 8;         // fp32 per AVX2 register
constexpr int64_t kStep = 2 * kLanes;  // weights per 256-bit load: K must be a multiple
constexpr int kChunkRows = 4;         // x rows per tile
constexpr int64_t kTileRows = 4;      // weight rows every chunk of x rows multiplies before the next ones
constexpr int64_t kBlockRows = 16;    // weight rows a thread takes at a time
constexpr int64_t kLineWeights = 32;  // bf16 per 64-byte cache line: one prefetch per row per line

// 16 bf16 at p -> fp32 even (elements 0, 2, .., 14) and odd (1, 3, .., 15)
inline void widen_pairs(const at::BFloat16* p, __m256& even, __m256& odd) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The compiler would fold an x load into each of the R FMAs that use it (R loads, not one): keep it loaded.
inline __m256 load_once(const float* p) {
  __m256 v = _mm256_loadu_ps(p);
  asm("" : "+x"(v));
  return v;
}

// y[m * ldy + r] for m < MC, r < R: x fp32 rows K apart (in pair order), w bf16 rows K apart. S = 2 gives the
// even and odd products accumulators of their own, where MC * R alone is too few chains to hide the latency.
template <int MC, int R, int S>
inline void tile(const float* x, const at::BFloat16* w, int64_t K, at::BFloat16* y, int64_t ldy) {
  __m256 acc[S][MC][R];
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < MC; ++m)
      for (int r = 0; r < R; ++r) acc[s][m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kStep) {
    if (k % kLineWeights == 0) {
      for (int r = R; r < 2 * R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k), _MM_HINT_T0);
      for (int r = 2 * R; r < 4 * R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k), _MM_HINT_T1);
    }
    __m256 even[R], odd[R];
    for (int r = 0; r < R; ++r) widen_pairs(w + r * K + k, even[r], odd[r]);
    for (int m = 0; m < MC; ++m) {
      const __m256 x_even = load_once(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[0][m][r] = _mm256_fmadd_ps(x_even, even[r], acc[0][m][r]);
      const __m256 x_odd = load_once(x + m * K + k + kLanes);
      for (int r = 0; r < R; ++r) acc[S - 1][m][r] = _mm256_fmadd_ps(x_odd, odd[r], acc[S - 1][m][r]);
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) {
      __m256 sum = acc[0][m][r];
      if constexpr (S == 2) sum = _mm256_add_ps(sum, acc[1][m][r]);
      y[m * ldy + r] = at::BFloat16(horizontal_sum(sum));
    }
}

// MC x rows against weight rows [n0, n1), R at a time, then one at a time.
template <int MC, int R, int S>
void rows_against_weights(const float* x, const at::BFloat16* w, int64_t K, int64_t n0, int64_t n1, at::BFloat16* y,
                          int64_t ldy) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) tile<MC, R, S>(x, w + n * K, K, y + n, ldy);
  for (; n < n1; ++n) tile<MC, 1, 2>(x, w + n * K, K, y + n, ldy);
}

void chunk_against_weights(const float* x, int64_t rows, const at::BFloat16* w, int64_t K, int64_t n0, int64_t n1,
                           at::BFloat16* y, int64_t ldy) {
  switch (rows) {
    case 4: return rows_against_weights<4, 2, 1>(x, w, K, n0, n1, y, ldy);
    case 3: return rows_against_weights<3, 2, 1>(x, w, K, n0, n1, y, ldy);
    case 2: return rows_against_weights<2, 4, 1>(x, w, K, n0, n1, y, ldy);
    default: return rows_against_weights<1, 4, 2>(x, w, K, n0, n1, y, ldy);
  }
}

// x (M, K) bf16 -> fp32, each 16-element block's even elements then its odd ones (widen_pairs' order)
torch::Tensor widen_in_pair_order(const torch::Tensor& x) {
  const torch::Tensor source = x.contiguous();
  auto out = torch::empty(source.sizes(), source.options().dtype(torch::kFloat32));
  const at::BFloat16* src = source.data_ptr<at::BFloat16>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < source.numel(); i += kStep)
    for (int64_t j = 0; j < kLanes; ++j) {
      dst[i + j] = static_cast<float>(src[i + 2 * j]);
      dst[i + kLanes + j] = static_cast<float>(src[i + 2 * j + 1]);
    }
  return out;
}

}  // namespace

torch::Tensor linear_bf16_avx2(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (M, K) and w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 x and w");
  TORCH_CHECK(w.is_contiguous() && x.size(1) % kStep == 0, "contiguous w, K a multiple of 16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const torch::Tensor x32 = widen_in_pair_order(x);  // once, read by every block
  const float* xp = x32.data_ptr<float>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block) {
      const int64_t block_end = std::min(N, (block + 1) * kBlockRows);
      for (int64_t n = block * kBlockRows; n < block_end; n += kTileRows) {
        const int64_t tile_end = std::min(block_end, n + kTileRows);
        for (int64_t m = 0; m < M; m += kChunkRows)
          chunk_against_weights(xp + m * K, std::min<int64_t>(kChunkRows, M - m), wp, K, n, tile_end, yp + m * N, N);
      }
    }
  });
  return y;
}

torch::Tensor gemm_bf16_avx2(const torch::Tensor& x, const torch::Tensor& w);  // gemm_bf16_avx2.cpp
torch::Tensor pack_f32_panels(const torch::Tensor& w);  // gemm_f32_avx2.cpp
torch::Tensor biased_gemm_f32_avx2(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& bias,
                                   int64_t N, bool gelu_tanh);
void bind_linear_attention(pybind11::module& m);  // gated_deltanet_avx2.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("linear_bf16_avx2", &linear_bf16_avx2, "y = x @ w.T for bf16 x (M, K) and w (N, K) on AVX2 + FMA, fp32 "
        "accumulation: a decode step's few rows", release_gil());
  m.def("gemm_bf16_avx2", &gemm_bf16_avx2, "y = x @ w.T for bf16 x (M, K) and w (N, K) on AVX2 + FMA, fp32 "
        "products: prefill's many rows, on panels of widened weights", release_gil());
  m.def("pack_f32_panels", &pack_f32_panels, "fp32 w (N, K) -> (ceil(N / 16), K, 16) panels for "
        "biased_gemm_f32_avx2", release_gil());
  m.def("biased_gemm_f32_avx2", &biased_gemm_f32_avx2, "activation(x @ w.T + bias) for fp32 x (M, K) on packed "
        "panels, the tanh GELU or none", release_gil());
  bind_linear_attention(m);
}
