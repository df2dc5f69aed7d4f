"""Serving comparison: mili vs HF `transformers serve --continuous-batching`, same random checkpoint.

Builds (once) a random-weight checkpoint in Qwen3-0.6B shapes (bf16; or Qwen3.5-0.8B's, `--model-shape`), then
for each server in turn — never both at once, the machine has 2 cores — starts it, waits for /health, runs the
workloads with `bench serve`, and stops it. Raw results go to `bench-results/<workload>-<server>.json`; the side-by-side
tables (built from every result JSON present, so a partial rerun merges with earlier runs) go between
marker comments in `docs/performance.md`.

Fairness: random weights hit EOS early and at random, so both servers are told to ignore it (mili: the
vLLM field `ignore_eos`; transformers serve: a per-request `generation_config` with `eos_token_id: -1`),
and per-token rates always come from each server's own usage counts (shown in the tables).

    .venv/bin/python scripts/compare_serving.py                        # everything
    .venv/bin/python scripts/compare_serving.py --servers mili --workloads W3
    .venv/bin/python scripts/compare_serving.py --render-only          # tables from existing JSON
    python scripts/compare_serving.py --device cuda                    # both servers on the GPU
    # quantized weights, beside llama.cpp's server on GGUF conversions of the same checkpoint:
    .venv/bin/python scripts/compare_serving.py --servers mili --quantization int8 int4 --no-limits \
        --llama-server /path/to/llama-server --llama-gguf q8_0=/path/q8_0.gguf --llama-gguf Q4_K_M=/path/q4km.gguf \
        --section quantized
    # the prefix cache's workloads on a random Qwen3.5-0.8B-shaped checkpoint: mili, mili without its prefix
    # cache, and llama.cpp's server on the checkpoint's GGUF conversion (bf16)
    .venv/bin/python scripts/compare_serving.py --model-shape qwen3.5-0.8b --servers mili mili-no-prefix-cache \
        --workloads W2 MT MT-text MT-ids --no-limits --llama-server /path/to/llama-server \
        --llama-gguf bf16=/path/qwen3.5-0.8b-bf16.gguf --section prefix_cache

On CUDA the limits are the GPU's (its read bandwidth, its bf16 GEMM peak) and the tables go to a section
of their own in the doc, beside the CPU one.

The peer needs transformers' serving extras: `.venv/bin/pip install "transformers[serving]"`.

llama.cpp's server, built from llama-cpp-python 0.3.36's vendored source (`pip download --no-deps
--no-binary :all: llama-cpp-python`): `cmake -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF`, then
`cmake --build build --target llama-server llama-quantize`; the GGUF files from `PYTHONPATH=gguf-py python
convert_hf_to_gguf.py CKPT --outtype bf16` and `llama-quantize` to q8_0 and Q4_K_M.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import orjson
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("mili_openai") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from mili_openai.bench.comparison_table import render_workload_table, update_marked_file  # noqa: E402
from mili_openai.bench.config import BenchConfig  # noqa: E402
from mili_openai.bench.prompt_tokens import load_tokenizer  # noqa: E402
from mili_openai.bench.report import format_table, write_json  # noqa: E402
from mili_openai.bench.runner import run_benchmark  # noqa: E402
from mili_openai.bench.server_process import (  # noqa: E402
    LOCALHOST,
    ServerProcess,
    ServerSpec,
    build_cpu_kernels_first,
    free_port,
)
from serving_limits import measure_machine_limits, paired_rounds, render_limits, render_paired  # noqa: E402 (sibling)
from serving_workloads import (  # noqa: E402 (sibling)
    DEFAULT_WORKLOADS,
    MODEL_SHAPES,
    WORKLOADS,
    Workload,
    checkpoint_shape,
    ensure_checkpoint,
)

MILI_NO_CACHE = "mili-no-prefix-cache"  # mili with `--no-enable-prefix-caching`, against itself
SERVERS = ("mili", "transformers", MILI_NO_CACHE)  # the first is "ours": ratios are mili ÷ peer
DEFAULT_SERVERS = ("mili", "transformers")
MILI_QUANTIZED_PREFIX = "mili-"  # mili-int8: `mili serve --quantization int8`
LLAMA_PREFIX = "llama.cpp-"  # llama.cpp-q8_0: llama.cpp's server on the GGUF file labelled q8_0
# llama.cpp's server as the issue runs it: 2 threads, 8 slots, a 16k context shared by the slots; --jinja: the
# chat endpoint renders the GGUF's own chat template (Qwen3.5's), as mili renders the checkpoint's
LLAMA_ARGS = ("-t", "2", "-np", "8", "-c", "16384", "--jinja")
DEVICES = ("cpu", "cuda")
DOC_TITLE = "Performance"
REQUEST_TIMEOUT_S = 900.0  # a whole workload on 2 CPU cores takes tens of seconds; this only stops hangs
STARTUP_TIMEOUT_S = 600.0  # model load (and mili's kernel build) on a cold machine
# transformers' peer cannot take `ignore_eos`; a per-request generation config with no EOS does the same.
TRANSFORMERS_NO_EOS = {"generation_config": json.dumps({"eos_token_id": -1})}
LIMITS_FILE = "machine_limits.json"
BYTES_PER_MIB = 1 << 20
SINGLE_STREAM_WORKLOAD = "W3"  # the one the per-token floors apply to directly
# Paired rounds (see serving_limits.py): the single-stream prompt with a short output, a prompt seed apiece
PAIRED_ROUNDS = 8
PAIRED_OUTPUT_LEN = 32
PAIRED_SEED_BASE = 1000


def doc_markers(device: str, section: str | None = None) -> tuple[str, str]:
    """The comments between which the run's section sits in the doc (the CPU's name has no suffix)."""
    name = "compare_serving" + (f"_{section}" if section else "" if device == "cpu" else f"_{device}")
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def server_names(args: argparse.Namespace) -> list[str]:
    """mili first (the tables' ratios are it ÷ each other), its quantized variants, then the peers."""
    names = [name for name in args.servers if name == "mili"]
    names += [f"{MILI_QUANTIZED_PREFIX}{method}" for method in args.quantization]
    names += [name for name in args.servers if name != "mili"]
    return names + [f"{LLAMA_PREFIX}{label}" for label in args.llama_gguf]


def server_spec(name: str, checkpoint: Path, port: int, extra_args: list[str], device: str,
                llama: tuple[Path, Path] | None = None) -> ServerSpec:
    """`llama`: (llama.cpp's server binary, the GGUF file) for a llama.cpp server."""
    base_url = f"http://{LOCALHOST}:{port}"
    common = ["--host", LOCALHOST, "--port", str(port), "--dtype", "bfloat16", "--device", device]
    if llama is not None:
        binary, gguf = llama
        argv = [str(binary), "-m", str(gguf), "--host", LOCALHOST, "--port", str(port), *LLAMA_ARGS]
        return ServerSpec(name=name, argv=tuple(argv + extra_args), base_url=base_url)
    if name.startswith("mili"):
        argv = [sys.executable, "-m", "mili_openai", "serve", str(checkpoint), *common, "--log-level", "warning"]
        quantization = "" if name == MILI_NO_CACHE else name.removeprefix("mili").removeprefix("-")
        argv += ["--quantization", quantization] if quantization else []
        argv += ["--no-enable-prefix-caching"] if name == MILI_NO_CACHE else []
    else:
        # its CLI module rather than the `transformers` script: the one this interpreter imports, wherever the
        # package was installed (a --target dir on PYTHONPATH holds no script beside the interpreter)
        argv = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(checkpoint),
                "--continuous-batching", *common, "--log-level", "warning"]
    # Offline: the checkpoint is local and no machine of this project reaches the hub.
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return ServerSpec(name=name, argv=tuple(argv + extra_args), base_url=base_url,
                      env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": python_path})


def bench_config(workload: Workload, server: str, spec: ServerSpec, checkpoint: Path) -> BenchConfig:
    if server != "transformers":  # mili and llama.cpp's server both take vLLM's `ignore_eos`
        return replace(workload.bench, base_url=spec.base_url, ignore_eos=True, timeout_s=REQUEST_TIMEOUT_S,
                       progress=True)
    # transformers serve's /v1/models lists the hub cache, not the pinned model: name it ourselves.
    return replace(workload.bench, base_url=spec.base_url, model=str(checkpoint), timeout_s=REQUEST_TIMEOUT_S,
                   extra_body=json.dumps(TRANSFORMERS_NO_EOS), progress=True)


def single_stream_workload() -> Workload:
    """The workload the per-token floors apply to."""
    return next(w for w in WORKLOADS if w.name == SINGLE_STREAM_WORKLOAD)


def single_stream_bench() -> BenchConfig:
    return single_stream_workload().bench


def bracket_path(out_dir: Path, server: str) -> Path:
    return out_dir / f"{SINGLE_STREAM_WORKLOAD}-{server}-limits.json"


def paired_path(out_dir: Path, server: str) -> Path:
    return out_dir / f"{SINGLE_STREAM_WORKLOAD}-{server}-paired.json"


def paired_description() -> str:
    return (f"{PAIRED_ROUNDS} requests of {single_stream_bench().input_len} prompt tokens and {PAIRED_OUTPUT_LEN} "
            f"output tokens, one at a time")


def run_paired(server: str, spec: ServerSpec, checkpoint: Path, tokenizer, device: torch.device) -> list[dict]:
    w3 = single_stream_workload()

    def run_request(index: int) -> dict:
        bench = replace(bench_config(w3, server, spec, checkpoint), num_requests=1, output_len=PAIRED_OUTPUT_LEN,
                        warmup=0, seed=PAIRED_SEED_BASE + index, progress=False)
        return asyncio.run(run_benchmark(bench, tokenizer)).summary.to_json()

    return paired_rounds(checkpoint, w3.bench.input_len, run_request, PAIRED_ROUNDS, device)


def run_server(server: str, workloads: list[Workload], checkpoint: Path, out_dir: Path, extra_args: list[str],
               tokenizer, bracket_limits: bool, device: str, llama: tuple[Path, Path] | None = None) -> None:
    spec = server_spec(server, checkpoint, free_port(), extra_args, device, llama)
    limits_device = torch.device(device)
    prompt_len = single_stream_bench().input_len
    with ServerProcess(spec, out_dir / f"{server}.log") as process:
        took = process.wait_healthy(STARTUP_TIMEOUT_S)
        print(f"{server} healthy after {took:.1f} s", file=sys.stderr)
        for workload in workloads:
            bracketed = bracket_limits and workload.name == SINGLE_STREAM_WORKLOAD
            before = measure_machine_limits(checkpoint, prompt_len, device=limits_device) if bracketed else None
            run = asyncio.run(run_benchmark(bench_config(workload, server, spec, checkpoint), tokenizer))
            if bracketed:
                after = measure_machine_limits(checkpoint, prompt_len, device=limits_device)
                bracket_path(out_dir, server).write_text(json.dumps({"before": before, "after": after}, indent=2))
                paired = run_paired(server, spec, checkpoint, tokenizer, limits_device)
                paired_path(out_dir, server).write_text(json.dumps(paired, indent=2))
            print(f"\n{workload.name} on {server}\n{format_table(run)}")
            write_json(run, out_dir / f"{workload.name}-{server}.json")
    print(f"{server} stopped", file=sys.stderr)


def load_results(out_dir: Path, servers: list[str]) -> dict[str, dict[str, dict]]:
    """{workload: {server: full result JSON}} for every result file present."""
    results: dict[str, dict[str, dict]] = {}
    for workload in WORKLOADS:
        for server in servers:
            path = out_dir / f"{workload.name}-{server}.json"
            if path.exists():
                results.setdefault(workload.name, {})[server] = orjson.loads(path.read_bytes())
    return results


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown CPU" where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")


