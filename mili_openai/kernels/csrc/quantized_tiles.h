// The products shared by the int8 and int4 matmuls (linear_int8.cpp, linear_int4.cpp): a tile of R weight
// rows, decoded to bf16 in registers 32 values at a time, times up to 8 rows of x with bf16 pair products
// (VDPBF16PS), as linear_bf16's tiles multiply bf16 weights. Each decoded register is reused by every row of
// x in the chunk; each x register by every weight row of the tile.
//
// A Decoder gives, for weight row n, a `Row` state (where its bytes are, its group's scale or table) and
//   weights(row, k, u): the bf16 values k + 32u .. k + 32u + 31 of the row (k a multiple of 128, u < 4;
//     visited in order),
//   finish(row, sum): the output from the fp32 sum of products (a per-row scale, or none),
//   address(row, k): where value k's byte is, and kBlockBytes: the bytes of a block of 128 values.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>

namespace mili::quantized {

#define MILI_QUANTIZED __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")))

constexpr int64_t kPairLanes = 32;  // bf16 values per 512-bit register
constexpr int kBlockRegisters = 4;  // registers of values per block: an int4 block's 64 bytes
constexpr int64_t kBlockValues = kBlockRegisters * kPairLanes;
constexpr int kMaxChunkRows = 8;    // rows of x per tile
// A tile streams its weight rows' bytes, and decodes them about as fast as memory delivers them: left to the
// hardware prefetchers, the core waits on line after line, its decoding and the memory taking turns rather
// than overlapping. So a tile asks for every line of each of its rows this far ahead, into L1.
constexpr int64_t kStreamAheadBytes = 4096;
constexpr int64_t kCacheLine = 64;

// Weight rows per tile for MC rows of x: one row streams alone (2 rows of x too, the faster split for bf16
// weights in linear_bf16); more share each load of x among several weight rows, within 32 registers
// (MC * R sums, R decoded weights, R group tables).
template <int MC> constexpr int tile_rows() { return MC <= 2 ? 1 : MC <= 4 ? 4 : 2; }
// Independent sums along K per (x row, weight row): enough chains of pair products in flight
template <int MC> constexpr int tile_unroll() { return MC == 1 ? 4 : MC == 2 ? 2 : 1; }

template <typename Decoder, int MC, int R>
MILI_QUANTIZED inline void tile(const Decoder& d, const at::BFloat16* x, int64_t K, int64_t n, at::BFloat16* y,
                                int64_t ldy) {
  constexpr int U = tile_unroll<MC>();
  static_assert(kBlockRegisters % U == 0, "sums split evenly over a block");
  typename Decoder::Row rows[R];
  for (int r = 0; r < R; ++r) rows[r] = d.row(n + r);
  __m512 acc[U][MC][R];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MC; ++m)
      for (int r = 0; r < R; ++r) acc[u][m][r] = _mm512_setzero_ps();
  // One loop with the body written out: through a lambda GCC stored every updated sum to memory as well.
  for (int64_t k = 0; k < K; k += kBlockValues) {
    for (int r = 0; r < R; ++r)
      for (int64_t line = 0; line < Decoder::kBlockBytes; line += kCacheLine)
        _mm_prefetch(d.address(rows[r], k) + line + kStreamAheadBytes, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int u = 0; u < kBlockRegisters; ++u) {
      if (u > 0 && k + u * kPairLanes >= K) break;  // int8 rows may end inside a block
      __m512i w[R];
      for (int r = 0; r < R; ++r) w[r] = d.weights(rows[r], k, u);
      for (int m = 0; m < MC; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k + u * kPairLanes);
        for (int r = 0; r < R; ++r) acc[u % U][m][r] = _mm512_dpbf16_ps(acc[u % U][m][r], xv, (__m512bh)w[r]);
      }
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) {
      __m512 sum = acc[0][m][r];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[u][m][r]);
      y[m * ldy + r] = at::BFloat16(d.finish(rows[r], _mm512_reduce_add_ps(sum)));
    }
}

// Weight rows [begin, end) against MC rows of x (K apart): tiles of R rows, then single rows.
template <typename Decoder, int MC>
MILI_QUANTIZED void rows_chunk(const Decoder& d, const at::BFloat16* x, int64_t K, int64_t begin, int64_t end,
                               at::BFloat16* y, int64_t ldy) {
  constexpr int R = tile_rows<MC>();
  int64_t n = begin;
  for (; n + R <= end; n += R) tile<Decoder, MC, R>(d, x, K, n, y + (n - begin), ldy);
  for (; n < end; ++n) tile<Decoder, MC, 1>(d, x, K, n, y + (n - begin), ldy);
}

// y[m * ldy + n - begin] for every row m of x (M, K) and weight rows [begin, end): chunks of up to 8 rows of x,
// each over the rows' block (which stays in cache for the chunks after the first).
template <typename Decoder>
void multiply_rows(const Decoder& d, const at::BFloat16* x, int64_t M, int64_t K, int64_t begin, int64_t end,
                   at::BFloat16* y, int64_t ldy) {
  for (int64_t m = 0; m < M; m += kMaxChunkRows) {
    const at::BFloat16* xm = x + m * K;
    at::BFloat16* ym = y + m * ldy;
    switch (std::min<int64_t>(M - m, kMaxChunkRows)) {
      case 1: rows_chunk<Decoder, 1>(d, xm, K, begin, end, ym, ldy); break;
      case 2: rows_chunk<Decoder, 2>(d, xm, K, begin, end, ym, ldy); break;
      case 3: rows_chunk<Decoder, 3>(d, xm, K, begin, end, ym, ldy); break;
      case 4: rows_chunk<Decoder, 4>(d, xm, K, begin, end, ym, ldy); break;
      case 5: rows_chunk<Decoder, 5>(d, xm, K, begin, end, ym, ldy); break;
      case 6: rows_chunk<Decoder, 6>(d, xm, K, begin, end, ym, ldy); break;
      case 7: rows_chunk<Decoder, 7>(d, xm, K, begin, end, ym, ldy); break;
      default: rows_chunk<Decoder, kMaxChunkRows>(d, xm, K, begin, end, ym, ldy); break;
    }
  }
}

// Rows [begin, end) decoded to bf16, K values apart: the weights `multiply_rows` multiplies.
template <typename Decoder>
MILI_QUANTIZED void decode_rows(const Decoder& d, int64_t K, int64_t begin, int64_t end, at::BFloat16* out) {
  for (int64_t n = begin; n < end; ++n) {
    auto row = d.row(n);
    at::BFloat16* o = out + (n - begin) * K;
    for (int64_t k = 0; k < K; k += kBlockValues)
      for (int u = 0; u < kBlockRegisters && k + u * kPairLanes < K; ++u)
        _mm512_storeu_si512(o + k + u * kPairLanes, d.weights(row, k, u));
  }
}

}  // namespace mili::quantized
