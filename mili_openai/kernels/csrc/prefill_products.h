// The two matrix products of prefill attention for one task of paged_prefill_attention.cpp: the scores
// of a block of keys against the task's 64 query rows, and the probability-weighted sum of the block's
// values. Query rows sit across the lanes of four registers (kRowVectors), so both products are
// broadcast multiply-adds: a key's (or value's) element times 64 rows at once.
//
// Fp32Products widens each block's K and V rows to fp32 and uses FMAs: any AVX-512 CPU.
// Bf16DotProducts multiplies bf16 pairs with VDPBF16PS (AVX512-BF16: Zen 4, Sapphire Rapids), two
// products per lane per instruction and no widening: queries and keys pair up along head_dim, and the
// probabilities (rounded to bf16, as torch's flash attention does for bf16 inputs) pair with values
// along the keys: markedly faster than fp32 products where the CPU has them.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "simd_bf16.h"

namespace mili {

constexpr int64_t kRowVectors = 4;                    // query rows of a task: 4 registers of 16 lanes
constexpr int64_t kTaskRows = kRowVectors * kLanes;  // 64 = (query heads of a group) x positions
constexpr int64_t kKeyBlock = 64;                    // keys per block (fp32 K and V blocks: 32 KB each at D=128)
constexpr int64_t kKeysPerPass = 4;                  // score accumulators: 4 keys x 4 row vectors
constexpr int64_t kDimsPerPass = 4;                  // output accumulators: 4 dims x 4 row vectors

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// One task's query rows: row r of the 64 reads `rows[r]` (head_dim values).
template <typename T>
struct QueryRows {
  const T* rows[kTaskRows];
};

// The running output of dims [d, d + kDimsPerPass) for a task's row vectors (out_t is dim-major: each
// dim holds kRowVectors vectors of 16 rows), in the registers `accumulate` adds into.
using OutBlock = __m512[kDimsPerPass][kRowVectors];
inline void load_out_block(const float* out_t, int64_t d, OutBlock& acc) {
  for (int64_t u = 0; u < kDimsPerPass; ++u)
    for (int64_t v = 0; v < kRowVectors; ++v) acc[u][v] = _mm512_loadu_ps(out_t + ((d + u) * kRowVectors + v) * kLanes);
}
inline void store_out_block(float* out_t, int64_t d, const OutBlock& acc) {
  for (int64_t u = 0; u < kDimsPerPass; ++u)
    for (int64_t v = 0; v < kRowVectors; ++v) _mm512_storeu_ps(out_t + ((d + u) * kRowVectors + v) * kLanes, acc[u][v]);
}

template <typename T>
class Fp32Products {
 public:
  explicit Fp32Products(int64_t head_dim)
      : D_(head_dim), q_t_(head_dim * kTaskRows), keys_(kKeyBlock * head_dim), values_(kKeyBlock * head_dim) {}

  // q_t[d] (4 row vectors) = the rows' element d, pre-scaled
  void load_queries(const QueryRows<T>& q, float scale) {
    for (int64_t r = 0; r < kTaskRows; ++r)
      for (int64_t d = 0; d < D_; ++d) q_t_[d * kTaskRows + r] = to_float(q.rows[r][d]) * scale;
  }

  // the block's `count` K and V rows (slot rows `row_stride` apart, `offset` in), widened
  void load_block(const T* k_pool, const T* v_pool, const int64_t* slots, int64_t count, int64_t row_stride,
                  int64_t offset) {
    widen(k_pool, slots, count, row_stride, offset, keys_.data());
    widen(v_pool, slots, count, row_stride, offset, values_.data());
  }

