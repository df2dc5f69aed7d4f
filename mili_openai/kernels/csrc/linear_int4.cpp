// int4 weights, four values a 16-bit word, with a float16 scale and a zero point per group of values along a
// row: weight[n, k] stands for (level - zero) * scale of its group, zero a uint8 per group or 8 for all.
//
// Layout (kernels/quantized.py packs it): each 128 values of a row take 64 bytes, 32 little-endian words;
// word j holds values j, 32 + j, 64 + j and 96 + j in its four nibbles, low to high. So one shift gives 32
// levels in order, one per 16-bit lane, with no shuffle.
//
// Decoding (quantized_tiles.h multiplies): each group's 16 values bf16((level - zero) * scale) sit in one
// register, built when a row's group starts, and VPERMW looks the 32 levels up in it: the bf16 weights the
// torch reference (and the prefill path's GEMM, through `dequantize`) rounds to.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "quantized_linear.h"
#include "quantized_tiles.h"

namespace {

using namespace mili::quantized;

constexpr int64_t kBlock = kBlockValues;  // values per 64 packed bytes: a block of the tiles
constexpr float kSymmetricZero = 8.f;  // where no zero points are stored: levels 0..15 stand for -8..7

constexpr int64_t kGroupsAtOnce = 16;  // groups whose scales and zero points a row widens to fp32 at once

// bf16((level - zero) * scale) for levels 0..15, as level * scale + offset with offset = -zero * scale (both
// products exact, so one rounding, as the reference's), in both halves of a register: VPERMW reads its
// indices' low five bits, so a shifted word's next nibble (bit 4 up) needs no mask.
MILI_QUANTIZED inline __m512i level_table(float scale, float offset) {
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 values = _mm512_fmadd_ps(levels, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
  return (__m512i)_mm512_cvtne2ps_pbh(values, values);
}

// Rows whose groups are whole blocks (kWholeBlocks: 128 values or a multiple), or of 32 or 64 values.
template <bool kWholeBlocks>
struct Int4Decoder {
  static constexpr int64_t kBlockBytes = kBlockValues / 2;
  struct Row {
    const uint8_t* bytes;
    const uint16_t* scales;  // float16
    const uint8_t* zeros;    // nullptr: symmetric
    __m512i table;           // the group's level table
    int64_t group_end;       // where the group in `table` ends
    uint64_t next_group;     // the group after it
    alignas(64) float scale[kGroupsAtOnce], offset[kGroupsAtOnce];  // of 16 groups, from a multiple of 16
  };

  const uint8_t* weight;
  const uint16_t* scales;
  const uint8_t* zeros;
  int64_t K, groups, group;

  Row row(int64_t n) const {
    Row row;
    row.bytes = weight + n * (K / 2);
    row.scales = scales + n * groups;
    row.zeros = zeros ? zeros + n * groups : nullptr;
    row.group_end = 0;
    row.next_group = 0;
    return row;
  }
  const char* address(const Row& row, int64_t k) const { return reinterpret_cast<const char*>(row.bytes + k / 2); }

  // The row's groups [first, first + 16) (those it has): scales and offsets in fp32, one conversion for all.
  MILI_QUANTIZED void widen_groups(Row& row, int64_t first) const {
    const __mmask16 have = static_cast<__mmask16>((1u << std::min<int64_t>(kGroupsAtOnce, groups - first)) - 1);
    const __m512 scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(have, row.scales + first));
    const __m512 zero = row.zeros ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(have, row.zeros + first)))
                                  : _mm512_set1_ps(kSymmetricZero);
    _mm512_store_ps(row.scale, scale);
    _mm512_store_ps(row.offset, _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(zero, scale)));
  }

  MILI_QUANTIZED __m512i weights(Row& row, int64_t block, int u) const {
    if ((!kWholeBlocks || u == 0) && block + u * kPairLanes == row.group_end) {  // the next group starts
      const uint64_t g = row.next_group++;
      if (g % kGroupsAtOnce == 0) widen_groups(row, static_cast<int64_t>(g));
      row.table = level_table(row.scale[g % kGroupsAtOnce], row.offset[g % kGroupsAtOnce]);
      row.group_end += group;
    }
    const __m512i words = _mm512_loadu_si512(row.bytes + block / 2);
    return _mm512_permutexvar_epi16(u == 0 ? words : _mm512_srli_epi16(words, 4 * u), row.table);
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
    const auto* xb = x.data_ptr<at::BFloat16>();
    if (group_ % kBlock == 0)
      multiply_rows(decoder<true>(), xb, x.size(0), K_, begin, end, y, ldy);
    else
      multiply_rows(decoder<false>(), xb, x.size(0), K_, begin, end, y, ldy);
  }

  void dequantize(int64_t begin, int64_t end, at::BFloat16* out) const override {
    if (group_ % kBlock == 0)
      decode_rows(decoder<true>(), K_, begin, end, out);
    else
      decode_rows(decoder<false>(), K_, begin, end, out);
  }

 private:
  template <bool kWholeBlocks>
  Int4Decoder<kWholeBlocks> decoder() const {
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
