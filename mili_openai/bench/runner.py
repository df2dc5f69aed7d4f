"""Drives a run: build the workload, warm up, send the measured requests (arrivals + concurrency cap; for
multi-turn, conversations whose turns follow one another), collect per-request results and summarise them.

Arrivals follow a Poisson process at `request_rate` (exponential gaps from a seeded RNG, so a rerun sends
the same schedule), or with `burstiness` other than 1 vLLM's gamma process at the same mean rate;
`concurrency` caps how many are in flight, later arrivals wait for a free slot. Progress shows as a
one-line bar on stderr, redrawn in place, and only on a terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from http import HTTPStatus
from typing import Any, TextIO

import aiohttp
import orjson

from mili_openai.bench.config import MULTI_TURN, BenchConfig
from mili_openai.bench.datasets import BenchRequest, Conversation, build_workload
from mili_openai.bench.prompt_tokens import TokenPrompt, load_tokenizer
from mili_openai.bench.server_metrics import scrape_snapshot_memory
from mili_openai.bench.sse_client import RequestResult, request_body, request_headers, stream_request
from mili_openai.bench.spec_metrics import acceptance_by_position, scrape_per_position
from mili_openai.bench.summary import BenchSummary, summarize

MODELS_PATH = "/v1/models"
START_PROFILE_PATH, STOP_PROFILE_PATH = "/start_profile", "/stop_profile"  # vLLM's routes (--profile)
# Longest SSE line the client reads (aiohttp's default is 64 KiB): an event with logprobs or an echoed
# long prompt can be larger.
MAX_LINE_BYTES = 1 << 24
# Keep the arrival schedule's RNG apart from the prompt RNG (same --seed, different stream).
ARRIVAL_SEED_OFFSET = 7919
BAR_WIDTH = 30


@dataclass(frozen=True, slots=True)
class BenchRun:
    config: BenchConfig
    model: str  # the names requests sent, comma-separated where they were spread over several (`models`)
    started_at: str  # UTC, ISO 8601
    summary: BenchSummary
    results: list[RequestResult]
    warmup_failed: int
    profile: dict[str, Any] | None = None  # with --profile: what POST /stop_profile answered (the files' paths)
    # speculative decoding's drafts and acceptance per draft position over the run (bench/spec_metrics.py)
    acceptance: list[dict[str, Any]] | None = None
    # a hybrid model's prefix-cache state snapshots after the run, from mili's /metrics (bench/server_metrics.py)
    snapshot_memory: dict[str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config.to_json(),
            "model": self.model,
            "started_at": self.started_at,
            "warmup_failed": self.warmup_failed,
            "profile": self.profile,
            "speculative_acceptance_by_position": self.acceptance,
            "state_snapshot_memory": self.snapshot_memory,
            "summary": self.summary.to_json(),
            "requests": [r.to_json() for r in self.results],
        }


async def run_benchmark(config: BenchConfig, tokenizer=None) -> BenchRun:
    """Run the configured benchmark end to end; `tokenizer` (a `tokenizers.Tokenizer`) skips loading."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)
    warmup, measured = build_workload(config, tokenizer)  # before the clock: tokenising is not serving
    # no cap on connections (the concurrency cap is ours); per-read timeouts, the whole stream's is ours
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.timeout_s, sock_read=config.timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                     read_bufsize=MAX_LINE_BYTES) as client:
        models = config.models or (config.model or await first_model_id(client, config),)
        warmup_failed = 0
        if warmup:
            warmup_results = await send_all(client, config, models, warmup, "warmup", rate=math.inf)
            warmup_failed = sum(not r.success for r in warmup_results)
        if config.profile:
            await post_profile(client, config, START_PROFILE_PATH)
        counters_before = await scrape_per_position(client, config.base_url, request_headers(config))
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        started = time.perf_counter()
        if config.dataset == MULTI_TURN:
            results = await send_conversations(client, config, models, measured, tokenizer, "bench")
        else:
            results = await send_all(client, config, models, measured, "bench", rate=config.request_rate)
        duration = time.perf_counter() - started
        profile = await post_profile(client, config, STOP_PROFILE_PATH) if config.profile else None
        counters_after = await scrape_per_position(client, config.base_url, request_headers(config))
        snapshots = await scrape_snapshot_memory(client, config.base_url, request_headers(config))
    summary = summarize(results, duration, config.max_error_messages, config.goodput_slos, config.metric_percentiles)
    return BenchRun(config=config, model=",".join(models), started_at=started_at, summary=summary, results=results,
                    warmup_failed=warmup_failed, profile=profile,
                    acceptance=acceptance_by_position(counters_before, counters_after), snapshot_memory=snapshots)


async def post_profile(client: aiohttp.ClientSession, config: BenchConfig, path: str) -> dict[str, Any]:
    """POST the server's start or stop profile route; its JSON answer, or ValueError with what it said."""
    url = config.base_url.rstrip("/") + path
    async with client.post(url, headers=request_headers(config)) as response:
        text = await response.text()
        if response.status != HTTPStatus.OK:
            raise ValueError(f"POST {url} answered {response.status}: {text[:300]}")
    return orjson.loads(text)


