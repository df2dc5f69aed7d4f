"""Paged attention for CUDA in Triton: the launchers of triton_attention_kernels.py and their shape rules.

`TritonAttention` reads K/V in place from the paged pool through page tables:
- decode: every decode row in one split-K launch (plus a reduce launch when the context is split), the
  split count fixed by the number of rows and the GPU's multiprocessor count alone, so a CUDA graph
  captured for a batch size serves any context length;
- prefill: every prefill chunk of a step in one varlen launch (`cu_seqlens`), causal over each chunk's
  cached prefix pages plus its new tokens: a radix-cache hit costs no recompute and no gather.

Launch constants live in `DecodeConfig` and `ExtendConfig`; scripts/tune_gpu_kernels.py times the
alternatives on a GPU.

It takes the same calls as the CPU kernels (model.paged_attention.AttentionKernel). Outside CUDA it runs
only under Triton's CPU interpreter (TRITON_INTERPRET=1 for the whole process, set before Triton is
imported), which is how the tests check it on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mili_openai.kernels.triton_attention_kernels import decode_partial_kernel, decode_reduce_kernel, extend_kernel

LOG2_E = 1.4426950408889634  # softmax runs in base 2 inside the kernels
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MIN_DOT_ROWS = 16  # tl.dot's smallest M on the GPU: decode pads a head group up to it
# the multiprocessors split counts are planned for where the device cannot say (Triton's CPU interpreter, which
# runs each program of a launch in Python): a small GPU's, so launches stay short while a few decode rows still
# split their context and meet the reduce (an H100's 132 made each decode launch 16 splits, 2.4x slower there)
DEFAULT_MULTIPROCESSORS = 8


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """The decode kernels' launch constants (scripts/tune_gpu_kernels.py times the alternatives)."""

    block_n: int = 64  # context positions per step of the loop, and the split granularity
    warps: int = 4
    stages: int = 2
    # Each row's context is split until the launch has about this many programs per multiprocessor (a power
    # of two of splits, at most max_splits): at batch 1 a long context then uses the whole GPU, and a large
    # batch runs unsplit. Four is about what a multiprocessor holds at once with these tiles (registers and
    # shared memory, bf16 head_dim 128), so the grid fills the GPU in about one wave.
    programs_per_multiprocessor: int = 4
    max_splits: int = 16


