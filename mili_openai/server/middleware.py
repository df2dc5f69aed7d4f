"""Per-request plumbing in front of every route, as two pure ASGI middlewares (no BaseHTTPMiddleware,
so streamed responses pass through untouched):

- `RequestContextMiddleware`, outermost: the request id (the client's `X-Request-Id` when it is
  sane, else a fresh one; echoed on every response, errors included), the per-request context, the
  in-flight count a shutdown drain waits for, `mili_http_requests_total`, and the request log line.
- `AccessGuardMiddleware`, inside CORS (so preflights pass without a key): the API key and the
  body size limit, both checked before the body is read.
"""

from __future__ import annotations

import hmac
import logging
import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mili_openai.protocol.errors import APIError
from mili_openai.server.errors import CLIENT_CLOSED_REQUEST, error_response
from mili_openai.server.request_log import CURRENT_REQUEST, REQUEST_LOGGER_NAME, RequestContext, log_finished_request
from mili_openai.server.state import REQUEST_ID_SCOPE_KEY, ServerState

REQUEST_ID_HEADER = "x-request-id"
# a client id is echoed in headers and response ids: keep it short and free of anything odd
VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})  # reachable without the API key
UNMATCHED_PATH = "unmatched"  # the metrics label of requests no route matched (404s): bounded cardinality


def new_request_id() -> str:
    return uuid.uuid4().hex


def route_template(scope: Scope) -> str:
    """The matched route's path template (`/status/{request_id}`), never the raw URL.

    Requests refused before routing (401, 413) are matched here, so they are labelled by route too.
    """
    route = scope.get("route")
    if route is None:
        router = getattr(scope.get("app"), "router", None)
        for candidate in getattr(router, "routes", ()):
            match, _ = candidate.matches(scope)
            if match is not Match.NONE:
                route = candidate
                break
    return getattr(route, "path", None) or UNMATCHED_PATH


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes", code="body_too_large")


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, server: ServerState) -> None:
        self.app = app
        self.server = server
        self.request_logger = logging.getLogger(REQUEST_LOGGER_NAME)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_HEADER)
        request_id = given if given is not None and VALID_REQUEST_ID.match(given) else new_request_id()
        scope[REQUEST_ID_SCOPE_KEY] = request_id
        server = self.server
        context = RequestContext(request_id, scope["method"], scope["path"], server)
        counted = scope["path"] not in OPEN_PATHS  # probes and scrapes do not hold a drain back
        status_seen = CLIENT_CLOSED_REQUEST

        async def send_with_id(message: Message) -> None:
            nonlocal status_seen
            if message["type"] == "http.response.start":
                status_seen = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        token = CURRENT_REQUEST.set(context)
        if counted:
            server.active_requests += 1
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            CURRENT_REQUEST.reset(token)
            context.release()  # a request refused after check_queue (bad prompt...) frees its place
            if counted:
                server.active_requests -= 1
            endpoint = route_template(scope)
            if server.metrics is not None:
                server.metrics.http_requests.labels(scope["method"], endpoint, str(status_seen)).inc()
            log_finished_request(self.request_logger, context, endpoint, status_seen)


class AccessGuardMiddleware:
    def __init__(self, app: ASGIApp, server: ServerState) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rejection = self._reject(scope, Headers(scope=scope))
        if rejection is not None:
            await error_response(rejection)(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _reject(self, scope: Scope, headers: Headers) -> APIError | None:
        """Refuse before reading the body: a missing API key, or a declared body over the limit."""
        config = self.server.config
        if config.api_key is not None and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
                return APIError(401, "Incorrect API key provided.", type="authentication_error",
                                code="invalid_api_key")
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                return APIError(400, "invalid Content-Length header")
            if int(declared) > config.max_body_bytes:
                return BodyTooLarge(config.max_body_bytes)
        return None

    def _limited(self, receive: Receive) -> Receive:
        """`receive` that also counts streamed (chunked) body bytes, so no header can dodge the limit."""
        limit = self.server.config.max_body_bytes
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        return limited_receive
