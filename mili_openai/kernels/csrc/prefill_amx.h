// Prefill attention on AMX tiles: the path paged_prefill_attention.cpp takes for bf16 where the CPU has
// AMX-BF16 (and Linux grants the tiles). See prefill_amx.cpp.
#pragma once

#include <torch/extension.h>

namespace mili::prefill {

struct AmxPrefillShape {
  int64_t length, ctx, num_heads, num_kv_heads, head_dim;
  int64_t q_row_stride;  // elements between q's rows (each row's heads contiguous)
  int64_t pool_row_stride;  // elements between the pool's slots (num_kv_heads * head_dim)
};

// Whether the tiles take these heads: head_dim 64 or 128, query heads a multiple of KV heads.
bool amx_prefill_fits(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);

// A chunk of `length` queries (q: (length, H, D) rows) causally against its `ctx` context slots (the chunk's
// own last), scores scaled by `scale`, into out (length, H, D) contiguous.
void attend_prefill_amx(const at::BFloat16* q, const at::BFloat16* k_pool, const at::BFloat16* v_pool,
                        const int64_t* slots, const AmxPrefillShape& s, float scale, at::BFloat16* out);

}  // namespace mili::prefill
