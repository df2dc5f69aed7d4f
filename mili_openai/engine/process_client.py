"""`EngineProcessClient`: the server's `EngineClient` in front of an engine running in a process of its own
(engine/engine_process.py), as vLLM's V1 splits its API server from its engine core.

With the engine on the server's event loop, every streamed token's HTTP work (SSE encoding, the response
write, the route's bookkeeping) runs between the engine's steps, on the same GIL: under many streams the
device waits for the host. Split, the engine keeps stepping while the server streams, and a stream that
falls behind reads its queued deltas merged into one event (`RequestStream`).

The server's side keeps what the Protocol answers at once: the engine's metadata and tokenizer (sent once
by the loaded engine), the same `check_request` the engine runs (so `submit` stays synchronous and raises
ValueError for a request that can never run), the live requests' streams, and the latest stats snapshot.
Requests and aborts are one-way messages; `start`, `shutdown`, `compile_format`, `page_accounting` and the
profiler's `start_profile` and `stop_profile` are calls answered by the engine. A dead engine process (or one whose runner failed) ends every live stream
with an engine-error delta and sets `fatal_error`, on which the server exits non-zero (server/drain.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import socket
from multiprocessing.util import Finalize
from typing import Any

from mili_openai.config import EngineConfig
from mili_openai.engine.client import RequestStream
from mili_openai.engine.core import check_request
from mili_openai.engine.engine_process import engine_process_main
from mili_openai.engine.outputs import EngineObserver, EngineStats, PageAccounting, ProfileFiles, SequenceDelta
from mili_openai.engine.process_messages import (
    Abort,
    Call,
    EngineFailed,
    EngineReady,
    Outputs,
    Reply,
    Submit,
    read_frame,
    recv_frame,
    write_frame,
)
from mili_openai.engine.sampling_params import SamplingParams
from mili_openai.engine.tp_runner import describe_exit

logger = logging.getLogger(__name__)

EXIT_TIMEOUT_S = 30.0  # the engine process, its socket closed, gets this long to stop its loop and exit
REAP_TIMEOUT_S = 5.0  # how long a closed socket waits for the process's exit code, for the log line
EXIT_PRIORITY = 10  # any priority runs at exit; this one before multiprocessing's lower ones


def _stop_process(process: multiprocessing.Process, sock: socket.socket) -> None:
    """Close the socket (the engine process exits on that; it ignores SIGTERM), then kill it if it lingers."""
    sock.close()
    process.join(EXIT_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()


class LiveRequest:
    """A request the engine has not finished: its stream, and which samples still owe a final delta."""

    __slots__ = ("stream", "unfinished")

    def __init__(self, stream: RequestStream, num_samples: int) -> None:
        self.stream = stream
        self.unfinished = set(range(num_samples))


class EngineProcessClient:
    def __init__(self, config: EngineConfig, observer: EngineObserver | None = None,
                 freeze_gc_after_load: bool = False) -> None:
        """Spawn the engine process and block until its model is loaded (the server builds this on a thread).
        A load that fails raises here what it raised there."""
        context = multiprocessing.get_context("spawn")
        ours, theirs = socket.socketpair()
        log_level = logging.getLogger().getEffectiveLevel()
        # not daemonic: the engine process may itself spawn tensor-parallel workers
        self._process = context.Process(target=engine_process_main, name="mili-engine", daemon=False,
                                        args=(config, theirs, log_level, freeze_gc_after_load))
        self._process.start()
        theirs.close()
        self._sock = ours
        # multiprocessing's Finalize, not weakref's: at interpreter exit it runs before multiprocessing joins its
        # non-daemonic children, which would wait forever on an engine process whose socket is still open
        self._finalizer = Finalize(self, _stop_process, args=(self._process, ours), exitpriority=EXIT_PRIORITY)
        try:
            first = recv_frame(ours)
        except EOFError:
            self._finalizer()
            raise RuntimeError(f"the engine process {describe_exit(self._process.exitcode, 'closed its socket')} "
                               f"before its model loaded") from None
        if isinstance(first, EngineFailed):
            self._finalizer()
            raise first.error
        ready: EngineReady = first
        self.pid = ready.pid
        self.tokenizer = ready.tokenizer
        self.model_path = ready.model_path
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.eos_token_ids = ready.eos_token_ids
        self.quantization = ready.quantization
        self.sampling_defaults = ready.sampling_defaults
        self._limits = ready.limits
        self._stats: EngineStats = ready.stats
        self._observer = observer
        self._requests: dict[str, LiveRequest] = {}
        self._request_ids = itertools.count()
        self._call_ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}
        self._sequences_sent = 0  # sequences of every Submit written; the engine reports those it has taken
        self._sequences_received = 0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._receiver: asyncio.Task | None = None
        self._started = False
        self._closing = False
        self._engine_fatal: str | None = None  # the engine's own report (a tensor-parallel rank died)
        self._death: str | None = None  # the engine process is gone
        logger.info("engine process (pid %d) loaded; the server talks to it over a socket", self.pid)

    # ---- lifecycle ----
    async def start(self) -> None:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(sock=self._sock)
            self._receiver = asyncio.create_task(self._receive(), name="mili-engine-outputs")
        if not self._started:
            await self._call("start")
            self._started = True

    async def shutdown(self) -> None:
        """Stop the engine's loop and abort every request; the model stays loaded and `start` may run again."""
        self._started = False
        if self._writer is not None and self._death is None:
            with contextlib.suppress(RuntimeError):  # the engine process died meanwhile: ended below
                await self._call("shutdown")
        self._end_every_request(error=None)

    async def close(self) -> None:
        """Stop the engine process (after `shutdown`): it exits once its socket closes."""
        self._closing = True
        if self._writer is not None:
            self._writer.close()
        await asyncio.to_thread(self._finalizer)
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver

    def is_ready(self) -> bool:
        return self._started and self.fatal_error is None

    @property
    def fatal_error(self) -> str | None:
        return self._engine_fatal or self._death

    # ---- requests ----
    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        if not self._started or self._writer is None:
            raise RuntimeError("the engine is not started: await engine.start() first")
        if self.fatal_error is not None:
            raise RuntimeError(f"the engine cannot run requests: {self.fatal_error}")
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = [int(t) for t in prompt_token_ids]
        check_request(prompt, params, self._limits)  # the engine's own check, so a 400 comes from here
        stream = RequestStream(request_id, params.n, self.abort)
        self._requests[request_id] = LiveRequest(stream, params.n)
        self._sequences_sent += params.n
        write_frame(self._writer, Submit(prompt, params, request_id))
        return stream

    def abort(self, request_id: str) -> None:
        """The engine aborts it and sends its final "abort" deltas back, which end the stream."""
        if request_id in self._requests and self._writer is not None and self._death is None:
            write_frame(self._writer, Abort(request_id))

    def abort_all(self) -> int:
        request_ids = list(self._requests)
        for request_id in request_ids:
            self.abort(request_id)
        return len(request_ids)

    async def compile_format(self, params: SamplingParams) -> None:
        """Compiled in the engine process, which keeps it for the request's `submit` (ValueError if bad)."""
        if params.structured_outputs is not None:
            await self._call("compile_format", params)

    def stats(self) -> EngineStats:
        """The engine's latest snapshot (sent with every tick's outputs), counting as waiting the sequences
        submitted that the engine has not taken yet."""
        stats = self._stats
        unseen = self._sequences_sent - self._sequences_received
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + unseen) if unseen else stats

    async def page_accounting(self) -> PageAccounting:
        return await self._call("page_accounting")

    async def start_profile(self) -> None:
        """The engine process profiles its own steps (engine/step_profiler.py)."""
        await self._call("start_profile")

    async def stop_profile(self) -> ProfileFiles:
        return await self._call("stop_profile")

    def set_observer(self, observer: EngineObserver | None) -> None:
        """Finished-request metrics arrive with the engine's outputs and are replayed on `observer`."""
        self._observer = observer

    # ---- the engine's messages ----
    async def _call(self, method: str, *args: Any) -> Any:
        if self._writer is None:
            raise RuntimeError("the engine is not started: await engine.start() first")
        if self._death is not None:
            raise RuntimeError(f"the engine cannot answer: {self._death}")
        if self._receiver is None or self._receiver.done():
            raise RuntimeError("the engine's replies are no longer read (the server is stopping)")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        write_frame(self._writer, Call(call_id, method, args))
        return await future

    async def _receive(self) -> None:
        try:
            while True:
                message = await read_frame(self._reader)
                if isinstance(message, Outputs):
                    self._take(message)
                else:
                    self._answered(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            if not self._closing:
                await self._engine_died()
        finally:  # also when cancelled (the loop is closing): no call may wait for a reply nobody reads
            self._fail_calls(RuntimeError(self._death or "the engine's replies are no longer read"))

    def _fail_calls(self, error: Exception) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()

    def _take(self, outputs: Outputs) -> None:
        observer = self._observer
        if observer is not None:  # before the deltas: a client that sees its request end finds it counted
            for metrics in outputs.finished:
                observer.on_request_finished(metrics)
        requests = self._requests
        for delta in outputs.deltas:
            live = requests.get(delta.request_id)
            if live is None:
                continue
            live.stream.put(delta)
            if delta.finish_reason is not None:
                live.unfinished.discard(delta.index)
                if not live.unfinished:
                    del requests[delta.request_id]
        self._stats = outputs.stats
        self._sequences_received = outputs.sequences_received
        if outputs.fatal_error is not None and self._engine_fatal is None:
            self._engine_fatal = outputs.fatal_error
            logger.error("the engine process reports it cannot continue: %s", outputs.fatal_error.splitlines()[0])

    def _answered(self, reply: Reply) -> None:
        future = self._calls.pop(reply.call_id, None)
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(reply.error)
        else:
            future.set_result(reply.value)

    async def _engine_died(self) -> None:
        process = self._process
        await asyncio.to_thread(process.join, REAP_TIMEOUT_S)
        self._death = f"the engine process (pid {process.pid}) {describe_exit(process.exitcode, 'closed its socket')}"
        logger.error("%s; failing its %d request(s)", self._death, len(self._requests))
        self._fail_calls(RuntimeError(self._death))
        self._end_every_request(error=f"engine error: {self._death}")

    def _end_every_request(self, error: str | None) -> None:
        """A final "abort" delta for every sample still owed one (the engine cannot send them any more)."""
        for request_id, live in list(self._requests.items()):
            for index in sorted(live.unfinished):
                live.stream.put(SequenceDelta(request_id, "", [], None, "abort", None, 0, 0, 0,
                                              error=error, index=index))
        self._requests.clear()
