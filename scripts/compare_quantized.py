"""Single-stream decode and prefill of mili's quantized weights against its bf16 weights, interleaved.

On a machine whose memory speed swings minute to minute (and that others share), workloads run one server
after another compare moments, not servers. Here every server is up at once (idle ones use no CPU) and
each round sends one W3-shaped request (512 prompt tokens, greedy, EOS ignored) to each in turn, in
rotating order; the ratios are medians over rounds of each server's TPOT and TTFT over bf16's in the same
round.

    .venv/bin/python scripts/compare_quantized.py --checkpoint bench-results/qwen3-0.6b-random-seed0 \\
        --quantization int8 int4 --rounds 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("mili_openai") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from compare_serving import (  # noqa: E402 (sibling)
    STARTUP_TIMEOUT_S,
    bench_config,
    ensure_checkpoint,
    server_spec,
    single_stream_workload,
)

from mili_openai.bench.prompt_tokens import load_tokenizer  # noqa: E402
from mili_openai.bench.runner import run_benchmark  # noqa: E402
from mili_openai.bench.server_process import ServerProcess, build_cpu_kernels_first, free_port  # noqa: E402

BASELINE = "mili"
KV_CACHE_GB = "0.5"  # each server's pool: several are up at once; one 768-token stream needs ~90 MB
SEED_BASE = 2000  # each round's prompt is its own: no prefix-cache hits across rounds
# what each quantized server is started with
SCHEMES = {"int8": ["--quantization", "int8"], "int4": ["--quantization", "int4"],
           "int4-lm-head-int4": ["--quantization", "int4", "--quantize-lm-head", "int4"]}


def quartiles(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    low, mid, high = statistics.quantiles(values, n=4)
    return f"{mid:.3f} ({low:.3f}-{high:.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path("bench-results/qwen3-0.6b-random-seed0"))
    parser.add_argument("--quantization", nargs="+", choices=tuple(SCHEMES), default=["int8", "int4"],
                        help="int4-lm-head-int4: int4 weights and LM head (--quantize-lm-head int4)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128, help="tokens per request (W3 has 256)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/quantized-interleaved.json"))
    args = parser.parse_args(argv)
    ensure_checkpoint(args.checkpoint, seed=0)
    build_cpu_kernels_first()
    servers = [BASELINE, *(f"mili-{method}" for method in args.quantization)]
    tokenizer = load_tokenizer()
    w3 = single_stream_workload()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, dict]] = []
    with contextlib.ExitStack() as stack:
        specs = {}
        for name in servers:
            scheme = name.removeprefix(BASELINE).removeprefix("-")
            extra = ["--kv-cache-memory-gb", KV_CACHE_GB, *(SCHEMES[scheme] if scheme else [])]
            spec = replace(server_spec(BASELINE, args.checkpoint, free_port(), extra, "cpu"), name=name)
            process = stack.enter_context(ServerProcess(spec, args.out.with_name(f"{name}.log")))
            print(f"{name} healthy after {process.wait_healthy(STARTUP_TIMEOUT_S):.1f} s", file=sys.stderr)
            specs[name] = spec
        for index in range(args.rounds):
            order = servers[index % len(servers):] + servers[:index % len(servers)]
            results = {}
            for name in order:
                bench = replace(bench_config(w3, name, specs[name], args.checkpoint), num_requests=1, warmup=0,
                                output_len=args.output_len, seed=SEED_BASE + index, progress=False)
                results[name] = asyncio.run(run_benchmark(bench, tokenizer)).summary.to_json()
            rounds.append(results)
            print(f"round {index + 1}: " + ", ".join(f"{name} TPOT {r['tpot']['mean_ms']:.1f} ms TTFT "
                                                       f"{r['ttft']['mean_ms']:.0f} ms" for name, r in results.items()),
                  file=sys.stderr)
    args.out.write_text(json.dumps(rounds, indent=2))
    print(f"\n{args.rounds} interleaved rounds, {w3.bench.input_len} prompt + {args.output_len} output tokens; "
          f"median (quartiles) over rounds of each ratio to {BASELINE} (bf16) in the same round:")
    for name in servers[1:]:
        tpot = [r[name]["tpot"]["mean_ms"] / r[BASELINE]["tpot"]["mean_ms"] for r in rounds]
        ttft = [r[name]["ttft"]["mean_ms"] / r[BASELINE]["ttft"]["mean_ms"] for r in rounds]
        print(f"- {name}: TPOT {quartiles(tpot)} x bf16's, TTFT {quartiles(ttft)} x bf16's")
    print(f"- {BASELINE} (bf16): TPOT median {statistics.median(r[BASELINE]['tpot']['mean_ms'] for r in rounds):.1f} "
          f"ms, TTFT median {statistics.median(r[BASELINE]['ttft']['mean_ms'] for r in rounds):.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
