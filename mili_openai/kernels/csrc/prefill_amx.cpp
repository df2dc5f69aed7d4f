// Prefill attention on AMX tiles, straight from the paged pool: a chunk of L queries of one sequence
// against its context (cached prefix plus the chunk), causally.
//
// torch's flash attention runs Qwen3-0.6B's prefill shapes far below the tiles' rate, and the model's
// torch path gathers the context and builds a mask first. Here each product is a tile
// instruction (TDPBF16PS: 16 x 16 x 32 multiply-adds):
// - A work item is a KV head (and, with fewer heads than threads, a slice of its positions). It packs
//   the head's K and V into the layouts the B operand takes, in its thread's buffer (256 KB at 1024
//   keys, so they stay in L2 for all its blocks): K^T as 16-key x 32-dim tiles whose row p holds every
//   key's dims 2p and 2p + 1 (a 16 x 16 dword transpose in registers), V with each pair of keys' rows
//   interleaved value by value.
// - Then per block of 32 query positions, latest first, and per query head of the group: S = Q . K^T
//   over the keys the block's last position sees, a softmax along each row of S (two passes over the row
//   in memory: no running rescale), and O = P . V with its bf16 numerators as the A operand.
// Several times faster than torch's SDPA on CPUs with AMX, whose flash attention beats the AVX-512 kernel.
#include "prefill_amx.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>

#include "amx_tiles.h"
#include "simd_bf16.h"

