"""One generation request's life on the server, shared by /v1/chat/completions, /v1/completions and
/generate: validate, submit every prompt to the engine, then stream SSE events or answer one JSON body.

`serve_job` is the one handler all three run. A `GenerationJob` subclass says how its request becomes
prompts and `SamplingParams` (`submit`) and how the engine's deltas become its wire shapes (`collect`
for one JSON body, `events` for a stream). The engine fans each prompt out into its n samples
(engine/parallel_sampling.py); a request with several prompts (/v1/completions) becomes one engine
request per prompt, merged here into one stream of `(choice, delta)`, choice = prompt * n + sample.

Every prompt is checked (`check_request`, the one check a request gets) and submitted before the response
starts, so a bad request is a plain 400 and never a broken stream. Whoever stops consuming early (a client
disconnect, an error, the request timeout) leaves no orphan: every unfinished engine request is aborted and
its pages return to the pool. The current request's context hears of both ends: submitting ends its queue
reservation, and every delta is tallied once (`RequestTally`), for the usage and the request's log line.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from mili_openai.engine.client import EngineClient, RequestStream
from mili_openai.engine.contract import check_request
from mili_openai.engine.image_inputs import ImageFeatures
from mili_openai.engine.outputs import RequestOutput, SequenceDelta
from mili_openai.engine.sampling_params import SamplingParams
from mili_openai.protocol.errors import INTERNAL_ERROR, APIError
from mili_openai.protocol.sampling import SamplingFields
from mili_openai.server.errors import cancel_on_disconnect, json_response, parse_body
from mili_openai.server.request_log import RequestTally, current_request
from mili_openai.server.sse import sse_stream
from mili_openai.server.state import ServerState, request_id_of, server_state

BodyT = TypeVar("BodyT", bound=SamplingFields)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class GenerationJob(ABC, Generic[BodyT]):
    """One validated request bound to the engine: its identity on the wire, its prompts and streams."""

    id_prefix = "gen"  # response ids read f"{id_prefix}-{request id}", as OpenAI's do
    sse_event_names = False  # whether each SSE event carries an `event:` line with its "type" (Responses API)

    def __init__(self, server: ServerState, body: BodyT, request_id: str) -> None:
        self.server = server
        self.body = body
        self.engine: EngineClient = server.require_engine()
        self.response_id = f"{self.id_prefix}-{request_id}"
        self.created = int(time.time())
        self.model = server.served_model_name  # what responses name: the LoRA adapter's name where one runs
        self.lora_name: str | None = None  # set by `serve_job` from the request's `model`
        self.num_samples = 1  # per prompt: set by `submit_prompts`
        self.prompt_ids: list[list[int]] = []
        self.streams: list[RequestStream] = []
        context = current_request()  # the usage and the request's log line read one tally
        self.tally = context.tally if context is not None else RequestTally()

    @property
    def num_sequences(self) -> int:
        """The engine sequences this request will queue (what `check_queue` reserves)."""
        return self.body.n

    # ---- what a route defines ----
    @abstractmethod
    async def submit(self) -> None:
        """Build the prompts and parameters, then `submit_prompts` (raises for a request that cannot run)."""

    @abstractmethod
    async def collect(self) -> dict[str, Any]:
        """Run to the end: the whole response body."""

    @abstractmethod
    def events(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's events, in order (the SSE layer adds [DONE])."""

    # ---- shared ----
    async def submit_prompts(self, prompts: list[list[int]], params: SamplingParams,
                             prompt_field: str | None = None, images: list[ImageFeatures] | None = None) -> None:
        """One engine request per prompt, each of `params.n` samples; all or nothing. `prompt_field`: what the
        request calls its prompt, for the errors to name (see `check_request`); `images`: a single prompt's."""
        info = self.engine.info
        requests = [check_request(prompt, params, info, prompt_field, images, lora_name=self.lora_name)
                    for prompt in prompts]
        self.prompt_ids, self.num_samples = prompts, params.n
        try:
            for index, request in enumerate(requests):
                request_id = self.response_id if len(prompts) == 1 else f"{self.response_id}-{index}"
                self.streams.append(await self.engine.submit(request, request_id))
        except BaseException:
            self.abort()
            raise
        request_ids = [stream.request_id for stream in self.streams]
        context = current_request()
        if context is not None:
            context.note_submitted(sum(map(len, prompts)), request_ids, params.n)
        else:
            self.tally.note_submitted(sum(map(len, prompts)), request_ids, params.n)

    def abort(self) -> None:
        """Free whatever the request still holds; a no-op for finished requests."""
        for stream in self.streams:
            stream.abort()

    def usage(self) -> Usage:
        """As OpenAI counts it: each prompt once (not once per sample), every generated token."""
        tally = self.tally
        return Usage(tally.num_prompt_tokens, tally.num_output_tokens, tally.num_cached_tokens)

    async def deltas(self) -> AsyncIterator[tuple[int, SequenceDelta]]:
        """`(choice, delta)` as the engine produces them, until every sample of every prompt has finished.

        Past the server's request timeout what still runs is aborted (it ends with finish_reason "abort").
        A delta carrying an engine error raises a 500. Closing this early aborts what still runs.
        """
        # A timer that aborts what is left (each sample then ends with an "abort" delta), not wait_for
        # around the next delta: on Python < 3.12 wait_for can swallow a cancellation that lands as the read
        # completes, and a disconnected client's request would then keep generating.
        timer = asyncio.get_running_loop().call_later(max(self.server.config.request_timeout_s, 0.0), self.abort)
        # a lone stream (most requests) is read in place: a generator between it and this loop would cost
        # every token one more resumption
        lone = self.streams[0] if len(self.streams) == 1 else None
        items = self._merged_items() if lone is None else None
        try:
            while True:
                try:
                    prompt, item = (0, await lone.__anext__()) if lone is not None else await anext(items)
                except StopAsyncIteration:
                    return
                if item.error is not None:  # the engine failed the request: a 500, not bad input
                    raise APIError(500, item.error, type=INTERNAL_ERROR)
                self.tally.observe(item)
                yield prompt * self.num_samples + item.index, item
        finally:
            timer.cancel()
            self.abort()
            if items is not None:
                await items.aclose()

    async def _merged_items(self) -> AsyncIterator[tuple[int, SequenceDelta]]:
        """`(prompt, delta)` from the streams of several prompts, as they arrive (a task per stream)."""
        # (prompt, delta), (prompt, None) once its stream has ended, or (prompt, the error its stream raised)
        queue: asyncio.Queue[tuple[int, SequenceDelta | BaseException | None]] = asyncio.Queue()

        async def pump(prompt: int, stream: RequestStream) -> None:
            try:
                async for delta in stream:
                    queue.put_nowait((prompt, delta))
                queue.put_nowait((prompt, None))
            except Exception as exc:  # handed to the consumer, which raises it
                queue.put_nowait((prompt, exc))

        pumps = [asyncio.create_task(pump(prompt, stream)) for prompt, stream in enumerate(self.streams)]
        streaming = len(pumps)
        try:
            while streaming:
                prompt, item = await queue.get()
                if item is None:
                    streaming -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield prompt, item
        finally:
            for task in pumps:
                task.cancel()

    async def outputs(self) -> list[RequestOutput]:
        """Run to the end: one RequestOutput per prompt, every delta of its samples folded in."""
        results = [RequestOutput.empty(stream.request_id, prompt, self.num_samples)
                   for stream, prompt in zip(self.streams, self.prompt_ids)]
        async with aclosing(self.deltas()) as deltas:
            async for choice, delta in deltas:
                results[choice // self.num_samples].add(delta)
        return results


class RequestBody(Protocol):
    """What `serve_job` reads of a request body before the job takes it over."""

    model: str | None
    stream: bool


RequestT = TypeVar("RequestT", bound=RequestBody)


async def serve_job(request: Request, body_type: type[RequestT],
                    job_type: Callable[[ServerState, RequestT, str], GenerationJob]) -> Response:
    """The handler of every generation endpoint: parse, admit, submit, then stream or answer once."""
    server = server_state(request)
    body = await parse_body(request, body_type)
    lora_name = server.check_model(body.model)
    job = job_type(server, body, request_id_of(request))
    if lora_name is not None:
        job.lora_name = job.model = lora_name
    server.check_queue(job.num_sequences)
    await job.submit()
    if body.stream:
        return sse_stream(job.events(), job.abort, shutdown_grace_s=server.config.shutdown_grace_s,
                          event_names=job.sse_event_names)
    try:
        return json_response(await cancel_on_disconnect(request, job.collect()))
    finally:
        job.abort()  # a no-op for finished requests; frees everything if anything failed
