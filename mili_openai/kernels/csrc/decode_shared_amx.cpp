// Cascade attention for decode on AMX tiles: the query heads of several sequences against the context
// prefix they share (a system prompt, a few-shot preamble, n > 1 samples: pages the radix cache hands to
// each of them), the prefix's K/V read once for all of them.
//
// Scoring one query token per sequence against a context is a matrix-vector product per head, so eight
// sequences sharing a long prefix spent a third of a batch-8 step scoring the same K/V eight times in
// the AVX-512 kernel (paged_decode_attention.cpp). Stacked, the sequences' query heads of one KV head
// form a matrix of up to 16 rows, and each
// product is a tile instruction (TDPBF16PS: 16 x 16 x 32 multiply-adds).
//
// Per KV head: S^T = K . Q^T, with A tiles 16 K rows loaded in place from the pool (a page's slots are
// consecutive; a block that is not is copied first) and Q^T packed once into the VNNI pairs B takes; a
// softmax down each column of S^T (one query head each), its bf16 numerators scattered into P tiles
// (16 heads x 32 slots); then O = P . V, with V's rows for two slots interleaved value by value into B
// tiles by the same 16-bit unpacks the AVX-512 kernel weighs with, so O comes out in its pair_lane_of
// order and the partials merge with that kernel's. Both passes walk the span in chunks of 128 slots,
// every KV head inside a chunk, so a slot's row (all heads side by side) is read in one go.
//
// A shared prefix then costs a fraction of its separate scoring; where nothing is shared this path is not
// taken. Prefetching the next chunk's rows into L2 made no difference, so nothing is prefetched.
#include "decode_shared_amx.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_tiles.h"
#include "simd_bf16.h"

namespace mili::decode {
namespace {

#define MILI_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int64_t kTile = kTileRows;       // rows of every tile; fp32 columns of a C tile; slots a score block
constexpr int64_t kValuesPerTileRow = 32;  // bf16 values in a row of 64 bytes
constexpr int64_t kHalf = 64;              // output values a pass over V covers: four C tiles of 16
constexpr int64_t kChunk = 128;            // slots whose rows (every head) are read together
// Tile registers (the intrinsics take them as literals). Scoring: C = 0, Q^T chunks 1-4, K rows 5.
// Weighing: C = 0-3, P 4, V 5 (amx_tiles.h's accumulate_four).
constexpr int kTilesUsed = 6;
struct SpanScratch;  // thread_scratch's tag: a span's scores, P tiles, packed queries and sums

// Q^T for KV head h in VNNI pairs: per 32 values of D, a tile whose row p holds, for each stacked query
// head n (member n / group, head h * group + n % group), its values 2p and 2p + 1. Unused columns are zero.
void pack_queries(const at::BFloat16* q, const int64_t* members, int64_t count, const SharedSpanShape& s,
                  int64_t h, uint32_t* packed) {
  const int64_t group = s.num_heads / s.num_kv_heads, D = s.head_dim;
  std::memset(packed, 0, D / kValuesPerTileRow * kTileFloats * sizeof(uint32_t));
  for (int64_t n = 0; n < count * group; ++n) {
    const int64_t head = members[n / group] * s.num_heads + h * group + n % group;
    const auto* row = reinterpret_cast<const uint32_t*>(q + head * D);
    for (int64_t p = 0; p < D / 2; ++p) packed[p * kTile + n] = row[p];  // pair p: chunk p / 16, row p % 16
  }
}

// Whether a block's 16 slots sit side by side in the pool, so one tile load reads their rows in place.
bool consecutive(const int64_t* slots) {
  for (int64_t j = 1; j < kTile; ++j)
    if (slots[j] != slots[0] + j) return false;
  return true;
}

// Scores of slots [j0, j1) against each KV head's stacked query heads, unscaled: head h's (n, 16) at
// scores + h * n * 16. Heads go inside a chunk so that its rows, all heads side by side, are read together.
template <int64_t D>
MILI_AMX void score_chunk(const uint32_t* packed_q, const at::BFloat16* k_pool, const int64_t* slots, int64_t j0,
                          int64_t j1, int64_t n, int64_t row_stride, int64_t num_kv_heads, at::BFloat16* staged,
                          float* scores) {
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    const uint32_t* q = packed_q + h * (D / kValuesPerTileRow) * kTileFloats;
    _tile_loadd(1, q, 64);
    _tile_loadd(2, q + kTileFloats, 64);
    if constexpr (D == 128) {
      _tile_loadd(3, q + 2 * kTileFloats, 64);
      _tile_loadd(4, q + 3 * kTileFloats, 64);
    }
    for (int64_t j = j0; j < j1; j += kTile) {
      const at::BFloat16* rows = k_pool + slots[j] * row_stride + h * D;
      int64_t stride = row_stride * 2;
      if (!consecutive(slots + j)) {
        for (int64_t i = 0; i < kTile; ++i)
          std::memcpy(staged + i * D, k_pool + slots[j + i] * row_stride + h * D, D * sizeof(at::BFloat16));
        rows = staged, stride = D * 2;
      }
      _tile_zero(0);
      _tile_loadd(5, rows, stride);
      _tile_dpbf16ps(0, 5, 1);
      _tile_loadd(5, rows + 32, stride);
      _tile_dpbf16ps(0, 5, 2);
      if constexpr (D == 128) {
        _tile_loadd(5, rows + 64, stride);
        _tile_dpbf16ps(0, 5, 3);
        _tile_loadd(5, rows + 96, stride);
        _tile_dpbf16ps(0, 5, 4);
      }
      _tile_stored(0, scores + (h * n + j) * kTile, 64);
    }
  }
}

// The softmax down each column of scores (n, 16), scaled: the column maxima and sums of exp(score - max)
// into max and sum, and the numerators, rounded to bf16 as the AVX-512 kernel rounds them, into P tiles
// (per 32 slots: row = stacked query head, dword r = its numerators for slots 2r and 2r + 1).
MILI_AMX void softmax_columns(const float* scores, int64_t n, float scale, uint32_t* p_tiles, float* max,
                              float* sum) {
  __m512 column_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; ++j) column_max = _mm512_max_ps(column_max, _mm512_load_ps(scores + j * kTile));
  const __m512 vscale = _mm512_set1_ps(scale), scaled_max = _mm512_mul_ps(column_max, vscale);
  alignas(64) int16_t interleave[32];  // 16-bit lanes: head n's numerator for slot 2r, then for 2r + 1
  alignas(64) int32_t row_of_head[16];  // dword offsets of each head's row in a P tile
  for (int i = 0; i < 16; ++i) interleave[2 * i] = i, interleave[2 * i + 1] = 16 + i, row_of_head[i] = i * kTile;
  const __m512i interleave_index = _mm512_load_si512(interleave), scatter_index = _mm512_load_si512(row_of_head);
  __m512 column_sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 2) {
    const __m512 even = exp_nonpositive(_mm512_fmsub_ps(_mm512_load_ps(scores + j * kTile), vscale, scaled_max));
    const __m512 odd = exp_nonpositive(_mm512_fmsub_ps(_mm512_load_ps(scores + (j + 1) * kTile), vscale, scaled_max));
    column_sum = _mm512_add_ps(column_sum, _mm512_add_ps(even, odd));
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // 16 even, then 16 odd
    uint32_t* tile = p_tiles + j / kValuesPerTileRow * kTileFloats + j % kValuesPerTileRow / 2;
    _mm512_i32scatter_epi32(tile, scatter_index, _mm512_permutexvar_epi16(interleave_index, both), 4);
  }
  _mm512_store_ps(max, scaled_max);
  _mm512_store_ps(sum, column_sum);
}

