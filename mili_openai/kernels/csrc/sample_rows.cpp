// Sampling for the rows of a step that do not decode greedily: temperature, then top-k, top-p and min-p
// truncation, then one draw, all in a few vectorised passes over each row of logits.
//
// The torch path (engine/logits_processing.py and the sampler) sorts the best 1024 logits of a row for
// top-p, or all of them when the nucleus is wider, and draws with an exponential race that needs one
// random number per token: over Qwen3's 151936 logits that costs a visible share of a decode step, and a
// flat row's full sort far more.
//
// Here the cut of top-k and top-p comes from a histogram of the logits' distance below the row's best
// (kBucketsPerUnit buckets per unit, each holding its tokens' count and probability mass); only the
// tokens of the bucket where the cut falls are sorted. The draw is an inverse CDF: one uniform per row,
// the kept tokens' mass walked in vocabulary order until it passes u times their total.
#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "kernels.h"
#include "simd_bf16.h"

namespace {

using mili::kLanes;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int32_t kBucketsPerUnit = 64;  // a bucket spans 1/64 of a logit (after temperature)
constexpr int32_t kBucketUnits = 32;     // tokens further than 32 below the best share the last bucket
constexpr int32_t kFarBucket = kBucketsPerUnit * kBucketUnits;
constexpr int32_t kExcluded = kFarBucket + 1;  // -inf (masked) and NaN logits: never kept, never counted
constexpr int32_t kBuckets = kExcluded + 1;

struct RowParams {
  float temperature, top_p, min_p;
  int64_t top_k;  // the vocabulary size where off
};

// One row's working memory, reused across rows of a thread.
struct RowScratch {
  std::vector<float> x;         // logits / temperature
  std::vector<float> weight;    // exp(x - best), 0 for excluded tokens
  std::vector<int32_t> bucket;  // histogram bucket of each token
  std::vector<int32_t> near;    // the tokens of the buckets before the far one, in vocabulary order
  int64_t num_near = 0;         // (the first num_near entries of `near`)
  std::vector<int64_t> count;   // tokens and probability mass of each bucket
  std::vector<double> mass;
  std::vector<float> boundary;  // the values of the bucket where a cut falls

  explicit RowScratch(int64_t vocab)
      : x(vocab), weight(vocab), bucket(vocab), near(vocab + kLanes), count(kBuckets), mass(kBuckets) {}
};

// The lanes of the vector at token i that hold tokens (all but in the last, partial vector).
inline __mmask16 tokens_at(int64_t i, int64_t vocab) {
  return vocab - i >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (vocab - i)) - 1);
}

// x = logits / temperature (the division torch does, so the same floats), and the row's best value.
float scale_row(const float* logits, int64_t vocab, float temperature, float* x) {
  const __m512 t = _mm512_set1_ps(temperature), neg_inf = _mm512_set1_ps(kNegInf);
  __m512 best = neg_inf;
  for (int64_t i = 0; i < vocab; i += kLanes) {
    const __mmask16 lanes = tokens_at(i, vocab);
    const __m512 v = _mm512_div_ps(_mm512_mask_loadu_ps(neg_inf, lanes, logits + i), t);
    _mm512_mask_storeu_ps(x + i, lanes, v);
    best = _mm512_max_ps(v, best);  // a NaN value loses: max_ps answers its second operand for NaN
  }
  return _mm512_reduce_max_ps(best);
}

