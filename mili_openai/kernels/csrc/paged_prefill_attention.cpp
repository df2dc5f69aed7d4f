// Prefill attention straight from the paged KV pool: each chunk of L query tokens of one sequence attends
// causally to its context (cached prefix plus the chunk itself, already written to the pool), read through
// the chunk's page table row (attention_pages.h), without gathering it into a contiguous copy or building a
// mask. The chunks of a step come in one call and run one after another, each over every thread.
//
// Flash-attention order on AVX-512: one task per (KV head, block of query positions) holds the block's
// rows for every query head sharing that KV head (grouped-query attention: each K and V row serves the
// whole group), walks the context in blocks of keys up to the block's last visible position, and keeps
// a running max and sum per row (online softmax, fp32), so no score matrix larger than one block exists.
// Queries and the output are held transposed, 64 rows across the lanes of four registers: scores,
// softmax, masking and rescaling are then plain vector ops, and both products (prefill_products.h) are
// broadcast multiply-adds with 16 accumulators. Key blocks wholly after a row block's last position are
// skipped. It beats torch's causal SDPA on the same K/V already gathered, on CPUs without AMX.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "attention_pages.h"
#include "kernels.h"
#include "prefill_amx.h"
#include "prefill_products.h"

namespace {

using mili::exp_nonpositive;
using mili::kKeyBlock;
using mili::kLanes;
using mili::kRowVectors;
using mili::kTaskRows;

struct Shapes {
  int64_t length, ctx, num_heads, num_kv_heads, head_dim, group, positions_per_task, q_row_stride;
};

// One task: KV head h, query positions [p0, p0 + positions_per_task) of the chunk. Lane r holds query
// head h * group + r / positions and chunk position p0 + r % positions (lanes past the group's rows, or
// past the chunk, compute a copy of a valid row and are not written). `products` is the thread's own.
template <typename T, typename Products>
void attend_task(const T* q, const T* k_pool, const T* v_pool, const int64_t* slots, const Shapes& s, int64_t h,
                 int64_t p0, float scale, T* out, Products& products, std::vector<float>& out_buffer,
                 std::vector<__m512>& scores_buffer) {
  const int64_t D = s.head_dim, P = s.positions_per_task, kv_row = s.num_kv_heads * D;
  const int64_t last = std::min(s.length, p0 + P) - 1;  // last chunk position in the task
  alignas(64) int32_t lane_pos[kTaskRows];            // each lane's context position
  mili::QueryRows<T> rows;
  for (int64_t r = 0; r < kTaskRows; ++r) {
    const int64_t g = std::min(r / P, s.group - 1), p = std::min(p0 + r % P, last);
    lane_pos[r] = static_cast<int32_t>(s.ctx - s.length + p);
    rows.rows[r] = q + p * s.q_row_stride + (h * s.group + g) * D;
  }
  products.load_queries(rows, scale);
  float* out_t = out_buffer.data();
  std::fill(out_buffer.begin(), out_buffer.end(), 0.f);
  __m512 pos[kRowVectors], row_max[kRowVectors], row_sum[kRowVectors];
  for (int64_t v = 0; v < kRowVectors; ++v) {
    pos[v] = _mm512_cvtepi32_ps(_mm512_load_si512(lane_pos + v * kLanes));
    row_max[v] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    row_sum[v] = _mm512_setzero_ps();
  }
  const int64_t visible = s.ctx - s.length + last + 1;  // keys [0, visible) matter to some lane
  for (int64_t c0 = 0; c0 < visible; c0 += kKeyBlock) {
    const int64_t keys = std::min(kKeyBlock, visible - c0);
    products.load_block(k_pool, v_pool, slots + c0, keys, kv_row, h * D);
    __m512* scores = scores_buffer.data();
    products.score(keys, scores);
    // causal: key position c0 + j is hidden from lanes at an earlier position
    const bool diagonal = c0 + keys - 1 > s.ctx - s.length + p0;
    __m512 block_max[kRowVectors];
    for (int64_t v = 0; v < kRowVectors; ++v) block_max[v] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < keys; ++j) {
      const __m512 key_pos = _mm512_set1_ps(static_cast<float>(c0 + j));
      for (int64_t v = 0; v < kRowVectors; ++v) {
        __m512& sc = scores[j * kRowVectors + v];
        if (diagonal)
          sc = _mm512_mask_mov_ps(sc, _mm512_cmp_ps_mask(key_pos, pos[v], _CMP_GT_OQ),
                                  _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
        block_max[v] = _mm512_max_ps(block_max[v], sc);
      }
    }
    __m512 new_max[kRowVectors];
    for (int64_t v = 0; v < kRowVectors; ++v) {
      // every lane sees key 0, so after the first block the running max is finite
      new_max[v] = _mm512_max_ps(row_max[v], block_max[v]);
      const __m512 rescale = c0 == 0 ? _mm512_setzero_ps() : exp_nonpositive(_mm512_sub_ps(row_max[v], new_max[v]));
      row_sum[v] = _mm512_mul_ps(row_sum[v], rescale);
      row_max[v] = new_max[v];
      if (c0 != 0)
        for (int64_t d = 0; d < D; ++d) {
          float* o = out_t + (d * kRowVectors + v) * kLanes;
          _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), rescale));
        }
    }
    for (int64_t j = 0; j < keys; ++j)
      for (int64_t v = 0; v < kRowVectors; ++v) {
        __m512& sc = scores[j * kRowVectors + v];
        const __mmask16 seen =
            _mm512_cmp_ps_mask(sc, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
        sc = _mm512_maskz_mov_ps(seen, exp_nonpositive(_mm512_sub_ps(sc, new_max[v])));  // hidden keys weigh 0
        row_sum[v] = _mm512_add_ps(row_sum[v], sc);
      }
    products.accumulate(scores, keys, out_t);
  }
  alignas(64) float inv_sum[kTaskRows];
  for (int64_t v = 0; v < kRowVectors; ++v)
    _mm512_store_ps(inv_sum + v * kLanes, _mm512_div_ps(_mm512_set1_ps(1.f), row_sum[v]));
  const int64_t real_rows = s.group * P;  // lanes that are real (head, position) pairs
  for (int64_t r = 0; r < std::min(real_rows, kTaskRows); ++r) {
    if (p0 + r % P > last) continue;
    const int64_t row = (p0 + r % P) * s.num_heads * D + (h * s.group + r / P) * D;
    for (int64_t d = 0; d < D; ++d) out[row + d] = static_cast<T>(out_t[d * kTaskRows + r] * inv_sum[r]);
  }
}

