"""Time the Triton kernels' launch constants on a CUDA GPU, so that one call picks them.

    python3 scripts/tune_gpu_kernels.py [--only decode,extend,fused] [--rep-ms 20]

In Qwen3-0.6B's shapes, bf16 (16 query heads, 8 KV heads, head_dim 128, hidden 1024, intermediate 3072;
K/V on shuffled pages of 16 slots), with triton.testing.do_bench (the L2 cache cleared before each run):
- decode (split-K partial + reduce) at batch 1, 64 and 256 and contexts 512 and 2048, over DecodeConfig's
  block_n, warps, stages and programs per multiprocessor (which sets the split count);
- extend (varlen prefill) of 8192 new tokens as 16 prompts of 512 and as 4 of 2048, over ExtendConfig's
  block_n, rows, warps, stages and grid order (longest loops first or not);
- the fused ops at 8192 tokens over FusedOpsConfig.
Each line gives the configuration (`*` marks the current default), microseconds, and GB/s of the bytes the
kernel has to move (TFLOP/s too for extend); then the best per shape. Every configuration's output is
checked against the default's. Constants live in kernels/triton_attention.py (DecodeConfig, ExtendConfig)
and kernels/triton_fused_ops.py (FusedOpsConfig); figures belong in docs/performance.md with the GPU named.
Needs a CUDA GPU: it refuses without one. Sized to finish in about a minute on an H100 (mostly compiling).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("mili_openai") is None:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

DEVICE = "cuda"
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B
HIDDEN, INTERMEDIATE = 1024, 3072
PAGE_SIZE = 16
DTYPE = torch.bfloat16
BYTES = 2  # per bf16 element
DECODE_SHAPES = [(batch, context) for batch in (1, 64, 256) for context in (512, 2048)]
EXTEND_SHAPES = [(16, 512), (4, 2048)]  # (prompts, tokens each): 8192 new tokens a step
FUSED_TOKENS = 8192
ATTENTION_TOLERANCE = 2e-2  # bf16 outputs of another summation order
FUSED_TOLERANCE = 1e-2


@dataclass(frozen=True)
class Timing:
    label: str
    config: str
    default: bool
    micros: float | None  # None: the configuration did not run (its error in `note`)
    gbps: float = 0.0
    note: str = ""


def refuse_without_cuda() -> str | None:
    """Why this machine cannot run the timings, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    from mili_openai.kernels.triton_attention import TritonAttention

    if TritonAttention().device_type != "cuda":
        return "Triton runs its CPU interpreter here (TRITON_INTERPRET is set)"
    return None


