// bf16 matmul for AVX512 CPUs: y = x @ w.T with bf16 weights, fp32 accumulation, bf16 output.
//
// Needs only AVX512F: a bf16 value is the high half of an fp32, so 16 weights widen to fp32 with a
// zero-extend and a shift, and the products are plain fp32 FMAs. Many CPUs (and most cloud VMs, which
// hide the BF16 extension) run oneDNN's bf16 GEMM far below memory speed at decode shapes.
//
// Threads take blocks of contiguous weight rows and stream each once per block of x rows: a tile of R
// weight rows is widened from L1 for every chunk of up to 8 x rows, so a decode step reads every weight
// byte from memory exactly once, whatever the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <type_traits>

#include "kernels.h"
#include "row_ranges.h"
#include "simd_bf16.h"

namespace {

using mili::kLanes;
using mili::widen_bf16;
constexpr int kMaxChunkRows = 8;    // x rows sharing one widened weight tile (registers: 8 x 3 accumulators)
constexpr int64_t kRowsPerPass = 24;      // weight rows reused by every chunk of x rows before moving on
constexpr int64_t kOwnerBlockRows = 2 * kRowsPerPass;  // rows a thread claims at a time from its own range
constexpr int64_t kXBlockBytes = 256 * 1024;  // x rows per outer block are sized to stay in L2

// Weight rows in flight per x chunk, and independent partial sums along K per (row, weight row): with
// 4-cycle FMA latency and two FMA ports a core needs ~8 independent accumulators to stay busy, within
// 32 registers (MC * R * U accumulators + R weights + 1 x). From ~4 rows of x on a core is FMA-bound, so
// eight rows go as one chunk of three weight rows (24 accumulators) rather than 6 + 2, which re-widened
// every weight for two rows.
// A single row of x (a decode step at batch 1, and every LM head, where the CPU lacks the pair products
// below) is bound by memory, not FMAs: it reads the weights as one sequential stream, a row at a time
// with eight partial sums along K, which the hardware prefetchers follow as they follow a plain `sum`
// (faster than interleaved rows: docs/performance.md has the machine's read limits).
template <int MC> constexpr int tile_rows() { return MC == 1 ? 1 : MC <= 6 ? 4 : 3; }
template <int MC> constexpr int k_unroll() { return MC == 1 ? 8 : 1; }

// The hardware prefetcher loses track of R interleaved row streams: while a tile is multiplied, ask for
// the same K offset of the next tile's rows into L1, and of the two tiles after it into L2, which tracks
// more misses (one cache line per row per 32 bf16). Both prefetches raise the multi-row read rate a lot,
// the two further tiles most on CPUs with fast memory.
constexpr int64_t kPrefetchStride = 32;  // bf16 per 64-byte line
template <int R>
inline void prefetch_tiles_ahead(const at::BFloat16* w, int64_t K, int64_t k) {
  for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * K + k), _MM_HINT_T0);
  for (int r = 2 * R; r < 4 * R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k), _MM_HINT_T1);
}

// The chunks of x rows after the first read a block of weight rows from L1/L2 and would leave memory idle
// meanwhile: the second asks for the next block's rows (kRowsPerPass on) into L2, one line per row per
// step, so the weights keep streaming while it multiplies.
template <int R>
inline void prefetch_next_pass(const at::BFloat16* w, int64_t K, int64_t k) {
  for (int r = 0; r < R; ++r)
    _mm_prefetch(reinterpret_cast<const char*>(w + (kRowsPerPass + r) * K + k), _MM_HINT_T1);
}

// What a tile asks for ahead while it multiplies (see multiply_chunk).
enum class Ahead { kNothing, kTiles, kNextPass };

// The single-row stream also asks, once per 256 bytes it reads, for the lines 8 and 16 KB ahead into L2:
// a nudge that keeps the prefetchers ahead (the distances and the L2 target were the fastest tried;
// into L1 was slower than no prefetch at all).
constexpr int64_t kStreamAheadBytes[] = {8192, 16384};
inline void prefetch_stream(const at::BFloat16* w) {
  for (const int64_t ahead : kStreamAheadBytes) _mm_prefetch(reinterpret_cast<const char*>(w) + ahead, _MM_HINT_T1);
}

