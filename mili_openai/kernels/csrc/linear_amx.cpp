// bf16 matmul on AMX tiles (Intel Sapphire Rapids and later) for decode batches: y = x @ w.T with up to
// 16 rows of x, fp32 accumulation, bf16 output.
//
// A tile product (TDPBF16PS) multiplies 16 weight rows by 32 values of K for every row of x at once, so
// a few instructions cover what takes the AVX512-BF16 tile dozens, and the loads run ahead of them: it
// streams the weights faster than linear_bf16.cpp's pair products and oneDNN's GEMM at 1 to 16 rows.
//
// Layout: C^T = W . X^T. A tile is 16 rows of W (64 bytes of K each) loaded in place, K * 2 bytes apart;
// B is X^T in the VNNI pairs TDPBF16PS takes (row p: for each x row m, its values 2p and 2p + 1), packed
// once per call; C is 16 weight rows by M fp32 sums. Each step loads one B tile for two A tiles.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "kernels.h"
#include "row_ranges.h"
#include "simd_bf16.h"

namespace {

#define MILI_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))

constexpr int64_t kMaxRows = 16;         // rows of x: the columns of a C tile
constexpr int64_t kTileRows = 16;        // weight rows per A tile and per C tile
constexpr int64_t kTileK = 32;           // bf16 values of K per A row (64 bytes)
constexpr int64_t kBlockRows = 2 * kTileRows;  // weight rows per pass over K: two A tiles share each B tile
// Each pass over K reads 32 weight rows side by side, one line each per step; asking for the lines
// four steps ahead into L1 keeps the stream at memory speed.
constexpr int64_t kPrefetchSteps = 4;
constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // Linux: ask to use the tile registers

// tile registers (the intrinsics take them as literals, hence macros)
#define MILI_SUMS_LOW 0
#define MILI_SUMS_HIGH 1
#define MILI_WEIGHTS_LOW 2
#define MILI_WEIGHTS_HIGH 3
#define MILI_INPUTS 4

MILI_AMX void configure_tiles(int64_t M) {
  mili::TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  for (const int t : {MILI_SUMS_LOW, MILI_SUMS_HIGH, MILI_INPUTS}) config.rows[t] = kTileRows, config.colsb[t] = M * 4;
  for (const int t : {MILI_WEIGHTS_LOW, MILI_WEIGHTS_HIGH}) config.rows[t] = kTileRows, config.colsb[t] = kTileK * 2;
  _tile_loadconfig(&config);
}

// Weight rows [n_begin, n_end), a multiple of 32 apart, against all M rows of x (packed: (K/2, M, 2)).
MILI_AMX void multiply_rows(const at::BFloat16* packed, const at::BFloat16* w, at::BFloat16* y, int64_t M,
                            int64_t N, int64_t K, int64_t n_begin, int64_t n_end) {
  alignas(64) float sums[kBlockRows * kTileRows];
  const __m512i rows_apart =
      _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(M));
  for (int64_t n = n_begin; n < n_end; n += kBlockRows) {
    _tile_zero(MILI_SUMS_LOW);
    _tile_zero(MILI_SUMS_HIGH);
    const at::BFloat16* low = w + n * K;
    const at::BFloat16* high = low + kTileRows * K;
    for (int64_t k = 0; k < K; k += kTileK) {
      // the same K offset further on, or the next block's first lines near the end of K
      const int64_t ahead = k + kPrefetchSteps * kTileK;
      const at::BFloat16* next = ahead < K ? low + ahead : low + kBlockRows * K + (ahead - K);
      if (n + kBlockRows < n_end || ahead < K)
        for (int64_t r = 0; r < kBlockRows; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * K), _MM_HINT_T0);
      _tile_loadd(MILI_INPUTS, packed + k * M, M * 4);
      _tile_loadd(MILI_WEIGHTS_LOW, low + k, K * 2);
      _tile_loadd(MILI_WEIGHTS_HIGH, high + k, K * 2);
      _tile_dpbf16ps(MILI_SUMS_LOW, MILI_WEIGHTS_LOW, MILI_INPUTS);
      _tile_dpbf16ps(MILI_SUMS_HIGH, MILI_WEIGHTS_HIGH, MILI_INPUTS);
    }
    _tile_stored(MILI_SUMS_LOW, sums, M * 4);
    _tile_stored(MILI_SUMS_HIGH, sums + kTileRows * M, M * 4);
    // sums is (weight row, x row): each x row's 16 sums of a tile are M floats apart, gathered into one
    // register, rounded and stored as 16 bf16, not a value at a time.
    for (int64_t m = 0; m < M; ++m)
      for (int64_t half = 0; half < kBlockRows / kTileRows; ++half) {
        const __m512 row = _mm512_i32gather_ps(rows_apart, sums + half * kTileRows * M + m, sizeof(float));
        mili::store_bf16(y + m * N + n + half * kTileRows, mili::round_bf16(row));
      }
  }
}

