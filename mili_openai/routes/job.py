"""Fan one prompt out into `n` engine sequences and merge their deltas back into choices.

The engine runs one sequence per request id; OpenAI's `n` (and a list of prompts) becomes several.
Sub-requests are `f"{request_id}-{i}"`, seeded `seed + i` when a seed is given so the samples differ
yet stay reproducible. Whoever stops consuming early (a client disconnect, an error, the request
timeout) leaves no orphan: every unfinished sub-request is aborted and its pages return to the pool.

Both ends also report to the current request's context (when there is one): submitting ends the
request's queue reservation, and every delta is tallied for the request's log line.
"""

from __future__ import annotations

import asyncio
import time
import dataclasses
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from mili_openai.engine.outputs import SequenceDelta, TokenLogprob
from mili_openai.engine.sampling_params import INT64_MAX, SamplingParams
from mili_openai.server.errors import INTERNAL_ERROR, APIError
from mili_openai.server.request_log import current_request


def sub_request_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of sample `index`: one sequence, its own seed when seeded."""
    seed = params.seed
    if seed is not None:
        seed = seed + index if seed + index <= INT64_MAX else seed - index  # stay inside int64
    return dataclasses.replace(params, n=1, seed=seed)


def submit_choices(engine: Any, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> list:
    """Submit `params.n` sequences now (so a bad request raises ValueError before any stream starts).

    If one submit fails, the ones already submitted are aborted before the error propagates.
    """
    streams: list = []
    try:
        for index in range(params.n):
            streams.append(engine.submit(prompt_token_ids, sub_request_params(params, index), f"{request_id}-{index}"))
    except BaseException:
        abort_streams(engine, streams)
        raise
    context = current_request()
    if context is not None:
        context.note_submitted(len(prompt_token_ids), [stream.request_id for stream in streams])
    return streams


def abort_streams(engine: Any, streams: Sequence) -> None:
    for stream in streams:
        engine.abort(stream.request_id)


async def merge_streams(
    engine: Any, streams: Sequence, timeout_s: float | None = None
) -> AsyncIterator[tuple[int, SequenceDelta]]:
    """Yield `(choice index, delta)` as the streams produce them, until each has finished once.

    Past `timeout_s` every unfinished stream is aborted (it ends with finish_reason "abort"). If the
    consumer stops early, or a stream fails, the unfinished streams are aborted.
    """
    queue: asyncio.Queue[tuple[int, SequenceDelta | BaseException]] = asyncio.Queue()

    async def pump(index: int, stream: Any) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((index, delta))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    unfinished = set(range(len(streams)))
    # The deadline is a timer that aborts what is left (each stream then ends with a final "abort"
    # delta), not asyncio.wait_for around queue.get(): on Python < 3.12 wait_for can swallow a
    # cancellation that lands as the get() completes, and a disconnected client's request would then
    # keep generating.
    timer = None
    if timeout_s is not None:
        timer = asyncio.get_running_loop().call_later(
            max(timeout_s, 0.0), lambda: abort_streams(engine, [streams[i] for i in unfinished])
        )
    context = current_request()
    try:
        while unfinished:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if context is not None:
                context.observe(item)
            if item.finish_reason is not None:
                unfinished.discard(index)
            yield index, item
    finally:
        if timer is not None:
            timer.cancel()
        abort_streams(engine, [streams[i] for i in unfinished])
        for task in tasks:
            task.cancel()


async def generate_choices(
    engine: Any, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
    timeout_s: float | None = None,
) -> AsyncIterator[tuple[int, SequenceDelta]]:
    """Submit `params.n` sequences and yield `(choice index, delta)` as they come."""
    streams = submit_choices(engine, prompt_token_ids, params, request_id)
    # aclosing: if our consumer closes us early, the inner generator's cleanup (the aborts) runs now
    async with aclosing(merge_streams(engine, streams, timeout_s)) as merged:
        async for item in merged:
            yield item


# ---- non-streaming ----
@dataclass(slots=True)
class ChoiceResult:
    """One finished choice: everything its deltas carried, concatenated."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # params.prompt_logprobs: per prompt token

    def add(self, delta: SequenceDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def usage_of(prompt_lengths: Sequence[int], cached: Sequence[int], completion_tokens: int) -> Usage:
    """Usage as OpenAI counts it: each prompt once (not once per sample), every generated token."""
    return Usage(sum(prompt_lengths), completion_tokens, sum(cached))


def raise_engine_error(delta: SequenceDelta) -> None:
    """An aborted delta carrying `error` means the engine failed the request: a 500, not bad input."""
    if delta.error is not None:
        raise APIError(500, delta.error, type=INTERNAL_ERROR)


async def collect_streams(
    engine: Any, streams: Sequence, timeout_s: float | None = None
) -> list[ChoiceResult]:
    """Run the streams to the end; one ChoiceResult per stream, in stream order."""
    results = [ChoiceResult(index) for index in range(len(streams))]
    async with aclosing(merge_streams(engine, streams, timeout_s)) as merged:
        async for index, delta in merged:
            raise_engine_error(delta)
            results[index].add(delta)
    return results


async def collect_choices(
    engine: Any, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
    timeout_s: float | None = None,
) -> tuple[list[ChoiceResult], Usage]:
    """Non-streaming generation of `params.n` choices: their results and the usage (with cached tokens)."""
    streams = submit_choices(engine, prompt_token_ids, params, request_id)
    results = await collect_streams(engine, streams, timeout_s)
    usage = usage_of([len(prompt_token_ids)], [results[0].num_cached_tokens],
                     sum(len(r.token_ids) for r in results))
    return results, usage


class GenerationJob:
    """One validated request bound to the engine: its identity on the wire and its submitted streams.

    The chat and completions routes subclass it with their prompt handling and response shapes.
    """

    id_prefix = "gen"  # response ids read f"{id_prefix}-{request id}", as OpenAI's do

    def __init__(self, server: Any, body: Any, request_id: str) -> None:
        self.server = server
        self.body = body
        self.engine = server.engine
        self.response_id = f"{self.id_prefix}-{request_id}"
        self.created = int(time.time())
        self.model = server.served_model_name
        self.streams: list = []

    def abort(self) -> None:
        """Free whatever the request still holds; a no-op for finished sequences."""
        abort_streams(self.engine, self.streams)