// A tile's partial sums: U along K for each (x row m, weight row r), all zero to start.
template <int U, int MC, int R>
inline void zero_sums(__m512 (&acc)[U][MC][R]) {
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MC; ++m)
      for (int r = 0; r < R; ++r) acc[u][m][r] = _mm512_setzero_ps();
}

// y[m, r] = bf16(sum over u and lanes of acc[u][m][r]), y rows ldy apart.
template <int U, int MC, int R>
inline void store_sums(const __m512 (&acc)[U][MC][R], at::BFloat16* y, int64_t ldy) {
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) {
      __m512 sum = acc[0][m][r];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[u][m][r]);
      y[m * ldy + r] = at::BFloat16(_mm512_reduce_add_ps(sum));
    }
}

// y[m, n + r] for m < MC, r < R: x is fp32 (rows ldx apart), w bf16 rows K apart. Asks for the
// weights ahead as kAhead says (see multiply_chunk).
template <int MC, int R, Ahead kAhead>
inline void tile(const float* x, int64_t ldx, const at::BFloat16* w, int64_t K, at::BFloat16* y, int64_t ldy) {
  constexpr int U = k_unroll<MC>();
  __m512 acc[U][MC][R];
  zero_sums(acc);
  int64_t k = 0;
  for (; k + U * kLanes <= K; k += U * kLanes) {
    if constexpr (MC == 1)
      prefetch_stream(w + k);  // one line per 256 bytes (U = 8)
    else if (kAhead == Ahead::kTiles && k % kPrefetchStride == 0)
      prefetch_tiles_ahead<R>(w, K, k);
    else if (kAhead == Ahead::kNextPass && k % kPrefetchStride == 0)
      prefetch_next_pass<R>(w, K, k);
    for (int u = 0; u < U; ++u) {
      __m512 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = widen_bf16(w + r * K + k + u * kLanes);
      for (int m = 0; m < MC; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * ldx + k + u * kLanes);
        for (int r = 0; r < R; ++r) acc[u][m][r] = _mm512_fmadd_ps(xv, wv[r], acc[u][m][r]);
      }
    }
  }
  for (; k < K; k += kLanes) {  // K is a multiple of 16, not always of 16 * U
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = widen_bf16(w + r * K + k);
    for (int m = 0; m < MC; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[0][m][r] = _mm512_fmadd_ps(xv, wv[r], acc[0][m][r]);
    }
  }
  store_sums(acc, y, ldy);
}

// The same tile with bf16 pair products (VDPBF16PS, AVX512-BF16): x stays bf16 and each instruction
// multiplies 32 weights by 32 inputs, summing pairs into 16 fp32 lanes, where the fp32 tile widens every
// weight and needs two FMAs. From ~4 rows of x the fp32 tile is bound by its FMAs, so this one reads the
// weights up to twice as fast there. Partial sums along K run in
// another order, so results differ from the fp32 tile's in rounding only.
#define MILI_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
constexpr int64_t kPairLanes = 2 * kLanes;  // bf16 values per 512-bit register

// 32 bf16 from p; kHalf: the 16 at p, then zeros (the tail of a K that is an odd multiple of 16)
template <bool kHalf>
MILI_BF16_DOT inline __m512i load_pairs(const at::BFloat16* p) {
  if constexpr (kHalf) return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_loadu_si512(p);
}

// Where a chunk of x rows keeps its values for one step of 32 along K: row-major (a row's steps 32 apart,
// rows K apart), or packed by pack_pair_chunks (a step's rows side by side), so that the chunk's reads are
// one sequential stream, which the L1 prefetcher follows from L2 once x outgrows L1 (16 rows at K 2048;
// rows K apart fall in the same few L1 sets and each is a stream of its own).
struct PairRows {
  const at::BFloat16* x;
  int64_t row_stride;
  int64_t step_stride;
  const at::BFloat16* step(int64_t k) const { return x + k / kPairLanes * step_stride; }
};

