"""Bounded soak test of a real `mili serve` process: mixed traffic, a burst, a 32K prompt, then leak checks.

    .venv/bin/python scripts/soak.py                 # the tiny random checkpoint, built in a temp dir
    .venv/bin/python scripts/soak.py --model DIR     # any local checkpoint

Each of `--rounds` identical rounds sends `--requests` mixed requests (`--concurrency` at a time:
completions and chat, streaming and not, n>1, shared prefixes, /generate, clients that hang up
mid-stream, bad inputs that must get a 4xx), then `--burst` concurrent streams, then one prompt of
`--long-prompt-tokens` tokens. After each round it waits for the engine to go idle and reads
`GET /debug/engine`: nothing running or waiting, no page locked or owned, free + cached == total, the
radix tree's integrity check clean. It compares the server's RSS after the last round with the
first (same traffic, so memory must stay flat), then sends SIGTERM and expects exit code 0.
Prints a JSON report; exits 1 if any check failed. Bounded by `--deadline-s`. Not part of pytest.
A request lost to a transport error (the connection dropped: httpx.ReadError, RemoteProtocolError...) is
a failed request in the report, its status the error's name; it never ends the soak without a verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable
from pathlib import Path

import httpx
import orjson

MODEL_NAME = "soak"
SHARED_PREFIX = "You are a careful assistant. Answer briefly and precisely. " * 6  # several KV pages
VOCAB_SAFE_IDS = (1000, 60000)  # plain BPE tokens of the Qwen3 vocabulary, far from special ones
START_TIMEOUT_S = 600.0  # a first start JIT-builds the CPU kernels: ~5 min on 2 cores
IDLE_TIMEOUT_S = 60.0
POLL_S = 0.2
REQUEST_TIMEOUT_S = 600.0
RSS_TOLERANCE_BYTES = 64 * 1024 * 1024  # allocator noise on a process of a few hundred MB
RSS_TOLERANCE_RATIO = 0.05
EXIT_TIMEOUT_S = 60.0
BAD_REQUESTS = (  # (path, raw body): each must be a 4xx
    ("/v1/completions", b'{"model": "soak", "prompt": "x", "max_tokens": -1}'),
    ("/v1/completions", b'{"model": "no-such-model", "prompt": "x"}'),
    ("/v1/completions", b'{"model": "soak", "prompt": "x", "n": 0}'),
    ("/v1/completions", b'{"model": "soak", "prompt": '),
    ("/v1/chat/completions", b'{"model": "soak", "messages": []}'),
    ("/v1/completions", b'{"model": "soak", "prompt": [999999999]}'),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random Qwen3)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=300, help="mixed requests per round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--burst", type=int, default=256, help="concurrent streams per round")
    parser.add_argument("--long-prompt-tokens", type=int, default=32768)
    parser.add_argument("--max-model-len", type=int, default=33000)
    parser.add_argument("--num-pages", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=24, help="output tokens of the mixed requests")
    parser.add_argument("--deadline-s", type=float, default=1800.0, help="the whole soak stops after this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="of the mixed requests (0: greedy, whose loops on a random model make drafts)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `mili serve` argument, e.g. --serve-arg=--speculative-config=JSON (repeat)")
    return parser.parse_args(argv)


# ---- the server process ----
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_checkpoint(directory: Path) -> Path:
    import torch

    from mili_openai.model.checkpoint import TINY_SHAPE, build_random_checkpoint

    return build_random_checkpoint(directory, TINY_SHAPE, seed=0, dtype=torch.float32)


def start_server(args: argparse.Namespace, model: Path, port: int, log_path: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "mili_openai", "serve", str(model), "--port", str(port),
               "--served-model-name", MODEL_NAME, "--dtype", args.dtype, "--num-pages", str(args.num_pages),
               "--max-model-len", str(args.max_model_len), "--debug-endpoints", "--log-level", "warning",
               "--shutdown-grace-period", "10", *args.serve_arg]
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc status")


async def wait_healthy(client: httpx.AsyncClient, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        with contextlib.suppress(httpx.TransportError):
            if (await client.get("/health")).status_code == 200:
                return
        await asyncio.sleep(POLL_S)
    raise RuntimeError("the server never became healthy")


# ---- one request of each kind: returns (kind, ok, status) ----
async def outcome(kind: str, request: Awaitable[tuple[bool, int]]) -> tuple[str, bool, int | str]:
    """(kind, ok, status) of one request; a transport error fails it, with the error's name as its status."""
    try:
        return (kind, *await request)
    except httpx.TransportError as exc:
        return kind, False, type(exc).__name__


