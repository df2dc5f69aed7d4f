// Qwen3-MoE's routed experts in one call for bf16 on AVX512 CPUs: every (token, expert) pair's SwiGLU,
// weighted by the router and summed per token.
//
// The pairs are sorted by expert (a counting sort, token order within each expert), so each expert's
// tokens are one block of rows that multiplies its weights once: a decode step reads each routed expert
// once, whatever the batch, and a prefill chunk runs one matmul per expert. An expert with a few pairs (a
// decode step's) streams its weights through linear_bf16's tiles (multiply_weight_rows); one with many (a
// prefill chunk's) packs each unit's weights into a panel and multiplies all its pairs there, with SwiGLU
// applied in registers (expert_tiles.h). When every expert has few pairs, a thread runs whole experts,
// both matmuls, one after another (run_small_experts); otherwise work is split into units of contiguous
// weight rows of one expert, so both cores stream weights even when one expert has all the tokens. Either
// way the threads share the work like linear_bf16's rows (row_ranges.h), and no Python loop runs over the
// experts.
//
// Rounding as transformers' eager experts: the gate/up projection rounded to bf16, silu rounded, the
// product rounded; the down projection rounded, times the routing weight rounded; each token's k rows
// summed in fp32 and rounded once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "expert_tiles.h"
#include "kernels.h"
#include "moe.h"
#include "row_ranges.h"
#include "simd_bf16.h"

namespace {

using mili::kLanes;
using BF16 = at::BFloat16;

// Gate columns per unit of the first matmul (its gate and up rows, 2 x 32 weight rows), and output
// columns per unit of the second: units of 128-256 KB of weights at Qwen3-30B-A3B's widths, enough of them
// for two threads to balance.
constexpr int64_t kGateColumnsPerUnit = 32;
constexpr int64_t kDownRowsPerUnit = 64;
constexpr int64_t kRowBlock = 64;  // pair rows multiplied per pass over a unit's weights (stay in L2)
constexpr int64_t kUnitsClaimed = 2;  // units a thread claims at a time from its own range
// An expert with at least this many pairs packs each unit's weights into a panel (expert_tiles.h) rather
// than streaming them through linear_bf16's tiles.
constexpr int64_t kPanelMinRows = 32;
static_assert(2 * kGateColumnsPerUnit == kDownRowsPerUnit &&
              kDownRowsPerUnit == mili::kMaxPanelGroups * mili::kPanelGroupRows, "a unit's rows fill one panel");
// gathers and sums too small to be worth waking the other threads for (a decode step's) run on the caller
constexpr int64_t kRowsPerTask = 256, kTokensPerTask = 64;

// The (token, expert) pairs sorted by expert.
struct Routing {
  std::vector<int64_t> expert_begin;  // (E + 1,): expert e's pairs are sorted rows [begin[e], begin[e + 1])
  std::vector<int64_t> token_of;      // (P,): sorted row -> its token
  std::vector<int64_t> row_of;        // (P,): pair t * k + j -> its sorted row
};

Routing sort_pairs(const int64_t* ids, int64_t pairs, int64_t top_k, int64_t experts) {
  Routing routing{std::vector<int64_t>(experts + 1, 0), std::vector<int64_t>(pairs),
                  std::vector<int64_t>(pairs)};
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < experts, "moe_experts_bf16: expert id ", ids[p], " outside [0, ",
                experts, ")");
    ++routing.expert_begin[ids[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) routing.expert_begin[e + 1] += routing.expert_begin[e];
  std::vector<int64_t> next(routing.expert_begin.begin(), routing.expert_begin.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t row = next[ids[p]]++;
    routing.token_of[row] = p / top_k;
    routing.row_of[p] = row;
  }
  return routing;
}

// A unit of work: weight rows [begin, end) of one expert (in the output dimension of its matmul).
struct Unit {
  int64_t expert, begin, end;
};

std::vector<Unit> split_units(const Routing& routing, int64_t experts, int64_t rows, int64_t rows_per_unit) {
  std::vector<Unit> units;
  for (int64_t e = 0; e < experts; ++e)
    if (routing.expert_begin[e + 1] > routing.expert_begin[e])
      for (int64_t r = 0; r < rows; r += rows_per_unit) units.push_back({e, r, std::min(rows, r + rows_per_unit)});
  return units;
}

// run(unit, panel, next) for every unit, over the threads: each takes a contiguous range of units, then
// helps the others. panel: the thread's scratch of `panel_dwords` for packed weights (expert_tiles.h); next:
// the unit it runs after this one where it knows it (the rest of its claim), else null.
template <typename Run>
void run_units(const std::vector<Unit>& units, int64_t panel_dwords, Run&& run) {
  const int64_t count = static_cast<int64_t>(units.size());
  if (count == 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  mili::RowRanges ranges(count, threads, 1);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    std::vector<uint32_t> panel(panel_dwords);
    ranges.work_through(first, last, kUnitsClaimed, 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) run(units[u], panel.data(), u + 1 < end ? &units[u + 1] : nullptr);
    });
  });
}