def hardware_text(device: str) -> str:
    """What the run's servers ran on: '2 CPU cores (AMD EPYC ...)', or '1 NVIDIA H200 (16 CPU cores beside
    it)'. Named by the machine that renders: `--render-only` elsewhere than the run's machine names that one."""
    if device == "cpu":
        return f"{os.cpu_count()} CPU cores ({cpu_model_name()})"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CUDA GPU (none here to name)"
    return f"1 {gpu} ({os.cpu_count()} CPU cores beside it)"


def render_section(results: dict[str, dict[str, dict]], checkpoint: Path, out_dir: Path,
                   limits: dict[str, float] | None, device: str, servers: list[str]) -> str:
    lines = [  # the doc gives each section its heading (which servers, which device)
        f"Generated by `scripts/compare_serving.py --device {device}` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {hardware_text(device)}, one server at a time, "
        f"same random-weight checkpoint `{checkpoint.name}` ({checkpoint_shape(checkpoint)}), completions "
        "endpoint (MT: chat), greedy, streaming. Cached prompt share: what each server's usage reports cached "
        "(n/a: it reports none), multi-turn from turn 2 on. EOS "
        "ignored on both sides; token counts from each server's usage. Advantage columns: > 1 means mili is "
        f"better (throughput ratio mili ÷ peer, latency ratio peer ÷ mili). Raw JSON: `{out_dir}/`.",
    ]
    for workload in WORKLOADS:
        summaries = {server: data["summary"] for server, data in results.get(workload.name, {}).items()}
        if not summaries:
            continue
        lines += ["", f"### {workload.name}: {workload.description}", "",
                  render_workload_table(servers, summaries)]
        for server, data in results[workload.name].items():
            for error in data["summary"]["errors"]:
                lines.append(f"\n- {server} error: `{error}`")
            memory = data.get("state_snapshot_memory")
            if memory:  # mili on a hybrid model: what its prefix cache's state snapshots held after the run
                lines.append(f"\n- {server} state snapshots after the run: {memory['cached']} of {memory['snapshots']} "
                             f"cached, {memory['used_bytes'] / BYTES_PER_MIB:.1f} of "
                             f"{memory['budget_bytes'] / BYTES_PER_MIB:.1f} MiB")
    single = results.get(SINGLE_STREAM_WORKLOAD, {})
    brackets = {server: json.loads(bracket_path(out_dir, server).read_text())
                for server in single if bracket_path(out_dir, server).exists()}
    if limits is not None or brackets:
        lines += render_limits(SINGLE_STREAM_WORKLOAD, single_stream_bench().input_len, limits, single, brackets)
    paired = {server: json.loads(paired_path(out_dir, server).read_text())
              for server in servers if paired_path(out_dir, server).exists()}
    if paired:
        lines += render_paired(paired_description(), paired, single_stream_bench().input_len)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(DEFAULT_SERVERS))
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where both servers run, and whose "
                        "limits are measured")
    parser.add_argument("--workloads", nargs="+", choices=[w.name for w in WORKLOADS], default=list(DEFAULT_WORKLOADS))
    parser.add_argument("--model-shape", choices=MODEL_SHAPES, default=MODEL_SHAPES[0],
                        help="the shapes of a built checkpoint")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="checkpoint dir (built when missing; default: bench-results/SHAPE-random-seedN)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed of a built checkpoint")
    parser.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    parser.add_argument("--doc", type=Path, default=Path("docs/performance.md"))
    parser.add_argument("--quantization", nargs="*", choices=("int8", "int4", "fp8"), default=[],
                        help="also run mili with each of these `--quantization` (servers mili-int8, ...)")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    parser.add_argument("--llama-gguf", action="append", default=[], metavar="LABEL=PATH",
                        help="also run llama.cpp's server on this GGUF file (server llama.cpp-LABEL; repeat)")
    parser.add_argument("--section", default=None,
                        help="write the tables to the doc section compare_serving_SECTION (default: the device's)")
    parser.add_argument("--mili-arg", action="append", default=[], help="extra `mili serve` argument (repeat)")
    parser.add_argument("--transformers-arg", action="append", default=[],
                        help="extra `transformers serve` argument (repeat)")
    parser.add_argument("--no-limits", action="store_true", help="skip measuring the machine's limits")
    parser.add_argument("--render-only", action="store_true", help="only rebuild the tables from existing JSON")
    return parser.parse_args(argv)