async def first_model_id(client: aiohttp.ClientSession, config: BenchConfig) -> str:
    url = config.base_url.rstrip("/") + MODELS_PATH
    async with client.get(url, headers=request_headers(config)) as response:
        if response.status != HTTPStatus.OK:
            raise ValueError(f"GET {url} answered {response.status}: {(await response.text())[:200]}")
        models = (await response.json(content_type=None)).get("data") or []
    if not models:
        raise ValueError(f"GET {url} lists no model; pass --model")
    return models[0]["id"]


class RequestSender:
    """Sends requests under the run's concurrency cap (later ones wait for a free slot), each timed from the
    sender's creation, its progress on the bar."""

    def __init__(self, client: aiohttp.ClientSession, config: BenchConfig, total: int, label: str) -> None:
        self.client, self.config = client, config
        self.slots = asyncio.Semaphore(config.concurrency) if config.concurrency is not None else None
        self.progress = ProgressBar(total, label, enabled=config.progress)
        self.headers = request_headers(config)
        self.origin = time.perf_counter()

    async def wait_until(self, arrival_s: float) -> None:
        await asyncio.sleep(max(0.0, arrival_s - (time.perf_counter() - self.origin)))

    async def send(self, request: BenchRequest, model: str) -> RequestResult:
        async with self.slots if self.slots is not None else contextlib.nullcontext():
            sent_s = time.perf_counter() - self.origin
            result = await stream_request(self.client, self.config.url,
                                          request_body(self.config, model, request), self.headers,
                                          request.prompt_len, self.config.timeout_s)
        result.start_s, result.turn = sent_s, request.turn
        self.progress.advance(result.success)
        return result


async def send_all(client: aiohttp.ClientSession, config: BenchConfig, models: tuple[str, ...],
                   requests: list[BenchRequest], label: str, rate: float) -> list[RequestResult]:
    """Send every request on its arrival time, at most `config.concurrency` in flight, request i naming
    models[i % len(models)]; results in order."""
    sender = RequestSender(client, config, len(requests), label)

    async def send_one(request: BenchRequest, arrival_s: float, model: str) -> RequestResult:
        await sender.wait_until(arrival_s)
        return await sender.send(request, model)

    arrivals = arrival_times(len(requests), rate, config.seed + ARRIVAL_SEED_OFFSET, config.burstiness)
    try:
        return list(await asyncio.gather(*(send_one(request, arrival, models[index % len(models)])
                                           for index, (request, arrival) in enumerate(zip(requests, arrivals)))))
    finally:
        sender.progress.close()


async def send_conversations(client: aiohttp.ClientSession, config: BenchConfig, models: tuple[str, ...],
                             conversations: list[Conversation], tokenizer, label: str) -> list[RequestResult]:
    """Run the conversations at once (each from its arrival time, under the concurrency cap), each one's turns in
    order: a turn resends the history with the server's own replies. A failed turn ends its conversation (there
    is no reply to resend). Conversation i names models[i % len(models)]. Results conversation by conversation,
    turns in order."""
    sender = RequestSender(client, config, sum(len(c.messages) for c in conversations), label)

    async def converse(conversation: Conversation, arrival_s: float, model: str) -> list[RequestResult]:
        await sender.wait_until(arrival_s)
        results: list[RequestResult] = []
        history: tuple[tuple[TokenPrompt, TokenPrompt], ...] = ()
        for turn, message in enumerate(conversation.messages, start=1):
            result = await sender.send(BenchRequest(body=message, output_len=conversation.output_len,
                                                    history=history, turn=turn), model)
            results.append(result)
            if not result.success:
                break
            reply_ids = tokenizer.encode(result.text, add_special_tokens=False).ids
            history = (*history, (message, TokenPrompt(text=result.text, token_ids=tuple(reply_ids))))
        return results

    arrivals = arrival_times(len(conversations), config.request_rate, config.seed + ARRIVAL_SEED_OFFSET,
                             config.burstiness)
    try:
        per_conversation = await asyncio.gather(*(converse(conversation, arrival, models[index % len(models)])
                                                  for index, (conversation, arrival)
                                                  in enumerate(zip(conversations, arrivals))))
    finally:
        sender.progress.close()
    return [result for results in per_conversation for result in results]


def arrival_times(num_requests: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send offsets (s), first at 0; all zero for an infinite rate. The gaps are gamma-distributed with
    shape `burstiness` and mean 1 / `rate` (vLLM's arrivals): exponential, a Poisson process, at 1; their
    coefficient of variation is 1 / sqrt(burstiness), so below 1 requests come in bursts."""
    if not rate > 0:
        raise ValueError("rate must be > 0")
    if not burstiness > 0:
        raise ValueError("burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        # expovariate at 1 keeps a Poisson schedule the same as before burstiness existed
        now += rng.expovariate(rate) if burstiness == 1 else rng.gammavariate(burstiness, 1 / (rate * burstiness))
    return times


class ProgressBar:
    def __init__(self, total: int, label: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        # A redrawn line in a log file or a pipe is just noise: draw only on a terminal.
        self.enabled = enabled and self.stream.isatty()
        self.total = total
        self.label = label
        self.done = 0
        self.failed = 0
        self.started = time.perf_counter()

    def advance(self, success: bool) -> None:
        self.done += 1
        self.failed += 0 if success else 1
        self._draw()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        if not self.enabled:
            return
        filled = BAR_WIDTH * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        elapsed = time.perf_counter() - self.started
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} "
                          f"failed={self.failed} {elapsed:.1f}s")
        self.stream.flush()