template <typename T, typename Products>
void run(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool, const int64_t* sp,
         int64_t ctx, double scale, torch::Tensor& out) {
  Shapes s{};
  s.length = q.size(0);
  s.num_heads = q.size(1);
  s.head_dim = q.size(2);
  s.ctx = ctx;
  s.num_kv_heads = k_pool.size(1);
  s.group = s.num_heads / s.num_kv_heads;
  s.positions_per_task = kTaskRows / s.group;
  s.q_row_stride = q.stride(0);
  const int64_t blocks = (s.length + s.positions_per_task - 1) / s.positions_per_task;
  const int64_t tasks = blocks * s.num_kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Later position blocks see more keys: hand them out first, from a shared counter, so the cheap early
  // blocks fill in at the end and no thread is left with the long tail.
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Products products(s.head_dim);
    std::vector<float> out_buffer(s.head_dim * kTaskRows);
    std::vector<__m512> scores_buffer(kKeyBlock * kRowVectors);
    for (int64_t t = next_task.fetch_add(1); t < tasks; t = next_task.fetch_add(1)) {
      const int64_t block = blocks - 1 - t / s.num_kv_heads, h = t % s.num_kv_heads;
      attend_task(qp, kp, vp, sp, s, h, block * s.positions_per_task, static_cast<float>(scale), op, products,
                  out_buffer, scores_buffer);
    }
  });
}

// One chunk: q (L, H, D) against its context slots [0, ctx) (the chunk's own L last) into out (L, H, D).
void attend_chunk(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                  const int64_t* slots, int64_t ctx, double scale, bool bf16_dot_products, bool amx_tiles,
                  torch::Tensor out) {
  if (amx_tiles && mili::prefill::amx_prefill_fits(q.size(1), k_pool.size(1), q.size(2))) {
    const mili::prefill::AmxPrefillShape shape{q.size(0), ctx, q.size(1), k_pool.size(1), q.size(2), q.stride(0),
                                               k_pool.stride(0)};
    mili::prefill::attend_prefill_amx(q.data_ptr<at::BFloat16>(), k_pool.data_ptr<at::BFloat16>(),
                                      v_pool.data_ptr<at::BFloat16>(), slots, shape, static_cast<float>(scale),
                                      out.data_ptr<at::BFloat16>());
  } else if (bf16_dot_products) {
    run<at::BFloat16, mili::Bf16DotProducts>(q, k_pool, v_pool, slots, ctx, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<at::BFloat16, mili::Fp32Products<at::BFloat16>>(q, k_pool, v_pool, slots, ctx, scale, out);
  } else {
    run<float, mili::Fp32Products<float>>(q, k_pool, v_pool, slots, ctx, scale, out);
  }
}

}  // namespace