// One thread's share: its own range from the front, then the others' from the back (row_ranges.h, as
// linear_bf16 shares its rows). Tile state is per thread, so each configures and releases its own.
MILI_AMX void multiply_share(mili::RowRanges& ranges, int64_t first, int64_t last, const at::BFloat16* packed,
                             const at::BFloat16* w, at::BFloat16* y, int64_t M, int64_t N, int64_t K) {
  configure_tiles(M);
  const int64_t threads = ranges.parts();
  int64_t n_begin = 0, n_end = 0;
  for (int64_t part = first; part < last; ++part)
    while (ranges.claim_front(part, 2 * kBlockRows, n_begin, n_end))
      multiply_rows(packed, w, y, M, N, K, n_begin, n_end);
  for (int64_t step = 1; step < threads; ++step) {
    const int64_t part = (first + step) % threads;
    while (ranges.claim_back(part, kBlockRows, n_begin, n_end)) multiply_rows(packed, w, y, M, N, K, n_begin, n_end);
  }
  _tile_release();
}

bool request_tile_permission() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = edx & (1u << 22), amx_tile = edx & (1u << 24);
  return amx_bf16 && amx_tile && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

#undef MILI_AMX
#undef MILI_SUMS_LOW
#undef MILI_SUMS_HIGH
#undef MILI_WEIGHTS_LOW
#undef MILI_WEIGHTS_HIGH
#undef MILI_INPUTS

}  // namespace

bool cpu_has_amx_tiles() {
  static const bool permitted = request_tile_permission();  // once per process
  return permitted;
}

bool amx_linear_fits(int64_t M, int64_t N, int64_t K) {
  return M >= 1 && M <= kMaxRows && K % kTileK == 0 && N % kBlockRows == 0;
}

torch::Tensor linear_amx(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(cpu_has_amx_tiles(), "linear_amx: this CPU has no AMX tiles (or Linux did not grant them)");
  TORCH_CHECK(amx_linear_fits(M, N, K), "linear_amx: 1 to 16 rows, K a multiple of 32, N of 32");
  // X^T in VNNI pairs, (K/2, M, 2): a transpose of 32-bit pairs, looped here because two torch copies
  // (contiguous, transpose, contiguous) a call add up over a decode step's matmuls.
  const torch::Tensor xc = x.contiguous();
  std::vector<uint32_t> packed(M * K / 2);
  const auto* pairs = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
  for (int64_t p = 0; p < K / 2; ++p)
    for (int64_t m = 0; m < M; ++m) packed[p * M + m] = pairs[m * (K / 2) + p];
  auto y = torch::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const at::BFloat16*>(packed.data());
  const auto* wp = w.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  mili::RowRanges ranges(N, at::get_num_threads(), kBlockRows);
  at::parallel_for(0, ranges.parts(), 1, [&](int64_t first, int64_t last) {
    multiply_share(ranges, first, last, xp, wp, yp, M, N, K);
  });
  return y;
}
