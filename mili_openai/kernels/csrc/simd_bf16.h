// AVX-512 helpers shared by the CPU kernels: bf16 <-> fp32 in registers, exp for softmax, SiLU, and a
// 16 x 16 transpose.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>

namespace mili {

constexpr int64_t kLanes = 16;  // fp32 values per 512-bit register

// 16 bf16 -> fp32: a bf16 is the high half of an fp32, so zero-extend to 32 bits and shift into place.
inline __m512 widen_bf16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// fp32 -> nearest bf16 (ties to even), returned as the fp32 it stands for; NaN stays a quiet NaN.
inline __m512 round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), high);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i quiet_nan = _mm512_or_si512(_mm512_and_si512(bits, high), _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, nan, quiet_nan));
}

// Store 16 values already rounded by round_bf16 (their low halves are zero) as bf16.
inline void store_bf16(at::BFloat16* p, __m512 rounded) {
  const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half);
}

// exp(x) for x <= 0: 2^(x log2 e) split into an integer power of two and a degree-6 polynomial on
// [-0.5, 0.5]; relative error ~2e-7, far below bf16's.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // exp(-87) ~ 1e-38: smaller underflows to 0 anyway
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));  // |f| <= ln2/2
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);  // p * 2^n
}

// x * sigmoid(x) in fp32, with sigmoid from exp(-|x|) so the exponent never overflows.
inline __m512 silu(__m512 x) {
  const __m512 magnitude = _mm512_abs_ps(x);
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), magnitude));
  const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 numerator = _mm512_mask_blend_ps(negative, _mm512_set1_ps(1.f), e);  // e/(1+e) below zero
  return _mm512_mul_ps(x, _mm512_div_ps(numerator, denominator));
}

// SwiGLU's activation over one row, width a multiple of 16: out = bf16(bf16(silu(gate)) * up), transformers'
// rounding points.
inline void silu_mul_row(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* out, int64_t width) {
  for (int64_t i = 0; i < width; i += kLanes) {
    const __m512 activated = round_bf16(silu(widen_bf16(gate + i)));
    store_bf16(out + i, round_bf16(_mm512_mul_ps(activated, widen_bf16(up + i))));
  }
}

// 16 x 16 dwords in place: r[i] lane j <- r[j] lane i (pairs within 128-bit lanes, then quads, then lanes).
inline void transpose_dwords(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + j], lane L: column 4L + j of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i u0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), u1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i u3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }
  std::copy(t, t + 16, r);
}

}  // namespace mili
