"""What the server sees of the engine: the `EngineClient` Protocol, and the stream a request's deltas
arrive on.

The routes type against `EngineClient`, not against `AsyncEngine`: the server never reaches into the
engine's loop, scheduler or model, and a test engine (tests/fake_engine.py) serves the routes by
following this Protocol. Importing this module pulls in neither torch nor the model.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from mili_openai.engine.outputs import (
    EngineObserver,
    EngineStats,
    PageAccounting,
    ProfileFiles,
    SequenceDelta,
    merge_deltas,
)
from mili_openai.engine.sampling_params import SamplingDefaults, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class DeltaSink(Protocol):
    """Where the engine puts one request's deltas: a `RequestStream`, or, in an engine process, the outbox to
    the server's process (engine/engine_process.py)."""

    def put(self, delta: SequenceDelta) -> None: ...

    @property
    def finished(self) -> bool:
        """Every sample's final delta has been put: the engine forgets the sink."""
        ...


class RequestStream:
    """Async iterator over one request's deltas, every sample's (`delta.index`) in the order the engine
    produced them; it ends once each of the request's samples has delivered its final delta.

    A consumer that falls behind the engine reads each sample's queued deltas merged into one: under load
    one SSE event then carries several tokens, instead of every token paying an event's cost on the
    event loop that also runs the engine (vLLM's output collector merges the same way).

    `abort` (or `aclose`, when a consumer stops early) aborts the samples still running.
    """

    def __init__(self, request_id: str, num_samples: int, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.num_samples = num_samples
        self._abort = abort
        self._queue: deque[SequenceDelta] = deque()
        # the consumer's wait for the next delta (a bare future: one per wait, as asyncio.Event would
        # make, without the Event's own calls on every token); None while it is not waiting
        self._waiter: asyncio.Future[None] | None = None
        self._undelivered = num_samples  # samples whose final delta the engine has not put yet
        self._unread = num_samples  # samples whose final delta the consumer has not read yet

    @property
    def finished(self) -> bool:
        """Every sample's final delta has been put (whether or not it has been read)."""
        return self._undelivered == 0

    def put(self, delta: SequenceDelta) -> None:
        if delta.finish_reason is not None:
            self._undelivered -= 1
        self._queue.append(delta)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a consumer cancelled while waiting leaves a cancelled future
                waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> SequenceDelta:
        if self._unread == 0:
            raise StopAsyncIteration
        queue = self._queue
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
        if delta.finish_reason is not None:
            self._unread -= 1
        return delta

    def abort(self) -> None:
        """Abort every sample still running; each then delivers a final "abort" delta."""
        if not self.finished:
            self._abort(self.request_id)

    async def aclose(self) -> None:
        """Stop listening; aborts what still runs (e.g. the client went away)."""
        self._unread = 0
        self.abort()


class EngineClient(Protocol):
    """The engine as the server uses it: `AsyncEngine` on the server's own event loop, or
    `EngineProcessClient` (engine/process_client.py) in front of one in a process of its own."""

    tokenizer: PreTrainedTokenizerBase
    model_path: Path | None
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    quantization: str | None  # what the weights are (int8, int4, awq, ...), None for unquantized
    sampling_defaults: SamplingDefaults  # what a request's omitted sampling fields become

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

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        """Queue a request of `params.n` samples; ValueError for one that can never run."""
        ...

    def abort(self, request_id: str) -> None:
        """Abort every sample of the request still running (a no-op for a finished or unknown one)."""
        ...

    def abort_all(self) -> int:
        """Abort every live request; returns how many were aborted."""
        ...

    async def compile_format(self, params: SamplingParams) -> None:
        """Compile the request's structured-output format off the event loop (ValueError if it is bad)."""
        ...

    def stats(self) -> EngineStats: ...

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
