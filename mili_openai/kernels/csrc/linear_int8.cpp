// int8 weights (N, K) with float32 scales per output row, or per group of values along a row:
// weight[n, k] stands for q[n, k] * scales[n, k / (K / G)] (symmetric, no zero point).
//
// Decoding (quantized_tiles.h multiplies): 16 values widen with a sign extend and a convert, and two such
// vectors pack into 32 bf16. With one scale per row the bf16 values are the exact integers and the scale
// multiplies each finished sum, so the result is x . (q * scale) up to fp32 rounding; with groups each
// group's scale multiplies the widened values first, giving bf16(q * scale), the bf16 weights the torch
// reference (and the prefill path's GEMM, through `dequantize`) rounds to.
#include <torch/extension.h>
#include <immintrin.h>

#include <vector>

#include "quantized_linear.h"
#include "quantized_tiles.h"

namespace {

using namespace mili::quantized;
constexpr int64_t kLanes = 16;  // fp32 values per 512-bit register

MILI_QUANTIZED inline __m512 widen_int8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 32 values at p, each times `scale`, as bf16
MILI_QUANTIZED inline __m512i scaled_pairs(const int8_t* p, __m512 scale) {
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(widen_int8(p + kLanes), scale), _mm512_mul_ps(widen_int8(p), scale));
}

// Rows with one scale each (kGrouped false) or a scale per group of `group` values.
template <bool kGrouped>
struct Int8Decoder {
  static constexpr int64_t kBlockBytes = kBlockValues;
  struct Row {
    const int8_t* values;
    const float* scales;    // the row's scale; where grouped, the next group's
    __m512 scale;           // the group's, where grouped
    int64_t group_end = 0;  // where the group in `scale` ends
  };

  const int8_t* weight;
  const float* scales;
  int64_t K, groups, group;

  Row row(int64_t n) const { return {weight + n * K, scales + n * groups, _mm512_setzero_ps()}; }
  const char* address(const Row& row, int64_t k) const { return reinterpret_cast<const char*>(row.values + k); }

  MILI_QUANTIZED __m512i weights(Row& row, int64_t block, int u) const {
    const int64_t k = block + u * kPairLanes;
    const int8_t* p = row.values + k;
    if constexpr (kGrouped) {
      if (k == row.group_end) row.scale = _mm512_set1_ps(*row.scales++), row.group_end += group;  // in order
      return scaled_pairs(p, row.scale);
    } else {
      return (__m512i)_mm512_cvtne2ps_pbh(widen_int8(p + kLanes), widen_int8(p));
    }
  }

  float finish(const Row& row, float sum) const { return kGrouped ? sum : sum * row.scales[0]; }
};

class Int8Rows final : public QuantizedRows {
 public:
  Int8Rows(const torch::Tensor& weight, const torch::Tensor& scales)
      : weight_(weight), scales_(scales), K_(weight.size(1)), groups_(scales.size(1)),
        group_(groups_ > 0 ? K_ / groups_ : 0) {
    TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous() &&
                weight.device().is_cpu(), "int8 linear: weight (N, K) int8, contiguous, on CPU");
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == weight.size(0) &&
                scales.is_contiguous(), "int8 linear: scales (N, G) float32");
    TORCH_CHECK(groups_ >= 1 && K_ % groups_ == 0 && group_ % kPairLanes == 0,
                "int8 linear: groups (or rows) of a multiple of 32 values along K");
  }

  std::vector<torch::Tensor> prepare(const torch::Tensor&) const override { return {}; }

  void multiply(const torch::Tensor& x, const std::vector<torch::Tensor>&, int64_t begin, int64_t end,
                at::BFloat16* y, int64_t ldy) const override {
    const auto* xb = x.data_ptr<at::BFloat16>();
    if (groups_ == 1)
      multiply_rows(decoder<false>(), xb, x.size(0), K_, begin, end, y, ldy);
    else
      multiply_rows(decoder<true>(), xb, x.size(0), K_, begin, end, y, ldy);
  }

  void dequantize(int64_t begin, int64_t end, at::BFloat16* out) const override {
    decode_rows(decoder<true>(), K_, begin, end, out);
  }

 private:
  template <bool kGrouped>
  Int8Decoder<kGrouped> decoder() const {
    return {weight_.data_ptr<int8_t>(), scales_.data_ptr<float>(), K_, groups_, group_};
  }

  torch::Tensor weight_, scales_;
  int64_t K_, groups_, group_;  // K, groups per row, values per group
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

torch::Tensor gemm_int8(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales, int64_t slice_rows,
                        bool widen_to_fp32) {
  return quantized_gemm(x, Int8Rows(weight, scales), weight.size(0), weight.size(1), slice_rows, widen_to_fp32);
}
