"""Micro-benchmark of the gated delta rule and its causal conv on CPU: the compiled kernels (AVX-512's set, else
AVX2's) against the torch reference (kernels/gated_delta_rule.py), and decode against its bytes floor.

At Qwen3.5-0.8B's linear-attention shape (16 key heads, 16 value heads, Dk = Dv = 128, conv over 6144 channels,
kernel 4), for one layer: a decode step at batch 1 and 8, and a 512-token prefill (one sequence, and 8 of 64).
Decode's floor is its fp32 state read and written once (B x Hv x Dk x Dv x 4 bytes each way) at the bandwidth a
large copy reaches here; each step uses other pool slots (a pool far larger than the caches), as a model with 24
such layers would. The machine may be shared and noisy: each line gives the median and the spread (min to max)
of the repetitions.

    .venv/bin/python scripts/bench_gated_delta_rule.py
    .venv/bin/python scripts/bench_gated_delta_rule.py --threads 1 --repeats 21
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from mili_openai.kernels import load_cpu_kernels
from mili_openai.kernels.cpu_avx2 import compiled_avx2_kernels
from mili_openai.kernels.linear_attention import TorchLinearAttention

K_HEADS, V_HEADS, HEAD_DIM = 16, 16, 128  # Qwen3.5-0.8B's linear attention
CONV_CHANNELS, CONV_WIDTH = 2 * K_HEADS * HEAD_DIM + V_HEADS * HEAD_DIM, 4
POOL_SLOTS = 128  # 1 MiB of state each: far past the last-level cache
PREFILL_TOKENS = 512
COPY_BYTES = 256 << 20  # the bandwidth probe's buffer
STATE_BYTES_PER_ROW = V_HEADS * HEAD_DIM * HEAD_DIM * 4


def timings(run: Callable[[int], object], repeats: int) -> list[float]:
    """Seconds of `run(i)` for i in range(repeats), after one warm-up call."""
    run(repeats)
    seconds = []
    for i in range(repeats):
        start = time.perf_counter()
        run(i)
        seconds.append(time.perf_counter() - start)
    return seconds


def summary(seconds: list[float]) -> str:
    return (f"median {statistics.median(seconds) * 1e3:8.3f} ms  (min {min(seconds) * 1e3:.3f}, "
            f"max {max(seconds) * 1e3:.3f})")


def copy_bandwidth(repeats: int) -> float:
    """Bytes per second read plus written by a large tensor copy."""
    source = torch.ones(COPY_BYTES // 4)
    target = torch.empty_like(source)
    return 2 * COPY_BYTES / statistics.median(timings(lambda _: target.copy_(source), repeats))


def decode_case(batch: int, dtype: torch.dtype) -> dict:
    def randn(*shape):
        return torch.randn(*shape).to(dtype)

    return dict(q=randn(batch, K_HEADS, HEAD_DIM), k=randn(batch, K_HEADS, HEAD_DIM), v=randn(batch, V_HEADS, HEAD_DIM),
                g=-torch.rand(batch, V_HEADS), beta=torch.rand(batch, V_HEADS).to(dtype))


def bench_decode(kernels: dict, batch: int, dtype: torch.dtype, repeats: int, bandwidth: float) -> None:
    pool = torch.zeros(POOL_SLOTS, V_HEADS, HEAD_DIM, HEAD_DIM)
    conv_pool = torch.zeros(POOL_SLOTS, CONV_CHANNELS, CONV_WIDTH - 1, dtype=dtype)
    weight = torch.randn(CONV_CHANNELS, CONV_WIDTH).to(dtype)
    inputs, x = decode_case(batch, dtype), torch.randn(batch, CONV_CHANNELS).to(dtype)
    groups = POOL_SLOTS // batch

    def slots(i: int) -> torch.Tensor:  # another set of slots each step: the state comes from memory
        return torch.arange(batch) + (i % groups) * batch

    floor = 2 * batch * STATE_BYTES_PER_ROW / bandwidth
    print(f"decode batch {batch}: state bytes floor {floor * 1e3:.3f} ms "
          f"({2 * batch * STATE_BYTES_PER_ROW / 2**20:.0f} MiB at {bandwidth / 1e9:.1f} GB/s)")
    for name, kernel in kernels.items():
        seconds = timings(lambda i: kernel.gated_delta_rule_decode(**inputs, state_pool=pool, state_slots=slots(i)),
                          repeats)
        print(f"  delta rule {name:>6}: {summary(seconds)}  = {statistics.median(seconds) / floor:.1f}x floor")
    for name, kernel in kernels.items():
        seconds = timings(lambda i: kernel.causal_conv1d_decode(x, conv_pool, weight, None, slots(i)), repeats)
        print(f"  conv       {name:>6}: {summary(seconds)}")


def bench_prefill(kernels: dict, segments: int, dtype: torch.dtype, repeats: int) -> None:
    inputs = decode_case(PREFILL_TOKENS, dtype)
    x = torch.randn(PREFILL_TOKENS, CONV_CHANNELS).to(dtype)
    weight = torch.randn(CONV_CHANNELS, CONV_WIDTH).to(dtype)
    cu_seqlens = torch.arange(segments + 1) * (PREFILL_TOKENS // segments)
    pool = torch.zeros(POOL_SLOTS, V_HEADS, HEAD_DIM, HEAD_DIM)
    conv_pool = torch.zeros(POOL_SLOTS, CONV_CHANNELS, CONV_WIDTH - 1, dtype=dtype)
    slots = torch.arange(segments)
    print(f"prefill {PREFILL_TOKENS} tokens in {segments} segment(s):")
    for name, kernel in kernels.items():
        seconds = timings(lambda _: kernel.gated_delta_rule_prefill(**inputs, cu_seqlens=cu_seqlens, state_pool=pool,
                                                                    state_slots=slots), repeats)
        print(f"  delta rule {name:>6}: {summary(seconds)}")
    for name, kernel in kernels.items():
        seconds = timings(lambda _: kernel.causal_conv1d_prefill(x, cu_seqlens, conv_pool, weight, None, slots),
                          repeats)
        print(f"  conv       {name:>6}: {summary(seconds)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="q, k, v and the conv's dtype (the state is float32 either way)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compiled = load_cpu_kernels() or compiled_avx2_kernels()
    if compiled is None:
        raise SystemExit("the CPU kernels are not available here (no AVX512 nor AVX2, or the build failed)")
    kernels = {"kernel": compiled.linear_attention, "torch": TorchLinearAttention()}
    dtype = getattr(torch, args.dtype)
    print(f"{args.threads} thread(s), {args.dtype} inputs, {args.repeats} repeats, {type(compiled).__name__}")
    bandwidth = copy_bandwidth(args.repeats)
    for batch in (1, 8):
        bench_decode(kernels, batch, dtype, args.repeats, bandwidth)
    for segments in (1, 8):
        bench_prefill(kernels, segments, dtype, args.repeats)


if __name__ == "__main__":
    main()
