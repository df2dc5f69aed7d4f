// Register-level pieces of the paged decode attention kernel (paged_decode_attention.cpp): loading a
// head row of K or V as fp32, scoring and weighing a block of 16 slots for a few query heads at once,
// and prefetching the blocks ahead. Only that kernel includes this header.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <type_traits>

#include <torch/extension.h>

#include "simd_bf16.h"

namespace mili::decode {

constexpr int64_t kBlock = kLanes;  // slots scored together: one vector of scores per query head
constexpr int64_t kCacheLine = 64;

inline __m512 load_fp32(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_fp32(const at::BFloat16* p) { return mili::widen_bf16(p); }

// A head row (CH * 16 values) in CH fp32 registers. For bf16 with CH even, each 64-byte load holds 32
// values whose 32-bit lanes pair neighbours: a shift gives the even ones as fp32 and a mask the odd
// ones, two instructions per 32 values where widening in order takes four. The query and the output
// use the same order (`lane_of`), so dot products and weighted sums are unchanged.
template <typename T, int CH>
constexpr bool pairs_lanes() { return std::is_same_v<T, at::BFloat16> && CH % 2 == 0; }

template <typename T, int CH>
inline void load_row(const T* p, __m512* out) {
  if constexpr (pairs_lanes<T, CH>()) {
    const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int i = 0; i < CH / 2; ++i) {
      const __m512i raw = _mm512_loadu_si512(reinterpret_cast<const void*>(p + 2 * kLanes * i));
      out[2 * i] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      out[2 * i + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, high_half));
    }
  } else {
    for (int i = 0; i < CH; ++i) out[i] = load_fp32(p + i * kLanes);
  }
}

// Where element e of a head row sits in load_row's registers, as an index into CH * 16 floats.
template <typename T, int CH>
inline int64_t lane_of(int64_t e) {
  if constexpr (pairs_lanes<T, CH>()) {
    const int64_t block = e / (2 * kLanes), r = e % (2 * kLanes);
    return (2 * block + (r & 1)) * kLanes + (r >> 1);
  } else {
    return e;
  }
}

// Sixteen 16-lane partial sums -> one vector of their sixteen totals, in order: a transpose-and-add tree
// (15 adds, 30 shuffles) in place of sixteen horizontal reductions.
inline __m512 sum_each(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial total of each of four vectors
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);  // float pairs
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 halves[2];
  for (int i = 0; i < 2; ++i)  // sum 128-bit lanes pairwise: (0+1, 2+3) of two vectors
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

// The hardware prefetcher does not follow a walk over pages scattered in the pool, and a core's L1
// tracks too few misses to keep its share of the memory busy. So for each head, while a block is
// scored, ask for that head's part of the next `blocks_ahead` blocks into L2, which tracks more; each
// block is asked for once at every distance, as an L2 prefetch may be dropped while too many misses are
// outstanding. Asking at every distance up to the farthest beats asking once or into L1; the best
// farthest distance differs between CPUs, so it is timed at load (kernels/planning.py) and passed in.
constexpr int64_t kMaxBlocksAhead = 8;

// Into L2: `bytes` from `offset` of the rows of slots [first, end) (elements of T, rows row_stride apart).
template <typename T>
inline void prefetch_rows(const T* pool, const int64_t* slots, int64_t first, int64_t end, int64_t row_stride,
                          int64_t offset, int64_t bytes) {
  for (int64_t j = first; j < end; ++j) {
    const char* p = reinterpret_cast<const char*>(pool + slots[j] * row_stride + offset);
    for (int64_t b = 0; b < bytes; b += kCacheLine) _mm_prefetch(p + b, _MM_HINT_T1);
  }
}

// For blocks 1..blocks_ahead after the one at `slots` (the span has n slots from there): the bytes of
// each slot row that the head at `offset` covers.
template <typename T>
inline void prefetch_ahead(const T* pool, const int64_t* slots, int64_t n, int64_t row_stride, int64_t offset,
                           int64_t head_dim, int64_t blocks_ahead) {
  prefetch_rows(pool, slots, kBlock, std::min(n, (blocks_ahead + 1) * kBlock), row_stride, offset,
                head_dim * static_cast<int64_t>(sizeof(T)));
}

