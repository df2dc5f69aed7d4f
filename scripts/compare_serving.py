"""Serving comparison: mili vs HF `transformers serve --continuous-batching`, same random checkpoint.

Builds (once) a random-weight checkpoint in Qwen3-0.6B shapes (bf16), then for each server in turn —
never both at once, the machine has 2 cores — starts it, waits for /health, runs the workloads with
`bench serve`, and stops it. Raw results go to `bench-results/<workload>-<server>.json`; the side-by-side
tables (built from every result JSON present, so a partial rerun merges with earlier runs) go between
marker comments in `docs/performance.md`.

Fairness: random weights hit EOS early and at random, so both servers are told to ignore it (mili: the
vLLM field `ignore_eos`; transformers serve: a per-request `generation_config` with `eos_token_id: -1`),
and per-token rates always come from each server's own usage counts (shown in the tables).

    .venv/bin/python scripts/compare_serving.py                        # everything
    .venv/bin/python scripts/compare_serving.py --servers mili --workloads W3
    .venv/bin/python scripts/compare_serving.py --render-only          # tables from existing JSON

The peer needs transformers' serving extras: `.venv/bin/pip install "transformers[serving]"`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import orjson

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("mili_openai") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from mili_openai.bench.comparison_table import render_workload_table, update_marked_file  # noqa: E402
from mili_openai.bench.config import BenchConfig  # noqa: E402
from mili_openai.bench.prompt_tokens import TOKENIZER_FILE, load_tokenizer  # noqa: E402
from mili_openai.bench.report import format_table, write_json  # noqa: E402
from mili_openai.bench.runner import run_benchmark  # noqa: E402
from mili_openai.bench.server_process import LOCALHOST, ServerProcess, ServerSpec, free_port  # noqa: E402

SERVERS = ("mili", "transformers")  # the first is "ours": ratios are mili ÷ peer
BEGIN_MARKER = "<!-- compare_serving:begin -->"
END_MARKER = "<!-- compare_serving:end -->"
DOC_TITLE = "Performance"
REQUEST_TIMEOUT_S = 900.0  # a whole workload on 2 CPU cores takes tens of seconds; this only stops hangs
STARTUP_TIMEOUT_S = 600.0  # model load (and mili's kernel build) on a cold machine
# transformers' peer cannot take `ignore_eos`; a per-request generation config with no EOS does the same.
TRANSFORMERS_NO_EOS = {"generation_config": json.dumps({"eos_token_id": -1})}
LIMITS_FILE = "machine_limits.json"
SINGLE_STREAM_WORKLOAD = "W3"  # the one the per-token floors apply to directly
BF16_BYTES = 2
MS_PER_S = 1000.0


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    description: str
    bench: BenchConfig  # base_url/model/EOS fields are filled in per server


# Each workload has its own prompt seed: one server stays up across all of them, and with a shared seed the
# first prompts of two workloads would share their first tokens (and hit mili's prefix cache).
WORKLOADS = (
    Workload("W1", "random prompts: 16 requests, concurrency 8, 256 prompt tokens, 64 output tokens",
             BenchConfig(dataset="random", num_requests=16, concurrency=8, input_len=256, output_len=64,
                         warmup=2, seed=1)),
    Workload("W2", "shared prefix: 16 requests, concurrency 8, 2 groups of ~960 shared + 64 own prompt "
                   "tokens, 32 output tokens",
             BenchConfig(dataset="shared-prefix", num_requests=16, concurrency=8, num_groups=2, prefix_len=960,
                         suffix_len=64, output_len=32, warmup=2, seed=2)),
    Workload("W3", "single stream: 512 prompt tokens, 256 output tokens",
             BenchConfig(dataset="random", num_requests=1, concurrency=1, input_len=512, output_len=256,
                         warmup=1, seed=3)),
)


def server_spec(name: str, checkpoint: Path, port: int, extra_args: list[str]) -> ServerSpec:
    base_url = f"http://{LOCALHOST}:{port}"
    common = ["--host", LOCALHOST, "--port", str(port), "--dtype", "bfloat16"]
    if name == "mili":
        argv = [sys.executable, "-m", "mili_openai", "serve", str(checkpoint), *common, "--log-level", "warning"]
    else:
        cli = Path(sys.executable).with_name("transformers")
        argv = [str(cli), "serve", str(checkpoint), "--continuous-batching", *common, "--device", "cpu",
                "--log-level", "warning"]
    # Offline: the checkpoint is local and no machine of this project reaches the hub.
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return ServerSpec(name=name, argv=tuple(argv + extra_args), base_url=base_url,
                      env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": python_path})


def bench_config(workload: Workload, server: str, spec: ServerSpec, checkpoint: Path) -> BenchConfig:
    if server == "mili":
        return replace(workload.bench, base_url=spec.base_url, ignore_eos=True, timeout_s=REQUEST_TIMEOUT_S,
                       progress=True)
    # transformers serve's /v1/models lists the hub cache, not the pinned model: name it ourselves.
    return replace(workload.bench, base_url=spec.base_url, model=str(checkpoint), timeout_s=REQUEST_TIMEOUT_S,
                   extra_body=json.dumps(TRANSFORMERS_NO_EOS), progress=True)


def ensure_checkpoint(path: Path, seed: int) -> Path:
    """Build the random checkpoint into a missing or empty dir; refuse to touch an incomplete one."""
    if path.exists() and any(path.iterdir()):
        # The builder writes the tokenizer last: without it, or without weights, a build was interrupted.
        if not (path / TOKENIZER_FILE).exists() or not any(path.glob("*.safetensors")):
            raise ValueError(f"{path} holds no complete checkpoint (an interrupted build? delete it)")
        return path
    import torch

    from mili_openai.model.checkpoint import QWEN3_0_6B_SHAPE, build_random_checkpoint

    print(f"building a random Qwen3-0.6B-shaped checkpoint in {path}", file=sys.stderr)
    return build_random_checkpoint(path, QWEN3_0_6B_SHAPE, seed=seed, dtype=torch.bfloat16)


def checkpoint_shape(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "torch_dtype")
    return ", ".join(f"{key} {config[key]}" for key in keys if key in config)


def single_stream_bench():
    """The bench config of the workload the per-token floors apply to."""
    return next(w for w in WORKLOADS if w.name == SINGLE_STREAM_WORKLOAD).bench


def measure_machine_limits(checkpoint: Path) -> dict:
    """The floors a server cannot beat here: a decode step reads every weight once (bandwidth-bound), a
    prefill token costs 2 flops per non-embedding parameter plus causal attention's two products over its
    mean context, at the single-stream workload's prompt length (matmul-bound). Probes shared with
    scripts/bench_engine.py."""
    from bench_engine import measure_matmul_flops, measure_read_bandwidths  # a sibling script

    weight_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    probes = measure_read_bandwidths()
    bandwidth, flops = max(probes.values()), measure_matmul_flops()
    config = json.loads((checkpoint / "config.json").read_text())
    # A prompt token goes through every matmul but the LM head (applied to the last position only); the
    # embedding is a row lookup. Tied or not, the file holds the vocab × hidden table at least once.
    params = weight_bytes / BF16_BYTES - config["vocab_size"] * config["hidden_size"]
    prompt_len = single_stream_bench().input_len
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    # q·k and p·v, 2 flops a multiply-add each, per head and layer, over the mean context of a causal prompt
    attention = 2 * 2 * config["num_hidden_layers"] * config["num_attention_heads"] * head_dim * (prompt_len // 2)
    return {"weight_bytes": weight_bytes, "read_bandwidth_bytes_per_s": bandwidth,
            "read_bandwidth_probes": probes, "matmul_flops_per_s": flops,
            "decode_step_floor_ms": weight_bytes / bandwidth * MS_PER_S,
            "prefill_floor_ms_per_token": (2 * params + attention) / flops * MS_PER_S}


def probe_text(limits: dict) -> str:
    """' (the fastest of: float32 sum 23.1, ...)' from the probes, when the limits recorded them."""
    probes = limits.get("read_bandwidth_probes")
    if not probes:
        return ""
    return " (the fastest of: " + ", ".join(f"{name} {rate / 1e9:.1f}" for name, rate in probes.items()) + ")"


def render_limits(limits: dict, results: dict[str, dict[str, dict]]) -> list[str]:
    step, per_token = limits["decode_step_floor_ms"], limits["prefill_floor_ms_per_token"]
    w3 = single_stream_bench()
    prefill = per_token * w3.input_len
    lines = ["", "### Against this machine's limits", "",
             f"Measured: read bandwidth {limits['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s{probe_text(limits)}, "
             f"best bf16-weight matmul "
             f"{limits['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s; weights {limits['weight_bytes'] / 1e9:.2f} GB. "
             f"Floors: a decode step {step:.1f} ms (every weight read once), a {w3.input_len}-token prefill "
             f"{prefill:.0f} ms. {SINGLE_STREAM_WORKLOAD} measured ÷ floor (1.0 = at the limit):", ""]
    for server, data in results.get(SINGLE_STREAM_WORKLOAD, {}).items():
        summary = data["summary"]
        tpot, ttft = summary["tpot"]["mean_ms"], summary["ttft"]["mean_ms"]
        if tpot is not None and ttft is not None:
            lines.append(f"- {server}: TPOT {tpot:.1f} ms = {tpot / step:.2f}× the decode floor; "
                         f"TTFT {ttft:.0f} ms = {ttft / prefill:.2f}× the prefill floor")
    return lines


def run_server(server: str, workloads: list[Workload], checkpoint: Path, out_dir: Path, extra_args: list[str],
               tokenizer) -> None:
    spec = server_spec(server, checkpoint, free_port(), extra_args)
    with ServerProcess(spec, out_dir / f"{server}.log") as process:
        took = process.wait_healthy(STARTUP_TIMEOUT_S)
        print(f"{server} healthy after {took:.1f} s", file=sys.stderr)
        for workload in workloads:
            run = asyncio.run(run_benchmark(bench_config(workload, server, spec, checkpoint), tokenizer))
            print(f"\n{workload.name} on {server}\n{format_table(run)}")
            write_json(run, out_dir / f"{workload.name}-{server}.json")
    print(f"{server} stopped", file=sys.stderr)


def load_results(out_dir: Path) -> dict[str, dict[str, dict]]:
    """{workload: {server: full result JSON}} for every result file present."""
    results: dict[str, dict[str, dict]] = {}
    for workload in WORKLOADS:
        for server in SERVERS:
            path = out_dir / f"{workload.name}-{server}.json"
            if path.exists():
                results.setdefault(workload.name, {})[server] = orjson.loads(path.read_bytes())
    return results


def render_section(results: dict[str, dict[str, dict]], checkpoint: Path, out_dir: Path,
                   limits: dict[str, float] | None) -> str:
    lines = [
        "## Serving: mili vs `transformers serve --continuous-batching`",
        "",
        f"Generated by `scripts/compare_serving.py` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} CPU cores, one server at a time, same random-weight checkpoint "
        f"`{checkpoint.name}` ({checkpoint_shape(checkpoint)}), completions endpoint, greedy, streaming. EOS "
        "ignored on both sides; token counts from each server's usage. Advantage columns: > 1 means mili is "
        f"better (throughput ratio mili ÷ peer, latency ratio peer ÷ mili). Raw JSON: `{out_dir}/`.",
    ]
    for workload in WORKLOADS:
        summaries = {server: data["summary"] for server, data in results.get(workload.name, {}).items()}
        if not summaries:
            continue
        lines += ["", f"### {workload.name}: {workload.description}", "",
                  render_workload_table(list(SERVERS), summaries)]
        for server, data in results[workload.name].items():
            for error in data["summary"]["errors"]:
                lines.append(f"\n- {server} error: `{error}`")
    if limits is not None:
        lines += render_limits(limits, results)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--workloads", nargs="+", choices=[w.name for w in WORKLOADS],
                        default=[w.name for w in WORKLOADS])
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="checkpoint dir (built when missing; default: bench-results/qwen3-0.6b-random-seedN)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed of a built checkpoint")
    parser.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    parser.add_argument("--doc", type=Path, default=Path("docs/performance.md"))
    parser.add_argument("--mili-arg", action="append", default=[], help="extra `mili serve` argument (repeat)")
    parser.add_argument("--transformers-arg", action="append", default=[],
                        help="extra `transformers serve` argument (repeat)")
    parser.add_argument("--no-limits", action="store_true", help="skip measuring the machine's limits")
    parser.add_argument("--render-only", action="store_true", help="only rebuild the tables from existing JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    checkpoint = args.checkpoint or args.out_dir / f"qwen3-0.6b-random-seed{args.seed}"
    if not args.render_only:
        ensure_checkpoint(checkpoint, args.seed)
        tokenizer = load_tokenizer()
        workloads = [w for w in WORKLOADS if w.name in args.workloads]
        extra = {"mili": args.mili_arg, "transformers": args.transformers_arg}
        for server in args.servers:
            run_server(server, workloads, checkpoint, args.out_dir, extra[server], tokenizer)
        if not args.no_limits:  # with both servers stopped: nothing else on the cores
            limits = measure_machine_limits(checkpoint)
            (args.out_dir / LIMITS_FILE).write_text(json.dumps(limits, indent=2))
    limits_path = args.out_dir / LIMITS_FILE
    limits = json.loads(limits_path.read_text()) if limits_path.exists() and not args.no_limits else None
    results = load_results(args.out_dir)
    if not results:
        print(f"no results in {args.out_dir}", file=sys.stderr)
        return 1
    doc = update_marked_file(args.doc, BEGIN_MARKER, END_MARKER, render_section(results, checkpoint, args.out_dir, limits),
                             DOC_TITLE)
    print(f"\nwrote {doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