namespace mili::prefill {
namespace {

#define MILI_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int64_t kKeys = 16;       // keys a score tile covers (its fp32 columns), and a K^T tile
constexpr int64_t kPairKeys = 32;   // keys a P tile covers (its bf16 columns): a packing step
constexpr int64_t kScoreStep = 2 * kKeys;  // keys one scoring pass covers: two C tiles per row tile
constexpr int64_t kRowTiles = 2;     // tiles of query rows a block scores together, each K^T tile serving both
constexpr int64_t kPositions = kRowTiles * kTileRows;  // query positions of a block
constexpr int64_t kDimChunk = 32;   // head dims a Q tile's row covers
constexpr int64_t kOutCols = 16;    // output dims a weighing C tile covers
constexpr int64_t kOutHalf = 4 * kOutCols;  // output dims one pass over P covers: four C tiles
// Tile registers (the intrinsics take them as literals). Scoring: C = 0-3 (two row tiles x two key blocks),
// Q 4-5, K^T 6. Weighing (amx_tiles.h): C = 0-3 (four runs of output dims), P 4, V 5. Four accumulators
// in flight hide the products' latency, and each K^T tile loaded serves 32 query rows.
constexpr int kTilesUsed = 7;

struct PackedKV;     // thread_scratch tags: a worker's packed K^T and V of one head, and its task buffers
struct TaskScratch;

// Where one KV head's packed operands sit (in dwords): K^T tiles by (key block of 16, dim chunk), then V's
// pair rows of D dwords each, for keys [0, keys) (a multiple of kScoreStep; zeros past the context).
struct PackedLayout {
  int64_t keys, head_dim;
  int64_t dim_chunks() const { return head_dim / kDimChunk; }
  int64_t key_tile(int64_t block, int64_t chunk) const { return (block * dim_chunks() + chunk) * kTileFloats; }
  int64_t values() const { return keys * head_dim / 2; }
  int64_t value_row(int64_t pair) const { return values() + pair * head_dim; }
  int64_t size() const { return keys * head_dim; }
};

// Keys [k0, k0 + 32) of KV head h into the packed K^T tiles and V pair rows (keys past ctx as zeros).
MILI_AMX void pack_keys(const at::BFloat16* k_pool, const at::BFloat16* v_pool, const int64_t* slots,
                        const AmxPrefillShape& s, const PackedLayout& layout, int64_t h, int64_t k0,
                        uint32_t* packed) {
  const int64_t D = s.head_dim;
  const at::BFloat16* k_rows[kPairKeys];
  const at::BFloat16* v_rows[kPairKeys];
  for (int64_t i = 0; i < kPairKeys; ++i) {
    const bool real = k0 + i < s.ctx;
    k_rows[i] = real ? k_pool + slots[k0 + i] * s.pool_row_stride + h * D : nullptr;
    v_rows[i] = real ? v_pool + slots[k0 + i] * s.pool_row_stride + h * D : nullptr;
  }
  for (int64_t half = 0; half < 2; ++half)
    for (int64_t c = 0; c < layout.dim_chunks(); ++c) {
      __m512i r[kKeys];
      for (int64_t n = 0; n < kKeys; ++n) {
        const at::BFloat16* row = k_rows[half * kKeys + n];
        r[n] = row != nullptr ? _mm512_loadu_si512(row + c * kDimChunk) : _mm512_setzero_si512();
      }
      transpose_dwords(r);  // r[p]: each key's dims 2p and 2p + 1 of the chunk
      uint32_t* tile = packed + layout.key_tile(k0 / kKeys + half, c);
      for (int64_t p = 0; p < kKeys; ++p) _mm512_store_si512(tile + p * kKeys, r[p]);
    }
  alignas(64) int16_t low_index[32], high_index[32];  // value i of the even key, then of the odd key
  for (int i = 0; i < 16; ++i) {
    low_index[2 * i] = i, low_index[2 * i + 1] = 32 + i;
    high_index[2 * i] = 16 + i, high_index[2 * i + 1] = 48 + i;
  }
  const __m512i low = _mm512_load_si512(low_index), high = _mm512_load_si512(high_index);
  for (int64_t pair = 0; pair < kPairKeys / 2; ++pair) {
    const at::BFloat16* even = v_rows[2 * pair];
    const at::BFloat16* odd = v_rows[2 * pair + 1];
    uint32_t* out = packed + layout.value_row(k0 / 2 + pair);
    for (int64_t d = 0; d < D; d += kDimChunk) {
      const __m512i a = even != nullptr ? _mm512_loadu_si512(even + d) : _mm512_setzero_si512();
      const __m512i b = odd != nullptr ? _mm512_loadu_si512(odd + d) : _mm512_setzero_si512();
      _mm512_store_si512(out + d, _mm512_permutex2var_epi16(a, low, b));
      _mm512_store_si512(out + d + kOutCols, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// Unscaled scores of the staged queries (32 rows of D) against keys [0, keys) (a multiple of kScoreStep),
// into rows of `stride` floats.
template <int64_t D>
MILI_AMX void score(const at::BFloat16* queries, const uint32_t* packed, const PackedLayout& layout, int64_t keys,
                    float* scores, int64_t stride) {
  const at::BFloat16* lower = queries + kTileRows * D;  // rows 16-31
  float* lower_scores = scores + kTileRows * stride;
  for (int64_t j = 0; j < keys; j += kScoreStep) {
    const int64_t block = j / kKeys;
    zero_accumulators();
    for (int64_t c = 0; c < D / kDimChunk; ++c) {
      _tile_loadd(4, queries + c * kDimChunk, D * 2);
      _tile_loadd(5, lower + c * kDimChunk, D * 2);
      _tile_loadd(6, packed + layout.key_tile(block, c), 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(6, packed + layout.key_tile(block + 1, c), 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(3, 5, 6);
    }
    _tile_stored(0, scores + j, stride * 4);
    _tile_stored(1, scores + j + kKeys, stride * 4);
    _tile_stored(2, lower_scores + j, stride * 4);
    _tile_stored(3, lower_scores + j + kKeys, stride * 4);
  }
}

// 2^t for t <= 0, to ~4e-5 (a degree-4 polynomial of the fraction): the numerators are rounded to bf16
// (4e-3) after, so exp_nonpositive's degree 7 buys nothing here, and the softmax was the largest of the
// three passes.
MILI_AMX inline __m512 exp2_for_bf16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // |f| <= 1/2
  __m512 p = _mm512_set1_ps(0.009618129f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550411f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931472f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);  // p * 2^n
}

// One row's softmax over its `visible` keys, scaled: numerators as bf16 into p[0, width) (zeros past
// `visible`), returning their sum.
MILI_AMX float softmax_row(const float* scores, int64_t visible, int64_t width, float scale, at::BFloat16* p) {
  __m512 row_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < visible; j += kKeys) {
    const __mmask16 mask = visible - j >= kKeys ? 0xFFFF : static_cast<__mmask16>((1u << (visible - j)) - 1);
    row_max = _mm512_mask_max_ps(row_max, mask, row_max, _mm512_loadu_ps(scores + j));
  }
  const float log2_scale = scale * 1.4426950408889634f;  // exp(x * scale) = 2^(x * scale * log2 e)
  const __m512 vscale = _mm512_set1_ps(log2_scale);
  const __m512 scaled_max = _mm512_set1_ps(_mm512_reduce_max_ps(row_max) * log2_scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += kPairKeys) {
    __m512 e[2];
    for (int64_t i = 0; i < 2; ++i) {
      const int64_t first = j + i * kKeys, left = visible - first;
      const __mmask16 mask = left >= kKeys ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
      e[i] = mask == 0 ? _mm512_setzero_ps()
                       : _mm512_maskz_mov_ps(mask, exp2_for_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(scores + first),
                                                                                  vscale, scaled_max)));
    }
    sum = _mm512_add_ps(sum, _mm512_add_ps(e[0], e[1]));
    _mm512_storeu_si512(p + j, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));  // keys j .. j + 15, then the next 16
  }
  return _mm512_reduce_add_ps(sum);
}

// acc (16, D) = P (16 rows of `stride` bf16) . V over keys [0, width).
template <int64_t D>
MILI_AMX void weigh(const at::BFloat16* p, int64_t stride, const uint32_t* packed, const PackedLayout& layout,
                    int64_t width, float* acc) {
  for (int64_t half = 0; half < D; half += kOutHalf) {
    zero_accumulators();
    for (int64_t j = 0; j < width; j += kPairKeys)
      accumulate_four(p + j, stride * 2, packed + layout.value_row(j / 2) + half, kOutCols, D * 4);
    store_accumulators(acc + half, kOutCols, D * 4);
  }
}

// KV head h (packed), query positions [p0, p0 + 32) of the chunk, every query head of the group in turn.
template <int64_t D>
MILI_AMX void attend_block(const at::BFloat16* q, const uint32_t* packed, const PackedLayout& layout,
                           const AmxPrefillShape& s, int64_t h, int64_t p0, float scale, at::BFloat16* out) {
  const int64_t group = s.num_heads / s.num_kv_heads, rows = std::min(kPositions, s.length - p0);
  const int64_t first_visible = s.ctx - s.length + p0 + 1;  // keys row 0 sees; row r sees r more
  const int64_t keys = first_visible + rows - 1;
  const int64_t width = (keys + kPairKeys - 1) / kPairKeys * kPairKeys;
  const int64_t scored = (keys + kScoreStep - 1) / kScoreStep * kScoreStep, stride = layout.keys;
  float* scores = thread_scratch<TaskScratch>(kPositions * (stride + stride / 2 + D + D / 2));
  auto* p = reinterpret_cast<at::BFloat16*>(scores + kPositions * stride);  // (32, stride) bf16
  float* acc = scores + kPositions * (stride + stride / 2);                  // (32, D)
  auto* queries = reinterpret_cast<at::BFloat16*>(acc + kPositions * D);     // (32, D) bf16
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head = h * group + g;
    for (int64_t r = 0; r < kPositions; ++r) {
      if (r < rows)
        std::memcpy(queries + r * D, q + (p0 + r) * s.q_row_stride + head * D, D * sizeof(at::BFloat16));
      else
        std::memset(queries + r * D, 0, D * sizeof(at::BFloat16));
    }
    score<D>(queries, packed, layout, scored, scores, stride);
    float inverse_sum[kPositions];
    for (int64_t r = 0; r < kPositions; ++r) {
      if (r < rows) {
        inverse_sum[r] = 1.f / softmax_row(scores + r * stride, first_visible + r, width, scale, p + r * stride);
      } else {
        std::memset(p + r * stride, 0, width * sizeof(at::BFloat16));
      }
    }
    for (int64_t tile = 0; tile < kRowTiles && tile * kTileRows < rows; ++tile)
      weigh<D>(p + tile * kTileRows * stride, stride, packed, layout, width, acc + tile * kTileRows * D);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inverse = _mm512_set1_ps(inverse_sum[r]);
      at::BFloat16* row = out + (p0 + r) * s.num_heads * D + head * D;
      for (int64_t d = 0; d < D; d += kOutCols)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), inverse)));
    }
  }
}

