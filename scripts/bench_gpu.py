"""The GPU serving benchmark of issue 30: five workloads through the HTTP API with `mili bench serve`.

Builds (once) a random-weight checkpoint in Qwen3-0.6B shapes (bf16), then for each server configuration
in turn starts `mili serve CKPT --device cuda ...`, waits for /health, runs the workloads, stops it, and
prints one table with every figure beside the issue's target:

    python3 scripts/bench_gpu.py --out-dir /tmp/bench-gpu                 # issue flags, then the defaults
    python3 scripts/bench_gpu.py --configs issue torch:c64 fp8:single,c64  # Triton against torch's SDPA, fp8

Configurations: "issue" (`--kv-cache-memory-gb 40 --max-num-seqs 256 --max-num-batched-tokens 8192`, as the
issue measured), "defaults" (plain `mili serve CKPT --device cuda`), "torch" (the issue's flags with
`--attention-backend torch`, the gathered-K/V path as the peer of the Triton kernels), "fp8" (the issue's flags
with `--quantization fp8`), "inproc" (the issue's flags with `--no-engine-process`: the engine on the server's
event loop), "sync" (the issue's flags with `--no-async-launch`: each step launched on the worker thread once
the step before is on the host). On a random Qwen3.5-0.8B-shaped checkpoint (hybrid: Gated DeltaNet + gated
attention) with the issue's flags: "hybrid", and "mtp" (MTP speculation, 2 tokens, the off-switch off: a random
MTP head accepts almost nothing, so this measures what verifying drafts costs). "lora": the issue's flags serving
8 random rank-16 adapters (scripts/make_lora_adapters.py) in one step, the requests spread over them round robin.
`CONFIG:W1,W2` runs only those workloads under that configuration; a
configuration that fails (its server or a workload) is reported and the rest still run, and `--deadline-s`
skips what would start too late to finish. Each row prints as soon as it is measured. Random weights hit
EOS at random, so every request sets `ignore_eos`. The checkpoints and adapters are built into the out dir once
(the Qwen3.5 one and the adapters on a background thread while the first configurations run). Raw results:
`<out-dir>/<config>-<workload>.json`, server logs beside them. It needs a CUDA GPU; it measures nothing on a CPU.

`--profile CONFIG:WORKLOAD` (alone, or after the `--configs` plan) serves that configuration with
`--torch-profiler-dir <out-dir>/profile-CONFIG-WORKLOAD` and runs that workload with `mili bench serve --profile`:
the server profiles its steps through the measured requests and writes a Chrome trace and a summary there,
and the summary (operators by GPU and host time, the GPU-busy share) prints here. Its figures ran under the
profiler: they are not the configuration's.

    python3 scripts/bench_gpu.py --out-dir /tmp/bench-gpu --profile issue:c64
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("mili_openai") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from make_lora_adapters import DEFAULT_TARGETS, write_adapters  # noqa: E402
from serving_workloads import MODEL_SHAPES, ensure_checkpoint  # noqa: E402

from mili_openai.bench.server_process import LOCALHOST, ServerProcess, ServerSpec, free_port  # noqa: E402

STARTUP_TIMEOUT_S = 600.0  # model load, memory profile, Triton compiles and graph capture on a cold machine
REQUEST_TIMEOUT_S = 600.0
CHECKPOINT_SEED = 0
QWEN3, QWEN35 = MODEL_SHAPES
LORA_ADAPTERS, LORA_RANK = 8, 16
MTP_FORCED = json.dumps({"method": "mtp", "num_speculative_tokens": 2, "min_acceptance_rate": 0})


@dataclass(frozen=True)
class ServerConfig:
    flags: tuple[str, ...]  # `mili serve` flags
    model: str = QWEN3  # the random checkpoint's shape, one of MODEL_SHAPES
    lora: bool = False  # serve the LORA_ADAPTERS random adapters and spread the requests over them


ISSUE_FLAGS = ("--kv-cache-memory-gb", "40", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192")
CONFIGS = {
    "issue": ServerConfig(ISSUE_FLAGS),
    "defaults": ServerConfig(()),
    "torch": ServerConfig((*ISSUE_FLAGS, "--attention-backend", "torch")),
    "fp8": ServerConfig((*ISSUE_FLAGS, "--quantization", "fp8")),
    "inproc": ServerConfig((*ISSUE_FLAGS, "--no-engine-process")),
    "sync": ServerConfig((*ISSUE_FLAGS, "--no-async-launch")),
    "hybrid": ServerConfig(ISSUE_FLAGS, model=QWEN35),
    "mtp": ServerConfig((*ISSUE_FLAGS, "--speculative-config", MTP_FORCED), model=QWEN35),
    "lora": ServerConfig((*ISSUE_FLAGS, "--max-loras", str(LORA_ADAPTERS), "--max-lora-rank", str(LORA_RANK)),
                         lora=True),
}
# a server's start-up plus one workload: configurations begun with less time left are skipped
MIN_CONFIG_S = 90.0
PROFILE_SUMMARY_LINES = 70  # of the profile's summary printed (the rest stays in its file)


@dataclass(frozen=True)
class Workload:
    flags: tuple[str, ...]  # `mili bench serve` flags
    metric: str  # what the issue judges it by: a key of the run's summary
    target: float
    higher_is_better: bool = True


WORKLOADS = {
    "single": Workload(("--num-requests", "4", "--concurrency", "1", "--input-len", "512", "--output-len", "256"),
                       "tpot_p50_ms", 2.0, higher_is_better=False),
    "c64": Workload(("--num-requests", "128", "--concurrency", "64", "--input-len", "512", "--output-len", "256"),
                    "output_throughput", 10_000),
    "c256": Workload(("--num-requests", "512", "--concurrency", "256", "--input-len", "512", "--output-len", "256"),
                     "output_throughput", 20_000),
    "prefill": Workload(("--num-requests", "256", "--concurrency", "64", "--input-len", "2048", "--output-len", "1"),
                        "input_throughput", 250_000),
    "prefix": Workload(("--dataset", "shared-prefix", "--num-groups", "8", "--prefix-len", "4000", "--suffix-len",
                        "100", "--num-requests", "256", "--concurrency", "64", "--output-len", "64"),
                       "input_throughput", 150_000),
}


def run_workload(name: str, workload: Workload, base_url: str, out: Path, *extra: str,
                 time_limit_s: float | None = None) -> dict:
    """`mili bench serve` as a user runs it (with `extra` flags), stopped after `time_limit_s`; -> the summary of
    its JSON result."""
    argv = [sys.executable, "-m", "mili_openai", "bench", "serve", "--base-url", base_url, "--ignore-eos",
            "--warmup", "2", "--no-progress", "--timeout", str(REQUEST_TIMEOUT_S), "--json", str(out),
            *workload.flags, *extra]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT, timeout=time_limit_s)
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"bench serve {name} stopped at the deadline, after {time_limit_s:.0f} s") from error
    print(result.stdout, flush=True)
    if result.returncode != 0:
        raise RuntimeError(f"bench serve {name} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    summary = json.loads(out.read_text())["summary"]
    summary["tpot_p50_ms"] = summary["tpot"]["p50_ms"]
    return summary


class Checkpoints:
    """The random checkpoints (and adapters) a plan serves, built into the out dir once: the Qwen3 one at once, the
    Qwen3.5 one and the adapters on a background thread (started here) while the first configurations run."""

    def __init__(self, out_dir: Path, qwen3: Path | None, configs: list[ServerConfig]):
        self.paths = {QWEN3: qwen3 or ensure_checkpoint(out_dir / "qwen3-0.6b-random", CHECKPOINT_SEED)}
        self.adapters: list[tuple[str, Path]] = []
        wanted_qwen35 = any(config.model == QWEN35 for config in configs)
        wanted_lora = any(config.lora for config in configs)
        self._rest: Future = ThreadPoolExecutor(1).submit(self._build_rest, out_dir, wanted_qwen35, wanted_lora)

    def _build_rest(self, out_dir: Path, qwen35: bool, lora: bool) -> None:
        if qwen35:
            self.paths[QWEN35] = ensure_checkpoint(out_dir / "qwen3.5-0.8b-random", CHECKPOINT_SEED, QWEN35)
        if lora:  # written once: the first run's adapters are the later runs' too
            directory = out_dir / "lora-adapters"
            self.adapters = write_adapters(self.paths[QWEN3], directory, LORA_ADAPTERS, LORA_RANK, DEFAULT_TARGETS,
                                           CHECKPOINT_SEED, torch.bfloat16, skip_existing=True)

    def for_config(self, config: ServerConfig) -> tuple[Path, tuple[str, ...], tuple[str, ...]]:
        """(checkpoint, the config's `mili serve` flags, extra `mili bench serve` flags); waits for the background
        builds where the config needs them."""
        if config.model != QWEN3 or config.lora:
            self._rest.result()
        if not config.lora:
            return self.paths[config.model], config.flags, ()
        modules = tuple(f"{name}={path}" for name, path in self.adapters)
        return (self.paths[config.model], (*config.flags, "--enable-lora", "--lora-modules", *modules),
                ("--models", ",".join(name for name, _ in self.adapters)))


def serve(checkpoint: Path, flags: tuple[str, ...], log: Path) -> tuple[ServerProcess, str]:
    port = free_port()
    base_url = f"http://{LOCALHOST}:{port}"
    argv = (sys.executable, "-m", "mili_openai", "serve", str(checkpoint), "--device", "cuda", "--host", LOCALHOST,
            "--port", str(port), *flags)
    return ServerProcess(ServerSpec("mili", argv, base_url), log), base_url


def verdict(workload: Workload, value: float) -> str:
    met = value >= workload.target if workload.higher_is_better else value <= workload.target
    return "met" if met else "missed"


def parse_plan(items: list[str], default_workloads: list[str]) -> list[tuple[str, list[str]]]:
    """["issue", "torch:c64"] -> [("issue", every default workload), ("torch", ["c64"])]."""
    plan = []
    for item in items:
        config, _, names = item.partition(":")
        workloads = names.split(",") if names else default_workloads
        unknown = [name for name in (config, *workloads) if name not in CONFIGS and name not in WORKLOADS]
        if config not in CONFIGS or unknown:
            raise ValueError(f"unknown configuration or workload in {item!r}: choose from {list(CONFIGS)} "
                             f"and {list(WORKLOADS)}")
        plan.append((config, workloads))
    return plan


def parse_profile(item: str) -> tuple[str, str]:
    """"issue:c64" -> ("issue", "c64"): one configuration, one workload."""
    config, _, name = item.partition(":")
    if config not in CONFIGS or name not in WORKLOADS:
        raise ValueError(f"--profile takes CONFIG:WORKLOAD, one of each, from {list(CONFIGS)} and {list(WORKLOADS)}; "
                         f"got {item!r}")
    return config, name


def run_profile(config: str, name: str, checkpoints: Checkpoints, out_dir: Path) -> None:
    """One workload under the server's step profiler; prints the row (profiled) and the summary's head."""
    label = f"profile-{config}-{name}"
    profile_dir = out_dir / label
    checkpoint, flags, bench_flags = checkpoints.for_config(CONFIGS[config])
    flags = (*flags, "--torch-profiler-dir", str(profile_dir))
    server, base_url = serve(checkpoint, flags, out_dir / f"server-{label}.log")
    workload, out = WORKLOADS[name], out_dir / f"{label}.json"
    with server:
        started = server.wait_healthy(STARTUP_TIMEOUT_S)
        print(f"== {label}: healthy after {started:.1f} s (`mili serve CKPT --device cuda {' '.join(flags)}`)",
              flush=True)
        begun = time.monotonic()
        summary = run_workload(name, workload, base_url, out, "--profile", *bench_flags)
        print_row(f"{config} (profiled)", name, workload, summary, time.monotonic() - begun)
    written = Path(json.loads(out.read_text())["profile"]["summary"])
    shutil.copy(written, out_dir / f"{label}.summary.txt")  # beside the JSON results, whatever the dir's layout
    print(f"== {label}: trace and summary in {profile_dir}", flush=True)
    print("\n".join(written.read_text().splitlines()[:PROFILE_SUMMARY_LINES]), flush=True)


def print_row(config: str, name: str, workload: Workload, summary: dict | None, wall: float, note: str = "") -> None:
    bound = ">=" if workload.higher_is_better else "<="
    if summary is None:
        print(f"| {config} | {name} | {workload.metric} | - | {bound} {workload.target:,g} | failed: {note} | - | "
              f"{wall:.0f} |", flush=True)
        return
    value = summary[workload.metric]
    print(f"| {config} | {name} | {workload.metric} | {value:,.1f} | {bound} {workload.target:,g} | "
          f"{verdict(workload, value)} | {summary['failed']} | {wall:.0f} |", flush=True)


def run_config(config: str, workloads: list[str], checkpoints: Checkpoints, out_dir: Path, deadline: float) -> None:
    checkpoint, flags, bench_flags = checkpoints.for_config(CONFIGS[config])
    server, base_url = serve(checkpoint, flags, out_dir / f"server-{config}.log")
    with server:
        started = server.wait_healthy(STARTUP_TIMEOUT_S)
        print(f"== {config}: healthy after {started:.1f} s (`mili serve {checkpoint.name} --device cuda "
              f"{' '.join(flags)}`)", flush=True)
        for name in workloads:
            workload = WORKLOADS[name]
            if time.monotonic() > deadline:
                print_row(config, name, workload, None, 0.0, "skipped: past the deadline")
                continue
            begun = time.monotonic()
            try:
                summary = run_workload(name, workload, base_url, out_dir / f"{config}-{name}.json", *bench_flags,
                                       time_limit_s=max(1.0, deadline - begun) if deadline < float("inf") else None)
            except RuntimeError as error:
                print(error, flush=True)
                print_row(config, name, workload, None, time.monotonic() - begun, "see above")
                continue
            print_row(config, name, workload, summary, time.monotonic() - begun)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="bench-results/gpu", help="JSON results and server logs")
    parser.add_argument("--checkpoint", default=None,
                        help="the Qwen3 checkpoint dir (default: build a random 0.6B one)")
    parser.add_argument("--configs", nargs="+", default=None,
                        help=f"CONFIG or CONFIG:WORKLOAD,...; configurations {list(CONFIGS)} (default: issue "
                             "defaults, or none with --profile)")
    parser.add_argument("--profile", default=None, metavar="CONFIG:WORKLOAD",
                        help="then run one workload under the server's torch profiler and print its summary")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                        help="the workloads of a configuration named without its own list")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start nothing new after this many seconds, and stop a workload still running then")
    args = parser.parse_args()
    configs = args.configs if args.configs is not None else ([] if args.profile else ["issue", "defaults"])
    try:
        plan = parse_plan(configs, args.workloads)
        profiled = parse_profile(args.profile) if args.profile else None
    except ValueError as error:
        parser.error(str(error))
    if not torch.cuda.is_available():
        parser.error("torch sees no CUDA device: this benchmark measures the GPU path")
    # stopped by a deadline (`timeout`), still stop the server: it runs in a session of its own
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"{parser.prog}: terminated"))
    begun = time.monotonic()
    deadline = begun + args.deadline_s if args.deadline_s else float("inf")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    served = [CONFIGS[config] for config, _ in plan] + ([CONFIGS[profiled[0]]] if profiled else [])
    checkpoints = Checkpoints(out_dir, Path(args.checkpoint) if args.checkpoint else None, served)
    print(f"## mili on {torch.cuda.get_device_name()}, random Qwen3-0.6B-shaped (or Qwen3.5-0.8B) bf16 checkpoints, "
          "`mili bench serve --ignore-eos`\n\n| config | workload | metric | value | target | | failed | wall s |\n"
          "|---|---|---|---|---|---|---|---|", flush=True)
    for config, workloads in plan:
        if time.monotonic() + MIN_CONFIG_S > deadline:
            print(f"== {config}: skipped, too close to the deadline", flush=True)
            continue
        try:
            run_config(config, workloads, checkpoints, out_dir, deadline)
        except Exception as error:  # noqa: BLE001 -- a server or build that fails must not stop the other configs
            print(f"== {config}: failed: {error!r} (server log: {out_dir / f'server-{config}.log'})", flush=True)
    if profiled is not None:
        if time.monotonic() + MIN_CONFIG_S > deadline:
            print(f"== profile {args.profile}: skipped, too close to the deadline", flush=True)
            return 0
        try:
            run_profile(*profiled, checkpoints, out_dir)
        except Exception as error:  # noqa: BLE001 -- as above
            print(f"== profile {args.profile}: failed: {error!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
