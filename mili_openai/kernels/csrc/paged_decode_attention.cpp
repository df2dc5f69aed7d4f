// Decode attention straight from the paged KV pool: one query token per sequence attends to the
// context slots listed for it, without gathering the context into a contiguous copy first.
//
// One task per (sequence, KV head): the task reads each of the head's cached K rows once, scores it
// against the query heads that share that KV head (grouped-query attention; two heads per pass),
// softmaxes in fp32, then reads each V row once and accumulates the weighted sums in fp32.
// Measured on a 2-core Xeon (Qwen3-0.6B heads, batch 8, 1024-token contexts): 1.2-1.4 ms per layer,
// against 2.1-2.6 ms when each head re-read the rows and reduced every score horizontally.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd_bf16.h"

namespace {

using mili::exp_nonpositive;
using mili::kLanes;

inline __m512 load_fp32(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_fp32(const at::BFloat16* p) { return mili::widen_bf16(p); }

// softmax of s[0, n) in place, fp32
inline void softmax_inplace(float* s, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + c));
  float max_score = _mm512_reduce_max_ps(vmax);
  for (; c < n; ++c) max_score = std::max(max_score, s[c]);
  const __m512 vm = _mm512_set1_ps(max_score);
  __m512 vsum = _mm512_setzero_ps();
  for (c = 0; c + kLanes <= n; c += kLanes) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + c), vm));
    _mm512_storeu_ps(s + c, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  float total = _mm512_reduce_add_ps(vsum);
  for (; c < n; ++c) total += (s[c] = std::exp(s[c] - max_score));
  const __m512 inv = _mm512_set1_ps(1.f / total);
  for (c = 0; c + kLanes <= n; c += kLanes) _mm512_storeu_ps(s + c, _mm512_mul_ps(_mm512_loadu_ps(s + c), inv));
  for (; c < n; ++c) s[c] /= total;
}

// A head's K or V row is a short piece of each slot's row (the pool interleaves heads), so the hardware
// prefetcher sees a strided walk through scattered pages: ask for rows a few slots ahead explicitly.
constexpr int64_t kPrefetchRows = 16;
constexpr int64_t kCacheLine = 64;

template <typename T>
inline void prefetch_row(const T* row, int64_t count) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(T)); offset += kCacheLine)
    _mm_prefetch(p + offset, _MM_HINT_T0);
}

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

// G query heads (arranged by lane_of, pre-scaled) against one KV head's context: each K and V row is
// read and widened once for all G heads. scores holds G rows of `stride` floats; out gets G * CH * 16
// floats in lane_of order.
template <typename T, int CH, int G>
void attend_heads(const float* q, const T* k_pool, const T* v_pool, const int64_t* slots, int64_t ctx,
                  int64_t row_stride, int64_t head_offset, float* scores, int64_t stride, float* out) {
  constexpr int64_t head_dim = CH * kLanes;
  alignas(64) __m512 partial[G][kLanes];
  for (int64_t c0 = 0; c0 < ctx; c0 += kLanes) {
    const int64_t n = std::min(kLanes, ctx - c0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t c = c0 + j;
      if (c + kPrefetchRows < ctx) prefetch_row(k_pool + slots[c + kPrefetchRows] * row_stride + head_offset, head_dim);
      __m512 k[CH];
      load_row<T, CH>(k_pool + slots[c] * row_stride + head_offset, k);
      for (int g = 0; g < G; ++g) {
        const float* qg = q + g * head_dim;
        // two accumulators halve the chain of dependent FMAs
        __m512 first = _mm512_mul_ps(k[0], _mm512_load_ps(qg));
        __m512 second = _mm512_setzero_ps();
        for (int i = 1; i < CH; ++i) {
          __m512& acc = (i % 2) ? second : first;
          acc = _mm512_fmadd_ps(k[i], _mm512_load_ps(qg + i * kLanes), acc);
        }
        partial[g][j] = _mm512_add_ps(first, second);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int64_t j = n; j < kLanes; ++j) partial[g][j] = _mm512_setzero_ps();
      const __m512 totals = sum_each(partial[g]);
      _mm512_mask_storeu_ps(scores + g * stride + c0, static_cast<__mmask16>((1u << n) - 1), totals);
    }
  }
  for (int g = 0; g < G; ++g) softmax_inplace(scores + g * stride, ctx);
  __m512 acc[G][CH];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < CH; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < ctx; ++c) {
    if (c + kPrefetchRows < ctx) prefetch_row(v_pool + slots[c + kPrefetchRows] * row_stride + head_offset, head_dim);
    __m512 v[CH];
    load_row<T, CH>(v_pool + slots[c] * row_stride + head_offset, v);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * stride + c]);
      for (int i = 0; i < CH; ++i) acc[g][i] = _mm512_fmadd_ps(p, v[i], acc[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < CH; ++i) _mm512_store_ps(out + g * head_dim + i * kLanes, acc[g][i]);
}

