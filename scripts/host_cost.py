"""Host CPU per output token of `mili serve`, split by thread: the event loop's apart from the forward's.

Starts `mili serve` (default: the small embedded model, `--max-num-seqs 256`) from each checkout given,
then drives streaming `bench serve` workloads (512 prompt / 256 output tokens, `--ignore-eos`) at each
concurrency, the checkouts taking turns round by round. Around every run it reads the CPU time (user +
system) of each of the server's threads from /proc/<pid>/task/<tid>/stat. The event loop is the main
thread (uvicorn runs it there); every other thread is the forward's (its worker thread and torch's OpenMP
team). The event loop's CPU per output token is the host cost a GPU does not take away: at high
concurrency on a GPU it sets the pace (docs/performance.md, "CUDA under load").

    .venv/bin/python scripts/host_cost.py                                  # this checkout
    .venv/bin/python scripts/host_cost.py --checkout old=/tmp/main --checkout new=.   # A/B, alternating
    .venv/bin/python scripts/host_cost.py --concurrency 64 --rounds 1 --num-requests 128
    .venv/bin/python scripts/host_cost.py --endpoint chat --extra-body '{"logprobs": true, "top_logprobs": 5}'

While a run is in flight, `perf record -t PID` (the printed PID is the loop thread's id too) shows where its
CPU goes by native symbol; py-spy samples wall time, and on a loaded machine charges the socket writes (where
the woken client preempts the loop) far more than their CPU. `py-spy record --gil --threads --pid PID` keeps only
the samples where a thread holds the GIL: for the loop thread, close to its CPU by Python function.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("mili_openai") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from mili_openai.bench.config import ENDPOINTS, BenchConfig  # noqa: E402
from mili_openai.bench.prompt_tokens import load_tokenizer  # noqa: E402
from mili_openai.bench.runner import run_benchmark  # noqa: E402
from mili_openai.bench.server_process import LOCALHOST, ServerProcess, ServerSpec, free_port  # noqa: E402
from mili_openai.model.checkpoint import TINY_SHAPE, build_random_checkpoint  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STAT_UTIME_FIELD = 13  # utime, then stime: fields 14 and 15 of /proc/.../stat (1-based), after the name
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 1800.0
US_PER_S = 1e6


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of every live thread of `pid`, by thread id. Only the sum is read: the
    kernel keeps each part monotonic by scaling both from tick samples, so over a short run one part can
    stand still while the other takes all of it."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended while we listed them
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces: cut after it
        times[int(task.name)] = (int(fields[STAT_UTIME_FIELD - 2]) + int(fields[STAT_UTIME_FIELD - 1])) / CLOCK_TICKS
    return times


@dataclass(frozen=True, slots=True)
class HostCost:
    checkout: str
    concurrency: int
    output_tokens: int
    output_throughput: float
    loop_us_per_token: float  # the main thread: asyncio loop, engine bookkeeping, HTTP, SSE
    forward_us_per_token: float  # every other thread: the forward's worker and torch's threads
    load: float  # the 1-minute load average at the end of the run (other jobs share the cores)


def measure(name: str, pid: int, bench: BenchConfig, tokenizer) -> HostCost:
    before = thread_cpu_s(pid)
    run = asyncio.run(run_benchmark(bench, tokenizer))
    after = thread_cpu_s(pid)
    if run.summary.failed:
        raise RuntimeError(f"{name}: {run.summary.failed} requests failed")
    spent = {tid: seconds - before.get(tid, 0.0) for tid, seconds in after.items()}
    loop_s = spent.pop(pid)
    tokens = run.summary.total_output_tokens
    return HostCost(name, bench.concurrency, tokens, run.summary.output_throughput,
                    loop_s / tokens * US_PER_S, sum(spent.values()) / tokens * US_PER_S, os.getloadavg()[0])


def server_spec(name: str, checkout: str, args: argparse.Namespace) -> ServerSpec:
    port = free_port()
    argv = [sys.executable, "-m", "mili_openai", "serve", *([args.model] if args.model else []),
            "--host", LOCALHOST, "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
            "--served-model-name", "bench", *args.serve_args]
    return ServerSpec(name=name, argv=tuple(argv), base_url=f"http://{LOCALHOST}:{port}",
                      env={"PYTHONPATH": os.pathsep.join(str(Path(part).resolve()) for part in checkout.split(os.pathsep))})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR",
                        help="serve from this source tree (repeatable; default: this checkout); DIR may be a PYTHONPATH")
    parser.add_argument("--model", default=None, help="checkpoint (default: mili's embedded model)")
    parser.add_argument("--tiny", action="store_true",
                        help="a random checkpoint of the tests' tiny shape (Qwen3's vocabulary): the forward costs"
                             " least, so runs are short")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="more `mili serve` flags")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="completions")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--num-requests", type=int, default=None, help="per run (default: the concurrency, one wave)")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--extra-body", default=None,
                        help="JSON object merged into every request body, e.g. '{\"logprobs\": 5}'")
    parser.add_argument("--rounds", type=int, default=3, help="runs per checkout and concurrency, alternating")
    parser.add_argument("--log-dir", default="bench-results/host-cost")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    checkouts = [tuple(entry.split("=", 1)) for entry in args.checkout] or [("this", str(REPO_ROOT))]
    tokenizer = load_tokenizer(None)
    if args.tiny:
        args.model = str(build_random_checkpoint(Path(args.log_dir) / "tiny-checkpoint", TINY_SHAPE, seed=0))
    servers = [ServerProcess(server_spec(name, path, args), Path(args.log_dir) / f"{name}.log")
               for name, path in checkouts]
    results: list[HostCost] = []
    try:
        for server in servers:
            server.start()
            server.wait_healthy(STARTUP_TIMEOUT_S)
            print(f"{server.spec.name}: pid {server.process.pid}", flush=True)
        for round_index in range(args.rounds):
            for concurrency in args.concurrency:
                for server in servers:
                    bench = BenchConfig(
                        base_url=server.spec.base_url, model="bench", endpoint=args.endpoint, num_requests=args.num_requests or concurrency,
                        concurrency=concurrency, input_len=args.input_len, output_len=args.output_len,
                        ignore_eos=True, timeout_s=REQUEST_TIMEOUT_S, warmup=0, progress=False,
                        seed=round_index, extra_body=args.extra_body)
                    cost = measure(server.spec.name, server.process.pid, bench, tokenizer)
                    results.append(cost)
                    print(f"round {round_index + 1} c{concurrency:<4} {cost.checkout:>8}: loop {cost.loop_us_per_token:6.1f}"
                          f" us/token, forward {cost.forward_us_per_token:7.1f} us/token, {cost.output_throughput:7.1f}"
                          f" out tok/s, {cost.output_tokens} tokens, load {cost.load:.1f}", flush=True)
    finally:
        for server in servers:
            server.stop()
    print("\nmedian event-loop CPU per output token (us), by concurrency:")
    for concurrency in args.concurrency:
        row = [f"c{concurrency}"]
        for name, _ in checkouts:
            values = [r.loop_us_per_token for r in results if r.checkout == name and r.concurrency == concurrency]
            row.append(f"{name} {statistics.median(values):.1f} (" + ", ".join(f"{v:.1f}" for v in values) + ")")
        print("  " + " | ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
