"""What the server sees of the engine: the `EngineClient` Protocol, and the stream a request's deltas
arrive on.

The routes type against `EngineClient`, not against `AsyncEngine`: the server never reaches into the
engine's loop, scheduler or model, and a test engine (tests/helpers/fake_engine.py) serves the routes by
following this Protocol. Importing this module pulls in neither torch nor the model.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from mili_openai.engine.contract import EngineInfo, EngineRequest
from mili_openai.engine.outputs import (
    EngineObserver,
    EngineStats,
    PageAccounting,
    ProfileFiles,
    SequenceDelta,
    abort_deltas,
)
from mili_openai.engine.parallel_sampling import SampleProgress


class DeltaSink(Protocol):
    """Where the engine puts one request's deltas: a `RequestStream`, or, in an engine process, the outbox to
    the server's process (engine/engine_process.py). The engine forgets the sink after the delta that
    finishes the request (`SequenceDelta.request_finished`)."""

    def put(self, delta: SequenceDelta) -> None: ...


def merge_deltas(deltas: list[SequenceDelta]) -> SequenceDelta:
    """Consecutive deltas of one sample as one, the last one's state kept (a stream's consumer fell behind).
    A delta without logprobs (an abort's) adds none."""
    last = deltas[-1]
    logprobs = None
    if any(delta.logprobs is not None for delta in deltas):
        logprobs = [entry for delta in deltas if delta.logprobs is not None for entry in delta.logprobs]
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return replace(last, text="".join(delta.text for delta in deltas),
                   token_ids=[token for delta in deltas for token in delta.token_ids],
                   logprobs=logprobs, prompt_logprobs=prompt_logprobs)


class RequestStream:
    """Async iterator over one request's deltas, every sample's (`delta.index`) in the order the engine
    produced them; it ends once each of the request's samples has delivered its final delta.

    A consumer that falls behind the engine reads each sample's queued deltas merged into one: under load
    one SSE event then carries several tokens, instead of every token paying an event's cost on the
    event loop that also runs the engine (vLLM's output collector merges the same way).

    `abort` (or `aclose`, when a consumer stops early) aborts the samples still running; `end` finishes the
    samples still owed a final delta itself (an engine that can send no more).
    """

    def __init__(self, request_id: str, num_samples: int, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.num_samples = num_samples
        self._abort = abort
        self._queue: deque[SequenceDelta] = deque()
        # the consumer's wait for the next delta (a bare future: one per wait, as asyncio.Event would
        # make, without the Event's own calls on every token); None while it is not waiting
        self._waiter: asyncio.Future[None] | None = None
        self._progress = SampleProgress(num_samples)  # samples whose final delta has not been put yet
        self._closed = False  # the consumer stopped listening

    @property
    def finished(self) -> bool:
        """Every sample's final delta has been put (whether or not it has been read)."""
        return self._progress.finished

    def put(self, delta: SequenceDelta) -> None:
        if delta.finish_reason is not None:
            self._progress.finish(delta.index)
        self._queue.append(delta)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a consumer cancelled while waiting leaves a cancelled future
                waiter.set_result(None)

    def end(self, error: str | None) -> None:
        """A final "abort" delta (with `error`, if any) for every sample still owed one."""
        for delta in abort_deltas(self.request_id, self._progress.unfinished, error):
            self.put(delta)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> SequenceDelta:
        queue = self._queue
        if self._closed or (not queue and self.finished):
            raise StopAsyncIteration
        while not queue:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        delta = queue.popleft()
        if delta.finish_reason is None and queue and queue[0].index == delta.index:
            run = [delta]
            while queue and queue[0].index == delta.index and run[-1].finish_reason is None:
                run.append(queue.popleft())
            delta = merge_deltas(run)
        return delta

    def abort(self) -> None:
        """Abort every sample still running; each then delivers a final "abort" delta."""
        if not self.finished:
            self._abort(self.request_id)

    async def aclose(self) -> None:
        """Stop listening; aborts what still runs (e.g. the client went away)."""
        self._closed = True
        self.abort()


class EngineClient(Protocol):
    """The engine as the server uses it: `AsyncEngine` on the server's own event loop, or
    `EngineProcessClient` (engine/process_client.py) in front of one in a process of its own."""

    info: EngineInfo  # the loaded engine: tokenizer, context length, vocabulary, sampling defaults, ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None:
        """Stop the loop and abort every request."""
        ...

    async def close(self) -> None:
        """Release what the engine holds beyond the model (its process, its threads) for good, at the
        server's exit; after `shutdown`."""
        ...

    def is_ready(self) -> bool: ...

    @property
    def fatal_error(self) -> str | None:
        """Why the engine can run no more steps (a tensor-parallel worker died), or None: the server then
        exits non-zero (server/drain.py)."""
        ...

    async def submit(self, request: EngineRequest, request_id: str | None = None) -> RequestStream:
        """Queue a request checked by `check_request` (engine/contract.py), of `params.n` samples, and return
        the stream of its deltas. A structured-output format is compiled here, off the event loop (ValueError
        if it is bad); ValueError for a request id in use."""
        ...

    def abort(self, request_id: str) -> None:
        """Abort every sample of the request still running (a no-op for a finished or unknown one)."""
        ...

    def abort_all(self) -> int:
        """Abort every live request; returns how many were aborted."""
        ...

    def stats(self) -> EngineStats: ...

    def lora_adapters(self) -> tuple[tuple[str, str], ...]:
        """The LoRA adapters a request may name as its `model` now, (name, path) in the order they were loaded."""
        ...

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Read the PEFT adapter at `path` and serve it as `name` (vLLM's /v1/load_lora_adapter): LoraAdapterExists
        for a name served already, AdapterError (a ValueError) for an adapter this base cannot serve, ValueError
        with LoRA off."""
        ...

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving `name` to new requests (UnknownLoraAdapter if it is not served); requests already on it
        finish on it, and its weights are let go after the last one."""
        ...

    async def page_accounting(self) -> PageAccounting:
        """Where every KV page is, with an integrity check (for debugging and soak tests, not per request)."""
        ...

    def set_observer(self, observer: EngineObserver | None) -> None:
        """Attach the server's metrics to an engine built before the server."""
        ...

    async def start_profile(self) -> None:
        """Start a torch profile of the engine's steps (ValueError when profiling is off; ProfilerStateError,
        a ValueError, when one already runs)."""
        ...

    async def stop_profile(self) -> ProfileFiles:
        """Stop it and write its trace and summary (ProfilerStateError when none runs)."""
        ...