// Query heads go two at a time: two heads' accumulators (2 * CH) and a V row (CH) fit the 32 registers.
constexpr int64_t kHeadsPerPass = 2;

template <typename T, int CH>
void run_head_dim(const T* qp, const T* kp, const T* vp, const int64_t* sp, const int64_t* lp, int64_t batch,
                  int64_t num_heads, int64_t num_kv_heads, int64_t width, float scale, T* op) {
  constexpr int64_t head_dim = CH * kLanes;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;  // elements between consecutive slots
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    alignas(64) float q[kHeadsPerPass * head_dim];
    alignas(64) float out[kHeadsPerPass * head_dim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads, ctx = lp[b];
      const int64_t stride = (ctx + kLanes - 1) / kLanes * kLanes;  // score rows end on a full vector
      scores.resize(kHeadsPerPass * stride);
      for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
        const int64_t heads = std::min(kHeadsPerPass, group - g0);
        const int64_t offset = (b * num_heads + h * group + g0) * head_dim;
        for (int64_t g = 0; g < heads; ++g)
          for (int64_t e = 0; e < head_dim; ++e)
            q[g * head_dim + lane_of<T, CH>(e)] = static_cast<float>(qp[offset + g * head_dim + e]) * scale;
        const int64_t* slots = sp + b * width;
        if (heads == 2)
          attend_heads<T, CH, 2>(q, kp, vp, slots, ctx, row_stride, h * head_dim, scores.data(), stride, out);
        else
          attend_heads<T, CH, 1>(q, kp, vp, slots, ctx, row_stride, h * head_dim, scores.data(), stride, out);
        for (int64_t g = 0; g < heads; ++g)
          for (int64_t e = 0; e < head_dim; ++e)
            op[offset + g * head_dim + e] = static_cast<T>(out[g * head_dim + lane_of<T, CH>(e)]);
      }
    }
  });
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
         const torch::Tensor& slots, const torch::Tensor& ctx_lens, double scale, torch::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_pool.size(1), width = slots.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = ctx_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float s = static_cast<float>(scale);
  switch (head_dim / kLanes) {
    case 1: run_head_dim<T, 1>(qp, kp, vp, sp, lp, batch, num_heads, num_kv_heads, width, s, op); break;
    case 2: run_head_dim<T, 2>(qp, kp, vp, sp, lp, batch, num_heads, num_kv_heads, width, s, op); break;
    case 4: run_head_dim<T, 4>(qp, kp, vp, sp, lp, batch, num_heads, num_kv_heads, width, s, op); break;
    case 8: run_head_dim<T, 8>(qp, kp, vp, sp, lp, batch, num_heads, num_kv_heads, width, s, op); break;
    default: TORCH_CHECK(false, "paged_decode_attention: head_dim must be 16, 32, 64 or 128");
  }
}

}  // namespace

// q (B, H, D); k_pool, v_pool (slots, KV, D); slots (B, C) int64; ctx_lens (B,) int64 -> (B, H, D)
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool,
                                     const torch::Tensor& v_pool, const torch::Tensor& slots,
                                     const torch::Tensor& ctx_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(), "paged_decode_attention: shapes");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && slots.is_contiguous() &&
              ctx_lens.is_contiguous(), "paged_decode_attention: contiguous inputs only");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "paged_decode_attention: q and the pools share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong, "int64 slots and lengths");
  TORCH_CHECK(q.size(2) == k_pool.size(2), "q and the pools share head_dim");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(slots.size(0) == q.size(0) && ctx_lens.size(0) == q.size(0), "one slot row and length per query");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(q, k_pool, v_pool, slots, ctx_lens, scale, out);
  } else if (q.scalar_type() == at::kFloat) {
    run<float>(q, k_pool, v_pool, slots, ctx_lens, scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: bf16 or fp32 only");
  }
  return out;
}