// weight = exp(x - best) for kept-able tokens (0 for -inf and NaN); with `buckets`, each token's bucket,
// the near tokens' list and the histogram (the far bucket counted here in vector lanes: most tokens of
// a peaked row are far, and the histogram then walks only the near ones).
void weigh_row(RowScratch& s, int64_t vocab, float best, bool buckets) {
  const __m512 b = _mm512_set1_ps(best), per_unit = _mm512_set1_ps(static_cast<float>(kBucketsPerUnit));
  const __m512 neg_inf = _mm512_set1_ps(kNegInf), far_distance = _mm512_set1_ps(static_cast<float>(kFarBucket));
  const __m512i far = _mm512_set1_epi32(kFarBucket), excluded = _mm512_set1_epi32(kExcluded);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 far_mass = _mm512_setzero_ps();
  int64_t num_near = 0, far_count = 0;
  for (int64_t i = 0; i < vocab; i += kLanes) {
    const __mmask16 lanes = tokens_at(i, vocab);
    const __m512 v = _mm512_mask_loadu_ps(neg_inf, lanes, s.x.data() + i);
    const __mmask16 finite = _mm512_cmp_ps_mask(v, neg_inf, _CMP_GT_OQ);  // false for -inf and NaN
    const __m512 weight = _mm512_maskz_mov_ps(finite, mili::exp_nonpositive(_mm512_sub_ps(v, b)));
    _mm512_mask_storeu_ps(s.weight.data() + i, lanes, weight);
    if (!buckets) continue;
    // min in float before the conversion: a distance of thousands would overflow the int
    const __m512 scaled = _mm512_min_ps(_mm512_mul_ps(_mm512_sub_ps(b, v), per_unit), far_distance);
    const __m512i index = _mm512_min_epi32(_mm512_cvttps_epi32(scaled), far);
    _mm512_mask_storeu_epi32(s.bucket.data() + i, lanes, _mm512_mask_mov_epi32(excluded, finite, index));
    const __mmask16 near = _mm512_mask_cmplt_epi32_mask(finite, index, far);
    const __mmask16 is_far = finite & ~near;
    // compressed in a register and stored whole: a compressing store to memory is slow on Zen 4, and
    // `near` has room for the 16 entries past the last token
    const __m512i tokens = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(i)));
    _mm512_storeu_si512(s.near.data() + num_near, _mm512_maskz_compress_epi32(near, tokens));
    num_near += _mm_popcnt_u32(near);
    far_count += _mm_popcnt_u32(is_far);
    far_mass = _mm512_mask_add_ps(far_mass, is_far, far_mass, weight);
  }
  if (!buckets) return;
  s.num_near = num_near;
  std::fill(s.count.begin(), s.count.end(), 0);
  std::fill(s.mass.begin(), s.mass.end(), 0.0);
  for (int64_t j = 0; j < num_near; ++j) {
    const int32_t token = s.near[j];
    ++s.count[s.bucket[token]];
    s.mass[s.bucket[token]] += s.weight[token];
  }
  s.count[kFarBucket] = far_count;
  s.mass[kFarBucket] = _mm512_reduce_add_ps(far_mass);
}

// The values of bucket `target`, best first.
const std::vector<float>& bucket_values(RowScratch& s, int64_t vocab, int32_t target) {
  std::vector<float>& out = s.boundary;
  out.clear();
  if (target < kFarBucket) {
    for (int64_t j = 0; j < s.num_near; ++j)
      if (s.bucket[s.near[j]] == target) out.push_back(s.x[s.near[j]]);
  } else {
    for (int64_t i = 0; i < vocab; ++i)
      if (s.bucket[i] == target) out.push_back(s.x[i]);
  }
  std::sort(out.begin(), out.end(), std::greater<float>());
  return out;
}