def bench(run: Callable[[], torch.Tensor], reference: torch.Tensor | None, tolerance: float, rep_ms: int
          ) -> tuple[float, str, torch.Tensor]:
    """(median microseconds, a note: a mismatch against `reference`, the first run's output). The first run
    compiles; its output is copied, as a later run may write the same buffer."""
    import triton

    first = run().clone()
    note = ""
    if reference is not None:
        error = (first.float() - reference.float()).abs().max().item()
        if not error <= tolerance:  # also catches NaN
            note = f"MISMATCH vs default: max abs error {error:.3g}"
    micros = triton.testing.do_bench(run, warmup=max(1, rep_ms // 4), rep=rep_ms, return_mode="median") * 1e3
    return micros, note, first


@dataclass(frozen=True)
class Shape:
    label: str
    bytes_moved: int  # what the kernel has to read and write at least
    tolerance: float  # of an output against the default configuration's
    flops: int = 0  # where the work is also worth counting in operations
    describe: Callable[[object], str] = lambda config: ""  # what the configuration implies here (a split count)


def time_configs(shape: Shape, configs: list, default, make_run: Callable[[object], Callable[[], torch.Tensor]],
                 rep_ms: int) -> list[Timing]:
    """Each configuration at one shape, the default first (its output is the reference)."""
    timings, reference = [], None
    for config in [default, *(c for c in configs if c != default)]:
        changed = [f"{key}={value}" for key, value in asdict(config).items() if value != getattr(default, key)]
        described = " ".join([*(changed or ["default"]), shape.describe(config)])
        try:
            micros, note, first = bench(make_run(config), reference, shape.tolerance, rep_ms)
            if config == default:
                reference = first
        except Exception as exc:  # noqa: BLE001 -- out of shared memory, a compile error: report and go on
            timings.append(Timing(shape.label, described.strip(), config == default, None, note=f"failed: {exc}"[:160]))
            continue
        if shape.flops:
            note = f"{shape.flops / micros / 1e6:.0f} TFLOP/s {note}"
        timings.append(Timing(shape.label, described.strip(), config == default, micros,
                              shape.bytes_moved / micros / 1e3, note.strip()))
    report(timings)  # as each shape finishes: a run cut short still shows what it timed
    return timings


def shuffled_page_table(rows: int, pages_per_row: int, generator: torch.Generator) -> torch.Tensor:
    order = torch.randperm(rows * pages_per_row, generator=generator, device=DEVICE)
    return order.view(rows, pages_per_row)


def decode_timings(rep_ms: int) -> list[Timing]:
    from mili_openai.kernels.triton_attention import DecodeConfig, TritonAttention

    generator = torch.Generator(device=DEVICE).manual_seed(0)
    slots = max(batch * context for batch, context in DECODE_SHAPES)
    k_pool, v_pool = (torch.randn(slots, KV_HEADS, HEAD_DIM, generator=generator, device=DEVICE, dtype=DTYPE)
                      for _ in range(2))
    configs = [DecodeConfig(block_n=block_n, warps=warps, stages=2, programs_per_multiprocessor=per_sm)
               for block_n in (32, 64, 128) for warps in (4, 8) for per_sm in (1, 4, 16)]
    configs += [DecodeConfig(stages=stages) for stages in (1, 3)]
    timings = []
    for batch, context in DECODE_SHAPES:
        # q as the model passes it: the query heads of the fused q/k rows
        q = torch.randn(batch, HEADS + KV_HEADS, HEAD_DIM, generator=generator, device=DEVICE, dtype=DTYPE)[:, :HEADS]
        table = shuffled_page_table(batch, context // PAGE_SIZE, generator)
        ctx_lens = torch.full((batch,), context, device=DEVICE)
        out = torch.empty(batch, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)

        def make_run(config, q=q, table=table, ctx_lens=ctx_lens, out=out):
            backend = TritonAttention(decode=config)
            return lambda: backend.paged_decode_attention(q, k_pool, v_pool, table, PAGE_SIZE, ctx_lens,
                                                          HEAD_DIM ** -0.5, out=out)

        bytes_moved = 2 * batch * context * KV_HEADS * HEAD_DIM * BYTES + 2 * batch * HEADS * HEAD_DIM * BYTES

        def splits(config, batch=batch) -> str:
            return f"splits={TritonAttention(decode=config).decode_splits(batch, KV_HEADS)}"

        shape = Shape(f"decode batch {batch} context {context}", bytes_moved, ATTENTION_TOLERANCE, describe=splits)
        timings += time_configs(shape, configs, DecodeConfig(), make_run, rep_ms)
    return timings


def extend_timings(rep_ms: int) -> list[Timing]:
    from mili_openai.kernels.triton_attention import ExtendConfig, TritonAttention

    generator = torch.Generator(device=DEVICE).manual_seed(1)
    configs = [ExtendConfig(block_n=block_n, rows=rows) for block_n in (32, 64, 128) for rows in (64, 128)]
    configs += [ExtendConfig(warps=4), *(ExtendConfig(stages=stages) for stages in (1, 3))]
    # FlashAttention-2's Hopper tiles (key blocks of 128 on 8 warps, or rows of 64 on 4 warps: two programs a
    # multiprocessor), and the grid in launch order. Key blocks of 128 on 4 warps spill registers on sm_90.
    configs += [ExtendConfig(block_n=128, stages=3), ExtendConfig(rows=64, warps=4, stages=3),
                ExtendConfig(longest_first=False)]
    timings = []
    for prompts, length in EXTEND_SHAPES:
        tokens = prompts * length
        pool = (torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=generator, device=DEVICE, dtype=DTYPE)
                for _ in range(2))
        k_pool, v_pool = pool
        q = torch.randn(tokens, HEADS + KV_HEADS, HEAD_DIM, generator=generator, device=DEVICE, dtype=DTYPE)[:, :HEADS]
        table = shuffled_page_table(prompts, length // PAGE_SIZE, generator)
        cu_seqlens = torch.arange(0, tokens + 1, length, device=DEVICE)
        ctx_lens = torch.full((prompts,), length, device=DEVICE)
        out = torch.empty(tokens, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)

        def make_run(config, q=q, k_pool=k_pool, v_pool=v_pool, table=table, cu_seqlens=cu_seqlens,
                     ctx_lens=ctx_lens, out=out, length=length):
            backend = TritonAttention(extend=config)
            return lambda: backend.paged_prefill_attention(q, k_pool, v_pool, table, PAGE_SIZE, cu_seqlens, ctx_lens,
                                                           length, HEAD_DIM ** -0.5, out=out)

        bytes_moved = tokens * (2 * HEADS + 2 * KV_HEADS) * HEAD_DIM * BYTES  # q, out, and K/V once
        flops = 4 * HEADS * HEAD_DIM * prompts * length * (length + 1) // 2  # causal QK^T and PV
        shape = Shape(f"extend {prompts} x {length} tokens", bytes_moved, ATTENTION_TOLERANCE, flops)
        timings += time_configs(shape, configs, ExtendConfig(), make_run, rep_ms)
    return timings


def fused_timings(rep_ms: int) -> list[Timing]:
    from mili_openai.kernels.triton_fused_ops import FusedOpsConfig, TritonFusedOps

    generator = torch.Generator(device=DEVICE).manual_seed(2)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=DEVICE, dtype=DTYPE)

    tokens = FUSED_TOKENS
    x, residual, weight = randn(tokens, HIDDEN), randn(tokens, HIDDEN), randn(HIDDEN)
    qkv = randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, HEADS + KV_HEADS, HEAD_DIM)
    norm_weight, cos, sin = randn(HEAD_DIM), randn(tokens, 1, HEAD_DIM), randn(tokens, 1, HEAD_DIM)
    gate_up = randn(tokens, 2 * INTERMEDIATE)
    default = FusedOpsConfig()
    ops = {
        "rms_norm": ([FusedOpsConfig(norm_warps=warps) for warps in (2, 4, 8)],
                     lambda k: lambda: k.rms_norm(x, weight, 1e-6), 2 * tokens * HIDDEN * BYTES),
        # h lands in x's rows: each configuration works on its own copy, fresh for its first (checked) run
        "add_rms_norm": ([FusedOpsConfig(norm_warps=warps) for warps in (2, 4, 8)],
                         lambda k: lambda scratch=x.clone(): k.add_rms_norm(scratch, residual, weight, 1e-6)[1],
                         4 * tokens * HIDDEN * BYTES),
        "qk_norm_rope": ([FusedOpsConfig(qk_rope_elements=elements, qk_rope_warps=warps)
                          for elements in (1024, 2048, 4096, 8192) for warps in (4, 8)],
                         lambda k: lambda: k.qk_norm_rope(qk, norm_weight, norm_weight, HEADS, 1e-6, cos, sin),
                         2 * tokens * (HEADS + KV_HEADS) * HEAD_DIM * BYTES + 2 * tokens * HEAD_DIM * BYTES),
        "silu_mul": ([*(FusedOpsConfig(silu_block=block) for block in (512, 1024, 2048, 4096)),
                      FusedOpsConfig(silu_warps=8)],
                     lambda k: lambda: k.silu_mul(gate_up), 3 * tokens * INTERMEDIATE * BYTES),
    }
    timings = []
    for name, (configs, make, bytes_moved) in ops.items():
        shape = Shape(f"{name} {tokens} tokens", bytes_moved, FUSED_TOLERANCE)
        timings += time_configs(shape, configs, default, lambda config, make=make: make(TritonFusedOps(config)),
                                rep_ms)
    return timings


def best_line(rows: list[Timing]) -> str:
    """The fastest configuration that ran and matched the default's output, against the default."""
    ran = [t for t in rows if t.micros is not None and "MISMATCH" not in t.note]
    if not ran:
        return f"{rows[0].label}: nothing ran"
    best = min(ran, key=lambda t: t.micros)
    default = next((t for t in rows if t.default and t.micros), None)
    gain = f", {default.micros / best.micros:.2f}x the default's speed" if default else ""
    return f"{rows[0].label}: best {best.micros:.1f} us ({best.gbps:.0f} GB/s{gain}): {best.config}"


def report(rows: list[Timing]) -> None:
    """One shape's timings, `*` marking the default, then its best."""
    print(f"\n## {rows[0].label}")
    for t in rows:
        figure = f"{t.micros:9.1f} us {t.gbps:7.0f} GB/s" if t.micros is not None else " " * 27
        print(f"{'*' if t.default else ' '} {figure}  {t.config}  {t.note}".rstrip())
    print(best_line(rows), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="decode,extend,fused", help="comma-separated: decode, extend, fused")
    parser.add_argument("--rep-ms", type=int, default=20, help="do_bench's timing window per configuration")
    args = parser.parse_args()
    wanted = set(args.only.split(","))
    unknown = wanted - {"decode", "extend", "fused"}
    if unknown:
        parser.error(f"unknown kernel group(s): {', '.join(sorted(unknown))}")
    reason = refuse_without_cuda()
    if reason is not None:
        print(f"tune_gpu_kernels.py times the Triton kernels on a CUDA GPU and cannot run here: {reason}.",
              file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} "
          f"multiprocessors; torch {torch.__version__}, triton {__import__('triton').__version__}")
    timings = []
    for group, run in (("decode", decode_timings), ("extend", extend_timings), ("fused", fused_timings)):
        if group in wanted:
            timings += run(args.rep_ms)
    print("\n## best per shape")
    for label in dict.fromkeys(t.label for t in timings):
        print(best_line([t for t in timings if t.label == label]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