// x rows in sorted pair order (bf16, or widened to fp32 without pair products).
template <typename T>
torch::Tensor gather_rows(const BF16* x, int64_t width, const Routing& routing, at::ScalarType dtype) {
  const int64_t pairs = static_cast<int64_t>(routing.token_of.size());
  auto out = torch::empty({pairs, width}, torch::TensorOptions().dtype(dtype));
  T* op = out.data_ptr<T>();
  at::parallel_for(0, pairs, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const BF16* src = x + routing.token_of[row] * width;
      std::copy(src, src + width, op + row * width);  // BF16 -> float converts exactly
    }
  });
  return out;
}

// An expert's weights within a layer's stacks: gate_up (E, 2I, H), gate rows first, and down (E, H, I).
struct ExpertWeights {
  const BF16* gate_up;
  const BF16* down;
  int64_t hidden, intermediate;
};

// Experts with few pairs each (a decode step's): a thread takes a whole expert at a time and runs its
// gate/up rows (one contiguous block), SwiGLU and its down rows (another) before the next, so each thread
// streams its experts' weights in order and the layer has one parallel section, with no barrier between
// the two matmuls for the threads to wait at. Expert e's pairs' outputs go to rows
// [begin[e], begin[e + 1]) of eo (H apart).
void run_small_experts(const Routing& routing, int64_t experts, const torch::Tensor& xs, bool pairs,
                       const ExpertWeights& weights, BF16* eo) {
  const int64_t hidden = weights.hidden, intermediate = weights.intermediate;
  std::vector<int64_t> routed;  // the experts with pairs, in order
  for (int64_t e = 0; e < experts; ++e)
    if (routing.expert_begin[e + 1] > routing.expert_begin[e]) routed.push_back(e);
  const int64_t count = static_cast<int64_t>(routed.size());
  if (count == 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  mili::RowRanges ranges(count, threads, 1);
  at::parallel_for(0, threads, 1, [&](int64_t first_part, int64_t last_part) {
    std::vector<BF16> products(kPanelMinRows * 2 * intermediate);  // gate columns, then up columns
    std::vector<BF16> act(kPanelMinRows * intermediate);
    std::vector<float> act_f(pairs ? 0 : kPanelMinRows * intermediate);
    ranges.work_through(first_part, last_part, 1, 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const int64_t e = routed[u], first = routing.expert_begin[e], block = routing.expert_begin[e + 1] - first;
        const BF16* gate_up = weights.gate_up + e * 2 * intermediate * hidden;
        if (pairs)
          multiply_weight_rows_packing(xs.data_ptr<BF16>() + first * hidden, block, hidden, gate_up, products.data(),
                                       2 * intermediate, 0, 2 * intermediate);
        else
          multiply_weight_rows(nullptr, xs.data_ptr<float>() + first * hidden, block, hidden, gate_up,
                               products.data(), 2 * intermediate, 0, 2 * intermediate);
        for (int64_t r = 0; r < block; ++r) {
          BF16* out = act.data() + r * intermediate;
          const BF16* gate = products.data() + r * 2 * intermediate;
          mili::silu_mul_row(gate, gate + intermediate, out, intermediate);
          if (!pairs) std::copy(out, out + intermediate, act_f.data() + r * intermediate);
        }
        const BF16* down = weights.down + e * hidden * intermediate;
        if (pairs)
          multiply_weight_rows_packing(act.data(), block, intermediate, down, eo + first * hidden, hidden, 0, hidden);
        else
          multiply_weight_rows(nullptr, act_f.data(), block, intermediate, down, eo + first * hidden, hidden, 0,
                               hidden);
      }
    });
  });
}

