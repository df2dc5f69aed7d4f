// The partial results of decode attention's tasks (paged_decode_attention.cpp), and their merge: each
// task leaves, for its span of a sequence's context, the unnormalised weighted sums of V and per query
// head the span's max score and sum of exp(score - max); a sequence's spans merge into its output.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "decode_blocks.h"
#include "decode_shared_amx.h"
#include "simd_bf16.h"

namespace mili::decode {

// n floats starting on a 64-byte boundary, for aligned vector loads and stores.
class AlignedFloats {
 public:
  explicit AlignedFloats(int64_t n) : storage_(n + kLanes) {
    data_ = storage_.data() + (-reinterpret_cast<uintptr_t>(storage_.data()) / sizeof(float) % kLanes);
  }
  float* data() { return data_; }

 private:
  std::vector<float> storage_;
  float* data_;
};

// Where each task's partial goes: per task, H * D weighted sums, then H maxima and H sums.
class Partials {
 public:
  Partials(int64_t count, int64_t num_heads, int64_t head_dim)
      : heads_(num_heads), head_dim_(head_dim),
        size_((num_heads * head_dim + 2 * num_heads + kLanes - 1) / kLanes * kLanes),  // aligned for vector loads
        storage_(count * size_) {}
  float* acc(int64_t entry) { return storage_.data() + entry * size_; }
  float* max(int64_t entry) { return acc(entry) + heads_ * head_dim_; }
  float* sum(int64_t entry) { return max(entry) + heads_; }
  SpanPartial span(int64_t entry) { return {acc(entry), max(entry), sum(entry)}; }

 private:
  int64_t heads_, head_dim_, size_;
  AlignedFloats storage_;
};

// A shared prefix's span, attended once for all its members (cascade attention, decode_shared_amx.cpp);
// its members' partials are entries [first_entry, first_entry + members).
struct SharedTask {
  const SharedPrefix* prefix;
  int64_t begin, n, first_entry;
};

// Each sequence's output from its partials (entries_of[b]): weights exp(max_i - max) rescale both the
// sums and the weighted sums. acc is in pair_lane_of order with pairs, lane_of otherwise.
template <typename T, int CH>
void merge_partials(Partials& partials, const std::vector<std::vector<int64_t>>& entries_of, int64_t H, bool pairs,
                    T* op) {
  constexpr int64_t D = CH * kLanes;
  const int64_t batch = static_cast<int64_t>(entries_of.size());
  at::parallel_for(0, batch * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / H, head = item % H;
      float global_max = -std::numeric_limits<float>::infinity();
      for (const int64_t entry : entries_of[b]) global_max = std::max(global_max, partials.max(entry)[head]);
      alignas(64) float out[D];
      __m512 o[CH];
      for (int i = 0; i < CH; ++i) o[i] = _mm512_setzero_ps();
      float total_sum = 0.f;
      for (const int64_t entry : entries_of[b]) {
        const float weight = std::exp(partials.max(entry)[head] - global_max);
        total_sum += weight * partials.sum(entry)[head];
        const __m512 w = _mm512_set1_ps(weight);
        const float* acc = partials.acc(entry) + head * D;
        for (int i = 0; i < CH; ++i) o[i] = _mm512_fmadd_ps(w, _mm512_load_ps(acc + i * kLanes), o[i]);
      }
      const __m512 inv = _mm512_set1_ps(1.f / total_sum);
      for (int i = 0; i < CH; ++i) _mm512_store_ps(out + i * kLanes, _mm512_mul_ps(o[i], inv));
      T* dst = op + (b * H + head) * D;
      for (int64_t e = 0; e < D; ++e) dst[e] = static_cast<T>(out[pairs ? pair_lane_of(e) : lane_of<T, CH>(e)]);
    }
  });
}

}  // namespace mili::decode