// q (T, H, D), every chunk's rows (rows may be strided, each row's heads contiguous); k_pool, v_pool (slots,
// KV, D); page_table (S, W) int64 or int32, a row per chunk, page_size slots a page (attention_pages.h);
// cu_seqlens (S + 1,) int64: chunk s is rows [cu[s], cu[s + 1]); ctx_lens (S,) int64: its context after the
// chunk -> out (T, H, D) contiguous. Row i of a chunk of L sits at context position ctx - L + i and sees
// positions [0, ctx - L + i]. bf16_dot_products: bf16 inputs multiply in bf16 pairs (VDPBF16PS), on a CPU
// that has them; amx_tiles: with them, on AMX tiles where the heads fit (prefill_amx.cpp).
void paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                             const torch::Tensor& page_table, int64_t page_size, const torch::Tensor& cu_seqlens,
                             const torch::Tensor& ctx_lens, double scale, bool bf16_dot_products, bool amx_tiles,
                             torch::Tensor out) {
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu(), "paged_prefill_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(), "paged_prefill_attention: shapes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_prefill_attention: each q row's heads contiguous");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "paged_prefill_attention: contiguous pools");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "paged_prefill_attention: q and the pools share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "paged_prefill_attention: bf16 or fp32 only");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous(),
              "paged_prefill_attention: out (T, H, D) contiguous, q's dtype");
  TORCH_CHECK(q.size(2) == k_pool.size(2) && q.size(2) % kLanes == 0, "head_dim: shared, a multiple of 16");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0 && q.size(1) / k_pool.size(1) <= kTaskRows,
              "query heads must be a multiple of KV heads, at most 64 per KV head");
  TORCH_CHECK(!bf16_dot_products || (q.scalar_type() == at::kBFloat16 && mili::cpu_has_bf16_dot_products()),
              "paged_prefill_attention: bf16 dot products need bf16 inputs and a CPU with AVX512-BF16");
  TORCH_CHECK(!amx_tiles || (bf16_dot_products && cpu_has_amx_tiles()),
              "paged_prefill_attention: AMX tiles need bf16 dot products and a CPU that grants the tiles");
  const int64_t segments = ctx_lens.numel();
  TORCH_CHECK(ctx_lens.scalar_type() == at::kLong && cu_seqlens.scalar_type() == at::kLong &&
              ctx_lens.is_contiguous() && cu_seqlens.is_contiguous() && cu_seqlens.numel() == segments + 1,
              "paged_prefill_attention: ctx_lens (S,) and cu_seqlens (S + 1,) int64");
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t* lengths = ctx_lens.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[segments] == q.size(0), "paged_prefill_attention: cu_seqlens cover q's rows");
  for (int64_t seg = 0; seg < segments; ++seg)
    TORCH_CHECK(cu[seg] <= cu[seg + 1] && cu[seg + 1] - cu[seg] <= lengths[seg],
                "paged_prefill_attention: each chunk lies within its context");
  mili::check_page_table(page_table, page_size, lengths, segments, k_pool.size(0), "paged_prefill_attention");
  std::vector<int64_t> slots;
  for (int64_t seg = 0; seg < segments; ++seg) {
    const int64_t length = cu[seg + 1] - cu[seg];
    if (length == 0) continue;
    slots.resize(lengths[seg]);
    mili::list_context_slots(page_table, page_size, seg, lengths[seg], slots.data());
    attend_chunk(q.narrow(0, cu[seg], length), k_pool, v_pool, slots.data(), lengths[seg], scale, bf16_dot_products,
                 amx_tiles, out.narrow(0, cu[seg], length));
  }
}

bool cpu_has_bf16_dot_products() { return mili::cpu_has_bf16_dot_products(); }
