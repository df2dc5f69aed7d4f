"""Attention over the paged KV cache for one layer: write the new tokens' K/V into their slots, then
attend — all decode rows in one call, each prefill chunk in its own causal call; through a compiled
kernel reading the pool in place where one applies, else torch's SDPA over gathered copies. A batch that
carries page tables (`ForwardBatch.pages`) goes to a `PagedAttentionKernel` instead: all decode rows in
one call and all prefill chunks in one more.

Grouped-query attention uses SDPA's `enable_gqa=True`: it matches expanding the KV heads exactly and
copies nothing per head, which makes fp32 decode much faster on CPU.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from mili_openai.model.batch import ForwardBatch, PageTables, PrefillSegment


class AttentionKernel(Protocol):
    """Compiled decode and prefill attention reading K/V in place (see mili_openai.kernels.CpuKernels)."""

    def supports_decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor) -> bool: ...

    def decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                         ctx_lens: torch.Tensor, scale: float) -> torch.Tensor: ...

    def supports_prefill_attention(self, q: torch.Tensor, k_pool: torch.Tensor) -> bool: ...

    def prefill_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          context_slots: torch.Tensor, scale: float) -> torch.Tensor: ...


@runtime_checkable
class PagedAttentionKernel(AttentionKernel, Protocol):
    """An `AttentionKernel` that also reads contexts through page tables, every decode row of a step in
    one call and every prefill chunk in another (mili_openai.kernels.triton_attention). The runner
    builds page tables instead of slot tables for a model that has one."""

    def supports_paged_attention(self, q: torch.Tensor, k_pool: torch.Tensor) -> bool: ...

    def paged_decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               page_table: torch.Tensor, page_size: int, ctx_lens: torch.Tensor, scale: float,
                               out: torch.Tensor | None = None) -> torch.Tensor: ...

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


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: ForwardBatch,
                     scale: float, kernel: AttentionKernel | None = None) -> torch.Tensor:
    """One query per sequence against its context. q (B, H, D) -> (B, H, D).

    With a compiled kernel the context is read in place from the pool; otherwise it is gathered into a
    padded (B, C) copy and masked.
    """
    slots, ctx_lens = batch.decode_slots, batch.decode_ctx_lens
    if kernel is not None and kernel.supports_decode_attention(q, k_pool):
        return kernel.decode_attention(q, k_pool, v_pool, slots, ctx_lens, scale)
    mask = (torch.arange(slots.shape[1], device=slots.device)[None, :] < ctx_lens[:, None])[:, None, None, :]
    compute = decode_compute_dtype(q.dtype, q.device)
    keys = gather_slots(k_pool, slots).to(compute).transpose(1, 2)  # (B, kv_heads, C, D)
    values = gather_slots(v_pool, slots).to(compute).transpose(1, 2)  # (B, kv_heads, C, D)
    out = F.scaled_dot_product_attention(
        q.to(compute).unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )  # (B, H, 1, D)
    return out.squeeze(2).to(q.dtype)


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                      v_pool: torch.Tensor, segment: PrefillSegment, scale: float,
                      kernel: AttentionKernel | None = None) -> torch.Tensor:
    """One chunk of one sequence, causally over its cached prefix plus itself.

    q (L, H, D); k_new, v_new (L, kv_heads, D) the chunk's own K/V (already written to the pool)
    -> (L, H, D). Query i sits at context position ctx - L + i and sees context [0, ctx - L + i].
    """
    if kernel is not None and kernel.supports_prefill_attention(q, k_pool):
        return kernel.prefill_attention(q, k_pool, v_pool, segment.context_slots, scale)
    length, ctx = segment.length, int(segment.context_slots.shape[0])
    if ctx == length:
        # no cached prefix: the chunk's own K/V are the whole context, no gather, plain causal mask
        keys, values, mask, causal = k_new, v_new, None, True
    else:
        keys = gather_slots(k_pool, segment.context_slots)  # (ctx, kv_heads, D)
        values = gather_slots(v_pool, segment.context_slots)
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
    if batch.pages is not None:
        return attention_through_page_tables(q, k_pool, v_pool, batch, batch.pages, scale, kernel)
    num_decode = batch.num_decode
    if num_decode and not batch.prefills:  # the steady state: skip the output buffer
        return decode_attention(q, k_pool, v_pool, batch, scale, kernel)
    if len(batch.prefills) == 1 and not num_decode:
        segment = batch.prefills[0]
        return prefill_attention(q, k, v, k_pool, v_pool, segment, scale, kernel)
    out = torch.empty_like(q)  # (T, H, D)
    if num_decode:
        out[:num_decode] = decode_attention(q[:num_decode], k_pool, v_pool, batch, scale, kernel)
    for segment in batch.prefills:
        rows = slice(segment.start, segment.start + segment.length)
        out[rows] = prefill_attention(q[rows], k[rows], v[rows], k_pool, v_pool, segment, scale, kernel)
    return out


def attention_through_page_tables(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: ForwardBatch,
                                  pages: PageTables, scale: float, kernel: AttentionKernel | None) -> torch.Tensor:
    """The decode rows in one kernel call, every prefill chunk in one more, both writing one output: no
    per-chunk loop, no gathered copy."""
    supports = getattr(kernel, "supports_paged_attention", None)  # cheaper than isinstance on a Protocol
    if supports is None or not supports(q, k_pool):
        raise RuntimeError("the batch carries page tables, but the model has no attention kernel that reads "
                           f"them for {q.dtype} queries on {q.device}")
    num_decode = batch.num_decode
    if not batch.prefills:
        return kernel.paged_decode_attention(q, k_pool, v_pool, pages.decode, pages.page_size,
                                             batch.decode_ctx_lens, scale)
    out = torch.empty_like(q)  # (T, H, D)
    if num_decode:
        kernel.paged_decode_attention(q[:num_decode], k_pool, v_pool, pages.decode, pages.page_size,
                                      batch.decode_ctx_lens, scale, out=out[:num_decode])
    kernel.paged_prefill_attention(q[num_decode:], k_pool, v_pool, pages.prefill, pages.page_size,
                                   pages.prefill_cu_seqlens, pages.prefill_ctx_lens, pages.max_prefill_len, scale,
                                   out=out[num_decode:])
    return out
