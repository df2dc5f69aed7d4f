"""Paged attention for CUDA in Triton: the launchers of triton_attention_kernels.py and their shape rules.

`TritonAttention` reads K/V in place from the paged pool through page tables:
- decode: every decode row in one split-K launch (plus a reduce launch when the context is split), the
  split count fixed by the number of rows alone, so a CUDA graph captured for a batch size serves any
  context length;
- prefill: every prefill chunk of a step in one varlen launch (`cu_seqlens`), causal over each chunk's
  cached prefix pages plus its new tokens: a radix-cache hit costs no recompute and no gather.

It also takes the slot-addressed calls of the CPU kernels' interface (a slot table is a page table with
page size 1), so it can stand in wherever those run. Outside CUDA it runs only under Triton's CPU
interpreter (TRITON_INTERPRET=1 for the whole process, set before Triton is imported), which is how the
tests check it on any machine.
"""

from __future__ import annotations

import torch

from mili_openai.kernels.triton_attention_kernels import decode_partial_kernel, decode_reduce_kernel, extend_kernel

LOG2_E = 1.4426950408889634  # softmax runs in base 2 inside the kernels
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MIN_DOT_ROWS = 16  # tl.dot's smallest M on the GPU: decode pads a head group up to it
DECODE_BLOCK_N = 64  # context positions per step of the decode loop, and the split granularity
EXTEND_BLOCK_N = 64  # key positions per step of the extend loop
# score rows (tokens x heads of a group) per extend program for rows of up to 256 bytes (bf16 head_dim 128);
# halved for each doubling past that, so the q, K and V tiles stay within a multiprocessor's shared memory
EXTEND_ROWS, EXTEND_ROW_BYTES = 128, 256
# Decode splits the context until the launch has about this many programs (rows x KV heads x splits),
# enough to keep every multiprocessor of a large GPU busy at batch 1; at most MAX_DECODE_SPLITS.
TARGET_DECODE_PROGRAMS = 512
MAX_DECODE_SPLITS = 16
DECODE_WARPS, EXTEND_WARPS, PIPELINE_STAGES = 4, 8, 2


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def decode_splits(rows: int, kv_heads: int) -> int:
    """Splits of each decode row's context: a power of two that depends on the batch shape only (a graph
    fixes it), many for a few rows (long contexts then use the whole GPU), one for a large batch."""
    wanted = max(1, TARGET_DECODE_PROGRAMS // max(1, rows * kv_heads))
    return min(MAX_DECODE_SPLITS, 1 << (wanted.bit_length() - 1))


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs multiply in full precision (the fp32 path must match transformers token for token);
    half-precision inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


class TritonAttention:
    """The Triton attention backend (implements model.paged_attention.PagedAttentionKernel)."""

    def __init__(self) -> None:
        # The interpreter runs on CPU tensors, the compiled kernels on CUDA ones.
        interpreted = type(extend_kernel).__name__ == "InterpretedFunction"
        self.device_type = "cpu" if interpreted else "cuda"

    def _widen(self, q: torch.Tensor) -> bool:
        """Multiply half-precision tiles as float32: only under the interpreter (see the kernels' docstring)."""
        return self.device_type == "cpu" and q.dtype != torch.float32

    # ---- which calls it takes ----
    def supports_paged_attention(self, q: torch.Tensor, k_pool: torch.Tensor) -> bool:
        """q (T, H, D), k_pool (slots, KV, D) of one layer: on this backend's device, a dtype it computes
        in, rows of contiguous head_dim, whole query groups per KV head."""
        return (
            q.device.type == self.device_type
            and k_pool.device == q.device
            and q.dtype in DTYPES
            and k_pool.dtype == q.dtype
            and q.shape[-1] <= MAX_HEAD_DIM
            and q.stride(-1) == 1
            and k_pool.stride(-1) == 1
            and q.shape[1] % k_pool.shape[1] == 0
        )

    supports_decode_attention = supports_paged_attention
    supports_prefill_attention = supports_paged_attention

    # ---- the CPU kernels' slot-addressed interface (model.paged_attention.AttentionKernel) ----
    def decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                         ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q (B, H, D) against the pool rows at slots[b, :ctx_lens[b]] -> (B, H, D)."""
        return self.paged_decode_attention(q, k_pool, v_pool, slots, 1, ctx_lens, scale)

    def prefill_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          context_slots: torch.Tensor, scale: float) -> torch.Tensor:
        """q (L, H, D), the last L of the context's slots -> causal attention over the context, (L, H, D)."""
        length = q.shape[0]
        cu_seqlens = torch.tensor([0, length], dtype=torch.int64, device=q.device)
        ctx_lens = torch.tensor([context_slots.shape[0]], dtype=torch.int64, device=q.device)
        return self.paged_prefill_attention(q, k_pool, v_pool, context_slots.unsqueeze(0), 1, cu_seqlens, ctx_lens,
                                            length, scale)

    # ---- page-table addressed, every row of a kind in one launch ----
    def paged_decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               page_table: torch.Tensor, page_size: int, ctx_lens: torch.Tensor, scale: float,
                               out: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
        """One query row each against its context: q (B, H, D); page_table (B, W) pages of row b's context,
        whose first ctx_lens[b] (>= 1) positions it attends -> (B, H, D), into `out` where given.
        num_splits: a power of two; None = `decode_splits` of the batch's shape."""
        rows, num_heads, head_dim = q.shape
        kv_heads = k_pool.shape[1]
        group = num_heads // kv_heads
        out = torch.empty_like(q) if out is None else out
        if rows == 0:
            return out
        splits = num_splits or decode_splits(rows, kv_heads)
        block_d = next_power_of_two(head_dim)
        if splits > 1:
            part_acc = torch.empty(rows, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(rows, num_heads, splits, dtype=torch.float32, device=q.device)
        else:  # the partial kernel writes `out` itself; these are never read
            part_acc = part_lse = out
        decode_partial_kernel[(rows, kv_heads, splits)](
            q, k_pool, v_pool, page_table, ctx_lens, out, part_acc, part_lse,
            scale * LOG2_E, page_size, num_heads,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            page_table.stride(0), out.stride(0), out.stride(1),
            GROUP=group, BLOCK_H=max(MIN_DOT_ROWS, next_power_of_two(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=splits, PRECISION=_dot_precision(q.dtype), WIDEN=self._widen(q),
            num_warps=DECODE_WARPS, num_stages=PIPELINE_STAGES,
        )
        if splits > 1:
            decode_reduce_kernel[(rows, num_heads)](
                part_acc, part_lse, ctx_lens, out, num_heads, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=splits,
                num_warps=DECODE_WARPS,
            )
        return out

    def paged_prefill_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                page_table: torch.Tensor, page_size: int, cu_seqlens: torch.Tensor,
                                ctx_lens: torch.Tensor, max_length: int, scale: float,
                                out: torch.Tensor | None = None) -> torch.Tensor:
        """Every prefill segment at once: q (T, H, D) holds segment s's new tokens at rows
        [cu_seqlens[s], cu_seqlens[s + 1]), the last of its ctx_lens[s] context positions (their K/V already
        in the pool); page_table (S, W); max_length the longest segment -> causal attention (T, H, D)."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = k_pool.shape[1]
        group = num_heads // kv_heads
        out = torch.empty_like(q) if out is None else out
        segments = ctx_lens.shape[0]
        if segments == 0 or max_length == 0:
            return out
        block_d = next_power_of_two(head_dim)
        group_pad = next_power_of_two(group)
        rows = max(MIN_DOT_ROWS, EXTEND_ROWS * EXTEND_ROW_BYTES // max(EXTEND_ROW_BYTES, block_d * q.element_size()))
        block_t = max(1, rows // group_pad)
        grid = (segments, kv_heads, -(-max_length // block_t))
        extend_kernel[grid](
            q, k_pool, v_pool, out, page_table, cu_seqlens, ctx_lens,
            scale * LOG2_E, page_size,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            page_table.stride(0), out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=group_pad, BLOCK_T=block_t, BLOCK_M=block_t * group_pad, HEAD_DIM=head_dim,
            BLOCK_D=block_d, BLOCK_N=EXTEND_BLOCK_N, PRECISION=_dot_precision(q.dtype), WIDEN=self._widen(q),
            num_warps=EXTEND_WARPS, num_stages=PIPELINE_STAGES,
        )
        return out
