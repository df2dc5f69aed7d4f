// Every decoder layer of a decode step in one call: the same kernels, in the same order and with the
// same rounding, as the Python modules run them one by one.
//
// At batch 1 a Qwen3-0.6B layer is ~14 small operations around four matmuls; called from Python each
// pays module dispatch, argument checks and tensor views, a sizeable share of a step over 28 layers.
// Here a layer's overhead is a few allocations, and the GIL is released for the whole stack so the event
// loop streams meanwhile.
//
// The stack starts from the token ids (the embedding lookup is a row copy, done here): between two
// steps the forward thread then calls no torch op, each of which would hand the GIL to the event loop
// and wait for it back, while the loop does its own work for the step that just ended.
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "attention_pages.h"
#include "kernels.h"
#include "moe.h"
#include "quantized_linear.h"

namespace {

// see DecodeStack's constructor for the order; a sparse layer has no gate_up and down linears
constexpr size_t kNormsPerLayer = 4, kLinearsPerLayer = 4, kSparseLinearsPerLayer = 2;

struct LayerWeights {
  torch::Tensor input_norm, q_norm, k_norm, post_norm;
  PackedLinear qkv, o, gate_up, down;  // a sparse layer's gate_up and down are empty
  mili::SparseMoeLayer sparse;         // a Qwen3-MoE layer's router and experts (top_k 0: dense)
  LoraProjection lora_qkv, lora_o, lora_gate_up, lora_down;  // adapter slots (set_lora); empty A: none
};

// y = a linear's output for x: each row's adapter delta added in place (lora_slots (B,), or empty for no LoRA)
torch::Tensor with_lora(torch::Tensor y, const torch::Tensor& x, const LoraProjection& lora,
                        const torch::Tensor& lora_slots) {
  if (lora.a.defined() && lora_slots.numel() > 0) add_lora_bf16(y, x, lora, lora_slots);
  return y;
}

// Copy each token's K (from the rotated heads) and V (from the projection) into its pool slot.
void write_kv(const at::BFloat16* k, int64_t k_stride, const at::BFloat16* v, int64_t v_stride,
              const int64_t* slot_mapping, int64_t tokens, int64_t row, int64_t num_slots, at::BFloat16* k_pool,
              at::BFloat16* v_pool) {
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "decode_stack: slot ", slot, " outside the pool");
    std::memcpy(k_pool + slot * row, k + t * k_stride, row * sizeof(at::BFloat16));
    std::memcpy(v_pool + slot * row, v + t * v_stride, row * sizeof(at::BFloat16));
  }
}

}  // namespace

