"""Which of the compiled kernels and torch's own ops run what, timed on this CPU at load.

The kernels are fastest on CPUs with AVX512 and no matrix units. Where the CPU has AMX, oneDNN's bf16 GEMM
overtakes them at prefill shapes, and torch's flash attention the AVX-512 prefill attention (the AMX one
beats it: prefill_amx.cpp), so the split is timed rather than assumed (well under a second at load, each
choice from interleaved rounds: median_time_ratio). Timings run on an injectable clock (`Clock`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mili_openai.kernels.attention_reference import context_slots

Clock = Callable[[], float]  # seconds on a monotonic clock; tests pass a fake one
MatmulFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, weight) -> x @ weight.T
# prefill attention as `AttentionKernel.paged_prefill_attention` takes it: (q (T, H, D), k_pool, v_pool
# (slots, KV, D), page_table (S, W), page_size, cu_seqlens (S + 1,), ctx_lens (S,), max_length, scale) -> (T, H, D)
PrefillAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor,
                               torch.Tensor, int, float], torch.Tensor]
# decode attention: (q (B, H, D), k_pool, v_pool (slots, KV, D), page_table (B, W), page_size, ctx_lens (B,),
# scale, prefetch distance) -> (B, H, D)
DecodeAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor, float, int],
                             torch.Tensor]
CALIBRATION_PAGE_SIZE = 16  # the CPU's default page size

# Rows of x the matmul kernel takes: decode batches, where its single pass over the weights wins, and the
# decode stack (every layer in one call) runs batches of up to that many rows; the largest choice at
# which the kernel still beats the GEMM (timed at the choice's rows, 32 for 64). 8 is the floor: even
# where oneDNN's GEMM beats the kernel at 8 rows (AMX), decode steps layer by layer with it are slower
# than the stack.
KERNEL_ROWS_CHOICES = (8, 16, 64)
CALIBRATION_K, CALIBRATION_N = 1024, 3072  # an MLP-sized weight
CALIBRATION_LARGE_ROWS = 256  # a prefill chunk
# a prefill chunk after a cached prefix, in Qwen3-0.6B's attention shape (heads, KV heads, head dim)
CALIBRATION_CHUNK, CALIBRATION_CONTEXT, CALIBRATION_HEADS = 128, 384, (16, 8, 128)
# Decode attention's prefetch distance, in blocks of 16 slots (csrc/decode_blocks.h): the best one differs
# between CPUs (three on a Zen 4, one on a Xeon with AMX); the first choice wins a tie. Timed on batch-8
# steps over distinct 256-token contexts in several layers' pools (64 MB), read cold: a larger read
# evicts them before each run.
DECODE_PREFETCH_CHOICES = (3, 1)
CALIBRATION_DECODE_BATCH, CALIBRATION_DECODE_CONTEXT, CALIBRATION_DECODE_LAYERS = 8, 256, 8
CALIBRATION_EVICT_BYTES = 256 << 20
PLAN_ROUNDS = 9  # rounds of each comparison (median_time_ratio)


def linear_via_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16 x @ weight.T as an fp32 GEMM: where the CPU lacks bf16 dot products, oneDNN's bf16 GEMM runs
    well below its fp32 GEMM, and widening the operands first costs a few percent of a prefill chunk's
    matmul."""
    return F.linear(x.float(), weight.float()).to(x.dtype)


def linear_by_rows(x: torch.Tensor, weight: torch.Tensor, kernel: MatmulFn, plan: KernelPlan,
                   lanes: int) -> torch.Tensor:
    """x @ weight.T: bf16 x of up to `plan.max_kernel_rows` rows through `kernel` (which takes 2-D x, K a multiple
    of `lanes`, a contiguous weight), more through `plan.large_matmul`, anything else through F.linear."""
    if not (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.shape[-1] % lanes == 0 and weight.is_contiguous()):
        return F.linear(x, weight)
    rows = x.numel() // x.shape[-1]
    if rows > plan.max_kernel_rows:
        return plan.large_matmul(x, weight)
    return kernel(x.reshape(rows, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])


