// Decode attention straight from the paged KV pool: one query token per sequence attends to the
// context slots listed for it, without gathering the context into a contiguous copy first.
//
// One task per (sequence, KV head): the task reads each of the head's cached K rows once, scores it
// against the query heads that share that KV head (grouped-query attention), softmaxes in fp32, then
// reads each V row once and accumulates the weighted sum in fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // fp32 values per 512-bit register

inline __m512 load_fp32(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_fp32(const at::BFloat16* p) {
  // bf16 is the high half of an fp32: widen 16 of them to 32 bits and shift into place
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T>
void attend_one(const T* q, const T* k_pool, const T* v_pool, const int64_t* slots, int64_t ctx,
                int64_t num_kv_heads, int64_t kv_head, int64_t group, int64_t head_dim, float scale,
                std::vector<float>& scores, T* out) {
  const int64_t chunks = head_dim / kLanes;
  const int64_t row_stride = num_kv_heads * head_dim;  // elements between consecutive slots
  scores.resize(group * ctx);
  // query heads of this group, widened to fp32 once
  std::vector<float> qf(group * head_dim);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = static_cast<float>(q[g * head_dim + d]);

  for (int64_t c = 0; c < ctx; ++c) {
    const T* k = k_pool + slots[c] * row_stride + kv_head * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < chunks; ++i)
        acc = _mm512_fmadd_ps(load_fp32(qf.data() + g * head_dim + i * kLanes), load_fp32(k + i * kLanes), acc);
      scores[g * ctx + c] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * ctx;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < ctx; ++c) max_score = std::max(max_score, s[c]);
    float total = 0.f;
    for (int64_t c = 0; c < ctx; ++c) total += (s[c] = std::exp(s[c] - max_score));
    const float inv = 1.f / total;
    for (int64_t c = 0; c < ctx; ++c) s[c] *= inv;
  }
  std::vector<__m512> acc(group * chunks, _mm512_setzero_ps());
  for (int64_t c = 0; c < ctx; ++c) {
    const T* v = v_pool + slots[c] * row_stride + kv_head * head_dim;
    for (int64_t i = 0; i < chunks; ++i) {
      const __m512 vv = load_fp32(v + i * kLanes);
      for (int64_t g = 0; g < group; ++g)
        acc[g * chunks + i] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * ctx + c]), vv, acc[g * chunks + i]);
    }
  }
  alignas(64) float lanes[kLanes];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < chunks; ++i) {
      _mm512_store_ps(lanes, acc[g * chunks + i]);
      for (int64_t l = 0; l < kLanes; ++l) out[g * head_dim + i * kLanes + l] = static_cast<T>(lanes[l]);
    }
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
         const torch::Tensor& slots, const torch::Tensor& ctx_lens, double scale, torch::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_pool.size(1), group = num_heads / num_kv_heads, width = slots.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = ctx_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t offset = (b * num_heads + h * group) * head_dim;
      attend_one<T>(qp + offset, kp, vp, sp + b * width, lp[b], num_kv_heads, h, group, head_dim,
                    static_cast<float>(scale), scores, op + offset);
    }
  });
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
  TORCH_CHECK(q.size(2) == k_pool.size(2) && q.size(2) % kLanes == 0, "head_dim must be a multiple of 16");
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