  // scores[j * 4 + v] = sum_d q_t[d] * k[j, d], for the block's keys
  void score(int64_t keys, __m512* scores) const {
    const float* q_t = q_t_.data();
    const float* k = keys_.data();
    int64_t j = 0;
    for (; j + kKeysPerPass <= keys; j += kKeysPerPass) {
      __m512 acc[kKeysPerPass][kRowVectors];
      for (auto& key : acc)
        for (auto& v : key) v = _mm512_setzero_ps();
      for (int64_t d = 0; d < D_; ++d) {
        __m512 qv[kRowVectors];
        for (int64_t v = 0; v < kRowVectors; ++v) qv[v] = _mm512_loadu_ps(q_t + (d * kRowVectors + v) * kLanes);
        for (int64_t u = 0; u < kKeysPerPass; ++u) {
          const __m512 kv = _mm512_set1_ps(k[(j + u) * D_ + d]);
          for (int64_t v = 0; v < kRowVectors; ++v) acc[u][v] = _mm512_fmadd_ps(qv[v], kv, acc[u][v]);
        }
      }
      for (int64_t u = 0; u < kKeysPerPass; ++u)
        for (int64_t v = 0; v < kRowVectors; ++v) scores[(j + u) * kRowVectors + v] = acc[u][v];
    }
    for (; j < keys; ++j) {
      __m512 acc[kRowVectors];
      for (auto& v : acc) v = _mm512_setzero_ps();
      for (int64_t d = 0; d < D_; ++d) {
        const __m512 kv = _mm512_set1_ps(k[j * D_ + d]);
        for (int64_t v = 0; v < kRowVectors; ++v)
          acc[v] = _mm512_fmadd_ps(_mm512_loadu_ps(q_t + (d * kRowVectors + v) * kLanes), kv, acc[v]);
      }
      for (int64_t v = 0; v < kRowVectors; ++v) scores[j * kRowVectors + v] = acc[v];
    }
  }

  // out_t[d] (4 row vectors) += sum_j probs[j] * v[j, d]
  void accumulate(const __m512* probs, int64_t keys, float* out_t) const {
    const float* values = values_.data();
    for (int64_t d = 0; d < D_; d += kDimsPerPass) {
      OutBlock acc;
      load_out_block(out_t, d, acc);
      for (int64_t j = 0; j < keys; ++j) {
        for (int64_t u = 0; u < kDimsPerPass; ++u) {
          const __m512 vv = _mm512_set1_ps(values[j * D_ + d + u]);
          for (int64_t v = 0; v < kRowVectors; ++v)
            acc[u][v] = _mm512_fmadd_ps(probs[j * kRowVectors + v], vv, acc[u][v]);
        }
      }
      store_out_block(out_t, d, acc);
    }
  }

 private:
  void widen(const T* pool, const int64_t* slots, int64_t count, int64_t row_stride, int64_t offset, float* dst) const {
    for (int64_t j = 0; j < count; ++j) {
      const T* src = pool + slots[j] * row_stride + offset;
      float* out = dst + j * D_;
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        for (int64_t d = 0; d < D_; d += kLanes) _mm512_storeu_ps(out + d, widen_bf16(src + d));
      } else {
        std::copy(src, src + D_, out);
      }
    }
  }

  int64_t D_;
  std::vector<float> q_t_, keys_, values_;
};

#define MILI_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), noinline))

// bf16 x bf16 products for bf16 inputs. Its methods are compiled for AVX512-BF16 alone and never inlined
// into code for plain AVX-512; call them only where `cpu_has_bf16_dot_products()`.
class Bf16DotProducts {
 public:
  explicit Bf16DotProducts(int64_t head_dim)
      : D_(head_dim), q_pairs_(head_dim / 2 * kTaskRows), value_pairs_(kKeyBlock / 2 * head_dim) {}

  // q_pairs[i] (4 row vectors of 32-bit lanes) = the rows' elements (2i, 2i + 1); the scale goes on the
  // scores, since scaling bf16 queries would round them again
  void load_queries(const QueryRows<at::BFloat16>& q, float scale) {
    scale_ = scale;
    for (int64_t r = 0; r < kTaskRows; ++r)
      for (int64_t i = 0; i < D_ / 2; ++i)
        std::memcpy(&q_pairs_[i * kTaskRows + r], q.rows[r] + 2 * i, sizeof(uint32_t));
  }

