"""Stop work for a client that has gone away, for responses that are not streamed.

A streamed response notices the disconnect itself (sse-starlette); a plain JSON handler would keep the
engine generating for nobody, so it races its work against the client's `http.disconnect`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (its cleanup aborts the engine requests)."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work_task.cancel()
        raise
    finally:
        watcher.cancel()
    if work_task in done:
        return work_task.result()
    work_task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work_task
    raise ClientDisconnected
