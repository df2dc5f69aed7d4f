// Decode attention straight from the paged KV pool: one query token per sequence attends to the context
// its page table row addresses (attention_pages.h), without gathering it into a contiguous copy first.
//
// Split over the context ("flash-decoding"): each sequence's context is cut into spans, and one task per
// (sequence, span) walks its slots in blocks of 16, reading each slot's row once for every KV head
// together: the pool keeps a slot's heads side by side, so a block is a few contiguous KB the memory
// streams; and a sequence's context is shared by every thread, so batch 1 keeps both cores busy. Within
// a block each query head shares its KV head's widened row with the rest of its group (grouped-query
// attention). A task softmaxes its span in fp32 and keeps the span's max and sum; a second pass merges
// the spans of each sequence: much faster than one task per (sequence, KV head). Where the
// CPU has AMX tiles, a prefix several sequences share is one more span, attended for all of them at
// once (cascade attention, decode_shared_amx.cpp), and each member's own spans start after it.
//
// With AVX512-BF16, bf16 scores are bf16 pair products (score_block_pairs), and so is the weighted sum
// of V (weigh_block_pairs), its numerators rounded to bf16 as torch's CPU flash attention rounds them, two
// slots' V rows an instruction: both a little faster than fp32, outputs within the same tolerance of fp32
// SDPA.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "attention_pages.h"
#include "decode_blocks.h"
#include "decode_partials.h"
#include "decode_shared_amx.h"
#include "kernels.h"
#include "simd_bf16.h"