// Each KV head's acc (16, D) += P . V over slots [j0, j1), in pair_lane_of order: per 64 output values,
// four C tiles; per 32 slots, B tiles of V whose row r interleaves slots 2r and 2r + 1 (unpacklo/hi_epi16).
// Head h's P tiles start at p_tiles + h * (n / 32) tiles, its acc at acc + h * 16 * D.
template <int64_t D>
MILI_AMX void weigh_chunk(const uint32_t* p_tiles, const at::BFloat16* v_pool, const int64_t* slots, int64_t j0,
                          int64_t j1, int64_t n, int64_t row_stride, int64_t num_kv_heads, uint32_t* staged,
                          float* acc) {
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    const uint32_t* p = p_tiles + h * (n / kValuesPerTileRow) * kTileFloats;
    float* head_acc = acc + h * kTile * D;
    for (int64_t half = 0; half < D; half += kHalf) {
      if (j0 == 0)
        zero_accumulators();
      else
        load_accumulators(head_acc + half, kTile, D * 4);
      for (int64_t j = j0; j < j1; j += kValuesPerTileRow) {
        for (int64_t r = 0; r < kTile; ++r) {
          const at::BFloat16* a = v_pool + slots[j + 2 * r] * row_stride + h * D + half;
          const at::BFloat16* b = v_pool + slots[j + 2 * r + 1] * row_stride + h * D + half;
          for (int64_t i = 0; i < 2; ++i) {
            const __m512i va = _mm512_loadu_si512(a + 32 * i), vb = _mm512_loadu_si512(b + 32 * i);
            _mm512_store_si512(staged + (2 * i) * kTileFloats + r * kTile, _mm512_unpacklo_epi16(va, vb));
            _mm512_store_si512(staged + (2 * i + 1) * kTileFloats + r * kTile, _mm512_unpackhi_epi16(va, vb));
          }
        }
        accumulate_four(p + j / kValuesPerTileRow * kTileFloats, 64, staged, kTileFloats, 64);
      }
      store_accumulators(head_acc + half, kTile, D * 4);
    }
  }
}