// Experts of which some have many pairs (a prefill chunk's): units of contiguous weight rows of one expert
// over the threads, first the gate/up projection and SwiGLU of every expert, then the down projection.
void run_large_experts(const Routing& routing, int64_t experts, const torch::Tensor& xs, bool pairs,
                       const ExpertWeights& weights, BF16* eo) {
  // First matmul and the activation: unit = gate columns [begin, end) of one expert, with their up rows.
  const int64_t rows = routing.expert_begin[experts], hidden = weights.hidden, intermediate = weights.intermediate;
  const BF16* gate_up_w = weights.gate_up;
  const BF16* down_w = weights.down;
  auto activated = torch::empty({rows, intermediate}, torch::dtype(at::kBFloat16));
  auto activated_f = pairs ? torch::Tensor() : torch::empty({rows, intermediate}, torch::dtype(at::kFloat));
  BF16* act = activated.data_ptr<BF16>();
  // A thread's panel holds a unit's gate and up rows (or its down rows) as pairs: one dword per two values.
  const int64_t panel_dwords = pairs ? 2 * kGateColumnsPerUnit * std::max(hidden, intermediate) / 2 : 0;
  run_units(split_units(routing, experts, intermediate, kGateColumnsPerUnit), panel_dwords,
            [&](const Unit& unit, uint32_t* panel, const Unit* next) {
    const int64_t width = unit.end - unit.begin;
    const BF16* gate_rows = gate_up_w + (unit.expert * 2 * intermediate + unit.begin) * hidden;
    const BF16* up_rows = gate_rows + intermediate * hidden;
    const int64_t first = routing.expert_begin[unit.expert], last = routing.expert_begin[unit.expert + 1];
    if (pairs && last - first >= kPanelMinRows) {
      mili::LinesAhead ahead;
      if (next != nullptr) {
        const BF16* next_gate = gate_up_w + (next->expert * 2 * intermediate + next->begin) * hidden;
        ahead.add(0, next_gate, (next->end - next->begin) * hidden);
        ahead.add(1, next_gate + intermediate * hidden, (next->end - next->begin) * hidden);
      }
      const int groups = static_cast<int>(width / mili::kPanelGroupRows);  // gate groups, then as many up groups
      for (int g = 0; g < groups; ++g) {
        mili::pack_group(gate_rows + g * mili::kPanelGroupRows * hidden, hidden, g, 2 * groups, panel);
        mili::pack_group(up_rows + g * mili::kPanelGroupRows * hidden, hidden, groups + g, 2 * groups, panel);
      }
      mili::multiply_panel(xs.data_ptr<BF16>() + first * hidden, hidden, last - first, panel, hidden / 2,
                           2 * groups, true, act + first * intermediate + unit.begin, intermediate, ahead);
      return;
    }
    BF16 products[kRowBlock * 2 * kGateColumnsPerUnit];  // a block's gate columns, then its up columns
    for (int64_t m = first; m < last; m += kRowBlock) {
      const int64_t block = std::min(kRowBlock, last - m);
      const BF16* xb = pairs ? xs.data_ptr<BF16>() + m * hidden : nullptr;
      const float* xf = pairs ? nullptr : xs.data_ptr<float>() + m * hidden;
      multiply_weight_rows(xb, xf, block, hidden, gate_rows, products, 2 * width, 0, width);
      multiply_weight_rows(xb, xf, block, hidden, up_rows, products + width, 2 * width, 0, width);
      for (int64_t r = 0; r < block; ++r) {
        BF16* out = act + (m + r) * intermediate + unit.begin;
        mili::silu_mul_row(products + r * 2 * width, products + r * 2 * width + width, out, width);
        if (!pairs) std::copy(out, out + width, activated_f.data_ptr<float>() + (m + r) * intermediate + unit.begin);
      }
    }
  });

  // Second matmul: unit = output columns [begin, end) of one expert, written to its pairs' rows.
  run_units(split_units(routing, experts, hidden, kDownRowsPerUnit), panel_dwords,
            [&](const Unit& unit, uint32_t* panel, const Unit* next) {
    const BF16* w = down_w + unit.expert * hidden * intermediate;
    const int64_t first = routing.expert_begin[unit.expert], last = routing.expert_begin[unit.expert + 1];
    if (pairs && last - first >= kPanelMinRows) {
      mili::LinesAhead ahead;
      if (next != nullptr)
        ahead.add(0, down_w + (next->expert * hidden + next->begin) * intermediate,
                  (next->end - next->begin) * intermediate);
      const int groups = static_cast<int>((unit.end - unit.begin) / mili::kPanelGroupRows);
      for (int g = 0; g < groups; ++g)
        mili::pack_group(w + (unit.begin + g * mili::kPanelGroupRows) * intermediate, intermediate, g, groups, panel);
      mili::multiply_panel(act + first * intermediate, intermediate, last - first, panel, intermediate / 2, groups,
                           false, eo + first * hidden + unit.begin, hidden, ahead);
      return;
    }
    for (int64_t m = first; m < last; m += kRowBlock) {
      const int64_t block = std::min(kRowBlock, last - m);
      multiply_weight_rows(pairs ? act + m * intermediate : nullptr,
                           pairs ? nullptr : activated_f.data_ptr<float>() + m * intermediate, block, intermediate, w,
                           eo + m * hidden, hidden, unit.begin, unit.end);
    }
  });

}

}  // namespace

