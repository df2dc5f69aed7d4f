"""Graceful shutdown of `mili serve`: health 503 -> drain in-flight requests -> exit 0.

On the first SIGTERM or SIGINT the server is marked draining at once: /health answers 503 (so a
balancer stops sending) and new generation requests get 503, while the listener stays open so they
get that answer rather than a refused connection. In-flight requests get `shutdown_grace_s` to
finish normally; past it they are aborted (streams end with finish_reason "abort", a 503 error
event and [DONE]; plain responses return what was generated with finish_reason "abort"). Only then
is uvicorn told to exit: it closes the listener and idle connections and runs the lifespan shutdown,
which stops the engine. A second signal exits at once.

uvicorn's own signal handling re-raises the signal after a clean shutdown, so the process would
die "killed by SIGTERM" (status -15); `DrainingServer` installs its own handlers and does not, so
a drained server exits 0 as Kubernetes expects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from mili_openai.server.state import ServerState

logger = logging.getLogger(__name__)

DRAIN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DRAIN_POLL_S = 0.05
# after the grace, aborted streams need a moment to send their final events and [DONE]
ABORT_FLUSH_S = 5.0


async def wait_until_idle(server: ServerState, timeout_s: float) -> bool:
    """True once no request is in flight, False if `timeout_s` passed first."""
    deadline = time.monotonic() + timeout_s
    while server.active_requests > 0:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(DRAIN_POLL_S)
    return True


async def drain(server: ServerState, grace_s: float) -> bool:
    """Refuse new work, let in-flight requests finish within `grace_s`, abort the rest.

    Returns True when everything finished within the grace.
    """
    server.draining = True
    logger.info("draining: %d request(s) in flight, %.1f s grace", server.active_requests, grace_s)
    if await wait_until_idle(server, grace_s):
        return True
    logger.warning("shutdown grace of %.1f s is over: aborting %d in-flight request(s)", grace_s,
                   server.active_requests)
    server.grace_expired = True
    if server.engine is not None:
        server.engine.abort_all()
    if not await wait_until_idle(server, ABORT_FLUSH_S):
        logger.error("%d request(s) still open after the abort; uvicorn will cancel them", server.active_requests)
    return False


class DrainingServer(uvicorn.Server):
    """uvicorn that drains `state` before exiting on a signal, and exits 0 afterwards."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self.drain_task: asyncio.Task | None = None
        # the model never loaded, or the engine stopped for good: the process should exit non-zero
        self.model_failed = False

    async def on_tick(self, counter: int) -> bool:
        # A server without a model only answers 503s; exiting lets a supervisor (Kubernetes, systemd)
        # restart it and show the failure, as vLLM does, instead of a pod that looks alive.
        if self.state.load_error is not None and not self.model_failed:
            logger.error("exiting: the model failed to load (%s)", self.state.load_error)
            self.model_failed = True
            self.should_exit = True
        engine = self.state.engine
        fatal = engine.fatal_error if engine is not None else None
        if fatal is not None and not self.model_failed:  # e.g. a tensor-parallel rank died
            logger.error("exiting: the engine cannot continue (%s)", fatal.splitlines()[0])
            self.model_failed = True
            self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Signals can only be handled on the main thread (tests run servers on others).
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        for sig in DRAIN_SIGNALS:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in DRAIN_SIGNALS:
                loop.remove_signal_handler(sig)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain_task is not None or self.should_exit:
            logger.warning("second signal: exiting without waiting")
            self.should_exit = self.force_exit = True
            return
        self.state.draining = True  # /health is 503 from this instant on
        self.drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit(), name="mili-drain")

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self.state, self.grace_s)
        finally:
            self.should_exit = True