template <int64_t D>
MILI_AMX void attend(const at::BFloat16* q, const int64_t* members, int64_t count, const SharedSpanShape& s,
                     float scale, const at::BFloat16* k_pool, const at::BFloat16* v_pool, const int64_t* slots,
                     int64_t n, float* scratch, const SpanPartial* out) {
  const int64_t group = s.num_heads / s.num_kv_heads, KV = s.num_kv_heads, steps = n / kValuesPerTileRow;
  float* scores = scratch;                                                  // KV x (n, 16)
  auto* p_tiles = reinterpret_cast<uint32_t*>(scores + KV * n * kTile);     // KV x n / 32 tiles
  auto* packed_q = p_tiles + KV * steps * kTileFloats;                      // KV x D / 32 tiles
  auto* staged = packed_q + KV * (D / kValuesPerTileRow) * kTileFloats;     // 4 tiles: V, or 16 K rows
  float* acc = reinterpret_cast<float*>(staged + 4 * kTileFloats);          // KV x (16, D)
  float* max = acc + KV * kTile * D;                                        // KV x 16
  float* sum = max + KV * kTile;                                            // KV x 16
  for (int64_t h = 0; h < KV; ++h)
    pack_queries(q, members, count, s, h, packed_q + h * (D / kValuesPerTileRow) * kTileFloats);
  configure_whole_tiles(kTilesUsed);
  for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
    const int64_t j1 = std::min(n, j0 + kChunk);
    score_chunk<D>(packed_q, k_pool, slots, j0, j1, n, s.row_stride, KV, reinterpret_cast<at::BFloat16*>(staged),
                   scores);
  }
  for (int64_t h = 0; h < KV; ++h)
    softmax_columns(scores + h * n * kTile, n, scale, p_tiles + h * steps * kTileFloats, max + h * kTile,
                    sum + h * kTile);
  for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
    const int64_t j1 = std::min(n, j0 + kChunk);
    weigh_chunk<D>(p_tiles, v_pool, slots, j0, j1, n, s.row_stride, KV, staged, acc);
  }
  _tile_release();
  for (int64_t h = 0; h < KV; ++h) {
    for (int64_t row = 0; row < count * group; ++row) {
      const SpanPartial& partial = out[row / group];
      const int64_t head = h * group + row % group;
      std::memcpy(partial.acc + head * D, acc + (h * kTile + row) * D, D * sizeof(float));
      partial.max[head] = max[h * kTile + row];
      partial.sum[head] = sum[h * kTile + row];
    }
  }
}

#undef MILI_AMX

// How many leading slots two rows have in common, up to `limit`: memcmp over 32-slot chunks, then slot
// by slot.
int64_t common_prefix(const int64_t* a, const int64_t* b, int64_t limit) {
  int64_t n = 0;
  while (n + kSharedStep <= limit && std::memcmp(a + n, b + n, kSharedStep * sizeof(int64_t)) == 0) n += kSharedStep;
  while (n < limit && a[n] == b[n]) ++n;
  return n;
}

}  // namespace

std::vector<SharedPrefix> find_shared_prefixes(const int64_t* slots, const int64_t* lengths, int64_t batch,
                                               int64_t width, int64_t max_members) {
  std::vector<SharedPrefix> prefixes;
  std::vector<bool> grouped(batch, false);
  for (int64_t first = 0; first < batch; ++first) {
    if (grouped[first]) continue;
    SharedPrefix prefix{{first}, lengths[first] - 1};
    const int64_t* row = slots + first * width;
    for (int64_t other = first + 1; other < batch && static_cast<int64_t>(prefix.members.size()) < max_members;
         ++other) {
      if (grouped[other] || slots[other * width] != row[0]) continue;
      const int64_t common = common_prefix(row, slots + other * width, std::min(lengths[first], lengths[other]) - 1);
      if (common < kMinSharedSlots) continue;
      prefix.members.push_back(other);
      prefix.length = std::min(prefix.length, common);
      grouped[other] = true;
    }
    prefix.length = prefix.length / kSharedStep * kSharedStep;  // >= kMinSharedSlots, a multiple of the step
    if (prefix.members.size() >= 2) prefixes.push_back(std::move(prefix));
  }
  return prefixes;
}

bool shared_span_fits(const SharedSpanShape& s) {
  return (s.head_dim == 64 || s.head_dim == 128) && s.num_heads % s.num_kv_heads == 0 &&
         s.num_heads / s.num_kv_heads <= kMaxSharedRows;
}

void attend_shared_span(const at::BFloat16* q, const int64_t* members, int64_t count, const SharedSpanShape& s,
                        float scale, const at::BFloat16* k_pool, const at::BFloat16* v_pool, const int64_t* slots,
                        int64_t n, const SpanPartial* out) {
  TORCH_CHECK(shared_span_fits(s) && n % kSharedStep == 0 && count * (s.num_heads / s.num_kv_heads) <= kMaxSharedRows,
              "attend_shared_span: shapes");
  const int64_t KV = s.num_kv_heads, tiles = KV * (n / kValuesPerTileRow + s.head_dim / kValuesPerTileRow) + 4;
  float* scratch =
      thread_scratch<SpanScratch>(KV * n * kTile + tiles * kTileFloats + KV * kTile * s.head_dim + 2 * KV * kTile);
  if (s.head_dim == 128)
    attend<128>(q, members, count, s, scale, k_pool, v_pool, slots, n, scratch, out);
  else
    attend<64>(q, members, count, s, scale, k_pool, v_pool, slots, n, scratch, out);
}

}  // namespace mili::decode