class DecodeStack {
 public:
  // embedding (vocab, hidden), bf16, or int8 or int4 rows (an LM head it is tied to); per layer, norms: input_layernorm,
  // q_norm, k_norm, post_attention_layernorm (bf16); linears: qkv_proj, o_proj, then a dense layer's
  // gate_up_proj, down_proj (bf16, int8 or int4); sparse: per layer its MoE block (bf16), or none (top_k 0) for a
  // dense layer. All held, not copied.
  DecodeStack(const PackedLinear& embedding, const std::vector<torch::Tensor>& norms,
              const std::vector<PackedLinear>& linears, const std::vector<mili::SparseMoeLayer>& sparse,
              int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              bool bf16_dot_products, bool amx_tiles, int64_t prefetch_blocks)
      : embedding_(embedding), num_q_heads_(num_q_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
        eps_(eps), scale_(scale), bf16_dot_products_(bf16_dot_products), amx_tiles_(amx_tiles),
        prefetch_blocks_(prefetch_blocks) {
    TORCH_CHECK(!norms.empty() && norms.size() % kNormsPerLayer == 0 && sparse.size() == norms.size() / kNormsPerLayer,
                "decode_stack: 4 norms and one sparse block (or none) per layer");
    TORCH_CHECK(embedding.weight.dim() == 2, "decode_stack: embedding (vocab, hidden), bf16, int8 or int4");
    for (const auto& w : norms) check_bf16(w);
    check_linear(embedding);
    if (embedding.bits != 16) embedding_rows_ = packed_rows(embedding);
    size_t next = 0;  // the next layer's first linear
    for (size_t layer = 0; layer < sparse.size(); ++layer) {
      const size_t count = sparse[layer].top_k > 0 ? kSparseLinearsPerLayer : kLinearsPerLayer;
      TORCH_CHECK(next + count <= linears.size(), "decode_stack: too few linears for the layers");
      for (size_t k = next; k < next + count; ++k) check_linear(linears[k]);
      const size_t i = layer * kNormsPerLayer;
      const PackedLinear none{16, torch::Tensor(), torch::Tensor(), torch::Tensor()};
      layers_.push_back({norms[i], norms[i + 1], norms[i + 2], norms[i + 3], linears[next], linears[next + 1],
                         count == kLinearsPerLayer ? linears[next + 2] : none,
                         count == kLinearsPerLayer ? linears[next + 3] : none, sparse[layer]});
      next += count;
    }
    TORCH_CHECK(next == linears.size(), "decode_stack: more linears than the layers take");
    linear_count_ = next;
  }

  // LoRA adapter slots on the linears, in the constructor's order of `linears` (held, not copied: loading an
  // adapter into a slot writes the same tensors); an empty A leaves its linear without.
  void set_lora(const std::vector<LoraProjection>& lora) {
    TORCH_CHECK(lora.size() == linear_count_, "decode_stack: one LoRA projection (or an empty one) per linear");
    size_t next = 0;
    for (LayerWeights& w : layers_) {
      for (LoraProjection* slot : {&w.lora_qkv, &w.lora_o, &w.lora_gate_up, &w.lora_down}) {
        if (slot == &w.lora_gate_up && w.sparse.top_k > 0) break;  // a sparse layer has two linears
        *slot = lora[next++];
      }
    }
  }

  // input_ids (B,) int64; cos, signed_sin (B, 1, D); pools (layers, 2, slots, KV, D); slot_mapping (B,) int64;
  // page_table (B, W) int64 or int32 of page_size slots a page, ctx_lens (B,) int64; lora_slots (B,) int64 each
  // row's adapter slot (-1: none), or empty -> hidden after the last layer, before the final norm. The contexts'
  // slots are listed once, for every layer.
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                        const torch::Tensor& pools, const torch::Tensor& slot_mapping, const torch::Tensor& page_table,
                        int64_t page_size, const torch::Tensor& ctx_lens, const torch::Tensor& lora_slots) const {
    torch::Tensor hidden = embed(input_ids);
    const int64_t tokens = hidden.size(0), heads = num_q_heads_ + num_kv_heads_, row = num_kv_heads_ * head_dim_;
    TORCH_CHECK(pools.scalar_type() == at::kBFloat16 && pools.is_contiguous() && pools.dim() == 5 &&
                pools.size(0) == static_cast<int64_t>(layers_.size()) && pools.size(1) == 2 &&
                pools.size(3) == num_kv_heads_ && pools.size(4) == head_dim_, "decode_stack: pools (L, 2, S, KV, D)");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                slot_mapping.numel() == tokens, "decode_stack: one int64 slot per token");
    const int64_t num_slots = pools.size(2);
    const int64_t* mapping = slot_mapping.data_ptr<int64_t>();
    TORCH_CHECK(ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous() && ctx_lens.numel() == tokens,
                "decode_stack: one int64 context length per token");
    const int64_t* lengths = ctx_lens.data_ptr<int64_t>();
    TORCH_CHECK(lora_slots.numel() == 0 || lora_slots.numel() == tokens, "decode_stack: one LoRA slot per token");
    mili::check_page_table(page_table, page_size, lengths, tokens, num_slots, "decode_stack");
    const torch::Tensor slots = mili::context_slot_rows(page_table, page_size, lengths, tokens);
    for (size_t index = 0; index < layers_.size(); ++index) {
      const LayerWeights& w = layers_[index];
      const torch::Tensor k_pool = pools.select(0, index).select(0, 0);
      const torch::Tensor v_pool = pools.select(0, index).select(0, 1);
      const torch::Tensor normed_input = rms_norm_bf16(hidden, w.input_norm, eps_);
      const torch::Tensor qkv = with_lora(linear_packed(normed_input, w.qkv, bf16_dot_products_, amx_tiles_),
                                          normed_input, w.lora_qkv, lora_slots);  // (B, (H+2KV)D)
      const torch::Tensor qk = qk_norm_rope_bf16(qkv.narrow(1, 0, heads * head_dim_).view({tokens, heads, head_dim_}),
                                                 w.q_norm, w.k_norm, num_q_heads_, eps_, cos,
                                                 signed_sin);  // (B, H + KV, D), read from qkv in place
      write_kv(qk.data_ptr<at::BFloat16>() + num_q_heads_ * head_dim_, heads * head_dim_,
               qkv.data_ptr<at::BFloat16>() + heads * head_dim_, qkv.size(1), mapping, tokens, row, num_slots,
               k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>());
      const torch::Tensor q = qk.narrow(1, 0, num_q_heads_).contiguous();
      torch::Tensor attended = torch::empty_like(q);  // (B, H, D)
      decode_attention_over_slots(q, k_pool, v_pool, slots, ctx_lens, scale_, bf16_dot_products_, amx_tiles_,
                                  prefetch_blocks_, attended);
      const torch::Tensor heads_out = attended.view({tokens, num_q_heads_ * head_dim_});
      hidden = with_lora(linear_packed(heads_out, w.o, bf16_dot_products_, amx_tiles_), heads_out, w.lora_o, lora_slots)
                   .add_(hidden);
      const torch::Tensor normed = rms_norm_bf16(hidden, w.post_norm, eps_);
      if (w.sparse.top_k > 0) {
        const mili::SparseMoeLayer& moe = w.sparse;
        hidden = mili::sparse_moe_block(normed, moe.router, moe.gate_up, moe.down, moe.top_k, moe.normalize,
                                        moe.expert_load, bf16_dot_products_).add_(hidden);
        continue;
      }
      const torch::Tensor gate_up =
          with_lora(linear_packed(normed, w.gate_up, bf16_dot_products_, amx_tiles_), normed, w.lora_gate_up, lora_slots);
      const torch::Tensor activated = silu_mul_bf16(gate_up);
      hidden = with_lora(linear_packed(activated, w.down, bf16_dot_products_, amx_tiles_), activated, w.lora_down,
                         lora_slots).add_(hidden);
    }
    return hidden;
  }

 private:
  static void check_bf16(const torch::Tensor& w) {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.device().is_cpu() && w.is_contiguous(),
                "decode_stack: contiguous bf16 CPU weights");
  }

  static void check_linear(const PackedLinear& w) {
    if (w.bits == 16)
      check_bf16(w.weight);
    else
      packed_rows(w);  // checks the quantized tensors
  }

  // (B,) token ids -> their embedding rows (B, hidden)
  torch::Tensor embed(const torch::Tensor& input_ids) const {
    TORCH_CHECK(input_ids.scalar_type() == at::kLong && input_ids.dim() == 1 && input_ids.is_contiguous(),
                "decode_stack: input_ids (B,) int64");
    const torch::Tensor& table = embedding_.weight;
    const int64_t tokens = input_ids.size(0), vocab = table.size(0);
    const int64_t width = embedding_.bits == 4 ? 2 * table.size(1) : table.size(1);  // int4: two values a byte
    auto hidden = torch::empty({tokens, width}, torch::dtype(at::kBFloat16));
    auto* out = hidden.data_ptr<at::BFloat16>();
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "decode_stack: token id ", ids[t], " outside the vocabulary");
      if (embedding_rows_)  // a quantized row, dequantized as the torch path does (QuantizedEmbedding)
        embedding_rows_->dequantize(ids[t], ids[t] + 1, out + t * width);
      else
        std::memcpy(out + t * width, table.data_ptr<at::BFloat16>() + ids[t] * width, width * sizeof(at::BFloat16));
    }
    return hidden;
  }

  PackedLinear embedding_;
  std::unique_ptr<QuantizedRows> embedding_rows_;  // quantized embeddings only
  std::vector<LayerWeights> layers_;
  size_t linear_count_ = 0;
  int64_t num_q_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  bool bf16_dot_products_;  // the matmuls' and attention's choice, as CpuKernels makes it
  bool amx_tiles_;  // the matmuls' (linear_amx.cpp) and shared prefixes' attention, as CpuKernels makes it
  int64_t prefetch_blocks_;  // decode attention's prefetch distance, as the kernel plan times it
};