// Work items, taken from `next_item` until none is left: KV head h and every slices-th block of 32
// positions from `slice` on, latest first. The item packs the keys its blocks see into this thread's
// buffer (a head's K/V, 256 KB at 1024 keys: it stays in L2 for all the item's blocks), then attends.
template <int64_t D>
MILI_AMX void run_items(const at::BFloat16* q, const at::BFloat16* k_pool, const at::BFloat16* v_pool,
                        const int64_t* slots, const AmxPrefillShape& s, float scale, int64_t slices,
                        std::atomic<int64_t>& next_item, at::BFloat16* out) {
  configure_whole_tiles(kTilesUsed);  // tile state is per thread
  const int64_t blocks = (s.length + kPositions - 1) / kPositions;
  for (int64_t item = next_item.fetch_add(1); item < s.num_kv_heads * slices; item = next_item.fetch_add(1)) {
    const int64_t h = item / slices, slice = item % slices;
    const int64_t last = blocks - 1 - slice;  // the item's latest block
    if (last < 0) continue;
    const int64_t keys = s.ctx - s.length + std::min(s.length, (last + 1) * kPositions);
    const PackedLayout layout{(keys + kScoreStep - 1) / kScoreStep * kScoreStep, D};
    auto* packed = reinterpret_cast<uint32_t*>(thread_scratch<PackedKV>(layout.size()));
    for (int64_t k0 = 0; k0 < layout.keys; k0 += kPairKeys) pack_keys(k_pool, v_pool, slots, s, layout, h, k0, packed);
    for (int64_t block = last; block >= 0; block -= slices)
      attend_block<D>(q, packed, layout, s, h, block * kPositions, scale, out);
  }
  _tile_release();
}

