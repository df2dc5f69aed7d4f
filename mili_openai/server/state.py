"""What route handlers reach: the engine, the config, the served model name, readiness.

One `ServerState` per app, created by `create_app` and handed to every request through the
lifespan's state (`request.state.server`); nothing lives in module globals. The lifespan fills in
the engine once it has loaded, so `/health` can answer 503 meanwhile.

Overload: `check_queue` refuses a generation request with 429 once the sequences waiting for the
engine (its waiting list plus those admitted by routes but not yet submitted) reach `max_queue`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request

from mili_openai.config import ServerConfig
from mili_openai.server.errors import APIError
from mili_openai.server.request_context import current_request
from mili_openai.routes.request_records import RequestRecords

REQUEST_ID_SCOPE_KEY = "mili.request_id"  # where the request-id middleware leaves the id in the ASGI scope
DEFAULT_MODEL_NAME = "Qwen3-0.6B"  # what the embedded default model is called when no path is given
# Retry-After of a 429: a constant, since a queue that is full now drains at the pace of whole
# generations (seconds on any hardware); one second lets clients with backoff retry without hammering.
QUEUE_FULL_RETRY_AFTER_S = 1
QUEUE_FULL_REASON = "queue_full"


class QueueFull(APIError):
    """429 with a Retry-After header, in OpenAI's error shape."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(429, "too many requests are waiting; retry later", type="rate_limit_exceeded",
                         code=QUEUE_FULL_REASON, headers={"Retry-After": str(retry_after_s)})


def default_served_name(config: ServerConfig) -> str:
    """`--served-model-name`, else the model path's last component (like vLLM)."""
    if config.served_model_name:
        return config.served_model_name
    if config.engine.model:
        return Path(config.engine.model.rstrip("/")).name or config.engine.model
    return DEFAULT_MODEL_NAME


@dataclass(slots=True, eq=False)
class ServerState:
    config: ServerConfig
    served_model_name: str
    engine: Any | None = None  # an AsyncEngine once loaded and started
    metrics: Any | None = None  # routes.metrics.ServerMetrics, when that module is present
    records: RequestRecords = field(default_factory=RequestRecords)
    draining: bool = False  # set when shutdown begins: /health turns 503 so balancers stop sending
    grace_expired: bool = False  # set when the shutdown grace is over and what still ran was aborted
    pending_sequences: int = 0  # admitted by check_queue, not yet submitted to the engine
    active_requests: int = 0  # HTTP requests in flight, probes and scrapes excepted (what a drain waits for)
    load_error: str | None = None  # why the model failed to load, if it did
    start_time: float = 0.0

    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_ready() and not self.draining

    def require_engine(self) -> Any:
        """The running engine, or a 503 the client may retry."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable")
        if self.engine is None or not self.engine.is_ready():
            detail = f": {self.load_error}" if self.load_error else "; retry shortly"
            raise APIError(503, f"the model is not ready{detail}", type="service_unavailable")
        return self.engine

    def check_model(self, name: str | None) -> None:
        """404 for a model this server does not serve (None means "the one served")."""
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_queue(self, num_sequences: int = 1) -> None:
        """429 once `max_queue` sequences wait: shed load instead of queueing forever.

        Admitted requests reserve their `num_sequences` (n samples per prompt count n) until they are
        submitted, so concurrent requests still tokenizing cannot all slip past a nearly full queue.
        A request that alone exceeds `max_queue` is still admitted when the queue is below it: a
        retry could never succeed otherwise.
        """
        engine = self.require_engine()
        if engine.stats().num_waiting + self.pending_sequences >= self.config.max_queue:
            if self.metrics is not None:
                self.metrics.rejected_requests.labels(QUEUE_FULL_REASON).inc()
            raise QueueFull(QUEUE_FULL_RETRY_AFTER_S)
        context = current_request()
        if context is not None and context.server is self:
            context.reserve(num_sequences)


def server_state(request: Request) -> ServerState:
    """From the lifespan state; falls back to `app.state` for ASGI servers without lifespan state."""
    state = getattr(request.state, "server", None)
    return state if state is not None else request.app.state.server


def request_id_of(request: Request) -> str:
    """The id the request-id middleware assigned (the client's X-Request-Id, or a fresh one)."""
    return request.scope[REQUEST_ID_SCOPE_KEY]
