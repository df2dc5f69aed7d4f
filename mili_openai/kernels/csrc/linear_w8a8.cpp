// W8A8: int8 weights (linear_int8.cpp's layout) times bf16 x quantized to int8 levels first, multiplied as
// integers with AVX512-VNNI and scaled once per output value.
//
// x's rows quantize as kernels/quantized.py's `quantize_int8_rows` does, the same float32 operations in the
// same order (bit-identical levels and scales): per token, s = amax / 127 and q = round(x * ((1 / amax) * 127))
// (torch's `127 / amax` is a reciprocal times 127); or with a static scale, q = round(x / s); rounding half to
// even, clamped to [-128, 127].
//
// VPDPBUSD multiplies unsigned by signed bytes, so x goes in as q + 128 (q ^ 0x80) and each weight row's sum
// comes out of the same pass, one more VPDPBUSD of all-ones against each weight register (shared by every row of
// x in the chunk): q . w = (q + 128) . w - 128 * sum(w), exact in int32 (|sums| < 2^31 for K <= kMaxK).
// y = bf16((s_x * s_w) * dot); with groups, each group's int32 lanes become fp32 and take its scale (a
// group's lane sums stay below 2^24, exact in fp32).
#include <torch/extension.h>
#include <immintrin.h>

#include <memory>
#include <vector>

#include "kernels.h"
#include "quantized_linear.h"
#include "quantized_tiles.h"

namespace {

#define MILI_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

using mili::quantized::kCacheLine;
using mili::quantized::kStreamAheadBytes;
constexpr int64_t kBytes = 64;           // int8 values per register
constexpr int64_t kLanes = 16;           // fp32 values per register
constexpr int64_t kRowValues = 32;       // rows of one scale: K a multiple of this (a half-register tail)
constexpr int64_t kMaxK = 65536;         // K * 255 * 128 stays below 2^31
constexpr int kMaxChunkRows = 8;         // rows of x per tile
constexpr float kLevelMax = 127.0f, kLevelMin = -128.0f;
constexpr uint8_t kLevelOffset = 0x80;   // q ^ 0x80 == q + 128 as an unsigned byte

MILI_VNNI inline __m512 load_bf16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Row m's levels (XOR `offset`: 0 for q, 0x80 for q + 128) and scale, from bf16 x (K a multiple of 16).
MILI_VNNI void quantize_row(const at::BFloat16* x, int64_t K, const float* static_scale, uint8_t offset,
                            uint8_t* levels, float* scale) {
  __m512 multiplier;  // dynamic: values times it; static: values divided by it
  if (static_scale == nullptr) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += kLanes) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16(x + k)));
    const float top = _mm512_reduce_max_ps(amax);
    *scale = top / kLevelMax;
    multiplier = _mm512_set1_ps(top > 0.0f ? (1.0f / top) * kLevelMax : 0.0f);
  } else {
    *scale = *static_scale;
    multiplier = _mm512_set1_ps(*static_scale);
  }
  const __m512 low = _mm512_set1_ps(kLevelMin), high = _mm512_set1_ps(kLevelMax);
  const __m128i flip = _mm_set1_epi8(static_cast<char>(offset));
  for (int64_t k = 0; k < K; k += kLanes) {
    const __m512 v = load_bf16(x + k);
    __m512 q = static_scale == nullptr ? _mm512_mul_ps(v, multiplier) : _mm512_div_ps(v, multiplier);
    q = _mm512_min_ps(_mm512_max_ps(q, low), high);  // clamping before rounding: the bounds are integers
    const __m512i ints = _mm512_cvt_roundps_epi32(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(levels + k), _mm_xor_si128(_mm512_cvtepi32_epi8(ints), flip));
  }
}

void quantize_rows(const torch::Tensor& x, const torch::Tensor& static_scale, uint8_t offset, torch::Tensor& levels,
                   torch::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1);
  const auto* xp = x.data_ptr<at::BFloat16>();
  const float* sp = static_scale.numel() ? static_scale.data_ptr<float>() : nullptr;
  auto* lp = static_cast<uint8_t*>(levels.data_ptr());  // int8 q, or uint8 q + 128
  auto* scp = scales.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, sp, offset, lp + m * K, scp + m);
}

void check_static_scale(const torch::Tensor& static_scale) {
  TORCH_CHECK(static_scale.numel() == 0 || (static_scale.numel() == 1 && static_scale.scalar_type() == at::kFloat &&
                                            static_scale.device().is_cpu()),
              "int8 activations: a static scale is one float32 value (empty: per token, dynamic)");
}

inline __mmask64 tail_mask(int64_t left) { return left >= kBytes ? ~0ULL : (1ULL << left) - 1; }