template <int MC, int R, bool kHalf>
MILI_BF16_DOT inline void dot_step(const at::BFloat16* xk, int64_t ldx, const at::BFloat16* w, int64_t K, int64_t k,
                                   __m512 (&acc)[MC][R]) {
  __m512i wv[R];
  for (int r = 0; r < R; ++r) wv[r] = load_pairs<kHalf>(w + r * K + k);
  for (int m = 0; m < MC; ++m) {
    const __m512bh xv = (__m512bh)load_pairs<kHalf>(xk + m * ldx);
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, (__m512bh)wv[r]);
  }
}

// Two rows of x read the weights fastest as one stream, a row at a time; from three, tiles of R weight rows
// share each load of x (each split was the faster of the two for its row count). Every tile sums a (row,
// weight row) pair in one chain along K, in the same order, whatever its MC and R: a row of x gets the same
// bits alone as beside up to max_kernel_rows others (batch invariance), so a row verifying a draft computes
// what the plain decode of that token computes and greedy bf16 output does not depend on speculation. (Two
// partial sums for one or two rows, as before, read ~the same speed: the stream is bound by memory.)
constexpr int kMaxPlainRows = 2;
template <int MC> constexpr int dot_tile_rows() { return MC <= kMaxPlainRows ? 1 : MC <= 6 ? 4 : 3; }

template <int MC, int R, Ahead kAhead>
MILI_BF16_DOT inline void dot_tile(const PairRows& x, const at::BFloat16* w, int64_t K, at::BFloat16* y,
                                   int64_t ldy) {
  __m512 acc[1][MC][R];  // one chain per (row, weight row): see dot_tile_rows
  zero_sums(acc);
  int64_t k = 0;
  for (; k + kPairLanes <= K; k += kPairLanes) {
    if constexpr (R == 1) {
      if (k % (2 * kPairLanes) == 0) prefetch_stream(w + k);  // once per 128 bytes, as with two sums
    } else if constexpr (kAhead == Ahead::kTiles) {
      prefetch_tiles_ahead<R>(w, K, k);  // one line per row per 32 values, as in the fp32 tile
    } else if constexpr (kAhead == Ahead::kNextPass) {
      prefetch_next_pass<R>(w, K, k);
    }
    dot_step<MC, R, false>(x.step(k), x.row_stride, w, K, k, acc[0]);
  }
  if (k < K) dot_step<MC, R, true>(x.step(k), x.row_stride, w, K, k, acc[0]);  // K: a multiple of 16, not always 32
  store_sums(acc, y, ldy);
}

// Weight rows [n_begin, n_end) against x rows [0, rows): tiles of R weight rows, each reused for every
// chunk of MC x rows while it sits in L1.
template <int MC, Ahead kAhead>
void rows_chunk(const float* x, int64_t ldx, const at::BFloat16* w, int64_t K, at::BFloat16* y, int64_t ldy,
                int64_t n_begin, int64_t n_end) {
  constexpr int R = tile_rows<MC>();
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) tile<MC, R, kAhead>(x, ldx, w + n * K, K, y + n, ldy);
  for (; n < n_end; ++n) tile<MC, 1, kAhead>(x, ldx, w + n * K, K, y + n, ldy);
}

template <int MC, Ahead kAhead>
MILI_BF16_DOT void dot_rows_chunk(const PairRows& x, const at::BFloat16* w, int64_t K, at::BFloat16* y, int64_t ldy,
                                  int64_t n_begin, int64_t n_end) {
  constexpr int R = dot_tile_rows<MC>();
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) dot_tile<MC, R, kAhead>(x, w + n * K, K, y + n, ldy);
  for (; n < n_end; ++n) dot_tile<MC, 1, kAhead>(x, w + n * K, K, y + n, ldy);
}

