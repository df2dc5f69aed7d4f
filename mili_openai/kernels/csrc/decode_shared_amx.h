// Decode attention over a context prefix that several sequences share (cascade attention), on AMX tiles:
// the pieces paged_decode_attention.cpp calls where the CPU has AMX-BF16. See decode_shared_amx.cpp.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace mili::decode {

constexpr int64_t kSharedStep = 32;    // a shared span is a whole number of these slots (one P tile row)
constexpr int64_t kMaxSharedRows = 16;  // query heads attended together: the columns of a score tile

// Where one member's share of a span goes, as attend_span leaves its own: the unnormalised weighted sums
// of V (H * D, in pair_lane_of order), and per query head the span's max score and sum of exp(score - max).
struct SpanPartial {
  float* acc;
  float* max;
  float* sum;
};

struct SharedSpanShape {
  int64_t num_heads, num_kv_heads, head_dim, row_stride;  // row_stride: elements between the pool's slots
};

// Sequences whose slot rows begin with the same slots (pages the radix cache shares): `members` attend
// slots [0, length) of the first member's row together. length is a whole number of kSharedStep slots,
// at least kMinSharedSlots, and short of every member's context, so each keeps a suffix of its own.
struct SharedPrefix {
  std::vector<int64_t> members;
  int64_t length;
};
constexpr int64_t kMinSharedSlots = 64;  // below it, the tiles' fixed costs outweigh reading a span twice

// Groups of at most max_members sequences (first come, first grouped) from slots (batch, width) and the
// context lengths. A sequence joins the first group whose first member shares kMinSharedSlots with it.
std::vector<SharedPrefix> find_shared_prefixes(const int64_t* slots, const int64_t* lengths, int64_t batch,
                                               int64_t width, int64_t max_members);

// Whether the tiles take these heads: head_dim 64 or 128, and one sequence's query heads per KV head
// (the group) fit a score tile's 16 columns.
bool shared_span_fits(const SharedSpanShape& s);

// The query heads of `count` sequences (their rows of q, (B, H, D) bf16, at `members`) against the n
// slots (a multiple of kSharedStep) they share, read once for all of them: count * group <= 16.
// out[i] receives member i's partial; scores are scaled by `scale`.
void attend_shared_span(const at::BFloat16* q, const int64_t* members, int64_t count, const SharedSpanShape& s,
                        float scale, const at::BFloat16* k_pool, const at::BFloat16* v_pool, const int64_t* slots,
                        int64_t n, const SpanPartial* out);

}  // namespace mili::decode