async def stream_ok(client: httpx.AsyncClient, path: str, body: dict, hang_up: bool = False) -> tuple[bool, int]:
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return False, response.status_code
        events = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if hang_up:
                    return True, 200  # one event arrived: leave, the server must abort the rest
    if not events or events[-1] != "[DONE]":
        return False, 200
    chunks = [orjson.loads(e) for e in events[:-1]]
    finishes = [c["finish_reason"] for chunk in chunks for c in chunk.get("choices", []) if c.get("finish_reason")]
    return bool(finishes) and not any("error" in chunk for chunk in chunks), 200


async def plain_ok(client: httpx.AsyncClient, path: str, body: dict) -> tuple[bool, int]:
    response = await client.post(path, json=body)
    if response.status_code != 200:
        return False, response.status_code
    data = response.json()
    choices = data.get("choices", [data])
    return all(c.get("finish_reason") in ("length", "stop") for c in choices), 200


async def one_request(client: httpx.AsyncClient, index: int, args: argparse.Namespace) -> tuple[str, bool, int | str]:
    kind, max_tokens = index % 9, args.max_tokens
    rng = random.Random(f"{args.seed}-{index}")  # the same request in every round, whatever the interleaving
    sampling = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": args.temperature, "seed": index,
                "ignore_eos": True}
    prompt = f"Request {index}: tell me about number {rng.randrange(10**6)}."
    messages = [{"role": "user", "content": prompt}]
    if kind == 0:
        return await outcome("completion", plain_ok(client, "/v1/completions", {**sampling, "prompt": prompt}))
    if kind == 1:
        return await outcome("completion_stream", stream_ok(client, "/v1/completions",
                                                            {**sampling, "prompt": prompt, "stream": True}))
    if kind == 2:
        return await outcome("completion_n3", plain_ok(client, "/v1/completions",
                                                       {**sampling, "prompt": prompt, "n": 3}))
    if kind == 3:
        return await outcome("shared_prefix", plain_ok(client, "/v1/completions",
                                                       {**sampling, "prompt": SHARED_PREFIX + prompt}))
    if kind == 4:
        return await outcome("chat", plain_ok(client, "/v1/chat/completions", {**sampling, "messages": messages}))
    if kind == 5:
        return await outcome("chat_stream_n2", stream_ok(client, "/v1/chat/completions",
                                                         {**sampling, "messages": messages, "stream": True, "n": 2}))
    if kind == 6:
        return await outcome("generate", plain_ok(client, "/generate", {**sampling, "prompt": prompt}))
    if kind == 7:
        body = {**sampling, "prompt": SHARED_PREFIX + prompt, "stream": True, "max_tokens": max_tokens * 8}
        return await outcome("hang_up", stream_ok(client, "/v1/completions", body, hang_up=True))
    return await outcome("bad_input", bad_input_ok(client, *BAD_REQUESTS[index // 9 % len(BAD_REQUESTS)]))


async def bad_input_ok(client: httpx.AsyncClient, path: str, raw: bytes) -> tuple[bool, int]:
    response = await client.post(path, content=raw, headers={"content-type": "application/json"})
    return 400 <= response.status_code < 500, response.status_code


# ---- a round ----
async def run_round(client: httpx.AsyncClient, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)  # every round sends the same traffic
    limit = asyncio.Semaphore(args.concurrency)

    async def limited(index: int):
        async with limit:
            return await one_request(client, index, args)

    started = time.monotonic()
    mixed = await asyncio.gather(*(limited(i) for i in range(args.requests)))
    mixed_s = time.monotonic() - started
    burst_body = {"model": MODEL_NAME, "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True}
    started = time.monotonic()
    burst = await asyncio.gather(*(outcome("burst_stream", stream_ok(client, "/v1/completions",
                                                                     {**burst_body, "prompt": f"burst {i}"}))
                                   for i in range(args.burst)))
    burst_s = time.monotonic() - started
    long_ids = [rng.randrange(*VOCAB_SAFE_IDS) for _ in range(args.long_prompt_tokens)]
    started = time.monotonic()
    long_prompt = await outcome("long_prompt", plain_ok(client, "/v1/completions",
                                                        {"model": MODEL_NAME, "prompt": long_ids, "max_tokens": 4}))
    long_s = time.monotonic() - started
    outcomes = [*mixed, *burst, long_prompt]
    return {
        "requests": len(outcomes),
        "failed": Counter(kind for kind, ok, _ in outcomes if not ok),
        "statuses": Counter(str(status) for _, _, status in outcomes),
        "by_kind": Counter(kind for kind, _, _ in outcomes),
        "mixed_s": round(mixed_s, 1), "burst_s": round(burst_s, 1), "long_prompt_s": round(long_s, 1),
    }


async def wait_idle(client: httpx.AsyncClient) -> dict:
    """The engine's page accounting once nothing runs (aborted hang-ups take a step to land)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        try:
            state = (await client.get("/debug/engine")).json()
        except httpx.TransportError:  # a dropped connection: poll again (the deadline still bounds it)
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(POLL_S)
            continue
        stats, pages = state["stats"], state["pages"]
        idle = stats["num_running"] == stats["num_waiting"] == 0 and pages["num_sequences"] == 0
        if idle or time.monotonic() > deadline:
            return state
        await asyncio.sleep(POLL_S)


# engine totals after each round (drafts show what --serve-arg=--speculative-config=... exercised)
REPORTED_COUNTERS = ("generation_tokens_total", "num_preemptions_total", "spec_decode_num_draft_tokens_total",
                     "spec_decode_num_accepted_tokens_total")


def page_problems(state: dict) -> list[str]:
    pages, problems = state["pages"], []
    if state["stats"]["num_running"] or state["stats"]["num_waiting"]:
        problems.append(f"not idle: {state['stats']['num_running']} running, {state['stats']['num_waiting']} waiting")
    if pages["num_locked"] or pages["num_owned"]:
        problems.append(f"{pages['num_locked']} pages locked, {pages['num_owned']} owned after the load")
    if pages["num_free"] + pages["num_cached"] != pages["num_pages"]:
        problems.append(f"free {pages['num_free']} + cached {pages['num_cached']} != {pages['num_pages']}")
    if pages["integrity_error"]:
        problems.append(pages["integrity_error"])
    return problems


async def soak(args: argparse.Namespace, proc: subprocess.Popen, base_url: str) -> dict:
    limits = httpx.Limits(max_connections=args.burst + args.concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        await wait_healthy(client, proc)
        rss_start = rss_bytes(proc.pid)
        rounds = []
        for _ in range(args.rounds):
            result = await run_round(client, args)
            state = await wait_idle(client)
            result.update(pages=state["pages"], page_problems=page_problems(state), rss_bytes=rss_bytes(proc.pid),
                          counters={name: state["stats"][name] for name in REPORTED_COUNTERS})
            rounds.append(result)
    return {"rss_start_bytes": rss_start, "rounds": rounds}


def verdict(report: dict) -> list[str]:
    problems = []
    for number, result in enumerate(report["rounds"], 1):
        problems += [f"round {number}: {n} {kind} request(s) failed" for kind, n in result["failed"].items()]
        problems += [f"round {number}: {n} answer(s) with status {s}" for s, n in result["statuses"].items()
                     if s.startswith("5")]
        problems += [f"round {number}: {n} request(s) lost to {s}" for s, n in result["statuses"].items()
                     if not s.isdigit()]
        problems += [f"round {number}: {p}" for p in result["page_problems"]]
    first, last = report["rounds"][0]["rss_bytes"], report["rounds"][-1]["rss_bytes"]
    tolerance = max(RSS_TOLERANCE_BYTES, RSS_TOLERANCE_RATIO * first)
    if len(report["rounds"]) > 1 and last - first > tolerance:
        problems.append(f"RSS grew from {first} to {last} bytes between identical rounds")
    if report["server_log_tracebacks"]:
        problems.append(f"{report['server_log_tracebacks']} traceback(s) in the server log")
    if report["exit_code"] != 0:
        problems.append(f"the server exited with {report['exit_code']} after SIGTERM")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mili-soak-") as scratch:
        model = Path(args.model) if args.model else tiny_checkpoint(Path(scratch) / "tiny-qwen3")
        port, log_path = free_port(), Path(scratch) / "server.log"
        proc = start_server(args, model, port, log_path)
        started = time.monotonic()
        try:
            report = asyncio.run(asyncio.wait_for(soak(args, proc, f"http://127.0.0.1:{port}"), args.deadline_s))
            proc.send_signal(signal.SIGTERM)
            report["exit_code"] = proc.wait(timeout=EXIT_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        report["wall_s"] = round(time.monotonic() - started, 1)
        report["server_log_tracebacks"] = log_path.read_text().count("Traceback")
    report["problems"] = verdict(report)
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    print("SOAK PASSED" if not report["problems"] else "SOAK FAILED", file=sys.stderr)
    return 0 if not report["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
