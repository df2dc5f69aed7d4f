"""A torch profile of busy engine steps on CUDA: where a step's host and GPU time go.

Offline, through the engine's own step (schedule -> execute -> postprocess), on a random Qwen3-0.6B-shaped
bf16 checkpoint: `--prompts` prompts of `--prompt-len` tokens admitted at once. It profiles the first step
(a prefill of up to max_num_batched_tokens, the prompts' chunks in one varlen attention call per layer),
runs until every prompt decodes, then profiles `--decode-steps` decode steps at full batch (replayed from
CUDA graphs). For each it prints the wall time, the GPU's busy time, and the top operators by GPU time and
by host time; `--trace DIR` also writes Chrome traces.

    python3 scripts/profile_gpu_step.py --checkpoint /tmp/bench-gpu/qwen3-0.6b-random --trace $OUT
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("mili_openai") is None:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from mili_openai import LLM, SamplingParams  # noqa: E402
from mili_openai.engine.contract import check_request  # noqa: E402
from mili_openai.model import QWEN3_0_6B_SHAPE, build_random_checkpoint  # noqa: E402

TOP_OPERATORS = 15
VOCAB_SAMPLE = 150000  # prompt ids drawn below the special tokens


def step(core) -> None:
    scheduled = core.schedule()
    if scheduled is None:
        raise RuntimeError("nothing to schedule")
    batch, prepared = scheduled
    core.postprocess(batch, core.runner.execute(prepared))


def profiled(core, steps: int, label: str, trace_dir: Path | None) -> None:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step(core)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    gpu_us = sum(event.self_device_time_total for event in events)
    print(f"\n### {label}: {steps} step(s), wall {wall * 1e3:.2f} ms, GPU busy {gpu_us / 1e3:.2f} ms "
          f"({100 * gpu_us / 1e3 / (wall * 1e3):.0f}% of the wall time)")
    print(events.table(sort_by="self_device_time_total", row_limit=TOP_OPERATORS))
    print(events.table(sort_by="self_cpu_time_total", row_limit=TOP_OPERATORS))
    if trace_dir is not None:
        prof.export_chrome_trace(str(trace_dir / f"trace-{label.split()[0]}.json"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="default: build a random 0.6B one under --work-dir")
    parser.add_argument("--work-dir", default="bench-results/gpu")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=5)
    parser.add_argument("--trace", default=None, help="write Chrome traces into this directory")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("torch sees no CUDA device")
    checkpoint = Path(args.checkpoint) if args.checkpoint else Path(args.work_dir) / "qwen3-0.6b-random"
    if not (checkpoint / "config.json").exists():
        build_random_checkpoint(checkpoint, QWEN3_0_6B_SHAPE, seed=0, dtype=torch.bfloat16)
    llm = LLM(str(checkpoint), device="cuda", kv_cache_memory_gb=8.0)
    core = llm.core
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 64, ignore_eos=True)
    for _ in range(args.prompts):
        prompt = [rng.randrange(VOCAB_SAMPLE) for _ in range(args.prompt_len)]
        core.add(check_request(prompt, params, core.info))
    trace_dir = Path(args.trace) if args.trace else None
    print(f"{torch.cuda.get_device_name()}: {args.prompts} prompts of {args.prompt_len} tokens, budget "
          f"{core.config.max_num_batched_tokens} tokens a step, attention kernel "
          f"{type(core.runner.forward.model.backend.attention).__name__}")
    profiled(core, 1, "prefill step", trace_dir)
    while core.scheduler.waiting or any(seq.num_computed_tokens < seq.num_prompt_tokens
                                        for seq in core.scheduler.running):
        step(core)
    step(core)  # the first all-decode step, unprofiled
    profiled(core, args.decode_steps, f"decode steps at batch {len(core.scheduler.running)}", trace_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