// The lowest value kept by top-k then top-p (-inf where neither cuts), as apply_top_k_top_p defines it:
// top-k keeps the k best (and their ties); top-p then keeps, of those k best first, each token whose
// better ones' probability (normalised over the k) is still below p, so the best token always stays.
float top_k_top_p_threshold(RowScratch& s, int64_t vocab, float best, const RowParams& p) {
  // Top-k: buckets before k_bucket hold only tokens among the k best; of k_bucket, its k_rest best.
  int32_t k_bucket = kExcluded;
  int64_t k_rest = 0, seen = 0;
  double k_mass = 0.0;  // the probability mass (unnormalised) of exactly the k best
  for (int32_t b = 0; b < kExcluded; ++b) {
    if (p.top_k < vocab && seen + s.count[b] >= p.top_k) {
      k_bucket = b, k_rest = p.top_k - seen;
      break;
    }
    seen += s.count[b];
    k_mass += s.mass[b];
  }
  float threshold = kNegInf;
  if (k_bucket < kExcluded) {
    const std::vector<float>& values = bucket_values(s, vocab, k_bucket);
    threshold = values[k_rest - 1];
    for (int64_t j = 0; j < k_rest; ++j) k_mass += std::exp(static_cast<double>(values[j]) - best);
  }
  if (!(p.top_p < 1.f)) return threshold;
  // Top-p: every token of the buckets before the one where the mass reaches p stays; in that bucket,
  // best first, each token whose better ones' mass is still below p.
  const double target = static_cast<double>(p.top_p) * k_mass;
  double before = 0.0;
  for (int32_t b = 0; b <= std::min(k_bucket, kFarBucket); ++b) {
    const bool in_k_bucket = b == k_bucket;
    if (!in_k_bucket && before + s.mass[b] < target) {
      before += s.mass[b];
      continue;
    }
    const std::vector<float>& values = bucket_values(s, vocab, b);
    const int64_t eligible = in_k_bucket ? k_rest : static_cast<int64_t>(values.size());
    float last_kept = values[0];
    for (int64_t j = 0; j < eligible && before < target; ++j) {
      last_kept = values[j];
      before += std::exp(static_cast<double>(values[j]) - best);
    }
    if (in_k_bucket || before >= target) return std::max(threshold, last_kept);
  }
  return threshold;  // rounding left the mass short of p: everything top-k kept stays
}

// The row's cut: x (logits / temperature) at or above it is kept. Fills the scratch for `draw`.
float row_threshold(RowScratch& s, const float* logits, int64_t vocab, const RowParams& p, float& best) {
  best = scale_row(logits, vocab, p.temperature, s.x.data());
  if (!(best > kNegInf)) return kNegInf;  // every token masked (or NaN): `draw` answers token 0
  const bool cuts = p.top_k < vocab || p.top_p < 1.f;
  weigh_row(s, vocab, best, cuts);
  float threshold = cuts ? top_k_top_p_threshold(s, vocab, best, p) : kNegInf;
  if (p.min_p > 0.f) threshold = std::max(threshold, best + std::log(p.min_p));  // as apply_min_p
  return threshold;
}

// Inverse CDF over the kept tokens in vocabulary order: the first whose running mass passes u * total.
int64_t draw(const RowScratch& s, int64_t vocab, float threshold, double u) {
  const __m512 cut = _mm512_set1_ps(threshold);
  const auto kept_weights = [&](int64_t i) {  // the weights of the kept tokens of the vector at i, 0 elsewhere
    const __mmask16 lanes = tokens_at(i, vocab);
    const __mmask16 kept = _mm512_mask_cmp_ps_mask(lanes, _mm512_maskz_loadu_ps(lanes, s.x.data() + i), cut,
                                                   _CMP_GE_OQ);
    return _mm512_maskz_loadu_ps(kept, s.weight.data() + i);
  };
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t i = 0; i < vocab; i += kLanes) lanes = _mm512_add_ps(lanes, kept_weights(i));
  const double target = u * _mm512_reduce_add_ps(lanes);
  double running = 0.0;
  for (int64_t i = 0; i < vocab; i += kLanes) {
    alignas(64) float weights[kLanes];
    _mm512_store_ps(weights, kept_weights(i));
    const double block = _mm512_reduce_add_ps(_mm512_load_ps(weights));
    if (running + block <= target) {  // the running mass crosses no token of this vector
      running += block;
      continue;
    }
    for (int64_t j = 0; j < kLanes; ++j) {
      running += weights[j];
      if (weights[j] > 0.f && running > target) return i + j;
    }
  }
  for (int64_t j = vocab - 1; j > 0; --j)  // rounding kept the walk at or below u * total: the last kept
    if (s.x[j] >= threshold && s.weight[j] > 0.f) return j;
  return 0;
}