struct Operands {
  const uint8_t* x;        // (M, K) levels + 128
  const float* x_scales;   // (M,)
  const int8_t* weight;    // (N, K)
  const float* scales;     // (N, G)
  int64_t K, groups, group;
};

// Tile sizes within 32 registers: MC * R int32 sums (and as many fp32 ones where grouped), R weights, R sums of
// weights. One weight row streams alone for one or two rows of x; more share each x load among weight rows.
template <int MC, bool kGrouped> constexpr int tile_rows() {
  return MC <= 2 ? 1 : kGrouped ? (MC <= 4 ? 2 : 1) : (MC <= 4 ? 4 : 2);
}
// independent sums along K per (x row, weight row): enough VPDPBUSD chains in flight
template <int MC, bool kGrouped> constexpr int tile_unroll() { return kGrouped ? 1 : MC == 1 ? 4 : MC == 2 ? 2 : 1; }

// y[m * ldy + r] for MC rows of x and weight rows n .. n + R - 1.
template <int MC, int R, bool kGrouped>
MILI_VNNI inline void tile(const Operands& o, int64_t n, at::BFloat16* y, int64_t ldy) {
  constexpr int U = tile_unroll<MC, kGrouped>();
  const int64_t K = o.K;
  const int64_t span = kGrouped ? o.group : K;  // values summed in int32 before they are scaled
  const int8_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = o.weight + (n + r) * K;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512 scaled[MC][R];  // grouped: the groups' scaled sums so far
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) scaled[m][r] = _mm512_setzero_ps();
  int64_t dots[MC][R];
  for (int64_t start = 0; start < K; start += span) {
    __m512i acc[U][MC][R], wsum[U][R];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < R; ++r) {
        wsum[u][r] = _mm512_setzero_si512();
        for (int m = 0; m < MC; ++m) acc[u][m][r] = _mm512_setzero_si512();
      }
    const int64_t end = start + span;
    for (int64_t k = start; k < end; k += U * kBytes) {
      // every row of the tile asks for its lines ahead: the products keep pace with memory, and left to the
      // hardware prefetchers, tiles of several rows wait on line after line
      for (int r = 0; r < R; ++r)
        for (int64_t line = 0; line < U * kBytes; line += kCacheLine)
          _mm_prefetch(reinterpret_cast<const char*>(rows[r] + k) + line + kStreamAheadBytes, _MM_HINT_T0);
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const int64_t ku = k + u * kBytes;
        if (u > 0 && ku >= end) break;
        const __mmask64 mask = tail_mask(end - ku);
        __m512i w[R];
        for (int r = 0; r < R; ++r) {
          w[r] = _mm512_maskz_loadu_epi8(mask, rows[r] + ku);
          wsum[u][r] = _mm512_dpbusd_epi32(wsum[u][r], ones, w[r]);
        }
        for (int m = 0; m < MC; ++m) {
          const __m512i xv = _mm512_maskz_loadu_epi8(mask, o.x + m * K + ku);
          for (int r = 0; r < R; ++r) acc[u][m][r] = _mm512_dpbusd_epi32(acc[u][m][r], xv, w[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512i offset = wsum[0][r];
      for (int u = 1; u < U; ++u) offset = _mm512_add_epi32(offset, wsum[u][r]);
      offset = _mm512_slli_epi32(offset, 7);  // 128 * the weights' sums, lane by lane
      for (int m = 0; m < MC; ++m) {
        __m512i dot = acc[0][m][r];
        for (int u = 1; u < U; ++u) dot = _mm512_add_epi32(dot, acc[u][m][r]);
        dot = _mm512_sub_epi32(dot, offset);
        if constexpr (kGrouped)
          scaled[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                         _mm512_set1_ps(o.scales[(n + r) * o.groups + start / span]), scaled[m][r]);
        else
          dots[m][r] = _mm512_reduce_add_epi32(dot);
      }
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < R; ++r) {
      const float value = kGrouped ? o.x_scales[m] * _mm512_reduce_add_ps(scaled[m][r])
                                   : (o.x_scales[m] * o.scales[n + r]) * static_cast<float>(dots[m][r]);
      y[m * ldy + r] = at::BFloat16(value);
    }
}

template <int MC, bool kGrouped>
MILI_VNNI void rows_chunk(const Operands& o, int64_t begin, int64_t end, at::BFloat16* y, int64_t ldy) {
  constexpr int R = tile_rows<MC, kGrouped>();
  int64_t n = begin;
  for (; n + R <= end; n += R) tile<MC, R, kGrouped>(o, n, y + (n - begin), ldy);
  for (; n < end; ++n) tile<MC, 1, kGrouped>(o, n, y + (n - begin), ldy);
}

// Weight rows [begin, end) against every row of x, chunks of up to 8 rows of x each over the rows' block (in
// cache for the chunks after the first).
template <bool kGrouped>
void multiply_rows(Operands o, int64_t M, int64_t begin, int64_t end, at::BFloat16* y, int64_t ldy) {
  const Operands first = o;
  for (int64_t m = 0; m < M; m += kMaxChunkRows) {
    o.x = first.x + m * o.K;
    o.x_scales = first.x_scales + m;
    at::BFloat16* ym = y + m * ldy;
    switch (std::min<int64_t>(M - m, kMaxChunkRows)) {
      case 1: rows_chunk<1, kGrouped>(o, begin, end, ym, ldy); break;
      case 2: rows_chunk<2, kGrouped>(o, begin, end, ym, ldy); break;
      case 3: rows_chunk<3, kGrouped>(o, begin, end, ym, ldy); break;
      case 4: rows_chunk<4, kGrouped>(o, begin, end, ym, ldy); break;
      case 5: rows_chunk<5, kGrouped>(o, begin, end, ym, ldy); break;
      case 6: rows_chunk<6, kGrouped>(o, begin, end, ym, ldy); break;
      case 7: rows_chunk<7, kGrouped>(o, begin, end, ym, ldy); break;
      default: rows_chunk<kMaxChunkRows, kGrouped>(o, begin, end, ym, ldy); break;
    }
  }
}

class Int8ActivationRows final : public QuantizedRows {
 public:
  Int8ActivationRows(const torch::Tensor& weight, const torch::Tensor& scales, const torch::Tensor& static_scale)
      : int8_(int8_rows(weight, scales)), weight_(weight), scales_(scales), static_scale_(static_scale),
        K_(weight.size(1)), groups_(scales.size(1)), group_(K_ / groups_) {
    TORCH_CHECK(cpu_has_int8_dot_products(), "W8A8 linear: this CPU has no AVX512-VNNI");
    check_static_scale(static_scale);
    TORCH_CHECK(K_ <= kMaxK, "W8A8 linear: K up to ", kMaxK, ", got ", K_);
    TORCH_CHECK(groups_ == 1 ? K_ % kRowValues == 0 : group_ % kBytes == 0,
                "W8A8 linear: K a multiple of 32 (a scale per row) or groups of a multiple of 64 values");
  }

  std::vector<torch::Tensor> prepare(const torch::Tensor& x) const override {
    auto levels = torch::empty({x.size(0), K_}, torch::dtype(at::kByte));
    auto x_scales = torch::empty({x.size(0)}, torch::dtype(at::kFloat));
    quantize_rows(x, static_scale_, kLevelOffset, levels, x_scales);
    return {levels, x_scales};
  }

  void multiply(const torch::Tensor&, const std::vector<torch::Tensor>& prepared, int64_t begin, int64_t end,
                at::BFloat16* y, int64_t ldy) const override {
    const Operands o{prepared[0].data_ptr<uint8_t>(), prepared[1].data_ptr<float>(), weight_.data_ptr<int8_t>(),
                     scales_.data_ptr<float>(), K_, groups_, group_};
    if (groups_ == 1)
      multiply_rows<false>(o, prepared[0].size(0), begin, end, y, ldy);
    else
      multiply_rows<true>(o, prepared[0].size(0), begin, end, y, ldy);
  }

  void dequantize(int64_t begin, int64_t end, at::BFloat16* out) const override { int8_->dequantize(begin, end, out); }

 private:
  std::unique_ptr<QuantizedRows> int8_;  // checks the weight's tensors, and dequantizes
  torch::Tensor weight_, scales_, static_scale_;
  int64_t K_, groups_, group_;
};

}  // namespace

bool cpu_has_int8_dot_products() { return __builtin_cpu_supports("avx512vnni"); }

std::unique_ptr<QuantizedRows> int8_activation_rows(const torch::Tensor& weight, const torch::Tensor& scales,
                                                    const torch::Tensor& static_scale) {
  return std::make_unique<Int8ActivationRows>(weight, scales, static_scale);
}

torch::Tensor linear_w8a8(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales,
                          const torch::Tensor& static_scale) {
  return quantized_linear(x, Int8ActivationRows(weight, scales, static_scale), weight.size(0), weight.size(1));
}

std::vector<torch::Tensor> quantize_int8_activations(const torch::Tensor& x, const torch::Tensor& static_scale) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.dim() == 2 && x.size(1) % kLanes == 0,
              "int8 activations: x (M, K) bf16 on CPU, K a multiple of 16");
  check_static_scale(static_scale);
  const torch::Tensor xs = x.contiguous();
  auto levels = torch::empty({x.size(0), x.size(1)}, torch::dtype(at::kChar));
  auto scales = torch::empty({x.size(0)}, torch::dtype(at::kFloat));
  quantize_rows(xs, static_scale, 0, levels, scales);
  return {levels, scales};
}
