// Many LoRA adapters over one batch of rows (Punica's BGMV): each row adds its own adapter slot's delta to a
// projection's output, rounding as the torch reference (kernels/lora.py) does in bf16: the shrink x A^T rounded to
// bf16, the expand h B^T rounded to bf16, then added to the output and rounded again.
//
// A slot stacks a fused projection's modules (model/lora_layers.py): A rows [i R, (i + 1) R) are module i's, and
// module i's output columns [offsets[i], offsets[i + 1]) read only those, so the expand reads B^T (W, O) a module's
// R rows over its own columns alone. Rows sharing a slot read its A once; the expand's column blocks are spread
// over the threads, each reading its block of B^T once per row that runs the slot (from L1 after the first).
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "kernels.h"
#include "simd_bf16.h"

namespace {

constexpr int64_t kExpandBlock = 256;  // output columns a thread's task covers

// 16 bf16 (the first `count`, the rest zero) -> fp32
inline __m512 widen_bf16_first(const at::BFloat16* p, int64_t count) {
  const __mmask16 mask = count >= mili::kLanes ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store_bf16_first(at::BFloat16* p, __m512 rounded, int64_t count) {
  const __mmask16 mask = count >= mili::kLanes ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16));
  _mm256_mask_storeu_epi16(p, mask, half);
}

// bf16(x . a) over `width` values (a multiple of 16); x already widened
inline float shrink_dot(const float* x, const at::BFloat16* a, int64_t width) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < width; k += mili::kLanes) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), mili::widen_bf16(a + k), acc);
  float sum = _mm512_reduce_add_ps(acc);
  _mm_store_ss(&sum, _mm512_castps512_ps128(mili::round_bf16(_mm512_set1_ps(sum))));
  return sum;
}

}  // namespace

void add_lora_bf16(torch::Tensor& out, const torch::Tensor& x, const LoraProjection& lora,
                   const torch::Tensor& row_slots) {
  const torch::Tensor &lora_a = lora.a, &lora_b_t = lora.b_t;
  const std::vector<int64_t>& offsets = lora.offsets;
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16 &&
              lora_a.scalar_type() == at::kBFloat16 && lora_b_t.scalar_type() == at::kBFloat16,
              "add_lora_bf16: bf16 tensors");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && lora_a.dim() == 3 && lora_b_t.dim() == 3,
              "add_lora_bf16: out (T, O), x (T, I), lora_a (S, W, I), lora_b_t (S, W, O)");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1 && lora_a.is_contiguous() && lora_b_t.is_contiguous(),
              "add_lora_bf16: rows of out and x contiguous, weights contiguous");
  const int64_t tokens = x.size(0), in = x.size(1), slots = lora_a.size(0), width = lora_a.size(1);
  const int64_t outs = out.size(1), modules = static_cast<int64_t>(offsets.size()) - 1;
  TORCH_CHECK(out.size(0) == tokens && lora_a.size(2) == in && lora_b_t.size(0) == slots &&
              lora_b_t.size(1) == width && lora_b_t.size(2) == outs, "add_lora_bf16: shapes disagree");
  TORCH_CHECK(in % mili::kLanes == 0, "add_lora_bf16: in_features a multiple of 16");
  TORCH_CHECK(modules >= 1 && width % modules == 0 && offsets.front() == 0 && offsets.back() == outs &&
              std::is_sorted(offsets.begin(), offsets.end()), "add_lora_bf16: module offsets 0 .. O, one per A block");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && row_slots.is_contiguous() && row_slots.numel() == tokens,
              "add_lora_bf16: one int64 slot per row");
  const int64_t rank = width / modules;
  const int64_t* slot_of = row_slots.data_ptr<int64_t>();
  // the rows that run an adapter, by slot: each slot's A is read once for its rows
  std::vector<int64_t> rows;
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot_of[t] >= -1 && slot_of[t] < slots, "add_lora_bf16: slot ", slot_of[t], " outside the table");
    if (slot_of[t] >= 0) rows.push_back(t);
  }
  if (rows.empty()) return;
  std::stable_sort(rows.begin(), rows.end(), [&](int64_t a, int64_t b) { return slot_of[a] < slot_of[b]; });
  std::vector<int64_t> group_starts;  // runs of one slot in `rows`
  for (size_t i = 0; i < rows.size(); ++i)
    if (i == 0 || slot_of[rows[i]] != slot_of[rows[i - 1]]) group_starts.push_back(static_cast<int64_t>(i));
  group_starts.push_back(static_cast<int64_t>(rows.size()));
  const int64_t groups = static_cast<int64_t>(group_starts.size()) - 1, active = static_cast<int64_t>(rows.size());

  std::vector<float> xf(active * in);  // the active rows widened once, in `rows` order
  std::vector<float> h(active * width);  // their shrink, rounded to bf16
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* a = lora_a.data_ptr<at::BFloat16>();
  const at::BFloat16* bt = lora_b_t.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < active; ++i)
    for (int64_t k = 0; k < in; k += mili::kLanes)
      _mm512_storeu_ps(xf.data() + i * in + k, mili::widen_bf16(xp + rows[i] * ldx + k));
  at::parallel_for(0, groups * width, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / width, w = item % width;
      const at::BFloat16* a_row = a + (slot_of[rows[group_starts[g]]] * width + w) * in;
      for (int64_t i = group_starts[g]; i < group_starts[g + 1]; ++i) h[i * width + w] = shrink_dot(xf.data() + i * in, a_row, in);
    }
  });
  // expand: tasks of up to kExpandBlock columns within one module
  std::vector<int64_t> task_module, task_begin;
  for (int64_t m = 0; m < modules; ++m)
    for (int64_t c = offsets[m]; c < offsets[m + 1]; c += kExpandBlock) {
      task_module.push_back(m);
      task_begin.push_back(c);
    }
  at::parallel_for(0, static_cast<int64_t>(task_module.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task_module[task], c0 = task_begin[task], c1 = std::min(c0 + kExpandBlock, offsets[m + 1]);
      for (int64_t i = 0; i < active; ++i) {
        const float* hr = h.data() + i * width + m * rank;
        const at::BFloat16* b_rows = bt + (slot_of[rows[i]] * width + m * rank) * outs;
        at::BFloat16* y = op + rows[i] * ldo;
        for (int64_t c = c0; c < c1; c += mili::kLanes) {
          const int64_t count = c1 - c;
          __m512 acc = _mm512_setzero_ps();
          for (int64_t r = 0; r < rank; ++r)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(hr[r]), widen_bf16_first(b_rows + r * outs + c, count), acc);
          const __m512 sum = _mm512_add_ps(widen_bf16_first(y + c, count), mili::round_bf16(acc));
          store_bf16_first(y + c, mili::round_bf16(sum), count);
        }
      }
    }
  });
}
