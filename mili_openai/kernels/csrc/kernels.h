// The kernels' entry points, shared by the Python bindings and the fused decode stack.
#pragma once

#include <torch/extension.h>

#include <vector>

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, bool bf16_dot_products, bool amx_tiles);
// y[m, n] = x[m] . w[n] for x rows [0, M) (K apart) and weight rows [n_begin, n_end) (w rows K apart), y rows
// ldy apart, on the calling thread; xb: bf16 x for pair products (AVX512-BF16), else xf: x widened to fp32.
// Each block of weight rows is read once for all M rows (linear_bf16's tiles; callers block M for L2).
void multiply_weight_rows(const at::BFloat16* xb, const float* xf, int64_t M, int64_t K, const at::BFloat16* w,
                          at::BFloat16* y, int64_t ldy, int64_t n_begin, int64_t n_end);
// The same with pair products for bf16 x, packed first as linear_bf16 packs it (rows of a tile's chunk side
// by side, one sequential stream rather than rows K apart in the same few L1 sets) where tiles of several
// rows read it: for a matmul over all of a weight's rows, where packing costs little beside the products.
void multiply_weight_rows_packing(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w,
                                  at::BFloat16* y, int64_t ldy, int64_t n_begin, int64_t n_end);
bool cpu_has_amx_tiles();  // AMX-BF16, with Linux's leave to use the tiles (asked once per process)
bool amx_linear_fits(int64_t M, int64_t N, int64_t K);
torch::Tensor linear_amx(const torch::Tensor& x, const torch::Tensor& w);
// Attention through page tables (attention_pages.h), as kernels/triton_attention.py takes it; out: (T, H, D)
void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                            const torch::Tensor& page_table, int64_t page_size, const torch::Tensor& ctx_lens,
                            double scale, bool bf16_dot_products, bool amx_tiles, int64_t prefetch_blocks,
                            torch::Tensor out);
// the same over slot rows (B, C) int64 already listed: for the decode stack, which lists them once for all layers
void decode_attention_over_slots(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                 const torch::Tensor& slots, const torch::Tensor& ctx_lens, double scale,
                                 bool bf16_dot_products, bool amx_tiles, int64_t prefetch_blocks, torch::Tensor& out);
void paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                             const torch::Tensor& page_table, int64_t page_size, const torch::Tensor& cu_seqlens,
                             const torch::Tensor& ctx_lens, double scale, bool bf16_dot_products, bool amx_tiles,
                             torch::Tensor out);
bool cpu_has_bf16_dot_products();
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps);
// Qwen3.5's zero-centred RMSNorm (1 + w), after the residual add into x where `residual` is given
torch::Tensor zero_centered_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                                     const c10::optional<torch::Tensor>& residual);
torch::Tensor qk_norm_rope_bf16(const torch::Tensor& qk, const torch::Tensor& q_weight, const torch::Tensor& k_weight,
                                int64_t num_q_heads, double eps, const torch::Tensor& cos,
                                const torch::Tensor& signed_sin);
torch::Tensor silu_mul_bf16(const torch::Tensor& gate_up);
// One projection's LoRA slots (lora_bf16.cpp): A (S, W, I) and B^T (S, W, O) bf16, n modules stacked, module i's
// output columns [offsets[i], offsets[i + 1]) reading A rows [i W / n, (i + 1) W / n) alone (model/lora_layers.py)
struct LoraProjection {
  torch::Tensor a, b_t;
  std::vector<int64_t> offsets;
};
// out (T, O) += each row's slot's delta (row_slots (T,) int64, -1: none), in place, with torch's bf16 rounding
void add_lora_bf16(torch::Tensor& out, const torch::Tensor& x, const LoraProjection& lora, const torch::Tensor& row_slots);
torch::Tensor moe_experts_bf16(const torch::Tensor& x, const torch::Tensor& gate_up, const torch::Tensor& down,
                               const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
                               bool bf16_dot_products);
torch::Tensor sparse_moe_bf16(const torch::Tensor& x, const torch::Tensor& router, const torch::Tensor& gate_up,
                              const torch::Tensor& down, int64_t top_k, bool normalize,
                              const torch::Tensor& expert_load, bool bf16_dot_products);
torch::Tensor sample_rows(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& top_k,
                          const torch::Tensor& top_p, const torch::Tensor& min_p, const torch::Tensor& uniform);
torch::Tensor truncation_thresholds(const torch::Tensor& logits, const torch::Tensor& temperature,
                                    const torch::Tensor& top_k, const torch::Tensor& top_p,
                                    const torch::Tensor& min_p);
// Quantized weights (linear_int8.cpp, linear_int4.cpp; layouts in kernels/quantized.py)
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales);
torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales,
                          const torch::Tensor& zeros);
torch::Tensor dequantize_int8(const torch::Tensor& weight, const torch::Tensor& scales);
torch::Tensor dequantize_int4(const torch::Tensor& weight, const torch::Tensor& scales, const torch::Tensor& zeros);
// W8A8 (linear_w8a8.cpp): x quantized to int8 per token (empty static_scale) or with a static scale, then
// multiplied as integers (AVX512-VNNI); the quantization alone gives (int8 levels (M, K), float32 scales (M,))
bool cpu_has_int8_dot_products();
torch::Tensor linear_w8a8(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales,
                          const torch::Tensor& static_scale);
std::vector<torch::Tensor> quantize_int8_activations(const torch::Tensor& x, const torch::Tensor& static_scale);
// the same products for many rows of x: dequantized `slice_rows` weight rows at a time into torch's GEMM
torch::Tensor gemm_int8(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales, int64_t slice_rows,
                        bool widen_to_fp32);
torch::Tensor gemm_int4(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales,
                        const torch::Tensor& zeros, int64_t slice_rows, bool widen_to_fp32);
