// int4 weights, four values a 16-bit word, with a float16 scale and a zero point per group of values along a
// row: weight[n, k] stands for (level - zero) * scale of its group, zero a uint8 per group or 8 for all.
//
// Layout (kernels/quantized.py packs it): each 128 values of a row take 64 bytes, 32 little-endian words;
// word j holds values j, 32 + j, 64 + j and 96 + j in its four nibbles, low to high. So one shift gives 32
// levels in order, one per 16-bit lane, with no shuffle.
//
// The matmul, where groups are whole blocks (128 values or a multiple; the default, AWQ's and GPTQ's): a level
// OR'd into the bits of bf16 128.0 is the bf16 of 128 + level, exactly (128 has 7 mantissa bits below it), so
// a level decodes with a shift and one bitwise op, without a table lookup, whose cross-lane permute cost
// more than the products. The pair products sum x . (128 + level) over a group, and the group's scale and
// zero apply to that sum: scale * (sum - (128 + zero) * sum of x over the group), the sums of x computed once
// a call. That is x . ((level - zero) * scale) up to fp32 rounding: the float32 dequantized weights, not
// their bf16 rounding (as int8 with one scale a row).
//
// Dequantizing, and the matmul for groups of 32 or 64 values (quantized_tiles.h multiplies): each group's 16
// values bf16((level - zero) * scale) sit in one register, built when a row's group starts, and VPERMW looks
// the 32 levels up in it: the bf16 weights the torch reference (and the prefill path's GEMM, through
// `dequantize`) rounds to.
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

// Where groups are whole blocks (see the top of the file): levels as bf16 128 + level, sums per group scaled.
constexpr int kBiasedLanesMask = 0x000F;
constexpr int kBiasBits = 0x4300;  // bf16 128.0
constexpr float kBias = 128.f;
constexpr int kLevelsOrBias = 0xEA;  // VPTERNLOG's truth table for (a & b) | c

// For each row m of x (M, K) and group g of `group` values along K: the fp32 sum of x's values, (M, G).
MILI_QUANTIZED torch::Tensor group_sums(const torch::Tensor& x, int64_t groups) {
  const int64_t M = x.size(0), K = x.size(1), group = K / groups;
  auto sums = torch::empty({M, groups}, torch::dtype(at::kFloat));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* out = sums.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += kPairLanes / 2) {
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * K + k));
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
      }
      out[m * groups + g] = _mm512_reduce_add_ps(sum);
    }
  return sums;
}

struct BiasedRows {
  const uint8_t* weight;
  const uint16_t* scales;  // float16
  const uint8_t* zeros;    // nullptr: symmetric
  const float* x_sums;     // (M, G), group_sums
  int64_t K, groups, group;

