// int4 weights, four values a 16-bit word, with a float16 scale and a zero point per group of values along a
// row: weight[n, k] stands for (level - zero) * scale of its group, zero a uint8 per group or 8 for all.
//
// Layout (kernels/quantized.py packs it): each 128 values of a row take 64 bytes, 32 little-endian words;
// word j holds values j, 32 + j, 64 + j and 96 + j in its four nibbles, low to high. So one shift and one
// mask give 32 levels in order, one per 16-bit lane, with no shuffle.
//
// Decoding (quantized_tiles.h multiplies): each group's 16 values bf16((level - zero) * scale) sit in one
// register, built when a row's group starts, and VPERMW looks the 32 levels up in it: the bf16 weights the
// torch reference (and the prefill path's GEMM, through `dequantize`) rounds to.
#include <torch/extension.h>
#include <immintrin.h>

#include <vector>

#include "quantized_linear.h"
#include "quantized_tiles.h"

namespace {

using namespace mili::quantized;

constexpr int64_t kBlock = 128;        // values per 64 packed bytes
constexpr float kSymmetricZero = 8.f;  // where no zero points are stored: levels 0..15 stand for -8..7

// bf16((level - zero) * scale) for levels 0..15, in the low half of a register (VPERMW reads its indices'
// low five bits; the high half is never looked up).
MILI_QUANTIZED inline __m512i level_table(float scale, float zero) {
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 values = _mm512_mul_ps(_mm512_sub_ps(levels, _mm512_set1_ps(zero)), _mm512_set1_ps(scale));
  return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));
}

struct Int4Decoder {
  static constexpr int64_t kPrefetchValues = 1024;
  struct Row {
    const uint8_t* bytes;
    const uint16_t* scales;  // float16
    const uint8_t* zeros;    // nullptr: symmetric
    __m512i table;           // the group's level table
    int64_t group_end = 0;   // where the group in `table` ends
  };

  const uint8_t* weight;
  const uint16_t* scales;
  const uint8_t* zeros;
  int64_t K, groups, group;

  Row row(int64_t n) const {
    return {weight + n * (K / 2), scales + n * groups, zeros ? zeros + n * groups : nullptr, _mm512_setzero_si512()};
  }
  const char* address(const Row& row, int64_t k) const { return reinterpret_cast<const char*>(row.bytes + k / 2); }

  MILI_QUANTIZED __m512i weights(Row& row, int64_t k) const {
    if (k == row.group_end) {
      const int64_t g = k / group;
      row.table = level_table(_cvtsh_ss(row.scales[g]), row.zeros ? static_cast<float>(row.zeros[g]) : kSymmetricZero);
      row.group_end += group;
    }
    const __m512i words = _mm512_loadu_si512(row.bytes + (k / kBlock) * (kBlock / 2));
    const __m128i shift = _mm_cvtsi64_si128(4 * ((k % kBlock) / kPairLanes));
    return _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srl_epi16(words, shift), _mm512_set1_epi16(0x000F)),
                                    row.table);
  }

  float finish(const Row&, float sum) const { return sum; }
};

class Int4Rows final : public QuantizedRows {
 public:
  Int4Rows(const torch::Tensor& weight, const torch::Tensor& scales, const torch::Tensor& zeros)
      : weight_(weight), scales_(scales), zeros_(zeros), K_(2 * weight.size(1)), groups_(scales.size(1)),
        group_(groups_ > 0 ? K_ / groups_ : 0) {
    TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous() &&
                weight.device().is_cpu(), "int4 linear: weight (N, K / 2) uint8, contiguous, on CPU");
    TORCH_CHECK(K_ % kBlock == 0, "int4 linear: K must be a multiple of 128");
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 2 && scales.size(0) == weight.size(0) &&
                scales.is_contiguous(), "int4 linear: scales (N, G) float16");
    TORCH_CHECK(groups_ >= 1 && K_ % groups_ == 0 && group_ % kPairLanes == 0,
                "int4 linear: groups of a multiple of 32 values along K");
    TORCH_CHECK(zeros.numel() == 0 || (zeros.scalar_type() == at::kByte && zeros.sizes() == scales.sizes() &&
                                       zeros.is_contiguous()), "int4 linear: zeros (N, G) uint8, or none");
  }

  std::vector<torch::Tensor> prepare(const torch::Tensor&) const override { return {}; }

  void multiply(const torch::Tensor& x, const std::vector<torch::Tensor>&, int64_t begin, int64_t end,
                at::BFloat16* y, int64_t ldy) const override {
    multiply_rows(decoder(), x.data_ptr<at::BFloat16>(), x.size(0), K_, begin, end, y, ldy);
  }

  MILI_QUANTIZED void dequantize(int64_t begin, int64_t end, at::BFloat16* out) const override {
    const Int4Decoder d = decoder();
    for (int64_t n = begin; n < end; ++n) {
      auto row = d.row(n);
      for (int64_t k = 0; k < K_; k += kPairLanes) _mm512_storeu_si512(out + (n - begin) * K_ + k, d.weights(row, k));
    }
  }

 private:
  Int4Decoder decoder() const {
    return {weight_.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales_.data_ptr<at::Half>()),
            zeros_.numel() ? zeros_.data_ptr<uint8_t>() : nullptr, K_, groups_, group_};
  }

  torch::Tensor weight_, scales_, zeros_;
  int64_t K_, groups_, group_;  // K, groups per row, values per group
};

}  // namespace

std::unique_ptr<QuantizedRows> int4_rows(const torch::Tensor& weight, const torch::Tensor& scales,
                                         const torch::Tensor& zeros) {
  return std::make_unique<Int4Rows>(weight, scales, zeros);
}

torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales,
                          const torch::Tensor& zeros) {
  return quantized_linear(x, Int4Rows(weight, scales, zeros), weight.size(0), 2 * weight.size(1));
}

torch::Tensor dequantize_int4(const torch::Tensor& weight, const torch::Tensor& scales, const torch::Tensor& zeros) {
  return quantized_dequantize(Int4Rows(weight, scales, zeros), weight.size(0), 2 * weight.size(1));
}
