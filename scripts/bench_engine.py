"""Engine benchmark: mili's engine vs HF transformers `generate()` on one random Qwen3 checkpoint.

Measures prefill tokens/s for one 512-token prompt and decode tokens/s at batch 1, 8 and 32, each
side by side with HF on the same weights, plus this machine's limits: decode is bound by reading the
weights once per step (weight bytes / measured read bandwidth), prefill by the best matmul throughput
for bf16 weights (oneDNN's bf16 GEMM, or fp32 on widened operands where the CPU lacks bf16 dot products).

    .venv/bin/python scripts/bench_engine.py                       # Qwen3-0.6B shapes, bf16, CPU
    .venv/bin/python scripts/bench_engine.py --batches 1 8 --json bench-results/engine.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mili_openai import LLM, SamplingParams
from mili_openai.engine.contract import check_request
from mili_openai.kernels import load_cpu_kernels
from mili_openai.kernels.planning import fastest_seconds
from mili_openai.model.checkpoint import QWEN3_0_6B_SHAPE, build_random_checkpoint
from mili_openai.model.huge_pages import huge_page_zeros

BANDWIDTH_BYTES = 1 << 30  # per read-bandwidth probe pass; far larger than the caches
BANDWIDTH_PROBE_ROW = 1024  # the matmul probe's K: Qwen3-0.6B's hidden size, the LM head's shape
MATMUL_SHAPE = (512, 1024, 3072)  # a prefill-shaped bf16 GEMM (tokens, hidden, intermediate)
CUDA_PEAK_MATMUL_SHAPE = (8192, 8192, 8192)


class ReadProbes:
    """Streaming reads over buffers far larger than the last-level cache.

    On CPU, on huge pages (where the engine keeps its weights): torch's fp32 and bf16 `sum`, and the
    engine's own one-row matmul kernel over a bf16 matrix where it loads. The kernel, which prefetches,
    measured the fastest of the three on the 2-core Xeon VM (27-29 GB/s against `sum`'s 19-24), so a limit
    taken from `sum` alone would flatter a decode step that reads at the kernel's speed.
    On CUDA, the two `sum`s over GPU memory, each pass timed to the end of its kernels: a decode step there
    reads its weights through torch's kernels. The buffers are allocated once, so a caller can probe often."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self._device = device
        self._kernels = None
        if device.type == "cpu":
            # written before they are read: untouched anonymous memory reads as the kernel's shared zero page
            self._buffers = {dtype: huge_page_zeros((BANDWIDTH_BYTES // dtype.itemsize,), dtype).fill_(1)
                             for dtype in (torch.float32, torch.bfloat16)}
            self._kernels = load_cpu_kernels()
        else:
            self._buffers = {dtype: torch.ones(BANDWIDTH_BYTES // dtype.itemsize, dtype=dtype, device=device)
                             for dtype in (torch.float32, torch.bfloat16)}
        self._row = torch.ones(1, BANDWIDTH_PROBE_ROW, dtype=torch.bfloat16)

    def measure(self, repeats: int = 8) -> dict[str, float]:
        """Bytes/s of each read, the fastest of `repeats` passes."""
        rates = {f"{str(dtype).removeprefix('torch.')} sum":
                 BANDWIDTH_BYTES / fastest_seconds(synchronized(buffer.sum, self._device), repeats)
                 for dtype, buffer in self._buffers.items()}
        if self._kernels is not None:
            matrix = self._buffers[torch.bfloat16].view(-1, BANDWIDTH_PROBE_ROW)
            rates["matmul kernel, one row"] = BANDWIDTH_BYTES / fastest_seconds(
                functools.partial(self._kernels.linear, self._row, matrix), repeats)
        return rates


def synchronized(work: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """`work`, returning only once the device has finished it (CUDA kernels run after their launch returns)."""
    if device.type != "cuda":
        return work
    return lambda: (work(), torch.cuda.synchronize(device))


def measure_read_bandwidth(repeats: int = 8) -> float:
    """The machine's read bandwidth: the fastest of the `ReadProbes`."""
    return max(ReadProbes().measure(repeats).values())


def measure_matmul_flops(repeats: int = 10, device: torch.device = torch.device("cpu")) -> float:
    """The best matmul throughput for bf16 weights on this device. On CPU: oneDNN's bf16 GEMM, or an fp32
    GEMM on widened operands where the CPU has no bf16 dot products (what the engine's prefill then uses).
    On CUDA: cuBLAS's bf16 GEMM, at the prefill's shape and at a large one that reaches the tensor cores'
    peak (the prefill shape alone is too small to fill an H100-class GPU, and the floor is the peak)."""
    shapes, dtypes = [MATMUL_SHAPE], (torch.bfloat16, torch.float32)
    if device.type == "cuda":
        shapes, dtypes = [MATMUL_SHAPE, CUDA_PEAK_MATMUL_SHAPE], (torch.bfloat16,)
    rates = []
    for (m, k, n), dtype in itertools.product(shapes, dtypes):
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(n, k, dtype=dtype, device=device)
        seconds = fastest_seconds(synchronized(functools.partial(torch.matmul, a, b.T), device), repeats)
        rates.append(2 * m * k * n / seconds)
    return max(rates)


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes every decode step must read: all weights, with the embedding read once (as the LM head)."""
    seen, total = set(), 0
    for param in model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    return total


def prefill_flops_per_token(model: torch.nn.Module, prompt_len: int) -> int:
    """Matmul flops of one prompt token: every projection, plus causal attention at the mean context.

    The embedding is a lookup and the LM head runs for the last token only, so neither counts.
    """
    config = model.config
    embedding = model.model.embed_tokens.weight.numel()
    projections = sum(p.numel() for p in model.parameters() if p.dim() == 2) - embedding
    if model.lm_head is not None:
        projections -= model.lm_head.weight.numel()
    attention = 2 * 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * prompt_len // 2
    return 2 * projections + attention


def random_prompt(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 150000) for _ in range(length)]


def bench_mili(path: Path, prompt_len: int, decode_prompt_len: int, decode_tokens: int, batches: list[int],
               threads: int | None) -> dict:
    llm = LLM(str(path), dtype="bfloat16", num_threads=threads, max_num_seqs=max(batches),
              max_num_batched_tokens=max(prompt_len, max(batches) * decode_prompt_len), kv_cache_memory_gb=2.0)
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([random_prompt(prompt_len, rng)], greedy)  # warm-up (kernel build, allocator)
    prefill_s = float("inf")
    for _ in range(2):  # best of two, as for HF
        start = time.perf_counter()
        llm.generate([random_prompt(prompt_len, rng)], greedy)
        prefill_s = min(prefill_s, time.perf_counter() - start)
    result = {"prefill_tokens_per_s": prompt_len / prefill_s, "decode_tokens_per_s": {}}
    for batch in batches:
        prompts = [random_prompt(decode_prompt_len, rng) for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
        result["decode_tokens_per_s"][batch] = _timed_decode(llm, prompts, params)
    result["weight_bytes"] = weight_bytes_per_step(llm.core.runner.forward.model)
    result["flops_per_token"] = prefill_flops_per_token(llm.core.runner.forward.model, prompt_len)
    return result


def _timed_decode(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    """Tokens/s over the pure-decode steps only (prefill steps are timed separately)."""
    core = llm.core
    for i, prompt in enumerate(prompts):
        core.add(check_request(prompt, params, core.info), f"bench-{time.monotonic_ns()}-{i}")
    decode_time, decode_tokens = 0.0, 0
    while core.has_work():
        batch, step = core.schedule()
        start = time.perf_counter()
        output = core.runner.execute(step)
        core.postprocess(batch, output)
        if batch.num_decode == len(batch.seqs):
            decode_time += time.perf_counter() - start
            decode_tokens += batch.num_decode
    return decode_tokens / decode_time


@torch.inference_mode()
def bench_hf(path: Path, prompt_len: int, decode_prompt_len: int, decode_tokens: int, batches: list[int]) -> dict:
    from transformers import AutoModelForCausalLM  # the checkpoint's own class: Qwen3, Qwen3.5, Qwen3-Next ...

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    rng = random.Random(0)

    def generate(ids: torch.Tensor, new_tokens: int, repeats: int = 2) -> float:
        """Best of `repeats` wall times: the least disturbed run on a shared 2-core machine."""
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            times.append(time.perf_counter() - start)
        return min(times)

    generate(torch.tensor([random_prompt(prompt_len, rng)]), 1)  # warm-up
    prefill_s = generate(torch.tensor([random_prompt(prompt_len, rng)]), 1)
    result = {"prefill_tokens_per_s": prompt_len / prefill_s, "decode_tokens_per_s": {}}
    for batch in batches:
        ids = torch.tensor([random_prompt(decode_prompt_len, rng) for _ in range(batch)])
        first = generate(ids, 1)
        total = generate(ids, decode_tokens)
        result["decode_tokens_per_s"][batch] = batch * (decode_tokens - 1) / (total - first)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path.home() / ".cache/mili-openai/bench-qwen3-0.6b")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-prompt-len", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    if not (args.checkpoint / "config.json").exists():
        print(f"building a random Qwen3-0.6B-shaped checkpoint in {args.checkpoint} ...", flush=True)
        build_random_checkpoint(args.checkpoint, QWEN3_0_6B_SHAPE, seed=0, dtype=torch.bfloat16)
    bandwidth, flops = measure_read_bandwidth(), measure_matmul_flops()
    mili = bench_mili(args.checkpoint, args.prompt_len, args.decode_prompt_len, args.decode_tokens, args.batches,
                      args.threads)
    hf = None if args.skip_hf else bench_hf(args.checkpoint, args.prompt_len, args.decode_prompt_len,
                                            args.decode_tokens, args.batches)
    decode_limit = bandwidth / mili["weight_bytes"]
    prefill_limit = flops / mili["flops_per_token"]
    rows = [("prefill tok/s (%d-token prompt)" % args.prompt_len, mili["prefill_tokens_per_s"],
             hf and hf["prefill_tokens_per_s"], prefill_limit)]
    for batch in args.batches:
        rows.append((f"decode tok/s, batch {batch}", mili["decode_tokens_per_s"][batch],
                     hf and hf["decode_tokens_per_s"][batch], decode_limit * batch if batch == 1 else None))
    print(f"\nread bandwidth {bandwidth / 1e9:.1f} GB/s, best bf16-weight matmul {flops / 1e9:.0f} GFLOP/s, "
          f"weights {mili['weight_bytes'] / 1e9:.2f} GB/step, threads {torch.get_num_threads()}")
    print("| metric | mili | HF generate | mili / HF | limit | mili / limit |\n|---|---|---|---|---|---|")
    for name, ours, theirs, limit in rows:
        cells = [f"{ours:.1f}", f"{theirs:.1f}" if theirs else "-", f"{ours / theirs:.2f}x" if theirs else "-",
                 f"{limit:.1f}" if limit else "-", f"{ours / limit:.0%}" if limit else "-"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"mili": mili, "hf": hf, "bandwidth_bytes_per_s": bandwidth,
                                         "bf16_matmul_flops": flops, "args": vars(args)}, default=str, indent=2))


if __name__ == "__main__":
    main()
