"""The engine process: an `AsyncEngine` on an event loop of its own, serving the server's process over one
socket (engine/process_client.py is the other end; engine/process_messages.py the messages).

Its deltas go into an outbox rather than to streams, and the outbox goes to the server once per loop tick
(a flush scheduled with `call_soon` by the tick's first delta): one step's deltas for every request travel
as one message, with the metrics of the sequences that finished in it and a stats snapshot. The server's
HTTP work then runs beside the engine's steps, on its own GIL, instead of between them.

The process ignores SIGINT and SIGTERM (Ctrl-C, or a supervisor signalling the process group, reaches it
too: the server drains, then closes the socket) and exits when the socket closes, or, failing that, when
its parent process is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from typing import Any

from mili_openai.config import EngineConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.engine.outputs import RequestMetrics, SequenceDelta, abort_deltas
from mili_openai.engine.process_helpers import encode_frame, exit_with_parent, freeze_heap, read_frame, write_frame
from mili_openai.engine.process_messages import Abort, Call, EngineFailed, EngineReady, Outputs, Reply, Submit

logger = logging.getLogger(__name__)

ENGINE_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [engine]: %(message)s"
FATAL_POLL_S = 0.25  # how often an idle engine looks whether its runner failed (a tensor-parallel rank died)
# what Ctrl-C (SIGINT, to the whole process group) or a supervisor signalling the group (SIGTERM) sends
SERVER_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# the AsyncEngine methods (all coroutines) the server may call by name over the socket (`Call`)
ENGINE_CALLS = frozenset({"start", "shutdown", "page_accounting", "start_profile", "stop_profile", "load_lora_adapter",
                          "unload_lora_adapter"})


class Outbox:
    """What the engine produced since the last flush; sent as one `Outputs` at the end of the loop tick.

    It is every request's `DeltaSink`, and also the engine's observer: finished-request metrics travel with the
    deltas, and the server's process replays them on its own observer (the Prometheus metrics)."""

    def __init__(self, engine: AsyncEngine, writer: asyncio.StreamWriter) -> None:
        self.engine = engine
        self.writer = writer
        self.sequences_received = 0
        self.fatal_reported = False
        self._deltas: list[SequenceDelta] = []
        self._finished: list[RequestMetrics] = []
        self._scheduled = False

    def put(self, delta: SequenceDelta) -> None:
        self._deltas.append(delta)
        self.schedule_flush()

    def on_request_finished(self, metrics: RequestMetrics) -> None:
        self._finished.append(metrics)
        self.schedule_flush()

    def schedule_flush(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what is pending, with the stats as they are now (also with nothing pending: a stats update)."""
        self._scheduled = False
        if self.writer.is_closing():
            return
        fatal = self.engine.fatal_error
        self.fatal_reported = fatal is not None
        outputs = Outputs(self._deltas, self._finished, self.engine.stats(), self.sequences_received, fatal)
        self._deltas, self._finished = [], []
        write_frame(self.writer, outputs)


class EngineServer:
    """Serves the server's messages: requests into the engine, calls answered in order of completion."""

    def __init__(self, engine: AsyncEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.engine = engine
        self.reader = reader
        self.writer = writer
        self.outbox = Outbox(engine, writer)
        engine.set_observer(self.outbox)
        self._calls: set[asyncio.Task] = set()
        self._compiling: dict[str, asyncio.Task] = {}  # by request id: Submits whose format is compiling

    async def serve(self) -> None:
        """Until the server's end of the socket closes."""
        watcher = asyncio.create_task(self._watch_fatal(), name="mili-engine-fatal-watch")
        try:
            while True:
                try:
                    message = await read_frame(self.reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                self._handle(message)
        finally:
            watcher.cancel()
            for task in list(self._compiling.values()):
                task.cancel()
            await self.engine.shutdown()
            await self.engine.close()

    def _handle(self, message: Any) -> None:
        if isinstance(message, Submit):
            self.outbox.sequences_received += message.request.params.n
            if message.call_id is None:  # no format to compile: queued now, in order with what follows
                self._submit(message)
            else:
                task = asyncio.create_task(self._compile_and_submit(message))
                self._compiling[message.request_id] = task
                task.add_done_callback(lambda done: self._compiled(message.request_id, done))
        elif isinstance(message, Abort):
            compiling = self._compiling.pop(message.request_id, None)
            if compiling is not None:  # the server gave up on it before its format compiled: never queued
                compiling.cancel()
            else:
                self.engine.abort(message.request_id)
        elif isinstance(message, Call):
            task = asyncio.create_task(self._answer(message))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
        else:
            raise TypeError(f"the engine process got an unknown message {type(message).__name__}")
        self.outbox.schedule_flush()  # the server's stats (num_waiting) see the request within the tick

    def _submit(self, message: Submit) -> None:
        try:
            self.engine.submit_to(self.outbox, message.request, message.request_id)
        except Exception as exc:  # the server checked it already: this one failed past those checks
            logger.exception("request %s refused in the engine process", message.request_id)
            samples = list(range(message.request.params.n))
            for delta in abort_deltas(message.request_id, samples, f"engine error: {exc}"):
                self.outbox.put(delta)

    def _compiled(self, request_id: str, task: asyncio.Task) -> None:
        if self._compiling.get(request_id) is task:  # not a later request's, under the same id
            del self._compiling[request_id]

    async def _compile_and_submit(self, message: Submit) -> None:
        """A request with a structured-output format: compiled, then queued; the server awaits the answer (its
        ValueError if the format is bad)."""
        try:
            await self.engine.compile_format(message.request.params)
            self.engine.submit_to(self.outbox, message.request, message.request_id)
        except Exception as exc:
            self._reply(message.call_id, None, _picklable(exc))
        else:
            self._reply(message.call_id, None, None)

    async def _answer(self, call: Call) -> None:
        try:
            value, error = await self._call(call.method, *call.args), None
        except Exception as exc:
            value, error = None, _picklable(exc)
        self.outbox.flush()  # what the call produced (a shutdown's aborts) arrives before its reply
        self._reply(call.call_id, value, error)

    def _reply(self, call_id: int, value: Any, error: BaseException | None) -> None:
        if not self.writer.is_closing():
            write_frame(self.writer, Reply(call_id, value, error))

    async def _call(self, method: str, *args: Any) -> Any:
        if method not in ENGINE_CALLS:
            raise ValueError(f"the engine process has no call {method!r}")
        return await getattr(self.engine, method)(*args)

    async def _watch_fatal(self) -> None:
        """Report a runner failure even when no step notices it (no request running)."""
        while not self.outbox.fatal_reported:
            if self.engine.fatal_error is not None:
                self.outbox.flush()
            await asyncio.sleep(FATAL_POLL_S)


def _picklable(exc: BaseException) -> BaseException:
    try:
        encode_frame(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def engine_process_main(config: EngineConfig, sock: socket.socket, log_level: int, freeze_gc: bool) -> None:
    """The engine process: load, report ready (or why not), then serve until the socket closes."""
    for sig in SERVER_SIGNALS:  # meant for the server, which drains and then closes the socket
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=ENGINE_LOG_FORMAT)
    exit_with_parent()
    try:
        engine = AsyncEngine(config)
    except BaseException as exc:
        logger.exception("the model failed to load in the engine process")
        sock.sendall(encode_frame(EngineFailed(_picklable(exc))))
        return
    sock.sendall(encode_frame(EngineReady(os.getpid(), engine.info, engine.stats())))
    if freeze_gc:
        freeze_heap()
    asyncio.run(_serve(engine, sock))


async def _serve(engine: AsyncEngine, sock: socket.socket) -> None:
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        await EngineServer(engine, reader, writer).serve()
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass
    logger.info("the server's process closed the engine socket: the engine process exits")