// The rows of a span's first block, every head at once: no block before it in the span asked for them.
template <typename T>
inline void prefetch_first_block(const T* pool, const int64_t* slots, int64_t n, int64_t row_stride) {
  prefetch_rows(pool, slots, 0, std::min(n, kBlock), row_stride, 0, row_stride * static_cast<int64_t>(sizeof(T)));
}

// Query heads go two at a time: two heads' accumulators (2 * CH) and a V row (CH) fit the 32 registers.
constexpr int64_t kHeadsPerPass = 2;

// partial[g][j] = 16 partial products of query head g (G heads from q, D apart) with slot j's K row of
// the head at `offset`; each row is read and widened once for the G heads.
template <typename T, int CH, int G>
inline void score_block(const float* q, const T* k_pool, const int64_t* slots, int64_t m, int64_t row_stride,
                        int64_t offset, __m512 (*partial)[kBlock]) {
  constexpr int64_t D = CH * kLanes;
  for (int64_t j = 0; j < m; ++j) {
    __m512 k[CH];
    load_row<T, CH>(k_pool + slots[j] * row_stride + offset, k);
    for (int g = 0; g < G; ++g) {
      // two accumulators halve the chain of dependent FMAs
      __m512 first = _mm512_mul_ps(k[0], _mm512_load_ps(q + g * D));
      __m512 second = _mm512_setzero_ps();
      for (int i = 1; i < CH; ++i) {
        __m512& a = (i % 2) ? second : first;
        a = _mm512_fmadd_ps(k[i], _mm512_load_ps(q + g * D + i * kLanes), a);
      }
      partial[g][j] = _mm512_add_ps(first, second);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int64_t j = m; j < kBlock; ++j) partial[g][j] = _mm512_setzero_ps();
}

// score_block with bf16 pair products (AVX512-BF16): q stays bf16 in its own order (G heads, D apart),
// and each instruction multiplies 32 values of a K row by 32 of q, summing pairs into 16 fp32 lanes, where
// the fp32 block widens every K value and needs two FMAs. Sums run in another order, so scores differ
// from score_block's in rounding only; the scale is applied to the summed score, not to q.
#define MILI_DECODE_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
template <int CH, int G>
MILI_DECODE_BF16_DOT inline void score_block_pairs(const at::BFloat16* q, const at::BFloat16* k_pool,
                                                   const int64_t* slots, int64_t m, int64_t row_stride,
                                                   int64_t offset, __m512 (*partial)[kBlock]) {
  static_assert(CH % 2 == 0, "a head row of whole 32-value pairs");
  constexpr int P = CH / 2;
  constexpr int64_t D = CH * kLanes;
  for (int64_t j = 0; j < m; ++j) {
    const at::BFloat16* row = k_pool + slots[j] * row_stride + offset;
    __m512i k[P];
    for (int i = 0; i < P; ++i) k[i] = _mm512_loadu_si512(reinterpret_cast<const void*>(row + 2 * kLanes * i));
    for (int g = 0; g < G; ++g) {
      __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};  // two chains of dependent sums
      for (int i = 0; i < P; ++i) {
        const __m512i qv = _mm512_loadu_si512(reinterpret_cast<const void*>(q + g * D + 2 * kLanes * i));
        sums[i % 2] = _mm512_dpbf16_ps(sums[i % 2], (__m512bh)qv, (__m512bh)k[i]);
      }
      partial[g][j] = _mm512_add_ps(sums[0], sums[1]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int64_t j = m; j < kBlock; ++j) partial[g][j] = _mm512_setzero_ps();
}

// acc (G heads, D apart) += p[g][j] * V row of slot j, for the block's m slots; p rows `stride` apart.
template <typename T, int CH, int G>
inline void weigh_block(const float* p, int64_t stride, const T* v_pool, const int64_t* slots, int64_t m,
                        int64_t row_stride, int64_t offset, bool first_block, float* acc) {
  constexpr int64_t D = CH * kLanes;
  __m512 o[G][CH];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < CH; ++i) o[g][i] = first_block ? _mm512_setzero_ps() : _mm512_load_ps(acc + g * D + i * kLanes);
  for (int64_t j = 0; j < m; ++j) {
    __m512 v[CH];
    load_row<T, CH>(v_pool + slots[j] * row_stride + offset, v);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * stride + j]);
      for (int i = 0; i < CH; ++i) o[g][i] = _mm512_fmadd_ps(w, v[i], o[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < CH; ++i) _mm512_store_ps(acc + g * D + i * kLanes, o[g][i]);
}

// n (a multiple of 32) fp32 values -> bf16 in order, two per 32 bits (round to nearest even).
MILI_DECODE_BF16_DOT inline void pack_bf16_pairs(const float* row, int64_t n, uint32_t* pairs) {
  for (int64_t c = 0; c < n; c += 2 * kLanes) {
    const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_load_ps(row + c + kLanes), _mm512_load_ps(row + c));
    _mm512_storeu_si512(reinterpret_cast<void*>(pairs + c / 2), (__m512i)packed);
  }
}

