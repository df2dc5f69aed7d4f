// int4 weights, two values a byte, with a float16 scale and a zero point per group of K / G values:
// weight[n, k] stands for (q[n, k] - zero) * scale of its group, zero a uint8 per group or 8 for all.
//
// Layout (kernels/quantized.py packs it): each 64 values of a row take 32 bytes, byte j holding value j in
// its low nibble and value 32 + j in its high one. A zero-extend to 16-bit lanes and a mask or a shift
// then give 32 values in order, each the index of its level in a 16-entry table, and one VPERMW per 32
// values looks up bf16((level - zero) * scale): the group's dequantized weights, exactly the bf16 values
// the torch reference (and the prefill path's GEMM) multiplies. The table is built once per group per row.
// One row of x multiplies the looked-up pairs with bf16 pair products (VDPBF16PS) as they stream in.
#include <torch/extension.h>
#include <immintrin.h>

#include "quantized_linear.h"

namespace {

#define MILI_INT4 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")))

constexpr int64_t kBlock = 64;        // values per 32 packed bytes
constexpr int64_t kHalf = kBlock / 2;  // values per looked-up register
constexpr float kSymmetricZero = 8.f;  // where no zero points are stored: levels 0..15 stand for -8..7
// Ask for the bytes 4 and 8 KB ahead into L2 once per 256 bytes read: linear_bf16's single-row nudge.
constexpr int64_t kStreamAheadBytes[] = {4096, 8192};
constexpr int64_t kPrefetchEvery = 512;  // values: 256 bytes

// bf16((level - zero) * scale) for levels 0..15, in the low half of a register (VPERMW reads its indices'
// low five bits; the high half is never looked up).
MILI_INT4 inline __m512i level_table(float scale, float zero) {
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 values = _mm512_mul_ps(_mm512_sub_ps(levels, _mm512_set1_ps(zero)), _mm512_set1_ps(scale));
  return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));
}

// 32 packed bytes -> values 0..31 of the block through `low`, 32..63 through `high`, as bf16
MILI_INT4 inline void unpack_block(const uint8_t* p, __m512i low, __m512i high, __m512i& first, __m512i& second) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  first = _mm512_permutexvar_epi16(_mm512_and_si512(bytes, _mm512_set1_epi16(0x0F)), low);
  second = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), high);
}

class Int4Rows final : public QuantizedRows {
 public:
  Int4Rows(const torch::Tensor& weight, const torch::Tensor& scales, const torch::Tensor& zeros)
      : weight_(weight), scales_(scales), zeros_(zeros), K_(2 * weight.size(1)), groups_(scales.size(1)),
        group_(groups_ > 0 ? K_ / groups_ : 0) {
    TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous() &&
                weight.device().is_cpu(), "int4 linear: weight (N, K / 2) uint8, contiguous, on CPU");
    TORCH_CHECK(K_ % kBlock == 0, "int4 linear: K must be a multiple of 64");
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 2 && scales.size(0) == weight.size(0) &&
                scales.is_contiguous(), "int4 linear: scales (N, G) float16");
    TORCH_CHECK(groups_ >= 1 && K_ % groups_ == 0 && (group_ == kHalf || group_ % kBlock == 0),
                "int4 linear: groups of 32 values or a multiple of 64 along K");
    TORCH_CHECK(zeros.numel() == 0 || (zeros.scalar_type() == at::kByte && zeros.sizes() == scales.sizes() &&
                                       zeros.is_contiguous()), "int4 linear: zeros (N, G) uint8, or none");
    packed_ = weight.data_ptr<uint8_t>();
    scale_bits_ = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
    zero_points_ = zeros.numel() ? zeros.data_ptr<uint8_t>() : nullptr;
  }

  bool streams_fp32_x() const override { return false; }

  MILI_INT4 void stream(const void* x, int64_t begin, int64_t end, at::BFloat16* y) const override {
    const auto* xb = static_cast<const at::BFloat16*>(x);
    for (int64_t n = begin; n < end; ++n) {
      // two blocks in flight, each with a sum per half: four chains of dependent pair products
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      const uint8_t* w = row(n);
      Tables tables;
      int64_t k = 0;
      for (; k + 2 * kBlock <= K_; k += 2 * kBlock) {
        if (k % kPrefetchEvery == 0)
          for (const int64_t ahead : kStreamAheadBytes) _mm_prefetch(reinterpret_cast<const char*>(w + k / 2) + ahead, _MM_HINT_T1);
        advance(n, k, tables);
        multiply_block(xb + k, w + k / 2, tables, acc[0], acc[1]);
        advance(n, k + kBlock, tables);
        multiply_block(xb + k + kBlock, w + (k + kBlock) / 2, tables, acc[2], acc[3]);
      }
      if (k < K_) {  // K is a multiple of 64, not always of 128
        advance(n, k, tables);
        multiply_block(xb + k, w + k / 2, tables, acc[0], acc[1]);
      }
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
      y[n - begin] = at::BFloat16(_mm512_reduce_add_ps(sum));
    }
  }

  MILI_INT4 void dequantize(int64_t begin, int64_t end, at::BFloat16* out) const override {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* w = row(n);
      at::BFloat16* o = out + (n - begin) * K_;
      Tables tables;
      for (int64_t k = 0; k < K_; k += kBlock) {
        advance(n, k, tables);
        __m512i first, second;
        unpack_block(w + k / 2, tables.low, tables.high, first, second);
        _mm512_storeu_si512(o + k, first);
        _mm512_storeu_si512(o + k + kHalf, second);
      }
    }
  }

 private:
  // The level tables of the block being read: `low` for its values 0..31, `high` for 32..63.
  struct Tables {
    __m512i low, high;
    int64_t next_group = 0;  // the group the next table comes from
    int64_t group_end = 0;   // the K where the tables' group ends
  };

  const uint8_t* row(int64_t n) const { return packed_ + n * (K_ / 2); }

  // first += x[0..31] . values 0..31 of the block at w; second += x[32..63] . values 32..63
  MILI_INT4 static void multiply_block(const at::BFloat16* x, const uint8_t* w, const Tables& tables, __m512& first,
                                       __m512& second) {
    __m512i low, high;
    unpack_block(w, tables.low, tables.high, low, high);
    first = _mm512_dpbf16_ps(first, (__m512bh)_mm512_loadu_si512(x), (__m512bh)low);
    second = _mm512_dpbf16_ps(second, (__m512bh)_mm512_loadu_si512(x + kHalf), (__m512bh)high);
  }

  MILI_INT4 __m512i table(int64_t n, int64_t g) const {
    const int64_t i = n * groups_ + g;
    return level_table(_cvtsh_ss(scale_bits_[i]), zero_points_ ? static_cast<float>(zero_points_[i]) : kSymmetricZero);
  }

  // Row n's tables for the block at k (blocks visited in order): a group's table is built once.
  MILI_INT4 void advance(int64_t n, int64_t k, Tables& tables) const {
    if (group_ == kHalf) {  // each half of a block is a group of its own
      tables.low = table(n, tables.next_group++);
      tables.high = table(n, tables.next_group++);
    } else if (k == tables.group_end) {
      tables.low = tables.high = table(n, tables.next_group++);
      tables.group_end += group_;
    }
  }

  torch::Tensor weight_, scales_, zeros_;  // held: the pointers below are theirs
  int64_t K_, groups_, group_;  // K, groups per row, values per group
  const uint8_t* packed_;
  const uint16_t* scale_bits_;      // float16
  const uint8_t* zero_points_;      // nullptr: symmetric
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