void bind_decode_stack(pybind11::module& m) {
  pybind11::class_<mili::SparseMoeLayer>(m, "SparseMoeLayer")
      .def(pybind11::init<>())  // a dense layer
      .def(pybind11::init([](torch::Tensor router, torch::Tensor gate_up, torch::Tensor down, torch::Tensor load,
                             int64_t top_k, bool normalize) {
        TORCH_CHECK(top_k >= 1, "SparseMoeLayer: top_k must be at least 1");
        return mili::SparseMoeLayer{router, gate_up, down, load, top_k, normalize};
      }));
  pybind11::class_<LoraProjection>(m, "LoraProjection")
      .def(pybind11::init<>())  // a linear without adapters
      .def(pybind11::init([](torch::Tensor a, torch::Tensor b_t, std::vector<int64_t> offsets) {
        TORCH_CHECK(a.scalar_type() == at::kBFloat16 && b_t.scalar_type() == at::kBFloat16 && a.is_contiguous() &&
                    b_t.is_contiguous() && a.dim() == 3 && b_t.dim() == 3, "LoraProjection: contiguous bf16 A, B^T");
        return LoraProjection{a, b_t, offsets};
      }));
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<const PackedLinear&, const std::vector<torch::Tensor>&, const std::vector<PackedLinear>&,
                          const std::vector<mili::SparseMoeLayer>&, int64_t, int64_t, int64_t, double, double, bool,
                          bool, int64_t>())
      .def("set_lora", &DecodeStack::set_lora)
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
