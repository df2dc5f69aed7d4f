"""Attention over the paged KV cache for one layer: write the new tokens' K/V into their slots, then
attend through the step's page tables (`ForwardBatch.pages`): all decode rows in one call, all prefill
chunks in one more, through a compiled kernel reading the pool in place where one applies
(`AttentionKernel`: the CPU kernels, the Triton kernels), else torch's SDPA over copies gathered through
the same page tables (each prefill chunk on its own).

Grouped-query attention uses SDPA's `enable_gqa=True`: it matches expanding the KV heads exactly and
copies nothing per head, which makes fp32 decode much faster on CPU.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from mili_openai.kernels.attention_reference import context_slots
from mili_openai.model.batch import ForwardBatch, PageTables


class AttentionKernel(Protocol):
    """Compiled attention reading K/V in place through page tables, every decode row of a step in one call
    and every prefill chunk in another (mili_openai.kernels.CpuKernels, kernels.triton_attention). Page
    tables are (rows, W) int64 or int32; `out`, where given, is a contiguous (rows, H, D) the result goes to."""

    def supports_decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor) -> bool: ...

    def paged_decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               page_table: torch.Tensor, page_size: int, ctx_lens: torch.Tensor, scale: float,
                               out: torch.Tensor | None = None) -> torch.Tensor: ...

    def supports_prefill_attention(self, q: torch.Tensor, k_pool: torch.Tensor) -> bool: ...

    def paged_prefill_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                page_table: torch.Tensor, page_size: int, cu_seqlens: torch.Tensor,
                                ctx_lens: torch.Tensor, max_length: int, scale: float,
                                out: torch.Tensor | None = None) -> torch.Tensor: ...


def decode_compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype decode attention runs in.

    On CPU, torch's SDPA for a single bf16/fp16 query is several times slower than float32, and the
    gathered context is a copy anyway, so upcasting it costs little and also rounds less. On GPUs the
    native dtype is fastest.
    """
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V at its slot. pools (slots, kv_heads, D); k, v (T, kv_heads, D)."""
    k_pool.index_copy_(0, slot_mapping, k)
    v_pool.index_copy_(0, slot_mapping, v)


def gather_slots(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool (slots, kv_heads, D) rows at `slots` (any shape S) -> (*S, kv_heads, D).

    index_select on the flattened slots rather than advanced indexing: same copy, less per-call
    overhead, which matters at two gathers per layer per step.
    """
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, *pool.shape[1:])



def table_slots(page_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """(rows, W) page table -> (rows, W * page_size) int64: the slot of every position its pages cover."""
    offsets = torch.arange(page_size, device=page_table.device)
    return (page_table.long()[:, :, None] * page_size + offsets).flatten(1)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: PageTables,
                     ctx_lens: torch.Tensor, scale: float, kernel: AttentionKernel | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row against its context. q (B, H, D) -> (B, H, D), into `out` where given.

    With a compiled kernel the context is read in place from the pool; otherwise every row's pages are
    gathered into a padded (B, W * page_size) copy and masked past its length.
    """
    if kernel is not None and kernel.supports_decode_attention(q, k_pool):
        return kernel.paged_decode_attention(q, k_pool, v_pool, pages.decode, pages.page_size, ctx_lens, scale, out=out)
    slots = table_slots(pages.decode, pages.page_size)  # (B, C)
    mask = (torch.arange(slots.shape[1], device=slots.device)[None, :] < ctx_lens[:, None])[:, None, None, :]
    compute = decode_compute_dtype(q.dtype, q.device)
    keys = gather_slots(k_pool, slots).to(compute).transpose(1, 2)  # (B, kv_heads, C, D)
    values = gather_slots(v_pool, slots).to(compute).transpose(1, 2)  # (B, kv_heads, C, D)
    attended = F.scaled_dot_product_attention(
        q.to(compute).unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    ).squeeze(2)  # (B, H, D)
    if out is None:
        return attended.to(q.dtype)
    out.copy_(attended)
    return out


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                      v_pool: torch.Tensor, batch: ForwardBatch, scale: float, kernel: AttentionKernel | None,
                      out: torch.Tensor) -> torch.Tensor:
    """Every prefill chunk causally over its cached prefix plus itself, into `out`.

    q, out (P, H, D); k_new, v_new (P, kv_heads, D): the prefill rows and their own K/V (already written to
    the pool). Row i of a chunk of L sits at context position ctx - L + i and sees context [0, ctx - L + i].
    """
    pages = batch.pages
    if kernel is not None and kernel.supports_prefill_attention(q, k_pool):
        return kernel.paged_prefill_attention(q, k_pool, v_pool, pages.prefill, pages.page_size,
                                              pages.prefill_cu_seqlens, pages.prefill_ctx_lens, pages.max_prefill_len,
                                              scale, out=out)
    first = batch.num_decode
    for index, segment in enumerate(batch.prefills):
        rows = slice(segment.start - first, segment.start - first + segment.length)
        out[rows] = chunk_attention(q[rows], k_new[rows], v_new[rows], k_pool, v_pool, pages.prefill[index],
                                    pages.page_size, segment.context_len, scale)
    return out


def chunk_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, table_row: torch.Tensor, page_size: int, ctx: int,
                    scale: float) -> torch.Tensor:
    """One chunk through torch's SDPA: q (L, H, D) over the `ctx` positions its pages `table_row` hold, its
    own K/V (k_new, v_new) the last L -> (L, H, D)."""
    length = q.shape[0]
    if ctx == length:
        # no cached prefix: the chunk's own K/V are the whole context, no gather, plain causal mask
        keys, values, mask, causal = k_new, v_new, None, True
    else:
        slots = context_slots(table_row, page_size, ctx)
        keys = gather_slots(k_pool, slots)  # (ctx, kv_heads, D)
        values = gather_slots(v_pool, slots)
        key_pos = torch.arange(ctx, device=q.device)
        query_pos = torch.arange(ctx - length, ctx, device=q.device)
        mask, causal = key_pos[None, :] <= query_pos[:, None], False  # (L, ctx), bottom-right causal
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # (1, H, L, D)
        keys.transpose(0, 1).unsqueeze(0),  # (1, kv_heads, ctx, D)
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )  # (1, H, L, D)
    return out.squeeze(0).transpose(0, 1)  # (L, H, D)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, batch: ForwardBatch, scale: float,
                    kernel: AttentionKernel | None = None) -> torch.Tensor:
    """q (T, H, D), k/v (T, kv_heads, D) of the batch's new tokens -> attention output (T, H, D)."""
    write_kv(k_pool, v_pool, k, v, batch.slot_mapping)
    num_decode = batch.num_decode
    if not batch.prefills:  # the steady state: no output buffer to fill
        return decode_attention(q, k_pool, v_pool, batch.pages, batch.decode_ctx_lens, scale, kernel)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (T, H, D), contiguous whatever q's strides
    if num_decode:
        decode_attention(q[:num_decode], k_pool, v_pool, batch.pages, batch.decode_ctx_lens, scale, kernel,
                         out[:num_decode])
    prefill_attention(q[num_decode:], k[num_decode:], v[num_decode:], k_pool, v_pool, batch, scale, kernel,
                      out[num_decode:])
    return out