namespace {

using namespace mili::decode;  // the block-level pieces this kernel is built from, and the shared spans
using mili::exp_nonpositive;
using mili::kLanes;

constexpr int64_t kMinSpan = 4 * kBlock;  // shorter spans cost more in merging than they balance

// Floats between two query heads' score rows for a span of n slots: whole 32-value pairs, so that the
// bf16 copy of a row packs without a tail. The scores buffer is sized from it too.
inline int64_t score_row_stride(int64_t n) { return (n + 2 * kBlock - 1) / (2 * kBlock) * (2 * kBlock); }

struct Layout {
  int64_t num_heads, num_kv_heads, group, head_dim, row_stride;  // row_stride: elements between slots
  int64_t blocks_ahead;  // the prefetch distance (decode_blocks.h)
};

// One span of one sequence, slots [0, n) of it. The query is either q, (H, D) fp32 in lane_of order and
// pre-scaled (scale unused), or, with kPairs, q_pairs, (H, D) bf16 as given, scored with pair
// products and scaled after. Leaves, per query head, the span's unnormalised weighted sum of V (acc,
// H * D in lane_of order, or pair_lane_of with kPairs), its max score (max) and the sum of
// exp(score - max) (sum). `scores` holds H * stride floats, then (kPairs) their bf16 pairs.
template <typename T, int CH, bool kPairs>
__attribute__((always_inline)) inline void attend_span(const float* q, const T* q_pairs, float scale, const T* k_pool,
                                                      const T* v_pool, const int64_t* slots, int64_t n,
                                                      const Layout& s, float* scores, float* acc, float* max,
                                                      float* sum) {
  constexpr int64_t D = CH * kLanes;
  const int64_t stride = score_row_stride(n);  // a score row per query head; with kPairs, the bf16 copy follows
  uint32_t* p_pairs = reinterpret_cast<uint32_t*>(scores + s.num_heads * stride);
  alignas(64) __m512 partial[kHeadsPerPass][kBlock];
  const __m512 vscale = _mm512_set1_ps(scale);
  prefetch_first_block(k_pool, slots, n, s.row_stride);
  for (int64_t c0 = 0; c0 < n; c0 += kBlock) {
    const int64_t m = std::min(kBlock, n - c0);
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      prefetch_ahead(k_pool, slots + c0, n - c0, s.row_stride, h * D, D, s.blocks_ahead);
      for (int64_t g0 = 0; g0 < s.group; g0 += kHeadsPerPass) {
        const int64_t head = h * s.group + g0;
        const bool two = s.group - g0 >= 2;
        if constexpr (kPairs) {
          if (two)
            score_block_pairs<CH, 2>(q_pairs + head * D, k_pool, slots + c0, m, s.row_stride, h * D, partial);
          else
            score_block_pairs<CH, 1>(q_pairs + head * D, k_pool, slots + c0, m, s.row_stride, h * D, partial);
        } else {
          if (two)
            score_block<T, CH, 2>(q + head * D, k_pool, slots + c0, m, s.row_stride, h * D, partial);
          else
            score_block<T, CH, 1>(q + head * D, k_pool, slots + c0, m, s.row_stride, h * D, partial);
        }
        for (int64_t g = 0; g < (two ? 2 : 1); ++g) {
          const __m512 score = sum_each(partial[g]);
          _mm512_store_ps(scores + (head + g) * stride + c0, kPairs ? _mm512_mul_ps(score, vscale) : score);
        }
      }
    }
  }
  prefetch_first_block(v_pool, slots, n, s.row_stride);  // in flight while the softmax runs
  for (int64_t head = 0; head < s.num_heads; ++head) {  // softmax numerators of the span, in place
    float* row = scores + head * stride;
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t c = 0;
    for (; c + kLanes <= n; c += kLanes) vmax = _mm512_max_ps(vmax, _mm512_load_ps(row + c));
    float row_max = _mm512_reduce_max_ps(vmax);
    for (; c < n; ++c) row_max = std::max(row_max, row[c]);
    const __m512 vm = _mm512_set1_ps(row_max);
    __m512 vsum = _mm512_setzero_ps();
    for (c = 0; c < stride; c += kLanes) {  // the tail past n is zeroed: it must not weigh in below
      const __mmask16 valid = c + kLanes <= n ? 0xFFFF : c >= n ? 0 : static_cast<__mmask16>((1u << (n - c)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(_mm512_load_ps(row + c), vm)));
      _mm512_store_ps(row + c, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    max[head] = row_max;
    sum[head] = _mm512_reduce_add_ps(vsum);
    if constexpr (kPairs) {  // the numerators as bf16, two per 32 bits, for the pair products below
      pack_bf16_pairs(row, stride, p_pairs + head * stride / 2);
    }
  }
  for (int64_t c0 = 0; c0 < n; c0 += kBlock) {
    const int64_t m = std::min(kBlock, n - c0);
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      prefetch_ahead(v_pool, slots + c0, n - c0, s.row_stride, h * D, D, s.blocks_ahead);
      for (int64_t g0 = 0; g0 < s.group; g0 += kHeadsPerPass) {
        const int64_t head = h * s.group + g0;
        if constexpr (kPairs) {
          const uint32_t* p = p_pairs + head * stride / 2 + c0 / 2;
          if (s.group - g0 >= 2)
            weigh_block_pairs<CH, 2>(p, stride, v_pool, slots + c0, m, s.row_stride, h * D, c0 == 0, acc + head * D);
          else
            weigh_block_pairs<CH, 1>(p, stride, v_pool, slots + c0, m, s.row_stride, h * D, c0 == 0, acc + head * D);
          continue;
        }
        if (s.group - g0 >= 2)
          weigh_block<T, CH, 2>(scores + head * stride + c0, stride, v_pool, slots + c0, m, s.row_stride, h * D,
                                c0 == 0, acc + head * D);
        else
          weigh_block<T, CH, 1>(scores + head * stride + c0, stride, v_pool, slots + c0, m, s.row_stride, h * D,
                                c0 == 0, acc + head * D);
      }
    }
  }
}

// The span walk, compiled twice: with fp32 products for any CPU, and with pair products inside a function
// built for AVX512-BF16, so that the pair-product blocks inline into it.
template <typename T, int CH>
void attend_span_fp32(const float* q, const T* k_pool, const T* v_pool, const int64_t* slots, int64_t n,
                      const Layout& s, float* scores, float* acc, float* max, float* sum) {
  attend_span<T, CH, false>(q, nullptr, 0.f, k_pool, v_pool, slots, n, s, scores, acc, max, sum);
}

template <int CH>
MILI_DECODE_BF16_DOT void attend_span_pairs(const at::BFloat16* q, float scale, const at::BFloat16* k_pool,
                                            const at::BFloat16* v_pool, const int64_t* slots, int64_t n,
                                            const Layout& s, float* scores, float* acc, float* max, float* sum) {
  attend_span<at::BFloat16, CH, true>(nullptr, q, scale, k_pool, v_pool, slots, n, s, scores, acc, max, sum);
}

template <typename T, int CH>
void run_head_dim(const T* qp, const T* kp, const T* vp, const int64_t* sp, const int64_t* lp, int64_t batch,
                  int64_t width, const Layout& s, float scale, bool pairs, bool amx, T* op) {
  constexpr int64_t D = CH * kLanes;
  constexpr bool kCanPair = std::is_same_v<T, at::BFloat16> && CH % 2 == 0;  // whole 32-value pairs a row
  pairs = pairs && kCanPair;
  const int64_t H = s.num_heads;
  const SharedSpanShape shape{H, s.num_kv_heads, D, s.row_stride};
  // Prefixes several sequences share go to AMX tiles once for all of them; each member's own tasks start
  // after its prefix (skip). The partials merge as any spans do.
  std::vector<SharedPrefix> prefixes;
  if (pairs && amx && shared_span_fits(shape))
    prefixes = find_shared_prefixes(sp, lp, batch, width, kMaxSharedRows / s.group);
  std::vector<int64_t> skip(batch, 0);
  for (const SharedPrefix& prefix : prefixes)
    for (const int64_t b : prefix.members) skip[b] = prefix.length;
  // Span length: a context split evenly over the threads, in whole blocks, at least kMinSpan. Each span
  // starts cold (nothing before it prefetched its first block), so fewer and longer spans read faster than
  // several a thread. A sequence's own spans follow from its own context alone, never from the rest of the
  // batch: its output is then the same bits at batch 1 as beside others (batch invariance), so a row
  // verifying a draft computes what the plain decode of that token computes (linear_bf16.cpp's tiles too).
  const int64_t threads = at::get_num_threads();
  const auto span_of = [threads](int64_t length) {
    const int64_t target = (length + threads - 1) / threads;
    return std::max(kMinSpan, (target + kBlock - 1) / kBlock * kBlock);
  };
  std::vector<int64_t> span_b(batch);
  int64_t total = 0, longest = kMinSpan;
  for (int64_t b = 0; b < batch; ++b) {
    span_b[b] = span_of(lp[b] - skip[b]);
    longest = std::max(longest, span_b[b]);
    total += lp[b] - skip[b];
  }
  for (const SharedPrefix& prefix : prefixes) total += prefix.length;
  const int64_t span = span_of(total);  // the shared prefixes' (AMX tiles)
  // Shared spans first (the longest tasks), then each sequence's own: tasks of sequence b are
  // [first_task[b], first_task[b + 1]) after the shared ones, and its partials are entries_of[b].
  std::vector<SharedTask> shared_tasks;
  std::vector<std::vector<int64_t>> entries_of(batch);
  const int64_t shared_span = (span + kSharedStep - 1) / kSharedStep * kSharedStep;
  int64_t entries = 0;
  for (const SharedPrefix& prefix : prefixes) {
    for (int64_t begin = 0; begin < prefix.length; begin += shared_span) {
      shared_tasks.push_back({&prefix, begin, std::min(shared_span, prefix.length - begin), entries});
      for (const int64_t b : prefix.members) entries_of[b].push_back(entries++);
    }
  }
  const int64_t num_shared = static_cast<int64_t>(shared_tasks.size());
  std::vector<int64_t> first_task(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    first_task[b + 1] = first_task[b] + std::max<int64_t>(1, (lp[b] - skip[b] + span_b[b] - 1) / span_b[b]);
    for (int64_t t = first_task[b]; t < first_task[b + 1]; ++t) entries_of[b].push_back(entries + t);
  }
  const int64_t tasks = num_shared + first_task[batch];
  Partials partials(entries + first_task[batch], H, D);
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int64_t row = score_row_stride(std::max(span, longest));  // attend_span's stride, at most
    AlignedFloats scores_buffer(H * row + (pairs ? H * row / 2 : 0)), q_buffer(H * D);  // then the bf16 pairs
    float* scores = scores_buffer.data();
    float* q = q_buffer.data();
    int64_t b = 0, q_of = -1;
    for (int64_t task = next_task.fetch_add(1); task < tasks; task = next_task.fetch_add(1)) {
      if (task < num_shared) {
        if constexpr (kCanPair) {
          const SharedTask& shared = shared_tasks[task];
          const std::vector<int64_t>& members = shared.prefix->members;
          std::vector<SpanPartial> out;
          for (size_t i = 0; i < members.size(); ++i) out.push_back(partials.span(shared.first_entry + i));
          attend_shared_span(qp, members.data(), members.size(), shape, scale, kp, vp,
                             sp + members[0] * width + shared.begin, shared.n, out.data());
        }
        continue;
      }
      const int64_t own = task - num_shared;
      while (first_task[b + 1] <= own) ++b;  // tasks are handed out in order
      if (q_of != b && !pairs) {
        for (int64_t head = 0; head < H; ++head)
          for (int64_t e = 0; e < D; ++e)
            q[head * D + lane_of<T, CH>(e)] = static_cast<float>(qp[(b * H + head) * D + e]) * scale;
        q_of = b;
      }
      const int64_t begin = skip[b] + (own - first_task[b]) * span_b[b], n = std::min(span_b[b], lp[b] - begin);
      const int64_t entry = entries + own;
      const int64_t* span_slots = sp + b * width + begin;
      float *acc = partials.acc(entry), *max = partials.max(entry), *sum = partials.sum(entry);
      if constexpr (kCanPair) {
        if (pairs) {
          attend_span_pairs<CH>(qp + b * H * D, scale, kp, vp, span_slots, n, s, scores, acc, max, sum);
          continue;
        }
      }
      attend_span_fp32<T, CH>(q, kp, vp, span_slots, n, s, scores, acc, max, sum);
    }
  });
  merge_partials<T, CH>(partials, entries_of, H, pairs, op);
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
         const torch::Tensor& slots, const torch::Tensor& ctx_lens, double scale, bool pairs, bool amx,
         int64_t blocks_ahead, torch::Tensor& out) {
  const int64_t batch = q.size(0), head_dim = q.size(2);
  Layout s{q.size(1), k_pool.size(1), q.size(1) / k_pool.size(1), head_dim, k_pool.size(1) * head_dim, blocks_ahead};
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = ctx_lens.data_ptr<int64_t>();
  const int64_t width = slots.size(1);
  T* op = out.data_ptr<T>();
  const float f = static_cast<float>(scale);
  switch (head_dim / kLanes) {
    case 1: run_head_dim<T, 1>(qp, kp, vp, sp, lp, batch, width, s, f, pairs, amx, op); break;
    case 2: run_head_dim<T, 2>(qp, kp, vp, sp, lp, batch, width, s, f, pairs, amx, op); break;
    case 4: run_head_dim<T, 4>(qp, kp, vp, sp, lp, batch, width, s, f, pairs, amx, op); break;
    case 8: run_head_dim<T, 8>(qp, kp, vp, sp, lp, batch, width, s, f, pairs, amx, op); break;
    // Qwen3.5 / Qwen3-Next attention: two heads' accumulators no longer fit the registers and spill to L1,
    // still far faster than gathering the context for SDPA
    case 16: run_head_dim<T, 16>(qp, kp, vp, sp, lp, batch, width, s, f, pairs, amx, op); break;
    default: TORCH_CHECK(false, "paged_decode_attention: head_dim must be 16, 32, 64, 128 or 256");
  }
}

}  // namespace

