// An expert's matmul over many of its tokens (a prefill chunk's) with AVX512-BF16 pair products, for
// moe_experts.cpp.
//
// linear_bf16's tiles multiply a weight row by a token row along K and sum the 16 lanes at the end: at
// an expert's K (768 for the down projection) those sums are a large share of the work, and each tile
// re-reads its token rows. Here a panel of up to 64 weight rows is first packed as pairs along K across
// the lanes (16 weight rows per register: a 16 x 16 transpose of pairs), then every tile of up to 6
// token rows runs through the whole panel: each pair product adds into 16 outputs of one token, with the
// token's pair broadcast, and the accumulators are the outputs themselves. The panel is packed once per
// call and reused by every token of the expert; the transpose costs about as much as the products save
// up to ~30 tokens, so fewer (a decode step's, a short prompt's) keep the streaming tiles.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd_bf16.h"

namespace mili {

#define MILI_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int64_t kPanelGroupRows = 16;  // weight rows per register of a packed panel
constexpr int kMaxPanelGroups = 4;       // groups per panel: 64 weight rows
constexpr int kPanelTileRows = 6;        // token rows per tile: 6 x 4 accumulators, 4 weights and a token pair
// Packing reads 16 rows side by side, more streams than the prefetchers follow: each load asks for its
// row's line this far ahead.
constexpr int64_t kPackAheadBytes = 2048;

// 16 weight rows (K apart, K even) packed as group g of a panel of `groups`: the dword at
// panel[(p * groups + g) * 16 + r] holds w[r][2p, 2p + 1].
inline void pack_group(const at::BFloat16* rows, int64_t K, int g, int groups, uint32_t* panel) {
  const int64_t pairs = K / 2;
  int64_t p = 0;
  for (; p + kLanes <= pairs; p += kLanes) {
    __m512i block[kLanes];  // row i's pairs p .. p + 15, then (transposed) pair p + j of the 16 rows
    for (int i = 0; i < kLanes; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(rows + i * K + 2 * p) + kPackAheadBytes, _MM_HINT_T1);
      block[i] = _mm512_loadu_si512(rows + i * K + 2 * p);
    }
    transpose_dwords(block);
    for (int j = 0; j < kLanes; ++j) _mm512_storeu_si512(panel + ((p + j) * groups + g) * kLanes, block[j]);
  }
  for (; p < pairs; ++p)  // a K that is an odd multiple of 16
    for (int i = 0; i < kLanes; ++i)
      std::memcpy(panel + (p * groups + g) * kLanes + i, rows + i * K + 2 * p, sizeof(uint32_t));
}

// The weights a thread multiplies next (the next unit's rows, in up to two ranges), asked into L2 a line
// per step of a panel's products: packing them then finds them there rather than in memory.
struct LinesAhead {
  const char* next[2] = {nullptr, nullptr};
  const char* end[2] = {nullptr, nullptr};

  void add(int slot, const at::BFloat16* begin, int64_t values) {
    next[slot] = reinterpret_cast<const char*>(begin);
    end[slot] = next[slot] + values * sizeof(at::BFloat16);
  }
  inline void step() {
    for (int r = 0; r < 2; ++r)
      if (next[r] < end[r]) {
        _mm_prefetch(next[r], _MM_HINT_T1);
        next[r] += 64;
        return;
      }
  }
};

// acc[m][v] (lane r) = x[m] . w[16 v + r] for MR token rows (ldx apart) against a packed panel of NV groups.
template <int MR, int NV>
MILI_BF16_DOT inline void panel_products(const at::BFloat16* x, int64_t ldx, const uint32_t* panel, int64_t pairs,
                                         __m512 (&acc)[MR][NV], LinesAhead& ahead) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    ahead.step();
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(panel + (p * NV + v) * kLanes);
    for (int m = 0; m < MR; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xv, w[v]);
    }
  }
}

// The down projection's tile: y[m][16 v + r] = bf16(acc), y rows ldy apart.
template <int MR, int NV>
MILI_BF16_DOT inline void panel_rows(const at::BFloat16* x, int64_t ldx, const uint32_t* panel, int64_t pairs,
                                     at::BFloat16* y, int64_t ldy, LinesAhead& ahead) {
  __m512 acc[MR][NV];
  panel_products<MR, NV>(x, ldx, panel, pairs, acc, ahead);
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) store_bf16(y + m * ldy + v * kLanes, round_bf16(acc[m][v]));
}

// The gate/up projection's tile with SwiGLU applied in registers: the panel's first NV / 2 groups are
// gate rows, the rest the matching up rows; y[m][16 j + r] = bf16(bf16(silu(bf16(gate))) * bf16(up)),
// transformers' rounding points (as silu_mul_row).
template <int MR, int NV>
MILI_BF16_DOT inline void panel_swiglu(const at::BFloat16* x, int64_t ldx, const uint32_t* panel, int64_t pairs,
                                       at::BFloat16* y, int64_t ldy, LinesAhead& ahead) {
  static_assert(NV % 2 == 0, "gate and up groups in pairs");
  __m512 acc[MR][NV];
  panel_products<MR, NV>(x, ldx, panel, pairs, acc, ahead);
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV / 2; ++j) {
      const __m512 activated = round_bf16(silu(round_bf16(acc[m][j])));
      store_bf16(y + m * ldy + j * kLanes, round_bf16(_mm512_mul_ps(activated, round_bf16(acc[m][NV / 2 + j]))));
    }
}

// f(std::integral_constant<int, N>{}) for N = n in [1, kMax].
template <int kMax, typename F>
inline void with_constant(int64_t n, F&& f) {
  if constexpr (kMax > 1) {
    if (n < kMax) return with_constant<kMax - 1>(n, f);
  }
  f(std::integral_constant<int, kMax>{});
}

// Token rows [0, M) (ldx apart) through a packed panel of `groups` groups, `swiglu` or not, in tiles of up
// to kPanelTileRows rows; y rows ldy apart; `ahead` asks for the next weights meanwhile.
MILI_BF16_DOT inline void multiply_panel(const at::BFloat16* x, int64_t ldx, int64_t M, const uint32_t* panel,
                                         int64_t pairs, int groups, bool swiglu, at::BFloat16* y, int64_t ldy,
                                         LinesAhead& ahead) {
  for (int64_t m = 0; m < M; m += kPanelTileRows) {
    const at::BFloat16* xm = x + m * ldx;
    at::BFloat16* ym = y + m * ldy;
    with_constant<kPanelTileRows>(std::min<int64_t>(kPanelTileRows, M - m), [&](auto rows) {
      constexpr int MR = decltype(rows)::value;
      with_constant<kMaxPanelGroups>(groups, [&](auto count) {
        constexpr int NV = decltype(count)::value;
        if constexpr (NV % 2 == 0) {
          if (swiglu) return panel_swiglu<MR, NV>(xm, ldx, panel, pairs, ym, ldy, ahead);
        }
        panel_rows<MR, NV>(xm, ldx, panel, pairs, ym, ldy, ahead);
      });
    });
  }
}

#undef MILI_BF16_DOT

}  // namespace mili