// Where element e of a head row sits in weigh_block_pairs's accumulators: 16-bit unpacks interleave two
// slots' rows per 128-bit lane, four values at a time (low half, then high half of each lane).
inline int64_t pair_lane_of(int64_t e) {
  const int64_t group = e / (2 * kLanes), within = e % (2 * kLanes), lane128 = within / 8, r = within % 8;
  return (2 * group + (r >= 4)) * kLanes + 4 * lane128 + r % 4;
}

// weigh_block with bf16 pair products: acc (G heads, D apart, pair_lane_of order) += p[g][j] * V row of
// slot j, where p holds each head's softmax numerators as bf16 pairs (pack_bf16_pairs; head rows
// `stride` values apart, zero past the span). Each instruction takes two slots: their V rows are
// interleaved value by value, and the pair (p[j], p[j + 1]) is broadcast.
template <int CH, int G>
MILI_DECODE_BF16_DOT inline void weigh_block_pairs(const uint32_t* p, int64_t stride, const at::BFloat16* v_pool,
                                                   const int64_t* slots, int64_t m, int64_t row_stride,
                                                   int64_t offset, bool first_block, float* acc) {
  constexpr int64_t D = CH * kLanes;
  __m512 o[G][CH];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < CH; ++i)
      o[g][i] = first_block ? _mm512_setzero_ps() : _mm512_load_ps(acc + g * D + i * kLanes);
  for (int64_t j = 0; j < m; j += 2) {
    const at::BFloat16* a = v_pool + slots[j] * row_stride + offset;
    const at::BFloat16* b = j + 1 < m ? v_pool + slots[j + 1] * row_stride + offset : nullptr;
    __m512i w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm512_set1_epi32(static_cast<int>(p[g * stride / 2 + j / 2]));
    for (int i = 0; i < CH / 2; ++i) {
      const __m512i va = _mm512_loadu_si512(reinterpret_cast<const void*>(a + 2 * kLanes * i));
      const __m512i vb =
          b ? _mm512_loadu_si512(reinterpret_cast<const void*>(b + 2 * kLanes * i)) : _mm512_setzero_si512();
      const __m512i lo = _mm512_unpacklo_epi16(va, vb), hi = _mm512_unpackhi_epi16(va, vb);
      for (int g = 0; g < G; ++g) {
        o[g][2 * i] = _mm512_dpbf16_ps(o[g][2 * i], (__m512bh)lo, (__m512bh)w[g]);
        o[g][2 * i + 1] = _mm512_dpbf16_ps(o[g][2 * i + 1], (__m512bh)hi, (__m512bh)w[g]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < CH; ++i) _mm512_store_ps(acc + g * D + i * kLanes, o[g][i]);
}

}  // namespace mili::decode