struct RowsInput {
  const float* logits;
  int64_t rows, vocab;
  std::vector<RowParams> params;
};

RowsInput check_rows(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& top_k,
                     const torch::Tensor& top_p, const torch::Tensor& min_p) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous() &&
              logits.device().is_cpu(), "sample_rows: logits (R, V) contiguous float32 on CPU");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "sample_rows: 1 to 2^31 - 1 logits a row");
  for (const auto* t : {&temperature, &top_p, &min_p})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == rows, "sample_rows: one float32 parameter a row");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.numel() == rows, "sample_rows: one int64 top_k a row");
  const auto temperatures = temperature.contiguous(), ks = top_k.contiguous();
  const auto ps = top_p.contiguous(), min_ps = min_p.contiguous();
  RowsInput input{logits.data_ptr<float>(), rows, vocab, {}};
  for (int64_t r = 0; r < rows; ++r) {
    const RowParams p{temperatures.data_ptr<float>()[r], ps.data_ptr<float>()[r], min_ps.data_ptr<float>()[r],
                      std::clamp<int64_t>(ks.data_ptr<int64_t>()[r], 1, vocab)};
    TORCH_CHECK(p.temperature > 0.f && p.top_p > 0.f && p.top_p <= 1.f && p.min_p >= 0.f && p.min_p <= 1.f,
                "sample_rows: temperature > 0, top_p in (0, 1], min_p in [0, 1]");
    input.params.push_back(p);
  }
  return input;
}

// Each thread's scratch, kept between calls: ~2.4 MB at Qwen3's vocabulary, which allocated anew
// (zero-filled, page-faulted) would cost as much as the passes themselves.
RowScratch& thread_scratch(int64_t vocab) {
  thread_local RowScratch scratch(0);
  if (static_cast<int64_t>(scratch.x.size()) < vocab) scratch = RowScratch(vocab);
  return scratch;
}

// f(row, scratch) for every row, rows spread over the threads
template <typename F>
void for_each_row(const RowsInput& input, F&& f) {
  at::parallel_for(0, input.rows, 1, [&](int64_t begin, int64_t end) {
    RowScratch& scratch = thread_scratch(input.vocab);
    for (int64_t r = begin; r < end; ++r) f(r, scratch);
  });
}

}  // namespace

torch::Tensor sample_rows(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& top_k,
                          const torch::Tensor& top_p, const torch::Tensor& min_p, const torch::Tensor& uniform) {
  const RowsInput input = check_rows(logits, temperature, top_k, top_p, min_p);
  TORCH_CHECK(uniform.scalar_type() == at::kDouble && uniform.numel() == input.rows,
              "sample_rows: one float64 uniform in [0, 1) a row");
  const auto u = uniform.contiguous();
  auto tokens = torch::empty({input.rows}, logits.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  for_each_row(input, [&](int64_t r, RowScratch& s) {
    float best;
    const float threshold = row_threshold(s, input.logits + r * input.vocab, input.vocab, input.params[r], best);
    out[r] = best > kNegInf ? draw(s, input.vocab, threshold, u.data_ptr<double>()[r]) : 0;
  });
  return tokens;
}

torch::Tensor truncation_thresholds(const torch::Tensor& logits, const torch::Tensor& temperature,
                                    const torch::Tensor& top_k, const torch::Tensor& top_p,
                                    const torch::Tensor& min_p) {
  const RowsInput input = check_rows(logits, temperature, top_k, top_p, min_p);
  auto thresholds = torch::empty({input.rows}, logits.options());
  float* out = thresholds.data_ptr<float>();
  for_each_row(input, [&](int64_t r, RowScratch& s) {
    float best;
    out[r] = row_threshold(s, input.logits + r * input.vocab, input.vocab, input.params[r], best);
  });
  return thresholds;
}
