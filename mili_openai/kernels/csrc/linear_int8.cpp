// int8 weights (N, K) with float32 scales per output row, or per group of K / G values along a row:
// weight[n, k] stands for q[n, k] * scales[n, k / (K / G)] (symmetric, no zero point).
//
// One row of x streams the weights as fp32 FMAs over the exact integers: 16 weights widen with a sign
// extend and a convert, and a row's scale multiplies its finished sum (with several groups, each group's
// scale multiplies the widened weights instead). So the result is x . (q * s) rounded once, to bf16.
// Several rows of x take blocks of bf16(q * s) (dequantize), as the prefill path's GEMM takes them.
#include <torch/extension.h>
#include <immintrin.h>

#include "quantized_linear.h"
#include "simd_bf16.h"

namespace {

using mili::kLanes;
#define MILI_INT8 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int kUnroll = 8;  // independent partial sums along K: FMA latency x ports, as linear_bf16's stream
constexpr int64_t kStep = kUnroll * kLanes;  // 128 weights: two cache lines per step
// Ask for the lines 8 and 16 KB ahead into L2 once per 256 bytes (two steps): the nudge that keeps the
// hardware prefetchers ahead of linear_bf16's single-row stream.
constexpr int64_t kStreamAheadBytes[] = {8192, 16384};

MILI_INT8 inline __m512 widen_int8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

class Int8Rows final : public QuantizedRows {
 public:
  Int8Rows(const torch::Tensor& weight, const torch::Tensor& scales)
      : weight_(weight), scales_(scales), K_(weight.size(1)), groups_(scales.size(1)),
        group_(groups_ > 0 ? K_ / groups_ : 0) {
    TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous() &&
                weight.device().is_cpu(), "int8 linear: weight (N, K) int8, contiguous, on CPU");
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == weight.size(0) &&
                scales.is_contiguous(), "int8 linear: scales (N, G) float32");
    TORCH_CHECK(groups_ >= 1 && K_ % groups_ == 0 && group_ % kLanes == 0 &&
                (groups_ == 1 || (group_ & (group_ - 1)) == 0),
                "int8 linear: one group per row, or groups of a power of two (at least 16) values along K");
    while ((int64_t{1} << group_shift_) < group_) ++group_shift_;
    values_ = weight.data_ptr<int8_t>();
    scale_values_ = scales.data_ptr<float>();
  }

  bool streams_fp32_x() const override { return true; }

  void stream(const void* x, int64_t begin, int64_t end, at::BFloat16* y) const override {
    const auto* xf = static_cast<const float*>(x);
    for (int64_t n = begin; n < end; ++n) y[n - begin] = at::BFloat16(groups_ == 1 ? row_dot(xf, n) : grouped_row_dot(xf, n));
  }

  MILI_INT8 void dequantize(int64_t begin, int64_t end, at::BFloat16* out) const override {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* w = row(n);
      at::BFloat16* o = out + (n - begin) * K_;
      for (int64_t g = 0; g < groups_; ++g) {
        const __m512 scale = _mm512_set1_ps(scale_values_[n * groups_ + g]);
        const int64_t stop = (g + 1) * group_;
        int64_t k = g * group_;
        for (; k + 2 * kLanes <= stop; k += 2 * kLanes) {
          const __m512 first = _mm512_mul_ps(widen_int8(w + k), scale);
          const __m512 second = _mm512_mul_ps(widen_int8(w + k + kLanes), scale);
          _mm512_storeu_si512(o + k, (__m512i)_mm512_cvtne2ps_pbh(second, first));
        }
        if (k < stop)  // a group of an odd multiple of 16 values
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(widen_int8(w + k), scale)));
      }
    }
  }

 private:
  const int8_t* row(int64_t n) const { return values_ + n * K_; }

  // x . q[n] over the exact integers, then the row's scale
  MILI_INT8 float row_dot(const float* x, int64_t n) const {
    const int8_t* w = row(n);
    __m512 acc[kUnroll];
    for (auto& a : acc) a = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + kStep <= K_; k += kStep) {
      if (k % (2 * kStep) == 0)
        for (const int64_t ahead : kStreamAheadBytes) _mm_prefetch(reinterpret_cast<const char*>(w + k) + ahead, _MM_HINT_T1);
      for (int u = 0; u < kUnroll; ++u)
        acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + u * kLanes), widen_int8(w + k + u * kLanes), acc[u]);
    }
    for (; k < K_; k += kLanes) acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), widen_int8(w + k), acc[0]);
    return reduce(acc) * scale_values_[n];
  }

  // x . (q[n] * group scales): each group's scale multiplies its widened weights (groups of 2^shift values)
  MILI_INT8 float grouped_row_dot(const float* x, int64_t n) const {
    const int8_t* w = row(n);
    const float* scales = scale_values_ + n * groups_;
    __m512 acc[kUnroll];
    for (auto& a : acc) a = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + kStep <= K_; k += kStep) {
      if (k % (2 * kStep) == 0)
        for (const int64_t ahead : kStreamAheadBytes) _mm_prefetch(reinterpret_cast<const char*>(w + k) + ahead, _MM_HINT_T1);
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t at = k + u * kLanes;
        const __m512 weights = _mm512_mul_ps(widen_int8(w + at), _mm512_set1_ps(scales[at >> group_shift_]));
        acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + at), weights, acc[u]);
      }
    }
    for (; k < K_; k += kLanes)
      acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_mul_ps(widen_int8(w + k), _mm512_set1_ps(scales[k >> group_shift_])), acc[0]);
    return reduce(acc);
  }

  MILI_INT8 static float reduce(const __m512 (&acc)[kUnroll]) {
    __m512 sum = acc[0];
    for (int u = 1; u < kUnroll; ++u) sum = _mm512_add_ps(sum, acc[u]);
    return _mm512_reduce_add_ps(sum);
  }

  torch::Tensor weight_, scales_;
  int64_t K_, groups_, group_;  // K, groups per row, values per group
  int group_shift_ = 0;  // log2(group_) where there are several groups
  const int8_t* values_;  // weight_'s
  const float* scale_values_;  // scales_'s
};

}  // namespace

std::unique_ptr<QuantizedRows> int8_rows(const torch::Tensor& weight, const torch::Tensor& scales) {
  return std::make_unique<Int8Rows>(weight, scales);
}

torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales) {
  return quantized_linear(x, Int8Rows(weight, scales), weight.size(0), weight.size(1));
}

torch::Tensor dequantize_int8(const torch::Tensor& weight, const torch::Tensor& scales) {
  return quantized_dequantize(Int8Rows(weight, scales), weight.size(0), weight.size(1));
}