template <int64_t D>
void attend(const at::BFloat16* q, const at::BFloat16* k_pool, const at::BFloat16* v_pool, const int64_t* slots,
            const AmxPrefillShape& s, float scale, at::BFloat16* out) {
  const int64_t threads = at::get_num_threads();
  const int64_t slices = std::max<int64_t>(1, (threads + s.num_kv_heads - 1) / s.num_kv_heads);  // fill every thread
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    run_items<D>(q, k_pool, v_pool, slots, s, scale, slices, next_item, out);
  });
}

#undef MILI_AMX

}  // namespace

bool amx_prefill_fits(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  return (head_dim == 64 || head_dim == 128) && num_kv_heads > 0 && num_heads % num_kv_heads == 0;
}

void attend_prefill_amx(const at::BFloat16* q, const at::BFloat16* k_pool, const at::BFloat16* v_pool,
                        const int64_t* slots, const AmxPrefillShape& s, float scale, at::BFloat16* out) {
  TORCH_CHECK(amx_prefill_fits(s.num_heads, s.num_kv_heads, s.head_dim) && s.ctx >= s.length,
              "attend_prefill_amx: shapes");
  if (s.head_dim == 128)
    attend<128>(q, k_pool, v_pool, slots, s, scale, out);
  else
    attend<64>(q, k_pool, v_pool, slots, s, scale, out);
}

}  // namespace mili::prefill
