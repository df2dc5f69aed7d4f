"""Server-sent events in OpenAI's streaming format: `data: {json}` per event, then `data: [DONE]`.

The stream always ends with [DONE]: an exception mid-stream becomes one OpenAI-shaped error event
first. On server shutdown the requests get `shutdown_grace_s` to finish; past it they are aborted
and their streams end with finish_reason "abort" and [DONE] -- never cut silently. Under `mili
serve` the drain (server/drain.py) does this and marks the server `grace_expired`; the stream then
also says why, with a 503 error event before [DONE]. Under a plain uvicorn, sse-starlette's own
shutdown event starts a per-stream grace timer instead (abort, no error event). A client that
disconnects mid-stream cancels the generator, `on_disconnect` aborts its engine requests, and the
disconnect is logged at info and counted (`mili_client_disconnects_total{phase="stream"}`), as
server/errors.py does for one that leaves before its answer starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import orjson
from sse_starlette.sse import EventSourceResponse
from starlette.types import Message, Send

from mili_openai.protocol.errors import INTERNAL_ERROR, APIError
from mili_openai.server.errors import note_client_disconnect
from mili_openai.server.request_log import current_request

logger = logging.getLogger(__name__)

EVENT_LINE_SEPARATOR = "\n"  # what OpenAI sends; sse-starlette's default "\r\n" trips naive parsers
DONE_EVENT = b"data: [DONE]\n\n"
PING_INTERVAL_S = 15.0  # keep-alive comments, so proxies do not drop a slow first token
# sse-starlette force-cancels the stream this long after our own grace period, as a last resort
SHUTDOWN_FORCE_MARGIN_S = 2.0

OnDisconnect = Callable[[], Any] | None


def event_bytes(event: dict[str, Any], event_name: str | None = None) -> bytes:
    """One SSE event on the wire, `data: {json}` (after an `event:` line when named). orjson's output holds
    no line break, so the data is one line; built here in one pass, where sse-starlette's ServerSentEvent
    would split and re-join it for every token of every stream."""
    data = b"data: " + orjson.dumps(event) + b"\n\n"
    if event_name is None:
        return data
    return b"event: " + event_name.replace("\r", "").replace("\n", "").encode() + b"\n" + data


class EventStreamResponse(EventSourceResponse):
    """sse-starlette's response, sending straight to the server where no per-send timeout is set (ours
    sets none): its base wraps every send in an anyio cancel scope, once per event of every stream."""

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def shutdown_error() -> APIError:
    return APIError(503, "the server shut down before this request finished; retry it",
                    type="service_unavailable", code="server_shutdown")


def error_event(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, APIError):
        return exc.to_dict()
    if isinstance(exc, ValueError):
        return APIError(400, str(exc)).to_dict()
    return APIError(500, "internal server error while streaming", type=INTERNAL_ERROR).to_dict()


async def _call(callback: OnDisconnect) -> None:
    if callback is None:
        return
    result = callback()
    if inspect.isawaitable(result):
        await result


async def _abort_after_grace(shutdown: anyio.Event, grace_s: float, callback: OnDisconnect) -> None:
    await shutdown.wait()
    await asyncio.sleep(grace_s)
    logger.warning("shutdown grace period over: aborting an in-flight stream")
    await _call(callback)


def sse_stream(
    events: AsyncIterator[dict[str, Any]],
    on_disconnect: OnDisconnect = None,
    *,
    shutdown_grace_s: float = 0.0,
    headers: dict[str, str] | None = None,
    event_names: bool = False,
) -> EventSourceResponse:
    """Stream `events` as SSE. `on_disconnect` (sync or async) aborts the work behind the stream.
    `event_names`: each event also gets an `event:` line naming its "type" (as the Responses API sends)."""
    shutdown = anyio.Event()
    context = current_request()
    server = context.server if context is not None else None

    def cut_by_drain() -> bool:
        return server is not None and server.grace_expired

    async def body() -> AsyncIterator[str]:
        watcher = asyncio.create_task(_abort_after_grace(shutdown, shutdown_grace_s, on_disconnect))
        try:
            async for event in events:
                yield event_bytes(event, event["type"] if event_names and "type" in event else None)
            if cut_by_drain():  # the events ended with an "abort"; say why
                yield event_bytes(shutdown_error().to_dict())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the client gets an error event rather than a cut stream
            if not isinstance(exc, (APIError, ValueError)):
                logger.exception("error while streaming a response")
            yield event_bytes(error_event(exc))
        finally:
            watcher.cancel()
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        yield DONE_EVENT

    async def client_closed(message: dict[str, Any]) -> None:
        if context is not None:
            note_client_disconnect("stream", context.method, context.path, server.metrics)
        await _call(on_disconnect)

    return EventStreamResponse(
        body(),
        headers=headers,
        ping=PING_INTERVAL_S,
        sep=EVENT_LINE_SEPARATOR,
        client_close_handler_callable=client_closed,
        shutdown_event=shutdown,
        shutdown_grace_period=shutdown_grace_s + SHUTDOWN_FORCE_MARGIN_S,
    )

