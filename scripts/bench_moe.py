"""Qwen3-MoE on CPU: mili (through its HTTP API, with `mili bench serve`'s client) against transformers'
`generate()` on the same random checkpoint in Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts, top-8,
expert intermediate 768, 32 query / 4 KV heads, head_dim 128, vocab 151936) with fewer layers, bf16.

For each batch size B (1 and 16), side by side in one run, mili first (its server stopped before
transformers loads: the two never share the memory):
- prefill tok/s: B prompts of --prompt-len random tokens sent at once, one output token each; prompt
  tokens / time until the last first token (mili: the bench's duration; transformers: generate with
  max_new_tokens=1).
- decode tok/s: B prompts of --decode-prompt-len tokens, --decode-tokens output tokens each (EOS ignored);
  mili: B / mean time per output token; transformers: B * (n - 1) / (time of n tokens - time of 1 token).

    .venv/bin/python scripts/bench_moe.py --checkpoint /tmp/qwen3-30b-a3b-4l          # builds it once
    .venv/bin/python scripts/bench_moe.py --checkpoint DIR --layers 4 --json moe.json --skip transformers

The checkpoint is written by transformers' own save_pretrained (per-expert names, as released checkpoints).
Prompts are random token ids, so no prompt shares a cached prefix with another. mili runs with a token
budget of --max-num-batched-tokens (default 4096, the largest prefill here): transformers prefills the
whole batch in one forward, and with 128 experts every step of a MoE reads nearly all of them, so the
server's CPU default of 512-token steps would read them 8 times for 4096 prompt tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("mili_openai") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from mili_openai.bench.config import BenchConfig  # noqa: E402
from mili_openai.bench.prompt_tokens import TOKENIZER_FILE  # noqa: E402
from mili_openai.bench.runner import run_benchmark  # noqa: E402
from mili_openai.bench.server_process import (  # noqa: E402
    LOCALHOST,
    ServerProcess,
    ServerSpec,
    build_cpu_kernels_first,
    free_port,
)
from mili_openai.model.checkpoint import QWEN3_30B_A3B_CONFIG, build_random_moe_checkpoint  # noqa: E402

BATCHES = (1, 16)
STARTUP_TIMEOUT_S = 900.0  # loading ~6 GB of weights (and the kernel build on a cold machine)
REQUEST_TIMEOUT_S = 1800.0
VOCAB_SAMPLE = 150_000  # prompt ids below the special tokens
PEERS = ("mili", "transformers")


def ensure_checkpoint(path: Path, layers: int, seed: int) -> Path:
    if path.exists() and any(path.iterdir()):
        if not (path / TOKENIZER_FILE).exists() or not any(path.glob("*.safetensors")):
            raise ValueError(f"{path} holds no complete checkpoint (an interrupted build? delete it)")
        return path
    print(f"building a random Qwen3-30B-A3B-shaped checkpoint with {layers} layers in {path}", file=sys.stderr)
    fields = {**QWEN3_30B_A3B_CONFIG, "num_hidden_layers": layers}
    return build_random_moe_checkpoint(path, fields, seed=seed, dtype=torch.bfloat16)


# ---- mili, through HTTP ----
def mili_spec(checkpoint: Path, max_batch: int, token_budget: int) -> ServerSpec:
    port = free_port()
    argv = (sys.executable, "-m", "mili_openai", "serve", str(checkpoint), "--host", LOCALHOST, "--port", str(port),
            "--dtype", "bfloat16", "--device", "cpu", "--max-num-seqs", str(max_batch), "--kv-cache-memory-gb", "1",
            "--max-num-batched-tokens", str(token_budget), "--log-level", "warning")
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return ServerSpec(name="mili", argv=argv, base_url=f"http://{LOCALHOST}:{port}", env={"PYTHONPATH": python_path})


def measure_mili(checkpoint: Path, args: argparse.Namespace, log_dir: Path) -> dict[str, float]:
    spec = mili_spec(checkpoint, max(BATCHES), args.max_num_batched_tokens)
    base = BenchConfig(base_url=spec.base_url, dataset="random", ignore_eos=True, prompt_as_ids=True,
                       timeout_s=REQUEST_TIMEOUT_S, progress=False, warmup=1)
    figures = {}
    with ServerProcess(spec, log_dir / "mili-moe.log") as server:
        print(f"mili ready after {server.wait_healthy(STARTUP_TIMEOUT_S):.0f} s", file=sys.stderr)
        for batch in BATCHES:
            prefill = replace(base, num_requests=batch, concurrency=batch, input_len=args.prompt_len, output_len=1,
                              seed=100 + batch)
            summary = asyncio.run(run_benchmark(prefill)).summary
            figures[f"prefill_b{batch}"] = summary.total_input_tokens / summary.duration_s
            decode = replace(base, num_requests=batch, concurrency=batch, input_len=args.decode_prompt_len,
                             output_len=args.decode_tokens, seed=200 + batch)
            summary = asyncio.run(run_benchmark(decode)).summary
            figures[f"decode_b{batch}"] = batch / (summary.tpot.mean_ms / 1000)
            print(f"mili batch {batch}: prefill {figures[f'prefill_b{batch}']:.1f} tok/s, "
                  f"decode {figures[f'decode_b{batch}']:.2f} tok/s", file=sys.stderr)
    return figures


# ---- transformers, offline ----
def timed_generate(model, input_ids: torch.Tensor, new_tokens: int) -> float:
    started = time.perf_counter()
    model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - started


@torch.inference_mode()
def measure_transformers(checkpoint: Path, args: argparse.Namespace) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16,
                                                 experts_implementation=args.transformers_experts).eval()
    print(f"transformers experts implementation: {model.config._experts_implementation}", file=sys.stderr)
    generator = torch.Generator().manual_seed(0)
    timed_generate(model, torch.randint(VOCAB_SAMPLE, (1, 16), generator=generator), 2)  # warm-up
    figures = {}
    for batch in BATCHES:
        prompts = torch.randint(VOCAB_SAMPLE, (batch, args.prompt_len), generator=generator)
        figures[f"prefill_b{batch}"] = batch * args.prompt_len / timed_generate(model, prompts, 1)
        prompts = torch.randint(VOCAB_SAMPLE, (batch, args.decode_prompt_len), generator=generator)
        first = timed_generate(model, prompts, 1)
        whole = timed_generate(model, prompts, args.decode_tokens)
        figures[f"decode_b{batch}"] = batch * (args.decode_tokens - 1) / (whole - first)
        print(f"transformers batch {batch}: prefill {figures[f'prefill_b{batch}']:.1f} tok/s, "
              f"decode {figures[f'decode_b{batch}']:.2f} tok/s", file=sys.stderr)
    return figures


def render(results: dict[str, dict[str, float]]) -> str:
    lines = ["| measure | batch | mili tok/s | transformers tok/s | mili ÷ transformers |", "|---|---|---|---|---|"]
    for measure in ("prefill", "decode"):
        for batch in BATCHES:
            key = f"{measure}_b{batch}"
            ours, peer = results.get("mili", {}).get(key), results.get("transformers", {}).get(key)
            ratio = f"{ours / peer:.2f}x" if ours and peer else "-"
            lines.append(f"| {measure} | {batch} | {ours or 0:.1f} | {peer or 0:.1f} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True, help="built here when missing")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of a checkpoint built now (48 in the "
                                                              "real model; 4 keep it near 6 GB in bf16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, default=256, help="prefill: tokens per prompt")
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=max(BATCHES) * 256,
                        help="mili's token budget per step")
    parser.add_argument("--transformers-experts", default=None,
                        help="transformers' experts_implementation (default: its own, grouped_mm; 'eager' loops "
                             "over the experts)")
    parser.add_argument("--skip", choices=PEERS, action="append", default=[])
    parser.add_argument("--log-dir", type=Path, default=Path("bench-results"))
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    checkpoint = ensure_checkpoint(args.checkpoint, args.layers, args.seed)
    results = {}
    if "mili" not in args.skip:
        build_cpu_kernels_first()
        results["mili"] = measure_mili(checkpoint, args, args.log_dir)
    if "transformers" not in args.skip:
        results["transformers"] = measure_transformers(checkpoint, args)
    print(render(results))
    if args.json is not None:
        args.json.write_text(json.dumps({"checkpoint": str(checkpoint), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