  // K rows are read in place (`score` broadcasts a pair of each); V rows pair up along the keys:
  // value_pairs[j / 2][d] = (v[j, d], v[j + 1, d]), the last odd key paired with a zero
  MILI_BF16_DOT void load_block(const at::BFloat16* k_pool, const at::BFloat16* v_pool, const int64_t* slots,
                                int64_t count, int64_t row_stride, int64_t offset) {
    for (int64_t j = 0; j < count; ++j)
      key_rows_[j] = reinterpret_cast<const uint16_t*>(k_pool + slots[j] * row_stride + offset);
    for (int64_t j = 0; j < count; j += 2) {
      const auto* even = reinterpret_cast<const __m256i*>(v_pool + slots[j] * row_stride + offset);
      const auto* odd =
          j + 1 < count ? reinterpret_cast<const __m256i*>(v_pool + slots[j + 1] * row_stride + offset) : nullptr;
      uint32_t* out = value_pairs_.data() + j / 2 * D_;
      for (int64_t d = 0; d < D_; d += kLanes) {
        const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(even + d / kLanes));
        const __m512i high = odd ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(odd + d / kLanes)), 16)
                                 : _mm512_setzero_si512();
        _mm512_storeu_si512(out + d, _mm512_or_si512(low, high));
      }
    }
  }

  void score(int64_t keys, __m512* scores) const {
    int64_t j = 0;
    for (; j + kKeysPerPass <= keys; j += kKeysPerPass) score_keys<kKeysPerPass>(j, scores);
    for (; j < keys; ++j) score_keys<1>(j, scores);
  }

  MILI_BF16_DOT void accumulate(const __m512* probs, int64_t keys, float* out_t) const {
    // probability pairs along the keys: lane r of pairs[j / 2][v] = (p[j][r], p[j + 1][r]) in bf16
    __m512i pairs[kKeyBlock / 2][kRowVectors];
    const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t j = 0; j < keys; j += 2)
      for (int64_t v = 0; v < kRowVectors; ++v) {
        const __m512i even = _mm512_castps_si512(round_bf16(probs[j * kRowVectors + v]));
        const __m512i odd = j + 1 < keys ? _mm512_castps_si512(round_bf16(probs[(j + 1) * kRowVectors + v]))
                                         : _mm512_setzero_si512();
        pairs[j / 2][v] = _mm512_or_si512(_mm512_srli_epi32(even, 16), _mm512_and_si512(odd, high_half));
      }
    const int64_t key_pairs = (keys + 1) / 2;
    for (int64_t d = 0; d < D_; d += kDimsPerPass) {
      OutBlock acc;
      load_out_block(out_t, d, acc);
      for (int64_t i = 0; i < key_pairs; ++i) {
        for (int64_t u = 0; u < kDimsPerPass; ++u) {
          const __m512bh vv = (__m512bh)_mm512_set1_epi32(static_cast<int>(value_pairs_[i * D_ + d + u]));
          for (int64_t v = 0; v < kRowVectors; ++v) acc[u][v] = _mm512_dpbf16_ps(acc[u][v], (__m512bh)pairs[i][v], vv);
        }
      }
      store_out_block(out_t, d, acc);
    }
  }

 private:
  // scores[(j + u) * 4 + v] for N keys from j: sum over pairs i of q_pairs[i] . (k[j + u, 2i], k[j + u, 2i + 1])
  template <int N>
  MILI_BF16_DOT void score_keys(int64_t j, __m512* scores) const {
    const uint32_t* q = q_pairs_.data();
    __m512 acc[N][kRowVectors];
    for (auto& key : acc)
      for (auto& v : key) v = _mm512_setzero_ps();
    for (int64_t i = 0; i < D_ / 2; ++i) {
      __m512i qv[kRowVectors];
      for (int64_t v = 0; v < kRowVectors; ++v) qv[v] = _mm512_loadu_si512(q + (i * kRowVectors + v) * kLanes);
      for (int u = 0; u < N; ++u) {
        uint32_t pair;
        std::memcpy(&pair, key_rows_[j + u] + 2 * i, sizeof(pair));
        const __m512bh kv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int64_t v = 0; v < kRowVectors; ++v) acc[u][v] = _mm512_dpbf16_ps(acc[u][v], (__m512bh)qv[v], kv);
      }
    }
    const __m512 scale = _mm512_set1_ps(scale_);
    for (int u = 0; u < N; ++u)
      for (int64_t v = 0; v < kRowVectors; ++v) scores[(j + u) * kRowVectors + v] = _mm512_mul_ps(acc[u][v], scale);
  }

  int64_t D_;
  float scale_ = 1.f;
  std::vector<uint32_t> q_pairs_, value_pairs_;
  const uint16_t* key_rows_[kKeyBlock] = {};
};

#undef MILI_BF16_DOT

// Whether this CPU runs VDPBF16PS (checked at run time: the kernels are built for plain AVX-512).
inline bool cpu_has_bf16_dot_products() { return __builtin_cpu_supports("avx512bf16"); }

}  // namespace mili
