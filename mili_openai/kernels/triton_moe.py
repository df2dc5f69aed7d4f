"""A Qwen3-MoE layer's experts on CUDA in two Triton launches, the fused-MoE scheme of vLLM and SGLang.

Every (token, slot) pair of the routing is one row of work. The pairs are sorted by expert and each
expert's run is padded to a multiple of BLOCK_M rows (`align_to_blocks`), so a program's BLOCK_M rows all
use one expert's weights: launch 1 multiplies each pair's token by its expert's [gate; up], launch 2 the
activated rows by its down projection, scaled by the pair's routing weight; the k rows of a token are
then summed. Padding rows carry an out-of-range pair id and are masked out.

Nothing here syncs with the host: the grid is sized for the worst case padding (every expert's run one
row short of a block) and programs past the real padded length return at once, so a CUDA graph can
capture the whole layer. Block sizes are fixed, not tuned per GPU.

Tested on CPU tensors under TRITON_INTERPRET=1 (tests/kernels/test_triton_moe.py); `grouped_swiglu` in
model/moe.py is the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# rows per program: decode-sized blocks while experts average few pairs each (less padding), larger ones for
# prefill (more reuse of each weight tile); tl.dot needs at least 16
BLOCK_M_SMALL, BLOCK_M_LARGE = 16, 64
BLOCK_N = 64
BLOCK_K = 32


# the token count's multiple changes every step: left unspecialised, it compiles no new variant under load
@triton.jit(do_not_specialize=["num_pairs"])
def _expert_matmul_kernel(
    a_ptr, w_ptr, out_ptr, pair_weights_ptr, sorted_pairs_ptr, block_experts_ptr, padded_length_ptr,
    N, K, num_pairs,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    PAIRS_PER_A_ROW: tl.constexpr,  # top_k when `a` holds one row per token, 1 when one row per pair
    MUL_PAIR_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[pair, n] = sum_k a[row of pair, k] * w[expert of pair, n, k] (x the pair's weight), BLOCK_M pairs
    of one expert by BLOCK_N outputs per program."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(padded_length_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    valid = pairs < num_pairs
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (pairs // PAIRS_PER_A_ROW).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    # (BLOCK_K, BLOCK_N): the expert's weight read transposed
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k_start
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if MUL_PAIR_WEIGHT:
        acc *= tl.load(pair_weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids (T, k) -> (sorted_pairs (P,), block_experts (P / block_m,), padded_length (1,)).

    sorted_pairs lists the pair ids (token * k + slot) grouped by expert, each expert's run padded with the
    id T * k up to a multiple of block_m; block_experts is the expert of each block (blocks past
    padded_length are unused). P is the worst case, so the shapes depend on T alone."""
    flat = topk_ids.reshape(-1)  # (T*k,)
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat,
                                                                                          torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # (E,)
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # (T*k,) pairs by expert
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    capacity = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[(padded_end - padded)[sorted_experts] + rank_in_expert] = order
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_experts, padded_end[-1:]


def _expert_matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pair_weights: torch.Tensor,
                   layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor], pairs_per_a_row: int,
                   multiply_weights: bool, block_m: int) -> None:
    sorted_pairs, block_experts, padded_length = layout
    n, k = w.shape[1], w.shape[2]
    grid = (sorted_pairs.numel() // block_m, triton.cdiv(n, BLOCK_N))
    _expert_matmul_kernel[grid](
        a, w, out, pair_weights, sorted_pairs, block_experts, padded_length,
        n, k, out.shape[0],
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        PAIRS_PER_A_ROW=pairs_per_a_row, MUL_PAIR_WEIGHT=multiply_weights,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # fp32 stays fp32 (no TF32 rounding)
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )


class TritonMoe:
    """`ExpertsKernel` (model/moe.py) on CUDA."""

    @staticmethod
    def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
        """x (T, H); gate_up (E, 2I, H) gate rows first; down (E, H, I); routing (T, k) -> (T, H)."""
        tokens, top_k = topk_ids.shape
        num_experts, intermediate = gate_up.shape[0], down.shape[2]
        num_pairs = tokens * top_k
        block_m = BLOCK_M_SMALL if num_pairs <= BLOCK_M_SMALL * num_experts else BLOCK_M_LARGE
        layout = align_to_blocks(topk_ids, num_experts, block_m)
        pair_weights = topk_weights.reshape(-1).contiguous()
        gate_up_rows = torch.empty((num_pairs, 2 * intermediate), dtype=x.dtype, device=x.device)
        _expert_matmul(x, gate_up, gate_up_rows, pair_weights, layout, top_k, False, block_m)
        gate, up = gate_up_rows.split(intermediate, dim=-1)
        activated = F.silu(gate).mul_(up)  # (T*k, I)
        out = torch.empty((num_pairs, x.shape[1]), dtype=x.dtype, device=x.device)
        _expert_matmul(activated, down, out, pair_weights, layout, 1, True, block_m)
        return out.view(tokens, top_k, -1).sum(dim=1)  # (T, H)
