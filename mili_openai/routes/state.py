"""What route handlers reach: the engine, the config, the served model name, readiness.

One `ServerState` per app, created by `create_app` and handed to every request through the
lifespan's state (`request.state.server`); nothing lives in module globals. The lifespan fills in
the engine once it has loaded, so `/health` can answer 503 meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request

from mili_openai.config import ServerConfig
from mili_openai.routes.errors import APIError
from mili_openai.routes.request_records import RequestRecords

REQUEST_ID_SCOPE_KEY = "mili.request_id"  # where the request-id middleware leaves the id in the ASGI scope
DEFAULT_MODEL_NAME = "Qwen3-0.6B"  # what the embedded default model is called when no path is given


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

    def check_queue(self) -> None:
        """429 when more requests wait than `max_queue`: shed load instead of queueing forever."""
        engine = self.require_engine()
        if engine.stats().num_waiting >= self.config.max_queue:
            if self.metrics is not None:
                self.metrics.rejected_requests.labels("queue_full").inc()
            raise APIError(429, "too many requests are waiting; retry later", type="rate_limit_exceeded")


def server_state(request: Request) -> ServerState:
    """From the lifespan state; falls back to `app.state` for ASGI servers without lifespan state."""
    state = getattr(request.state, "server", None)
    return state if state is not None else request.app.state.server


def request_id_of(request: Request) -> str:
    """The id the request-id middleware assigned (the client's X-Request-Id, or a fresh one)."""
    return request.scope[REQUEST_ID_SCOPE_KEY]
