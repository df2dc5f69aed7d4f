"""Per-request plumbing in front of every route: request id, API key, body size limit, HTTP metrics.

Pure ASGI (no BaseHTTPMiddleware) so streamed responses pass through untouched.
"""

from __future__ import annotations

import hmac
import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mili_openai.routes.errors import APIError, error_response
from mili_openai.routes.state import REQUEST_ID_SCOPE_KEY, ServerState

REQUEST_ID_HEADER = "x-request-id"
# a client id is echoed in headers and response ids: keep it short and free of anything odd
VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})  # reachable without the API key


def new_request_id() -> str:
    return uuid.uuid4().hex


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes", code="body_too_large")


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, server: ServerState) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given = headers.get(REQUEST_ID_HEADER)
        request_id = given if given is not None and VALID_REQUEST_ID.match(given) else new_request_id()
        scope[REQUEST_ID_SCOPE_KEY] = request_id
        status_seen = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status_seen
            if message["type"] == "http.response.start":
                status_seen = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            rejection = self._reject(scope, headers)
            if rejection is not None:
                await error_response(rejection)(scope, receive, send_with_id)
                return
            await self.app(scope, self._limited(receive), send_with_id)
        finally:
            self._count(scope, status_seen)

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

    def _count(self, scope: Scope, status: int) -> None:
        metrics = self.server.metrics
        if metrics is None:
            return
        route = scope.get("route")
        # the route's template keeps label cardinality bounded; unknown paths share one label
        path = getattr(route, "path", None) or "unmatched"
        metrics.http_requests.labels(scope["method"], path, str(status)).inc()