  // total[m] = -(each group's scale * (128 + zero) * sum of x over the group) of weight row n, in lanes, for MC
  // rows of x: the offsets the group sums carry, taken off before the sums.
  template <int MC>
  MILI_QUANTIZED void start_row(int64_t n, __m512 (&total)[MC]) const {
    for (int m = 0; m < MC; ++m) total[m] = _mm512_setzero_ps();
    for (int64_t first = 0; first < groups; first += kGroupsAtOnce) {
      const __mmask16 have = static_cast<__mmask16>((1u << std::min<int64_t>(kGroupsAtOnce, groups - first)) - 1);
      const __m512 group_scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(have, scales + n * groups + first));
      const __m512 zero = zeros ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(have, zeros + n * groups + first)))
                                : _mm512_set1_ps(kSymmetricZero);
      const __m512 weight_offset = _mm512_mul_ps(group_scale, _mm512_add_ps(zero, _mm512_set1_ps(kBias)));
      for (int m = 0; m < MC; ++m)
        total[m] = _mm512_fnmadd_ps(weight_offset, _mm512_maskz_loadu_ps(have, x_sums + m * groups + first), total[m]);
    }
  }

  // Blocks [block, block + U) of a row (bytes) against MC rows of x, into total: each block's sums of pair
  // products (two chains at MC 1) times its group's scale, block_scale[j]. A group of several blocks is scaled
  // block by block: the same products, summed in another order.
  template <int MC, int U>
  MILI_QUANTIZED void blocks(const uint8_t* bytes, const float (&block_scale)[U], const at::BFloat16* x, int64_t block,
                             __m512 (&total)[MC]) const {
    constexpr int C = MC == 1 ? 2 : 1;  // independent sums along a block per row of x
    const __m512i mask = _mm512_set1_epi16(kBiasedLanesMask), bias = _mm512_set1_epi16(kBiasBits);
    for (int j = 0; j < U; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(bytes + (block + j) * kBlock / 2) + kStreamAheadBytes, _MM_HINT_T0);
    __m512 acc[U][C][MC];
#pragma GCC unroll 4
    for (int j = 0; j < U; ++j) {
      const int64_t k = (block + j) * kBlock;
      const __m512i words = _mm512_loadu_si512(bytes + k / 2);
#pragma GCC unroll 4
      for (int u = 0; u < kBlockRegisters; ++u) {
        const __m512i levels = u == 0 ? words : _mm512_srli_epi16(words, 4 * u);
        const __m512bh w = (__m512bh)_mm512_ternarylogic_epi32(levels, mask, bias, kLevelsOrBias);
        for (int m = 0; m < MC; ++m) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k + u * kPairLanes);
          acc[j][u % C][m] = _mm512_dpbf16_ps(u < C ? _mm512_setzero_ps() : acc[j][u % C][m], xv, w);
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < U; ++j) {
      const __m512 group_scale = _mm512_set1_ps(block_scale[j]);
      for (int m = 0; m < MC; ++m)
        total[m] = _mm512_fmadd_ps(C == 2 ? _mm512_add_ps(acc[j][0][m], acc[j][C - 1][m]) : acc[j][0][m], group_scale,
                                   total[m]);
    }
  }

  // y[m * ldy + n - begin] for weight rows [begin, end) and MC rows of x (K apart) whose group sums start at
  // x_sums: one weight row at a time, streamed once for the MC rows; at MC 1 four blocks a step, so that eight
  // chains of pair products are in flight (one row's stream: several rows' streams read memory worse).
  template <int MC>
  MILI_QUANTIZED void rows(const at::BFloat16* x, int64_t begin, int64_t end, at::BFloat16* y, int64_t ldy) const {
    constexpr int U = MC == 1 ? 4 : 1;
    const int64_t row_blocks = K / kBlock, group_blocks = group / kBlock;
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* bytes = weight + n * (K / 2);
      const uint16_t* group_scale = scales + n * groups;  // the next block's group's
      int64_t group_left = group_blocks;                  // blocks of it to come
      // the next block's scale, straight from the row's float16s, its group by a count (no division per block)
      const auto next_scale = [&]() MILI_QUANTIZED {
        const float scale = _cvtsh_ss(*group_scale);
        if (--group_left == 0) ++group_scale, group_left = group_blocks;
        return scale;
      };
      __m512 total[MC];
      start_row<MC>(n, total);
      int64_t block = 0;
      for (; block + U <= row_blocks; block += U) {
        float block_scale[U];
        for (int j = 0; j < U; ++j) block_scale[j] = next_scale();
        blocks<MC, U>(bytes, block_scale, x, block, total);
      }
      for (; block < row_blocks; ++block) blocks<MC, 1>(bytes, {next_scale()}, x, block, total);
      for (int m = 0; m < MC; ++m) y[m * ldy + (n - begin)] = at::BFloat16(_mm512_reduce_add_ps(total[m]));
    }
  }
};

// BiasedRows over every row of x (M, K), in chunks of up to 8 rows (a weight row re-read from cache per chunk)
void multiply_biased(BiasedRows d, const at::BFloat16* x, int64_t M, int64_t begin, int64_t end, at::BFloat16* y,
                     int64_t ldy) {
  const float* x_sums = d.x_sums;
  for (int64_t m = 0; m < M; m += kMaxChunkRows) {
    d.x_sums = x_sums + m * d.groups;
    const at::BFloat16* xm = x + m * d.K;
    at::BFloat16* ym = y + m * ldy;
    switch (std::min<int64_t>(M - m, kMaxChunkRows)) {
      case 1: d.rows<1>(xm, begin, end, ym, ldy); break;
      case 2: d.rows<2>(xm, begin, end, ym, ldy); break;
      case 3: d.rows<3>(xm, begin, end, ym, ldy); break;
      case 4: d.rows<4>(xm, begin, end, ym, ldy); break;
      case 5: d.rows<5>(xm, begin, end, ym, ldy); break;
      case 6: d.rows<6>(xm, begin, end, ym, ldy); break;
      case 7: d.rows<7>(xm, begin, end, ym, ldy); break;
      default: d.rows<kMaxChunkRows>(xm, begin, end, ym, ldy); break;
    }
  }
}

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

  std::vector<torch::Tensor> prepare(const torch::Tensor& x) const override {
    if (biased()) return {group_sums(x, groups_)};
    return {};
  }

  void multiply(const torch::Tensor& x, const std::vector<torch::Tensor>& prepared, int64_t begin, int64_t end,
                at::BFloat16* y, int64_t ldy) const override {
    const auto* xb = x.data_ptr<at::BFloat16>();
    if (biased())
      multiply_biased({weight_.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales_.data_ptr<at::Half>()),
                       zeros_.numel() ? zeros_.data_ptr<uint8_t>() : nullptr, prepared[0].data_ptr<float>(), K_,
                       groups_, group_}, xb, x.size(0), begin, end, y, ldy);
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
  bool biased() const { return group_ % kBlock == 0; }  // BiasedRows multiplies

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

torch::Tensor gemm_int4(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales,
                        const torch::Tensor& zeros, int64_t slice_rows, bool widen_to_fp32) {
  return quantized_gemm(x, Int4Rows(weight, scales, zeros), weight.size(0), 2 * weight.size(1), slice_rows,
                        widen_to_fp32);
}