def run_seconds(work: Callable[[], object], before: Callable[[], object] | None = None,
                clock: Clock = time.perf_counter) -> float:
    """Seconds of one run of `work`; `before`, untimed, runs ahead of it (say, to evict the caches)."""
    if before is not None:
        before()
    start = clock()
    work()
    return clock() - start


def fastest_seconds(work: Callable[[], object], repeats: int = 3, before: Callable[[], object] | None = None,
                    clock: Clock = time.perf_counter) -> float:
    """The fastest of `repeats` timed runs after a warm-up (first-call allocation, oneDNN primitive
    creation): on a shared machine the slower runs measure the neighbours. `before`, untimed, runs ahead
    of each (say, to evict the caches). The machine-limit probes use it (scripts/bench_engine.py)."""
    work()
    return min(run_seconds(work, before, clock) for _ in range(repeats))


def median_time_ratio(first: Callable[[], object], second: Callable[[], object], rounds: int = PLAN_ROUNDS,
                      before: Callable[[], object] | None = None, clock: Clock = time.perf_counter) -> float:
    """The median, over `rounds` rounds, of `first`'s time over `second`'s, the two run back to back in each
    round (in turns which goes first), after a warm-up of each; `before`, untimed, runs ahead of each timed
    run. On a VM whose memory moves between speeds from second to second, the fastest of a few runs of
    each can catch one candidate in a fast moment and the other not, and pick the slower one. Two runs
    moments apart see the same machine, and the median drops the rounds split by a change.
    """
    first()
    second()
    ratios = []
    for round_index in range(rounds):
        if round_index % 2 == 0:
            first_seconds = run_seconds(first, before, clock)
            second_seconds = run_seconds(second, before, clock)
        else:
            second_seconds = run_seconds(second, before, clock)
            first_seconds = run_seconds(first, before, clock)
        ratios.append(first_seconds / second_seconds)
    return statistics.median(ratios)


@dataclass(frozen=True)
class KernelPlan:
    """What runs where on this CPU; the defaults (before timing) use the kernels least."""

    max_kernel_rows: int = KERNEL_ROWS_CHOICES[0]  # rows of x up to which `linear` runs the kernel
    large_matmul: MatmulFn = F.linear  # the GEMM for more rows
    # dtypes whose prefill attention the kernel runs (elsewhere torch's SDPA over gathered K/V)
    prefill_attention_dtypes: frozenset[torch.dtype] = field(default_factory=frozenset)
    decode_prefetch_blocks: int = DECODE_PREFETCH_CHOICES[0]  # decode attention's prefetch distance


def plan_matmuls(kernel: MatmulFn, clock: Clock = time.perf_counter,
                 gemms: tuple[MatmulFn, MatmulFn] = (linear_via_fp32, F.linear)) -> tuple[int, MatmulFn]:
    """(rows up to which `kernel` is used, the matmul for more rows: the faster of `gemms`)."""
    generator = torch.Generator().manual_seed(0)  # leave the global RNG as the caller seeded it

    def operand(rows: int) -> torch.Tensor:
        return torch.randn(rows, CALIBRATION_K, generator=generator).to(torch.bfloat16)

    weight, prefill = operand(CALIBRATION_N), operand(CALIBRATION_LARGE_ROWS)

    def faster(matmul: MatmulFn, other: MatmulFn, x: torch.Tensor) -> bool:
        return median_time_ratio(lambda: matmul(x, weight), lambda: other(x, weight), clock=clock) < 1.0

    large_matmul = gemms[0] if faster(*gemms, prefill) else gemms[1]
    max_rows = KERNEL_ROWS_CHOICES[0]
    for rows in KERNEL_ROWS_CHOICES[1:]:
        batch = operand(min(rows, 32))  # batches up to 64 are mostly far below it
        if not faster(kernel, large_matmul, batch):
            break
        max_rows = rows
    return max_rows, large_matmul


