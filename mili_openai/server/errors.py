"""The handlers that turn every failure into an OpenAI-shaped error (protocol/errors.py), and JSON responses.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}` with a fitting
status: bad input is a 400 (never a 500), unknown routes 404, wrong methods 405, and only a real bug
becomes a 500 `internal_error` (logged with its traceback). A client that leaves before its answer has
started -- while its request body is still arriving, or while a plain (not streamed) response is being
generated (`cancel_on_disconnect` then cancels the work) -- is no error of ours: it is logged at info as a
client disconnect, counted in `mili_client_disconnects_total`, logged as a 499 by the request log, and
nothing is sent to its closed socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

import orjson
import pydantic
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mili_openai.engine.contract import RequestError, UnknownLoraAdapter
from mili_openai.protocol.errors import INTERNAL_ERROR, INVALID_REQUEST, TYPE_BY_STATUS, APIError, validation_error
from mili_openai.server.metrics import ServerMetrics
from mili_openai.server.request_log import current_request

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)
T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before an answer started"


# Where in its request a client went away: the `phase` label of mili_client_disconnects_total.
DISCONNECT_PHASES = {
    "request_body": "while its request body was still arriving",  # e.g. a keep-alive connection closing under it
    "before_response": "before its response was ready",
    "stream": "in the middle of its stream",  # server/sse.py
}


class ClientDisconnected(Exception):
    """The client closed the connection before its response started (`phase`: a key of DISCONNECT_PHASES)."""

    def __init__(self, phase: str) -> None:
        super().__init__(f"the client disconnected {DISCONNECT_PHASES[phase]}")
        self.phase = phase


def note_client_disconnect(phase: str, method: str, path: str, metrics: ServerMetrics | None) -> None:
    """A client left before its answer was complete: its own doing, so one info line (no traceback) and a count."""
    logger.info("client disconnected %s: %s %s", DISCONNECT_PHASES[phase], method, path)
    if metrics is not None:
        metrics.client_disconnects.labels(path, phase).inc()


def json_response(body: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """orjson: fast, and strict about NaN rather than emitting invalid JSON."""
    return Response(orjson.dumps(body), status_code=status_code, media_type="application/json", headers=headers)


def error_response(exc: APIError, headers: dict[str, str] | None = None) -> Response:
    return json_response(exc.to_dict(), exc.status_code, {**(exc.headers or {}), **(headers or {})} or None)


async def parse_body(request: Request, model_cls: type[ModelT]) -> ModelT:
    """Read the JSON body (orjson) and validate it against `model_cls`; APIError(400) on any failure."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientDisconnected("request_body") from None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except pydantic.ValidationError as exc:
        raise validation_error(exc) from None


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (its cleanup aborts the engine requests)
    and raise ClientDisconnected. A streamed response notices the disconnect itself (server/sse.py)."""
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
    raise ClientDisconnected("before_response")


# ---- handlers ----
async def _api_error(request: Request, exc: Exception) -> Response:
    return error_response(exc)  # type: ignore[arg-type]


async def _pydantic_error(request: Request, exc: Exception) -> Response:
    return error_response(validation_error(exc))  # type: ignore[arg-type]


async def _value_error(request: Request, exc: Exception) -> Response:
    # SamplingParams and the engine raise ValueError for requests that can never run.
    return error_response(APIError(400, str(exc) or "invalid request"))


async def _request_error(request: Request, exc: Exception) -> Response:
    # check_request's refusal, naming the field at fault
    return error_response(APIError(400, str(exc), param=exc.param))  # type: ignore[attr-defined]


async def _unknown_lora_adapter(request: Request, exc: Exception) -> Response:
    # a request naming an adapter unloaded after the server checked its `model`: as an unknown model's 404
    return error_response(APIError(404, str(exc), param=exc.param, code="model_not_found"))  # type: ignore[attr-defined]


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    if status == 404:
        message = f"no route {request.url.path}"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(getattr(exc, "detail", "") or exc)
    error = APIError(status, message, type=TYPE_BY_STATUS.get(status, INVALID_REQUEST))
    return error_response(error, headers=dict(getattr(exc, "headers", None) or {}))


class CatchAllMiddleware:
    """Turns an exception no handler knew into a logged 500 (instead of a dropped connection), and a client
    that went away (`ClientDisconnected`) into an info line and a count, with nothing sent.

    Starlette's own 500 handler re-raises after answering; this one answers and stops there, and
    when a response has already started (a stream) it can only log.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnected as exc:  # its socket is closed: no answer can reach it
            context = current_request()
            note_client_disconnect(exc.phase, scope["method"], scope["path"],
                                   context.server.metrics if context is not None else None)
        except Exception:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            response = error_response(APIError(500, "internal server error", type=INTERNAL_ERROR))
            await response(scope, receive, send)


def install_error_handlers(app: Starlette) -> None:
    """Map every failure to an OpenAI-shaped error; call once, before the app serves.

    `CatchAllMiddleware` is not added here: the app places it inside the request-id middleware, so
    that a 500 carries the request's id too.
    """
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(pydantic.ValidationError, _pydantic_error)
    app.add_exception_handler(ValueError, _value_error)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(UnknownLoraAdapter, _unknown_lora_adapter)
    app.add_exception_handler(HTTPException, _http_error)