@dataclass(frozen=True, slots=True)
class ExtendConfig:
    """The extend (varlen prefill) kernel's launch constants."""

    block_n: int = 64  # key positions per step of the loop
    # score rows (tokens x heads of a group) per program for rows of up to row_bytes (bf16 head_dim 128);
    # halved for each doubling past that, so the q, K and V tiles stay within a multiprocessor's shared memory
    rows: int = 128
    row_bytes: int = 256
    warps: int = 8
    stages: int = 2
    # launch the last token blocks of each segment (the longest causal loops) first
    longest_first: bool = True


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def decode_splits(rows: int, kv_heads: int, target_programs: int, max_splits: int) -> int:
    """Splits of each decode row's context: a power of two that depends on the batch shape and the GPU only
    (a graph fixes it), many for a few rows (long contexts then use the whole GPU), one for a large batch."""
    wanted = max(1, target_programs // max(1, rows * kv_heads))
    return min(max_splits, 1 << (wanted.bit_length() - 1))


def multiprocessor_count(device_type: str) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return DEFAULT_MULTIPROCESSORS


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs multiply in full precision (the fp32 path must match transformers token for token);
    half-precision inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


class TritonAttention:
    """The Triton attention backend (implements model.paged_attention.AttentionKernel)."""

    def __init__(self, decode: DecodeConfig = DecodeConfig(), extend: ExtendConfig = ExtendConfig(),
                 multiprocessors: int | None = None) -> None:
        """multiprocessors: the GPU's, which the decode split count is planned for (None: the current
        device's)."""
        # The interpreter runs on CPU tensors, the compiled kernels on CUDA ones.
        interpreted = type(extend_kernel).__name__ == "InterpretedFunction"
        self.device_type = "cpu" if interpreted else "cuda"
        self.decode = decode
        self.extend = extend
        self.multiprocessors = multiprocessors or multiprocessor_count(self.device_type)

    def decode_splits(self, rows: int, kv_heads: int) -> int:
        """The split count of a decode launch of `rows` rows (`decode_splits` for this GPU and config)."""
        target = self.multiprocessors * self.decode.programs_per_multiprocessor
        return decode_splits(rows, kv_heads, target, self.decode.max_splits)

    def decode_split_rows(self, kv_heads: int) -> list[int]:
        """The fewest decode rows that get each split count, most splits first: one launch of each compiles
        every decode variant (model/kernel_warmup.py)."""
        first_rows: dict[int, int] = {}
        rows = 1
        while (splits := self.decode_splits(rows, kv_heads)) > 1:
            first_rows.setdefault(splits, rows)
            rows += 1
        return [*first_rows.values(), rows]

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

    # ---- page-table addressed, every row of a kind in one launch ----
    def paged_decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               page_table: torch.Tensor, page_size: int, ctx_lens: torch.Tensor, scale: float,
                               out: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
        """One query row each against its context: q (B, H, D); page_table (B, W) pages of row b's context,
        whose first ctx_lens[b] (>= 1) positions it attends -> (B, H, D), into `out` where given.
        num_splits: a power of two; None = `decode_splits` of the batch's shape."""
        config = self.decode
        rows, num_heads, head_dim = q.shape
        kv_heads = k_pool.shape[1]
        group = num_heads // kv_heads
        out = torch.empty_like(q) if out is None else out
        if rows == 0:
            return out
        splits = num_splits or self.decode_splits(rows, kv_heads)
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
            GROUP=group, BLOCK_H=max(MIN_DOT_ROWS, next_power_of_two(group)), HEAD_DIM=head_dim,
            BLOCK_D=block_d, BLOCK_N=config.block_n, NUM_SPLITS=splits, PRECISION=_dot_precision(q.dtype),
            WIDEN=self._widen(q), num_warps=config.warps, num_stages=config.stages,
        )
        if splits > 1:
            decode_reduce_kernel[(rows, num_heads)](
                part_acc, part_lse, ctx_lens, out, num_heads, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=config.block_n, NUM_SPLITS=splits,
                num_warps=config.warps,
            )
        return out

    def paged_prefill_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                page_table: torch.Tensor, page_size: int, cu_seqlens: torch.Tensor,
                                ctx_lens: torch.Tensor, max_length: int, scale: float,
                                out: torch.Tensor | None = None) -> torch.Tensor:
        """Every prefill segment at once: q (T, H, D) holds segment s's new tokens at rows
        [cu_seqlens[s], cu_seqlens[s + 1]), the last of its ctx_lens[s] context positions (their K/V already
        in the pool); page_table (S, W); max_length the longest segment -> causal attention (T, H, D)."""
        config = self.extend
        num_heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = k_pool.shape[1]
        group = num_heads // kv_heads
        out = torch.empty_like(q) if out is None else out
        segments = ctx_lens.shape[0]
        if segments == 0 or max_length == 0:
            return out
        block_d = next_power_of_two(head_dim)
        group_pad = next_power_of_two(group)
        rows = max(MIN_DOT_ROWS, config.rows * config.row_bytes // max(config.row_bytes, block_d * q.element_size()))
        block_t = max(1, rows // group_pad)
        grid = (segments, kv_heads, -(-max_length // block_t))
        extend_kernel[grid](
            q, k_pool, v_pool, out, page_table, cu_seqlens, ctx_lens,
            scale * LOG2_E, page_size,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            page_table.stride(0), out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=group_pad, BLOCK_T=block_t, BLOCK_M=block_t * group_pad,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=config.block_n, PRECISION=_dot_precision(q.dtype),
            WIDEN=self._widen(q), LONGEST_FIRST=config.longest_first, num_warps=config.warps,
            num_stages=config.stages,
        )
        return out