def sdpa_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                           page_size: int, cu_seqlens: torch.Tensor, ctx_lens: torch.Tensor, max_length: int,
                           scale: float) -> torch.Tensor:
    """The torch path's cost on one chunk (model.paged_attention's prefill without a kernel): K/V gathered
    through the page table, then SDPA under a bottom-right causal mask. Timing only; its output is not used."""
    length, context = q.shape[0], int(ctx_lens[0])
    slots = context_slots(page_table[0], page_size, context)
    keys, values = k_pool[slots], v_pool[slots]
    mask = torch.arange(context)[None, :] <= torch.arange(context - length, context)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                                          values.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
                                          enable_gqa=True)


def plan_prefill_attention(kernel: PrefillAttentionFn, dtypes: tuple[torch.dtype, ...],
                           clock: Clock = time.perf_counter,
                           reference: PrefillAttentionFn = sdpa_prefill_attention) -> frozenset[torch.dtype]:
    """The dtypes in which `kernel` beats `reference` (torch's SDPA) on a prefill chunk after a cached prefix."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = CALIBRATION_HEADS
    faster = set()
    for dtype in dtypes:
        q = torch.randn(CALIBRATION_CHUNK, heads, head_dim, generator=generator).to(dtype)
        k_pool, v_pool = (torch.randn(CALIBRATION_CONTEXT, kv_heads, head_dim, generator=generator).to(dtype)
                          for _ in range(2))
        table = torch.arange(CALIBRATION_CONTEXT // CALIBRATION_PAGE_SIZE)[None, :]
        cu_seqlens = torch.tensor([0, CALIBRATION_CHUNK])
        ctx_lens = torch.tensor([CALIBRATION_CONTEXT])
        runs = [lambda run=run: run(q, k_pool, v_pool, table, CALIBRATION_PAGE_SIZE, cu_seqlens, ctx_lens,
                                    CALIBRATION_CHUNK, head_dim ** -0.5) for run in (kernel, reference)]
        if median_time_ratio(*runs, clock=clock) < 1.0:
            faster.add(dtype)
    return frozenset(faster)


def plan_decode_prefetch(kernel: DecodeAttentionFn, clock: Clock = time.perf_counter,
                         evict_bytes: int = CALIBRATION_EVICT_BYTES) -> int:
    """The prefetch distance at which `kernel` runs batch-8 decode steps fastest from memory (read cold:
    `evict_bytes` are read before each run)."""
    heads, kv_heads, head_dim = CALIBRATION_HEADS
    batch, context = CALIBRATION_DECODE_BATCH, CALIBRATION_DECODE_CONTEXT
    # constant K/V time as random ones do (the work does not depend on the values), without drawing 64 MB
    pools = [(torch.ones(batch * context, kv_heads, head_dim, dtype=torch.bfloat16),
              torch.ones(batch * context, kv_heads, head_dim, dtype=torch.bfloat16))
             for _ in range(CALIBRATION_DECODE_LAYERS)]
    q = torch.ones(batch, heads, head_dim, dtype=torch.bfloat16)
    table = torch.arange(batch * context // CALIBRATION_PAGE_SIZE).view(batch, -1)
    ctx_lens = torch.full((batch,), context)
    evict = torch.ones(evict_bytes // 2, dtype=torch.bfloat16).sum if evict_bytes else None

    def step(blocks: int) -> None:
        for k_pool, v_pool in pools:
            kernel(q, k_pool, v_pool, table, CALIBRATION_PAGE_SIZE, ctx_lens, head_dim ** -0.5, blocks)

    best = DECODE_PREFETCH_CHOICES[0]
    for blocks in DECODE_PREFETCH_CHOICES[1:]:  # the earlier choice keeps a tie
        if median_time_ratio(lambda blocks=blocks: step(blocks), lambda best=best: step(best),
                             before=evict, clock=clock) < 1.0:
            best = blocks
    return best