namespace mili {

void check_experts(const torch::Tensor& x, const torch::Tensor& gate_up, const torch::Tensor& down,
                   bool bf16_dot_products) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && gate_up.scalar_type() == at::kBFloat16 &&
                  down.scalar_type() == at::kBFloat16, "moe: bf16 activations and expert weights only");
  TORCH_CHECK(x.device().is_cpu() && gate_up.device().is_cpu() && down.device().is_cpu(), "moe: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == down.size(0) &&
                  gate_up.size(1) == 2 * down.size(2) && gate_up.size(2) == x.size(1) && down.size(1) == x.size(1),
              "moe: x (T, H), gate_up (E, 2I, H) and down (E, H, I)");
  TORCH_CHECK(x.is_contiguous() && gate_up.is_contiguous() && down.is_contiguous(), "moe: contiguous tensors");
  TORCH_CHECK(x.size(1) % kLanes == 0 && down.size(2) % kLanes == 0,
              "moe: hidden and intermediate sizes must be multiples of 16");
  TORCH_CHECK(!bf16_dot_products || cpu_has_bf16_dot_products(), "moe: this CPU has no AVX512-BF16");
}

torch::Tensor run_experts(const torch::Tensor& x, const torch::Tensor& gate_up, const torch::Tensor& down,
                          const int64_t* ids, const at::BFloat16* wp, int64_t top_k, bool pairs,
                          int64_t* expert_load) {
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t experts = gate_up.size(0), intermediate = down.size(2);
  const Routing routing = sort_pairs(ids, tokens * top_k, top_k, experts);
  if (expert_load != nullptr)
    for (int64_t e = 0; e < experts; ++e) expert_load[e] += routing.expert_begin[e + 1] - routing.expert_begin[e];
  const int64_t rows = tokens * top_k;
  const torch::Tensor xs = pairs ? gather_rows<BF16>(x.data_ptr<BF16>(), hidden, routing, at::kBFloat16)
                                 : gather_rows<float>(x.data_ptr<BF16>(), hidden, routing, at::kFloat);
  const ExpertWeights weights{gate_up.data_ptr<BF16>(), down.data_ptr<BF16>(), hidden, intermediate};
  auto expert_out = torch::empty({rows, hidden}, x.options());
  BF16* eo = expert_out.data_ptr<BF16>();
  int64_t most_pairs = 0;
  for (int64_t e = 0; e < experts; ++e)
    most_pairs = std::max(most_pairs, routing.expert_begin[e + 1] - routing.expert_begin[e]);
  if (most_pairs < kPanelMinRows)
    run_small_experts(routing, experts, xs, pairs, weights, eo);
  else
    run_large_experts(routing, experts, xs, pairs, weights, eo);

  // Each token's k rows, weighted (rounded) and summed in fp32, rounded once.
  auto out = torch::empty({tokens, hidden}, x.options());
  BF16* op = out.data_ptr<BF16>();
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = 0; i < hidden; i += kLanes) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < top_k; ++j) {
          const __m512 weight = _mm512_set1_ps(static_cast<float>(wp[t * top_k + j]));
          const BF16* row = eo + routing.row_of[t * top_k + j] * hidden + i;
          sum = _mm512_add_ps(sum, mili::round_bf16(_mm512_mul_ps(mili::widen_bf16(row), weight)));
        }
        mili::store_bf16(op + t * hidden + i, mili::round_bf16(sum));
      }
  });
  return out;
}

}  // namespace mili

torch::Tensor moe_experts_bf16(const torch::Tensor& x, const torch::Tensor& gate_up, const torch::Tensor& down,
                               const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
                               bool bf16_dot_products) {
  mili::check_experts(x, gate_up, down, bf16_dot_products);
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_weights.scalar_type() == at::kBFloat16,
              "moe_experts_bf16: int64 expert ids and bf16 routing weights");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.sizes() == topk_weights.sizes() && topk_ids.size(0) == x.size(0),
              "moe_experts_bf16: topk ids and weights (T, k)");
  const torch::Tensor ids = topk_ids.contiguous(), weights = topk_weights.contiguous();
  return mili::run_experts(x, gate_up, down, ids.data_ptr<int64_t>(), weights.data_ptr<at::BFloat16>(),
                           topk_ids.size(1), bf16_dot_products, nullptr);
}
