"""Where the 8-concurrent image workload of scripts/bench_vision.py spends its time, step by step, in one process
(issue 48's throughput: 8 requests at once, a different 448 x 448 image each, 64 greedy tokens, `ignore_eos`).

Per step: its decode rows, prefill tokens and images encoded, its CPU and wall seconds, the tower's CPU seconds,
the matmul GFLOP it ran (every projection, the tower's and the LM head's, from the rows each weight multiplied)
and the weight GB those matmuls read (each weight once a call). Then per phase, the prefill steps (towers and
chunks, compute-bound) against the decode-only tail (memory-bound: every step reads every weight and each
sequence's linear-attention state): GFLOP/s and GB/s over their wall time, to set beside this CPU's limits (the
best bf16 matmul; the memory bandwidth). CPU seconds with `--threads 1` are the parts' shares on a busy machine;
wall seconds need a quiet one.

    python scripts/vision_step_costs.py /work/bench/vision1/qwen3.5-0.8b-vl-random-seed0 --threads 2 --out costs.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vision import CONCURRENT_REQUESTS, IMAGE_SIDE, THROUGHPUT_OUTPUT_TOKENS, drawn_png, image_messages  # noqa: E402

from mili_openai import LLM, SamplingParams  # noqa: E402
from mili_openai.model.layers import Linear  # noqa: E402
from mili_openai.model.qwen3_5_vision import BiasedLinear  # noqa: E402

GIGA = 1e9
FIRST_IMAGE_SEED = 2000  # each request its own image, none the warm-up's


@dataclass
class StepCost:
    decode_rows: int
    prefill_tokens: int
    images: int
    cpu_s: float
    wall_s: float
    tower_cpu_s: float
    matmul_gflop: float
    weight_gb: float


class MatmulCounter:
    """FLOPs and weight bytes of every projection and LM-head call since the last `take`."""

    def __init__(self) -> None:
        self.flop, self.weight_bytes = 0.0, 0.0

    def add(self, rows: int, weight: torch.Tensor) -> None:
        self.flop += 2.0 * rows * weight.numel()
        self.weight_bytes += weight.numel() * weight.element_size()

    def hook(self, module: torch.nn.Module, inputs: tuple, _output) -> None:
        x = inputs[0]
        self.add(x.numel() // x.shape[-1], module.weight)

    def take(self) -> tuple[float, float]:
        taken, self.flop, self.weight_bytes = (self.flop / GIGA, self.weight_bytes / GIGA), 0.0, 0.0
        return taken


def image_chat(seed: int) -> list[dict]:
    return image_messages(drawn_png(seed, IMAGE_SIDE))


def instrument(llm: LLM, steps: list[StepCost]) -> None:
    """Record a StepCost for each step the LLM runs (its schedule, then its runner's execute)."""
    core, runner = llm.core, llm.core.runner
    model = runner.forward.model
    counter = MatmulCounter()
    for module in model.modules():
        if isinstance(module, (Linear, BiasedLinear)):
            module.register_forward_hook(counter.hook)
    head_weight = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
    compute_logits, encode, schedule, execute = model.compute_logits, model.visual.encode, core.schedule, runner.execute
    tower = {"cpu_s": 0.0, "images": 0}
    scheduled: list = []

    def counted_logits(hidden: torch.Tensor, head_rows: torch.Tensor | None = None) -> torch.Tensor:
        counter.add(hidden.shape[0], head_weight if head_rows is None else head_rows)
        return compute_logits(hidden, head_rows)

    def timed_encode(pixel_values, grids):
        started = time.process_time()
        out = encode(pixel_values, grids)
        tower["cpu_s"] += time.process_time() - started
        tower["images"] += len(grids)
        return out

    def recorded_schedule():
        result = schedule()
        if result is not None:
            scheduled.append(result[0])
        return result

    def timed_execute(step):
        batch = scheduled.pop()
        cpu, wall, tower_cpu, images = time.process_time(), time.perf_counter(), tower["cpu_s"], tower["images"]
        counter.take()
        out = execute(step)
        flop, weight = counter.take()
        steps.append(StepCost(batch.num_decode, sum(batch.num_new_tokens) - batch.num_decode,
                              tower["images"] - images, time.process_time() - cpu, time.perf_counter() - wall,
                              tower["cpu_s"] - tower_cpu, flop, weight))
        return out

    model.compute_logits, model.visual.encode = counted_logits, timed_encode
    core.schedule, runner.execute = recorded_schedule, timed_execute


def phase(steps: list[StepCost]) -> dict:
    wall = sum(s.wall_s for s in steps)
    flop, weight = sum(s.matmul_gflop for s in steps), sum(s.weight_gb for s in steps)
    return {"steps": len(steps), "cpu_s": round(sum(s.cpu_s for s in steps), 3), "wall_s": round(wall, 3),
            "tower_cpu_s": round(sum(s.tower_cpu_s for s in steps), 3), "matmul_gflop": round(flop, 1),
            "matmul_gflop_per_s": round(flop / wall, 1) if wall else None,
            "weight_gb_per_s": round(weight / wall, 1) if wall else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a Qwen3.5 vision-language checkpoint (bench_vision.py's)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--concurrency", type=int, default=CONCURRENT_REQUESTS)
    parser.add_argument("--output-tokens", type=int, default=THROUGHPUT_OUTPUT_TOKENS)
    parser.add_argument("--dtype", default="bfloat16", help="the weights' dtype (the benchmark's: bfloat16)")
    parser.add_argument("--out", type=Path, help="write the steps and phases here as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(model=str(args.checkpoint), dtype=args.dtype, device="cpu")
    if llm.core.runner.forward.model.visual is None:
        parser.error(f"{args.checkpoint} has no vision tower")
    steps: list[StepCost] = []
    instrument(llm, steps)
    llm.chat([image_chat(FIRST_IMAGE_SEED - 1)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    steps.clear()  # the warm-up's: first calls build kernels' plans and oneDNN's primitives
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    cpu, wall = time.process_time(), time.perf_counter()
    outputs = llm.chat([image_chat(FIRST_IMAGE_SEED + i) for i in range(args.concurrency)], params)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    for index, s in enumerate(steps):
        print(f"step {index:3d}: decode {s.decode_rows} prefill {s.prefill_tokens:4d} images {s.images} "
              f"cpu {s.cpu_s:.3f} s wall {s.wall_s:.3f} s tower cpu {s.tower_cpu_s:.3f} s "
              f"matmuls {s.matmul_gflop:.1f} GFLOP, weights {s.weight_gb:.2f} GB")
    phases = {"prefill": phase([s for s in steps if s.prefill_tokens]),
              "decode_only": phase([s for s in steps if not s.prefill_tokens])}
    summary = {"threads": args.threads, "requests": args.concurrency, "output_tokens": tokens,
               "prompt_tokens": len(outputs[0].prompt_token_ids), "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
               "output_tok_per_s": round(tokens / wall, 2), **phases}
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps({**summary, "steps": [asdict(s) for s in steps]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
