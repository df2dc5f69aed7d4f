"""`EngineProcessClient`: the server's `EngineClient` in front of an engine running in a process of its own
(engine/engine_process.py), as vLLM's V1 splits its API server from its engine core.

With the engine on the server's event loop, every streamed token's HTTP work (SSE encoding, the response
write, the route's bookkeeping) runs between the engine's steps, on the same GIL: under many streams the
device waits for the host. Split, the engine keeps stepping while the server streams, and a stream that
falls behind reads its queued deltas merged into one event (`RequestStream`).

The server's side keeps what the Protocol answers at once: the engine's `EngineInfo` (sent once by the loaded
engine), the live requests' streams, and the latest stats snapshot. Requests arrive checked (engine/contract.py).
Requests and aborts are one-way messages, but for a request with a structured-output format, whose `submit`
waits for the engine to compile it (a bad one is the caller's ValueError); `start`, `shutdown`,
`page_accounting` and the profiler's `start_profile` and `stop_profile` are calls answered by the engine. A
dead engine process (or one whose runner failed) ends every live stream with an engine-error delta and sets
`fatal_error`, on which the server exits non-zero (server/drain.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import socket
from collections.abc import Callable
from multiprocessing.util import Finalize
from typing import Any

from mili_openai.config import EngineConfig
from mili_openai.engine.client import RequestStream
from mili_openai.engine.contract import EngineRequest
from mili_openai.engine.engine_process import engine_process_main
from mili_openai.engine.outputs import EngineObserver, EngineStats, PageAccounting, ProfileFiles
from mili_openai.engine.process_helpers import describe_exit, read_frame, recv_frame, write_frame
from mili_openai.engine.process_messages import Abort, Call, EngineFailed, EngineReady, Outputs, Reply, Submit

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
        self.info = ready.info
        self._lora_adapters = dict(ready.info.lora_adapters)  # name -> path: the engine's, as loads and unloads left it
        self._stats: EngineStats = ready.stats
        self._observer = observer
        self._requests: dict[str, RequestStream] = {}  # by request id, until the delta that finishes it
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
    async def submit(self, request: EngineRequest, request_id: str | None = None) -> RequestStream:
        if not self._started or self._writer is None:
            raise RuntimeError("the engine is not started: await engine.start() first")
        if self.fatal_error is not None:
            raise RuntimeError(f"the engine cannot run requests: {self.fatal_error}")
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, request.params.n, self.abort)
        self._requests[request_id] = stream
        self._sequences_sent += request.params.n
        if request.params.structured_outputs is None:
            write_frame(self._writer, Submit(request, request_id))
            return stream
        try:  # the engine compiles the format, then queues the request and answers
            await self._request(lambda call_id: Submit(request, request_id, call_id))
        except BaseException as exc:
            self._requests.pop(request_id, None)  # (gone already if the engine died meanwhile)
            if isinstance(exc, asyncio.CancelledError) and self._death is None:
                write_frame(self._writer, Abort(request_id))  # the caller gave up: the engine drops it
            raise
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

    def stats(self) -> EngineStats:
        """The engine's latest snapshot (sent with every tick's outputs), counting as waiting the sequences
        submitted that the engine has not taken yet."""
        stats = self._stats
        unseen = self._sequences_sent - self._sequences_received
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + unseen) if unseen else stats

    async def page_accounting(self) -> PageAccounting:
        return await self._call("page_accounting")

    def lora_adapters(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._lora_adapters.items())

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await self._call("load_lora_adapter", name, path)
        self._lora_adapters[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        await self._call("unload_lora_adapter", name)
        del self._lora_adapters[name]

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
        return await self._request(lambda call_id: Call(call_id, method, args))

    async def _request(self, message_for: Callable[[int], Any]) -> Any:
        """Send the message made for a fresh call id, and wait for the engine's `Reply` to it."""
        if self._writer is None:
            raise RuntimeError("the engine is not started: await engine.start() first")
        if self._death is not None:
            raise RuntimeError(f"the engine cannot answer: {self._death}")
        if self._receiver is None or self._receiver.done():
            raise RuntimeError("the engine's replies are no longer read (the server is stopping)")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        write_frame(self._writer, message_for(call_id))
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
            stream = requests.get(delta.request_id)
            if stream is None:
                continue
            stream.put(delta)
            if delta.request_finished:
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
        for stream in self._requests.values():
            stream.end(error)
        self._requests.clear()
