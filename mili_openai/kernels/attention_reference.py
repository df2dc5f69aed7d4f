"""Plain torch references for the paged attention kernels (triton_attention.py, cpu.py): the same arguments,
one sequence at a time in float64, K/V gathered through the page table and expanded per query head. For
tests: slow and obviously right (`context_slots` also serves the torch paths)."""

from __future__ import annotations

import torch


def context_slots(table_row: torch.Tensor, page_size: int, length: int) -> torch.Tensor:
    """(length,) slots of positions [0, length) of a sequence whose pages are `table_row`."""
    positions = torch.arange(length, device=table_row.device)
    return table_row[positions // page_size].long() * page_size + positions % page_size


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_positions: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q (L, H, D) at `query_positions` over keys/values (C, KV, D) at positions [0, C), causally -> (L, H, D)
    in float64."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)  # (C, H, D)
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,chd->hlc", q.double(), keys) * scale  # (H, L, C)
    key_positions = torch.arange(keys.shape[0], device=q.device)
    visible = key_positions[None, :] <= query_positions[:, None]  # (L, C)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hlc,chd->lhd", weights, values)


def paged_decode_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                           page_size: int, ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """As TritonAttention.paged_decode_attention: q (B, H, D) -> (B, H, D) in q's dtype."""
    out = torch.empty_like(q)
    for row in range(q.shape[0]):
        length = int(ctx_lens[row])
        slots = context_slots(page_table[row], page_size, length)
        position = torch.tensor([length - 1], device=q.device)
        out[row] = _attend(q[row : row + 1], k_pool[slots], v_pool[slots], position, scale)[0].to(q.dtype)
    return out


def paged_prefill_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                            page_size: int, cu_seqlens: torch.Tensor, ctx_lens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """As TritonAttention.paged_prefill_attention: q (T, H, D) of every segment's new tokens -> (T, H, D)."""
    out = torch.empty_like(q)
    for segment in range(ctx_lens.shape[0]):
        start, end, ctx = int(cu_seqlens[segment]), int(cu_seqlens[segment + 1]), int(ctx_lens[segment])
        slots = context_slots(page_table[segment], page_size, ctx)
        positions = torch.arange(ctx - (end - start), ctx, device=q.device)
        out[start:end] = _attend(q[start:end], k_pool[slots], v_pool[slots], positions, scale).to(q.dtype)
    return out