// Only the first chunk of x rows over a block of weight rows asks for its tiles ahead: the chunks after
// it find the block in L1/L2, where the tile prefetches (nine an iteration at eight rows) only take load
// slots from the products (which makes batches of more than 8 rows faster; one chunk is unchanged). The
// second asks for the next block instead, a line per row per step (prefetch_next_pass).
template <int MC, Ahead kAhead>
MILI_BF16_DOT void multiply_chunk_as(bool pairs, const PairRows& xb, const float* xf, int64_t K, const at::BFloat16* w,
                                     at::BFloat16* y, int64_t ldy, int64_t n_begin, int64_t n_end) {
  if (pairs)
    dot_rows_chunk<MC, kAhead>(xb, w, K, y, ldy, n_begin, n_end);
  else
    rows_chunk<MC, kAhead>(xf, K, w, K, y, ldy, n_begin, n_end);
}

template <int MC>
MILI_BF16_DOT void multiply_chunk(int64_t chunk_index, bool pairs, const PairRows& xb, const float* xf, int64_t K,
                                  const at::BFloat16* w, at::BFloat16* y, int64_t ldy, int64_t n_begin,
                                  int64_t n_end) {
  if (chunk_index == 0)
    multiply_chunk_as<MC, Ahead::kTiles>(pairs, xb, xf, K, w, y, ldy, n_begin, n_end);
  else if (chunk_index == 1)
    multiply_chunk_as<MC, Ahead::kNextPass>(pairs, xb, xf, K, w, y, ldy, n_begin, n_end);
  else
    multiply_chunk_as<MC, Ahead::kNothing>(pairs, xb, xf, K, w, y, ldy, n_begin, n_end);
}

// f(std::integral_constant<int, MC>{}) with MC = rows (1 to 8, more counting as 8): a chunk's height as
// the compile-time constant the tiles are built for.
template <typename F>
inline void with_chunk_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, kMaxChunkRows>{}); break;
  }
}
#undef MILI_BF16_DOT

// bf16 values per row of x packed for the pair products: K rounded up to a whole step
int64_t packed_row_values(int64_t K) { return (K + kPairLanes - 1) / kPairLanes * kPairLanes; }

// x (M rows, K apart) in chunks of kMaxChunkRows rows, each chunk step by step: the chunk at row m starts at
// m * packed_row_values(K), and within it step s holds the chunk's rows' 32 values side by side (zeros past K).
torch::Tensor pack_pair_chunks(const at::BFloat16* x, int64_t M, int64_t K) {
  const int64_t padded = packed_row_values(K);
  auto packed = torch::zeros({M * padded}, torch::dtype(at::kBFloat16));
  at::BFloat16* out = packed.data_ptr<at::BFloat16>();
  for (int64_t m0 = 0; m0 < M; m0 += kMaxChunkRows) {
    const int64_t height = std::min<int64_t>(kMaxChunkRows, M - m0);
    for (int64_t m = 0; m < height; ++m)
      for (int64_t k = 0; k < K; k += kPairLanes)
        std::copy_n(x + (m0 + m) * K + k, std::min(kPairLanes, K - k),
                    out + m0 * padded + k * height + m * kPairLanes);
  }
  return packed;
}

// The rows of chunk m0 (of up to kMaxChunkRows rows) in x, packed by pack_pair_chunks or row-major.
PairRows pair_rows(const at::BFloat16* x, bool packed, int64_t M, int64_t K, int64_t m0) {
  if (!packed) return {x + m0 * K, K, kPairLanes};
  const int64_t height = std::min<int64_t>(kMaxChunkRows, M - m0);
  return {x + m0 * packed_row_values(K), kPairLanes, height * kPairLanes};
}

void multiply_rows(const at::BFloat16* xb, bool packed, const float* xf, int64_t M, int64_t K,
                   const at::BFloat16* w, at::BFloat16* y, int64_t ldy, int64_t n_begin, int64_t n_end) {
  const bool pairs = xb != nullptr;
  for (int64_t n = n_begin; n < n_end; n += kRowsPerPass) {
    const int64_t n_stop = std::min(n_end, n + kRowsPerPass);
    for (int64_t m = 0; m < M; m += kMaxChunkRows) {
      with_chunk_rows(M - m, [&](auto chunk) {
        multiply_chunk<decltype(chunk)::value>(m / kMaxChunkRows, pairs,
                                               pairs ? pair_rows(xb, packed, M, K, m) : PairRows{},
                                               pairs ? nullptr : xf + m * K, K, w, y + m * ldy, ldy, n, n_stop);
      });
    }
  }
}

}  // namespace