// q (B, H, D); k_pool, v_pool (slots, KV, D); slots (B, C) int64, each row's context slots; ctx_lens (B,)
// int64 -> out (B, H, D). amx_tiles (with bf16_dot_products): prefixes several sequences share are attended
// on AMX tiles. prefetch_blocks: how many blocks of 16 slots ahead the walk asks for (decode_blocks.h).
void decode_attention_over_slots(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                 const torch::Tensor& slots, const torch::Tensor& ctx_lens, double scale,
                                 bool bf16_dot_products, bool amx_tiles, int64_t prefetch_blocks, torch::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(), "paged_decode_attention: shapes");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && slots.is_contiguous() &&
              ctx_lens.is_contiguous(), "paged_decode_attention: contiguous inputs only");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "paged_decode_attention: q and the pools share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong, "int64 slots and lengths");
  TORCH_CHECK(q.size(2) == k_pool.size(2), "q and the pools share head_dim");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous(),
              "paged_decode_attention: out (B, H, D) contiguous, q's dtype");
  TORCH_CHECK(!bf16_dot_products || cpu_has_bf16_dot_products(),
              "paged_decode_attention: this CPU has no AVX512-BF16");
  TORCH_CHECK(prefetch_blocks >= 1 && prefetch_blocks <= kMaxBlocksAhead,
              "paged_decode_attention: prefetch_blocks from 1 to ", kMaxBlocksAhead);
  TORCH_CHECK(!amx_tiles || cpu_has_amx_tiles(),
              "paged_decode_attention: this CPU has no AMX tiles (or Linux did not grant them)");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(slots.size(0) == q.size(0) && ctx_lens.size(0) == q.size(0), "one slot row and length per query");
  const int64_t* lp = ctx_lens.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(lp, lp + ctx_lens.size(0), [&](int64_t n) { return n >= 1 && n <= slots.size(1); }),
              "paged_decode_attention: each context holds 1 to slots.size(1) tokens");
  if (q.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(q, k_pool, v_pool, slots, ctx_lens, scale, bf16_dot_products, amx_tiles, prefetch_blocks, out);
  } else if (q.scalar_type() == at::kFloat) {
    run<float>(q, k_pool, v_pool, slots, ctx_lens, scale, false, false, prefetch_blocks, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: bf16 or fp32 only");
  }
}

// q (B, H, D); k_pool, v_pool (slots, KV, D); page_table (B, W) int64 or int32, page_size slots a page;
// ctx_lens (B,) int64 -> out (B, H, D): each row against positions [0, ctx_lens[b]) of its pages.
void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                            const torch::Tensor& page_table, int64_t page_size, const torch::Tensor& ctx_lens,
                            double scale, bool bf16_dot_products, bool amx_tiles, int64_t prefetch_blocks,
                            torch::Tensor out) {
  TORCH_CHECK(ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous() && ctx_lens.dim() == 1 &&
              q.dim() == 3 && ctx_lens.size(0) == q.size(0) && k_pool.dim() == 3,
              "paged_decode_attention: q (B, H, D), ctx_lens (B,) int64");
  const int64_t* lengths = ctx_lens.data_ptr<int64_t>();
  mili::check_page_table(page_table, page_size, lengths, q.size(0), k_pool.size(0), "paged_decode_attention");
  const torch::Tensor slots = mili::context_slot_rows(page_table, page_size, lengths, q.size(0));
  decode_attention_over_slots(q, k_pool, v_pool, slots, ctx_lens, scale, bf16_dot_products, amx_tiles,
                              prefetch_blocks, out);
}