def llama_files(args: argparse.Namespace) -> dict[str, tuple[Path, Path]]:
    """{server name: (llama-server, GGUF file)} from --llama-gguf LABEL=PATH."""
    files = {}
    for item in args.llama_gguf:
        label, _, path = item.partition("=")
        if not path or args.llama_server is None:
            raise SystemExit("--llama-gguf takes LABEL=PATH, and needs --llama-server")
        files[f"{LLAMA_PREFIX}{label}"] = (args.llama_server, Path(path))
    args.llama_gguf = [name.removeprefix(LLAMA_PREFIX) for name in files]
    return files


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    llama = llama_files(args)
    servers = server_names(args)
    checkpoint = args.checkpoint or args.out_dir / f"{args.model_shape}-random-seed{args.seed}"
    if not args.render_only:
        ensure_checkpoint(checkpoint, args.seed, args.model_shape)
        if args.device == "cpu":
            build_cpu_kernels_first()
        tokenizer = load_tokenizer(checkpoint)  # the checkpoint's own: its vocabulary makes the prompts
        workloads = [w for w in WORKLOADS if w.name in args.workloads]
        for server in servers:
            extra = args.transformers_arg if server == "transformers" else [] if server in llama else args.mili_arg
            run_server(server, workloads, checkpoint, args.out_dir, extra, tokenizer, not args.no_limits,
                       args.device, llama.get(server))
        if not args.no_limits:  # with both servers stopped: nothing else on the cores
            limits = measure_machine_limits(checkpoint, single_stream_bench().input_len,
                                            device=torch.device(args.device))
            (args.out_dir / LIMITS_FILE).write_text(json.dumps(limits, indent=2))
    limits_path = args.out_dir / LIMITS_FILE
    limits = json.loads(limits_path.read_text()) if limits_path.exists() and not args.no_limits else None
    results = load_results(args.out_dir, servers)
    if not results:
        print(f"no results in {args.out_dir}", file=sys.stderr)
        return 1
    section = render_section(results, checkpoint, args.out_dir, limits, args.device, servers)
    doc = update_marked_file(args.doc, *doc_markers(args.device, args.section), section, DOC_TITLE)
    print(f"\nwrote {doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