void multiply_weight_rows(const at::BFloat16* xb, const float* xf, int64_t M, int64_t K, const at::BFloat16* w,
                          at::BFloat16* y, int64_t ldy, int64_t n_begin, int64_t n_end) {
  multiply_rows(xb, false, xf, M, K, w, y, ldy, n_begin, n_end);
}

void multiply_weight_rows_packing(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w,
                                  at::BFloat16* y, int64_t ldy, int64_t n_begin, int64_t n_end) {
  if (M <= kMaxPlainRows) return multiply_rows(x, false, nullptr, M, K, w, y, ldy, n_begin, n_end);
  const torch::Tensor packed = pack_pair_chunks(x, M, K);
  multiply_rows(packed.data_ptr<at::BFloat16>(), true, nullptr, M, K, w, y, ldy, n_begin, n_end);
}

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, bool bf16_dot_products, bool amx_tiles) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16: bf16 inputs only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_bf16: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_bf16: x (M, K) and w (N, K)");
  TORCH_CHECK(w.is_contiguous(), "linear_bf16: contiguous weight only");
  TORCH_CHECK(!bf16_dot_products || cpu_has_bf16_dot_products(), "linear_bf16: this CPU has no AVX512-BF16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % kLanes == 0, "linear_bf16: K must be a multiple of 16");
  TORCH_CHECK(N < (int64_t{1} << 31), "linear_bf16: at most 2^31 weight rows");  // RowRanges packs two in 64 bits
  if (amx_tiles && amx_linear_fits(M, N, K)) return linear_amx(x, w);  // see linear_amx.cpp
  // Pair products for one row of x too, though it is bound by memory: they issue about a third of the fp32
  // tile's instructions per weight byte, which keeps the core's loads ahead when memory is fast.
  const bool pairs = bf16_dot_products;
  // Widen x once (M * K values) rather than once per weight tile; pair products take it as it is.
  const torch::Tensor xs = pairs ? x.contiguous() : x.to(at::kFloat).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xf = pairs ? nullptr : xs.data_ptr<float>();
  // Tiles of several rows read x packed (PairRows); one or two rows stream it as it is.
  const bool packed = pairs && M > kMaxPlainRows;
  const torch::Tensor xp = packed ? pack_pair_chunks(xs.data_ptr<at::BFloat16>(), M, K) : xs;
  const at::BFloat16* xb = pairs ? xp.data_ptr<at::BFloat16>() : nullptr;
  const int64_t ldxb = packed ? packed_row_values(K) : K;  // offset of x row m (a multiple of a chunk) in xb
  const auto* wp = w.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  // Rows of x per pass over the weights: as many as stay in L2 beside the weight tiles. Small batches
  // take one pass; long prompts re-read the weights once per block.
  const int64_t block = std::max<int64_t>(kMaxChunkRows, (kXBlockBytes / (K * 4)) / kMaxChunkRows * kMaxChunkRows);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m_end = std::min(M, m0 + block);
    // Each thread streams its own contiguous range of weight rows and then takes from the back of the
    // others' (row_ranges.h): on a shared machine a thread that loses its core for a while no longer
    // holds up the whole step; and it is no slower than a shared counter handing out ever smaller chunks.
    const int64_t threads = at::get_num_threads();
    mili::RowRanges ranges(N, threads, kRowsPerPass);
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
      const auto multiply = [&](int64_t n_begin, int64_t n_end) {
        multiply_rows(pairs ? xb + m0 * ldxb : nullptr, packed, pairs ? nullptr : xf + m0 * K, m_end - m0, K, wp,
                      yp + m0 * N, N, n_begin, n_end);
      };
      ranges.work_through(first, last, kOwnerBlockRows, kRowsPerPass, multiply);
    });
  }
  return y;
}
